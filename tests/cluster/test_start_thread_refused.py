"""A cluster node whose start cannot start a thread (RLIMIT_AS / RLIMIT_NPROC set before
start()): a RuntimeError naming the node and the limits (before: a bare "can't start new
thread" from the store's spare connections), nothing left running, a later start works.
(limits22; with the real limit: RLIMIT_AS = VmSize + 8..24 MiB set before start.)"""
import os
import socket
import threading
import types

import pytest

import shared_td
from shared_td.coordinator import cluster_store


class _RefusedThread(threading.Thread):
    def start(self):
        raise RuntimeError("can't start new thread")


# cluster_store's threading, whose threads the system refuses (as under the limits)
_RefusingThreading = types.SimpleNamespace(**{**vars(threading), "Thread": _RefusedThread})


_KEY = b"limits22-test-key-0123456789abcdef"


def _free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_cluster_node_start_without_threads_names_the_limits(monkeypatch):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    spec = f"tcp://127.0.0.1:{_free_port()}"
    before = threading.active_count()
    monkeypatch.setattr(cluster_store, "threading", _RefusingThreading)
    coord = shared_td.Coordinator(cluster=spec, node=0, nodes=1, timeout=10.0, authkey=_KEY)
    with pytest.raises(RuntimeError, match="Cluster node 0.*RLIMIT_NPROC.*RLIMIT_AS"):
        coord.start()
    monkeypatch.undo()
    assert threading.active_count() == before
    with shared_td.Coordinator(cluster=f"tcp://127.0.0.1:{_free_port()}", node=0, nodes=1, timeout=10.0, authkey=_KEY) as again:
        assert again.cluster is not None
