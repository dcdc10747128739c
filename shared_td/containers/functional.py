"""tensordict 0.15.3's ``tensordict.functional`` helpers that code imports from the
package (``from tensordict import merge_tensordicts``): ``merge_tensordicts``,
``dense_stack_tds``, and ``tensordict.utils``'s ``assert_allclose_td``; ``pad`` and
``pad_sequence`` are in functional_pad.py. Stacking is left to ``maybe_dense_stack``
(extra_constructors.py), so the results have the classes, nested structure and
non-tensor stacks it gives.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

import torch

from shared_td.containers.base import is_leaf_nontensor, is_non_tensor, is_tensor_collection
from shared_td.containers.value_kinds import is_lazy_stack, is_nested_node
from shared_td.errors import KeyThroughLeafError
from shared_td.keys import canonical_key
from shared_td.tensorclass_protocol import unwrap_tensorclass

__all__ = ["assert_allclose_td", "assert_close", "dense_stack_tds", "leaf_keys", "merge_tensordicts"]


def leaf_keys(td: Any) -> list:
    """The leaf keys (tensors and non-tensor entries) of ``td``, in its order."""
    return [canonical_key(k) for k in unwrap_tensorclass(td).keys(True, True, is_leaf=is_leaf_nontensor)]


# ------------------------------------------------------------------ merge_tensordicts
def merge_tensordicts(*tensordicts: Any, callback_exist: Callable | Mapping | None = None) -> Any:
    """A new tensordict holding every key of every input, with the batch size of the first.

    The values are not copied. A key held by several inputs takes the first input's value,
    unless ``callback_exist`` (a function, or a mapping of keys to functions) is given and
    every input holds it as a tensor: then ``callback(*values)`` is stored. Non-tensor
    entries always take the first value.

    Raises:
        RuntimeError: fewer than two tensordicts.
        KeyError: a key is a leaf in one input and a nested tensordict in another.

    Example:
        >>> td0 = TensorDict({"a": {"b0": 0}, "common": 0})
        >>> td1 = TensorDict({"a": {"b1": 1}, "f": 1, "common": 1})
        >>> td = merge_tensordicts(td0, td1)
        >>> sorted(td.keys(True, True), key=str), td["common"]
        ([('a', 'b0'), ('a', 'b1'), 'common', 'f'], tensor(0))
        >>> merge_tensordicts(td0, td1, callback_exist=lambda *v: torch.stack(v))["common"]
        tensor([0, 1])
    """
    if len(tensordicts) < 2:
        raise RuntimeError(f"merge_tensordicts needs at least 2 tensordicts, got {len(tensordicts)}.")
    for i, td in enumerate(tensordicts):
        if not is_tensor_collection(td):
            raise TypeError(f"merge_tensordicts: argument {i} is a {type(td).__name__}, not a tensordict.")
    callbacks = ({canonical_key(k): f for k, f in callback_exist.items()}
                 if isinstance(callback_exist, Mapping) else None)
    out = tensordicts[0].empty(recurse=True)
    done = set()
    for td in tensordicts:
        for key in leaf_keys(td):
            if key in done:
                continue
            done.add(key)
            values = [_get_leaf(other, key, i) for i, other in enumerate(tensordicts)]
            present = [value for value in values if value is not None]
            callback = callbacks.get(key) if callbacks is not None else callback_exist
            if callback is not None and len(present) == len(values) and not is_non_tensor(present[0]):
                value = callback(*values)
            else:
                value = present[0]
            try:
                out.set(key, value)
            except KeyThroughLeafError as error:
                raise KeyError(f"merge_tensordicts: the key {key!r} runs through a leaf of another "
                               "tensordict; rename one of them.") from error
    return out


def _get_leaf(td: Any, key: Any, index: int) -> Any:
    value = td.get(key, None)
    if is_nested_node(value):
        raise KeyError(f"merge_tensordicts: {key!r} is a nested tensordict in tensordict {index} but a "
                       "leaf in another; rename one of them.")
    return value


# ------------------------------------------------------------------ dense_stack_tds
def dense_stack_tds(td_list: Any, dim: int | None = None) -> Any:
    """Stack tensordicts, or the members of a lazy stack (along its ``stack_dim``), densely
    where they have the same keys and shapes (``maybe_dense_stack``): nested lazy stacks stay
    lazy, one dim lower. A TensorDict is returned as it is.

    Raises:
        ValueError: ``td_list`` is a list and ``dim`` is None.

    Example:
        >>> from shared_td import lazy_stack
        >>> lazy = lazy_stack([TensorDict(a=torch.zeros(3)), TensorDict(a=torch.ones(3))])
        >>> dense = dense_stack_tds(lazy)
        >>> type(dense).__name__, dense["a"].shape
        ('TensorDict', torch.Size([2, 3]))
    """
    from shared_td.containers.extra_constructors import maybe_dense_stack
    from shared_td.containers.tensordict import TensorDict

    if is_lazy_stack(td_list):
        return maybe_dense_stack(list(td_list.tensordicts), td_list.stack_dim)
    if isinstance(td_list, TensorDict):
        return td_list
    if dim is None:
        raise ValueError("dense_stack_tds(list, dim): give the dim to stack a list of tensordicts along.")
    return maybe_dense_stack(list(td_list), dim)


# ------------------------------------------------------------------ assert_allclose_td
def assert_allclose_td(actual: Any, expected: Any, rtol: float | None = None, atol: float | None = None,
                       equal_nan: bool = True, intersection: bool = False, msg: str = "",
                       prefix: Any = ()) -> bool:
    """Assert that two tensordicts (or tensorclasses, lazy stacks) have the same keys and
    close tensors (``torch.testing.assert_close``: dtypes, shapes and devices must match
    too); nested tensordicts are compared entry by entry, non-tensor entries are not
    compared (as in tensordict 0.15.3). Returns True.

    Raises:
        TypeError: an argument is not a tensordict or tensorclass.
        KeyError: the keys differ (``intersection=True`` compares the common keys only).
        AssertionError: two values are not close, or a key is a tensor in one and a nested
            tensordict in the other; the message names the key and the root mean square error.
        RuntimeError: two tensors whose shapes do not broadcast.

    Example:
        >>> a = TensorDict(x=torch.zeros(3))
        >>> assert_allclose_td(a, a.clone())
        True
        >>> assert_allclose_td(a, TensorDict(x=torch.ones(3)))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        AssertionError: key ('x',) does not match, got mse = 1.0000
        ...
    """
    if not is_tensor_collection(actual) or not is_tensor_collection(expected):
        raise TypeError(f"assert_allclose_td compares tensordicts, got a {type(actual).__name__} and a "
                        f"{type(expected).__name__}.")
    actual, expected = unwrap_tensorclass(actual), unwrap_tensorclass(expected)
    prefix = tuple(prefix) if isinstance(prefix, tuple) else (prefix,)
    options = dict(rtol=rtol, atol=atol, equal_nan=equal_nan, intersection=intersection, msg=msg)
    if (is_lazy_stack(actual) and is_lazy_stack(expected) and actual.stack_dim == expected.stack_dim
            and len(actual.tensordicts) == len(expected.tensordicts)):
        for mine, theirs in zip(actual.tensordicts, expected.tensordicts):
            assert_allclose_td(mine, theirs, prefix=prefix, **options)
        return True
    mine, theirs = set(actual.keys()), set(expected.keys())
    if mine != theirs and not intersection:
        raise KeyError(f"assert_allclose_td: keys differ at {prefix or 'the top'}: only the first has "
                       f"{sorted(mine - theirs)}, only the second has {sorted(theirs - mine)} "
                       "(pass intersection=True to compare the common keys).")
    for key in sorted(mine & theirs):
        one, two, where = actual.get(key), expected.get(key), prefix + (key,)
        if is_non_tensor(one) or is_non_tensor(two):
            continue
        if is_tensor_collection(one) != is_tensor_collection(two):
            raise AssertionError(f"key {where} is a tensor in one tensordict and a nested tensordict in the other.")
        if is_tensor_collection(one):
            assert_allclose_td(one, two, prefix=where, **options)
            continue
        one, two = one.detach().as_subclass(torch.Tensor), two.detach().as_subclass(torch.Tensor)
        try:
            mse = (one.to(torch.float) - two.to(torch.float)).pow(2).mean().sqrt().item()
        except RuntimeError as error:
            raise RuntimeError(f"assert_allclose_td: cannot compare key {where}: shapes {list(one.shape)} "
                               f"and {list(two.shape)}.") from error
        text = f"key {where} does not match, got mse = {mse:4.4f}" + (f",\t{msg}" if msg else "")
        torch.testing.assert_close(one, two, rtol=rtol, atol=atol, equal_nan=equal_nan,
                                   msg=lambda torch_msg, text=text: f"{text}\n{torch_msg}")
    return True


#: tensordict 0.15.3's other name of :func:`assert_allclose_td`
assert_close = assert_allclose_td
