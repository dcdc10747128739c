"""SharedValue: the memfd cell behind share_non_tensor (most behaviour is tested through
memmap_(share_non_tensor=True) in tests/persist and tests/coordinator)."""
from __future__ import annotations

import multiprocessing
import os
import pickle
import queue as queue_module
import signal
import struct
import subprocess
import sys

import pytest

from shared_td.errors import SegmentUnavailableError
from shared_td.storage import value_slab
from shared_td.storage.anonymous import Segment
from shared_td.storage.shared_value import SharedValue

WAIT = 30


def test_values_keep_their_type_and_size():
    cell = SharedValue.create("walk")
    for value in [True, 3, 2.5, b"\x00bytes", ("a", 1), {"k": [1, 2]}, None, "x" * 100_000]:
        cell.set(value)
        assert cell.get() == value and type(cell.get()) is type(value)


def test_a_pickled_cell_is_the_same_cell():
    cell = SharedValue.create([1, 2])
    clone = pickle.loads(pickle.dumps(cell))
    assert clone is cell  # one object per cell and process
    clone.set("new")
    assert cell.get() == "new"


def test_an_unpicklable_value_is_refused_and_the_old_one_stays():
    cell = SharedValue.create("old")
    with pytest.raises(TypeError, match="picklable.*lambda|lambda.*picklable|function"):
        cell.set(lambda: None)
    assert cell.get() == "old"


def _set_in_child(cell, queue):
    cell.set("from the child")
    queue.put(cell.get())


def test_fork_while_another_thread_holds_the_cell_locks():
    cell = SharedValue.create("parent")
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    # as if a thread were about to take the cell's locks when the fork happens
    locks = [cell._value_lock.threads, cell._write_lock.threads, cell._update_lock.threads]
    with locks[0], locks[1], locks[2]:
        child = ctx.Process(target=_set_in_child, args=(cell, queue))
        child.start()
        assert queue.get(timeout=WAIT) == "from the child"
    child.join(WAIT)
    if child.is_alive():
        child.kill()
        pytest.fail("the child hung on a lock held by a thread of its parent")
    assert child.exitcode == 0 and cell.get() == "from the child"


def test_a_fork_child_does_not_share_the_locks_its_parent_holds():
    """An open-file-description lock is shared through an inherited descriptor: the
    child must take its own, so a lock the parent holds at the fork excludes it."""
    cell = SharedValue.create("parent")
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    with cell._update_lock.hold(), cell._write_lock.hold():  # a parent thread mid-update
        child = ctx.Process(target=_set_in_child, args=(cell, queue))
        child.start()
        with pytest.raises(queue_module.Empty):
            queue.get(timeout=0.5)  # the child waits for our write lock
        assert cell.get() == "parent"
    assert queue.get(timeout=WAIT) == "from the child"
    child.join(WAIT)
    assert child.exitcode == 0 and cell.get() == "from the child"


def _memory(cell) -> int:
    import os

    return os.fstat(cell.fd).st_blocks * 512  # what the memfd holds (its size is sparse)


