"""Benchmark case ``map``: ``td.map(fn)`` over a memory-mapped tensordict in 2 fork
workers (the pool started by the call, as a user's call starts it), one chunk per worker
and 16 chunks, the results returned or written into a shared ``out`` by the workers,
against the floor: a ``multiprocessing`` pool of 2 fork workers that inherit the same
leaves as a flat dict of tensors and a shared output, are sent row ranges only and write
each range's result into the output (nothing pickled but two ints).
"""
from __future__ import annotations

import multiprocessing
import os

import torch

from shared_td.bench.libraries import libraries
from shared_td.bench.timing import best_of_each

_WORKERS = 2
_WIDTH = 1024  # float32 values a row of "obs": 4 KiB
_INHERITED: dict = {}  # the floor's leaves and output, set before its pool forks


def double(chunk):
    """What each worker does to its chunk (a tensordict): a new one, each leaf doubled."""
    return chunk.apply(lambda leaf: leaf * 2)


def _double_rows(bounds: tuple) -> None:
    """The floor's work for rows ``bounds`` of the inherited leaves."""
    start, stop = bounds
    for key, leaf in _INHERITED["leaves"].items():
        torch.mul(leaf[start:stop], 2, out=_INHERITED["out"][key][start:stop])


def _raw_map(rows: int, chunksize: int | None) -> None:
    step = chunksize or -(rows // -_WORKERS)
    # one torch thread per worker, as map's workers (and tensordict's) set it: an OpenMP
    # pool used before the fork hangs a child's first parallel op
    with multiprocessing.get_context("fork").Pool(_WORKERS, initializer=torch.set_num_threads,
                                                 initargs=(1,)) as pool:
        for _ in pool.imap(_double_rows, [(start, min(start + step, rows)) for start in range(0, rows, step)], 1):
            pass


def _tree(lib, rows: int):
    return lib.TensorDict(row=torch.arange(rows), obs=torch.zeros(rows, _WIDTH),
                          nested={"x": torch.zeros(rows, 16)}, batch_size=[rows])


def case_map(options, root: str) -> dict:
    """map() of a memory-mapped tensordict of ``size_mib`` MiB (obs rows of 4 KiB, an int
    row number and a nested leaf), by chunks per worker and 16 chunks, into a shared
    ``out`` and returned, vs the raw pool."""
    import warnings

    rows = max(16, options.size_mib * 256)
    _INHERITED["leaves"] = {"row": torch.arange(rows), "obs": torch.zeros(rows, _WIDTH), "x": torch.zeros(rows, 16)}
    _INHERITED["out"] = {key: torch.empty_like(leaf).share_memory_() for key, leaf in _INHERITED["leaves"].items()}
    variants = {}
    for label, chunksize in (("chunk per worker", None), ("16 chunks", -(rows // -16))):
        variants[f"raw fork Pool, {label}"] = (lambda: rows, lambda n, c=chunksize: _raw_map(n, c))
        for name, lib in libraries().items():
            td = _tree(lib, rows).memmap_(os.path.join(root, f"map_{name}_{chunksize}"))
            out = _tree(lib, rows).share_memory_()

            def run(td, c=chunksize, out=None):
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", FutureWarning)  # (tensordict's about seeds)
                    return td.map(double, num_workers=_WORKERS, chunksize=c, out=out, mp_start_method="fork")
            variants[f"{name}, {label}, into out"] = (lambda td=td: td, lambda td, r=run, o=out: r(td, out=o))
            variants[f"{name}, {label}, returned"] = (lambda td=td: td, run)
    try:
        return best_of_each(max(options.repeat, 3), variants)
    finally:
        _INHERITED.clear()
