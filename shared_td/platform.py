"""Platform primitives: the operating-system facilities that shared_td's shared memory
stands on, in one place (torch-free; of shared_td it loads only its torch-free siblings
memory_check.py and platform_locks.py, by path when it is loaded alone, so that the
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
* open-file-description locks (``F_OFD_SETLKW``, kernel 3.15): :class:`ByteLock`
  (in :mod:`shared_td.platform_locks`, with how it locks between processes *and*
  threads, and across a fork; re-exported here).

``renameat2(RENAME_EXCHANGE)`` (kernel 3.15, glibc 2.28) swaps a directory into place
without the path ever going missing (:func:`rename_exchange`); where the C library lacks
it or the filesystem refuses it, atomic writes fall back to two renames.

Other primitives: liveness of a process by pid (:func:`pid_alive`: a zombie is dead),
raw ``mmap`` of a descriptor's bytes that keeps no descriptor (:func:`map_shared_bytes`)
and a non-blocking ``flock`` probe (:func:`try_flock`).

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
    if not hasattr(fcntl, "F_ADD_SEALS"):
        missing.append("memfd seals (fcntl.F_ADD_SEALS, Linux 3.17)")
    return missing


_MISSING = _missing()
if _MISSING:
    raise ImportError(
        "shared_td runs on Linux only: it needs memfd_create (Linux 3.17), /proc/<pid>/fd "
        "and open-file-description locks (F_OFD_SETLKW, Linux 3.15); this system lacks "
        f"{', '.join(_MISSING)}."
    )

import ctypes  # noqa: E402  (after the check: what follows needs what it checks)
import errno  # noqa: E402
import fcntl  # noqa: E402
import mmap  # noqa: E402
import select  # noqa: E402
import stat  # noqa: E402
import time  # noqa: E402

__all__ = [
    "ByteLock", "CreatorWatch", "creator_pid", "free_bytes", "map_shared_bytes", "new_memfd", "pid_alive", "process_stat",
    "rename_exchange", "reopen_description", "reopen_peer_fd", "ThreadLock", "try_flock", "unmap_bytes",
]


def _load_sibling(name: str):
    """The torch-free module ``shared_td.<name>`` (``name`` may be dotted:
    ``coordinator.registry``): the one imported already, else loaded by its path below
    this file's folder, as this module may be (the coordinator's manager process loads
    them alone: importing the package would import torch)."""
    import importlib.util
    full_name = f"shared_td.{name}"
    if "shared_td" in sys.modules:  # imported through the package
        return importlib.import_module(full_name)
    if full_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            full_name, os.path.join(os.path.dirname(os.path.abspath(__file__)), *name.split(".")) + ".py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[full_name] = module
        spec.loader.exec_module(module)
    return sys.modules[full_name]


_memory_check = _load_sibling("memory_check")
# the lock primitives, in a module of their own (see there); their home for importers is here
_locks = _load_sibling("platform_locks")
ByteLock, ThreadLock, reopen_description, try_flock = (_locks.ByteLock, _locks.ThreadLock, _locks.reopen_description,
                                                      _locks.try_flock)


# --------------------------------------------------------------------- memfds


def new_memfd(name: str, nbytes: int) -> int:
    """A new memfd (close-on-exec; ``name`` shows in ``/proc/<pid>/fd``, never in
    ``/dev/shm``) of ``nbytes`` bytes, all reserved with ``posix_fallocate``, and sealed
    against shrinking (``F_SEAL_SHRINK``; another process of the user could otherwise
    truncate it through ``/proc``): touching them never raises SIGBUS. A full memory is the OSError of ``posix_fallocate``
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
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        for start in range(0, nbytes, _ALLOCATE_CHUNK):
            left = nbytes - start
            if start:
                _memory_check.check_growth(left)
            os.posix_fallocate(fd, start, min(left, _ALLOCATE_CHUNK))
        # never smaller: a process of the user truncating it (through /proc/<pid>/fd)
        # would make every mapping of it raise SIGBUS; growing, punching holes and
        # writing stay allowed, and no other seal can be added
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL)
    except BaseException:
        os.close(fd)
        raise
    return fd


# Reserved in chunks of this size, the memory checked again before each
_ALLOCATE_CHUNK = 1 << 28


