"""SharedValue: one Python value that the processes of a node read and write.

This is the mechanism behind ``memmap_(share_non_tensor=True)``. The value lives pickled
in an anonymous memfd, so it has no size limit (unlike tensordict's 100-byte strings)
and keeps its type (bool stays bool).

The cell, and why a writer killed at any instant cannot tear it::

    word 0        version: the published word; its low bit names the live slot
    words 1, 2    slot 0: offset, length of a pickled value
    words 3, 4    slot 1: offset, length
    byte 64 ...   payload area: the live value, and room for the next one

* Commit protocol. A write never touches the bytes a reader may read: it pickles the new
  value into a region of the payload area disjoint from the live one (before it if it
  fits there, else after it), fills the *other* slot's offset and length, and publishes
  with one aligned 8-byte store of ``version + 1`` (see :mod:`shared_td.platform`). A
  writer killed before that store leaves an unpublished slot and region that the next
  writer overwrites; killed after it, it has published a whole value.
* Readers. Each process maps the 64-byte header once and keeps the last value it
  unpickled with its version. Reading an unchanged value compares the shared version
  word with the cached one: one aligned 8-byte load, no lock, no system call. A changed
  version takes the shared ``_VALUE`` lock, reads the version, the live slot and its
  payload (``pread``), releases the lock, then unpickles.
* Why readers need no retry: the store that publishes is made while holding the
  exclusive ``_VALUE`` lock, so it waits until no reader is inside the live region, and
  every reader that starts afterwards reads the new slot. The next write reuses only
  what lies outside the new live region: no reader is there any more. Writers exclude
  one another with the ``_WRITE`` lock (the payload is copied under it, not under
  ``_VALUE``: readers are never held up by a long write), and whole read-modify-write
  updates with ``_UPDATE`` (see :meth:`SharedValue.updating`). Lock order: ``_UPDATE``,
  ``_WRITE``, ``_VALUE``; every lock is a :class:`~shared_td.platform.ByteLock` (thread
  lock, then open-file-description lock), so threads of two processes never get a
  false ``EDEADLK``, and a killed holder's locks vanish with it.
* Memory. Space is reserved with ``posix_fallocate`` before the payload is written: a
  full memory is a :class:`~shared_td.storage.files.StorageFullError` with the old
  value intact. The memfd never shrinks (another process's ``pread`` must never run
  past its end); it grows to at most ``64 + 2 * new + live`` bytes, so below three times
  the largest value (typically two: values of one size alternate between two regions).
  A write copies the value once (``pwrite`` of its pickle), as a plain write would.

Holders: the memfd travels to other processes like an anonymous segment, by reopening
``/proc/<pid>/fd/<fd>`` of a process that holds it. A pickled cell names the pickling
process first, then its *fallback holders*: the coordinators that adopted the cell (see
:mod:`shared_td.coordinator.ownership`), so a cell stays attachable after the process
that created it exited, for as long as such a coordinator lives. multiprocessing's
ForkingPickler (queues, process arguments, DataLoader workers) sends a *duplicate
descriptor* instead, as for segments
(:func:`~shared_td.storage.duplicates.receive_duplicate`): such a cell is received while
the sending process lives, even once it dropped the cell, and through the ``/proc``
route and the holders above if the duplicate cannot be taken.
A fork child inherits the descriptor and reopens its own open file description (the
cache's at-fork hook), so its locks exclude its parent's.
"""
from __future__ import annotations

import contextlib
import ctypes
import multiprocessing.reduction
import os
import pickle
import struct
import threading
import weakref
from typing import Any, Callable, ContextManager, Iterator

from shared_td.errors import SegmentUnavailableError
from shared_td.platform import ByteLock, map_shared_bytes, reopen_description, unmap_bytes
from shared_td.storage.anonymous import attach_peer_fd, create_memfd
from shared_td.storage.duplicates import held_duplicate, receive_duplicate
from shared_td.storage.cache import InodeCache
from shared_td.storage.files import allocate, pwrite_all

