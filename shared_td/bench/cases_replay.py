"""Benchmark cases of a replay buffer: the operations an RL loop repeats millions of times.

The buffer has ``rows`` rows of obs [8], action [2], reward [1], done [1] (bool) and
next/obs [8], in files. Three columns, measured in the same run:

* raw torch: a flat dict of plain tensors mapped from files (``torch.from_file``),
  indexed leaf by leaf: the floor of any dict-of-tensors API;
* tensordict 0.15.3: a memory-mapped TensorDict (when installed);
* shared_td: the same, published through a Coordinator.

``replay`` times the five operations in this process; ``replay_worker`` the writes and
the sampling in a spawn worker that attached each buffer (shared_td through the
Coordinator, tensordict by pickling its memory-mapped TensorDict through the process
arguments, raw torch by mapping the files again); ``replay_loader`` a DataLoader with 2
workers whose Dataset returns a batch of 256 rows from ``__getitems__``.
"""
from __future__ import annotations

import os

import torch

from shared_td.bench.libraries import libraries
from shared_td.bench.timing import best_of_each, frozen_heap
from shared_td.bench.worker import shared_worker

#: name -> (feature shape, dtype) of the buffer's leaves; "next/obs" is nested.
FIELDS = {
    "obs": ((8,), torch.float32),
    "action": ((2,), torch.float32),
    "reward": ((1,), torch.float32),
    "done": ((1,), torch.bool),
    "next/obs": ((8,), torch.float32),
}
RAW = "raw torch"
WORKER_TIMEOUT = 120.0  # seconds for the spawn worker to import torch (if new), attach and time


class Rate(float):
    """A result that is a rate (per second), not a time: shown as ``N/s``."""


# ---------------------------------------------------------------------------- buffers
def _nested(make) -> dict:
    """``{"obs": make(...), ..., "next": {"obs": make(...)}}`` over FIELDS."""
    out: dict = {}
    for name, (shape, dtype) in FIELDS.items():
        *parents, leaf = name.split("/")
        node = out
        for parent in parents:
            node = node.setdefault(parent, {})
        node[leaf] = make(shape, dtype)
    return out


def raw_files(root: str, rows: int) -> dict:
    """Zero-filled files for the raw buffer: ``{name: (path, shape, dtype)}``."""
    specs = {}
    for name, (shape, dtype) in FIELDS.items():
        path = os.path.join(root, "raw_" + name.replace("/", "_"))
        full = (rows, *shape)
        with open(path, "wb") as file:
            file.truncate(torch.Size(full).numel() * dtype.itemsize)
        specs[name] = (path, full, dtype)
    return specs


def raw_buffer(specs: dict) -> dict:
    """The raw buffer: ``{name: plain tensor mapped from its file}``."""
    return {
        name: torch.from_file(path, shared=True, size=torch.Size(shape).numel(), dtype=dtype).view(shape)
        for name, (path, shape, dtype) in specs.items()
    }


def td_buffer(lib, rows: int, prefix: str):
    """A zero TensorDict of ``rows`` rows built with ``lib``, memory-mapped under ``prefix``."""
    td = lib.TensorDict(_nested(lambda shape, dtype: torch.zeros(rows, *shape, dtype=dtype)), batch_size=[rows])
    return td.memmap_(prefix)


def sources(lib) -> tuple:
    """What is written: one step and a batch of 64, as ``lib`` holds them (raw: flat dicts)."""
    def make(batch):
        return lambda shape, dtype: torch.ones(*batch, *shape, dtype=dtype)

    if lib is None:
        return ({name: make(())(*spec) for name, spec in FIELDS.items()},
                {name: make((64,))(*spec) for name, spec in FIELDS.items()})
    return (lib.TensorDict(_nested(make(())), batch_size=[]),
            lib.TensorDict(_nested(make((64,))), batch_size=[64]))


# ---------------------------------------------------------------------------- timing
def _raw_write(buf: dict, index, source: dict) -> None:
    for name, value in source.items():
        buf[name][index] = value


