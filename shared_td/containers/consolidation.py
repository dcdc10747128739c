"""consolidate(): every leaf of a tree in one contiguous storage, the leaves views into it.

The bytes are laid out as an anonymous ``memmap_()`` lays out its one segment
(``persist.writer.packed_layout``): small leaves back to back, copied by one
``torch.cat`` per run of one dtype; big ones at 64-byte boundaries. Three places hold
the buffer:

* a plain CPU byte tensor (default; ``pin_memory=True``: pinned, where torch can pin);
* ``share_memory=True``: one anonymous shared-memory segment with the layout of
  ``memmap()`` without a prefix; its leaves are MemoryMappedTensors of the segment and
  pickle by reference (the segment), never by value;
* ``filename=``: one file, mapped shared; its leaves pickle by reference (the path).

The work is three passes over what the tree holds, none of them generic: one walk
collects the tensor leaves (in ``apply`` order); the views are made from the layout in
runs (one ``unbind`` per run of leaves of one dtype and shape); one walk builds the new
nodes with the containers' unchecked constructors (keys and batch sizes are those of a
valid tree) and locks each as it is built. ``inplace=True`` puts the views into the
tree's own nodes instead. The copy itself may run on ``num_threads`` threads, and
``return_early=True`` returns a TensorDictFuture while they copy.

Every node of a consolidated tree remembers the buffer, so a plain one pickles as ONE
buffer plus a small skeleton (consolidated_pickle.py). Whether it still is consolidated
is checked, not assumed: after ``unlock_()`` an entry may have been replaced.
"""
from __future__ import annotations

import operator
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterator

import torch

from shared_td.containers.consolidated_file import NewFile, metadata_json, rewrite_metadata
from shared_td.containers.consolidated_layout import Layout, placed_views
from shared_td.containers.consolidated_pickle import reduce_tree
from shared_td.containers.locking import lock_built
from shared_td.containers.pinning import check_pinnable
from shared_td.errors import LockedTensorDictError
from shared_td.keys import key_repr
from shared_td.memmap_tensor import MemoryMappedTensor
from shared_td.persist import nodes, writer
from shared_td.persist.future import TensorDictFuture
from shared_td.storage import files
from shared_td.storage.anonymous import Segment, align
from shared_td.tensorclass_protocol import unwrap_tensorclass

_BYTE = torch.uint8
_CPU = torch.device("cpu")
_Tensor = torch.Tensor
_dtype_of = operator.attrgetter("dtype")

# type -> node kind name, learnt once per class from the registered node kinds
_KIND_NAMES: dict[type, str] = {}


def _kind_name(node: Any) -> str:
    cls = type(node)
    name = _KIND_NAMES.get(cls)
    if name is None:
        name = _KIND_NAMES[cls] = nodes.kind_for_object(node).name
    return name


def _is_non_tensor_kind(name: str) -> bool:
    return name in (nodes.NON_TENSOR_DATA, nodes.NON_TENSOR_STACK)


# ----------------------------------------------------------------------------- walks
def _collect(node: Any, leaves: list) -> None:
    """Append the tensor leaves of ``node``'s tree in ``apply`` order (entries in order,
    nested collections where they stand, lazy-stack members one after another)."""
    kind = _KIND_NAMES.get(type(node)) or _kind_name(node)
    if kind == nodes.TENSORDICT:
        for value in node._tensordict.values():
            if isinstance(value, _Tensor):
                leaves.append(value)
            else:
                _collect(value, leaves)
    elif kind == nodes.TENSORCLASS:
        _collect(node._tensordict, leaves)
    elif kind == nodes.LAZY:
        for member in node.tensordicts:
            _collect(member, leaves)


def stored_leaves(obj: Any) -> list[torch.Tensor]:
    """The tensor leaves that ``obj``'s tree holds, in ``apply`` order: the members'
    own of a lazy stack (not the stacks its ``values()`` makes), a tensorclass's fields."""
    leaves: list[torch.Tensor] = []
    _collect(obj, leaves)
    return leaves


