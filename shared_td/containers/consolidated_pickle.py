"""The pickle of a consolidated tree: its one buffer once, plus a small skeleton.

A consolidated tensordict over a plain buffer pickles as the buffer (one
``PickleBuffer`` with protocol 5, so a pipe or a file gets it without a copy) and the
pickle of the tree in which every leaf that is a view of the buffer is only its
``(dtype, shape, byte offset)``. A leaf no longer in the buffer (an entry replaced
after ``unlock_()``) pickles as itself. Loading makes the payload the new tree's buffer
and every leaf a view of it: one allocation, no per-leaf storage.
"""
from __future__ import annotations

import copyreg
import io
import math
import pickle
from typing import Any

import torch

_BYTE = torch.uint8


class Layout:
    """The one storage of a consolidated tree: ``buffer`` (1-d uint8, its length a
    multiple of 64). Every node of the tree carries it, so a sub-tree pickles with the
    buffer once, not once per leaf.

    It also keeps the views it was made with (``record``) and their ``(dtype, shape,
    byte offset)``, so that pickling knows a leaf without asking torch (five calls per
    leaf); held here, a view's ``id`` names no other live object.
    """

    __slots__ = ("buffer", "views", "entries", "positions")

    def __init__(self, buffer: torch.Tensor):
        self.buffer = buffer
        self.views: list[torch.Tensor] = []
        self.entries: list[tuple] = []
        self.positions: dict[int, int] = {}

    def record(self, views: list[torch.Tensor], entries: list[tuple]) -> None:
        """``views`` of the buffer and their ``(dtype, shape tuple, byte offset)``."""
        self.views, self.entries = views, entries
        self.positions = {id(view): position for position, view in enumerate(views)}


