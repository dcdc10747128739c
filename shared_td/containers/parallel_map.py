"""``map`` and ``map_iter``: ``fn`` applied to chunks of a tensordict in worker processes,
the results joined (``map``) or yielded (``map_iter``), with tensordict 0.15.3's
signature and results.

The chunks are slices along ``dim``: ``chunksize`` rows each (``0``: one element at a
time, the results stacked), or ``num_chunks`` chunks, or by default one per worker. A
memory-mapped tensordict's chunk reaches its worker by file name, without a copy (data
larger than memory can be processed); a plain one through shared memory. The workers
are shared_td's own (:mod:`~shared_td.containers.map_pool`): a worker that dies is an
error that names its chunk, where tensordict's ``multiprocessing.Pool`` waits for ever.
"""
from __future__ import annotations

import functools
import math
import os
import sys
from typing import Any, Callable, Iterator

import torch

from shared_td.containers import batch as batch_ops
from shared_td.containers.map_pool import run_chunks
from shared_td.containers.pool_watch import pool_results

__all__ = ["MapOps"]


class MapOps:
    """Mixin of TensorDictBase."""

    def map(self, fn: Callable, dim: int = 0, num_workers: int | None = None, *, out: Any = None,
            chunksize: int | None = None, num_chunks: int | None = None, pool: Any = None,
            generator: torch.Generator | None = None, max_tasks_per_child: int | None = None,
            worker_threads: int = 1, index_with_generator: bool = False, pbar: bool = False,
            mp_start_method: str | None = None) -> Any:
        """``fn`` applied to chunks of this tensordict in worker processes, the results
        joined along ``dim`` (``torch.cat``; stacked for ``chunksize=0``), as tensordict
        0.15.3's ``map``.

        Args:
            fn: called on each chunk (a tensordict of the rows it holds); returns a
                tensordict, a tensor or None (left out). Picklable for the ``"spawn"``
                and ``"forkserver"`` start methods (a function at the top of a module).
            dim: the batch dim along which the chunks are cut.
            num_workers: the number of worker processes (default: one per CPU).
            out: a tensordict of the result's batch size to write the results into (and
                returned). Shared or memory-mapped, each worker writes its chunk's result
                into it itself; otherwise the results come back and are written here.
            chunksize: the rows of each chunk along ``dim``; 0 passes the elements one
                by one (the results are stacked). Not with ``num_chunks``.
            num_chunks: the number of chunks (at most the size of ``dim``); default: one
                per worker.
            pool: a ``multiprocessing`` (or ``multiprocess``) pool to run the chunks
                (its ``imap_unordered``): then ``num_workers``, ``generator``,
                ``max_tasks_per_child``, ``worker_threads`` and ``mp_start_method`` are
                not used. A worker of that pool that dies while it computes a chunk is a
                WorkerDiedError naming the chunk (the pool's own ``imap`` would wait for
                ever); the pool goes on running, yours to terminate.
            generator: draws the workers' base seed (worker ``i`` seeds torch and numpy
                with base + i); default: a new ``torch.Generator()``, so the same seed at
                every call, as tensordict 0.15.3 (without its FutureWarning).
            max_tasks_per_child: chunks a worker computes before a new one replaces it.
            worker_threads: torch threads in each worker; above 1 only with the
                ``"spawn"`` or ``"forkserver"`` start method (ValueError with ``"fork"``:
                a forked worker's torch threads hang once the parent used its own, and
                tensordict's map then never returns).
            index_with_generator: cut each chunk when a worker is free for it, instead
                of all of them first (less memory at once).
            pbar: show ``map(): N of M chunks`` on stderr.
            mp_start_method: ``"fork"``, ``"spawn"`` or ``"forkserver"`` (default:
                torch's default).

        Returns:
            The joined results; ``out`` when given; None when ``fn`` returned None for
            every chunk.

        Raises:
            The error ``fn`` raised in a worker (the worker's traceback as its cause);
            ``shared_td.WorkerDiedError`` (a RuntimeError) naming the chunk a worker held
            when it died (killed, out of memory): the other workers are stopped.
            ValueError for ``chunksize`` with ``num_chunks``.

        Example:
            >>> def double_x(chunk):
            ...     return chunk.apply(lambda x: x * 2)
            >>> td = TensorDict(x=torch.arange(6.0), batch_size=[6])
            >>> td.map(double_x, num_workers=2, mp_start_method="fork")["x"].tolist()
            [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]
        """
        dim = batch_ops.normalize_dim(dim, self.batch_dims)
        results = _results(self, fn, dim, num_workers, out, chunksize, num_chunks, pool, generator,
                           max_tasks_per_child, worker_threads, index_with_generator, pbar, mp_start_method,
                           shuffle=False, method="map")
        joined, start = [], 0
        before = (slice(None),) * dim
        for item in results:
            if item is None:
                continue
            if out is None:
                joined.append(item)
            elif chunksize == 0:
                out[before + (start,)].update_(item)
                start += 1
            else:
                out[before + (slice(start, start + item.shape[dim]),)].update_(item)
                start += item.shape[dim]
        if not joined:
            return out
        if chunksize == 0:
            from shared_td.containers.extra_constructors import maybe_dense_stack  # (it imports base)

            return maybe_dense_stack(joined, dim)
        return torch.cat(joined, dim)

    def map_iter(self, fn: Callable, dim: int = 0, num_workers: int | None = None, *, shuffle: bool = False,
                 chunksize: int | None = None, num_chunks: int | None = None, pool: Any = None,
                 generator: torch.Generator | None = None, max_tasks_per_child: int | None = None,
                 worker_threads: int = 1, index_with_generator: bool = True, pbar: bool = False,
                 mp_start_method: str | None = None) -> Iterator:
        """Yield ``fn(chunk)`` for each chunk of this tensordict, computed in worker
        processes (see ``map`` for the arguments), in the chunks' order; with
        ``shuffle=True`` (which needs ``index_with_generator=True``: RuntimeError
        otherwise, as tensordict) the chunks take their rows from a random permutation
        along ``dim`` and come as they are done. Nothing starts before the first
        ``next()``; closing the iterator early stops the workers.

        Example:
            >>> def double_x(chunk):
            ...     return chunk.apply(lambda x: x * 2)
            >>> td = TensorDict(x=torch.arange(6.0), batch_size=[6])
            >>> [chunk["x"].tolist() for chunk in td.map_iter(double_x, num_workers=2, chunksize=4,
            ...                                              mp_start_method="fork")]
            [[0.0, 2.0, 4.0, 6.0], [8.0, 10.0]]
        """
        dim = batch_ops.normalize_dim(dim, self.batch_dims)
        yield from _results(self, fn, dim, num_workers, None, chunksize, num_chunks, pool, generator,
                            max_tasks_per_child, worker_threads, index_with_generator, pbar, mp_start_method,
                            shuffle=shuffle, method="map_iter")


