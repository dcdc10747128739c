"""Benchmark case of cluster-wide non-tensor values, on loopback: two cluster nodes in one
process (see :mod:`shared_td.bench.cases_cluster`).

How long a changed ``share_non_tensor`` value takes to be seen on the other node, and
what an unchanged value costs to read there, beside the same read on one node.
"""
from __future__ import annotations

import statistics
import time

import torch

from shared_td.bench.cases_cluster import _Loopback
from shared_td.bench.timing import best_of


def case_cluster_value(options, root: str, loop: _Loopback | None = None) -> dict:
    """The read of an unchanged value on the replica node against the same read on one
    node, per read; then a value set on the owner node until the other node reads it
    (the median of ``rounds`` changes, at least 20; the reader looks every 10 µs).
    ``loop``: the run's loopback cluster (see :class:`~shared_td.bench.cases_cluster.SharedLoopback`),
    else the case starts its own."""
    import shared_td

    own = loop is None
    if own:
        loop = _Loopback()
    try:
        owner, other = loop.nodes
        td = owner.publish("cfg", shared_td.TensorDict(w=torch.zeros(4), task="v0", batch_size=[4]),
                           share_non_tensor=True)
        view = other.attach("cfg")
        one_node = shared_td.TensorDict(w=torch.zeros(4), task="v0", batch_size=[4]).memmap_(share_non_tensor=True)
        delays = []
        for i in range(1, max(options.rounds, 20) + 1):
            value = f"v{i}"
            began = time.perf_counter()
            td.set_("task", value)
            deadline = began + 10.0
            while view["task"] != value:
                if time.perf_counter() > deadline:
                    raise TimeoutError(f"the other node did not see {value!r} within 10 s")
                time.sleep(1e-5)
            delays.append(time.perf_counter() - began)
        reads = options.rounds * 50

        def read(entry):
            return lambda _: [entry.data for _ in range(reads)]

        return {
            "unchanged read, 1 node": best_of(options.repeat, lambda: None, read(one_node.get("task"))) / reads,
            "unchanged read, replica": best_of(options.repeat, lambda: None, read(view.get("task"))) / reads,
            "set -> seen on other node": statistics.median(delays),
        }
    finally:
        if own:
            loop.close()
