"""A store host that stops answering (SIGSTOP: a frozen machine, or a network partition
that sends no reset) held every store call of the other nodes, and their shutdown, for
as long as it lasted: torch's TCPStore client waits for a plain call's answer with no
limit (fuzz16: a sync with a 15 s timeout returned after 100 s, a close took 120 s).
Now each call is due within the node's timeout (plus what it waits for by itself), and
once one is overdue the host is taken as lost: ConnectionError, as for a host killed
(cluster_store_watch)."""
from __future__ import annotations

import datetime
import multiprocessing
import os
import queue
import signal
import socket
import threading
import time

import pytest

dist = pytest.importorskip("torch.distributed")

from shared_td.coordinator.cluster_store import SignedStore  # noqa: E402
from tests.cluster import stalled_host_children as children  # noqa: E402
from tests.processes import WAIT, all_threads_stopped, wait_until  # noqa: E402

KEY = "a-stopped-store-host-test-key-0123456789"
#: The slack allowed past a bound, for a loaded machine (the full suite runs cluster
#: tests two at a time on 2 cores).
SLACK_S = 5.0


class _Caller:
    """A thread that makes the calls it is given, each timed; its store connection is
    made first (a thread's first call connects, and torch tries a connect again until its
    own timeout: not what is measured here). Each answer is waited for within WAIT
    (before the fix a call never returned)."""

    def __init__(self, store):
        self.calls, self.answers = queue.SimpleQueue(), queue.SimpleQueue()
        threading.Thread(target=self._run, daemon=True).start()
        self(lambda: store.has("a"))

    def _run(self):
        while True:
            call = self.calls.get()
            started = time.monotonic()
            try:
                result = call()
            except Exception as err:  # noqa: BLE001 - the outcome under test
                result = err
            self.answers.put((result, time.monotonic() - started))

    def __call__(self, call) -> tuple[object, float]:
        self.calls.put(call)
        try:
            return self.answers.get(timeout=WAIT)
        except queue.Empty:
            return None, float("inf")


def test_calls_to_a_stopped_host_fail_within_their_bound_and_only_its_connections_are_cut():
    ctx = multiprocessing.get_context("spawn")
    ports = ctx.Queue()
    host = ctx.Process(target=children.store_host, args=(ports,), daemon=True)
    host.start()
    listener = socket.create_server(("127.0.0.1", 0))
    try:
        port = ports.get(timeout=WAIT)
        raw = dist.TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=5))
        store = SignedStore(raw, KEY.encode(), timeout=1.0)
        store.set_json("a", 1)
        caller, popper = _Caller(store), _Caller(store)
        assert popper(lambda: store.pop_json("queue/x", 0.01))[0] is None  # (its pop connection, made)
        popper.calls.put(lambda: store.pop_json("queue/x", 30.0))  # (it waits 30 s by itself)
        other = socket.create_connection(listener.getsockname())  # not the store's: never cut
        accepted, _ = listener.accept()
        os.kill(host.pid, signal.SIGSTOP)
        assert wait_until(lambda: all_threads_stopped(host.pid), timeout=5)  # (kill returns before it stops)
        try:
            outcome, took = caller(lambda: store.has("a"))
            assert isinstance(outcome, ConnectionError) and "did not answer" in str(outcome), outcome
            assert took < 1.0 + SLACK_S
            popped, pop_took = popper.answers.get(timeout=WAIT)
            assert isinstance(popped, ConnectionError) and pop_took < 1.0 + SLACK_S, popped
            outcome, took = caller(lambda: store.set_json("b", 2))  # the host is lost: at once
            assert isinstance(outcome, ConnectionError) and took < SLACK_S
            other.sendall(b"x")
            assert accepted.recv(1) == b"x"
            other.close()
            accepted.close()
            store.close()  # (its watch thread ends: bounded here, as a loaded machine may be slow)
            store._watch._thread.join(WAIT)
            assert not store._watch._thread.is_alive()
        finally:
            os.kill(host.pid, signal.SIGCONT)
    finally:
        listener.close()
        host.kill()
        host.join(WAIT)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.parametrize("first", ["sync", "stop"])
def test_a_node_whose_store_host_stopped_answers_and_closes_within_its_timeout(first):
    """Node 0 hosts the store and holds a replica of node 1's "p"; node 0 is stopped.
    Node 1's sync, a cluster counter's fetch_add and its shutdown each end within the
    node's timeout (plus slack); before, each waited until node 0 ran again."""
    timeout = 4.0
    ctx = multiprocessing.get_context("spawn")
    url = f"tcp://127.0.0.1:{_free_port()}"
    channels = [(ctx.Queue(), ctx.Queue()) for _ in range(2)]
    nodes = [ctx.Process(target=children.node, args=(url, n, KEY, timeout, *channels[n]), daemon=True)
             for n in range(2)]
    for process in nodes:
        process.start()

    def ask(n, command):
        channels[n][0].put(command)
        return channels[n][1].get(timeout=WAIT)

    try:
        assert [channels[n][1].get(timeout=WAIT)[0] for n in range(2)] == ["ok", "ok"]
        assert ask(1, "publish")[0] == ("ok",)
        assert ask(0, "attach")[0] == ("ok",)
        os.kill(nodes[0].pid, signal.SIGSTOP)
        try:
            assert wait_until(lambda: all_threads_stopped(nodes[0].pid), timeout=5)  # (kill returns before it stops)
            if first == "sync":
                (outcome, *why), took = ask(1, "sync")
                assert outcome == "ConnectionError" and "did not answer" in why[0] and took < timeout + SLACK_S
                (outcome, *_), took = ask(1, "counter")  # the host is lost: at once
                assert outcome == "ConnectionError" and took < SLACK_S
            what, took = ask(1, "stop")
            assert what == "stopped" and took < timeout + SLACK_S
            nodes[1].join(WAIT)
            assert nodes[1].exitcode == 0
        finally:
            os.kill(nodes[0].pid, signal.SIGCONT)
        assert ask(0, "stop")[0] == "stopped"
        nodes[0].join(WAIT)
        assert nodes[0].exitcode == 0
    finally:
        for process in nodes:
            if process.is_alive():
                os.kill(process.pid, signal.SIGCONT)
                process.kill()
                process.join(WAIT)


def test_a_watch_thread_that_cannot_start_fails_no_call_and_is_tried_again(monkeypatch):
    """The thread limit: the store's calls go on (unwatched, as before the watch), and
    the next call starts the thread; close() does not join a thread never started."""
    from torch.distributed import HashStore

    real_start = threading.Thread.start

    def refused(thread):
        if thread.name == "shared_td-store-watch":
            raise RuntimeError("can't start new thread")
        real_start(thread)

    store = SignedStore(HashStore(), KEY.encode(), timeout=5.0)
    monkeypatch.setattr(threading.Thread, "start", refused)
    store.set_json("a", 1)
    assert store.get_json("a") == 1 and store._watch._thread is None
    monkeypatch.setattr(threading.Thread, "start", real_start)
    store.set_json("b", 2)
    assert store._watch._thread is not None and store._watch._thread.is_alive()
    store.close()
    assert not store._watch._thread.is_alive()
