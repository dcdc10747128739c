"""The work behind the classmethods ``stack``, ``cat``, ``maybe_dense_stack``,
``fromkeys``, ``from_list`` and ``from_dataclass`` of every tensordict class (see
extra_names.py), and the module functions of the same names that shared_td exports, as
tensordict 0.15.3 does. Nothing new is stacked or copied here: ``torch.stack``,
``torch.cat`` (functions.py), ``lazy_stack`` and ``TensorDict.from_dict`` do it.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch

from shared_td.containers.batch import insertion_dim
from shared_td.containers.value_kinds import is_tensor_collection
from shared_td.tensorclass_protocol import is_tensorclass, unwrap_tensorclass


def stack(items: Sequence[Any], dim: int = 0, *, out: Any = None) -> Any:
    """``torch.stack(items, dim, out=out)``: tensordicts of the same keys and shapes
    give a dense TensorDict; others raise a RuntimeError naming the key (tensors give a
    tensor).

    Example:
        >>> a = TensorDict(x=torch.zeros(3), batch_size=[3])
        >>> stack([a, a], 1).batch_size
        torch.Size([3, 2])
    """
    return torch.stack(list(items), dim, out=out)


def cat(items: Sequence[Any], dim: int = 0, *, out: Any = None) -> Any:
    """``torch.cat(items, dim, out=out)`` (tensordict 0.15.3's ``tensordict.cat``).

    Example:
        >>> a = TensorDict(x=torch.zeros(3), batch_size=[3])
        >>> cat([a, a]).batch_size
        torch.Size([6])
    """
    return torch.cat(list(items), dim, out=out)


def maybe_dense_stack(items: Sequence[Any], dim: int = 0, *, out: Any = None, strict: bool = False) -> Any:
    """Stack ``items`` densely (``torch.stack``) when they have the same batch size,
    keys and entry shapes, else lazily (``lazy_stack``), as tensordict 0.15.3; TensorDicts
    with the same keys whose nested tensordicts differ give a TensorDict holding lazy
    stacks of those only (tensordict's "best intention" stack).

    ``out``: a tensordict the result is written into (``strict=True``: it must have the
    items' keys, no more, or a RuntimeError). Tensors give ``torch.stack`` of them.

    Example:
        >>> a, b = TensorDict(x=torch.zeros(3)), TensorDict(x=torch.zeros(4))
        >>> type(maybe_dense_stack([a, a])).__name__, type(maybe_dense_stack([a, b])).__name__
        ('TensorDict', 'LazyStackedTensorDict')
    """
    from shared_td.containers.functions import stack as stack_collections
    from shared_td.containers.lazy import LazyStackedTensorDict

    items = list(items)
    if not items:
        raise RuntimeError("maybe_dense_stack needs at least one tensordict: items cannot be empty.")
    if all(isinstance(item, torch.Tensor) for item in items):
        return torch.stack(items, dim, out=out)
    if out is not None and strict:
        _check_out_keys(items[0], out)
    if out is None and _same_keys_here(items):
        return _dense_here(items, dim)
    if _same_layout(items):  # (shapes that differ give a lazy stack there too)
        return stack_collections(items, dim, out=out, lazy_if_shapes_differ=True)
    return LazyStackedTensorDict.lazy_stack(items, dim, out=out)


def _same_keys_here(items: list) -> bool:
    """Whether the items are TensorDicts of one batch size with the same keys at this
    level (their nested ones may differ)."""
    from shared_td.containers.tensordict import TensorDict

    first = items[0]
    return all(type(item) is TensorDict and item.batch_size == first.batch_size
               and set(item._keys_str()) == set(first._keys_str()) for item in items)


def _dense_here(items: list, dim: int) -> Any:
    """maybe_dense_stack of TensorDicts with the same keys at this level: a TensorDict
    here, each nested tensordict stacked by maybe_dense_stack in turn (lazily only where
    their keys or shapes differ), as tensordict 0.15.3's "best intention" stack; entries
    of different shapes at this level make the whole stack lazy, as there."""
    from shared_td.containers.functions import stack as stack_collections
    from shared_td.containers.lazy import LazyStackedTensorDict
    from shared_td.containers.tensordict import TensorDict

    first = items[0]
    # counted from the items' own batch (a nested one's is longer); out of range is an
    # error, as torch.stack's (it was wrapped into range once more before)
    dim = insertion_dim(dim, first.batch_dims, "maybe_dense_stack")
    nested = [key for key in first._keys_str()
              if all(type(item._get_str(key, None)) is TensorDict for item in items)]
    if not nested:
        return stack_collections(items, dim, lazy_if_shapes_differ=True)
    dense = stack_collections([item.exclude(*nested) for item in items], dim, lazy_if_shapes_differ=True)
    if isinstance(dense, LazyStackedTensorDict):
        return LazyStackedTensorDict.lazy_stack(items, dim)
    stacked = {key: maybe_dense_stack([item._get_str(key, None) for item in items], dim) for key in nested}
    entries = {key: stacked[key] if key in stacked else dense._get_str(key, None) for key in first._keys_str()}
    return TensorDict._new_unsafe(entries, dense.batch_size, dense.device, dense.names)


def _same_layout(items: list) -> bool:
    """Whether the items have one batch size and one set of (nested) keys."""
    first = unwrap_tensorclass(items[0])
    keys = set(first.keys(include_nested=True))
    return all(unwrap_tensorclass(item).batch_size == first.batch_size
               and set(unwrap_tensorclass(item).keys(include_nested=True)) == keys for item in items[1:])


def _check_out_keys(item: Any, out: Any) -> None:
    mine = set(unwrap_tensorclass(item).keys(include_nested=True, leaves_only=True))
    theirs = set(unwrap_tensorclass(out).keys(include_nested=True, leaves_only=True))
    if mine != theirs:
        raise RuntimeError(
            f"maybe_dense_stack(..., out=out, strict=True): out has keys {sorted(theirs - mine, key=str)} "
            f"that the items lack, and lacks {sorted(mine - theirs, key=str)}; with strict=True they "
            "must have the same keys (pass strict=False to leave out's other keys alone)."
        )


def fromkeys(keys: Sequence[Any], value: Any = 0) -> Any:
    """A TensorDict of batch size ``[]`` with ``value`` under every key, as
    ``dict.fromkeys`` (tensordict 0.15.3's ``tensordict.fromkeys``).

    Example:
        >>> td = fromkeys(["a", ("b", "c")], torch.zeros(3))
        >>> td["a"] is td["b", "c"]
        True
    """
    from shared_td.containers.tensordict import TensorDict

    return TensorDict(dict.fromkeys(keys, value), batch_size=[])


def make_tensordict(input_dict: dict | None = None, batch_size: Any = None, device: Any = None,
                    auto_batch_size: bool | None = None, **entries: Any) -> Any:
    """A TensorDict of the keyword ``entries`` and ``input_dict`` (whose entries win), as
    ``TensorDict.from_dict`` makes it (tensordict 0.15.3's ``make_tensordict``): batch
    size ``[]`` unless ``batch_size`` is given or ``auto_batch_size=True``.

    Example:
        >>> make_tensordict(a=torch.zeros(3, 4), b=torch.zeros(3)).batch_size
        torch.Size([])
        >>> make_tensordict({"a": torch.zeros(3)}, auto_batch_size=True).batch_size
        torch.Size([3])
    """
    from shared_td.containers.tensordict import TensorDict

    if input_dict is not None:
        entries.update(input_dict)
    return TensorDict.from_dict(entries, batch_size=batch_size, device=device, auto_batch_size=bool(auto_batch_size))


def from_list(items: Sequence[Any], *, auto_batch_size: bool | None = None, batch_size: Any = None,
              device: Any = None, batch_dims: int | None = None, names: Any = None,
              lazy: bool | None = None) -> Any:
    """``TensorDict.from_list``: each dict of ``items`` made a TensorDict by ``from_dict``
    (a tensordict or tensorclass is taken as it is), stacked along a new first dim:
    densely when they match and lazily when not (``lazy=None``), always lazily
    (``lazy=True``) or always densely (``lazy=False``: a RuntimeError when they differ).

    ``batch_size`` and ``names`` are the result's, list dim first (each dict gets the
    rest); ``auto_batch_size``/``batch_dims`` (the result's most batch dims, the list
    dim included) set each dict's batch size from its entries.

    Raises:
        ValueError: ``batch_size[0]`` is not the length of ``items``.

    Example:
        >>> td = from_list([{"a": torch.zeros(3)}, {"a": torch.ones(3)}], batch_size=[2, 3], names=["x", "y"])
        >>> td.batch_size, td.names
        (torch.Size([2, 3]), ['x', 'y'])
    """
    from shared_td.containers.lazy import LazyStackedTensorDict

    items = list(items)
    if batch_size is not None:
        batch_size = torch.Size([batch_size] if isinstance(batch_size, int) else batch_size)
        if not batch_size or batch_size[0] != len(items):
            raise ValueError(
                f"from_list: batch_size {list(batch_size)} does not start with the length of the "
                f"list ({len(items)}): the first dim of the result is the list's."
            )
    members = _from_dicts(items, auto_batch_size=auto_batch_size, batch_size=batch_size,
                          device=device, batch_dims=batch_dims, names=names)
    if lazy is None:
        out = maybe_dense_stack(members)
    elif lazy:
        out = LazyStackedTensorDict.lazy_stack(members)
    else:
        out = torch.stack(members)
    if names is not None and len(names) == out.batch_dims:  # (the stack leaves dim 0 unnamed)
        out.names = list(names)
    return out


def lazy_from_list(items: Sequence[Any], *, auto_batch_size: bool | None = None, batch_size: Any = None,
                   device: Any = None, batch_dims: int | None = None, names: Any = None) -> Any:
    """``LazyStackedTensorDict.from_list``: always a lazy stack along dim 0, whose
    members are the dicts made TensorDicts by ``from_dict`` with ``batch_size``,
    ``batch_dims`` and ``names[1:]`` (``names[0]`` names the stack dim), as in
    tensordict 0.15.3.

    Example:
        >>> lazy_from_list([{"a": torch.zeros(3)}, {"a": torch.zeros(3)}], batch_size=[3]).batch_size
        torch.Size([2, 3])
    """
    from shared_td.containers.lazy import LazyStackedTensorDict

    items = list(items)
    if batch_size is not None:  # (each member's: a leading dim for the stack, as below)
        batch_size = torch.Size([len(items)]) + torch.Size([batch_size] if isinstance(batch_size, int) else batch_size)
    members = _from_dicts(items, auto_batch_size=auto_batch_size, batch_size=batch_size,
                          device=device, batch_dims=batch_dims, names=names)
    stack_dim_name = None if names is None else names[0]
    return LazyStackedTensorDict.lazy_stack(members, 0, stack_dim_name=stack_dim_name)


def _from_dicts(items: list, *, auto_batch_size: bool | None, batch_size: torch.Size | None, device: Any,
                batch_dims: int | None, names: Any) -> list:
    """Each dict of ``items`` as a TensorDict of the result's sizes and names without
    their first (list) dim; tensor collections as they are."""
    from shared_td.containers.tensordict import TensorDict

    options = dict(
        batch_size=None if batch_size is None else batch_size[1:], device=device,
        names=None if names is None else list(names[1:]),
        auto_batch_size=bool(auto_batch_size), batch_dims=None if batch_dims is None else batch_dims - 1,
    )
    return [item if is_tensor_collection(item) else TensorDict.from_dict(item, **options) for item in items]


def tensordict_from_dataclass(obj: Any, *, auto_batch_size: bool = False, batch_dims: int | None = None,
                              device: Any = None, batch_size: Any = None) -> Any:
    """``TensorDict.from_dataclass``: a TensorDict with one entry per field of the
    dataclass instance ``obj`` (a nested dataclass or dict becomes a nested
    TensorDict, a number a tensor, a string a NonTensorData), as tensordict 0.15.3.

    Raises:
        TypeError: ``obj`` is not a dataclass instance (a dataclass type is converted
            only when every field has a default, as tensordict 0.15.3 does), or both
            ``auto_batch_size`` and ``batch_size`` are given.

    Example:
        >>> @dataclasses.dataclass
        ... class Step:
        ...     obs: torch.Tensor
        ...     reward: float
        >>> td = tensordict_from_dataclass(Step(torch.zeros(3, 4), 1.5))
        >>> td["reward"], td.batch_size
        (tensor(1.5000), torch.Size([]))
    """
    from shared_td.containers.tensordict import TensorDict

    if not dataclasses.is_dataclass(obj):
        raise TypeError(f"from_dataclass() needs a dataclass instance, got a {type(obj).__name__}.")
    fields = dataclasses.fields(obj)
    if isinstance(obj, type) and (is_tensorclass(obj) or not all(hasattr(obj, f.name) for f in fields)):
        raise TypeError(
            f"from_dataclass() got the dataclass type {obj.__name__}, whose fields cannot all be "
            "read from the class. Pass an instance, or as_tensorclass=True to convert the type."
        )
    if auto_batch_size and batch_size is not None:
        raise TypeError("from_dataclass(): give batch_size or auto_batch_size=True, not both.")
    source = {}
    for field in fields:
        value = getattr(obj, field.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type) and not is_tensorclass(value):
            value = tensordict_from_dataclass(value, device=device, batch_size=batch_size)
        elif isinstance(value, dict):
            value = TensorDict.from_dict(value, batch_size=batch_size, device=device)
        source[field.name] = value
    result = TensorDict(source, batch_size=batch_size, device=device)
    if auto_batch_size:
        result.auto_batch_size_(batch_dims)
    return result


def is_lazy_class(cls: type) -> bool:
    """True for LazyStackedTensorDict and its subclasses (whose ``from_list`` is
    always a lazy stack)."""
    from shared_td.containers.lazy import LazyStackedTensorDict

    return issubclass(cls, LazyStackedTensorDict)


def wrap_for(cls: type, result: Any) -> Any:
    """``result`` as the classmethod of ``cls`` gives it: a tensorclass wraps a
    TensorDict whose keys are all its fields (``Step.stack([...])`` is a ``Step``, as in
    tensordict); any other class gives ``result`` as it is."""
    if not is_tensorclass(cls) or is_tensorclass(result) or not hasattr(result, "_keys_str"):
        return result
    if getattr(result, "_is_non_tensor", False) or not set(result._keys_str()) <= cls._tc_field_names:
        return result
    return cls._from_tensordict(result)
