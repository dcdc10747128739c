"""Audit 19, finding 2: a manager that dies right after answering publish or attach
makes the call raise the documented ConnectionError naming the coordinator's address
(and its manager's pid), not a SegmentUnavailableError (a RuntimeError) that tells the
caller to keep a "sender" alive. Deterministic: ``client.call`` is wrapped so that the
manager is SIGKILLed, and seen exited, right after its answer arrives; the name's
memory is files (a prefix), so the coordinator's version table is the one thing left
to open from the dead manager.

Also the channels.call site of finding 1: an exception raised by a signal handler just
as the connection's lock is taken (Ctrl-C) leaves that lock free, so the next call on
the healthy coordinator does not wait out its timeout. tensordict 0.15.3 has no
coordinator: nothing to compare.
"""
from __future__ import annotations

import os
import select
import signal
import time

import pytest
import torch

import shared_td
from shared_td.coordinator import channels, client, staleness
from shared_td.storage.cache import InodeCache

pytestmark = pytest.mark.timeout(60)
WAIT = 20  # seconds: the bound on waiting for the killed manager to exit


def tree():
    return shared_td.TensorDict(a=torch.zeros(4), batch_size=[4])


def kill_after(monkeypatch, pid: int, method: str) -> None:
    """Make ``client.call`` SIGKILL the manager ``pid`` once its answer to ``method``
    has arrived, and return that answer only when the manager has exited."""
    real = client.call

    def call(address, authkey, name, *args, **kwargs):
        answer = real(address, authkey, name, *args, **kwargs)
        if name == method:
            pidfd = os.pidfd_open(pid)
            try:
                exited = select.poll()
                exited.register(pidfd, select.POLLIN)
                os.kill(pid, signal.SIGKILL)
                assert exited.poll(WAIT * 1000), "the killed manager did not exit"
            finally:
                os.close(pidfd)
        return answer

    monkeypatch.setattr(client, "call", call)


def assert_gone(error: BaseException, coord, pid: int) -> None:
    assert isinstance(error, ConnectionError), f"{type(error).__name__}: {error}"
    assert coord.address in str(error) and "is gone" in str(error)
    assert f"its manager process {pid} died" in str(error)  # (not only inside the address)
    assert "sender" not in str(error)  # the advice for a pickled segment's sender: wrong here


def test_manager_dies_right_after_answering_publish(tmp_path, monkeypatch):
    with shared_td.Coordinator(timeout=5) as coord:
        pid = coord.pid  # (asked of the manager)
        kill_after(monkeypatch, pid, "publish")  # this process never mapped its table
        with pytest.raises(BaseException) as info:
            coord.publish("w", tree(), prefix=tmp_path / "w")
        assert_gone(info.value, coord, pid)


def test_manager_dies_right_after_answering_attach(tmp_path, monkeypatch):
    with shared_td.Coordinator(timeout=5) as coord:
        coord.publish("w", tree(), prefix=tmp_path / "w")
        # as in a process that never mapped this coordinator's version table (a worker's
        # first attach): publish mapped it here
        monkeypatch.setattr(staleness, "_TABLES", InodeCache())
        pid = coord.pid  # (asked of the manager)
        kill_after(monkeypatch, pid, "attach")
        with pytest.raises(BaseException) as info:
            shared_td.attach("w", address=coord.address, authkey=coord.authkey, timeout=5)
        assert_gone(info.value, coord, pid)


def test_ctrl_c_as_the_connection_lock_is_taken_leaves_it_free():
    with shared_td.Coordinator(timeout=3) as coord:
        coord.names()  # the connection exists
        channel = channels._CHANNELS[(os.getpid(), coord.address, coord.authkey)]
        real = channel.lock

        class InterruptedAsItReturns:
            """The lock, whose acquire succeeds and then raises KeyboardInterrupt, as a
            SIGINT handled when the acquire call returns does (once)."""

            def acquire(self, *args, **kwargs):
                taken = real.acquire(*args, **kwargs)
                channel.lock = real
                assert taken
                raise KeyboardInterrupt

            def __getattr__(self, name):
                return getattr(real, name)

        channel.lock = InterruptedAsItReturns()
        with pytest.raises(KeyboardInterrupt):
            coord.names()
        assert channel.lock is real
        start = time.monotonic()
        coord.names()  # before the fix: waited out the 3 s, then CoordinatorTimeoutError
        assert time.monotonic() - start < 1.5
