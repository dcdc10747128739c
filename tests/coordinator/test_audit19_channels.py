"""Audit 19 (third round): coordinator connections under Ctrl-C and signal handlers.

1. A second Ctrl-C landing in the cleanup of an interrupted call (at ``_forget``'s
   entry) never leaves the connection handed out out of step: before, every later call
   read the answer meant for the call before it (``attach("a")`` returned "b").
2. A Ctrl-C inside ``limit_waits`` never leaves an object that closes the connection's
   descriptor number later (before: a socket object over it, kept by the exception's
   traceback, closed whatever file had that number by then).
4. A call made by a signal handler (or finalizer) in the middle of this thread's own
   call on the same connection is answered (over a one-off connection), not refused
   with a false "did not answer within 5 s ... stopped".
5. A version table that cannot be opened while its manager lives makes its attach wait
   to tell a dead manager from a live one, but never with the process-wide table lock
   held: other threads' attach calls go on.

Each is deterministic (the interruption is raised by a monkeypatched function at the
point where CPython would run a signal handler). tensordict 0.15.3 has no coordinator:
nothing to compare.
"""
from __future__ import annotations

import gc
import os
import socket
import threading
import time
import types

import pytest
import torch

import shared_td
from shared_td.coordinator import channels, staleness
from shared_td.errors import SegmentUnavailableError

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def coord():
    with shared_td.Coordinator(timeout=5) as coordinator:
        coordinator.publish("a", shared_td.TensorDict(a_only=torch.zeros(1), batch_size=[]))
        for _ in range(3):
            coordinator.publish("b", shared_td.TensorDict(b_only=torch.ones(1), batch_size=[]))
        yield coordinator


def _version(coord, name):
    return channels.call(coord.address, coord.authkey, "version", name, timeout=5)


def _channel(coord):
    _version(coord, "a")  # the connection exists
    return channels._CHANNELS[(os.getpid(), coord.address, coord.authkey)]


def test_a_second_ctrl_c_in_the_cleanup_never_leaves_the_connection_out_of_step(coord, monkeypatch):
    expected = {"a": _version(coord, "a"), "b": _version(coord, "b")}
    assert expected["a"] != expected["b"]
    channel = _channel(coord)
    real_conn, real_forget = channel.conn, channels._forget

    class FirstCtrlC:
        """The connection: the first Ctrl-C lands while waiting for the answer."""

        def poll(self, *args):
            channel.conn = real_conn
            raise KeyboardInterrupt("first Ctrl-C, the request sent")

        def __getattr__(self, name):
            return getattr(real_conn, name)

    def second_ctrl_c(ch):
        monkeypatch.setattr(channels, "_forget", real_forget)
        raise KeyboardInterrupt("second Ctrl-C, at _forget's entry")

    channel.conn = FirstCtrlC()
    monkeypatch.setattr(channels, "_forget", second_ctrl_c)
    with pytest.raises(KeyboardInterrupt, match="second"):
        _version(coord, "b")
    # the answer to version("b") is unread on that connection: never read as another's
    for name in ["a", "b", "a", "b"]:
        assert _version(coord, name) == expected[name], name
    assert list(shared_td.attach("a", address=coord.address, authkey=coord.authkey).keys()) == ["a_only"]
    assert real_conn.closed  # dropped by the next call


class _CtrlCOnce(types.ModuleType):
    """``channels.socket``: the first thing limit_waits does with it raises
    KeyboardInterrupt, as a signal checked there would (for a call, once it returns)."""

    def __init__(self):
        super().__init__("socket")
        self.armed = False

    def __getattr__(self, name):
        value = getattr(socket, name)
        if not self.armed:
            return value
        self.armed = False
        if callable(value):
            def interrupted(*args, **kwargs):
                made = value(*args, **kwargs)  # held by the exception, as by its traceback in call()
                raise KeyboardInterrupt(f"Ctrl-C as socket.{name}() returns", made)
            return interrupted
        raise KeyboardInterrupt(f"Ctrl-C at socket.{name}")


