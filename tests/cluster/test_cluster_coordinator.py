"""The cluster through the Coordinator's own API: Coordinator(cluster=..., node=, nodes=,
authkey=), publish(replicate=True), attach, sync, pull, push, version, counter; two node
process trees (forkserver children, see test_cluster.py) on 127.0.0.1."""
from __future__ import annotations

import tempfile

import pytest

pytest.importorskip("torch.distributed")

from tests.cluster import cluster_children as kids  # noqa: E402
from tests.processes import WAIT, finish  # noqa: E402
from tests.cluster.test_cluster import KEY, node_context, store  # noqa: E402,F401  (store: the fixture)


def test_coordinator_cluster_api(store):
    ctx = node_context()
    url = f"tcp://127.0.0.1:{store.port}?host=0"
    results = [ctx.Queue() for _ in range(2)]
    procs = [ctx.Process(target=kids.coordinator_node, args=(url, n, 2, KEY, results[n], tempfile.gettempdir())) for n in range(2)]
    for proc in procs:
        proc.start()
    try:
        owner = results[0].get(timeout=WAIT)
        other = results[1].get(timeout=WAIT)
    finally:
        for proc in procs:
            assert finish(proc) == 0
    # version 3: the attach's pull was delivery 2, the sync 3
    assert owner == ("ok", [1], [-1.0, -1.0, 5.0], 3), owner
    assert other == ("ok", [2.0, 3.0], ([5.0, 5.0], 3), True, ["policy"]), other
