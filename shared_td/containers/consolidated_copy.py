"""The bytes of consolidate(): where they go (:class:`Storage`) and the copies that fill it.

The layout is ``persist.writer.packed_layout``'s: small leaves back to back, copied by
one ``torch.cat`` per run of one dtype; big ones at 64-byte boundaries, each copied by
itself (``pwrite`` into a shared segment: no first-touch faults of the mapping). The
copies are jobs that may run on ``num_threads`` threads (:func:`run_copies`) or on a
background thread (:func:`copy_in_background`, ``return_early=True``).

A copy that fails (a leaf on the meta device holds no data; a tensor subclass whose
``cpu()`` raises) is raised again naming the key of its leaf, found only then: the jobs
know leaf numbers, and :func:`~shared_td.containers.consolidated_tree.leaf_location`
turns one into a key.
"""
from __future__ import annotations

import functools
import operator
import os
from typing import Any, Callable

import torch

from shared_td.containers.consolidated_file import NewFile
from shared_td.memmap_tensor import MemoryMappedTensor
from shared_td.persist import in_flight
from shared_td.persist.future import TensorDictFuture
from shared_td.storage import files
from shared_td.storage.anonymous import Segment, align
from shared_td.thread_pool import ThreadPool

_nbytes = operator.attrgetter("nbytes")

_BYTE = torch.uint8
_dtype_of = operator.attrgetter("dtype")


def unpacked(sources: list, small: list[int]) -> list[int]:
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


