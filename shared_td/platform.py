"""Platform primitives: the operating-system facilities that shared_td's shared memory
stands on, in one place (torch-free; imports nothing of shared_td, so that the
coordinator's manager process can load this file alone, see
:mod:`shared_td.coordinator.server`).

What shared_td needs, checked once when this module is imported (``import shared_td``
imports it first), with one ImportError naming what is missing:

* Linux, with
* ``memfd_create`` (kernel 3.17): anonymous shared memory that is never named in
  ``/dev/shm``, so a SIGKILL leaks nothing (:func:`new_memfd`);
* ``/proc/<pid>/fd``: a process opens its own descriptor on a peer's memfd
  (:func:`reopen_peer_fd`), on its own descriptor (:func:`reopen_description`), and
  maps a file through the descriptor it checked;
* open-file-description locks (``F_OFD_SETLKW``, kernel 3.15): :class:`ByteLock`.

``renameat2(RENAME_EXCHANGE)`` (kernel 3.15, glibc 2.28) swaps a directory into place
without the path ever going missing (:func:`rename_exchange`); where the C library lacks
it or the filesystem refuses it, atomic writes fall back to two renames.

Other primitives: liveness of a process by pid (:func:`pid_alive`: a zombie is dead),
raw ``mmap`` of a descriptor's bytes that keeps no descriptor (:func:`map_shared_bytes`)
and a non-blocking ``flock`` probe (:func:`try_flock`).

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
  Should the reopen fail (out of descriptors, say), every later take raises a
  RuntimeError that says so instead of silently sharing the parent's locks.

One aligned 8-byte word: shared memory structures publish with a single aligned 8-byte
store through a mapping (a ``ctypes`` 64-bit integer at an 8-byte-aligned address, which
CPython reads and writes with one 8-byte move). x86-64 and arm64 make such accesses
single-copy atomic, so a reader sees the old or the new word, never a mix, and a writer
killed at any instant has stored all of it or none.
"""
from __future__ import annotations

import os
import sys


def _missing() -> list[str]:
    """What this system lacks of what shared_td needs (see the module doc)."""
    if not sys.platform.startswith("linux"):
        return [f"Linux (this is {sys.platform!r})"]
    missing = []
    if not hasattr(os, "memfd_create"):
        missing.append("os.memfd_create (Linux 3.17 and a C library that has it)")
    if not os.path.isdir("/proc/self/fd"):
        missing.append("/proc (mounted procfs)")
    import fcntl

    if not hasattr(fcntl, "F_OFD_SETLKW"):
        missing.append("open-file-description locks (fcntl.F_OFD_SETLKW, Linux 3.15)")
    return missing


_MISSING = _missing()
if _MISSING:
    raise ImportError(
        "shared_td runs on Linux only: it needs memfd_create (Linux 3.17), /proc/<pid>/fd "
        "and open-file-description locks (F_OFD_SETLKW, Linux 3.15); this system lacks "
        f"{', '.join(_MISSING)}."
    )

import contextlib  # noqa: E402  (after the check: fcntl does not exist everywhere)
import ctypes  # noqa: E402
import errno  # noqa: E402
import fcntl  # noqa: E402
import functools  # noqa: E402
import mmap  # noqa: E402
import select  # noqa: E402
import struct  # noqa: E402
import threading  # noqa: E402
from typing import Iterator  # noqa: E402

__all__ = [
    "ByteLock", "CreatorWatch", "creator_pid", "map_shared_bytes", "new_memfd", "pid_alive", "rename_exchange",
    "reopen_description", "reopen_peer_fd", "try_flock", "unmap_bytes",
]

# struct flock on Linux: l_type, l_whence (short); l_start, l_len (off_t); l_pid (0 for
# OFD locks), padded to 32 bytes
_FLOCK = struct.Struct("@hhqqi4x")


def _request(kind: int, byte: int) -> bytes:
    return _FLOCK.pack(kind, os.SEEK_SET, byte, 1, 0)


class _ThreadLock(threading.RLock().__class__):
    """A C ``RLock`` (``with`` enters and exits in C, ``_is_owned()`` is a C check) that
    also answers :meth:`locked`, as a ``threading.Lock`` does: held by any thread."""

    def locked(self) -> bool:
        if self._is_owned() or not self.acquire(False):
            return True
        self.release()
        return False


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
        self.threads = threading.Lock() if for_blocks else _ThreadLock()
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
        if self.holder == me or (isinstance(self.threads, _ThreadLock) and self.threads._is_owned()):
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
        self.threads = _ThreadLock() if isinstance(self.threads, _ThreadLock) else threading.Lock()
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


# --------------------------------------------------------------------- memfds


