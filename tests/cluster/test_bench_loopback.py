"""The benchmark's loopback cluster: its store listens on IPv4 only (no reverse lookup in
the store's event loop: shared_td/bench/loopback.py), and a run starts one cluster for
cluster_counter and cluster_value -- early, in the background, in a quick run."""
from __future__ import annotations

import contextlib
import io
import os
import threading

import pytest

pytest.importorskip("torch.distributed")

from shared_td.bench import CASES, BenchOptions, run  # noqa: E402
from shared_td.bench import cases_cluster  # noqa: E402
from shared_td.bench.cases_cluster import _Loopback  # noqa: E402
from shared_td.bench.loopback import loopback_store  # noqa: E402
from shared_td.coordinator.cluster import Cluster  # noqa: E402
from tests.processes import WAIT, wait_until  # noqa: E402

_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp*


def _listeners(port: int) -> dict[str, list[str]]:
    """table ("tcp", "tcp6") -> the local addresses (hex, as the kernel shows them)
    listening on ``port``."""
    found: dict[str, list[str]] = {}
    for table in ("tcp", "tcp6"):
        with open(f"/proc/net/{table}") as lines:
            next(lines)
            for line in lines:
                local, state = line.split()[1], line.split()[3]
                address, hex_port = local.rsplit(":", 1)
                if state == _LISTEN and int(hex_port, 16) == port:
                    found.setdefault(table, []).append(address)
    return found


@pytest.mark.timeout(60)
def test_the_loopback_clusters_store_listens_on_ipv4_127_0_0_1_only():
    """A store that binds ``::`` sees its loopback peers as ``::ffff:127.0.0.1``, which
    torch resolves in the store's event loop at every accept (a dropped DNS query stalls
    every node 5 s); on 127.0.0.1 they are named by /etc/hosts."""
    loop = _Loopback()
    try:
        assert _listeners(loop.store.port) == {"tcp": ["0100007F"]}  # 127.0.0.1, little-endian
        assert loop.nodes[1].counter("c").fetch_add(2) == 0 and loop.nodes[0].counter("c").value == 2
    finally:
        loop.close()


def test_loopback_store_leaks_no_descriptor():
    before = set(os.listdir("/proc/self/fd"))
    store = loopback_store(5.0)
    port = store.port
    store.set("k", b"v")
    assert store.get("k") == b"v"
    del store
    assert wait_until(lambda: set(os.listdir("/proc/self/fd")) <= before, WAIT)
    assert _listeners(port) == {}


def _count_node_starts(monkeypatch) -> list[str]:
    """Patch Cluster.start to record the name of the thread of each node start."""
    starts: list[str] = []
    real = Cluster.start

    def start(self):
        starts.append(threading.current_thread().name)
        return real(self)

    monkeypatch.setattr(Cluster, "start", start)
    return starts


def _run(options) -> tuple[int, str]:
    with contextlib.redirect_stdout(io.StringIO()) as out:
        status = run(options)
    return status, out.getvalue()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("quick", [True, False])
def test_a_run_starts_one_loopback_cluster_for_the_counter_and_value_cases(monkeypatch, quick):
    starts = _count_node_starts(monkeypatch)
    options = BenchOptions.quick(only=["cluster_counter", "cluster_value"], rounds=2)
    if not quick:
        options.early_peers = False
    status, out = _run(options)
    assert status == 0 and "failed" not in out, out
    assert len(starts) == 2, starts  # its two nodes, once (it was one cluster per case)
    rows = [line.split()[0] for line in out.splitlines()[2:]]
    assert rows == ["cluster_counter"] * 2 + ["cluster_value"] * 3, out


@pytest.mark.timeout(120)
def test_a_quick_run_starts_the_loopback_cluster_before_its_first_case(monkeypatch):
    """Its start (and any stalled connect of it) overlaps the cases before the cluster
    ones; a full run starts it at the first case that needs it."""
    starts = _count_node_starts(monkeypatch)

    def first(options, root):
        assert wait_until(lambda: len(starts) == 2, WAIT), "the cluster did not start meanwhile"
        return {"floor": 1.0}

    monkeypatch.setitem(CASES, "tree_load", first)
    status, out = _run(BenchOptions.quick(only=["tree_load", "cluster_counter"], rounds=2))
    assert status == 0 and "failed" not in out, out

    def before_any(options, root):
        assert starts == [], starts
        return {"floor": 1.0}

    starts.clear()
    monkeypatch.setitem(CASES, "tree_load", before_any)
    status, out = _run(BenchOptions(only=["tree_load", "cluster_counter"], rounds=2, repeat=1))
    assert status == 0 and "failed" not in out, out
    assert len(starts) == 2


@pytest.mark.timeout(60)
@pytest.mark.parametrize("quick", [True, False])
def test_a_cluster_that_does_not_start_fails_its_cases_and_the_others_run(monkeypatch, quick):
    def broken(coordinator=None):
        raise RuntimeError("no store today")

    monkeypatch.setattr(cases_cluster, "_Loopback", broken)
    monkeypatch.setitem(CASES, "tree_load", lambda options, root: {"floor": 1.0})
    options = BenchOptions.quick(only=["cluster_counter", "tree_load", "cluster_value"])
    if not quick:
        options.early_peers = False
    status, out = _run(options)
    assert status == 1
    assert "cluster_counter failed: RuntimeError: no store today" in out
    assert "cluster_value   failed: RuntimeError: no store today" in out
    assert "tree_load       floor" in out


@pytest.mark.timeout(60)
def test_a_node_that_fails_to_start_fails_the_loopback_and_stops_the_other(monkeypatch):
    real, started = Cluster.start, []

    def start(self):
        if self.node == 1:
            raise ValueError("node 1 refused")
        started.append(self)
        return real(self)

    monkeypatch.setattr(Cluster, "start", start)
    monkeypatch.setattr(Cluster, "__init__", _short_timeout(Cluster.__init__))
    with pytest.raises(RuntimeError, match="node 1 refused"):
        _Loopback()
    assert started and all(node._stop.is_set() for node in started)  # shut down


def _short_timeout(init):
    def short(self, *args, **kwargs):  # node 0 waits for node 1's join record 2 s, not 60
        init(self, *args, **{**kwargs, "timeout": 2})
    return short


@pytest.mark.timeout(60)
def test_the_loopback_cluster_stops_after_the_last_case_that_uses_it(monkeypatch):
    """Its threads (heartbeats, and a values poller every ms once cluster_value published
    a value) must not run beside the cases after it."""
    nodes: list[Cluster] = []
    real = Cluster.start

    def start(self):
        nodes.append(self)
        return real(self)

    def after(options, root):
        assert len(nodes) == 2 and all(node._stop.is_set() for node in nodes), "the cluster still runs"
        return {"floor": 1.0}

    monkeypatch.setattr(Cluster, "start", start)
    monkeypatch.setitem(CASES, "tree_load", after)
    status, out = _run(BenchOptions.quick(only=["cluster_value", "tree_load"], rounds=2))
    assert status == 0 and "failed" not in out, out
