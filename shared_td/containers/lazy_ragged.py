"""A lazy stack's reads of entries whose tensors differ in shape across its members
(ragged): the stacking of the members' values that a read does (:func:`stacked`, which
marks a ragged entry with :class:`Ragged` instead of stacking it), and ``get``'s
``as_list``, ``as_padded_tensor`` and ``as_nested_tensor`` (:func:`members_values`).

This module does not import lazy.py (lazy.py imports it): the stack is passed in.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from shared_td.containers.lazy_writes import _is_branch, _is_lazy
from shared_td.containers.nontensor import stack_non_tensors
from shared_td.containers.value_kinds import is_leaf_nontensor, is_non_tensor
from shared_td.keys import RAISE, key_repr, unravel_key
from shared_td.tensorclass_protocol import is_tensorclass, unwrap_tensorclass

if TYPE_CHECKING:  # for the annotations only: lazy.py imports this module
    from shared_td.containers.lazy import LazyStackedTensorDict

__all__ = ["Ragged", "has_ragged_leaf", "members_values", "pad_stack", "stacked"]


class Ragged:
    """What ``_get_path`` finds under a key whose tensors differ in shape across members."""

    def __init__(self, path: tuple, values: list):
        self.path, self.values = path, values

    def error(self) -> RuntimeError:
        shapes = [getattr(v, "shape", "ragged") for v in self.values]
        return RuntimeError(
            f"Failed to stack tensors within a tensordict under the key {key_repr(self.path)}: "
            f"their shapes are {shapes}. To read them, pass as_padded_tensor=True, "
            "as_nested_tensor=True or as_list=True to get()."
        )


def stacked(lazy: "LazyStackedTensorDict", path: tuple, values: list) -> Any:
    """The members' ``values`` under ``path`` stacked along ``lazy``'s stack dim: a
    tensor, a non-tensor stack, a lazy stack of nested tensordicts (of tensorclasses of
    one class: that class), or a :class:`Ragged` where tensors differ in shape."""
    if any(isinstance(v, Ragged) for v in values):
        return Ragged(path, values)
    if all(isinstance(v, torch.Tensor) for v in values):
        if len({v.shape for v in values}) > 1:
            return Ragged(path, values)
        return torch.stack(values, lazy._stack_dim)
    if all(is_non_tensor(v) for v in values):
        return stack_non_tensors(values, lazy._stack_dim)
    if all(_is_branch(v) for v in values):
        if is_tensorclass(values[0]) and all(type(v) is type(values[0]) for v in values):
            # nested tensorclasses of one class stay that class, as in tensordict
            return type(values[0])._from_tensordict(lazy._restack([v._tensordict for v in values]))
        return lazy._restack(values)
    raise TypeError(
        f"Cannot stack the entry {key_repr(path)}: the members hold "
        f"{sorted({type(v).__name__ for v in values})}."
    )


def has_ragged_leaf(lazy: "LazyStackedTensorDict") -> bool:
    """True when the members' tensors under some key differ in shape, in this stack or
    in a lazy stack that a member holds (reading such a key through this stack raises
    the stacking error, not a Ragged mark)."""
    if any(_holds_ragged_stack(member) for member in lazy.tensordicts):
        return True
    return any(isinstance(lazy._get_path(unravel_key(key), None), Ragged)
               for key in lazy.keys(True, True, is_leaf_nontensor))


def _holds_ragged_stack(node: Any) -> bool:
    """True when ``node`` is, or holds at any depth, a lazy stack with a ragged leaf."""
    if _is_lazy(node):
        return has_ragged_leaf(node)
    node = unwrap_tensorclass(node)  # (a tensorclass member: its fields' tensordict)
    return any(_holds_ragged_stack(value) for _, value in node._items_str() if _is_branch(value))


def members_values(lazy: "LazyStackedTensorDict", path: tuple, as_list: bool, as_padded_tensor: bool,
                   as_nested_tensor: bool, padding_side: str, padding_value: Any, layout: Any) -> Any:
    """``lazy.get(path, ...)`` with ``as_list``, ``as_padded_tensor`` or
    ``as_nested_tensor`` (see ``LazyStackedTensorDict.get``), for an entry that every
    member has."""
    # a member that is a lazy stack itself, or whose path runs through one (a nested
    # key), gives its values the same way (a nested list, or its own padded tensor),
    # since they may be ragged too
    inner = {"as_list": as_list} if as_list else (
        {"as_padded_tensor": True, "padding_side": padding_side, "padding_value": padding_value}
        if as_padded_tensor else {})
    values = [m.get(path, **inner) if _is_lazy(m) else m.get(path, RAISE, **inner) for m in lazy.tensordicts]
    if as_list:
        return values
    if not all(isinstance(v, torch.Tensor) for v in values):
        raise TypeError(f"as_padded_tensor/as_nested_tensor need tensors under {key_repr(path)}.")
    if as_nested_tensor:
        return torch.nested.nested_tensor(values, layout=layout or torch.jagged)
    return pad_stack(values, padding_value, padding_side, path)


def pad_stack(values: list, padding_value: Any, side: str, path: tuple) -> torch.Tensor:
    """Pad ``values`` to their largest shape and stack them along dim 0."""
    if len({v.ndim for v in values}) > 1:
        raise ValueError(f"Cannot pad the tensors under {key_repr(path)}: their numbers of dims differ.")
    if side not in ("left", "right"):
        raise ValueError(f"padding_side must be 'left' or 'right', got {side!r}.")
    shape = [max(sizes) for sizes in zip(*[v.shape for v in values])]
    dtype = values[0].dtype
    if not (dtype.is_floating_point or dtype.is_complex or dtype is torch.bool):
        limits = torch.iinfo(dtype)  # (torch.full wraps -1 into 255 for uint8; pad_sequence refuses it)
        if not limits.min <= padding_value <= limits.max:
            raise RuntimeError(f"padding_value {padding_value!r} cannot be converted to {dtype} without overflow.")
    out = torch.full([len(values), *shape], padding_value, dtype=dtype, device=values[0].device)
    for i, value in enumerate(values):
        if side == "right":
            region = tuple(slice(0, n) for n in value.shape)
        else:
            region = tuple(slice(m - n, m) for n, m in zip(value.shape, shape))
        out[i][region] = value
    return out
