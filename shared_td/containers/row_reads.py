"""The fast lane of ``td[i]`` on a locked tensordict: a replay buffer's row read.

A replay buffer is read row by row millions of times, and its structure does not change
between reads. ``TensorDict._index_rows`` decides, entry by entry, what each entry is
and how to index it; here that is decided once per node and kept in a
:class:`RowReadPlan` on the node: its memory-mapped leaves with their attributes, its
plain tensors, its nested tensordicts, the other entries, and the attributes every view
of it gets. A read over the plan indexes the memory-mapped leaves in one batch
(``basic_views``: no ``__torch_function__`` lookup per leaf) and builds each node from
its template without re-checking keys and batch sizes.

Correctness of the cache, as for the write plan (``row_writes``): the plan is never
trusted, it is *checked* at each read, by identity, against the node as it is now: the
same dict, holding the same key objects and the same entry objects in the same order.
Any change made by any code path (set of a new key, del, rename, replacing a leaf, a
nested tensordict or a non-tensor, memmap_ swapping the leaves, unlock and relock) makes
the check fail and the plan is rebuilt. A leaf changed in place (``set_``, ``resize_``)
is indexed as it is now. The plan is only used while the node is locked, a view of a
view keeps the lock and memmap flags (as ``_index_rows`` does), and anything a plan does
not cover (another container class, a tensor subclass) is indexed as ``_index_rows``
indexes it.
"""
from __future__ import annotations

import weakref
from typing import Any

import torch

from shared_td.containers import batch as batch_ops
from shared_td.containers.locking import LockingOps
from shared_td.memmap_tensor import MemoryMappedTensor
from shared_td.memmap_tensor.tensor import basic_views
from shared_td.tensorclass_protocol import unwrap_tensorclass


class RowReadPlan:
    """How to take a basic-index view of one locked TensorDict node."""

    __slots__ = ("entries", "keys", "ids", "values", "mapped", "plain", "nested", "others")

    def __init__(self, node: Any):
        kind = type(node)
        self.entries = node._tensordict
        self.keys = tuple(self.entries)
        self.values = tuple(self.entries.values())  # kept alive: their ids stay theirs
        self.ids = tuple(map(id, self.values))
        self.mapped: list = []  # (key, leaf, backing, parent shape): see basic_views
        self.plain: list = []  # (key, plain tensor)
        self.nested: list = []  # (key, nested node of the same class)
        self.others: list = []  # (key, entry): non-tensors, other classes, subclasses
        for key, value in self.entries.items():
            value_kind = type(value)
            if value_kind is MemoryMappedTensor:
                self.mapped.append((key, value, value._backing, value._parent_shape))
            elif value_kind is torch.Tensor:
                self.plain.append((key, value))
            elif value_kind is kind:
                self.nested.append((key, value))
            else:
                self.others.append((key, value))

    def holds_for(self, node: Any) -> bool:
        """True if ``node`` still has the entries the plan was made on."""
        entries = node._tensordict
        return (entries is self.entries and tuple(map(id, entries.values())) == self.ids
                and tuple(entries) == self.keys)


def read_rows(node: Any, index: tuple, new_size: torch.Size) -> Any:
    """``node[index]`` for a locked ``node`` (a TensorDict) and a normalized basic
    ``index`` that gives batch size ``new_size``: the view ``_index_rows`` builds, over
    the node's plan (made or remade here), with every node locked and linked to its
    parent view."""
    return _read(node, index, index[0] if len(index) == 1 else index, new_size)


def _read(node: Any, index: tuple, leaf_index: Any, new_size: torch.Size) -> Any:
    # ``leaf_index``: how a leaf is indexed (torch takes an int faster than (int,))
    plan = node._row_read_plan
    if plan is None or not plan.holds_for(node):
        plan = node._row_read_plan = RowReadPlan(node)
    entries = dict.fromkeys(plan.keys)  # the node's order of keys, filled below
    if plan.mapped:
        basic_views(plan.mapped, leaf_index, entries)
    for key, value in plan.plain:
        entries[key] = value[leaf_index]
    collections = []  # the entries the view links to itself (see _lock_view)
    if plan.nested:
        depth = len(node._batch_size)
        for key, child in plan.nested:
            # a nested node's batch dims usually end where ours do: no Size to build
            size = new_size if len(child._batch_size) == depth else new_size + child._batch_size[depth:]
            entries[key] = view = (_read(child, index, leaf_index, size) if child._is_locked
                                   else child._index_rows(index, size, True))
            collections.append(view)
    for key, value in plan.others:
        entries[key] = view = value[index]
        if not isinstance(view, torch.Tensor):
            collections.append(view)
    # TensorDict._new_unsafe's attributes, in its order (the instances share one table
    # of attribute names), with a locked view's flags: read from the node now, as
    # share_memory_ or memmap_ may change them in place
    out = _NEW(type(node))
    out._tensordict = entries
    out._batch_size = new_size
    out._device = node._device
    out._names = None if node._names is None else _view_names(node._names, index)
    out._is_locked = True
    out._is_shared = node._is_shared
    out._is_memmap = node._is_memmap
    out._memmap_prefix = node._memmap_prefix
    out._lock_parents = {}
    out._context_ops = []
    out._last_op = "lock_"
    if collections:
        lock_view_links(out, collections)
    return out


_NEW = object.__new__


def _view_names(names: list, index: tuple) -> list | None:
    """The names of a view's dims (None when all are unnamed, as ``_new_unsafe``)."""
    names = batch_ops.indexed_names(names, index)
    return None if names is None or all(name is None for name in names) else names


def lock_view_links(view: Any, collections: list) -> None:
    """Link each of ``collections``, the collection entries of ``view`` (a locked view
    just built from a locked tensordict), to ``view``: the nested views built by the
    same read are locked already and only get their link; any other collection is
    locked by lock_()."""
    link = weakref.ref(view)
    for value in collections:
        if type(value) is type(view) and value._is_locked:
            value._lock_parents[id(view)] = link
            continue
        child = unwrap_tensorclass(value)
        if isinstance(child, LockingOps):  # what lock_() reaches
            child._lock_parents[id(view)] = link
            child.lock_()
