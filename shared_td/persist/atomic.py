"""Atomic rewrites of a prefix: a sibling directory, a file lock, a swap.

``memmap_(prefix, atomic=True)`` writes the whole tree into a new directory next to
``prefix`` and then swaps it in, so a failure or a SIGKILL at any moment leaves ``prefix``
as it was or as the new complete version.

* **Lock**: writers of one prefix serialise on ``.<name>.lock`` beside it (never inside
  the directory being swapped), through ``filelock``. The lock only orders writers;
  readers rely on the rename alone (file locks do not work on every filesystem).
* **Swap**: ``renameat2(RENAME_EXCHANGE)`` (Linux), so ``prefix`` never goes missing;
  where the filesystem refuses it, two renames (``prefix`` is missing for a moment).
* **Leftovers**: temporary directories are named ``.<name>.shared_td-<kind>-<pid>-<rand>``;
  those of dead writers are removed by the next atomic write (under the lock) and by
  ``shared_td.gc(prefix)`` (a writer killed between the fallback's two renames leaves
  ``prefix`` missing until then: the sweep moves the old version back). Nothing outside
  prefix's parent directory is touched.
* **Not durable**: files are not synced, so this guards against a killed process, not
  a power failure.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import shutil
import sys
import tempfile

import filelock

#: Seconds a writer waits for another writer of the same prefix before TimeoutError.
#: Override per process with the environment variable SHARED_TD_LOCK_TIMEOUT.
DEFAULT_LOCK_TIMEOUT = 600.0

_TAG = "shared_td"
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


class AtomicWriteError(RuntimeError):
    """An atomic rewrite cannot start (the prefix is not a saved tensordict, ...)."""


def lock_path(prefix: str) -> str:
    """The lock file of ``prefix``: beside it, so that it survives every swap."""
    parent, name = os.path.split(os.path.abspath(prefix))
    return os.path.join(parent, f".{name}.lock")


def prefix_lock(prefix: str, timeout: float | None = None) -> filelock.BaseFileLock:
    """The inter-process lock that orders atomic writers of ``prefix``."""
    if timeout is None:
        timeout = float(os.environ.get("SHARED_TD_LOCK_TIMEOUT", DEFAULT_LOCK_TIMEOUT))
    return filelock.FileLock(lock_path(prefix), timeout=timeout)


class acquired:
    """``with acquired(prefix):`` holds the writer lock; a clear TimeoutError on expiry."""

    def __init__(self, prefix: str, timeout: float | None = None):
        self.lock = prefix_lock(prefix, timeout)

    def __enter__(self) -> "acquired":
        try:
            self.lock.acquire()
        except filelock.Timeout:
            raise TimeoutError(
                f"Another writer has held the lock {self.lock.lock_file} for more than "
                f"{self.lock.timeout:.0f} s: an atomic write of the same prefix is still "
                "running. Wait for it, or raise SHARED_TD_LOCK_TIMEOUT."
            ) from None
        return self

    def __exit__(self, *exc: object) -> None:
        self.lock.release()


def check_target(prefix: str | None, *, existsok: bool) -> str:
    """Validate an atomic write's prefix before anything is written; returns it absolute.

    Raises:
        NotImplementedError: on Windows (an open mapping blocks directory renames).
        ValueError: no prefix (and the tensordict has no directory of its own).
        NotADirectoryError: prefix is a file.
        RuntimeError: prefix is a non-empty directory and existsok=False, or a non-empty
            directory that holds no saved tensordict (no meta.json).
    """
    if sys.platform.startswith("win"):
        raise NotImplementedError(
            "atomic=True is not supported on Windows, where a directory that holds open "
            "(mapped) files cannot be renamed."
        )
    if prefix is None:
        raise ValueError(
            "atomic=True needs a directory to write to: pass prefix= (this tensordict is "
            "not memory-mapped to a directory of its own)."
        )
    prefix = os.path.abspath(prefix)
    if os.path.isfile(prefix):
        raise NotADirectoryError(f"atomic=True: prefix {prefix} is a file, not a directory.")
    if os.path.isdir(prefix) and os.listdir(prefix):
        if not existsok:
            raise RuntimeError(
                f"atomic=True with existsok=False: {prefix} is a non-empty directory. Pass "
                "existsok=True to replace it, or choose a new prefix."
            )
        if not os.path.isfile(os.path.join(prefix, "meta.json")):
            raise RuntimeError(
                f"atomic=True would replace {prefix} as a whole, but it holds no saved "
                "tensordict (no meta.json): refusing to delete files that are not ours."
            )
    return prefix


def make_staging_directory(prefix: str) -> str:
    """A new empty directory beside ``prefix`` (same filesystem, so it can be renamed)."""
    parent, name = os.path.split(prefix)
    os.makedirs(parent, exist_ok=True)
    return tempfile.mkdtemp(prefix=f".{name}.{_TAG}-new-{os.getpid()}-", dir=parent)


def swap_into_place(staging: str, prefix: str) -> None:
    """Make ``staging`` the directory at ``prefix``; the old one (if any) is deleted.

    Uses RENAME_EXCHANGE so ``prefix`` always exists; falls back to two renames on
    filesystems that refuse it.
    """
    if not os.path.lexists(prefix):
        os.rename(staging, prefix)
        return
    if _exchange(staging, prefix):
        retired = staging  # the old version now lives at the staging name
    else:
        parent, name = os.path.split(prefix)
        retired = tempfile.mkdtemp(prefix=f".{name}.{_TAG}-old-{os.getpid()}-", dir=parent)
        os.rename(prefix, os.path.join(retired, "tree"))
        os.rename(staging, prefix)
    _remove_tree(retired)


def sweep_leftovers(prefix: str) -> list[str]:
    """Remove temporary directories of ``prefix`` left by writers that died.

    Only names of our own pattern in prefix's parent whose writer pid is gone are
    removed. If the writer died between the two renames of the fallback (``prefix``
    missing), the old version it moved away is renamed back to ``prefix``. Call it
    while holding the prefix lock (``gc`` does). Returns what it removed.
    """
    prefix = os.path.abspath(prefix)
    parent, name = os.path.split(prefix)
    removed = []
    try:
        entries = os.listdir(parent)
    except FileNotFoundError:
        return removed
    for entry in entries:
        pid = _writer_pid(entry, name)
        if pid is not None and not _alive(pid):
            path = os.path.join(parent, entry)
            moved_away = os.path.join(path, "tree")
            if entry.startswith(f".{name}.{_TAG}-old-") and not os.path.lexists(prefix) \
                    and os.path.isdir(moved_away):
                # killed between the two renames of the fallback: the old version goes back
                os.rename(moved_away, prefix)
            _remove_tree(path)
            removed.append(path)
    return removed


def gc(prefix: str, timeout: float | None = None) -> list[str]:
    """Remove what killed atomic writers of ``prefix`` left beside it.

    Examples:
        >>> shared_td.gc("/data/buffer")
        []
    """
    prefix = os.path.abspath(os.fspath(prefix))
    with acquired(prefix, timeout):
        return sweep_leftovers(prefix)


def _writer_pid(entry: str, name: str) -> int | None:
    for kind in ("new", "old"):
        head = f".{name}.{_TAG}-{kind}-"
        if entry.startswith(head):
            pid = entry[len(head):].split("-", 1)[0]
            return int(pid) if pid.isdigit() else None
    return None


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def _remove_tree(path: str) -> None:
    """Remove a directory tree; files still mapped by readers stay valid until unmapped."""
    shutil.rmtree(path, ignore_errors=True)


_renameat2 = None


def _exchange(first: str, second: str) -> bool:
    """Atomically swap two paths; False if this system or filesystem cannot."""
    global _renameat2
    if not sys.platform.startswith("linux"):
        return False
    if _renameat2 is None:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        function = getattr(libc, "renameat2", None)
        if function is None:
            return False
        function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
        function.restype = ctypes.c_int
        _renameat2 = function
    result = _renameat2(_AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), _RENAME_EXCHANGE)
    if result == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EXDEV, errno.ENOTSUP):
        return False
    raise OSError(code, f"renameat2(RENAME_EXCHANGE) of {first} and {second}: {os.strerror(code)}")
