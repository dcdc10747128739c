"""The store stall watch (cluster_store_watch) must not take a healthy host as lost -- a
connect's own time, this process's own pause, a close interrupted after it bounded its
calls -- and must still cut when one lookup of the host's name fails (review48)."""
from __future__ import annotations

import datetime
import multiprocessing
import os
import signal
import socket
import threading
import time
import types

import pytest
import torch

dist = pytest.importorskip("torch.distributed")

import shared_td  # noqa: E402
from shared_td.coordinator import cluster_membership  # noqa: E402

from shared_td.coordinator import cluster_store_watch  # noqa: E402
from shared_td.coordinator.cluster_store import SignedStore  # noqa: E402
from shared_td.coordinator.cluster_store_watch import StallWatch  # noqa: E402
from tests.cluster import stalled_host_children as children  # noqa: E402
from tests.cluster.test_cluster_store import _pair, store  # noqa: E402,F401 (fixtures)
from tests.processes import all_threads_stopped, wait_until  # noqa: E402

KEY = b"review48-store-watch-key-0123456789"


class _SlowConnect(dist.TCPStore):
    def clone(self):
        time.sleep(1.5)  # a connect's reverse DNS lookup that the resolver dropped (5 s; 1 s with RES_OPTIONS)
        return super().clone()


def test_a_slow_connect_inside_a_call_is_not_a_stalled_host():
    host = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=10), wait_for_workers=False)
    raw = _SlowConnect("127.0.0.1", host.port, None, False, datetime.timedelta(seconds=10))
    store = SignedStore(raw, KEY, timeout=1.0)
    try:
        store.set_json("a", 1)  # this thread's first call: it connects (no spare)
        assert not store._host_lost and store.get_json("a") == 1
    finally:
        store.close()


def test_a_pause_of_this_process_is_not_a_stalled_host(monkeypatch):
    offset = [0.0]
    clock = types.SimpleNamespace(monotonic=lambda: time.monotonic() + offset[0])
    monkeypatch.setattr(cluster_store_watch, "time", clock)
    watch = StallWatch(None, on_stall=lambda: None)
    watch.calls[1] = clock.monotonic() + 3.0  # a call in flight, due in 3 s
    watch.start()
    try:
        time.sleep(0.6)
        offset[0] += 5.0  # the process was stopped 5 s (SIGSTOP, a frozen VM): its threads did not run
        time.sleep(0.6)  # running again: the call's answer is there
        assert not watch.stalled.is_set()
        assert watch.stalled.wait(4.0)  # still in flight past its due: the host is lost
    finally:
        watch.close()


def test_a_lookup_of_the_host_lost_at_the_stall_still_cuts(monkeypatch):
    ctx = multiprocessing.get_context("spawn")
    ports = ctx.Queue()
    host = ctx.Process(target=children.store_host, args=(ports,), daemon=True)
    host.start()
    try:
        raw = dist.TCPStore("localhost", ports.get(timeout=60), None, False, datetime.timedelta(seconds=5))
        store = SignedStore(raw, KEY, timeout=1.0)
        store.set_json("a", 1)
        time.sleep(0.5)  # (the watch, started by that call, is running)
        real, misses = socket.getaddrinfo, [1]

        def lookup(*args, **kwargs):  # one lookup of the name lost (a dropped DNS query)
            if misses and args and args[0] == "localhost":
                misses.pop()
                raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
            return real(*args, **kwargs)

        monkeypatch.setattr(cluster_store_watch.socket, "getaddrinfo", lookup)
        resume = threading.Timer(6.0, os.kill, (host.pid, signal.SIGCONT))  # (bounded: the host runs again)
        resume.start()
        os.kill(host.pid, signal.SIGSTOP)
        assert wait_until(lambda: all_threads_stopped(host.pid), timeout=5)  # (kill returns before it stops)
        began = time.monotonic()
        try:
            with pytest.raises(ConnectionError, match="did not answer"):
                store.has("a")  # (this thread's connection, made above); before: returned once the host ran again
            assert time.monotonic() - began < 1.0 + 3.0
        finally:
            resume.cancel()
            os.kill(host.pid, signal.SIGCONT)
    finally:
        host.kill()
        host.join(30)


TIMEOUT = 2.0


def test_an_interrupted_shutdown_leaves_no_stall_bound_armed(store, monkeypatch):
    owner, other = _pair(store, timeout=TIMEOUT)
    try:
        real = cluster_membership.stop_deliveries

        def stopped(cluster):
            real(cluster)
            raise KeyboardInterrupt  # a Ctrl-C as the delivery threads were told to stop

        monkeypatch.setattr(cluster_membership, "stop_deliveries", stopped)
        with pytest.raises(KeyboardInterrupt):
            other.shutdown()
        monkeypatch.setattr(cluster_membership, "stop_deliveries", real)
        time.sleep(TIMEOUT + 1.0)  # the host answers all along
        assert not owner._store._host_lost and not other._store._host_lost
        owner.publish("p", shared_td.TensorDict(x=torch.zeros(4), batch_size=[4]))  # the other node's sockets uncut
        other.shutdown()
        assert b"left." in store.get("shared_td/claim/1")  # its number released
    finally:
        for member in (owner, other):
            member.shutdown()