def c_strides(shape: Any) -> list[int]:
    """The strides of a contiguous tensor of ``shape``."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return strides[::-1]


def views_in_runs(buffer: torch.Tensor, entries: list[tuple]) -> list[torch.Tensor]:
    """The views of ``buffer`` (1-d uint8, its length a multiple of 64) that ``entries``
    describe, in order: each ``(dtype, shape, byte offset)`` a contiguous tensor. Each run
    of entries of one dtype and shape lying back to back is one ``unbind`` (one C++ call
    for the run instead of one ``as_strided`` per leaf)."""
    typed: dict[torch.dtype, torch.Tensor] = {}
    views: list[torch.Tensor] = []
    start, count = 0, len(entries)
    while start < count:
        dtype, shape, offset = entries[start]
        whole = typed.get(dtype)
        if whole is None:
            # (a buffer read from a file may end inside an element: view whole ones)
            whole = typed[dtype] = buffer[:buffer.numel() - buffer.numel() % dtype.itemsize].view(dtype)
        itemsize, numel = dtype.itemsize, math.prod(shape)
        end, after = start + 1, offset + numel * itemsize
        while numel and end < count and entries[end][2] == after and entries[end][0] is dtype \
                and entries[end][1] == shape:
            end, after = end + 1, after + numel * itemsize
        if end - start > 1:
            first = offset // itemsize
            views.extend(whole[first:first + numel * (end - start)].view(end - start, *shape).unbind(0))
        else:
            views.append(whole.as_strided(shape, c_strides(shape), offset // itemsize))
        start = end
    return views


def reduce_tree(obj: Any, root: Any, layout: Layout, protocol: int, node_class: type) -> tuple:
    """``obj.__reduce_ex__(protocol)`` for a consolidated ``obj`` over a plain buffer;
    ``root`` is the node that carries the layout (a tensorclass's tensordict);
    ``node_class`` the class of the tree's nodes (TensorDictBase's consolidate mixin)."""
    tree = io.BytesIO()
    pickler = _TreePickler(tree, protocol, layout, root if root.is_locked else None, node_class)
    pickler.dump(obj)
    data = layout.buffer.numpy()
    payload = pickle.PickleBuffer(data) if protocol >= 5 else data.tobytes()
    return _unpickle_consolidated, (payload, pickler.leaves, tree.getvalue())


class _TreePickler(pickle.Pickler):
    """Pickles a consolidated tree with its buffer's views as ``_leaf(index)`` (their
    ``(dtype, shape, byte offset)`` listed in ``leaves``, pickled beside the tree) and its
    layout as ``_layout()``: names that _TreeUnpickler resolves to its own views and
    buffer. (``reducer_override``, unlike ``persistent_id``, is not called for the many
    str/int/tuple/dict objects of a tree.)"""

    def __init__(self, file: Any, protocol: int, layout: Layout, locked_root: Any, node_class: type):
        super().__init__(file, protocol)
        self.layout = layout
        self.node_class = node_class
        self.leaves: list[tuple] = []
        self.positions = layout.positions
        self.base = layout.buffer.data_ptr()
        self.nbytes = layout.buffer.numel()
        self.locked_root = locked_root

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            position = self.positions.get(id(obj))
            if position is not None and self.layout.views[position] is obj:  # as it was made
                self.leaves.append(self.layout.entries[position])
                return _leaf, (len(self.leaves) - 1,)
            # within the buffer's bytes (whose addresses are its own): a view of it
            offset = obj.data_ptr() - self.base
            if 0 <= offset < self.nbytes and obj.is_contiguous() and not (obj.is_conj() or obj.is_neg()):
                pass  # (a conjugate or negative view's flag is not in the bytes)
            elif obj.numel() == 0:
                offset = 0
            else:
                return NotImplemented  # no longer a view of the buffer: pickled as itself
            self.leaves.append((obj.dtype, tuple(obj.shape), offset))
            return _leaf, (len(self.leaves) - 1,)
        elif isinstance(obj, self.node_class) and obj.__dict__.get("_consolidated") is self.layout:
            # a node of this tree: its state, as object.__reduce_ex__ gives it (not
            # through its own __reduce_ex__, which would start another tree pickle)
            state = obj.__getstate__()
            if self.locked_root is not None and obj is not self.locked_root:
                # the root's lock_() on loading locks its whole tree once (as here);
                # each node locking its own sub-tree as well cost O(nodes x depth)
                state["_is_locked"] = False
            return copyreg.__newobj__, (type(obj),), state
        elif obj is self.layout:
            return _layout, ()
        return NotImplemented


def _leaf(index: int) -> torch.Tensor:
    raise pickle.UnpicklingError("a consolidated leaf can only be read by _TreeUnpickler")


def _layout() -> Layout:
    raise pickle.UnpicklingError("a consolidated layout can only be read by _TreeUnpickler")


class _TreeUnpickler(pickle.Unpickler):
    """Reads what _TreePickler wrote: the leaves become views of ``buffer``, made
    before the tree is read (``leaves``: their dtypes, shapes and offsets, in order)."""

    def __init__(self, file: Any, buffer: torch.Tensor, leaves: list[tuple]):
        super().__init__(file)
        self.layout = Layout(buffer)
        self.views = views_in_runs(buffer, leaves)
        self.layout.record(self.views, leaves)

    def find_class(self, module: str, name: str) -> Any:
        if module == __name__ and name == "_leaf":
            return self.views.__getitem__
        if module == __name__ and name == "_layout":
            return lambda: self.layout
        return super().find_class(module, name)


def _unpickle_consolidated(payload: Any, leaves: list[tuple], tree: bytes) -> Any:
    """Rebuild a pickled consolidated tensordict: the payload becomes its one buffer."""
    data = payload if isinstance(payload, bytearray) else bytearray(payload)
    buffer = torch.frombuffer(data, dtype=_BYTE) if data else torch.empty(0, dtype=_BYTE)  # len: 64 * n
    return _TreeUnpickler(io.BytesIO(tree), buffer, leaves).load()