def copy_jobs(buffer: torch.Tensor, sources: list, offsets: list[int], small: list[int], others: list[int],
              threads: int, write_big: Callable[[int, torch.Tensor], None],
              name_leaf: Callable[[int], str]) -> list[Callable[[], None]]:
    """The copies that fill ``buffer``: the small leaves in ``threads`` pieces of about
    equal bytes (each one ``cat`` per dtype run), then each big leaf (``write_big``).
    A job that fails raises its error again naming the leaf (``name_leaf(index)``)."""
    jobs: list[Callable[[], None]] = []

    def small_job(piece: list[int]) -> Callable[[], None]:
        return _naming_the_leaf(lambda: _cat_small(buffer, sources, offsets, piece), piece, name_leaf,
                                retry_one=lambda index: _cat_small(buffer, sources, offsets, [index]))

    if small and threads <= 1:
        jobs.append(small_job(small))
    elif small:
        sizes = [sources[i].numel() * sources[i].element_size() for i in small]
        target = max(1, -(-sum(sizes) // max(1, threads)))
        piece, filled = [], 0
        for index, size in zip(small, sizes):
            piece.append(index)
            filled += size
            if filled >= target:
                jobs.append(small_job(piece))
                piece, filled = [], 0
        if piece:
            jobs.append(small_job(piece))
    for index in others:
        if sources[index].numel():
            jobs.append(_naming_the_leaf(functools.partial(write_big, offsets[index], sources[index]),
                                         [index], name_leaf))
    return jobs


def _naming_the_leaf(copy: Callable[[], None], indices: list[int], name_leaf: Callable[[int], str],
                     retry_one: Callable[[int], None] | None = None) -> Callable[[], None]:
    """``copy`` (of the leaves ``indices``), whose error is raised again naming the leaf
    that failed. Of several leaves copied together, the first whose copy alone fails
    (``retry_one``: the copy is being abandoned, so writing the buffer again is harmless)."""

    def job() -> None:
        try:
            copy()
        except Exception as error:  # (not KeyboardInterrupt & co: they name no leaf)
            culprit, cause = _culprit(error, indices, retry_one)
            if culprit is None:
                where = f"one of the leaves {name_leaf(indices[0])} to {name_leaf(indices[-1])}"
            else:
                where = f"the leaf {name_leaf(culprit)}"
            raise leaf_copy_error(cause, where) from cause

    return job


def _culprit(error: Exception, indices: list[int],
             retry_one: Callable[[int], None] | None) -> tuple[int | None, Exception]:
    """(the leaf of ``indices`` whose copy fails, its error); (None, ``error``) if each
    copies alone."""
    if len(indices) == 1:
        return indices[0], error
    for index in indices:
        try:
            retry_one(index)
        except Exception as own:  # noqa: BLE001 - that leaf's own error is the one to show
            return index, own
    return None, error


def leaf_copy_error(error: Exception, where: str) -> Exception:
    """``error`` (the failed copy of ``where``: "the leaf 'a'") with a message that names the
    leaf and the fix, of the same class (same errno for an OSError) so that handlers
    written for the copy's error still catch it; an exception class that cannot be made
    so gets the message as a note instead."""
    message = (
        f"consolidate() could not copy {where}: {error} The leaves must hold "
        "their data on a device torch can copy from (a tensor on the 'meta' device holds "
        "none): materialize or move that leaf first, or leave its key out "
        "(td.exclude(key).consolidate())."
    )
    try:
        if isinstance(error, OSError) and error.errno is not None:
            named = type(error)(error.errno, message)
        else:
            named = type(error)(message)
    except Exception:  # noqa: BLE001 - a constructor of its own: keep the error itself
        named = None
    if type(named) is not type(error):
        error.add_note(message)
        return error
    return named


class Storage:
    """Where the bytes of one consolidate() go: ``buffer`` (what the layout keeps),
    ``plain`` (a plain uint8 tensor over the same bytes, that the views are made of),
    ``write_big`` (how a big leaf is copied in) and ``wrap`` (the leaves the tree gets).

    Three places hold the buffer: a plain CPU byte tensor (default; ``pin_memory``:
    pinned); one anonymous shared-memory segment (``share_memory``), whose leaves pickle
    by reference; one file (``filename``), mapped shared, made beside its name and
    renamed over it by :meth:`commit`."""

    def __init__(self, total: int, *, filename: Any, share_memory: bool, pin_memory: bool,
                 metadata: bytes = b""):
        nbytes = align(total)  # a whole number of every dtype
        self.backing = self.file = None
        if filename is not None:
            self.file = NewFile(os.path.abspath(os.fspath(filename)), nbytes, metadata)
        try:
            self._place(nbytes, total, filename, share_memory, pin_memory)
        except BaseException:  # (a Ctrl-C included: the new file and its descriptor stayed)
            self.abort()
            raise

    def _place(self, nbytes: int, total: int, filename: Any, share_memory: bool, pin_memory: bool) -> None:
        if self.file is not None:
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

    def zero_padding(self, sources: list[torch.Tensor], offsets: list[int], small: list[int]) -> None:
        """Zero the bytes of a plain buffer that no leaf covers (the alignment gaps before
        the big leaves, the tail): it is ``torch.empty``, and pickling sends it whole, so
        they would carry whatever memory it reused (and make two consolidations of one
        tree differ). A file or a segment starts zeroed. The small leaves lie back to
        back from byte 0 (see packed_layout): only the big ones leave gaps."""
        if self.backing is not None or self.file is not None or not self.plain.numel():
            return
        covered = set(small)
        end = sum(_nbytes(sources[i]) for i in small)
        spans = sorted((offsets[i], offsets[i] + _nbytes(source)) for i, source in enumerate(sources)
                       if i not in covered and _nbytes(source))
        for start, stop in spans + [(self.plain.numel(), self.plain.numel())]:
            if start > end:
                self.plain[end:start].zero_()
            end = max(end, stop)

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


def run_copies(jobs: list[Callable[[], None]], threads: int) -> None:
    """Run the ``jobs`` on the calling thread (``threads`` below 2) or on that many
    threads; raise the first error (once every job has ended)."""
    pool = ThreadPool.start(min(threads, len(jobs)), "shared_td-consolidate") if threads > 1 and len(jobs) > 1 \
        else None
    if pool is None:  # (also when the system starts no thread: RLIMIT_NPROC)
        for job in jobs:
            job()
        return
    with pool:
        for done in [pool.submit(job) for job in jobs]:
            done.result()  # the first error of the copies


def copy_in_background(jobs: list, threads: int, result: Callable[[], Any], storage: Storage,
                       handover: "in_flight.Handover", on_error: Callable[[], Any] = lambda: None) -> TensorDictFuture:
    """Run the copies on a background thread; the future's result is ``result()``,
    called once they all succeeded (and ``storage`` committed: a file renamed in place);
    ``on_error()`` runs when a copy failed. Until the thread has taken ``handover``, a
    failure here (a Ctrl-C as the thread starts included) is the caller's to clean up
    (the storage, the tree's locks): the copy then never runs."""
    def copy() -> Any:
        try:
            run_copies(jobs, threads)
        except BaseException:
            storage.abort()
            on_error()
            raise
        storage.commit()
        return result()

    # (as memmap_'s: the interpreter waits for the copy at exit, before concurrent.futures
    # refuses the copies' pool; no tree or prefix to wait for: the tree stays locked)
    future = in_flight.run_in_background(copy, "consolidate", "shared_td-consolidate", handover=handover)
    return TensorDictFuture(future, "consolidate")