def _raw_read(buf: dict, index) -> dict:
    return {name: leaf[index] for name, leaf in buf.items()}


def operations(rows: int, calls: int) -> dict:
    """operation -> ``run(buf, step, batch, write, read)`` doing it ``calls`` times, over
    positions and indices drawn once (the same for every column)."""
    generator = torch.Generator().manual_seed(0)
    starts = torch.randint(0, rows - 64, (calls,), generator=generator).tolist()
    idx64 = [torch.randint(0, rows, (64,), generator=generator) for _ in range(16)]
    idx256 = [torch.randint(0, rows, (256,), generator=generator) for _ in range(16)]

    def each(op):
        return lambda *args: [op(i, *args) for i in range(calls)]

    return {
        "buf[i] = step": each(lambda i, buf, step, batch, write, read: write(buf, starts[i], step)),
        "buf[i:i+64] = batch": each(
            lambda i, buf, step, batch, write, read: write(buf, slice(starts[i], starts[i] + 64), batch)),
        "buf[idx64] = batch": each(lambda i, buf, step, batch, write, read: write(buf, idx64[i % 16], batch)),
        "buf[idx256] (sample)": each(lambda i, buf, step, batch, write, read: read(buf, idx256[i % 16])),
        "buf[i] (one row)": each(lambda i, buf, step, batch, write, read: read(buf, starts[i])),
    }


def time_operations(buffers: dict, rows: int, calls: int, repeat: int, only=None) -> dict:
    """``{operation: {column: seconds per call}}`` for ``buffers`` (column -> (buf, lib)),
    the columns taking turns (best_of_each), the garbage collector off while timed.

    The objects made so far (torch's, tensordict's: ~0.3 s per full collection) are
    frozen out of the collector's reach meanwhile, so that best_of's collection before
    each run sees only the garbage of the runs.
    """
    with frozen_heap():
        return _time_operations(buffers, rows, calls, repeat, only)


def _time_operations(buffers: dict, rows: int, calls: int, repeat: int, only) -> dict:
    out = {}
    for operation, run in operations(rows, calls).items():
        if only is not None and operation not in only:
            continue
        variants = {}
        for column, (buf, lib) in buffers.items():
            step, batch = sources(lib)
            write, read = (_raw_write, _raw_read) if lib is None else (_td_write, _td_read)
            run(buf, step, batch, write, read)  # warm: caches, first touch of the pages
            variants[column] = (lambda: None, lambda _, buf=buf, s=step, b=batch, w=write, r=read: run(buf, s, b, w, r))
        out[operation] = {column: t / calls for column, t in best_of_each(repeat, variants).items()}
    return out


def _td_write(buf, index, source) -> None:
    buf[index] = source


def _td_read(buf, index):
    return buf[index]


def _calls(options) -> int:
    return 10 * options.rounds  # 200 calls per timing with --quick, 2000 in the full run


def _repeat(options) -> int:
    return max(options.repeat, 3)  # a timing costs ~10 ms: best of 3 even with --quick


# ---------------------------------------------------------------------------- cases
def _buffers(coord, root: str, rows: int) -> tuple[dict, dict]:
    """column -> (buffer, library module or None for raw), and the raw files' specs."""
    import shared_td

    specs = raw_files(root, rows)
    buffers = {RAW: (raw_buffer(specs), None)}
    for name, lib in libraries().items():
        if lib is not shared_td:
            buffers[name] = (td_buffer(lib, rows, os.path.join(root, f"replay_{name}")), lib)
    td = shared_td.TensorDict(_nested(lambda shape, dtype: torch.zeros(rows, *shape, dtype=dtype)), batch_size=[rows])
    buffers["shared_td"] = (coord.publish("replay", td, prefix=os.path.join(root, "replay_shared_td")), shared_td)
    return buffers, specs


