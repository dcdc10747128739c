"""consolidate(): every leaf of a tree in one contiguous storage, the leaves views into it.

The bytes are laid out as an anonymous ``memmap_()`` lays out its one segment
(``persist.writer.packed_layout``): small leaves back to back, copied by one
``torch.cat``; big ones at 64-byte boundaries. Three places hold the buffer:

* a plain CPU byte tensor (default);
* ``share_memory=True``: one anonymous shared-memory segment, written by the engine's own
  anonymous writer, so the result is exactly what ``memmap()`` without a prefix gives;
  its leaves pickle by reference (the segment), never by value;
* ``filename=``: one file, mapped shared; its leaves pickle by reference (the path).

Every node of a consolidated tree remembers the buffer. A plain one pickles as ONE buffer
plus the pickle of the tree in which each leaf is only ``(dtype, shape, byte offset)``, instead of one whole storage per leaf (what torch pickles for a
view); a sub-tree pickles the same way. Whether it still is consolidated is checked, not
assumed: after ``unlock_()`` an entry may have been replaced; such a leaf pickles as
itself (with the standard pickler, also under a ForkingPickler).
"""
from __future__ import annotations

import copyreg
import io
import os
import pickle
from typing import Any

import torch

from shared_td.memmap_tensor import MemoryMappedTensor
from shared_td.persist import nodes, writer
from shared_td.storage import files
from shared_td.storage.anonymous import align

_BYTE = torch.uint8


class _Layout:
    """The one storage of a consolidated tree: ``buffer`` (1-d uint8). Every node of the
    tree carries it, so a sub-tree pickles with the buffer once, not once per leaf."""

    __slots__ = ("buffer",)

    def __init__(self, buffer: torch.Tensor):
        self.buffer = buffer


def _inner(obj: Any) -> Any:
    """The object that carries the layout: a tensorclass instance's tensordict, else obj."""
    return obj._tensordict if getattr(type(obj), "_is_tensorclass", False) else obj


def _sources(obj: Any) -> list[torch.Tensor]:
    """The tensor leaves of ``obj``'s tree in the order ``apply`` visits them (entries in
    order, nested collections where they stand, lazy-stack members one after another)."""
    leaves: list[torch.Tensor] = []

    def walk(node: Any) -> None:
        kind = nodes.kind_for_object(node)
        for _, value in kind.entries(node):
            if isinstance(value, torch.Tensor):
                leaves.append(value)
            elif not getattr(type(value), "_is_non_tensor", False):
                walk(value)
        for _, child in kind.children(node):
            walk(child)

    if not getattr(type(obj), "_is_non_tensor", False):
        walk(obj)
    return leaves