def test_a_ctrl_c_in_limit_waits_never_closes_another_descriptor_later(coord, monkeypatch, tmp_path):
    channel = _channel(coord)
    number = channel.conn.fileno()
    fake = _CtrlCOnce()
    monkeypatch.setattr(channels, "socket", fake)
    real_limit = channels.limit_waits

    def limit_waits(conn, deadline):
        fake.armed = True
        try:
            return real_limit(conn, deadline)
        finally:
            fake.armed = False

    monkeypatch.setattr(channels, "limit_waits", limit_waits)
    kept = None
    try:
        _version(coord, "a")
    except KeyboardInterrupt as error:
        kept = error  # kept a while, as a logger or a test report would
    assert kept is not None
    monkeypatch.setattr(channels, "limit_waits", real_limit)
    monkeypatch.setattr(channels, "socket", socket)
    files = []
    try:
        while True:  # meanwhile this process opens files: one gets the freed number
            files.append(open(tmp_path / f"f{len(files)}", "w+b"))
            if files[-1].fileno() == number or len(files) > 256:
                break
        assert files[-1].fileno() == number
        del kept
        gc.collect()
        for f in files:
            os.fstat(f.fileno())  # before the fix: EBADF, closed by the stray socket
            f.write(b"data")
            f.flush()
    finally:
        for f in files:
            f.close()
    assert _version(coord, "a") >= 1


def test_a_call_nested_in_this_threads_own_call_is_answered(coord):
    expected = _version(coord, "b")
    channel = _channel(coord)
    real = channel.conn
    nested = {}

    class HandlerRunsWhileWaiting:
        """The connection: a signal handler calling the coordinator runs during the wait."""

        def poll(self, timeout):
            channel.conn = real
            start = time.monotonic()
            try:
                nested["answer"] = _version(coord, "b")
            except Exception as error:  # noqa: BLE001 (reported by the assert below)
                nested["answer"] = f"{type(error).__name__}: {error}"
            nested["took"] = time.monotonic() - start
            return real.poll(timeout)

        def __getattr__(self, name):
            return getattr(real, name)

    channel.conn = HandlerRunsWhileWaiting()
    assert _version(coord, "a") == 1  # the interrupted call gets its own answer
    assert nested["answer"] == expected, nested["answer"]
    assert nested["took"] < 2.0
    # the side connection was one-off: the process's own one is still the same
    assert channels._CHANNELS[(os.getpid(), coord.address, coord.authkey)] is channel
    assert _version(coord, "b") == expected


def test_a_table_failure_with_a_live_manager_holds_up_no_other_attach(coord, monkeypatch):
    shared_td.attach("a", address=coord.address, authkey=coord.authkey)  # its table is mapped
    entered, release = threading.Event(), threading.Event()

    def exited(pid, pidfd, wait=staleness._EXIT_SHOWS_S):
        entered.set()
        release.wait(10)  # stands for the wait that tells a dead manager from a live one
        return False

    monkeypatch.setattr(staleness, "_exited", exited)
    failure = {}

    def bad():
        try:  # a live manager, a descriptor it does not have
            staleness._map_table(coord.pid, 9999, (0, 123456789), 64, address=coord.address)
        except Exception as error:  # noqa: BLE001 (checked below)
            failure["error"] = error

    bad_thread = threading.Thread(target=bad, daemon=True)
    bad_thread.start()
    try:
        assert entered.wait(10)
        other = threading.Thread(
            target=shared_td.attach, args=("a",),
            kwargs={"address": coord.address, "authkey": coord.authkey}, daemon=True)
        other.start()
        other.join(2.0)
        assert not other.is_alive(), "an attach to a healthy coordinator waited on the table lock"
    finally:
        release.set()
        bad_thread.join(10)
    assert isinstance(failure.get("error"), SegmentUnavailableError), failure
    assert not isinstance(failure["error"], ConnectionError)  # the manager lives: not "gone"


def test_a_call_made_while_this_thread_holds_the_connection_table_is_answered(coord):
    # final audit of f386d0b: a signal handler (or a finalizer) that calls the coordinator
    # while the call it interrupted holds the table's lock (mid-lookup) waited for itself
    # for ever (the lock was a plain Lock); it now goes over a side connection
    answers = []

    def interrupted_mid_lookup():
        with channels._CHANNELS_LOCK:  # as if a handler ran inside _channel's lookup
            answers.append(_version(coord, "b"))

    thread = threading.Thread(target=interrupted_mid_lookup, daemon=True)
    thread.start()
    thread.join(10)
    assert not thread.is_alive(), "the nested call waited on its own thread's table lock"
    assert answers == [_version(coord, "b")]