_HEADER_WORDS = 5  # version, then (offset, length) of slots 0 and 1
_FIRST_HEADER = struct.Struct(f"={_HEADER_WORDS}Q")  # (the words as the mapped header reads them)
_PAYLOAD = 64  # where the payload area starts; the header is reserved at creation
# The bytes that the ByteLocks lock (a lock needs no data there); see the module doc.
_VALUE, _WRITE, _UPDATE = 0, 1, 2
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
    """A picklable handle on a value shared between processes.

    Examples:
        >>> cell = SharedValue.create("walk")
        >>> clone = pickle.loads(pickle.dumps(cell))   # e.g. in another process
        >>> clone.set("run"); cell.get()
        'run'
    """

    def __init__(self, fd: int, holders: tuple = ()):
        # Private: use SharedValue.create, or pickle. Takes ownership of fd.
        self.fd = fd
        stat = os.fstat(fd)
        self.key = (stat.st_dev, stat.st_ino)
        # (pid, fd) of other processes that hold the memfd (see the holders property)
        self._holders: tuple[tuple[int, int], ...] = tuple(holders)
        # set while an adopter hands this cell to a coordinator in the background: a
        # call that returns once it is done (raising what went wrong); see holders
        self._handing_over: Callable[[], None] | None = None
        self._finalizer = weakref.finalize(self, os.close, fd)
        # not at interpreter exit: a cell put on a queue just before main returns is
        # pickled by the feeder thread after atexit hooks (os.dup(fd) would be EBADF);
        # the kernel closes it at exit
        self._finalizer.atexit = False
        # Mapped once: the header read by every get(). Its bytes were reserved at
        # creation, so touching them can never raise SIGBUS.
        try:
            address = map_shared_bytes(fd, _PAYLOAD)
        except BaseException:
            self._finalizer()
            raise
        unmap = weakref.finalize(self, unmap_bytes, address, _PAYLOAD)
        unmap.atexit = False  # exit unmaps anyway; a late get() must not find it gone
        self._version_word = ctypes.c_uint64.from_address(address)
        self._slots = (ctypes.c_uint64 * (_HEADER_WORDS - 1)).from_address(address + 8)
        self._value_lock = ByteLock(fd, _VALUE)
        self._write_lock = ByteLock(fd, _WRITE)
        self._update_lock = ByteLock(fd, _UPDATE, for_blocks=True)  # (held by updating() blocks only)
        # bytes of the memfd known to be reserved (it never shrinks): set() skips the
        # fallocate call below that
        self._reserved = stat.st_size
        # (version, value) in one tuple: a thread on the fast path never pairs a new
        # version with an old value.
        self._cached: tuple[int, Any] = (-1, None)

    @classmethod
    def create(cls, value: Any) -> "SharedValue":
        """A new shared cell holding ``value`` (which must be picklable).

        The header and the value are reserved with ``posix_fallocate``: a full memory is
        a :class:`~shared_td.storage.files.StorageFullError` here, never a SIGBUS.
        """
        payload = _pickled(value)
        fd = create_memfd(f"shared_td-value-{os.getpid()}", _PAYLOAD + len(payload), _WHAT)
        try:
            # The first value, as set() would write it (slot 1 live, version 1), without
            # its locks: no other process or thread can reach this memfd yet.
            pwrite_all(fd, payload, _PAYLOAD, where=_WHAT)
            pwrite_all(fd, _FIRST_HEADER.pack(1, 0, 0, _PAYLOAD, len(payload)), 0, where=_WHAT)
        except BaseException:
            os.close(fd)
            raise
        cell = cls(fd)
        _CACHE.put(cell.key, cell)
        for batch in _new_cell_batches():
            batch.append(cell)
        return cell

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
                slot = 2 * (version & 1)
                payload = _pread_all(self.fd, self._slots[slot + 1], self._slots[slot])
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
                live = 2 * (version & 1)
                live_offset, live_length = self._slots[live], self._slots[live + 1]
                # a region no reader looks at: before the live value if it fits, else after
                if _PAYLOAD + length <= live_offset:
                    offset = _PAYLOAD
                else:
                    offset = max(_PAYLOAD, -(-(live_offset + live_length) // 8) * 8)
                if offset + length > self._reserved:
                    # reserve first: a full memory fails here, before anything is published
                    allocate(self.fd, 0, offset + length, _WHAT, anonymous=True)
                    self._reserved = offset + length
                pwrite_all(self.fd, payload, offset, where=_WHAT)
                other = 2 - live
                self._slots[other] = offset
                self._slots[other + 1] = length
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
        """(pid, fd) of other processes that hold the memfd for as long as they live
        (coordinators), tried in order when the pickling process is gone.

        A cell that an adopter is still handing to a coordinator in the background (see
        :meth:`handing_over`) is waited for first, so a pickle names its coordinator;
        what went wrong in the background is raised here, once.
        """
        wait = self._handing_over
        if wait is not None:
            try:
                wait()
            finally:
                self._handing_over = None
        return self._holders

    def add_holders(self, holders) -> None:
        """Record more processes that hold this cell (e.g. a coordinator that adopted it)."""
        self._holders = tuple(dict.fromkeys((*self._holders, *map(tuple, holders))))

    def handing_over(self, wait: Callable[[], None]) -> None:
        """Mark this cell as being handed to a coordinator in the background:
        ``wait()`` returns once that is done (or raises why it failed); :attr:`holders`
        (and so a pickle) calls it first."""
        self._handing_over = wait

    def _after_fork(self) -> None:
        # A fork child shares our open file description, hence our locks: give it its own
        # (see shared_td.platform), and fresh thread locks.
        try:
            reopen_description(self.fd)
            error = None
        except OSError as err:
            error = err
        for lock in (self._value_lock, self._write_lock, self._update_lock):
            lock.renew_after_fork(error)

    def __reduce__(self):
        return _attach, (os.getpid(), self.fd, self.key, self.holders)

    def __deepcopy__(self, memo: dict) -> "SharedValue":
        # a new cell holding the current value: a deep copy is not tied to this cell (by
        # __reduce__ it came back as this same cell, this process's from the cache)
        return SharedValue.create(self.get())

    def _reduce_with_duplicate(self):
        # multiprocessing's ForkingPickler (registered below): a duplicate descriptor that
        # outlives this object, so that the receiver needs only the sender process. The
        # holders first: reading them can raise (a failed hand-over), and a DupFd made
        # before would stay registered with the resource sharer (an fd and the memfd's
        # memory) until this process exits
        # (/proc route: the duplicate's own number, see held_duplicate)
        holders = self.holders
        duplicate, held = held_duplicate(self.fd)
        return _receive, (duplicate, self.key, os.getpid(), held, holders)

    def __repr__(self) -> str:
        return f"SharedValue(fd={self.fd}, inode={self.key[1]}, holders={list(self._holders)})"


# (st_dev, st_ino) -> this process's SharedValue of that cell; a fork child reopens its
# own description of each and gets fresh thread locks (a fork taken while another thread
# was reading or writing a cell)
_CACHE = InodeCache(after_fork="_after_fork")


def _attach(pid: int, fd: int, key: tuple[int, int], holders: tuple = ()) -> SharedValue:
    """Unpickle a cell: this process's copy, else the sender's descriptor, else a holder's."""
    key = tuple(key)
    return _CACHE.get_or_create(key, lambda: SharedValue(_reopen_from_any(key, ((pid, fd), *holders)), holders))


def _reopen_from_any(key: tuple[int, int], candidates) -> int:
    first_error = None
    for pid, fd in candidates:
        try:
            return attach_peer_fd(pid, fd, key, what="shared non-tensor value")
        except SegmentUnavailableError as err:
            first_error = first_error or err
    raise first_error


def _receive(duplicate, key: tuple[int, int], pid: int, fd: int, holders: tuple = ()) -> SharedValue:
    """Unpickle a cell sent by ForkingPickler: this process's copy, else the duplicate
    descriptor received, else (it cannot be taken) :func:`_attach`'s routes.

    Example:
        >>> from multiprocessing.reduction import ForkingPickler
        >>> cell = SharedValue.create("walk")
        >>> ForkingPickler.loads(ForkingPickler.dumps(cell)) is cell
        True
    """
    key = tuple(key)

    def adopt(new_fd: int) -> SharedValue:
        cell = SharedValue(new_fd, holders)
        stored = _CACHE.put_if_absent(key, cell)
        if stored is not cell:  # another thread attached it meanwhile: one per process
            cell._finalizer()
        return stored

    return receive_duplicate(duplicate, key, _PAYLOAD, pid, what="shared non-tensor value", cached=_CACHE.get,
                             adopt=adopt, fallback=lambda: _attach(pid, fd, key, holders))


multiprocessing.reduction.ForkingPickler.register(SharedValue, SharedValue._reduce_with_duplicate)


# ----------------------------------------------------------------- new-cell batches
# memmap_(share_non_tensor=True) creates its cells inside ``collecting_new_cells()`` so
# that it can hand them all to a coordinator in one round trip, through the adopter that
# the coordinator package registers here (the engine never imports the coordinator).
_BATCHES = threading.local()
_ADOPTER: Callable[[list], None] | None = None


def set_cell_adopter(adopter: Callable[[list], None] | None) -> None:
    """Make ``adopter(cells)`` the hook that :func:`adopt_new_cells` calls (None: no hook).

    :mod:`shared_td.coordinator.ownership` registers the one that hands new cells to the
    process's coordinator, so that they outlive this process.
    """
    global _ADOPTER
    _ADOPTER = adopter


def adopt_new_cells(cells: list) -> None:
    """Hand the new ``cells`` (collected with :func:`collecting_new_cells`) to the
    registered adopter, if any and if there are cells; its errors propagate."""
    if cells and _ADOPTER is not None:
        _ADOPTER(cells)


def _new_cell_batches() -> list:
    return getattr(_BATCHES, "open", [])


@contextlib.contextmanager
def collecting_new_cells() -> Iterator[list]:
    """Collect the cells that :meth:`SharedValue.create` makes in this thread.

    Example:
        >>> with collecting_new_cells() as cells:
        ...     _ = SharedValue.create(1), SharedValue.create(2)
        >>> [cell.get() for cell in cells]
        [1, 2]
    """
    batch: list = []
    _BATCHES.open = [*_new_cell_batches(), batch]
    try:
        yield batch
    finally:
        _BATCHES.open = [b for b in _BATCHES.open if b is not batch]