def _byte_views(buffer: torch.Tensor, sources: list[torch.Tensor], offsets: list[int]) -> list[torch.Tensor]:
    """Each source's place in ``buffer`` (a plain uint8 tensor whose length is a multiple
    of 64), as a contiguous tensor of its dtype and shape: one ``as_strided`` each."""
    typed: dict[torch.dtype, torch.Tensor] = {}
    views = []
    for source, offset in zip(sources, offsets):
        dtype = source.dtype
        whole = typed.get(dtype)
        if whole is None:
            whole = typed[dtype] = buffer.view(dtype)
        views.append(whole.as_strided(source.shape, _c_strides(source.shape), offset // source.element_size()))
    return views


def _c_strides(shape: Any) -> list[int]:
    """The strides of a contiguous tensor of ``shape``."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return strides[::-1]


def _fill(buffer: torch.Tensor, sources: list[torch.Tensor], offsets: list[int], small: list[int]) -> None:
    """Copy the sources' values into ``buffer`` (length a multiple of 64): the small ones
    by one ``torch.cat`` per run of one dtype in packing order, straight into the typed
    buffer (no per-leaf byte view: those cost more than the copy for small leaves), the
    others one by one."""
    with torch.no_grad():  # out= refuses inputs that require grad
        start = 0
        while start < len(small):
            dtype = sources[small[start]].dtype
            end = start
            while end < len(small) and sources[small[end]].dtype is dtype:
                end += 1
            run = [sources[i] if sources[i].device.type == "cpu" else sources[i].cpu() for i in small[start:end]]
            first = offsets[small[start]] // run[0].element_size()
            count = sum(source.numel() for source in run)
            torch.cat([source.reshape(-1) for source in run], out=buffer.view(dtype)[first:first + count])
            start = end
    small_set = set(small)
    for i, (source, offset) in enumerate(zip(sources, offsets)):
        nbytes = source.numel() * source.element_size()
        if nbytes and i not in small_set:
            buffer[offset:offset + nbytes].copy_(files.raw_bytes(source.cpu()))


def _consolidate_plain(sources: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    offsets, small, total = writer.packed_layout(sources)
    buffer = torch.empty(align(total), dtype=_BYTE)  # a whole number of every dtype
    _fill(buffer, sources, offsets, small)
    return buffer, _byte_views(buffer, sources, offsets)


def _consolidate_shared(sources: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    plans = [writer.LeafPlan(str(i), source, None) for i, source in enumerate(sources)]
    writer._write_anonymous(plans, writer.Options(prefix=None, inplace=False))
    segment = next((p.result._backing for p in plans if p.result.numel()), None)
    if segment is None:  # nothing but empty leaves: no segment was made
        buffer = MemoryMappedTensor.empty(0, dtype=_BYTE)
    else:
        buffer = MemoryMappedTensor._from_backing(segment, 0, _BYTE, (segment.nbytes,))
    return buffer, [p.result for p in plans]


def _consolidate_file(sources: list[torch.Tensor], filename: Any) -> tuple[torch.Tensor, list[torch.Tensor]]:
    path = os.path.abspath(os.fspath(filename))
    offsets, small, total = writer.packed_layout(sources)
    if total == 0:
        files.create_file(path, 0, existsok=True)  # the checks only: nothing to map
        buffer = MemoryMappedTensor.empty(0, dtype=_BYTE)
        return buffer, [MemoryMappedTensor.empty(s.shape, dtype=s.dtype) for s in sources]
    backing, _ = files.create_file(path, total, existsok=True)
    buffer = MemoryMappedTensor._from_backing(backing, 0, _BYTE, (total,))
    _fill(buffer.as_subclass(torch.Tensor), sources, offsets, small)
    leaves = [MemoryMappedTensor._from_backing(backing, offset, s.dtype, s.shape)
              for s, offset in zip(sources, offsets)]
    return buffer, leaves


def _offset_in(layout: _Layout, leaf: torch.Tensor) -> int | None:
    """The byte offset of ``leaf`` in the layout's buffer, or None if it is not a
    contiguous view of it (an entry replaced after ``unlock_()``). An empty leaf holds no
    bytes: offset 0."""
    if leaf.numel() == 0:
        return 0
    if leaf.untyped_storage().data_ptr() != layout.buffer.untyped_storage().data_ptr() or not leaf.is_contiguous():
        return None
    return leaf.storage_offset() * leaf.element_size()


def _layout_of(obj: Any) -> _Layout | None:
    return _inner(obj).__dict__.get("_consolidated")


def _mark(obj: Any, layout: _Layout) -> None:
    """Give every tensordict node of ``obj``'s tree the layout."""
    if not getattr(type(obj), "_is_non_tensor", False):
        if not getattr(type(obj), "_is_tensorclass", False):
            obj.__dict__["_consolidated"] = layout
        kind = nodes.kind_for_object(obj)
        for _, value in kind.entries(obj):
            if not isinstance(value, torch.Tensor):
                _mark(value, layout)
        for _, child in kind.children(obj):
            _mark(child, layout)


class ConsolidateMethods:
    """consolidate() and is_consolidated() (tensordict 0.15.3's names and arguments)."""

    def consolidate(
        self, filename: Any = None, *, num_threads: int = 0, device: Any = None,
        non_blocking: bool = False, inplace: bool = False, return_early: bool = False,
        use_buffer: bool = False, share_memory: bool = False, pin_memory: bool = False,
        metadata: bool = False,
    ) -> Any:
        """A copy of this tensordict whose leaves all live in one contiguous storage.

        Every tensor leaf (nested ones, the members of lazy stacks, tensorclass fields)
        is copied once into one buffer and replaced by a view of it; non-tensor values
        are carried along. The result is locked (entries are fixed; leaves can be
        written in place). Pickling a consolidated tensordict sends one buffer plus a
        small skeleton.

        Args:
            filename: map one file at this path (created, or reused and grown) and put
                the bytes there; the leaves are MemoryMappedTensors of that file. The
                file holds the raw bytes only (no metadata, unlike tensordict's).
            share_memory: put the bytes in one anonymous shared-memory segment, laid out
                as ``memmap()`` without a prefix lays it out; the leaves pickle by
                reference, so another process sees the same memory.
            device: only None or "cpu" (CPU storage is the only one this build of
                shared_td consolidates into).
            num_threads, non_blocking, use_buffer, metadata: accepted for
                compatibility; the copy is one ``torch.cat`` on the calling thread and the
                layout is always kept, so they change nothing.
            inplace, return_early, pin_memory: not supported (ValueError).

        Examples:
            >>> import torch
            >>> from shared_td import TensorDict
            >>> td = TensorDict(a=torch.zeros(3), b={"c": torch.ones(3, dtype=torch.int64)}, batch_size=[3])
            >>> c = td.consolidate()
            >>> c.is_consolidated(), c["a"].untyped_storage().data_ptr() == c["b", "c"].untyped_storage().data_ptr()
            (True, True)
        """
        del num_threads, non_blocking, use_buffer, metadata  # see the docstring
        for name, value in (("inplace", inplace), ("return_early", return_early), ("pin_memory", pin_memory)):
            if value:
                raise ValueError(f"consolidate({name}=True) is not supported by shared_td; "
                                 f"call consolidate() without {name} (the result is a new tensordict).")
        if device is not None and torch.device(device).type != "cpu":
            raise ValueError(f"consolidate(device={device!r}): shared_td consolidates into CPU "
                             "memory only; call .to(device) on the result instead.")
        if filename is not None and share_memory:
            raise ValueError("consolidate(): pass either filename= (one file) or share_memory=True "
                             "(one anonymous segment), not both.")
        sources = _sources(self)
        if filename is not None:
            buffer, leaves = _consolidate_file(sources, filename)
        elif share_memory:
            buffer, leaves = _consolidate_shared(sources)
        else:
            buffer, leaves = _consolidate_plain(sources)
        return _rebuilt(self, buffer, leaves)

    def is_consolidated(self) -> bool:
        """True if this tensordict came from ``consolidate()`` (or the unpickling of
        one) and every leaf still is its view of the one storage.

        Example:
            >>> import torch
            >>> from shared_td import TensorDict
            >>> TensorDict(a=torch.zeros(2)).is_consolidated()
            False
        """
        layout = _layout_of(self)
        return layout is not None and all(_offset_in(layout, leaf) is not None for leaf in _sources(self))

    def __reduce_ex__(self, protocol: int):
        """A consolidated tree over a plain buffer pickles as the buffer (once) and the
        pickle of the tree in which each leaf that is a view of the buffer is only its
        dtype, shape and byte offset (a leaf no longer in the buffer pickles as itself).
        Other trees pickle their state (a shared or file buffer by reference)."""
        layout = _layout_of(self)
        if layout is None or isinstance(layout.buffer, MemoryMappedTensor):
            return super().__reduce_ex__(protocol)
        tree = io.BytesIO()
        root = _inner(self)
        _TreePickler(tree, protocol, layout, root if root.is_locked else None).dump(self)
        data = layout.buffer.numpy()
        payload = pickle.PickleBuffer(data) if protocol >= 5 else data.tobytes()
        return _unpickle_consolidated, (payload, tree.getvalue())


    def __copy__(self) -> Any:
        """A shallow copy (what ``copy.copy`` makes without ``__reduce_ex__``): the same
        leaves; defined here because copy.copy would otherwise take the pickling path
        above, which copies a consolidated tree's buffer."""
        new = type(self).__new__(type(self))
        new.__setstate__(self.__getstate__())
        return new


class _TreePickler(pickle.Pickler):
    """Pickles a consolidated tree with its buffer's views as ``_view(dtype, shape,
    offset)`` and its layout as ``_layout()``: names that _TreeUnpickler resolves to its
    own buffer. (``reducer_override``, unlike ``persistent_id``, is not called for the
    many str/int/tuple/dict objects of a tree.)"""

    def __init__(self, file: Any, protocol: int, layout: _Layout, locked_root: Any):
        super().__init__(file, protocol)
        self.layout = layout
        self.base = layout.buffer.untyped_storage().data_ptr()
        self.locked_root = locked_root

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            # _offset_in, inlined: this runs for every leaf of the tree
            if obj.untyped_storage().data_ptr() == self.base and obj.is_contiguous():
                return _view, (obj.dtype, tuple(obj.shape), obj.storage_offset() * obj.element_size())
            if obj.numel() == 0:
                return _view, (obj.dtype, tuple(obj.shape), 0)
        elif isinstance(obj, ConsolidateMethods) and obj.__dict__.get("_consolidated") is self.layout:
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


def _view(dtype: torch.dtype, shape: tuple, offset: int) -> torch.Tensor:
    raise pickle.UnpicklingError("a consolidated leaf can only be read by _TreeUnpickler")


def _layout() -> _Layout:
    raise pickle.UnpicklingError("a consolidated layout can only be read by _TreeUnpickler")


class _TreeUnpickler(pickle.Unpickler):
    """Reads what _TreePickler wrote: the leaves become views of ``buffer``."""

    def __init__(self, file: Any, buffer: torch.Tensor):
        super().__init__(file)
        self.layout = _Layout(buffer)
        self.typed: dict[torch.dtype, torch.Tensor] = {}

    def find_class(self, module: str, name: str) -> Any:
        if module == __name__ and name == "_view":
            return self.view
        if module == __name__ and name == "_layout":
            return lambda: self.layout
        return super().find_class(module, name)

    def view(self, dtype: torch.dtype, shape: tuple, offset: int) -> torch.Tensor:
        whole = self.typed.get(dtype)
        if whole is None:
            whole = self.typed[dtype] = self.layout.buffer.view(dtype)
        return whole.as_strided(shape, _c_strides(shape), offset // dtype.itemsize)


def _rebuilt(template: Any, buffer: torch.Tensor, leaves: list[torch.Tensor]) -> Any:
    """``template``'s tree with ``leaves`` (in apply order) for its leaves, carrying the
    layout, locked."""
    position = iter(leaves)
    out = template.apply(lambda _: next(position))
    _mark(out, _Layout(buffer))
    out.lock_()
    return out


def _unpickle_consolidated(payload: Any, tree: bytes) -> Any:
    """Rebuild a pickled consolidated tensordict: the payload becomes its one buffer."""
    data = payload if isinstance(payload, bytearray) else bytearray(payload)
    buffer = torch.frombuffer(data, dtype=_BYTE) if data else torch.empty(0, dtype=_BYTE)  # len: 64 * n
    return _TreeUnpickler(io.BytesIO(tree), buffer).load()
