"""The fast lane of ``td[index] = other``: a write of the same structure, leaf by leaf.

A replay buffer is written millions of times with tensordicts of one structure (a step,
a batch). The general write (``TensorDict._plan_index_writes``, index_writes.py)
checks every entry's kind, the lock and the shape, and plans one closure per leaf; here
the destination's leaves are found once, for the source's list of leaf paths, and kept in a
:class:`RowWritePlan` on the destination. A later write whose source has the same list
of paths checks only what can change between writes (that each planned leaf is still the
entry at its place, with the same shape, and that each source leaf broadcasts to its
indexed rows) and then writes leaf by leaf.

Correctness of the cache: the plan is never trusted, it is *checked* at each write, by
identity, against the destination as it is now (the leaves in the same pass as the
shapes of the source): every dict on the way to a leaf is
still its node's dict and still holds the same child, and every planned leaf is still
the same tensor object with the same shape. So any structural change, made by any code
path (set of a new key, del, rename, replacing a nested tensordict or a leaf, memmap_
swapping the leaves, resize_ of a leaf), makes the check fail and the plan is rebuilt.
Lock state does not matter: the fast lane writes existing tensors in place, which a
locked tensordict allows. Anything the fast lane does not cover (a new key, a
non-tensor, another container class, a shape that does not broadcast) goes to the
general write, which raises the same errors, naming the key and the shapes, before any
byte is written.
"""
from __future__ import annotations

from typing import Any

import torch

from shared_td.containers import batch as batch_ops
from shared_td.memmap_tensor import MemoryMappedTensor, refuse_read_only

# Tensor classes that override nothing of torch's: torch still looks up
# ``__torch_function__`` on a subclass (MemoryMappedTensor disables it) at every
# ``leaf.shape`` and ``leaf[index] = value``, ~0.5k instructions each, unless told not to
_NO_OVERRIDES = frozenset({torch.Tensor, MemoryMappedTensor})
_NO_SUBCLASS_DISPATCH = torch._C.DisableTorchFunctionSubclass


class RowWritePlan:
    """Where the leaves of a source with the leaf paths ``paths`` go in one destination."""

    __slots__ = ("paths", "root_entries", "nodes", "places", "leaves", "shapes", "expected", "expected_for",
                 "no_overrides")

    def __init__(self, paths: list, root_entries: dict, nodes: list, places: list, leaves: list):
        self.paths = paths  # the source's leaf paths, in its iteration order
        self.root_entries = root_entries  # the destination's own dict
        self.nodes = nodes  # (parent dict, key, nested tensordict, its dict) on the way
        self.places = places  # (dict, key) holding each leaf
        self.leaves = leaves  # the destination's tensors, one per path
        self.shapes = [leaf.shape for leaf in leaves]
        # the leaves are of classes whose torch behaviour is torch's own (see write_rows)
        self.no_overrides = {type(leaf) for leaf in leaves} <= _NO_OVERRIDES
        self.expected: list = []  # the indexed shape of each leaf ...
        self.expected_for: Any = None  # ... for this (indexed batch size, batch dims)

    def holds_nodes(self, dest: Any) -> bool:
        """True if ``dest`` still has the nodes the plan was made on (its leaves are
        checked by ``write_rows``, in its one pass over them)."""
        if dest._tensordict is not self.root_entries:
            return False
        for parent, key, node, entries in self.nodes:
            if parent.get(key) is not node or node._tensordict is not entries:
                return False
        return True

    def expected_shapes(self, target_batch: torch.Size, batch_dims: int) -> list:
        """The shape of ``leaf[index]`` for each leaf, for an index that leaves the
        batch dims as ``target_batch`` (the feature dims follow)."""
        if self.expected_for != (target_batch, batch_dims):
            self.expected = [target_batch + shape[batch_dims:] for shape in self.shapes]
            self.expected_for = (target_batch, batch_dims)
        return self.expected


def source_leaves(source: Any, kind: type, prefix: tuple, paths: list, leaves: list) -> bool:
    """Append the leaf paths and tensors of ``source`` (a ``kind`` tensordict); False
    if it holds anything but tensors and non-empty nested ``kind`` tensordicts (an
    empty one would add a key to the destination: the general write's business)."""
    for key, value in source._tensordict.items():
        if isinstance(value, torch.Tensor):
            paths.append(prefix + (key,))
            leaves.append(value)
        elif type(value) is not kind or not value._tensordict:
            return False
        elif not source_leaves(value, kind, prefix + (key,), paths, leaves):
            return False
    return True


