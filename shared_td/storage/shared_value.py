"""SharedValue: one Python value that the processes of a node read and write.

This is the mechanism behind ``memmap_(share_non_tensor=True)``. The value lives pickled
in an anonymous memfd, so it has no size limit (unlike tensordict's 100-byte strings)
and keeps its type (bool stays bool). The values shared together (a tree's) are cells of
one memfd, a :class:`~shared_td.storage.value_slab.ValueSlab`: how regions are
allocated there, freed and locked is said there.

The cell's header, and why a writer killed at any instant cannot tear it::

    word 0        version: the published word; its low bit names the live slot
    words 1-3     slot 0: offset, length of a pickled value, capacity of its region
    words 4-6     slot 1: offset, length, capacity

* Commit protocol. A write never touches the bytes a reader may read: it pickles the new
  value into the region of the slot that is not live (a new, bigger region if it does
  not fit there), fills that slot's length, and publishes with one aligned 8-byte store
  of ``version + 1`` (see :mod:`shared_td.platform`). A writer killed before that store
  leaves an unpublished slot that the next writer overwrites; killed after it, it has
  published a whole value.
* Readers. Each process maps the slab's headers once and keeps the last value it
  unpickled with its version. Reading an unchanged value compares the shared version
  word with the cached one: one aligned 8-byte load, no lock, no system call. A changed
  version takes the shared ``_VALUE`` lock, reads the version, the live slot and its
  payload (``pread``), releases the lock, then unpickles.
* Why readers need no retry: the store that publishes is made while holding the
  exclusive ``_VALUE`` lock, so it waits until no reader is inside the live region, and
  every reader that starts afterwards reads the new slot. The next write goes to the
  other slot's region: no reader is there any more (nor when that region is replaced
  and freed). Writers exclude one another with the ``_WRITE`` lock (the payload is
  copied under it, not under ``_VALUE``: readers are never held up by a long write), and
  whole read-modify-write updates with ``_UPDATE`` (see :meth:`SharedValue.updating`).
  Lock order: ``_UPDATE``, ``_WRITE``, ``_VALUE``, then the slab's; every lock is a
  :class:`~shared_td.platform.ByteLock` (thread lock, then open-file-description lock),
  so threads of two processes never get a false ``EDEADLK``, and a killed holder's locks
  vanish with it.
* Memory. Space is reserved with ``posix_fallocate`` before the payload is written: a
  full memory is a :class:`~shared_td.storage.files.StorageFullError` with the old
  value intact. Each slot's region only grows (another process's ``pread`` must never
  run past it), so a cell holds the live value and room for the next one, each at most
  1.5 times the largest value its slot held (see value_slab). A write copies the value
  once (``pwrite`` of its pickle), as a plain write would.

Holders: the slab's memfd travels to other processes like an anonymous segment, by
reopening ``/proc/<pid>/fd/<fd>`` of a process that holds it. A pickled cell names the
pickling process first, then its *fallback holders*: the coordinators that adopted its
slab (see :mod:`shared_td.coordinator.ownership`), so a cell stays attachable after the
process that created it exited, for as long as such a coordinator lives.
multiprocessing's ForkingPickler (queues, process arguments, DataLoader workers) sends a
*duplicate descriptor* instead, as for segments
(:func:`~shared_td.storage.duplicates.receive_duplicate`): such a cell is received while
the sending process lives, even once it dropped the cell, and through the ``/proc``
route and the holders above if the duplicate cannot be taken.
A fork child inherits the descriptor and reopens its own open file description (the
slab cache's at-fork hook), so its locks exclude its parent's.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import pickle
import struct
import threading
from typing import Any, Callable, ContextManager, Iterator

from shared_td.platform import ByteLock
from shared_td.storage.files import pwrite_all
from shared_td.storage.value_slab import ValueSlab, keep_slab, region_capacity

# A cell's header: the version word, then per slot (offset, length, capacity) of its region
_SLOT, _LENGTH, _CAPACITY = 3, 1, 2  # words per slot; a slot's length and capacity after its offset
_SLOT_WORDS = 2 * _SLOT
_HEADER = struct.Struct(f"={1 + _SLOT_WORDS}Q")
# The bytes that the ByteLocks lock (a lock needs no data there), after the cell's first
# (see value_slab): see the module doc.
_VALUE, _WRITE, _UPDATE = 0, 1, 2
_LOCK_BYTES = 3  # per cell; byte 0 of the memfd is the slab's
_WHAT = "a shared non-tensor value"


def _pickled(value: Any) -> bytes:
    try:
        return pickle.dumps(value)
    except Exception as error:
        # (the cell is unchanged; a tensordict's write checks its values before
        # writing any entry, and names the entry: NonTensorBase._check_storable)
        raise TypeError(
            f"A shared non-tensor value must be picklable; {type(value).__name__} is "
            f"not ({error}). Nothing was written: write a picklable value (a function "
            "defined at module level, not a lambda; no lock or open file)."
        ) from error


def _pread_all(fd: int, length: int, offset: int) -> bytes:
    # one pread moves at most ~2 GiB on Linux
    parts, done = [], 0
    while done < length:
        part = os.pread(fd, length - done, offset + done)
        if not part:
            raise OSError(f"{_WHAT} ends {length - done} bytes early (offset {offset + done})")
        parts.append(part)
        done += len(part)
    return parts[0] if len(parts) == 1 else b"".join(parts)


class SharedValue:
    """A picklable handle on a value shared between processes: cell ``index`` of a
    :class:`~shared_td.storage.value_slab.ValueSlab`.

    Examples:
        >>> cell = SharedValue.create("walk")
        >>> clone = pickle.loads(pickle.dumps(cell))   # e.g. in another process
        >>> clone.set("run"); cell.get()
        'run'
        >>> first, second = SharedValue.create_many(["walk", "door"])   # one memfd
        >>> first.slab is second.slab, second.get()
        (True, 'door')
    """

    def __init__(self, slab: ValueSlab, index: int):
        # Private: use SharedValue.create(_many), or pickle (slab.cell makes it).
        self.slab = slab
        self.index = index
        address = slab.header_address(index)
        self._version_word = ctypes.c_uint64.from_address(address)
        self._slots = (ctypes.c_uint64 * _SLOT_WORDS).from_address(address + 8)
        first = 1 + _LOCK_BYTES * index
        self._value_lock = ByteLock(slab.fd, first + _VALUE)
        self._write_lock = ByteLock(slab.fd, first + _WRITE)
        self._update_lock = ByteLock(slab.fd, first + _UPDATE, for_blocks=True)  # (held by updating() blocks only)
        # (version, value) in one tuple: a thread on the fast path never pairs a new
        # version with an old value.
        self._cached: tuple[int, Any] = (-1, None)

    @classmethod
    def create(cls, value: Any) -> "SharedValue":
        """A new shared cell holding ``value`` (which must be picklable), in a slab of its own."""
        return cls.create_many([value])[0]

    @classmethod
    def create_many(cls, values: list) -> list["SharedValue"]:
        """New shared cells holding ``values`` (each must be picklable: a TypeError,
        nothing made, if one is not), all in one new slab.

        The headers and the values are reserved with ``posix_fallocate``: a full memory
        is a :class:`~shared_td.storage.files.StorageFullError` here, never a SIGBUS.
        """
        if not values:
            return []
        # The first value of each cell, as set() would write it (slot 1 live, version 1),
        # without its locks: no other process or thread can reach this memfd yet.
        slab = ValueSlab.create([_pickled(value) for value in values], _first_header)
        keep_slab(slab)
        for batch in _new_slab_batches():
            batch.append(slab)
        return [slab.cell(index, cls) for index in range(slab.cells)]

    @property
    def fd(self) -> int:
        """The descriptor of the cell's memfd (its slab's) in this process."""
        return self.slab.fd

    @property
    def key(self) -> tuple[int, int]:
        """``(st_dev, st_ino)`` of the cell's memfd (its slab's)."""
        return self.slab.key

    @property
    def version(self) -> int:
        """The cell's version word: it changes with every :meth:`set` by any process
        (one aligned 8-byte load; the cluster layer polls it to see local writes)."""
        return self._version_word.value

    def get(self) -> Any:
        """The current value (the last one written by any process)."""
        version, value = self._cached
        if self._version_word.value == version:
            return value  # unchanged: no lock, no system call
        lock = self._value_lock
        # this shape exactly: a Ctrl-C here never leaves the lock held (see ByteLock); a
        # signal handler reading this value mid-write is refused, never a hang
        if lock.threads._is_owned():
            raise lock.reentered("Reading a shared non-tensor value")
        with lock.threads:
            try:
                lock.take_shared()
                version = self._version_word.value  # no store to it while we hold the lock
                if version == self._cached[0]:
                    return self._cached[1]  # another thread of ours read it meanwhile
                slot = _SLOT * (version & 1)
                offset, length, capacity = self._slots[slot], self._slots[slot + _LENGTH], self._slots[slot + _CAPACITY]
                self.slab.check_region(offset, max(length, capacity))
                payload = _pread_all(self.fd, length, offset)
            finally:
                lock.give_back()
        value = pickle.loads(payload)  # ours now: no lock needed
        if version > self._cached[0]:
            self._cached = (version, value)
        return value

    def set(self, value: Any) -> None:
        """Replace the value for every process (see the module doc: the old value stays
        whole for readers until the new one is published by one 8-byte store)."""
        self._write(value, None)

    def set_if_version(self, value: Any, version: int) -> bool:
        """:meth:`set`, only if the version word is still ``version`` (checked and
        written under the write lock, so no other write comes in between); whether it
        wrote. The cluster layer writes values from other nodes with it, so that a local
        write it has not seen yet is never overwritten.

        Example:
            >>> cell = SharedValue.create(1)
            >>> seen = cell.version
            >>> cell.set_if_version(2, seen), cell.set_if_version(3, seen), cell.get()
            (True, False, 2)
        """
        return self._write(value, version)

    def _write(self, value: Any, expected: int | None) -> bool:
        payload = _pickled(value)
        length = len(payload)
        write_lock, value_lock = self._write_lock, self._value_lock
        # this shape exactly: a Ctrl-C here never leaves a lock held (see ByteLock); a
        # signal handler writing this value mid-operation is refused, never a hang
        if write_lock.threads._is_owned() or value_lock.threads._is_owned():
            raise write_lock.reentered("Writing a shared non-tensor value")
        with write_lock.threads:
            try:
                write_lock.take()
                version = self._version_word.value  # only writers store it, and we are the one
                if expected is not None and version != expected:
                    return False
                # the slot that is not live: no reader looks at its region (module doc)
                other = _SLOT * (1 - (version & 1))
                offset, capacity = self._slots[other], self._slots[other + _CAPACITY]
                if capacity:  # (a slot not written yet has no region)
                    self.slab.check_region(offset, capacity)
                if length > capacity:
                    # reserve first: a full memory fails here, before anything is published
                    slab = self.slab
                    new_offset, new_capacity = slab.allocate(region_capacity(length, capacity))
                    # the offset before the capacity: killed between the two, the slot
                    # names the new region with the old, smaller capacity (value_slab)
                    self._slots[other] = new_offset
                    self._slots[other + _CAPACITY] = new_capacity
                    slab.free(offset, capacity)
                    offset = new_offset
                pwrite_all(self.fd, payload, offset, where=_WHAT)
                self._slots[other + _LENGTH] = length
                # publish: one aligned 8-byte store, made once no reader is inside the
                # region that the next write may reuse
                with value_lock.threads:
                    try:
                        value_lock.take()
                        self._version_word.value = version + 1
                    finally:
                        value_lock.give_back()
            finally:
                write_lock.give_back()
        return True

    def updating(self) -> ContextManager[None]:
        """Serialise whole updates between every process and thread: a
        read-modify-write (``set(f(get()))``) in the block loses no other update, and
        what the block does after ``set`` (rewriting files) happens in write order.

        Example:
            >>> cell = SharedValue.create(1)
            >>> with cell.updating():
            ...     cell.set(cell.get() + 1)
            >>> cell.get()
            2
        """
        # the lock's own context manager, not one wrapped in another: one Python
        # entry and exit fewer where a Ctrl-C could land (see ByteLock.hold)
        return self._update_lock.hold()

    @property
    def holders(self) -> tuple[tuple[int, int], ...]:
        """(pid, fd) of other processes that hold the cell's memfd (its slab's
        :attr:`~shared_td.storage.value_slab.ValueSlab.holders`: waits for a hand-over
        under way in the background, raising what went wrong there, once)."""
        return self.slab.holders

    def _renew_locks(self, error: OSError | None) -> None:
        # (the slab's after-fork hook: a fork child has its own open file description now,
        # or ``error`` says why not; a thread of the parent may have held a thread lock)
        for lock in (self._value_lock, self._write_lock, self._update_lock):
            lock.renew_after_fork(error)

    def __reduce__(self):
        # the slab pickled once however many of its cells a pickle holds (pickle's memo):
        # one descriptor sent, one route opened (a spawning child's arguments refuse the
        # same descriptor twice)
        return _cell_of, (self.slab, self.index)

    def __deepcopy__(self, memo: dict) -> "SharedValue":
        # a new cell holding the current value: a deep copy is not tied to this cell (by
        # __reduce__ it came back as this same cell, this process's from the cache)
        return SharedValue.create(self.get())

    def __repr__(self) -> str:
        return f"SharedValue(fd={self.fd}, inode={self.key[1]}, cell={self.index}, holders={list(self.slab._holders)})"


def share_together(entries: list) -> None:
    """Put the values of the non-tensor ``entries`` (NonTensorData, NonTensorStack: their
    ``_payload``) not in a cell yet into new cells of one slab, one memfd for all
    (``entry._share(cell)``); an entry listed twice gets one cell.

    Example:
        >>> from shared_td import NonTensorData
        >>> entries = [NonTensorData("walk"), NonTensorData("run")]
        >>> share_together(entries)
        >>> entries[0]._shared_value.slab is entries[1]._shared_value.slab
        True
    """
    entries = list({id(entry): entry for entry in entries if entry._shared_value is None}.values())
    if entries:
        for entry, cell in zip(entries, SharedValue.create_many([entry._payload for entry in entries])):
            entry._share(cell)


def _first_header(offset: int, length: int, capacity: int) -> bytes:
    """A new cell's header: version 1, slot 1 live (its value at ``offset``), slot 0 empty."""
    return _HEADER.pack(1, 0, 0, 0, offset, length, capacity)


