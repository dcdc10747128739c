"""A node's start() while the store's host is stopped (fuzz17): its first connection is
bounded (torch's client waits for the host's first answer with no limit once the kernel
completed the connect: start() waited as long as the host was stopped), and a node
itself stopped past its join deadline looks at the join records once more before it
says that the others did not join (they had, meanwhile: the cluster split)."""
import socket
import threading
import time
import types

import pytest

pytest.importorskip("torch.distributed")

import shared_td  # noqa: E402
from shared_td.coordinator import cluster_membership as cm  # noqa: E402


def test_start_with_a_store_host_that_never_answers_is_bounded():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)  # the kernel completes each connect; nothing ever answers (as for a stopped host)
    port = listener.getsockname()[1]
    out = []

    def start():
        t0 = time.monotonic()
        try:
            shared_td.Coordinator(cluster=f"tcp://127.0.0.1:{port}", node=1, nodes=2, timeout=2.0,
                                  authkey="fuzz17-cluster-key-0123456789abcdef").start()
            out.append(("started", time.monotonic() - t0))
        except BaseException as err:  # noqa: BLE001
            out.append((err, time.monotonic() - t0))

    thread = threading.Thread(target=start, daemon=True)
    thread.start()
    thread.join(15.0)  # due within two timeouts (a connect), plus slack
    listener.close()  # (resets the connections: a thread still blocked ends)
    thread.join(30.0)
    assert out, "start() did not return within 15 s"
    err, took = out[0]
    assert isinstance(err, ConnectionError), err
    assert "did not answer" in str(err)
    assert took < 15.0


class _Store:
    def __init__(self):
        self.records = {}

    def has(self, key):
        return key in self.records

    def get_json(self, key):
        return self.records[key]


def test_join_looks_again_after_its_deadline(monkeypatch):
    store = _Store()
    clock = [100.0]
    looked = []

    def has(key):  # node 1 not there yet; this process is then stopped for 10 s, node 1 joins meanwhile
        found = key in store.records
        if not looked:
            looked.append(key)
            clock[0] += 10.0
            store.records["join/1"] = {"node": 1, "nodes": 2}
        return found

    store.has = has
    monkeypatch.setattr(cm, "time", types.SimpleNamespace(monotonic=lambda: clock[0],
                                                          sleep=lambda s: clock.__setitem__(0, clock[0] + s)))
    node = types.SimpleNamespace(node=0, nodes=2, timeout=3.0, _store=store)
    cm.ClusterMembership._wait_for_the_others(node)  # before the fix: TimeoutError "nodes 1 did not join"


def test_join_still_times_out(monkeypatch):
    store = _Store()
    clock = [100.0]
    monkeypatch.setattr(cm, "time", types.SimpleNamespace(monotonic=lambda: clock[0],
                                                          sleep=lambda s: clock.__setitem__(0, clock[0] + 1.0)))
    node = types.SimpleNamespace(node=0, nodes=2, timeout=3.0, _store=store)
    with pytest.raises(TimeoutError):
        cm.ClusterMembership._wait_for_the_others(node)


def test_start_with_no_store_host_there_is_a_connection_error():
    """No process listens at the store's address (node 0 not started, a wrong port): a
    ConnectionError naming the address once torch's connect tries end (it was torch's
    DistNetworkError, a RuntimeError, unlike every other lost-store error)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # (closed: nothing listens there)
    started = time.monotonic()
    with pytest.raises(ConnectionError, match=f"127.0.0.1:{port}"):
        shared_td.Coordinator(cluster=f"tcp://127.0.0.1:{port}", node=1, nodes=2, timeout=1.0,
                              authkey="no-store-host-key-0123456789abcdef").start()
    assert time.monotonic() - started < 15.0