def case_replay(options, root: str) -> dict:
    """The five replay-buffer operations, per call, in this process."""
    import shared_td

    with shared_td.Coordinator() as coord:
        buffers, _ = _buffers(coord, root, options.rows)
        return time_operations(buffers, options.rows, _calls(options), _repeat(options))


WORKER_OPERATIONS = ("buf[i] = step", "buf[i:i+64] = batch", "buf[idx64] = batch", "buf[idx256] (sample)")


def case_replay_worker(options, root: str) -> dict:
    """The writes and the sampling, timed in a spawn worker (the run's) that attached
    each buffer."""
    import shared_td

    with shared_td.Coordinator() as coord:
        buffers, specs = _buffers(coord, root, options.rows)
        theirs = {name: buf for name, (buf, lib) in buffers.items() if name not in (RAW, "shared_td")}
        return shared_worker().call(
            _worker, coord.address, coord.authkey.hex(), theirs, specs, options.rows, _calls(options),
            _repeat(options), timeout=WORKER_TIMEOUT,
        )


def _worker(connection, address, authkey, theirs, specs, rows, calls, repeat) -> dict:
    """In the spawn worker: attach, time, return the results."""
    import shared_td

    buffers = {RAW: (raw_buffer(specs), None),
               "shared_td": (shared_td.attach("replay", address=address, authkey=authkey), shared_td)}
    for name, buf in theirs.items():
        buffers[name] = (buf, libraries()[name])
    order = [RAW, *theirs, "shared_td"]  # the columns in the main case's order
    return time_operations({c: buffers[c] for c in order}, rows, calls, repeat, WORKER_OPERATIONS)


class ReplayDataset(torch.utils.data.Dataset):
    """Rows of a replay buffer; ``__getitems__`` returns a whole batch at once (one
    indexing of the buffer per batch, as DataLoader calls it with a list of indices)."""

    def __init__(self, buf, raw: bool):
        self.buf, self.raw = buf, raw
        self.rows = len(next(iter(buf.values()))) if raw else len(buf)

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, index: int):
        return _raw_read(self.buf, index) if self.raw else self.buf[index]

    def __getitems__(self, indices: list):
        index = torch.tensor(indices)
        return _raw_read(self.buf, index) if self.raw else self.buf[index]


def _identity(batch):
    return batch


#: batches a DataLoader has ready before the first is taken (2 workers x prefetch 2):
#: received at once, they are left out of every timing
_PREFETCHED = 4


def case_replay_loader(options, root: str) -> dict:
    """DataLoader (2 workers, batch 256, shuffled) over the buffer: samples per second.

    One loader per column, all started before any timing (their start is not counted);
    each timing takes ``2 * rounds`` batches from one loader, the columns taking turns,
    and the best of ``repeat`` (at least 3) timings is kept, so that a slow phase of the
    machine does not fall on one column only.
    """
    import shared_td

    batches = 2 * options.rounds  # 40 with --quick, 400 in the full run
    repeat = _repeat(options)
    rows = max(options.rows, 256 * (_PREFETCHED + repeat * batches + 1))
    with shared_td.Coordinator() as coord:
        buffers, _ = _buffers(coord, root, rows)
        iterators = {}
        try:
            for column, (buf, lib) in buffers.items():
                loader = torch.utils.data.DataLoader(
                    ReplayDataset(buf, raw=lib is None), batch_size=256, shuffle=True, num_workers=2,
                    collate_fn=_identity, multiprocessing_context="fork",
                    generator=torch.Generator().manual_seed(0),
                )
                iterators[column] = iter(loader)
            for iterator in iterators.values():
                for _ in range(_PREFETCHED):
                    next(iterator)  # the workers have started, the prefetched batches are gone

            def take(_, iterator):
                for _ in range(batches):
                    next(iterator)

            seconds = best_of_each(repeat, {column: (lambda: None, lambda _, it=it: take(_, it))
                                            for column, it in iterators.items()})
        finally:
            iterators.clear()  # stops the workers
    return {"DataLoader samples/s": {column: Rate(256 * batches / t) for column, t in seconds.items()}}
