"""SharedValue: one Python value that the processes of a node read and write.

This is the mechanism behind ``memmap_(share_non_tensor=True)`` until the Coordinator
owns non-tensor state.  The value lives in an anonymous memfd as
``[version: u64][length: u64][pickled value]``, so it has no size limit (unlike
tensordict's 100-byte strings) and keeps its type (bool stays bool).  Writers take an
exclusive ``lockf`` lock on the memfd (processes) plus a thread lock; readers take a
shared lock, and re-unpickle only when the version changed.  The memfd travels to other
processes like an anonymous segment: by reopening ``/proc/<pid>/fd/<fd>`` of a holder,
under every pickler and start method.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import pickle
import struct
import threading
import weakref
from typing import Any, Iterator

from shared_td.storage.anonymous import reopen_peer_fd

_HEADER = struct.Struct("<QQ")  # version, payload length
# The bytes that lockf locks (a lock needs no data there): _VALUE guards one read or
# write of the value, _UPDATE a whole update (see ``updating``).
_VALUE, _UPDATE = 0, 1


def _lockf(fd: int, operation: int, byte: int) -> None:
    fcntl.lockf(fd, operation, 1, byte)


class SharedValue:
    """A picklable handle on a value shared between processes.

    Examples:
        >>> cell = SharedValue.create("walk")
        >>> clone = pickle.loads(pickle.dumps(cell))   # e.g. in another process
        >>> clone.set("run"); cell.get()
        'run'
    """

    def __init__(self, fd: int):
        # Private: use SharedValue.create, or pickle. Takes ownership of fd.
        self.fd = fd
        stat = os.fstat(fd)
        self.key = (stat.st_dev, stat.st_ino)
        self._finalizer = weakref.finalize(self, os.close, fd)
        self._thread_lock = threading.Lock()
        self._update_lock = threading.Lock()
        self._cached_version = -1
        self._cached_value: Any = None

    @classmethod
    def create(cls, value: Any) -> "SharedValue":
        """A new shared cell holding ``value`` (which must be picklable)."""
        fd = os.memfd_create(f"shared_td-value-{os.getpid()}", os.MFD_CLOEXEC)
        cell = cls(fd)
        cell.set(value)
        with _CACHE_LOCK:
            _CACHE[cell.key] = cell
        return cell

    def get(self) -> Any:
        """The current value (the last one written by any process)."""
        with self._thread_lock:
            _lockf(self.fd, fcntl.LOCK_SH, _VALUE)
            try:
                version, length = _HEADER.unpack(os.pread(self.fd, _HEADER.size, 0))
                if version != self._cached_version:
                    payload = os.pread(self.fd, length, _HEADER.size)
                    self._cached_value = pickle.loads(payload)
                    self._cached_version = version
                return self._cached_value
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
                header = os.pread(self.fd, _HEADER.size, 0)
                version = _HEADER.unpack(header)[0] if len(header) == _HEADER.size else 0
                os.pwrite(self.fd, payload, _HEADER.size)
                os.pwrite(self.fd, _HEADER.pack(version + 1, len(payload)), 0)
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

    def __reduce__(self):
        return _attach, (os.getpid(), self.fd, self.key)

    def __repr__(self) -> str:
        return f"SharedValue(fd={self.fd}, inode={self.key[1]})"


_CACHE: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_CACHE_LOCK = threading.Lock()


def _attach(pid: int, fd: int, key: tuple[int, int]) -> SharedValue:
    key = tuple(key)
    with _CACHE_LOCK:
        cell = _CACHE.get(key)
        if cell is None:
            cell = SharedValue(reopen_peer_fd(pid, fd, key, what="shared non-tensor value"))
            _CACHE[key] = cell
        return cell