def new_memfd(name: str, nbytes: int) -> int:
    """A new memfd (close-on-exec; ``name`` shows in ``/proc/<pid>/fd``, never in
    ``/dev/shm``) of ``nbytes`` bytes, all reserved with ``posix_fallocate``: touching
    them never raises SIGBUS. A full memory is the OSError of ``posix_fallocate``
    (``ENOSPC``, ``ENOMEM``) or of :func:`shared_td.memory_check.check_memory_room`,
    raised with the new descriptor closed (what was reserved is freed). The caller owns it. A memfd has no
    size limit of its own (reserving more than the memory fills RAM until the OOM killer
    ends some process): a big size is checked first, and reserved in chunks, checked
    again before each (memory taken by others meanwhile stops it too).

    Example:
        >>> fd = new_memfd("example", 64)
        >>> os.fstat(fd).st_size
        64
        >>> os.close(fd)
    """
    _memory_check.check_growth(nbytes)  # before anything exists
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        for start in range(0, nbytes, _ALLOCATE_CHUNK):
            left = nbytes - start
            if start:
                _memory_check.check_growth(left)
            os.posix_fallocate(fd, start, min(left, _ALLOCATE_CHUNK))
    except BaseException:
        os.close(fd)
        raise
    return fd


# Reserved in chunks of this size, the memory checked again before each
_ALLOCATE_CHUNK = 1 << 28


def _load_sibling(name: str):
    """The torch-free module ``shared_td.<name>`` (a file beside this one): the one
    imported already, else loaded by its path, as this module may be (the coordinator's
    manager process loads it alone: importing the package would import torch)."""
    import importlib.util
    full_name = f"shared_td.{name}"
    if "shared_td" in sys.modules:  # imported through the package
        return importlib.import_module(full_name)
    if full_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            full_name, os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[full_name] = module
        spec.loader.exec_module(module)
    return sys.modules[full_name]


_memory_check = _load_sibling("memory_check")


def reopen_peer_fd(pid: int, fd: int, key: tuple[int, int]) -> int:
    """Our own read-write descriptor (close-on-exec) on the file that process ``pid``
    holds as descriptor ``fd``, opened through ``/proc/<pid>/fd/<fd>`` (allowed between
    processes of one user) and checked to be the file ``key`` = ``(st_dev, st_ino)``.
    The caller owns it.

    Raises the OSError of the open when the process or its descriptor is gone
    (``ENOENT``) or is not ours to open (``EACCES``), and an OSError ``ESTALE`` when the
    descriptor number now names another file.

    Example:
        >>> fd = new_memfd("example", 8)
        >>> st = os.fstat(fd)
        >>> mine = reopen_peer_fd(os.getpid(), fd, (st.st_dev, st.st_ino))
        >>> os.path.samestat(os.fstat(mine), st), mine != fd
        (True, True)
        >>> os.close(mine); os.close(fd)
    """
    new_fd = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
    try:
        st = os.fstat(new_fd)
        if (st.st_dev, st.st_ino) != tuple(key):
            raise OSError(errno.ESTALE, f"descriptor {fd} now names another file (process {pid})")
    except BaseException:
        os.close(new_fd)
        raise
    return new_fd


# mmap through libc: Python's mmap.mmap keeps a second descriptor per mapping. libc is
# the process's own (dlopen(NULL) finds its symbols): ctypes.util.find_library("c") would
# run `ldconfig -p` in a subprocess at every import (each coordinator server's start).
_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.mmap.restype = ctypes.c_void_p
_LIBC.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_LIBC.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


def map_shared_bytes(fd: int, nbytes: int) -> int:
    """Map the first ``nbytes`` of ``fd`` (shared, read-write); returns the address.
    The caller unmaps it with ``unmap_bytes(address, nbytes)``; no descriptor is kept.

    Example:
        >>> fd = new_memfd("example", 8)
        >>> address = map_shared_bytes(fd, 8)
        >>> ctypes.c_uint64.from_address(address).value = 7
        >>> os.pread(fd, 1, 0)
        b'\\x07'
        >>> unmap_bytes(address, 8); os.close(fd)
    """
    return _map_bytes(fd, nbytes, mmap.MAP_SHARED)


def map_private_bytes(fd: int, nbytes: int) -> int:
    """:func:`map_shared_bytes`, but copy-on-write (``MAP_PRIVATE``): writes stay in
    this process, never reach the file; ``fd`` may be read-only.

    Example:
        >>> fd = new_memfd("example", 8)
        >>> address = map_private_bytes(fd, 8)
        >>> ctypes.c_uint64.from_address(address).value = 7
        >>> os.pread(fd, 1, 0)
        b'\\x00'
        >>> unmap_bytes(address, 8); os.close(fd)
    """
    return _map_bytes(fd, nbytes, mmap.MAP_PRIVATE)


def _map_bytes(fd: int, nbytes: int, flags: int) -> int:
    address = _LIBC.mmap(None, nbytes, mmap.PROT_READ | mmap.PROT_WRITE, flags, fd, 0)
    if address in (None, _MAP_FAILED):
        code = ctypes.get_errno()
        raise OSError(code, f"cannot map {nbytes} bytes of descriptor {fd}: {os.strerror(code)}")
    return address