def _locked_path(node: Any, path: tuple = ()) -> tuple | None:
    """The key path of the first locked tensordict of ``node``'s tree (() for the root),
    or None: inplace=True cannot replace the leaves of a locked node."""
    kind = _kind_name(node)
    if _is_non_tensor_kind(kind):
        return None
    if kind == nodes.TENSORCLASS:
        return _locked_path(node._tensordict, path)
    if node._is_locked:
        return path
    if kind == nodes.LAZY:
        children = [(path, member) for member in node.tensordicts]
    else:
        children = [(path + (key,), value) for key, value in node._tensordict.items()
                    if not isinstance(value, torch.Tensor)]
    for child_path, child in children:
        found = _locked_path(child, child_path)
        if found is not None:
            return found
    return None


def _build(node: Any, views: Iterator[torch.Tensor], layout: Layout, moved_to: torch.device | None = None) -> Any:
    """A new, locked tree like ``node``'s whose tensor leaves are the next ``views``;
    non-tensor values are carried in new wrappers (locking the result must not lock the
    source's), as tensordict does. Its nodes' device: ``moved_to`` for a move (``to``),
    else theirs, the CPU for one on another device (consolidate: the storage is there)."""
    kind = _KIND_NAMES.get(type(node)) or _kind_name(node)
    if kind == nodes.TENSORDICT:
        entries, children = {}, []
        for key, value in node._tensordict.items():
            if isinstance(value, _Tensor):
                entries[key] = next(views)
            else:
                entries[key] = built = _build(value, views, layout, moved_to)
                children.append(unwrap_tensorclass(built))
        if moved_to is not None:
            device = moved_to
        else:
            device = node._device
            if device is not None and device.type != "cpu":
                device = _CPU  # consolidate: the storage is on the CPU
        new = type(node)._new_unsafe(entries, node._batch_size, device, node._names)
    elif kind == nodes.TENSORCLASS:
        return type(node)._from_tensordict(_build(node._tensordict, views, layout, moved_to))
    elif kind == nodes.LAZY:
        children = [_build(member, views, layout, moved_to) for member in node.tensordicts]
        new = type(node)(*children, stack_dim=node.stack_dim, batch_size=node.batch_size)
    else:  # non-tensor data: no layout of its own
        new = node.clone(recurse=False)
        lock_built(new, ())
        return new
    new.__dict__["_consolidated"] = layout
    lock_built(new, children)
    return new


def _adopt(node: Any, views: Iterator[torch.Tensor], layout: Layout) -> None:
    """inplace=True: ``node``'s own tensor leaves become the next ``views`` (its
    entries are unlocked: checked before)."""
    kind = _kind_name(node)
    if kind == nodes.TENSORDICT:
        entries = node._tensordict
        for key, value in entries.items():
            if isinstance(value, torch.Tensor):
                entries[key] = next(views)  # an existing key: the dict keeps its size
            else:
                _adopt(value, views, layout)
        if node._device is not None and node._device.type != "cpu":
            node._device = _CPU
    elif kind == nodes.TENSORCLASS:
        _adopt(node._tensordict, views, layout)
        return
    elif kind == nodes.LAZY:
        for member in node.tensordicts:
            _adopt(member, views, layout)
    else:
        return
    # its leaves are no longer the files or shared memory they may have been
    node._is_memmap = node._is_shared = False
    node._memmap_prefix = None
    node.__dict__["_consolidated"] = layout


# ----------------------------------------------------------------------------- bytes
def _others(sources: list, small: list[int]) -> list[int]:
    """The indices of the sources that are not packed (big or empty ones), in order."""
    if len(small) == len(sources):
        return []
    packed = set(small)
    return [index for index in range(len(sources)) if index not in packed]


