"""Benchmark cases of sharing: pickling by reference, atomic rewrites, the Coordinator.

Each case takes the options and a scratch directory and returns ``{column: seconds}``;
the first column is the reference of the table.
"""
from __future__ import annotations

import os
import pickle
import time

import torch

from shared_td.bench import floors
from shared_td.bench.libraries import tensordict_module
from shared_td.bench.timing import best_of, best_of_each, fresh_dir


def case_leaf_pickle(options, root: str) -> dict:
    """Pickle round trip of 1000 views of one file-backed tensor (sent by reference)."""
    from shared_td import MemoryMappedTensor

    base_path = os.path.join(root, "pickled.memmap")
    ours = MemoryMappedTensor.from_tensor(torch.randn(1000, 16), filename=base_path, existsok=True)
    views = list(ours.unbind(0))
    out = {
        "raw pickle of the bytes": best_of(
            options.repeat, lambda: [v.clone().numpy() for v in views],
            lambda arrays: pickle.loads(pickle.dumps(arrays)),
        ),
        "shared_td": best_of(options.repeat, lambda: views, lambda vs: pickle.loads(pickle.dumps(vs))),
    }
    tensordict = tensordict_module()
    if tensordict is not None:
        theirs = tensordict.MemoryMappedTensor.from_filename(base_path, torch.float32, (1000, 16))
        their_views = list(theirs.unbind(0))
        out["tensordict"] = best_of(
            options.repeat, lambda: their_views, lambda vs: pickle.loads(pickle.dumps(vs))
        )
    return out


def case_atomic_rewrite(options, root: str) -> dict:
    """Rewrite of a tensordict of 8 leaves (size-mib/4 in all) onto a save: plain vs
    atomic, vs the floor: the same files written into a new directory (and mapped),
    swapped in with renameat2(RENAME_EXCHANGE), the old version removed."""
    import shared_td
    from shared_td.persist import atomic

    floats_per_leaf = options.size_mib * (1 << 20) // 4 // 32
    td = shared_td.TensorDict({f"leaf{i}": torch.randn(floats_per_leaf) for i in range(8)})
    path = os.path.join(root, "atomic")
    td.memmap(path)
    nodes = floors.saved_nodes(path)
    floor_path = os.path.join(root, "atomic_floor")
    td.memmap(floor_path)
    dirs = fresh_dir(root)
    out = {
        "floor: new dir+exchange": best_of(
            options.repeat, dirs, lambda staging: floors.rewrite_tree(nodes, floor_path, staging)
        ),
        "memmap_ (new directory)": best_of(
            options.repeat, lambda: (td.clone(), dirs()), lambda s: s[0].memmap_(s[1])
        ),
        "memmap_ (overwrite)": best_of(options.repeat, lambda: td.clone(), lambda t: t.memmap_(path)),
        "memmap_ atomic=True": best_of(
            options.repeat, lambda: td.clone(), lambda t: t.memmap_(path, atomic=True)
        ),
    }
    lock = atomic.prefix_lock(path)
    rounds = 5 * options.rounds
    start = time.perf_counter()
    for _ in range(rounds):
        lock.acquire()
        lock.release()
    out["lock acquire+release"] = (time.perf_counter() - start) / rounds
    return out


