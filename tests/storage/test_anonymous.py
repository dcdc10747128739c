"""shared_td.storage.anonymous: memfd segments, their descriptors and their pickles."""

import errno
import gc
import multiprocessing
import os
import pickle

import pytest

from tests.leakcheck import this_process_in_shm

from shared_td.storage import anonymous
from shared_td.storage.anonymous import Segment, SegmentUnavailableError, align
from shared_td.storage.files import StorageFullError

pytestmark = pytest.mark.timeout(60)


def fd_count():
    gc.collect()  # garbage of earlier tests must not close descriptors between two counts
    return len(os.listdir("/proc/self/fd"))


def test_align():
    assert [align(n) for n in (0, 1, 63, 64, 65)] == [0, 64, 64, 64, 128]
    assert align(5, 8) == 8


def test_create_write_and_read():
    segment = Segment.create(100)
    assert segment.nbytes == 100 and segment.storage.nbytes() == 100
    assert set(segment.storage.tolist()) == {0}
    segment.write(98, b"\x01\x02")
    assert segment.storage[98] == 1 and segment.storage[99] == 2
    with pytest.raises(ValueError, match="overflows"):
        segment.write(99, b"ab")
    with pytest.raises(ValueError, match="overflows"):
        segment.write(-1, b"a")


def test_zero_bytes_make_no_segment():
    before = fd_count()
    for nbytes in (0, -1):
        with pytest.raises(ValueError, match="positive size"):
            Segment.create(nbytes)
    assert fd_count() == before


def test_one_descriptor_per_segment_named_and_closed_with_its_mapping():
    before = fd_count()
    shm_before = this_process_in_shm()
    segment = Segment.create(4096)
    assert fd_count() == before + 1
    target = os.readlink(f"/proc/self/fd/{segment.fd}")
    assert "shared_td" in target and str(os.getpid()) in target
    assert this_process_in_shm() == shm_before
    storage = segment.storage
    del segment
    gc.collect()
    assert fd_count() == before + 1  # the mapping (any view of it) holds the descriptor: views can be sent
    storage[0] = 5
    assert storage[0] == 5
    del storage
    gc.collect()
    assert fd_count() == before  # closed with the last view of the mapping


def test_reservation_failure_is_a_clear_error(monkeypatch):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    before = fd_count()
    with pytest.raises(StorageFullError, match=r"3145728 bytes \(3.0 MiB\) for an anonymous"):
        Segment.create(3 * 2**20)
    assert fd_count() == before


def test_pickle_in_process_returns_the_same_segment():
    segment = Segment.create(64)
    assert pickle.loads(pickle.dumps(segment)) is segment
    assert multiprocessing.reduction.ForkingPickler.loads(
        multiprocessing.reduction.ForkingPickler.dumps(segment)) is segment


def test_pickle_of_a_released_segment_is_a_clear_error():
    blob = pickle.dumps(Segment.create(64))
    gc.collect()
    with pytest.raises(SegmentUnavailableError, match="gone"):
        pickle.loads(blob)


def _attach_and_report(pid, fd, key, conn):
    anonymous._CACHE.clear()  # see _attach_in_child
    try:
        anonymous._attach(pid, fd, key, 64)
        conn.send("attached")
    except SegmentUnavailableError as err:
        conn.send(str(err))


def test_attach_checks_the_inode():
    segment = Segment.create(64)
    other = Segment.create(64)
    # as if segment's descriptor number had been closed and reused for another file
    context = multiprocessing.get_context("fork")
    receiver, sender = context.Pipe(duplex=False)
    process = context.Process(target=_attach_and_report,
                              args=(os.getpid(), other.fd, segment.key, sender))
    process.start()
    message = receiver.recv()
    process.join(30)
    assert f"descriptor {other.fd} now names another file" in message
    assert f"sent by process {os.getpid()}" in message


def _attach_in_child(blob, conn):
    # a fork child inherits the cache; empty it to take the /proc route of a stranger
    anonymous._CACHE.clear()
    segment = pickle.loads(blob)
    segment.write(0, b"child")
    conn.send((segment.fd, os.readlink(f"/proc/self/fd/{segment.fd}")))


def test_another_process_attaches_through_proc():
    segment = Segment.create(4096)
    context = multiprocessing.get_context("fork")
    receiver, sender = context.Pipe(duplex=False)
    process = context.Process(target=_attach_in_child, args=(pickle.dumps(segment), sender))
    process.start()
    child_fd, child_target = receiver.recv()
    process.join(30)
    assert process.exitcode == 0
    assert "shared_td" in child_target and child_fd != segment.fd
    assert bytes(segment.storage[:5].tolist()) == b"child"