def _cell_of(slab: ValueSlab, index: int) -> SharedValue:
    """Unpickle a cell: this process's one object of cell ``index`` of ``slab``.

    Example:
        >>> from multiprocessing.reduction import ForkingPickler
        >>> cell = SharedValue.create("walk")
        >>> ForkingPickler.loads(ForkingPickler.dumps(cell)) is cell
        True
    """
    return slab.cell(index, SharedValue)


# ----------------------------------------------------------------- new-slab batches
# memmap_(share_non_tensor=True) creates its cells inside ``collecting_new_slabs()`` so
# that it can hand their slabs to a coordinator in one round trip, through the adopter
# that the coordinator package registers here (the engine never imports the coordinator).
_BATCHES = threading.local()
_ADOPTER: Callable[[list], None] | None = None


def set_slab_adopter(adopter: Callable[[list], None] | None) -> None:
    """Make ``adopter(slabs)`` the hook that :func:`adopt_new_slabs` calls (None: no hook).

    :mod:`shared_td.coordinator.ownership` registers the one that hands new slabs to the
    process's coordinator, so that their cells outlive this process.
    """
    global _ADOPTER
    _ADOPTER = adopter


def adopt_new_slabs(slabs: list) -> None:
    """Hand the new ``slabs`` (collected with :func:`collecting_new_slabs`) to the
    registered adopter, if any and if there are some; its errors propagate."""
    if slabs and _ADOPTER is not None:
        _ADOPTER(slabs)


def _new_slab_batches() -> list:
    return getattr(_BATCHES, "open", [])


@contextlib.contextmanager
def collecting_new_slabs() -> Iterator[list]:
    """Collect the slabs (:class:`~shared_td.storage.value_slab.ValueSlab`) that
    :meth:`SharedValue.create_many` makes in this thread.

    Example:
        >>> with collecting_new_slabs() as slabs:
        ...     _ = SharedValue.create_many([1, 2]), SharedValue.create(3)
        >>> [slab.cells for slab in slabs]
        [2, 1]
    """
    batch: list = []
    _BATCHES.open = [*_new_slab_batches(), batch]
    try:
        yield batch
    finally:
        _BATCHES.open = [b for b in _BATCHES.open if b is not batch]