def reopen_peer_fd(pid: int, fd: int, key: tuple[int, int]) -> int:
    """Our own read-write descriptor (close-on-exec) on the file that process ``pid``
    holds as descriptor ``fd``, opened through ``/proc/<pid>/fd/<fd>`` (allowed between
    processes of one user) and checked to be the file ``key`` = ``(st_dev, st_ino)``.
    The caller owns it.

    Raises the OSError of the open when the process or its descriptor is gone
    (``ENOENT``) or is not ours to open (``EACCES``), and an OSError ``ESTALE`` when the
    descriptor number now names another file. That file is never opened for reading or
    writing: a stale number may name a FIFO (opening it would release a writer waiting
    for a reader) or a device (opening it runs its driver). So the path is first opened
    ``O_PATH`` (no open of the file itself), checked to be a regular file (a memfd is
    one) with inode ``key``, and only that checked inode is opened read-write, through
    ``/proc/self/fd``.

    Example:
        >>> fd = new_memfd("example", 8)
        >>> st = os.fstat(fd)
        >>> mine = reopen_peer_fd(os.getpid(), fd, (st.st_dev, st.st_ino))
        >>> os.path.samestat(os.fstat(mine), st), mine != fd
        (True, True)
        >>> os.close(mine); os.close(fd)
    """
    if type(pid) is not int or type(fd) is not int:  # a path built from anything else names anything
        raise TypeError(f"a peer descriptor is two ints (pid, fd), got {pid!r}, {fd!r}")
    path_fd = os.open(f"/proc/{pid}/fd/{fd}", os.O_PATH | os.O_CLOEXEC)
    try:
        st = os.fstat(path_fd)
        if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != tuple(key):
            raise OSError(errno.ESTALE, f"descriptor {fd} now names another file (process {pid})")
        # the inode just checked, never whatever /proc/<pid>/fd/<fd> names by now
        return os.open(f"/proc/self/fd/{path_fd}", os.O_RDWR | os.O_CLOEXEC | os.O_NOCTTY)
    finally:
        os.close(path_fd)


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
        >>> unmap_bytes(address, 8), os.close(fd)
        (0, None)
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
        >>> unmap_bytes(address, 8), os.close(fd)
        (0, None)
    """
    return _map_bytes(fd, nbytes, mmap.MAP_PRIVATE)


def _map_bytes(fd: int, nbytes: int, flags: int) -> int:
    address = _LIBC.mmap(None, nbytes, mmap.PROT_READ | mmap.PROT_WRITE, flags, fd, 0)
    if address in (None, _MAP_FAILED):
        code = ctypes.get_errno()
        raise OSError(code, f"cannot map {nbytes} bytes of descriptor {fd}: {os.strerror(code)}")
    return address


# unmap_bytes(address, nbytes) undoes map_shared_bytes or map_private_bytes. It is the C
# function itself, not a Python function around it: finalizers call it, and no Ctrl-C can
# land inside a call that runs no bytecode (shared_td.finalizers).
unmap_bytes = _LIBC.munmap


_LIBC.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02


def free_bytes(fd: int, offset: int, nbytes: int) -> bool:
    """Give the memory of bytes ``offset .. offset + nbytes`` of the memfd ``fd`` back
    (``fallocate(FALLOC_FL_PUNCH_HOLE)``; the file keeps its size, those bytes then read
    as zeros); only whole pages are freed. Whether it was done: best effort, a system
    that cannot punch holes keeps the memory.

    Example:
        >>> fd = new_memfd("example", 3 * mmap.PAGESIZE)
        >>> free_bytes(fd, mmap.PAGESIZE, mmap.PAGESIZE), os.fstat(fd).st_size == 3 * mmap.PAGESIZE
        (True, True)
        >>> os.close(fd)
    """
    return _LIBC.fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, nbytes) == 0


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
        >>> CreatorWatch(os.getpid()).wait(timeout=0.01)
        False
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

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the creator has ended (True) or ``timeout`` seconds passed (then
        whether it has): on its pidfd, else polling the parent pid every 0.2 s."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.gone():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            if self._fd is not None:
                select.select([self._fd], [], [], left)
            else:
                time.sleep(0.2 if left is None else min(0.2, left))
        return True

    def close(self) -> None:
        """Let go of the pidfd (also done when the creator is found gone, or at collection)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    __del__ = close


def process_stat(pid: int) -> list[bytes]:
    """The fields of ``/proc/<pid>/stat`` after the process name: ``[0]`` its state
    (``b"R"``, ``b"T"`` stopped, ``b"Z"`` zombie, ...), ``[19]`` its start time in clock
    ticks after boot (which tells a reused pid). OSError if there is no such process,
    IndexError if the file cannot be parsed.

    Example:
        >>> process_stat(os.getpid())[0] in (b"R", b"S")
        True
    """
    with open(f"/proc/{pid}/stat", "rb") as stat_file:
        # "pid (comm) state ...": comm may hold spaces and parentheses, so the fields are
        # those after the last ")"
        return stat_file.read().rsplit(b")", 1)[1].split()


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
        state = process_stat(pid)[0]
    except FileNotFoundError:
        return False  # reaped since the kill
    except (OSError, IndexError):
        return True  # exists, but its state cannot be read: count it alive (never sweep it)
    return state not in (b"Z", b"X")  # zombie, or dead and being reaped