def unmap_bytes(address: int, nbytes: int) -> None:
    """Undo :func:`map_shared_bytes` or :func:`map_private_bytes`."""
    _LIBC.munmap(address, nbytes)


# --------------------------------------------------------------------- paths

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_renameat2 = getattr(_LIBC, "renameat2", None)  # glibc 2.28
if _renameat2 is not None:
    _renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    _renameat2.restype = ctypes.c_int


def rename_exchange(first: str, second: str) -> bool:
    """Swap the two existing paths ``first`` and ``second`` in one step
    (``renameat2(RENAME_EXCHANGE)``): neither path is ever missing. False, with nothing
    changed, where the C library or the filesystem cannot (the caller falls back to
    renames); any other failure is an OSError naming both paths.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as d:
        ...     a, b = os.path.join(d, "a"), os.path.join(d, "b")
        ...     os.mkdir(a); open(b, "w").close()
        ...     rename_exchange(a, b), os.path.isdir(b), os.path.isfile(a)
        (True, True, True)
    """
    if _renameat2 is None:
        return False
    result = _renameat2(_AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), _RENAME_EXCHANGE)
    if result == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EXDEV, errno.ENOTSUP):
        return False
    raise OSError(code, f"renameat2(RENAME_EXCHANGE) of {first} and {second}: {os.strerror(code)}")


# --------------------------------------------------------------------- processes


def creator_pid() -> int:
    """The pid of the process that started this one, as that process gave it (watch it
    with :class:`CreatorWatch`).

    Why not ``os.getppid()`` read when the child starts: a creator killed before the
    child ran that line has already handed the child to the reaper (init, or a
    subreaper), whose pid the child would then take for its creator's and watch for
    ever. A child of multiprocessing (or of multiprocess) gets the pid its creator
    recorded when it made the Process; any other process, ``os.getppid()`` (a child
    run by :mod:`subprocess` gets its creator's pid on its command line instead, see
    ``shared_td.coordinator.server``).

    Example:
        >>> creator_pid() == os.getppid()  # not a multiprocessing child
        True
    """
    for name in ("multiprocessing", "multiprocess"):  # whichever made this process
        module = sys.modules.get(name)
        parent = module.parent_process() if module is not None else None
        if parent is not None:
            return parent.pid
    return os.getppid()


class CreatorWatch:
    """Whether the process that started this one (:func:`creator_pid`, or ``pid``) has
    ended: :meth:`gone`, for a child that must not outlive it (even by SIGKILL).

    A pidfd of the creator, opened once (Linux 5.3), becomes readable when that very
    process ends, whoever this process's parent is: a child started through a fork
    server (multiprocessing's "forkserver", the default from Python 3.14) has the server
    as its parent, so comparing ``os.getppid()`` with the creator's pid said "gone" at
    once. Without pidfds the parent pid is compared (the creator must then be the
    parent, as with fork and spawn). A creator already gone when the watch is made is
    gone.

    Example:
        >>> CreatorWatch(os.getpid()).gone(), CreatorWatch(0).gone()
        (False, True)
    """

    def __init__(self, pid: int | None = None):
        self.pid = creator_pid() if pid is None else pid
        self._fd: int | None = None
        self._gone = self.pid <= 0
        if not self._gone:
            try:
                self._fd = os.pidfd_open(self.pid)  # (close-on-exec)
            except ProcessLookupError:
                self._gone = True
            except (AttributeError, OSError):
                pass  # no pidfds here: the parent pid is compared

    def gone(self) -> bool:
        if not self._gone:
            if self._fd is not None:
                self._gone = bool(select.select([self._fd], [], [], 0)[0])
            else:
                self._gone = os.getppid() != self.pid
            if self._gone:
                self.close()
        return self._gone

    def close(self) -> None:
        """Let go of the pidfd (also done when the creator is found gone, or at collection)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    __del__ = close


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists and can still act.

    A zombie (a process that exited and that its parent has not reaped yet, or never
    will, as under an init that does not reap) is dead: it will never run again, so
    whatever it held -- a lock, a half-written directory -- is abandoned. A process of
    another user is alive. A pid of 0 or below names no process (``kill`` would read it
    as a process group): dead.

    Example:
        >>> pid_alive(os.getpid()), pid_alive(0)
        (True, False)
    """
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists, another user's: its state below says whether it can act
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat_file:
            # "pid (comm) state ...": comm may hold spaces and parentheses, so the state
            # is the first field after the last ")"
            state = stat_file.read().rsplit(b")", 1)[1].split()[0]
    except FileNotFoundError:
        return False  # reaped since the kill
    except (OSError, IndexError):
        return True  # exists, but its state cannot be read: count it alive (never sweep it)
    return state not in (b"Z", b"X")  # zombie, or dead and being reaped
