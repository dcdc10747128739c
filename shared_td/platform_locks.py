"""Locks between processes *and* threads -- :class:`ByteLock` -- and the other lock
primitives of :mod:`shared_td.platform` (:func:`reopen_description`, :func:`try_flock`),
which re-exports them: import them from there.

Torch-free, and imports nothing of shared_td: :mod:`shared_td.platform` loads it by path
when it is loaded alone (the coordinator's manager process, see
:mod:`shared_td.coordinator.server`), after its check that this system has what they
need (open-file-description locks).

How a ByteLock locks:

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
  Should the reopen fail (out of descriptors, say), every later take raises a
  RuntimeError that says so instead of silently sharing the parent's locks.
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import struct
import threading
from typing import Iterator

__all__ = ["ByteLock", "ThreadLock", "reopen_description", "try_flock"]

# struct flock on Linux: l_type, l_whence (short); l_start, l_len (off_t); l_pid (0 for
# OFD locks), padded to 32 bytes
_FLOCK = struct.Struct("@hhqqi4x")


def _request(kind: int, byte: int) -> bytes:
    return _FLOCK.pack(kind, os.SEEK_SET, byte, 1, 0)


class ThreadLock(threading.RLock().__class__):
    """A C ``RLock`` (``with`` enters and exits in C, ``_is_owned()`` is a C check) that
    also answers :meth:`locked`, as a ``threading.Lock`` does: held by any thread.

    A wait for it that must be bounded (``acquire(timeout=)``) holds it with this exact
    pattern::

        lock.refuse_reentry("what is being done")
        try:
            if not lock.acquire(timeout=seconds):
                raise TimeoutError("...")
            ...                      # the locked section
        finally:
            try:
                lock.release()
            except RuntimeError:
                pass                 # not taken: timed out, or interrupted before it was

    Why this shape: a Ctrl-C's KeyboardInterrupt surfaces right after any call returns,
    so ``if not lock.acquire(...): raise`` before the ``try`` can leave the lock held for
    good, and a Python ``__exit__`` (or a helper called in the ``finally``) can be cut
    before it releases. Here the acquire is inside the ``try``, and the release is one C
    call that checks that this thread holds the lock (RuntimeError if not), so the
    ``finally`` needs no flag that an interrupted acquire could not set. The re-entry
    check comes first, as the ``finally`` would otherwise give back an outer hold. (A
    KeyboardInterrupt reaches only the main thread: a lock that only other threads take
    needs none of this.) Like any RLock, a thread that holds it takes it again at once,
    ``acquire(blocking=False)`` included: code that must not re-enter checks
    :meth:`refuse_reentry` (or ``_is_owned()``) first.

    Example:
        >>> lock = ThreadLock()
        >>> lock.refuse_reentry("an example")
        >>> try:
        ...     if not lock.acquire(timeout=1.0):
        ...         raise TimeoutError("held elsewhere")
        ...     print(lock.locked())
        ...     lock.refuse_reentry("an example, nested")
        ... finally:
        ...     try:
        ...         lock.release()
        ...     except RuntimeError:
        ...         pass
        Traceback (most recent call last):
        ...
        RuntimeError: an example, nested: this thread holds the lock already ...
        >>> lock.locked()
        False
    """

    def locked(self) -> bool:
        if self._is_owned() or not self.acquire(False):
            return True
        self.release()
        return False

    def refuse_reentry(self, what: str) -> None:
        """RuntimeError if this thread holds the lock (``what``: the operation), which
        waiting would turn into a wait for itself."""
        if self._is_owned():
            raise RuntimeError(
                f"{what}: this thread holds the lock already (the operation was nested, or a signal "
                "handler or finalizer ran it while the code it interrupted held it). Waiting would only "
                "time out: do that work outside the handler (set a flag there, act on it later)."
            )


class ByteLock:
    """Byte ``byte`` of the file open as ``fd`` locked between processes (an OFD lock)
    and between this process's threads (a thread lock, :attr:`threads`, taken first).

    Shared (:meth:`take_shared`) holders exclude exclusive ones (:meth:`take`), as a
    reader-writer lock. The descriptor must stay open for the lock's life; the lock does
    not own it.

    Hold it with this exact pattern (or :meth:`hold`, which wraps it)::

        if lock.threads._is_owned():
            raise lock.reentered("what is being done")
        with lock.threads:
            try:
                lock.take()        # or lock.take_shared()
                ...                # the locked section
            finally:
                lock.give_back()

    Why this shape: an exception raised by a signal handler (Ctrl-C's
    KeyboardInterrupt, a test-timeout alarm) surfaces at the next point where CPython
    checks for pending signals: right after any call returns and at the entry of any
    Python function. A lock taken by a call that *returns*, then protected by a
    ``try`` (or released by a Python ``__exit__``), can so be left held for ever by a
    process that caught the exception, and every other process then waits on it. Here
    no Python frame runs between taking and protecting, nor between the section and
    giving back: ``with`` on a thread lock enters and exits in C; :meth:`take`,
    :meth:`take_shared` and :meth:`give_back` are C calls (``functools.partial`` of
    ``fcntl``), each inside the ``try``; and giving back a byte not taken (``take``
    interrupted) is a no-op, as no other thread of this process can hold it on this
    description (we hold :attr:`threads`).

    Re-entry: :attr:`threads` is an ``RLock`` for its ``_is_owned()``, a C check only
    the owning thread can pass: a signal handler or finalizer using the lock while the
    frame it interrupted holds it would wait for ever on itself; the check makes it a
    RuntimeError (:meth:`reentered`) instead.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryFile() as f:
        ...     lock = ByteLock(f.fileno(), 0)
        ...     with lock.threads:
        ...         try:
        ...             _ = lock.take_shared()  # (fcntl's answer: the request's bytes)
        ...         finally:
        ...             _ = lock.give_back()
        ...     with lock.hold(exclusive=True):
        ...         pass
    """

    __slots__ = ("fd", "byte", "threads", "holder", "take", "take_shared", "give_back")

    def __init__(self, fd: int, byte: int, *, for_blocks: bool = False):
        self.fd = fd
        self.byte = byte
        # for _is_owned() (see "Re-entry" above); a lock held only by hold() blocks
        # (``for_blocks``) is a plain Lock, released by whichever thread leaves the block
        # (a generator resumed or closed on another thread), its holder noted for re-entry
        self.threads = threading.Lock() if for_blocks else ThreadLock()
        self.holder: int | None = None  # the thread inside a hold() block
        self.take = functools.partial(fcntl.fcntl, fd, fcntl.F_OFD_SETLKW, _request(fcntl.F_WRLCK, byte))
        self.take_shared = functools.partial(fcntl.fcntl, fd, fcntl.F_OFD_SETLKW, _request(fcntl.F_RDLCK, byte))
        self.give_back = functools.partial(fcntl.fcntl, fd, fcntl.F_OFD_SETLK, _request(fcntl.F_UNLCK, byte))

    @contextlib.contextmanager
    def hold(self, exclusive: bool = True) -> Iterator[None]:
        """The pattern above as a context manager, for code that is not on a hot path.
        Its own entry and exit are Python frames: an exception that a signal handler
        raises exactly there leaves the lock held until that exception is discarded
        (the generator is then closed, which gives the lock back)."""
        take = self.take if exclusive else self.take_shared
        me = threading.get_ident()
        if self.holder == me or (isinstance(self.threads, ThreadLock) and self.threads._is_owned()):
            raise self.reentered("a nested hold() of the same lock")
        with self.threads:
            self.holder = me
            try:
                take()
                yield
            finally:
                self.holder = None
                self.give_back()

    def reentered(self, what: str) -> RuntimeError:
        """The error for this thread taking the lock it already holds (``what``: the
        operation), which waiting would turn into a hang. Example:

            >>> import tempfile
            >>> with tempfile.TemporaryFile() as f:
            ...     print("signal handler" in str(ByteLock(f.fileno(), 0).reentered("x")))
            True
        """
        return RuntimeError(
            f"{what}: this thread is in the middle of an operation on the same lock (byte "
            f"{self.byte} of descriptor {self.fd}): a signal handler or finalizer (__del__, weakref "
            "callback) used it while the code it interrupted held it, or a block was nested. Waiting "
            "would hang for ever: do that work outside the handler (set a flag there, act on it later)."
        )

    def renew_after_fork(self, reopen_error: OSError | None = None) -> None:
        """In a fork child, after :func:`reopen_description` of ``fd``: a fresh thread
        lock; if the reopen failed (``reopen_error``), refuse every later take (and
        never give back: the description is still the parent's, with its locks)."""
        self.threads = ThreadLock() if isinstance(self.threads, ThreadLock) else threading.Lock()
        self.holder = None
        if reopen_error is not None:
            message = (
                f"This fork child could not open its own description of descriptor "
                f"{self.fd} ({reopen_error}), so it cannot take locks that exclude its "
                "parent's. Start the process with the 'spawn' method, or pass the object "
                "to it pickled."
            )

            def refuse():
                raise RuntimeError(message)

            self.take = self.take_shared = refuse
            self.give_back = _nothing


def _nothing() -> None:
    pass


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


def try_flock(fd: int) -> bool:
    """Take the exclusive ``flock`` of ``fd`` without waiting; False if another open
    file description holds it. Closing ``fd`` (its last descriptor) drops it.

    Example:
        >>> import tempfile
        >>> with tempfile.NamedTemporaryFile() as f:
        ...     other = os.open(f.name, os.O_RDONLY)
        ...     try_flock(f.fileno()), try_flock(other)
        ...     os.close(other)
        (True, False)
    """
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True
