"""SharedValue: one Python value that the processes of a node read and write.

This is the mechanism behind ``memmap_(share_non_tensor=True)``. The value lives in an
anonymous memfd as ``[version: u64][length: u64][pickled value]``, so it has no size
limit (unlike tensordict's 100-byte strings) and keeps its type (bool stays bool).

Reads: each process maps the 16-byte header once and keeps the last value it unpickled
with its version. Reading an unchanged value compares the shared version word with the
cached one -- one aligned 8-byte load, no lock, no system call (~0.2 us). Only a changed
version takes the shared ``lockf`` lock and re-reads the payload (``pread`` + unpickle).
That is safe without a seqlock retry because the fast path never reads the payload: a
reader that still sees the old version returns the old value it had already read whole,
which is the value before the concurrent write (the write becomes visible when the
writer stores the new version, last, while holding the exclusive lock).

Writes take an exclusive ``lockf`` lock (processes) plus a thread lock, write the payload
and the length with ``pwrite``, then store the new version through the mapping.

Holders: the memfd travels to other processes like an anonymous segment, by reopening
``/proc/<pid>/fd/<fd>`` of a process that holds it. A pickled cell names the pickling
process first, then its *fallback holders*: the coordinators that adopted the cell (see
:mod:`shared_td.coordinator.ownership`), so a cell stays attachable after the process
that created it exited, for as long as such a coordinator lives.
"""
from __future__ import annotations

import contextlib
import ctypes
import fcntl
import mmap
import os
import pickle
import struct
import threading
import weakref
from typing import Any, Iterator

from shared_td.storage.anonymous import SegmentUnavailableError, new_memfd, reopen_peer_fd
from shared_td.storage.cache import InodeCache
from shared_td.storage.files import allocate, pwrite_all

_HEADER = struct.Struct("<QQ")  # version, payload length
_LENGTH = struct.Struct("<Q")
# The bytes that lockf locks (a lock needs no data there): _VALUE guards one read or
# write of the value, _UPDATE a whole update (see ``updating``).
_VALUE, _UPDATE = 0, 1


def _lockf(fd: int, operation: int, byte: int) -> None:
    fcntl.lockf(fd, operation, 1, byte)


# mmap through libc: Python's mmap.mmap would keep a second descriptor per cell.
_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.mmap.restype = ctypes.c_void_p
_LIBC.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_LIBC.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