def _results(td: Any, fn: Callable, dim: int, num_workers: int | None, out: Any, chunksize: int | None,
             num_chunks: int | None, pool: Any, generator: Any, max_tasks_per_child: int | None,
             worker_threads: int, index_with_generator: bool, pbar: bool, start_method: str | None, *,
             shuffle: bool, method: str) -> Iterator:
    """The results of ``fn`` on the chunks of ``td``, in their order unless ``shuffle``."""
    if shuffle and not index_with_generator:
        raise RuntimeError(f"{method}(shuffle=True) needs index_with_generator=True: the shuffled chunks are cut "
                           "one at a time.")
    if chunksize is not None and num_chunks is not None:
        raise ValueError(f"{method}() takes chunksize or num_chunks, not both.")
    workers = pool._processes if pool is not None else (num_workers or os.cpu_count() or 1)
    rows = _chunk_rows(td.batch_size[dim], chunksize, num_chunks, workers, shuffle)
    before = (slice(None),) * dim
    describe = functools.partial(_described, rows, dim=dim)
    direct = out is not None and (out.is_shared() or out.is_memmap())  # (the workers write into it)

    def tasks() -> Iterator[tuple]:
        for number, index in enumerate(rows):
            yield number, _rows(td, before + (index,)), (_rows(out, before + (index,)) if direct else None)

    chunks = tasks() if index_with_generator else iter(list(tasks()))
    if pool is not None:
        results = pool_results(pool, fn, chunks, len(rows), ordered=not shuffle, describe=describe)
    else:
        if generator is None:
            generator = torch.Generator()  # (tensordict 0.15.3's default: the same base seed at each call)
        seed = int(torch.empty((), dtype=torch.int64).random_(generator=generator))
        results = run_chunks(fn, chunks, workers=min(workers, len(rows)), start_method=start_method, seed=seed,
                             threads=worker_threads, tasks_per_worker=max_tasks_per_child, ordered=not shuffle,
                             describe=describe)
    return _counted(results, len(rows), method) if pbar else results


def _rows(td: Any, index: tuple) -> Any:
    """``td[index]``, a tensordict (as ``split`` gives it) or a tensorclass of its class."""
    return td._index(index) if hasattr(type(td), "_index") else td[index]


def _chunk_rows(size: int, chunksize: int | None, num_chunks: int | None, workers: int, shuffle: bool) -> list:
    """The index of each chunk along the dim of ``size``: ints (``chunksize=0``) or
    slices; with ``shuffle``, tensors of rows of one random permutation."""
    if chunksize == 0:
        rows = list(range(size))
    else:
        if chunksize is None:
            chunksize = math.ceil(size / max(1, min(size, num_chunks or workers))) if size else 1
        elif chunksize < 0:
            raise ValueError(f"chunksize must be 0 or more, not {chunksize}.")
        rows = [slice(start, min(start + chunksize, size)) for start in range(0, size, chunksize)] or [slice(0, 0)]
    if shuffle:
        permutation = torch.randperm(size)
        rows = [permutation[index] for index in rows]
    return rows


def _described(rows: list, number: int, dim: int) -> str:
    index = rows[number]
    if isinstance(index, slice):
        where = f"rows {index.start}:{index.stop}"
    elif isinstance(index, int):
        where = f"element {index}"
    else:
        where = f"{index.numel()} shuffled rows"
    return f"chunk {number} ({where} along dim {dim})"


def _counted(results: Iterator, total: int, method: str) -> Iterator:
    """``results``, drawing ``method(): N of M chunks`` on stderr as they come."""
    done = 0
    try:
        for result in results:
            done += 1
            sys.stderr.write(f"\r{method}(): {done} of {total} chunks")
            sys.stderr.flush()
            yield result
    finally:
        sys.stderr.write("\n")
        sys.stderr.flush()
        if hasattr(results, "close"):  # (stops the workers now, not when collected)
            results.close()
