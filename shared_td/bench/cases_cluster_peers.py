"""The reference columns of ``cluster_sync``, measured as a user of torch.distributed
would run them: two processes (spawned; forked in a quick run from the command line), each rank of a
*registered* default gloo group
(``init_process_group`` on a TCPStore that the benchmark hosts on a free port of
127.0.0.1, ``GLOO_SOCKET_IFNAME=lo``).

Each column runs once untimed (buffers touched, as in a training loop), then the columns
take turns, one timing each per round; each timing starts when both ranks leave a barrier
and ends when the receiver (rank 1) holds the data, so that the sender's own work
(tensordict's ``consolidate()``, the pickling of ``init_remote``'s metadata) counts as the
receiver waits for it. Columns:

* ``raw gloo send/recv``: ``dist.send``/``dist.recv`` of the same bytes (the floor);
* ``raw gloo xK groups``: the same bytes in K ranges over K gloo groups at once (what
  striping gives at best between two processes);
* ``tensordict consolidated``: ``send(consolidated=True)`` of a changed (so not
  consolidated) tree, which runs ``consolidate()`` on each call, into the consolidated
  tensordict that ``from_remote_init`` built;
* ``tensordict init_remote``: ``init_remote`` -> ``from_remote_init`` (metadata pickled,
  then the consolidated storage): how a receiver that does not know the tree gets it;
* ``tensordict per leaf``: ``send``/``recv``, one message per leaf, into that tensordict;
* ``shared_td consolidated``, ``init_remote``, ``per leaf``: the same three with shared_td's
  TensorDict (its tensordict-compatible methods), in the same run.

The children are started first (:func:`start_peers`): they import torch and tensordict and
join the group while the caller prepares its own column, which it times once they are
idle (:meth:`Peers.ready`); they wait until :meth:`Peers.measure` lets them run. A full
run spawns them in the case, where nothing else is timed meanwhile. A quick bench run
starts them at its very beginning (:mod:`~shared_td.bench.runner`); from the command
line it forks them, before any case made a thread or a store: copies of the runner,
which has imported torch and tensordict already, so a few ms each instead of ~4 s of
CPU of imports that would compete with the cases on 2 cores. Every wait is bounded and no process outlives the run (the runner
closes them even when a case fails).
"""
from __future__ import annotations

import datetime
import multiprocessing
import os
import queue as queues
import time

import torch
import torch.distributed as dist

from shared_td.bench.libraries import tensordict_module
from shared_td.bench.loopback import HOST, loopback_store
from shared_td.platform import CreatorWatch

#: Seconds the children may take to start (imports, joining the group), and any gloo
#: call of theirs.
START_S = 120.0
#: Stripe counts of the striped columns (raw gloo here, ``sync`` in cases_cluster).
STRIPED = (2, 4)


def policy_tree(nbytes: int, library=None):
    """A policy-like tree of ``nbytes``: 4 layers, each a weight and a bias (8 leaves), a
    TensorDict of ``library`` (shared_td by default, or tensordict)."""
    if library is None:
        import shared_td as library
    layer = nbytes // 4 // 4  # float32 elements per layer
    bias = 256
    return library.TensorDict(
        {f"layer{i}": {"weight": torch.ones(layer - bias), "bias": torch.ones(bias)} for i in range(4)},
        batch_size=[])


def _peer_main(rank: int, ports, nbytes: int, repeat: int, with_tensordict: bool, go, results,
               columns_of) -> None:
    """One rank: get the store's port from ``ports``, join the group, tell ``results`` it
    is ready, wait for ``go``, then time each column of ``columns_of(rank, nbytes,
    tensordict or None)`` ``repeat`` times, the columns taking turns (rank 1 reports the
    best of each)."""
    caller = CreatorWatch()  # (not os.getppid() now: the caller may be gone already)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    tensordict = tensordict_module() if with_tensordict else None
    timeout = datetime.timedelta(seconds=START_S + nbytes / 20e6)
    store = dist.TCPStore(HOST, ports.get(timeout=START_S), None, False, timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timeout)
    try:
        results.put(("ready", rank))
        while not go.wait(1.0):  # the caller may run other cases first (see start_peers)
            if caller.gone():
                # orphaned: the caller went away (its sentinel pipe may live on in
                # processes it forked later, so parent_process().is_alive() need not see it)
                return
        columns = list(columns_of(rank, nbytes, tensordict).items())
        for _, step in columns:
            _timed(rank, step)  # once untimed: buffers touched, connections warm
        best = dict.fromkeys((name for name, _ in columns), float("inf"))
        for round_ in range(repeat):  # the columns take turns, in a rotating order: a slow phase hits them all
            start = round_ % len(columns)
            for name, step in columns[start:] + columns[:start]:
                best[name] = min(best[name], _timed(rank, step))
        if rank == 1:
            results.put(("times", best))
    finally:
        dist.destroy_process_group()


def sync_columns(rank: int, nbytes: int, tensordict) -> dict:
    """``cluster_sync``'s reference columns (see the module's opening)."""
    import shared_td

    columns = {"raw gloo send/recv": _raw(rank, nbytes), **_raw_striped(rank, nbytes)}
    for library in (shared_td, tensordict):
        if library is not None:
            columns.update(_library_columns(rank, library, nbytes))
    return columns


def _timed(rank: int, step) -> float:
    """Seconds from leaving a barrier together to the end of ``step()`` on this rank."""
    dist.barrier()
    began = time.perf_counter()
    step()
    return time.perf_counter() - began