def test_memory_stays_bounded_across_writes():
    """Each write goes where no reader looks (the region of the slot that is not live),
    but the memfd's memory never grows past the live value plus room for the new one:
    for values of one size, two regions of that size; else each region at most 1.5
    times the largest value its slot held (the regions it replaced freed)."""
    import mmap
    import random

    page = mmap.PAGESIZE

    def pages(nbytes: int) -> int:
        return -(-nbytes // page) * page

    cell = SharedValue.create(b"")
    size = 1 << 20
    for i in range(20):
        cell.set(bytes([i]) * size)
        assert cell.get() == bytes([i]) * size
    pickled = len(pickle.dumps(bytes(size)))
    assert _memory(cell) <= page + 2 * pages(pickled)  # + the headers and the first, tiny value
    rng = random.Random(0)
    for i in range(200):
        value = bytes([i % 256]) * rng.randint(0, 2 * size)
        cell.set(value)
        assert cell.get() == value
    assert _memory(cell) <= 2 * page + 2 * pages(3 * len(pickle.dumps(bytes(2 * size))) // 2)


def test_a_value_that_grows_a_little_at_each_write_keeps_its_memory_bounded():
    """A value that outgrows its region moves to a new one, 1.5 times bigger, and the
    old one is freed: 2000 writes each a few bytes longer (a list appended to) hold a
    few regions' worth, not one per write."""
    cell = SharedValue.create([])
    for i in range(2000):
        cell.set(list(range(i)) + ["x" * 4000])
        assert len(cell.get()) == i + 1
    final = len(pickle.dumps(list(range(2000)) + ["x" * 4000]))
    assert _memory(cell) <= 4 * final


def test_cells_made_together_share_one_memfd_and_stay_independent():
    first, second, third = SharedValue.create_many(["a", {"k": 1}, None])
    assert first.slab is second.slab is third.slab and first.fd == third.fd
    second.set("x" * 100_000)  # outgrows its region: a new one, at the slab's end
    first.set(b"\x00" * 50_000)
    assert (first.get(), second.get(), third.get()) == (b"\x00" * 50_000, "x" * 100_000, None)
    assert pickle.loads(pickle.dumps(second)) is second
    assert [cell.index for cell in (first, second, third)] == [0, 1, 2]


def _read_cells_in_child(cells, queue):
    queue.put([cell.get() for cell in cells])
    cells[1].set("from the child")
    queue.put(len({cell.fd for cell in cells}))


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_cells_of_one_slab_reach_another_process_through_one_descriptor(method):
    cells = SharedValue.create_many(["a", "b", "c"])
    ctx = multiprocessing.get_context(method)
    queue = ctx.Queue()
    child = ctx.Process(target=_read_cells_in_child, args=(cells, queue))
    child.start()
    try:
        assert queue.get(timeout=WAIT) == ["a", "b", "c"]
        assert queue.get(timeout=WAIT) == 1
    finally:
        child.join(WAIT)
    assert child.exitcode == 0
    assert [cell.get() for cell in cells] == ["a", "from the child", "c"]


def test_a_cell_index_outside_its_slab_is_refused():
    from shared_td.errors import SegmentUnavailableError
    from shared_td.storage import shared_value

    cell = SharedValue.create("only")
    with pytest.raises(SegmentUnavailableError, match="cell 1 of a slab of 1"):
        shared_value._cell_of(cell.slab, 1)


def test_set_if_version_never_overwrites_a_write_it_has_not_seen():
    cell = SharedValue.create("seen")
    seen = cell.version
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_set_in_child, args=(cell, queue))  # another process writes
    child.start()
    assert queue.get(timeout=WAIT) == "from the child"
    child.join(WAIT)
    assert child.exitcode == 0
    assert cell.version == seen + 1
    assert cell.set_if_version("remote", seen) is False  # the child's write stays
    assert cell.get() == "from the child"
    assert cell.set_if_version("remote", seen + 1) is True and cell.get() == "remote"
    assert cell.version == seen + 2


# ------------------------------------------------ review31: re-entry, hostile memfds, peak memory
@pytest.mark.timeout(60)
def test_a_signal_handler_growing_a_sibling_cell_mid_allocation_is_refused(monkeypatch):
    """A signal handler that grows one cell while the code it interrupted is inside the
    slab's allocation for another cell of the same slab must be refused (RuntimeError),
    as re-entering a cell's own locks is: re-entered, the allocation lock (an RLock, and
    an OFD lock this description already holds) let both allocations take the same region,
    and one value overwrote the other."""
    first, second = SharedValue.create_many(["a", "b"])
    refused = []

    def handler(signum, frame):
        try:
            second.set("S" * 20_000)  # outgrows its region: allocates in the same slab
        except RuntimeError as err:
            refused.append(err)

    real_allocate = value_slab.allocate
    raised = []

    def allocate_interrupted(*args, **kwargs):
        # the signal lands inside allocate(): the slab's lock taken, `end` not moved yet
        if not raised:
            raised.append(True)
            os.kill(os.getpid(), signal.SIGUSR1)  # its handler runs as this call returns
        return real_allocate(*args, **kwargs)

    previous = signal.signal(signal.SIGUSR1, handler)
    monkeypatch.setattr(value_slab, "allocate", allocate_interrupted)
    try:
        first.set("F" * 30_000)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    monkeypatch.undo()
    assert raised and len(refused) == 1 and "signal handler" in str(refused[0])
    assert first.get() == "F" * 30_000 and second.get() == "b"
    second.set("S" * 20_000)  # outside the handler: allowed, in a region of its own
    second._cached = (-1, None)  # read from the memfd, as another process would
    first._cached = (-1, None)
    assert (first.get(), second.get()) == ("F" * 30_000, "S" * 20_000)


def test_a_segment_memfd_named_as_a_slab_is_refused_and_left_alone():
    """A forged or mistaken pickle naming another memfd (here a Segment whose first bytes
    look like a slab's: an end and a small cell count) must not be read and written as
    cells: a write moved the 'end' word, the first 8 bytes of the tensor."""
    segment = Segment.create(4096)
    words = struct.pack("=8Q", 4096, 3, 1, 0, 0, 0, 100, 2**40)
    segment.write(0, words)
    with pytest.raises(SegmentUnavailableError, match="not a slab"):
        value_slab.attach_slab(os.getpid(), segment.fd, segment.key)
    assert os.pread(segment.fd, len(words), 0) == words


@pytest.mark.parametrize("offset, length, capacity", [
    (10**9, 50, 64),          # past the file
    (200, 2**40, 2**40),      # a length that MemoryError'd
    (2**63 + 5, 10, 10),      # an offset that OverflowError'd
    (0, 40, 4096),            # the headers themselves
])
def test_a_cell_naming_bytes_outside_its_regions_is_refused(offset, length, capacity):
    cell = SharedValue.create_many(["a", "b"])[1]
    slot = 3 * (cell.version & 1)  # the live slot: what get() reads
    cell._slots[slot], cell._slots[slot + 1], cell._slots[slot + 2] = offset, length, capacity
    cell._cached = (-1, None)
    with pytest.raises(SegmentUnavailableError, match="outside the regions"):
        cell.get()
    other = 3 - slot  # the slot a write reuses
    cell._slots[other], cell._slots[other + 2] = offset, capacity
    with pytest.raises(SegmentUnavailableError, match="outside the regions"):
        cell.set("c")
    assert cell.slab.cell(0, type(cell)).get() == "a"  # its sibling untouched


def test_a_slab_cannot_be_truncated_under_its_readers():
    """Any process of the user can open /proc/<pid>/fd/<fd> and truncate the memfd; every
    reader's get() then touched its unmapped headers: SIGBUS (the process killed). The
    memfd is sealed against shrinking (growing, writing and hole punching still work)."""
    first, second = SharedValue.create_many(["a", "b"])
    other = os.open(f"/proc/{os.getpid()}/fd/{first.fd}", os.O_RDWR)
    try:
        with pytest.raises(PermissionError):
            os.ftruncate(other, 0)
    finally:
        os.close(other)
    second.set("x" * 100_000)  # grows the slab, frees a region: still allowed
    first.set("y" * 50_000)
    assert (first.get(), second.get()) == ("y" * 50_000, "x" * 100_000)


_MEASURE = """
import pickle, resource
from shared_td.storage.shared_value import SharedValue
big = b"x" * (64 * 2**20)
pickle.dumps(big)  # the pickle a create makes anyway: in the baseline
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
cell = SharedValue.create(big)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""


@pytest.mark.timeout(120)
def test_sharing_a_big_value_holds_no_second_copy_of_it():
    """create_many wrote the memfd from one image of it: a big value's pickle was copied
    into a bytearray of the whole slab first, its peak memory growing by twice the value
    (measured in a fresh process: ru_maxrss is a high-water mark)."""
    grown_mib = int(subprocess.run([sys.executable, "-c", _MEASURE], capture_output=True, text=True,
                                   check=True, timeout=100).stdout)
    assert grown_mib < 32, f"peak memory grew by {grown_mib} MiB sharing a 64 MiB value"


def test_a_slab_no_route_reaches_is_an_error_naming_every_route_tried():
    """Attaching a slab whose sender and holders are all gone says what each route
    answered (before, only the sender's error was raised, the holders' lost)."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=WAIT)  # a pid that was a process, now gone (its descriptors with it)
    key = (0, 123456789)  # no slab of this process
    with pytest.raises(SegmentUnavailableError) as info:
        value_slab.attach_slab(dead.pid, 5, key, ((dead.pid, 6),))
    message = str(info.value)
    assert "Routes tried" in message and "(1) its sender" in message and "(2) a coordinator holding it" in message
    assert "shared non-tensor value (inode 123456789)" in message
