"""The skeleton of a consolidated tree's pickle: one walk of the tree that describes it
as plain tuples (consolidated_pickle.py says what the tuples are and how they load).

Its leaves are the layout's views in the order consolidate() made them, as long as they
can be (then they are one slice of the layout's runs: no entry listed per leaf); a node
or a leaf met twice stops the walk (``LookupError(ALIASED)``), and the tree is then
pickled as itself, so that it comes back as one object.

Example (where ``place`` finds a leaf in the buffer):
    >>> import torch
    >>> from shared_td import TensorDict
    >>> td = TensorDict(a=torch.zeros(2), b=torch.ones(3)).consolidate()
    >>> place(td._consolidated, td["b"])[1:]  # (dtype, shape, byte offset)
    ((3,), 8)
"""
from __future__ import annotations

from typing import Any

import torch

from shared_td.containers.consolidated_layout import Layout, runs_of

_Tensor = torch.Tensor
# The attributes of a tensordict node that its skeleton rebuilds (the others are caches
# of this process or what pickling resets); a node with any other is pickled as itself.
_NODE_ATTRIBUTES = frozenset({
    "_tensordict", "_batch_size", "_device", "_names", "_is_locked", "_is_shared",
    "_is_memmap", "_memmap_prefix", "_lock_parents", "_context_ops", "_consolidated",
    "_last_op", "_row_write_plan"})
_NODE, _TENSORCLASS = "node", "tensorclass"
_PICKLING = ("__reduce_ex__", "__reduce__", "__getstate__", "__setstate__")


# A node or leaf met twice: the tree is then pickled as itself (the memo keeps it one
# object). Said by a LookupError whose only argument is this marker (an exception, since
# the pickler's callback must stop the dump; no class of its own: every exception class
# of the package is a public one of errors.py), caught in consolidated_pickle.py only.
ALIASED = object()


def is_aliased(error: LookupError) -> bool:
    return error.args == (ALIASED,)


class _SkeletonKinds:
    """Which classes a skeleton describes: the subclasses of ``tensordict`` (TensorDict)
    and the tensorclasses that pickle exactly as it and as ``tensorclass`` (the members
    every tensorclass gets) do, learnt once per class."""

    def __init__(self) -> None:
        self.known: dict[type, str | None] = {}

    def of(self, cls: type, tensordict: type, tensorclass: type) -> str | None:
        kind = self.known.get(cls, False)
        if kind is False:
            kind = None
            for name, reference, member in ((_NODE, tensordict, issubclass(cls, tensordict)),
                                            (_TENSORCLASS, tensorclass, getattr(cls, "_is_tensorclass", False))):
                if member and all(
                        getattr(cls, method) is getattr(reference, method) for method in _PICKLING):
                    kind = name
            self.known[cls] = kind
        return kind


KINDS = _SkeletonKinds()


class Skeleton:
    """Walks a consolidated tree once and describes it (see the module's opening). The
    leaves it meets are the layout's views one after another (the order consolidate()
    made them in) as long as they can be: then they are a slice of the layout's runs;
    otherwise (entries replaced after ``unlock_()``) each one's entry is listed."""

    def __init__(self, layout: Layout, tensordict: type, tensorclass: type):
        self.layout, self.tensordict, self.tensorclass = layout, tensordict, tensorclass
        self.views = layout.views
        self.start: int | None = None  # the position of the first leaf in layout.views
        self.cursor = len(self.views)  # where the next leaf is expected (none: past the end)
        self.listed: list[tuple] | None = None  # the entries, once not in order
        self.seen_nodes: set[int] = set()
        self.seen_leaves: set[int] = set()
        self.value_ids: set[int] = set()  # the values ([value] items), loaded after the tree

    def runs(self) -> tuple[list[tuple], int]:
        """The runs of the leaves met, and their number."""
        if self.listed is not None:
            return runs_of(self.listed), len(self.listed)
        if self.start is None:
            return [], 0
        if self.start == 0 and self.cursor == len(self.views):
            return self.layout.runs, self.cursor
        return runs_of(self.layout.entries[self.start:self.cursor]), self.cursor - self.start

    def record(self, node: Any) -> tuple | None:
        """The skeleton of ``node``, or None where it is not one of this tree's nodes of
        a class the skeleton describes (then it is pickled as itself)."""
        cls = type(node)
        kind = KINDS.known.get(cls, False)
        if kind is False:
            kind = KINDS.of(cls, self.tensordict, self.tensorclass)
        if kind is _TENSORCLASS:
            state = node.__dict__
            inner = self.record(state["_tensordict"]) if len(state) == 1 else None
            return None if inner is None else (cls, inner)
        state = node.__dict__
        if kind is not _NODE or state.get("_consolidated") is not self.layout or state["_is_shared"] \
                or state["_is_memmap"] or state["_memmap_prefix"] is not None or not state.keys() <= _NODE_ATTRIBUTES:
            return None
        if id(node) in self.seen_nodes:
            raise LookupError(ALIASED)
        self.seen_nodes.add(id(node))
        views, count = self.views, len(self.views)
        cursor, items = self.cursor, None
        entries = state["_tensordict"]
        for index, value in enumerate(entries.values()):
            if cursor < count and views[cursor] is value:  # the next view: most leaves
                cursor += 1
                item = None
            else:
                self.cursor = cursor
                if isinstance(value, _Tensor):
                    item = self._leaf(value)
                else:
                    item = self.record(value)
                    if item is None:  # a value
                        self.value_ids.add(id(value))
                        item = [value]
                cursor = self.cursor
            if item is not None and items is None:
                items = [None] * index
            if items is not None:
                items.append(item)
        self.cursor = cursor
        return (cls, tuple(state["_batch_size"]), state["_device"], state["_names"], state["_is_locked"],
                tuple(entries), items)

    def _leaf(self, value: torch.Tensor) -> list | None:
        """The item of a tensor that is not the next view in order: None for a leaf of
        the buffer (listed), or ``[value]``."""
        if self.start is None and self.listed is None:  # the first leaf: where the order starts
            position = self.layout.positions.get(id(value))
            if position is not None and self.views[position] is value:
                self.start, self.cursor = position, position + 1
                return None
        if self.listed is None:  # out of order from here: list every leaf
            first = self.start or 0
            self.listed = list(self.layout.entries[first:self.cursor]) if self.start is not None else []
            self.seen_leaves = {id(view) for view in self.views[first:self.cursor]} if self.start is not None else set()
            self.cursor = len(self.views)
        if id(value) in self.seen_leaves:
            raise LookupError(ALIASED)
        entry = place(self.layout, value)
        if entry is None:
            self.value_ids.add(id(value))
            return [value]  # no longer a view of the buffer: a value, pickled as itself
        self.seen_leaves.add(id(value))
        self.listed.append(entry)
        return None


def place(layout: Layout, tensor: torch.Tensor) -> tuple | None:
    """``(dtype, shape, byte offset)`` of ``tensor`` in the layout's buffer, or None if
    it is not a contiguous view of it (a conjugate or negative view's flag is not in the
    bytes). An empty tensor holds no bytes: offset 0."""
    position = layout.positions.get(id(tensor))
    if position is not None and layout.views[position] is tensor:  # as it was made
        return layout.entries[position]
    offset = tensor.data_ptr() - layout.buffer.data_ptr()  # (addresses are the buffer's own)
    if 0 <= offset < layout.buffer.numel() and tensor.is_contiguous() and not (tensor.is_conj() or tensor.is_neg()):
        return tensor.dtype, tuple(tensor.shape), offset
    if tensor.numel() == 0:
        return tensor.dtype, tuple(tensor.shape), 0
    return None