def case_coord_attach(options, root: str) -> dict:
    """Coordinator.attach of a published 100-leaf tensordict (anonymous, then files),
    vs the floors: one received descriptor mapped once and 100 views (anonymous), 100
    files mapped (files); neither counts the round trip to the coordinator that fetches
    the layout (its own row: names() costs one).

    The ``100 leaves`` rows keep what they attach, as a process that attaches often
    does: after the first, each attach reuses the version this process parsed (see
    shared_td/coordinator/published.py). The ``first attach`` row drops each result
    first, so each attach parses the version anew (what a worker's one attach costs once
    connected; the segment stays open here, as the floor's descriptor does), against
    the same floor as the anonymous row.

    The rows take turns (best_of_each), so that a busy phase of a shared machine does
    not fall on a floor or on one row only: the ratios compare timings of one period."""
    import shared_td

    def leaves():
        return shared_td.TensorDict({f"k{i}": torch.zeros(4) for i in range(100)})

    rounds = options.rounds
    prefix = os.path.join(root, "published")
    with shared_td.Coordinator() as coord:
        coord.publish("anonymous", leaves())
        coord.publish("files", leaves(), prefix=prefix)
        floor_of = {"anonymous": _anonymous_floor(coord.attach("anonymous")),
                    "files": _files_floor(coord.attach("files"))}
        variants = {}
        for name in ["anonymous", "files"]:
            coord.attach(name)  # the connection is made once per process
            variants[f"floor {name}"] = lambda _, n=name: [floor_of[n]() for _ in range(rounds)]
            variants[f"{name}, 100 leaves"] = lambda _, n=name: [coord.attach(n) for _ in range(rounds)]
        variants["anonymous, first attach"] = lambda _: [type(coord.attach("anonymous")) for _ in range(rounds)]
        variants["names() round trip"] = lambda _: [coord.names() for _ in range(rounds)]
        times = best_of_each(options.repeat, {row: (lambda: None, run) for row, run in variants.items()})
    return {row: seconds / rounds for row, seconds in times.items()}


def _anonymous_floor(attached):
    """The floor of attaching ``attached`` (anonymous): its segment opened through a
    ``/proc/<pid>/fd`` path, as a receiver opens it, mapped once, one view per leaf."""
    leaves = list(attached.values(include_nested=True, leaves_only=True))
    segment = leaves[0]._backing
    layout = [(leaf._byte_offset(), leaf.dtype, tuple(leaf.shape)) for leaf in leaves]
    path = f"/proc/{os.getpid()}/fd/{segment.fd}"
    return lambda: floors.map_views(path, layout, segment.nbytes)


def _files_floor(attached):
    """The floor of attaching ``attached`` (files): each leaf's file mapped."""
    layout = [(leaf.filename, leaf.dtype, tuple(leaf.shape))
              for leaf in attached.values(include_nested=True, leaves_only=True)]
    return lambda: [floors.mapped_view(*leaf) for leaf in layout]


def case_nontensor_read(options, root: str) -> dict:
    """Read of an unchanged shared non-tensor value (a str): per read.

    The reference is a manager proxy (one round trip per read, what a
    ``multiprocess.Manager().dict()`` costs); shared_td reads the value's version word
    in shared memory and returns its cached object; tensordict 0.15.3 decodes its
    100-byte ``mp.Array`` on every read.
    """
    import multiprocess

    import shared_td

    value = "walk to the door"  # under tensordict's 100-byte limit for shared strings
    reads = 50 * options.rounds

    def per_read(read, calls: int) -> float:
        read()  # warm: caches, connections
        return best_of(options.repeat, lambda: None, lambda _: [read() for _ in range(calls)]) / calls

    out = {}
    with multiprocess.Manager() as manager:
        proxy = manager.dict(task=value)
        out["manager proxy"] = per_read(lambda: proxy["task"], options.rounds)
    ours = shared_td.TensorDict(task=value).memmap_(share_non_tensor=True)
    out["shared_td"] = per_read(lambda: ours["task"], reads)
    tensordict = tensordict_module()
    if tensordict is not None:
        theirs = tensordict.TensorDict(task=value).memmap_(share_non_tensor=True)
        out["tensordict"] = per_read(lambda: theirs["task"], reads)
    return out


def _small_td(lib):
    """What share_nontensor memmaps: a tensor and two str values, one of them nested."""
    return lib.TensorDict({"obs": torch.zeros(4, 3), "task": "walk to the door", "goal": {"name": "door"}},
                          batch_size=[4])


