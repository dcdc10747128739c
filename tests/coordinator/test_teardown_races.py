"""Audit 21: tearing a coordinator connection down while other threads use it, and
reopening a peer's descriptor number that now names something else.

1. A non-owning handle's ``shutdown()`` (``Coordinator.connect(...)``, or a handle
   received by pickle leaving its ``with``) leaves this process's connection alone:
   other handles and threads are using it. And ``drop_channel`` (the owner's shutdown)
   beside threads mid-call closes each descriptor once, by the thread that holds the
   connection's lock: before, two threads closed one number, and a bystander thread's
   own file (which got that number meanwhile) was closed or replaced under it, while
   calls to a healthy coordinator failed as "gone", EBADF, authentication errors...
4. A stale reference ``(pid, fd)`` whose number now names a FIFO is refused without
   opening the FIFO (opening it released a writer waiting for a reader); the manager
   refuses a (pid, fd) that is not two ints.

tensordict 0.15.3 has no coordinator: nothing to compare.
"""
from __future__ import annotations

import collections
import os
import threading
import time

import pytest
import torch

import shared_td
from shared_td import platform
from shared_td.coordinator import channels
from shared_td.coordinator.registry import Registry

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def coord():
    with shared_td.Coordinator(timeout=5) as coordinator:
        coordinator.publish("x", shared_td.TensorDict(a=torch.zeros(2), batch_size=[2]))
        yield coordinator


def _race(coord, tmp_path, teardown, seconds=0.8):
    """Two threads attach in a loop and a bystander thread checks its own file's
    descriptor, while this thread runs ``teardown()`` in a loop; what went wrong."""
    path = tmp_path / "bystander.txt"
    path.write_text("x")
    errors, stolen = collections.Counter(), collections.Counter()
    stop = threading.Event()

    def user():
        while not stop.is_set():
            try:
                shared_td.attach("x", address=coord.address, authkey=coord.authkey, timeout=5)
            except Exception as err:  # noqa: BLE001 (counted: the test asserts there are none)
                errors[f"{type(err).__name__}: {err}"[:120]] += 1

    def bystander():
        while not stop.is_set():
            fd = os.open(path, os.O_RDONLY)
            try:
                for _ in range(20):
                    if os.fstat(fd).st_size != 1:
                        stolen["its fd names another file"] += 1
                        break
                os.close(fd)
            except OSError as err:
                stolen[f"its own fd: {err}"] += 1

    threads = [threading.Thread(target=user) for _ in range(2)] + [threading.Thread(target=bystander)]
    for thread in threads:
        thread.start()
    try:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            try:
                teardown()
            except Exception as err:  # noqa: BLE001
                errors[f"teardown: {type(err).__name__}: {err}"[:120]] += 1
    finally:
        stop.set()
        for thread in threads:
            thread.join(10)
    return dict(errors), dict(stolen)


def test_a_non_owning_handles_shutdown_leaves_the_shared_connection_alone(coord, tmp_path):
    errors, stolen = _race(coord, tmp_path,
                           lambda: shared_td.Coordinator.connect(coord.address, coord.authkey, timeout=5).shutdown())
    assert errors == {} and stolen == {}
    # the handle itself is done with; the connection this process shares goes on
    handle = shared_td.Coordinator.connect(coord.address, coord.authkey, timeout=5)
    kept = channels._CHANNELS[(os.getpid(), coord.address, coord.authkey)]
    handle.shutdown()
    assert channels._CHANNELS[(os.getpid(), coord.address, coord.authkey)] is kept
    with pytest.raises(RuntimeError, match="not started"):
        handle.names()


def test_drop_channel_beside_calls_closes_each_descriptor_once_by_its_lock_holder(coord, tmp_path):
    errors, stolen = _race(coord, tmp_path, lambda: channels.drop_channel(coord.address))
    assert errors == {} and stolen == {}
    assert coord.names() == ["x"]


def test_a_channel_dropped_mid_call_is_closed_by_that_call_when_it_ends(coord):
    coord.names()
    channel = channels._CHANNELS[(os.getpid(), coord.address, coord.authkey)]
    assert channel.lock.acquire(timeout=5)  # as a thread mid-call holds it
    try:
        channels.drop_channel(coord.address)  # never waits for that call, never closes under it
        assert channel.retired and not channel.conn.closed
    finally:
        channel.lock.release()
    channels._close_retired(channel)  # what the call's finally does once its lock is free
    assert channel.conn.closed
    assert coord.names() == ["x"]  # a new connection


@pytest.fixture
def fifo_held_as_path(tmp_path):
    """A FIFO that this process holds as an O_PATH descriptor (neither reader nor
    writer), and a thread whose open for writing waits for a reader."""
    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo)
    held = os.open(fifo, os.O_PATH)
    released = threading.Event()

    def writer():
        os.close(os.open(fifo, os.O_WRONLY))  # blocks until someone opens it to read
        released.set()

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    time.sleep(0.05)
    assert not released.is_set()
    yield held, released
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # lets the writer go
    thread.join(5)
    os.close(reader)
    os.close(held)


def test_a_stale_reference_naming_a_fifo_never_opens_it(fifo_held_as_path):
    held, released = fifo_held_as_path
    st = os.fstat(held)
    for key in [(0, 12345), (st.st_dev, st.st_ino)]:  # even with the FIFO's own key: not a regular file
        with pytest.raises(OSError) as info:
            platform.reopen_peer_fd(os.getpid(), held, key)
        assert info.value.errno == 116  # ESTALE
    assert not released.wait(0.2), "the FIFO was opened: its waiting writer was released"


def test_the_manager_refuses_a_fifo_and_a_reference_that_is_not_two_ints(fifo_held_as_path):
    held, released = fifo_held_as_path
    registry = Registry()
    st = os.fstat(held)
    with pytest.raises(OSError):
        registry.adopt_cells(os.getpid(), [(held, (st.st_dev, st.st_ino))], [])
    for pid, fd in [(str(os.getpid()), held), (os.getpid(), f"{held}/../{held}"), (os.getpid(), 1.0)]:
        with pytest.raises(TypeError, match="int"):
            registry.adopt_cells(pid, [(fd, (st.st_dev, st.st_ino))], [])
    assert not released.wait(0.2), "the FIFO was opened: its waiting writer was released"
    # a memfd still reopens (a regular file)
    fd = platform.new_memfd("fix21", 8)
    mst = os.fstat(fd)
    _pid, fds = registry.adopt_cells(os.getpid(), [(fd, (mst.st_dev, mst.st_ino))], [])
    assert os.path.samestat(os.fstat(fds[0]), mst) and fds[0] != fd
    os.close(fd)
