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

This module holds the methods (the options, what is consolidated already, ``to`` of a
consolidated tree); the walks are in consolidated_tree.py, the storage and the copies
in consolidated_copy.py, the file format in consolidated_file.py and
consolidated_load.py.
"""
from __future__ import annotations

import os
from typing import Any

import torch

from shared_td.containers.consolidated_copy import Storage, copy_in_background, copy_jobs, run_copies, unpacked
from shared_td.containers.consolidated_file import holds_metadata, metadata_json
from shared_td.containers.consolidated_layout import Layout, placed_views
from shared_td.containers.consolidated_pickle import reduce_tree, unlocked_on_arrival
from shared_td.containers.consolidated_tree import (
    adopt_views,
    build_consolidated,
    kind_name,
    layout_of,
    leaf_location,
    leaf_offsets,
    locked_path,
    stored_leaves,
)
from shared_td.containers.locking import lock_until_restored
from shared_td.containers.pinning import check_pinnable
from shared_td.errors import LockedTensorDictError
from shared_td.keys import key_repr
from shared_td.memmap_tensor import MemoryMappedTensor
from shared_td.persist import in_flight
from shared_td.persist.writer import packed_layout
from shared_td.storage.anonymous import Segment
from shared_td.tensorclass_protocol import unwrap_tensorclass

__all__ = ["ConsolidateMethods", "moved_consolidated", "stored_leaves"]


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
    path = locked_path(obj)
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
        buffer plus a small skeleton; the receiver's copy is unlocked, as in
        tensordict. A tensordict that is already consolidated is returned as it is,
        unless it is asked for a storage it does not have (another file, shared memory,
        pinned memory): then a new one is made.

        Args:
            filename: write the bytes to one file at this path, in tensordict's format
                (the data, then the tree's JSON metadata, then its length), which
                ``from_consolidated`` (ours or tensordict's) reads. The leaves are
                MemoryMappedTensors of that file: in-place writes reach it, and they
                pickle by reference. The file is made beside its name and renamed over
                it once complete, so the path never holds a partial file and the
                tensordicts mapping an old file there keep their data. Non-tensor
                values must be JSON values (as in tensordict). A tree consolidated into
                this very file again is returned as it is if the file holds its tree;
                if its batch sizes or names changed, it gets a new file too, renamed over
                the old one, and a new tree over that file is returned (with inplace=True:
                this tree, its leaves now views of the new file, locked or not: its
                entries stay as they are). The file it maps is never written, cut nor
                grown: other processes that map it (tensordict's from_consolidated maps
                the whole file) keep reading it, and a reader sees the old file or the
                new one, whole.
            num_threads: with 2 or more, that many threads copy the leaves (in pieces of
                about equal bytes); below 2 (None, 0, 1, negative) the calling thread copies.
            device: only None or "cpu" (CPU storage is the only one this build of
                shared_td consolidates into).
            inplace: this tensordict's own leaves become the views, and it is returned
                (locked). Refused (LockedTensorDictError, a RuntimeError) when it or a
                nested tensordict is locked, unless it is consolidated into ``filename``
                already (see filename).
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
        # with filename: consolidated into the file at that path already (see the docstring)
        again = _already_consolidated(self, filename, share_memory, pin_memory)
        if again and (filename is None or _file_holds_it(self, filename)):
            return self
        if pin_memory and filename is None:  # (a file's mapping is never pinned)
            check_pinnable("consolidate(pin_memory=True)", "Call consolidate() without pin_memory=True: "
                           "pinning only speeds up copies to an accelerator.")
        if inplace and not again:  # (again: its entries stay as they are, only the leaves move)
            _check_unlocked(self)
        sources = stored_leaves(self)
        offsets, small, total = packed_layout(sources)
        metadata = b""
        if filename is not None:
            sizes = (source.numel() * source.element_size() for source in sources)
            metadata = metadata_json(self, zip(offsets, sizes), kind_name, os.fspath(filename))
        handover, restorers, storage = in_flight.Handover(), [], None
        try:
            storage = Storage(total, filename=filename, share_memory=share_memory,
                              pin_memory=pin_memory and filename is None and not share_memory,
                              metadata=metadata)
            storage.zero_padding(sources, offsets, small)
            others = unpacked(sources, small)
            jobs = copy_jobs(storage.plain, sources, offsets, small, others, threads, storage.write_big,
                             lambda index: leaf_location(self, index))
            views, entries, runs = placed_views(storage.plain, sources, offsets, small + others)
            leaves = storage.wrap(views, sources)
            layout = Layout(storage.buffer)
            if leaves is views:  # a plain buffer: it pickles with the tree (consolidated_pickle)
                layout.record(views, entries=entries, runs=runs)

            def finish() -> Any:
                if inplace:
                    adopt_views(self, iter(leaves), layout)
                    self.lock_()
                    result = self
                else:
                    # a file's mapping is CPU memory: its tree is on the CPU, as in tensordict
                    on_file = torch.device("cpu") if filename is not None else None
                    result = build_consolidated(self, iter(leaves), layout, moved_to=on_file)
                unwrap_tensorclass(result).__dict__.setdefault("_consolidated", layout)  # a non-tensor root
                return result

            if return_early and threads > 1:
                if inplace:  # this tensordict keeps its leaves until the copy has succeeded,
                    # locked meanwhile: the copies' views replace its leaves by position, so an
                    # entry added or deleted before they do mixed up the values
                    lock_until_restored(self, restorers)
                    return copy_in_background(jobs, threads, finish, storage, handover, on_error=restorers[0])
                result = finish()
                return copy_in_background(jobs, threads, lambda: result, storage, handover)
            run_copies(jobs, threads)  # before any leaf is replaced: a failed copy changes nothing
        except BaseException:
            # (from the storage's making on, until a background copy took it over: a
            # failure or a Ctrl-C landing anywhere here left its new file and descriptor,
            # and with return_early, inplace=True the tree locked)
            if handover.kept_by_caller():
                if storage is not None:
                    storage.abort()
                for restore in restorers:
                    restore()
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
        layout = layout_of(self)
        return layout is not None and leaf_offsets(stored_leaves(self), layout) is not None

    def __reduce_ex__(self, protocol: int):
        """A consolidated tree over a plain CPU buffer pickles as the buffer (once) and
        the pickle of the tree in which each leaf that is a view of the buffer is only its
        dtype, shape and byte offset (a leaf no longer in the buffer pickles as itself).
        Other trees pickle their state (a shared or file buffer by reference, a GPU
        one as torch pickles GPU tensors)."""
        layout = layout_of(self)
        if layout is None or not layout.buffer.is_cpu:
            return super().__reduce_ex__(protocol)
        if isinstance(layout.buffer, MemoryMappedTensor):  # arrives unlocked as a plain one
            return unlocked_on_arrival(self, super().__reduce_ex__(protocol), protocol)
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
    does. Where the storage is on ``device`` already (``to("cpu")`` of a tree whose
    device is None), a new tree over the same leaves and storage, consolidated and
    locked, as tensordict gives. None when ``obj`` is not consolidated (then each leaf
    is moved by itself)."""
    layout = layout_of(obj)
    if layout is None:
        return None
    sources = stored_leaves(obj)
    offsets = leaf_offsets(sources, layout)
    if offsets is None:
        return None
    if layout.buffer.device == device:  # no copy: the leaves are views of it already
        result = build_consolidated(obj, iter(sources), layout, moved_to=device)
        unwrap_tensorclass(result).__dict__.setdefault("_consolidated", layout)
        return result
    buffer = layout.buffer.as_subclass(torch.Tensor).to(device, non_blocking=non_blocking)
    order = sorted(range(len(sources)), key=offsets.__getitem__)
    views, entries, runs = placed_views(buffer, sources, offsets, order)
    moved_layout = Layout(buffer)
    if buffer.is_cpu:  # a plain buffer: it pickles with the tree (consolidated_pickle)
        moved_layout.record(views, entries=entries, runs=runs)
    result = build_consolidated(obj, iter(views), moved_layout, moved_to=device)
    unwrap_tensorclass(result).__dict__.setdefault("_consolidated", moved_layout)
    return result


def _already_consolidated(obj: Any, filename: Any, share_memory: bool, pin_memory: bool) -> bool:
    """Whether ``obj`` is consolidated into a storage of the kind asked for (then
    consolidate() returns it as it is, as tensordict does)."""
    layout = layout_of(obj)
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


def _file_holds_it(obj: Any, filename: Any) -> bool:
    """``obj`` is consolidated into the file at ``filename``: whether that file (still
    the one it maps) holds its current metadata (batch sizes and names may have changed
    since; then a new file is written: the mapped one is never written in place)."""
    layout = layout_of(obj)
    sources = stored_leaves(obj)
    offsets = leaf_offsets(sources, layout)  # every leaf is in it: obj is consolidated
    places = zip(offsets, (source.numel() * source.element_size() for source in sources))
    metadata = metadata_json(obj, places, kind_name, os.fspath(filename))
    path = os.path.abspath(os.fspath(filename))
    return holds_metadata(path, layout.buffer._backing, layout.buffer.numel(), metadata)