def case_share_nontensor(options, root: str) -> dict:
    """memmap_(share_non_tensor=True) of a small tensordict, tensordict vs shared_td.

    cold: the first call in a process that has shared nothing yet and whose environment
    announces no coordinator (the run's worker, forked at the start of a quick run, then
    a spawned one per further repeat): shared_td's starts the embedded coordinator in the background and
    returns; "+ coordinator ready" waits for it too (until the values are held by it).
    warm: per call, over ``rounds`` calls: the caller's time (shared_td's background
    hand-over is waited for after the clock stops, before the next timing), and with
    that wait inside the timing (the hand-over's cost counted); and one call on a tree
    of :data:`MANY_VALUES` str values, its hand-over counted.
    """
    from shared_td.bench.libraries import libraries
    from shared_td.bench.worker import JobWorker, shared_worker
    from shared_td.coordinator import ownership

    cold = []
    for run in range(options.repeat):  # a fresh process each: the run's worker first
        worker = shared_worker() if run == 0 else JobWorker()
        try:
            cold.append(worker.call(_first_share))
        finally:
            if run:
                worker.close()
    names = list(libraries())[::-1]  # tensordict first when installed, then shared_td
    out = {row: {name: min(c[row][name] for c in cold) for name in names} for row in cold[0]}
    calls = options.rounds

    def batch(lib):
        def setup():
            ownership.embedded_coordinator(start=False)  # the previous hand-over is done
            return [_small_td(lib) for _ in range(calls)]
        return setup

    def share_all(tds):
        for td in tds:
            td.memmap_(share_non_tensor=True)

    def share_all_handed_over(tds):
        share_all(tds)
        ownership.embedded_coordinator(start=False)  # shared_td's hand-over is done

    ownership.embedded_coordinator(start=True)  # warm: started (and the connection made)
    for lib in libraries().values():
        share_all_handed_over(batch(lib)())
    for row, run in [("warm: caller (per call)", share_all), ("warm: + hand-over done", share_all_handed_over)]:
        # a timing costs a few ms: best of 3 even with --quick
        warm = best_of_each(max(options.repeat, 3), {name: (batch(lib), run) for name, lib in libraries().items()})
        out[row] = {name: warm[name] / calls for name in names}
    # a tree of many values (per-environment task names, say): one memfd for them all
    many = best_of_each(max(options.repeat, 3), {
        name: (_many_values_setup(lib), share_all_handed_over) for name, lib in libraries().items()})
    out[f"warm: {MANY_VALUES} values + hand-over"] = {name: many[name] for name in names}
    ownership.embedded_coordinator(start=False)
    return out


#: the number of str values of share_nontensor's "many values" row
MANY_VALUES = 200


def _many_values_setup(lib):
    def setup():
        from shared_td.coordinator import ownership

        ownership.embedded_coordinator(start=False)  # the previous hand-over is done
        return [lib.TensorDict({f"task{i}": f"walk to door {i}" for i in range(MANY_VALUES)}, batch_size=[])]
    return setup


def _first_share(connection) -> dict:
    """In the worker: the first memmap_(share_non_tensor=True) of each library."""
    import time

    from shared_td.bench.libraries import libraries
    from shared_td.coordinator import ownership

    import multiprocessing

    os.environ.pop(ownership.ENV_VAR, None)  # no parent's coordinator: a cold start
    # as in a program's own process: a spawned child inherits the "spawn" start method,
    # which would make tensordict's first call (it starts a multiprocessing Manager)
    # re-import torch in the manager, seconds instead of tens of ms
    multiprocessing.set_start_method(None, force=True)
    if ownership._EMBEDDED is not None:
        raise RuntimeError("the worker has an embedded coordinator already: not a cold start")
    first, ready = {}, {}
    # tensordict first: its Manager's fork would wait for shared_td's background start
    for name, lib in reversed(libraries().items()):
        td = _small_td(lib)
        start = time.perf_counter()
        td.memmap_(share_non_tensor=True)
        first[name] = time.perf_counter() - start
        if name == "shared_td":
            ownership.embedded_coordinator(start=False)  # waits for the background start
        ready[name] = time.perf_counter() - start
    return {"cold: first call": first, "cold: + coordinator ready": ready}
