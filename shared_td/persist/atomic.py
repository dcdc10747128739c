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
  prefix's parent directory is touched. Lock files stay (every writer reuses them);
  ``gc(prefix, remove_lock=True)`` (``shared-td gc``) removes one no process holds.
* **Not durable**: files are not synced, so this guards against a killed process, not
  a power failure.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import re
import shutil
import sys
import tempfile

import filelock

from shared_td.persist import format as fmt
from shared_td.persist.lock_probe import lock_is_held, remove_unheld_lock

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
        while True:
            try:
                self.lock.acquire()
            except filelock.Timeout:
                raise TimeoutError(
                    f"Another writer has held the lock {self.lock.lock_file} for more than "
                    f"{self.lock.timeout:.0f} s: an atomic write of the same prefix is still "
                    "running. Wait for it, or raise SHARED_TD_LOCK_TIMEOUT."
                ) from None
            if self._holds_the_file_at_its_path():
                return self
            # gc removed the file between our open and our flock: what we hold locks
            # nothing that the next writer would see, so lock the file now there
            self.lock.release()

    def _holds_the_file_at_its_path(self) -> bool:
        """False if the locked file was unlinked or replaced (filelock 3.12 does not check that)."""
        fd = getattr(self.lock._context, "lock_file_fd", None)
        if fd is None:  # a filelock without this attribute: trust it
            return True
        try:
            return os.path.samestat(os.fstat(fd), os.stat(self.lock.lock_file))
        except FileNotFoundError:
            return False

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


def find_leftovers(prefix: str) -> list[str]:
    """Temporary directories of ``prefix`` whose writer process is gone (nothing removed).

    Only names of our own pattern in prefix's parent are considered, and a directory of
    a live writer (its pid still runs) is never one of them.
    """
    parent, name = os.path.split(os.path.abspath(prefix))
    try:
        entries = sorted(os.listdir(parent))
    except FileNotFoundError:
        return []
    found = []
    for entry in entries:
        pid = _writer_pid(entry, name)
        if pid is not None and not _alive(pid):
            found.append(os.path.join(parent, entry))
    return found


def find_stale_temporaries(prefix: str) -> list[str]:
    """Temporary files a killed (non-atomic) writer left inside the saved tree at
    ``prefix``: ``meta.json.<pid>.<thread>.tmp`` and the like, whose pid is gone.
    Symlinks are not followed; nothing is removed."""
    found = []
    for directory, subdirectories, names in os.walk(prefix):
        subdirectories.sort()
        for name in sorted(names):
            pid = fmt.temporary_writer_pid(name)
            if pid is not None and not _alive(pid):
                found.append(os.path.join(directory, name))
    return found


def sweep_leftovers(prefix: str) -> list[str]:
    """Remove temporary directories of ``prefix`` left by writers that died.

    If the writer died between the two renames of the fallback (``prefix`` missing),
    the old version it moved away is renamed back to ``prefix``. Call it while holding
    the prefix lock (``gc`` does). Returns what it removed.
    """
    prefix = os.path.abspath(prefix)
    parent, name = os.path.split(prefix)
    removed = []
    for path in find_leftovers(prefix):
        moved_away = os.path.join(path, "tree")
        if os.path.basename(path).startswith(f".{name}.{_TAG}-old-") \
                and not os.path.lexists(prefix) and os.path.isdir(moved_away):
            # killed between the two renames of the fallback: the old version goes back
            os.rename(moved_away, prefix)
        _remove_tree(path)
        removed.append(path)
    return removed


def gc(prefix: str, timeout: float | None = None, *, dry_run: bool = False,
       remove_lock: bool = False) -> list[str]:
    """Remove what killed writers of ``prefix`` left; returns the paths.

    The temporary directories of dead atomic writers (beside ``prefix``) and the
    temporary files of dead writers inside it (:func:`find_stale_temporaries`) are
    removed under the prefix lock (waiting at most ``timeout`` seconds for a running
    writer, then TimeoutError). With
    ``remove_lock=True`` the lock file ``.<name>.lock`` goes too when no process holds
    it. ``dry_run=True`` removes nothing, takes no lock and returns what would go.

    Examples:
        >>> shared_td.gc("/data/buffer")
        []
        >>> shared_td.gc("/data/buffer", remove_lock=True, dry_run=True)
        ['/data/.buffer.lock']
    """
    prefix = os.path.abspath(os.fspath(prefix))
    lock_file = lock_path(prefix)
    if dry_run:
        found = find_leftovers(prefix) + find_stale_temporaries(prefix)
        if remove_lock and os.path.lexists(lock_file) and not lock_is_held(lock_file):
            found.append(lock_file)
        return found
    existed = os.path.lexists(lock_file)  # else taking the lock creates it: not a leftover
    with acquired(prefix, timeout):
        removed = sweep_leftovers(prefix)
        for path in find_stale_temporaries(prefix):
            os.unlink(path)
            removed.append(path)
    if remove_lock and remove_unheld_lock(lock_file) and existed:
        removed.append(lock_file)
    return removed


# the random part of mkdtemp's names has no dot, so the last ".shared_td-" is ours
_LEFTOVER_NAME = re.compile(rf"\.(?P<name>.+)\.{_TAG}-(?:new|old)-(?P<pid>[0-9]+)-", re.DOTALL)


def parse_leftover_name(entry: str) -> tuple[str, int] | None:
    """``(prefix name, writer pid)`` of a temporary directory's name, else None.

    Examples:
        >>> parse_leftover_name(".buffer.shared_td-new-4242-k2j5x")
        ('buffer', 4242)
    """
    match = _LEFTOVER_NAME.match(entry)
    return (match["name"], int(match["pid"])) if match else None


def _writer_pid(entry: str, name: str) -> int | None:
    parsed = parse_leftover_name(entry)
    return parsed[1] if parsed is not None and parsed[0] == name else None


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