def _cat_small(buffer: torch.Tensor, sources: list, offsets: list[int], small: list[int]) -> None:
    """Copy the small sources (their indices in packing order: back to back) by one
    ``torch.cat`` per run of one dtype, straight into the typed buffer."""
    packed = [sources[i] for i in small]
    dtypes = list(map(_dtype_of, packed))  # (one C loop: a dtype read per leaf in Python cost more)
    with torch.no_grad():  # out= refuses inputs that require grad
        start = 0
        while start < len(packed):
            dtype = dtypes[start]
            end = start + 1
            while end < len(packed) and dtypes[end] is dtype:
                end += 1
            last = packed[end - 1]
            # (back to back: the run's bytes end where its last leaf ends)
            first, stop = offsets[small[start]], offsets[small[end - 1]] + last.numel() * last.element_size()
            # cat takes CPU tensors of one number of dims: flatten only where needed
            run = [(source if source.is_cpu else source.cpu()) if source.ndim == 1 else source.reshape(-1).cpu()
                   for source in packed[start:end]]
            torch.cat(run, out=buffer[first:stop].view(dtype))
            start = end


def _copy_jobs(buffer: torch.Tensor, sources: list, offsets: list[int], small: list[int], others: list[int],
               threads: int, write_big: Callable[[int, torch.Tensor], None]) -> list[Callable[[], None]]:
    """The copies that fill ``buffer``: the small leaves in ``threads`` pieces of about
    equal bytes (each one ``cat`` per dtype run), then each big leaf (``write_big``)."""
    jobs: list[Callable[[], None]] = []
    if small and threads <= 1:
        jobs.append(lambda: _cat_small(buffer, sources, offsets, small))
    elif small:
        sizes = [sources[i].numel() * sources[i].element_size() for i in small]
        target = max(1, -(-sum(sizes) // max(1, threads)))
        piece, filled = [], 0
        for index, size in zip(small, sizes):
            piece.append(index)
            filled += size
            if filled >= target:
                jobs.append(lambda piece=piece: _cat_small(buffer, sources, offsets, piece))
                piece, filled = [], 0
        if piece:
            jobs.append(lambda piece=piece: _cat_small(buffer, sources, offsets, piece))
    for index in others:
        if sources[index].numel():
            jobs.append(lambda offset=offsets[index], source=sources[index]: write_big(offset, source))
    return jobs


class _Storage:
    """Where the bytes of one consolidate() go: ``buffer`` (what the layout keeps),
    ``plain`` (a plain uint8 tensor over the same bytes, that the views are made of),
    ``write_big`` (how a big leaf is copied in) and ``wrap`` (the leaves the tree gets)."""

    def __init__(self, total: int, *, filename: Any, share_memory: bool, pin_memory: bool,
                 metadata: bytes = b""):
        nbytes = align(total)  # a whole number of every dtype
        self.backing = self.file = None
        if filename is not None:
            self.file = NewFile(os.path.abspath(os.fspath(filename)), nbytes, metadata)
            self.backing = self.file.backing
        elif share_memory and total:
            self.backing = Segment.create(nbytes)
        if self.backing is None and (filename is not None or share_memory):
            self.buffer = MemoryMappedTensor.empty(0, dtype=_BYTE)
            self.plain = torch.empty(0, dtype=_BYTE)
        elif self.backing is None:
            self.buffer = self.plain = torch.empty(nbytes, dtype=_BYTE, pin_memory=pin_memory)
        else:
            self.buffer = MemoryMappedTensor._from_backing(self.backing, 0, _BYTE, (nbytes,))
            self.plain = self.buffer.as_subclass(torch.Tensor)

    def commit(self) -> None:
        """The copies are done: a new file takes its name (nothing else to do otherwise)."""
        if self.file is not None:
            self.file.commit()

    def abort(self) -> None:
        if self.file is not None:
            self.file.abort()

    def write_big(self, offset: int, source: torch.Tensor) -> None:
        if isinstance(self.backing, Segment):  # pwrite: no first-touch faults of the mapping
            self.backing.write(offset, files.tensor_bytes(source.detach().cpu()))
        else:
            data = files.raw_bytes(source.detach().cpu())
            self.plain[offset:offset + data.numel()].copy_(data)

    def wrap(self, views: list[torch.Tensor], sources: list[torch.Tensor]) -> list[torch.Tensor]:
        """The leaves of the tree: the views themselves for a plain buffer, else
        MemoryMappedTensors of the segment or file (an empty one maps nothing)."""
        if not isinstance(self.buffer, MemoryMappedTensor):
            return views
        if self.backing is None:  # nothing but empty leaves: nothing was mapped
            return [MemoryMappedTensor.empty(s.shape, dtype=s.dtype) for s in sources]
        leaves = MemoryMappedTensor._wrap_views(self.backing, views)
        for index, view in enumerate(views):
            if not view.numel():
                leaves[index] = MemoryMappedTensor._from_backing(self.backing, 0, view.dtype, view.shape)
        return leaves


def _run_copies(jobs: list[Callable[[], None]], threads: int) -> None:
    if threads <= 1 or len(jobs) <= 1:
        for job in jobs:
            job()
        return
    with ThreadPoolExecutor(min(threads, len(jobs)), thread_name_prefix="shared_td-consolidate") as pool:
        for done in [pool.submit(job) for job in jobs]:
            done.result()  # the first error of the copies


def _copy_in_background(jobs: list, threads: int, result: Callable[[], Any], storage: "_Storage",
                        on_error: Callable[[], Any] = lambda: None) -> TensorDictFuture:
    """Run the copies on a background thread; the future's result is ``result()``,
    called once they all succeeded (and ``storage`` committed: a file renamed in place);
    ``on_error()`` runs when a copy failed."""
    future: Future = Future()

    def run() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            try:
                _run_copies(jobs, threads)
            except BaseException:
                storage.abort()
                on_error()
                raise
            storage.commit()
            future.set_result(result())
        except BaseException as error:  # delivered by future.result()
            future.set_exception(error)

    # Not a daemon, as memmap_'s: the interpreter waits for the copy at exit.
    threading.Thread(target=run, name="shared_td-consolidate", daemon=False).start()
    return TensorDictFuture(future, "consolidate")


def _check_options(filename: Any, num_threads: Any, device: Any, non_blocking: bool,
                   return_early: bool, use_buffer: bool, share_memory: bool, pin_memory: bool) -> int:
    """Refuse arguments that cannot be honoured, before any byte is copied; the number
    of threads."""
    threads = 0 if num_threads is None else num_threads
    if not isinstance(threads, int):
        raise ValueError(f"consolidate(num_threads={num_threads!r}): an int is needed.")
    threads = max(threads, 0)  # (as tensordict: below 2, the calling thread copies)
    if device is not None and torch.device(device).type != "cpu":
        raise ValueError(f"consolidate(device={device!r}): shared_td consolidates into CPU "
                         "memory only; call .to(device) on the result instead.")
    del share_memory  # with filename=, the file's mapping is the memory processes share (as tensordict)
    if return_early and threads > 1 and (use_buffer or non_blocking):
        name = "use_buffer" if use_buffer else "non_blocking"
        raise NotImplementedError(
            f"consolidate(return_early=True) is not supported with {name}=True (as in "
            f"tensordict): call it without {name}=True, or without return_early=True.")
    return threads


def _check_unlocked(obj: Any) -> None:
    """inplace=True replaces the leaves of every node: refused if one is locked."""
    path = _locked_path(obj)
    if path is not None:
        where = "it" if not path else f"its nested tensordict {key_repr(path)}"
        raise LockedTensorDictError(
            f"Cannot modify locked TensorDict: consolidate(inplace=True) replaces the "
            f"leaves of this tensordict, and {where} is locked. Unlock it first "
            "(`with td.unlock_(): td.consolidate(inplace=True)`), or call consolidate() "
            "without inplace=True, which returns a new tensordict.")


class ConsolidateMethods:
    """consolidate() and is_consolidated() (tensordict 0.15.3's names and arguments)."""

    def consolidate(
        self, filename: Any = None, *, num_threads: int = 0, device: Any = None,
        non_blocking: bool = False, inplace: bool = False, return_early: bool = False,
        use_buffer: bool = False, share_memory: bool = False, pin_memory: bool = False,
        metadata: bool = False,
    ) -> Any:
        """A tensordict whose leaves all live in one contiguous storage.

        Every tensor leaf (nested ones, the members of lazy stacks, tensorclass fields)
        is copied once into one buffer and replaced by a view of it; non-tensor values
        are carried along (in new wrappers). The result is locked (entries are fixed;
        leaves can be written in place). Pickling a consolidated tensordict sends one
        buffer plus a small skeleton. A tensordict that is already consolidated is
        returned as it is, unless it is asked for a storage it does not have (another
        file, shared memory, pinned memory): then a new one is made.

        Args:
            filename: write the bytes to one file at this path, in tensordict's format
                (the data, then the tree's JSON metadata, then its length), which
                ``from_consolidated`` (ours or tensordict's) reads. The leaves are
                MemoryMappedTensors of that file: in-place writes reach it, and they
                pickle by reference. The file is made beside its name and renamed over
                it once complete, so the path never holds a partial file and the
                tensordicts mapping an old file there keep their data. Non-tensor
                values must be JSON values (as in tensordict). A tree consolidated into
                this very file (still there) only gets its metadata rewritten.
            num_threads: with 2 or more, that many threads copy the leaves (in pieces of
                about equal bytes); below 2 (None, 0, 1, negative) the calling thread copies.
            device: only None or "cpu" (CPU storage is the only one this build of
                shared_td consolidates into).
            inplace: this tensordict's own leaves become the views, and it is returned
                (locked). Refused (LockedTensorDictError, a RuntimeError) when it or a
                nested tensordict is locked.
            return_early: with ``num_threads > 1``, return a TensorDictFuture at once
                while the threads copy; ``result()`` waits and returns the tensordict
                (or raises the copy's error). Do not write into the new leaves before.
                With inplace=True this tensordict keeps its own leaves until the copy
                has succeeded (tensordict replaces them at once), and is locked from the
                call on (unlocked again if the copy fails).
            share_memory: put the bytes in one anonymous shared-memory segment, laid out
                as ``memmap()`` without a prefix lays it out; the leaves pickle by
                reference, so another process sees the same memory. With ``filename``
                the file's shared mapping is that memory (as in tensordict).
            pin_memory: allocate the plain buffer in pinned memory. Without an
                accelerator torch cannot pin: RuntimeError (as tensordict). Ignored with
                ``filename`` (a file mapping) and, as in tensordict, with share_memory
                (the shared segment is not pinned).
            non_blocking, use_buffer, metadata: accepted for compatibility; the copies
                are CPU ones and the layout is always kept, so they change nothing
                (except that return_early=True refuses use_buffer and non_blocking, as
                tensordict does).

        Examples:
            >>> import torch
            >>> from shared_td import TensorDict
            >>> td = TensorDict(a=torch.zeros(3), b={"c": torch.ones(3, dtype=torch.int64)}, batch_size=[3])
            >>> c = td.consolidate()
            >>> c.is_consolidated(), c["a"].untyped_storage().data_ptr() == c["b", "c"].untyped_storage().data_ptr()
            (True, True)
            >>> td.consolidate(num_threads=2, return_early=True).result().is_consolidated()
            True
        """
        del metadata  # see the docstring
        threads = _check_options(filename, num_threads, device, non_blocking,
                                 return_early, use_buffer, share_memory, pin_memory)
        if _already_consolidated(self, filename, share_memory, pin_memory):
            if filename is None or _rewrite_own_file(self, filename):
                return self
        if pin_memory and filename is None:  # (a file's mapping is never pinned)
            check_pinnable("consolidate(pin_memory=True)", "Call consolidate() without pin_memory=True: "
                           "pinning only speeds up copies to an accelerator.")
        if inplace:
            _check_unlocked(self)
        sources = stored_leaves(self)
        offsets, small, total = writer.packed_layout(sources)
        metadata = b""
        if filename is not None:
            sizes = (source.numel() * source.element_size() for source in sources)
            metadata = metadata_json(self, zip(offsets, sizes), _kind_name, os.fspath(filename))
        storage = _Storage(total, filename=filename, share_memory=share_memory,
                           pin_memory=pin_memory and filename is None and not share_memory,
                           metadata=metadata)
        others = _others(sources, small)
        jobs = _copy_jobs(storage.plain, sources, offsets, small, others, threads, storage.write_big)
        views, entries, runs = placed_views(storage.plain, sources, offsets, small + others)
        leaves = storage.wrap(views, sources)
        layout = Layout(storage.buffer)
        if leaves is views:  # a plain buffer: it pickles with the tree (consolidated_pickle)
            layout.record(views, entries=entries, runs=runs)

        def finish() -> Any:
            if inplace:
                _adopt(self, iter(leaves), layout)
                self.lock_()
                result = self
            else:
                result = _build(self, iter(leaves), layout)
            unwrap_tensorclass(result).__dict__.setdefault("_consolidated", layout)  # a non-tensor root
            return result

        if return_early and threads > 1:
            if inplace:  # this tensordict keeps its leaves until the copy has succeeded,
                # locked meanwhile: the copies' views replace its leaves by position, so an
                # entry added or deleted before they do mixed up the values
                self.lock_()
                return _copy_in_background(jobs, threads, finish, storage, on_error=self.unlock_)
            result = finish()
            return _copy_in_background(jobs, threads, lambda: result, storage)
        try:
            _run_copies(jobs, threads)  # before any leaf is replaced: a failed copy changes nothing
        except BaseException:
            storage.abort()
            raise
        storage.commit()
        return finish()

    @classmethod
    def from_consolidated(cls, filename: Any) -> Any:
        """The tree of a file written by ``consolidate(filename=...)`` (by shared_td or
        tensordict 0.15.3), as tensordict's ``from_consolidated``.

        The result is consolidated: its leaves are views of one copy-on-write mapping
        of the file, so in-place writes into them do not reach the file (as in
        tensordict); ``consolidate(filename=...)`` writes them. It is not locked
        (unless the file says so). Batch sizes and names are those of the file; a
        tensorclass in the file must be defined in this process (it is looked up by
        name, never imported). A damaged file (truncated, bad length, JSON that is not
        a tree, offsets or shapes outside the data) raises a FormatError naming the
        file; a FIFO or directory at the path is refused without blocking; a symlink
        is followed.

        Example:
            >>> import tempfile, torch
            >>> from shared_td import TensorDict
            >>> with tempfile.TemporaryDirectory() as d:
            ...     _ = TensorDict(a=torch.ones(2)).consolidate(filename=f"{d}/td.bin")
            ...     TensorDict.from_consolidated(f"{d}/td.bin")["a"].tolist()
            [1.0, 1.0]
        """
        # imported here: it imports the containers, which import this module
        from shared_td.containers.consolidated_load import from_consolidated

        return from_consolidated(filename)

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
        return layout is not None and _leaf_offsets(stored_leaves(self), layout) is not None

    def __reduce_ex__(self, protocol: int):
        """A consolidated tree over a plain CPU buffer pickles as the buffer (once) and
        the pickle of the tree in which each leaf that is a view of the buffer is only its
        dtype, shape and byte offset (a leaf no longer in the buffer pickles as itself).
        Other trees pickle their state (a shared or file buffer by reference, a GPU
        one as torch pickles GPU tensors)."""
        layout = _layout_of(self)
        if layout is None or isinstance(layout.buffer, MemoryMappedTensor) or not layout.buffer.is_cpu:
            return super().__reduce_ex__(protocol)
        # imported here: they import this module (the same layer)
        from shared_td.containers.tensorclass_members import _TensorClassMembers
        from shared_td.containers.tensordict import TensorDict

        return reduce_tree(self, layout, protocol, ConsolidateMethods, TensorDict, _TensorClassMembers)

    def __copy__(self) -> Any:
        """``copy.copy``: :meth:`copy` (``clone(recurse=False)``), as tensordict: a new
        structure over the same leaves. Through pickling's state it shared the entry dicts
        with this tensordict (an entry set or deleted in the copy changed this one, locked
        or not), and a consolidated tree's pickle copied its buffer."""
        return self.copy()


def moved_consolidated(obj: Any, device: torch.device, non_blocking: bool) -> Any | None:
    """``obj.to(device)`` for a consolidated ``obj`` whose storage is on another device:
    ONE copy of its buffer (a tree of 2000 leaves moved leaf by leaf makes 2000), the
    leaves views of the copy, the result consolidated there and locked, as tensordict
    does. None when ``obj`` is not consolidated (then each leaf is moved by itself)."""
    layout = _layout_of(obj)
    if layout is None or layout.buffer.device == device:
        return None
    sources = stored_leaves(obj)
    offsets = _leaf_offsets(sources, layout)
    if offsets is None:
        return None
    buffer = layout.buffer.as_subclass(torch.Tensor).to(device, non_blocking=non_blocking)
    order = sorted(range(len(sources)), key=offsets.__getitem__)
    views, entries, runs = placed_views(buffer, sources, offsets, order)
    moved_layout = Layout(buffer)
    if buffer.is_cpu:  # a plain buffer: it pickles with the tree (consolidated_pickle)
        moved_layout.record(views, entries=entries, runs=runs)
    result = _build(obj, iter(views), moved_layout, moved_to=device)
    unwrap_tensorclass(result).__dict__.setdefault("_consolidated", moved_layout)
    return result


def _already_consolidated(obj: Any, filename: Any, share_memory: bool, pin_memory: bool) -> bool:
    """Whether ``obj`` is consolidated into a storage of the kind asked for (then
    consolidate() returns it as it is, as tensordict does)."""
    layout = _layout_of(obj)
    if layout is None or not obj.is_consolidated():
        return False
    buffer = layout.buffer
    backing = getattr(buffer, "_backing", None)
    if filename is not None:
        return getattr(backing, "path", None) == os.path.abspath(os.fspath(filename))
    if share_memory:
        return isinstance(backing, Segment) or (isinstance(buffer, MemoryMappedTensor) and not buffer.numel())
    if pin_memory and not isinstance(buffer, MemoryMappedTensor) and torch.accelerator.is_available():
        return buffer.is_pinned()  # (without an accelerator nothing can be pinned: as tensordict)
    return True


def _rewrite_own_file(obj: Any, filename: Any) -> bool:
    """``obj`` is consolidated into the file at ``filename``: write its current metadata
    there (batch sizes and names may have changed), as tensordict does. False if the
    path no longer is the file it maps (then a new file is written)."""
    layout = _layout_of(obj)
    sources = stored_leaves(obj)
    offsets = _leaf_offsets(sources, layout)  # every leaf is in it: obj is consolidated
    places = zip(offsets, (source.numel() * source.element_size() for source in sources))
    path = os.path.abspath(os.fspath(filename))
    metadata = metadata_json(obj, places, _kind_name, os.fspath(filename))
    return rewrite_metadata(path, layout.buffer._backing, layout.buffer.numel(), metadata)


def _leaf_offsets(leaves: list[torch.Tensor], layout: Layout) -> list[int] | None:
    """The byte offset of each of a tree's ``leaves`` in ``layout``'s buffer, or None if
    one is not a contiguous view of it (the tree is no longer consolidated)."""
    offsets = []
    for leaf in leaves:
        offset = _offset_in(layout, leaf)
        if offset is None:
            return None
        offsets.append(offset)
    return offsets


def _offset_in(layout: Layout, leaf: torch.Tensor) -> int | None:
    """The byte offset of ``leaf`` in the layout's buffer, or None if it is not a
    contiguous view of it (an entry replaced after ``unlock_()``). An empty leaf holds no
    bytes: offset 0."""
    if leaf.numel() == 0:
        return 0
    if leaf.untyped_storage().data_ptr() != layout.buffer.untyped_storage().data_ptr() or not leaf.is_contiguous():
        return None
    if leaf.is_conj() or leaf.is_neg():  # its values are not the bytes it views (conj()/neg view)
        return None
    return leaf.storage_offset() * leaf.element_size()


def _layout_of(obj: Any) -> Layout | None:
    return unwrap_tensorclass(obj).__dict__.get("_consolidated")
