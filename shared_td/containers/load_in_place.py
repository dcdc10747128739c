"""What ``load_memmap_(prefix)`` does to the tree it loads into, once the save is loaded
(``loaded``) and checked: the tree keeps its own nested tensordicts, tensorclasses and
lazy-stack members wherever the save has one of the same kind and batch size there, and
each gets the saved entries, recursively, as tensordict 0.15.3 loads into the objects it
has. Before, they were replaced by the loaded ones: a nested tensordict or a member taken
before the load (``n = td["n"]``, a member of a stack, a stack holding the same members)
kept the old values, and writes through the loaded tree never reached it.

Entries not in the save are dropped (as tensordict); an entry of another kind or batch
size there takes the saved one, and so does anything that is locked on its own after the
tree was unlocked (a nested tensordict that another locked tree holds too: the load must
not change that tree).
"""
from __future__ import annotations

import os
from typing import Any, Iterator

import torch

from shared_td.containers.value_kinds import is_lazy_stack
from shared_td.errors import BatchSizeMismatchError
from shared_td.tensorclass_protocol import is_tensorclass, unwrap_tensorclass

__all__ = ["check_entries_fit", "give_device", "keep_one_value_devices", "load_into", "one_value_devices"]


def check_entries_fit(target: Any, source: Any, prefix: Any) -> None:
    """Refuse a load_memmap_ whose save does not fit ``target``'s batch size: a TensorDict
    whose saved entries do not start with it (a [3, 2] save into a [1, 6] tensordict:
    tensordict 0.15.3 loads them, and its tree then holds entries its batch size does
    not fit), a lazy stack saved with another batch size (a [2, 1] save into a [2, 3]
    stack took the save's batch size in silence; tensordict keeps [2, 3] over [1] leaves)."""
    if is_lazy_stack(target):
        if tuple(source.batch_size) != tuple(target.batch_size):
            raise BatchSizeMismatchError(
                f"Cannot load {os.fsdecode(prefix)!r} in place: it holds a lazy stack of batch size "
                f"{list(source.batch_size)}, this one's is {list(target.batch_size)}; nothing changed: "
                "load it with load_memmap() instead.")
        return
    batch_size = target.batch_size
    for key, value in source._tensordict.items():
        shape = value.shape if isinstance(value, torch.Tensor) else value.batch_size
        if tuple(shape[: len(batch_size)]) != tuple(batch_size):
            raise BatchSizeMismatchError(
                f"Cannot load {os.fsdecode(prefix)!r} in place: its entry {key!r} of shape "
                f"{list(shape)} does not fit this tensordict's batch size {list(batch_size)}; "
                "nothing changed: load it with load_memmap() instead.")


def load_into(target: Any, source: Any) -> None:
    """Make ``target``'s entries (a TensorDict's) or members (a lazy stack's) those of
    ``source``, loading into ``target``'s own nodes where they match (see the module)."""
    if is_lazy_stack(target):
        members = [_kept(old, new) for old, new in zip(target.tensordicts, source.tensordicts)] \
            if len(target.tensordicts) == len(source.tensordicts) else list(source.tensordicts)
        target.tensordicts = members
        target._stack_dim, target._member_batch = source._stack_dim, source._member_batch
        target._stack_dim_name = source._stack_dim_name
    else:
        own = target._tensordict
        target._tensordict = {key: _kept(own.get(key), value) for key, value in source._tensordict.items()}
    target._memmap_prefix = source._memmap_prefix


def _kept(old: Any, new: Any) -> Any:
    """``old`` loaded with ``new``'s entries, when it is a node of the same kind and batch
    size that nothing else keeps locked; else ``new``."""
    if old is None or type(old) is not type(new) or is_tensorclass(old) != is_tensorclass(new):
        return new
    inner_old, inner_new = unwrap_tensorclass(old), unwrap_tensorclass(new)
    if not hasattr(inner_old, "_tensordict") and not is_lazy_stack(inner_old):
        return new  # a tensor, a non-tensor value: the saved one
    if type(inner_old) is not type(inner_new) or inner_old.batch_size != inner_new.batch_size \
            or inner_old.is_locked or getattr(inner_old, "_is_non_tensor", False):
        return new
    if is_lazy_stack(inner_old) and inner_old.stack_dim != inner_new.stack_dim:
        return new
    load_into(inner_old, inner_new)
    inner_old._is_memmap, inner_old._is_shared = inner_new._is_memmap, inner_new._is_shared
    if not is_lazy_stack(inner_old):  # (a stack's device is its members')
        inner_old._device = inner_new._device
    return old


def give_device(node: Any, device: Any) -> None:
    """``device`` for ``node`` and every tensordict and non-tensor entry in it (a lazy
    stack: its members'). A load that does not memory-map the tree again keeps the tree's
    device, and the nodes it loaded (on the CPU, as load_memmap gives them) take it, as in
    tensordict 0.15.3: before, a tree without a device held nested tensordicts on the CPU."""
    for _, inner in _nodes(node):
        inner._device = device


def one_value_devices(node: Any) -> dict:
    """``{path: device}`` of every NonTensorData entry of ``node``, for
    :func:`keep_one_value_devices`."""
    return {path: inner._device for path, inner in _nodes(node) if _is_one_value(inner)}


def keep_one_value_devices(node: Any, devices: dict) -> None:
    """Give each NonTensorData entry of ``node`` at a path of ``devices`` the device it
    had there: a load that maps the tree again keeps such an entry's device, as
    tensordict 0.15.3, whose load updates the entry (a NonTensorStack is taken as loaded,
    on the CPU, in both)."""
    for path, inner in _nodes(node):
        if _is_one_value(inner) and path in devices:
            inner._device = devices[path]


def _is_one_value(node: Any) -> bool:
    return getattr(node, "_is_non_tensor", False) and node._one_value


def _nodes(node: Any, path: tuple = ()) -> Iterator[tuple[tuple, Any]]:
    """``(path, node)`` of ``node`` and of every tensordict and non-tensor entry in it; a
    lazy stack by its members (at their positions: a stack's device is its members'), a
    tensorclass by its tensordict."""
    node = unwrap_tensorclass(node)
    if is_lazy_stack(node):
        for index, member in enumerate(node.tensordicts):
            yield from _nodes(member, path + (index,))
        return
    yield path, node
    if not getattr(node, "_is_non_tensor", False):
        for key, value in node._tensordict.items():
            if not isinstance(value, torch.Tensor):
                yield from _nodes(value, path + (key,))
