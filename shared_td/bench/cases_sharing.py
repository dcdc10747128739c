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
from shared_td.bench.timing import best_of, fresh_dir


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
    the layout (its own row: names() costs one)."""
    import shared_td

    def leaves():
        return shared_td.TensorDict({f"k{i}": torch.zeros(4) for i in range(100)})

    rounds = options.rounds
    prefix = os.path.join(root, "published")
    out = {}
    with shared_td.Coordinator() as coord:
        coord.publish("anonymous", leaves())
        coord.publish("files", leaves(), prefix=prefix)
        floor_of = {"anonymous": _anonymous_floor(coord.attach("anonymous")),
                    "files": _files_floor(coord.attach("files"))}
        for name in ["anonymous", "files"]:
            coord.attach(name)  # the connection is made once per process
            out[f"floor {name}"] = best_of(
                options.repeat, lambda: None,
                lambda _, n=name: [floor_of[n]() for _ in range(rounds)],
            ) / rounds
            out[f"{name}, 100 leaves"] = best_of(
                options.repeat, lambda: None,
                lambda _, n=name: [coord.attach(n) for _ in range(rounds)],
            ) / rounds
        out["names() round trip"] = best_of(
            options.repeat, lambda: None, lambda _: [coord.names() for _ in range(rounds)]
        ) / rounds
    return out


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
