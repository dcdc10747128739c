"""Audit 19, finding 1: an exception raised by a signal handler (Ctrl-C's
KeyboardInterrupt, a test-timeout alarm) inside SharedCounter.fetch_add or a
SharedValue's get / set / updating() never leaves a lock held once it is caught.

Before the fix the OFD byte lock taken by ``fcntl(F_OFD_SETLKW)`` stayed held when the
KeyboardInterrupt surfaced right after the call returned, and every other process then
waited on it for as long as the interrupted one lived. Each case storms one operation
with SIGINT in a fork CHILD (a thread there sends SIGINT to the child's main thread
every fraction of a millisecond; the handler raises KeyboardInterrupt, which the loop
catches), and after every caught interrupt asks the kernel, from another open file
description (``F_OFD_GETLK``), whether the bytes are free. The child then stays alive
while this process does the same kind of operation, which must end within a bound.
tensordict 0.15.3 has no cross-process counter or locked value: nothing to compare.
"""
from __future__ import annotations

import fcntl
import multiprocessing
import os
import random
import signal
import struct
import threading
import time

import pytest

from shared_td import SharedCounter
from shared_td.storage import shared_value as shared_value_module
from shared_td.storage.shared_value import SharedValue

pytestmark = pytest.mark.timeout(60)
WAIT = 20  # seconds: every join and queue read is bounded by this
STORM_S = 0.6  # seconds of SIGINT storm per case (before the fix a lock leaked within ~10 interrupts)
OTHER_S = 5.0  # seconds another process may take for one operation (it takes microseconds)

_FLOCK = struct.Struct("@hhqqi4x")  # struct flock, as shared_td.platform_locks packs it
_CELL_BYTES = (shared_value_module._VALUE, shared_value_module._WRITE, shared_value_module._UPDATE)


def held_bytes(fd: int, wanted) -> list[int]:
    """Bytes of ``wanted`` that some open file description other than a fresh one holds
    locked (``F_OFD_GETLK`` from a new description of the same file)."""
    probe = os.open(f"/proc/self/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
    try:
        return [byte for byte in wanted
                if _FLOCK.unpack(fcntl.fcntl(probe, fcntl.F_OFD_GETLK,
                                             _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, byte, 1, 0)))[0]
                != fcntl.F_UNLCK]
    finally:
        os.close(probe)


def _storm(op, fd, wanted, thread_locks, queue, done) -> None:
    """In the child: run ``op`` under a SIGINT storm for STORM_S; after each caught
    KeyboardInterrupt, check that no byte of ``wanted`` and no thread lock is held.
    Reports (operations, interrupts, what was found held or None), then waits for
    ``done`` (so that a lock it leaked stays leaked while the parent tries)."""
    armed = [False]

    def handler(signum, frame):
        if armed[0]:
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, handler)
    main, stop = threading.get_ident(), threading.Event()

    def pester():
        rng = random.Random(1234)
        while not stop.is_set():
            time.sleep(rng.uniform(0, 0.0005))
            signal.pthread_kill(main, signal.SIGINT)

    pesterer = threading.Thread(target=pester, daemon=True)
    pesterer.start()
    operations = interrupts = 0
    found = None
    end = time.monotonic() + STORM_S
    while time.monotonic() < end and found is None:
        interrupted = False
        try:
            armed[0] = True
            op()
            armed[0] = False
            operations += 1
        except KeyboardInterrupt:
            armed[0] = False
            interrupted = True
        if interrupted:  # checked once the exception is gone (it may hold a generator)
            interrupts += 1
            held = held_bytes(fd, wanted)
            threads = [i for i, lock in enumerate(thread_locks()) if lock.locked()]
            if held or threads:
                found = f"after interrupt {interrupts}: bytes {held} and thread locks {threads} held"
    stop.set()
    pesterer.join(WAIT)
    queue.put((operations, interrupts, found))
    done.wait(WAIT)


def _threads_of(lock):
    # the lock's thread lock (``_thread_lock`` before the audit-19 fix: this test is run
    # against the code from before it too, where it must fail)
    return getattr(lock, "threads", None) or lock._thread_lock


def _other_process_op(op) -> bool:
    """Run ``op`` (in this, another, process) in a thread; whether it ended in OTHER_S."""
    thread = threading.Thread(target=op, daemon=True)  # a hung one ends when the child dies
    thread.start()
    thread.join(OTHER_S)
    return not thread.is_alive()


def _run_case(op, fd, wanted, thread_locks, other_op):
    ctx = multiprocessing.get_context("fork")
    queue, done = ctx.Queue(), ctx.Event()
    child = ctx.Process(target=_storm, args=(op, fd, wanted, thread_locks, queue, done))
    child.start()
    try:
        operations, interrupts, found = queue.get(timeout=WAIT)
        other_ended = _other_process_op(other_op)
    finally:
        done.set()
        child.join(WAIT)
        if child.is_alive():
            child.kill()
            child.join(WAIT)
    assert interrupts > 0 and operations > 0, (operations, interrupts)
    assert found is None, f"the child left a lock held {found} ({operations} operations)"
    assert other_ended, "another process's operation hung on a lock the interrupted child kept"


def test_ctrl_c_in_fetch_add_never_leaves_the_lock_held():
    counter = SharedCounter()
    _run_case(lambda: counter.fetch_add(1), counter._segment.fd, [0],
              lambda: [_threads_of(counter._lock)], lambda: counter.fetch_add(1))
    assert counter.value >= 1


def _cell_locks(cell):
    return lambda: [_threads_of(lock) for lock in (cell._value_lock, cell._write_lock, cell._update_lock)]


def _update_and_set(cell, value):
    with cell.updating():
        cell.set(value)


@pytest.mark.parametrize("operation", ["get", "set", "updating"])
def test_ctrl_c_in_a_shared_value_never_leaves_a_lock_held(operation):
    cell = SharedValue.create("x" * 100)

    def get():
        cell._cached = (-1, None)  # as after another process's set(): the locked path
        cell.get()

    op = {"get": get, "set": lambda: cell.set("y" * 100),
          "updating": lambda: _update_and_set(cell, "z" * 100)}[operation]
    _run_case(op, cell.fd, _CELL_BYTES, _cell_locks(cell), lambda: _update_and_set(cell, "parent"))
    assert cell.get() == "parent"