def make_plan(dest: Any, paths: list) -> RowWritePlan | None:
    """The plan of ``dest`` for a source with leaf ``paths``; None when a path does not
    lead, through tensordicts of ``dest``'s class, to an existing tensor."""
    kind = type(dest)
    nodes, places, leaves, seen = [], [], [], set()
    for path in paths:
        node = dest
        for part in path[:-1]:
            child = node._tensordict.get(part)
            if type(child) is not kind:
                return None
            if id(child) not in seen:
                seen.add(id(child))
                nodes.append((node._tensordict, part, child, child._tensordict))
            node = child
        leaf = node._tensordict.get(path[-1])
        if not isinstance(leaf, torch.Tensor):
            return None
        places.append((node._tensordict, path[-1]))
        leaves.append(leaf)
    # checked once per plan, not per write: a refused leaf fails before any is written
    refuse_read_only(leaves, "td[index] = value")
    return RowWritePlan(paths, dest._tensordict, nodes, places, leaves)


def write_rows(dest: Any, index: tuple, target_batch: torch.Size, source: Any) -> bool:
    """``dest[index] = source`` leaf by leaf if the fast lane covers it; False (nothing
    written) otherwise, for the general write to do it or to raise.

    ``index`` is normalized and ``target_batch`` is the batch size it gives
    (``batch_ops.index_and_size``); ``source`` is a tensordict of ``dest``'s class.
    """
    paths: list = []
    sources: list = []
    if not source_leaves(source, type(dest), (), paths, sources):
        return False
    plan = dest._row_write_plan
    if plan is None or plan.paths != paths or not plan.holds_nodes(dest):
        plan = _new_plan(dest, paths)
        if plan is None:
            return False
    written = _write(plan, dest, index, target_batch, sources)
    if written is None:  # a planned leaf is no longer there or changed shape: plan again
        plan = _new_plan(dest, paths)
        if plan is None:
            return False
        written = _write(plan, dest, index, target_batch, sources)
    return bool(written)  # False: the general write raises, naming the key and the shapes


def _write(plan: RowWritePlan, dest: Any, index: tuple, target_batch: torch.Size, sources: list) -> bool | None:
    """Check the sources and the plan (``_fits``), then write leaf by leaf; None for a
    stale plan, False for a source that does not fit, with nothing written."""
    if plan.no_overrides and set(map(type, sources)) <= _NO_OVERRIDES:
        # no tensor here overrides torch: the same checks and writes without torch's
        # lookup of __torch_function__ on each (a tensor subclass is left to its own)
        with _NO_SUBCLASS_DISPATCH():
            return _fit_and_write(plan, dest, index, target_batch, sources)
    return _fit_and_write(plan, dest, index, target_batch, sources)


def _fit_and_write(plan: RowWritePlan, dest: Any, index: tuple, target_batch: torch.Size,
                   sources: list) -> bool | None:
    fits = _fits(plan, dest, target_batch, sources)
    if not fits:
        return fits
    for leaf, value in zip(plan.leaves, sources):
        leaf[index] = value
    return True


def _new_plan(dest: Any, paths: list) -> RowWritePlan | None:
    plan = make_plan(dest, paths)
    if plan is not None:
        dest._row_write_plan = plan
    return plan


def _fits(plan: RowWritePlan, dest: Any, target_batch: torch.Size, sources: list) -> bool | None:
    """In one pass over the planned leaves: None if one is no longer the entry at its
    place or changed shape (``resize_``), else whether each source leaf broadcasts to
    its leaf's indexed rows."""
    expected = plan.expected_shapes(target_batch, len(dest._batch_size))
    fits = True
    for (entries, key), leaf, shape, value, want in zip(plan.places, plan.leaves, plan.shapes, sources, expected):
        if entries.get(key) is not leaf or leaf.shape != shape:
            return None
        have = value.shape
        if have != want and not batch_ops.broadcasts_to(have, want):
            fits = False  # the other leaves are still checked: a stale plan comes first
    return fits