def map_shared_bytes(fd: int, nbytes: int) -> int:
    """Map the first ``nbytes`` of ``fd`` (shared, read-write); returns the address.
    The caller unmaps it with ``unmap_bytes(address, nbytes)``; no descriptor is kept."""
    address = _LIBC.mmap(None, nbytes, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
    if address in (None, _MAP_FAILED):
        errno = ctypes.get_errno()
        raise OSError(errno, f"cannot map {nbytes} bytes of a memfd: {os.strerror(errno)}")
    return address


def unmap_bytes(address: int, nbytes: int) -> None:
    _LIBC.munmap(address, nbytes)


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
        #: (pid, fd) of other processes that hold the memfd for as long as they live
        #: (coordinators), tried in order when the pickling process is gone.
        self.holders: tuple[tuple[int, int], ...] = tuple(holders)
        self._finalizer = weakref.finalize(self, os.close, fd)
        # Mapped once: the version word read by every get(). The header's page was
        # reserved at creation, so touching it can never raise SIGBUS.
        try:
            address = map_shared_bytes(fd, _HEADER.size)
        except BaseException:
            self._finalizer()
            raise
        unmap = weakref.finalize(self, unmap_bytes, address, _HEADER.size)
        unmap.atexit = False  # exit unmaps anyway; a late get() must not find it gone
        self._version_word = ctypes.c_uint64.from_address(address)
        self._thread_lock = threading.Lock()
        self._update_lock = threading.Lock()
        # (version, value) in one tuple: a thread on the fast path never pairs a new
        # version with an old value.
        self._cached: tuple[int, Any] = (-1, None)

    @classmethod
    def create(cls, value: Any) -> "SharedValue":
        """A new shared cell holding ``value`` (which must be picklable).

        The header is reserved with ``posix_fallocate``: a full memory is a
        :class:`~shared_td.storage.files.StorageFullError` here, never a SIGBUS.
        """
        fd = new_memfd(f"shared_td-value-{os.getpid()}", _HEADER.size, "a shared non-tensor value")
        cell = cls(fd)
        cell.set(value)
        _CACHE.put(cell.key, cell)
        for batch in _new_cell_batches():
            batch.append(cell)
        return cell

    def get(self) -> Any:
        """The current value (the last one written by any process)."""
        version, value = self._cached
        if self._version_word.value == version:
            return value  # unchanged: no lock, no system call
        with self._thread_lock:
            _lockf(self.fd, fcntl.LOCK_SH, _VALUE)
            try:
                version, length = _HEADER.unpack(os.pread(self.fd, _HEADER.size, 0))
                if version != self._cached[0]:
                    payload = os.pread(self.fd, length, _HEADER.size)
                    self._cached = (version, pickle.loads(payload))
                return self._cached[1]
            finally:
                _lockf(self.fd, fcntl.LOCK_UN, _VALUE)

    def set(self, value: Any) -> None:
        """Replace the value for every process."""
        try:
            payload = pickle.dumps(value)
        except Exception as error:
            raise TypeError(
                f"A shared non-tensor value must be picklable; {type(value).__name__} is "
                f"not ({error})."
            ) from error
        with self._thread_lock:
            _lockf(self.fd, fcntl.LOCK_EX, _VALUE)
            try:
                # reserve first: a full memory then fails with the old value intact
                # (a pwrite cut short would have overwritten part of it)
                allocate(self.fd, _HEADER.size, max(len(payload), 1), "a shared non-tensor value")
                pwrite_all(self.fd, payload, _HEADER.size, where="a shared non-tensor value")
                os.pwrite(self.fd, _LENGTH.pack(len(payload)), _LENGTH.size)
                # last, one aligned 8-byte store: from here on readers see the new value
                self._version_word.value += 1
            finally:
                _lockf(self.fd, fcntl.LOCK_UN, _VALUE)

    @contextlib.contextmanager
    def updating(self) -> Iterator[None]:
        """Serialise whole updates between every process and thread: a
        read-modify-write (``set(f(get()))``) in the block loses no other update, and
        what the block does after ``set`` (rewriting files) happens in write order.
        """
        with self._update_lock:
            _lockf(self.fd, fcntl.LOCK_EX, _UPDATE)
            try:
                yield
            finally:
                _lockf(self.fd, fcntl.LOCK_UN, _UPDATE)

    def add_holders(self, holders) -> None:
        """Record more processes that hold this cell (e.g. a coordinator that adopted it)."""
        self.holders = tuple(dict.fromkeys((*self.holders, *map(tuple, holders))))

    def __reduce__(self):
        return _attach, (os.getpid(), self.fd, self.key, self.holders)

    def __repr__(self) -> str:
        return f"SharedValue(fd={self.fd}, inode={self.key[1]}, holders={list(self.holders)})"


# (st_dev, st_ino) -> this process's SharedValue of that cell; a fork child gets fresh
# thread locks (a fork taken while another thread was reading or writing a cell)
_CACHE = InodeCache(thread_locks=("_thread_lock", "_update_lock"))


def _attach(pid: int, fd: int, key: tuple[int, int], holders: tuple = ()) -> SharedValue:
    """Unpickle a cell: this process's copy, else the sender's descriptor, else a holder's."""
    key = tuple(key)
    return _CACHE.get_or_create(key, lambda: SharedValue(_reopen_from_any(key, ((pid, fd), *holders)), holders))


def _reopen_from_any(key: tuple[int, int], candidates) -> int:
    first_error = None
    for pid, fd in candidates:
        try:
            return reopen_peer_fd(pid, fd, key, what="shared non-tensor value")
        except SegmentUnavailableError as err:
            first_error = first_error or err
    raise first_error


# ----------------------------------------------------------------- new-cell batches
# memmap_(share_non_tensor=True) creates its cells inside ``collecting_new_cells()`` so
# that it can hand them all to a coordinator in one round trip.
_BATCHES = threading.local()


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
