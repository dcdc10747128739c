"""The lock that orders the atomic writers of one prefix.

Writers of a prefix serialise on ``.<name>.lock`` beside it (never inside the directory
being swapped, so it survives every swap), through ``filelock`` (``flock``). The lock
only orders writers; readers rely on the rename alone (file locks do not work on every
filesystem). The lock file is created (or opened) with ``O_NOFOLLOW``: a symlink planted
there is an error, never followed (it could make a writer truncate or lock another
file). Lock files stay (every writer reuses them); ``gc(prefix, remove_lock=True)``
(``shared-td gc``) removes one no process holds (lock_probe.py).

Writing beside a prefix needs its parent directory writable: a PermissionError says so,
naming it (:func:`parent_not_writable`).
"""
from __future__ import annotations

import errno
import math
import os
import stat

import filelock

from shared_td.persist.format import lock_path

#: Seconds a writer waits for another writer of the same prefix before TimeoutError.
#: Override per process with the environment variable SHARED_TD_LOCK_TIMEOUT.
DEFAULT_LOCK_TIMEOUT = 600.0
LOCK_TIMEOUT_VARIABLE = "SHARED_TD_LOCK_TIMEOUT"


def lock_timeout() -> float:
    """The seconds a writer waits for another (the lock of a prefix, an earlier
    background write): ``SHARED_TD_LOCK_TIMEOUT`` if set (not blank), else DEFAULT_LOCK_TIMEOUT.

    Read at each wait, so a process may change it. A finite number >= 0 only: filelock
    takes a negative timeout as "wait for ever", the opposite of a bound, and NaN or
    text would fail later without naming the variable (ValueError naming it and the value).

    Example:
        >>> os.environ["SHARED_TD_LOCK_TIMEOUT"] = "1.5"; lock_timeout()
        1.5
        >>> os.environ["SHARED_TD_LOCK_TIMEOUT"] = "-5"; lock_timeout()
        Traceback (most recent call last):
        ...
        ValueError: SHARED_TD_LOCK_TIMEOUT='-5' is not a number of seconds >= 0 (a finite number such as 600 or 2.5).
        >>> os.environ["SHARED_TD_LOCK_TIMEOUT"] = " "; lock_timeout()  # blank: unset
        600.0
        >>> del os.environ["SHARED_TD_LOCK_TIMEOUT"]; lock_timeout()
        600.0
    """
    text = os.environ.get(LOCK_TIMEOUT_VARIABLE)
    if text is None or not text.strip():  # blank (VAR= in a shell, an env file) means unset
        return DEFAULT_LOCK_TIMEOUT
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds >= 0):
        raise ValueError(f"{LOCK_TIMEOUT_VARIABLE}={text!r} is not a number of seconds >= 0 "
                         "(a finite number such as 600 or 2.5).")
    return seconds


def prefix_lock(prefix: str, timeout: float | None = None) -> filelock.BaseFileLock:
    """The inter-process lock that orders atomic writers of ``prefix``; its file is
    created now if missing (:func:`create_lock_file`). ``timeout``: seconds to wait
    for it (None: :func:`lock_timeout`)."""
    if timeout is None:
        timeout = lock_timeout()
    path = lock_path(prefix)
    # filelock 3.x (3.22 still) sets the file's mode to its ``mode`` argument (0o644 by
    # default) at every acquire, taking away the group write of a 0o002 umask: given
    # the file's own mode, it changes nothing
    return filelock.FileLock(path, timeout=timeout, mode=create_lock_file(path))


class acquired:
    """``with acquired(prefix):`` holds the writer lock; a clear TimeoutError on expiry."""

    def __init__(self, prefix: str, timeout: float | None = None):
        self.lock = prefix_lock(prefix, timeout)

    def __enter__(self) -> "acquired":
        while True:
            # (any failure from the acquire on gives the lock back if this process took
            # it: a Ctrl-C landing as acquire() returned, or inside it once the file was
            # locked, left it held, since __exit__ never runs, until the exception was
            # discarded and the FileLock freed)
            try:
                try:
                    self.lock.acquire()
                except PermissionError as error:  # an existing lock file we may not open to write
                    raise PermissionError(error.errno, (
                        f"Cannot lock {self.lock.lock_file}: this process may not open it for writing "
                        f"({error.strerror}). Every writer of a prefix opens its lock file so: make it "
                        "writable by them (chmod), or remove it (the next writer makes a new one).")) from None
                except filelock.Timeout:
                    raise TimeoutError(
                        f"Another writer has held the lock {self.lock.lock_file} for more than "
                        f"{self.lock.timeout:g} s: an atomic write of the same prefix is still "
                        "running. Wait for it, or raise SHARED_TD_LOCK_TIMEOUT."
                    ) from None
                if self._holds_the_file_at_its_path():
                    return self
            except BaseException:
                self._release_if_held()
                raise
            # gc removed the file between our open and our flock: what we hold locks
            # nothing that the next writer would see, so lock the file now there
            self.lock.release()
            create_lock_file(self.lock.lock_file)

    def _release_if_held(self) -> None:
        if self.lock.is_locked:
            self.lock.release()

    def _holds_the_file_at_its_path(self) -> bool:
        """False if the locked file was unlinked or replaced (filelock 3.12 does not check that)."""
        fd = getattr(self.lock._context, "lock_file_fd", None)
        if fd is None:  # a filelock without this attribute: trust it
            return True
        try:
            return os.path.samestat(os.fstat(fd), os.lstat(self.lock.lock_file))
        except FileNotFoundError:
            return False

    def __exit__(self, *exc: object) -> None:
        self.lock.release()


def create_lock_file(path: str) -> int:
    """Create the lock file ``path`` (mode 0o666 less the umask, as a plain ``open``)
    unless it exists, never following a symlink: one planted there is an OSError, so
    that no writer truncates or locks the file it points to (filelock >= 3.20.1 opens
    it with O_NOFOLLOW too, which closes the window between this check and its open).
    Returns the file's mode bits."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o666)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise OSError(error.errno, f"The lock file {path} is a symlink (to {os.readlink(path)}): "
                          "refusing to follow it. Remove it; the next writer creates a new one.") from None
        if isinstance(error, PermissionError):
            raise parent_not_writable(error, path) from None
        raise
    try:
        mode = os.fstat(fd).st_mode
    finally:
        os.close(fd)
    if not stat.S_ISREG(mode):
        raise OSError(errno.EINVAL, f"The lock file {path} is not a regular file: remove it.")
    return stat.S_IMODE(mode)


def parent_not_writable(error: PermissionError, path: str) -> PermissionError:
    """``error`` (creating ``path``) reworded: the fix is a writable directory, not ``path``."""
    parent = os.path.dirname(path)
    return PermissionError(
        error.errno, f"Cannot create {path}: its directory {parent} is not writable by this "
        "process. An atomic write (atomic=True, an archive save, unpack_memmap) creates its "
        f"lock file and its new version beside the prefix, so {parent} must be writable: make "
        "it writable, or write elsewhere (a directory save in place: atomic=False)."
    )
