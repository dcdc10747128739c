"""A fork made while another thread of a node connects to the store: the child's own
first connect (made anew: cluster_store's _STORES) must not wait for ever on a lock that
thread held at the fork (glibc's resolver lock, taken by torch's connect)."""
import datetime
import gc
import os
import signal
import threading
import time

import pytest

dist = pytest.importorskip("torch.distributed")

from shared_td.coordinator import cluster_store_watch  # noqa: E402
from shared_td.coordinator.cluster_store import SignedStore  # noqa: E402
from tests.processes import fork_exit_code  # noqa: E402

HELD = threading.Lock()  # stands for the resolver's lock, held while a connect runs


class _SlowClone:
    """The store's raw store, whose clone (a connect) holds HELD for a while."""

    def __init__(self, raw, seconds: float = 0.5):
        self.raw, self.seconds = raw, seconds

    def clone(self):
        with HELD:
            time.sleep(self.seconds)
            return self.raw.clone()


def test_a_fork_waits_for_a_connect_under_way():
    raw = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=5), wait_for_workers=False)
    signed = SignedStore(raw, b"fork mid connect test key 012345", timeout=5.0)
    signed.set_json("a", 1)
    signed._raw = _SlowClone(raw)  # every later connection connects slowly
    other = threading.Thread(target=signed._take_connection)  # another thread's first call connects
    other.start()
    time.sleep(0.1)  # it is connecting now
    pid = os.fork()
    if pid == 0:
        gc.disable()  # (the test process's garbage is not the child's to collect: a fork in a test runner)
        signal.alarm(10)
        os._exit(0 if signed.get_json("a") == 1 else 1)
    outcome = fork_exit_code(pid, 20)
    other.join(10)
    signed.close()
    assert outcome == 0, "the fork child's first call hung"


def test_a_child_forked_past_the_wait_refuses_to_connect(monkeypatch):
    monkeypatch.setattr(cluster_store_watch, "FORK_WAIT_S", 0.2)
    raw = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=5), wait_for_workers=False)
    signed = SignedStore(raw, b"fork mid connect test key 012345", timeout=5.0)
    signed.set_json("a", 1)
    signed._raw = _SlowClone(raw, seconds=2.0)
    other = threading.Thread(target=signed._take_connection)
    other.start()
    time.sleep(0.1)
    began = time.monotonic()
    pid = os.fork()
    if pid == 0:
        gc.disable()  # (the test process's garbage is not the child's to collect: a fork in a test runner)
        signal.alarm(10)
        try:
            signed.get_json("a")
        except ConnectionError as err:
            os._exit(0 if "forked while another thread" in str(err) else 1)
        os._exit(2)
    waited = time.monotonic() - began
    outcome = fork_exit_code(pid, 20)
    other.join(10)
    signed.close()
    assert outcome == 0, outcome
    assert waited < 1.5  # the fork waited FORK_WAIT_S at most


def test_the_forking_threads_own_entry_is_not_waited_for():
    cluster_store_watch._lookups.add(threading.get_ident())  # left behind by a Ctrl-C in its __exit__
    try:
        began = time.monotonic()
        pid = os.fork()
        if pid == 0:
            os._exit(0 if not cluster_store_watch._forked_mid_lookup else 1)
        waited = time.monotonic() - began
    finally:
        cluster_store_watch._lookups.discard(threading.get_ident())
    assert fork_exit_code(pid, 20) == 0
    assert waited < cluster_store_watch.FORK_WAIT_S / 2
