"""Platform primitives: the operating-system facilities that shared_td's shared memory
stands on, in one place (torch-free; imports nothing of shared_td).

Locks between processes *and* threads -- :class:`ByteLock`:

* The lock that processes see is an *open file description* (OFD) lock on one byte of
  a file (Linux ``F_OFD_SETLKW``). It belongs to the open file description, not to the
  process: POSIX ``lockf``/``fcntl`` record locks belong to the process, so two threads
  of one process that wait on two locks look to the kernel like one owner waiting on
  itself, and it answers ``EDEADLK`` ("Resource deadlock avoided") to a thread of
  another process that closes the false cycle. The kernel does no deadlock detection on
  OFD locks; our lock order (documented by each user) prevents real cycles.
* Threads of one process share that description, so an OFD lock does not separate
  them: each ByteLock holds a thread lock, always taken *before* the OFD lock and
  released after it.
* A process killed while holding the lock loses it when its last descriptor on that
  description closes, i.e. at its death.
* Fork: a fork child inherits the *same* description, so parent and child would hold
  each other's locks (a lock held by the parent at the fork would look held by the
  child too, and either one's unlock would drop both). The objects that own a
  descriptor therefore call :func:`reopen_description` in a fork child (through their
  cache's at-fork hook, before any code of the child runs): the child then has its own
  description under the same descriptor number, and :meth:`ByteLock.renew_after_fork`
  gives it fresh thread locks (a thread of the parent may have held one at the fork).
  Should the reopen fail (no ``/proc``), every later acquire raises a RuntimeError that
  says so instead of silently sharing the parent's locks.
* Without ``F_OFD_SETLKW`` (not Linux) the process-owned ``lockf`` lock is used: correct
  between processes, but the false ``EDEADLK`` above remains possible there.

One aligned 8-byte word: shared memory structures publish with a single aligned 8-byte
store through a mapping (a ``ctypes`` 64-bit integer at an 8-byte-aligned address, which
CPython reads and writes with one 8-byte move). x86-64 and arm64 make such accesses
single-copy atomic, so a reader sees the old or the new word, never a mix, and a writer
killed at any instant has stored all of it or none.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import struct
import threading
from typing import Iterator

__all__ = ["ByteLock", "reopen_description"]

_OFD = hasattr(fcntl, "F_OFD_SETLKW")
# struct flock on Linux: l_type, l_whence (short); l_start, l_len (off_t); l_pid (0 for
# OFD locks), padded to 32 bytes
_FLOCK = struct.Struct("@hhqqi4x")


def _request(kind: int, byte: int) -> bytes:
    return _FLOCK.pack(kind, os.SEEK_SET, byte, 1, 0)


class ByteLock:
    """Byte ``byte`` of the file open as ``fd`` locked between processes (an OFD lock)
    and between this process's threads (a thread lock, taken first).

    Shared (``exclusive=False``) holders exclude exclusive ones, as a reader-writer lock.
    The descriptor must stay open for the lock's life; the lock does not own it.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryFile() as f:
        ...     lock = ByteLock(f.fileno(), 0)
        ...     with lock.hold(exclusive=True):
        ...         pass
    """

    __slots__ = ("fd", "byte", "_thread_lock", "_shared", "_exclusive", "_unlock", "_broken")

    def __init__(self, fd: int, byte: int):
        self.fd = fd
        self.byte = byte
        self._thread_lock = threading.Lock()
        self._shared = _request(fcntl.F_RDLCK, byte)
        self._exclusive = _request(fcntl.F_WRLCK, byte)
        self._unlock = _request(fcntl.F_UNLCK, byte)
        self._broken: str | None = None

    def acquire(self, exclusive: bool = True) -> None:
        """Wait for the lock (fcntl retries on EINTR and releases the GIL meanwhile)."""
        if self._broken is not None:
            raise RuntimeError(self._broken)
        self._thread_lock.acquire()
        try:
            if _OFD:
                fcntl.fcntl(self.fd, fcntl.F_OFD_SETLKW, self._exclusive if exclusive else self._shared)
            else:
                fcntl.lockf(self.fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH, 1, self.byte)
        except BaseException:
            self._thread_lock.release()
            raise

    def release(self) -> None:
        try:
            if _OFD:
                fcntl.fcntl(self.fd, fcntl.F_OFD_SETLK, self._unlock)
            else:
                fcntl.lockf(self.fd, fcntl.LOCK_UN, 1, self.byte)
        finally:
            self._thread_lock.release()

    @contextlib.contextmanager
    def hold(self, exclusive: bool = True) -> Iterator[None]:
        self.acquire(exclusive)
        try:
            yield
        finally:
            self.release()

    def renew_after_fork(self, reopen_error: OSError | None = None) -> None:
        """In a fork child, after :func:`reopen_description` of ``fd``: a fresh thread
        lock; if the reopen failed (``reopen_error``), refuse every later acquire."""
        self._thread_lock = threading.Lock()
        if reopen_error is not None:
            self._broken = (
                f"This fork child could not open its own description of descriptor "
                f"{self.fd} ({reopen_error}), so it cannot take locks that exclude its "
                "parent's. Start the process with the 'spawn' method, or pass the object "
                "to it pickled."
            )


def reopen_description(fd: int) -> None:
    """Make ``fd`` refer to a new open file description of the same file, with the same
    access mode, close-on-exec (through ``/proc/self/fd``); the old description stays
    with whoever else refers to it (the fork parent). OSError if it cannot.

    Example:
        >>> fd = os.memfd_create("example")
        >>> reopen_description(fd); os.fstat(fd).st_size
        0
        >>> os.close(fd)
    """
    flags = fcntl.fcntl(fd, fcntl.F_GETFL) & (os.O_ACCMODE | os.O_APPEND)
    new_fd = os.open(f"/proc/self/fd/{fd}", flags | os.O_CLOEXEC)
    try:
        os.dup2(new_fd, fd, inheritable=False)
    finally:
        os.close(new_fd)