def _raw(rank: int, nbytes: int):
    data = torch.ones(nbytes, dtype=torch.uint8)
    if rank == 0:
        return lambda: dist.send(data, dst=1)
    return lambda: dist.recv(data, src=0)


def _raw_striped(rank: int, nbytes: int, counts=STRIPED) -> dict:
    """The same bytes as k contiguous ranges over k gloo groups of the two ranks (each
    its own device: a TCP connection and an I/O thread), all posted, then all waited:
    what striping can give at best between two processes, beside ``sync``'s striped
    columns (:func:`~shared_td.bench.cases_cluster.striped_sync_columns`)."""
    data = torch.ones(nbytes, dtype=torch.uint8)
    columns = {}
    for count in counts:
        groups = [dist.new_group([0, 1], backend="gloo") for _ in range(count)]
        size = -(-nbytes // count)
        chunks = [data[i * size: (i + 1) * size] for i in range(count)]
        if rank == 0:
            def step(groups=groups, chunks=chunks):
                for work in [dist.isend(chunk, dst=1, group=group) for group, chunk in zip(groups, chunks)]:
                    work.wait()
        else:
            def step(groups=groups, chunks=chunks):
                for work in [dist.irecv(chunk, src=0, group=group) for group, chunk in zip(groups, chunks)]:
                    work.wait()
        columns[f"raw gloo x{count} groups"] = step
    return columns


def _library_columns(rank: int, library, nbytes: int) -> dict:
    """tensordict's three ways with ``library``'s TensorDict (tensordict's, or
    shared_td's tensordict-compatible methods), named after it."""
    name = library.__name__
    if rank == 0:
        # a learner's weights: a plain (not consolidated) tree, so send(consolidated=True)
        # runs consolidate() on each call, as after each change
        sent = policy_tree(nbytes, library)
        sent.init_remote(dst=1)  # the receiver's consolidated tensordict (untimed)
        return {
            f"{name} consolidated": lambda: sent.send(dst=1, consolidated=True),
            f"{name} init_remote": lambda: sent.init_remote(dst=1),
            f"{name} per leaf": lambda: sent.send(dst=1),
        }
    received = library.TensorDict.from_remote_init(src=0)
    return {
        f"{name} consolidated": lambda: received.recv(src=0, consolidated=True),
        f"{name} init_remote": lambda: library.TensorDict.from_remote_init(src=0),
        f"{name} per leaf": lambda: received.recv(src=0),
    }


class Peers:
    """The two rank processes of :func:`start_peers`."""

    def __init__(self, nbytes: int, repeat: int, start_method: str = "spawn", columns_of=sync_columns):
        ctx = multiprocessing.get_context(start_method)
        # kept until close: a spawned rank unpickles the queues after start() returned
        self._go, self._results, self._ports = ctx.Event(), ctx.Queue(), ctx.Queue()
        self._procs = [ctx.Process(target=_peer_main, args=(rank, self._ports, nbytes, repeat, tensordict_module() is not None,
                                                            self._go, self._results, columns_of), daemon=True)
                       for rank in (0, 1)]
        self._limit = START_S + repeat * 6 * (1 + nbytes / 20e6)  # the columns, at 20 MB/s at worst
        self._started, self._waiting = time.monotonic(), len(self._procs)
        self._closed = False
        for proc in self._procs:
            proc.start()
        # the store (and its thread) only now: a forked rank must not copy a running store
        self._store = loopback_store(START_S)  # IPv4 only: see shared_td.coordinator.store_host
        for _ in self._procs:
            self._ports.put(self._store.port)

    def ready(self) -> None:
        """Wait until both ranks joined the group (and are idle: nothing of theirs runs
        beside the caller's timings)."""
        while self._waiting:
            self._get("ready", self._started + START_S)
            self._waiting -= 1

    def measure(self) -> dict:
        """Let the ranks run; the best time of each column (seconds)."""
        try:
            self.ready()
            self._go.set()
            return self._get("times", time.monotonic() + self._limit)
        finally:
            self.close()

    def _get(self, kind: str, deadline: float):
        while True:
            try:
                got, value = self._results.get(timeout=max(0.1, min(1.0, deadline - time.monotonic())))
            except queues.Empty:
                dead = [p.exitcode for p in self._procs if p.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(f"the torch.distributed ranks did not report {kind!r} "
                                       f"(exit codes {[p.exitcode for p in self._procs]})") from None
                continue
            if got == kind:
                return value

    def close(self) -> None:
        """Stop both ranks (bounded: after their columns, or at once when they were never
        let run) and free the queue. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for proc in self._procs:
            proc.join(10 if self._go.is_set() else 0)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        for queue in (self._results, self._ports):
            queue.close()
            queue.join_thread()


def start_peers(nbytes: int, repeat: int, start_method: str = "spawn", columns_of=sync_columns) -> Peers:
    """Start the two ranks (they get ready while the caller works). Once ready they wait,
    idle, for :meth:`Peers.measure` as long as the caller lives, so that a caller may
    start them before other work (the runner of a quick run: before the first case); the
    caller must :meth:`Peers.close` them (``measure`` does).

    ``start_method``: "spawn" (fresh interpreters, as a user's ranks) or "fork" (copies of
    the caller, which must have started no thread, store or coordinator yet: the quick
    run's start); either way each rank makes its own group, buffers and connections
    after it started, so the columns time the same work. ``columns_of``: a function of
    a module (the ranks import it by name) that makes the timed steps of a rank."""
    return Peers(nbytes, repeat, start_method, columns_of)
