"""Is a writer lock file held, and removing it safely when it is not.

The atomic writers' lock files (``.<name>.lock``, see atomic.py) are taken with
``flock`` through filelock. A lock file nobody holds is harmless but clutters the
directory; ``shared_td gc`` removes it. A lock is "held" only in the flock sense: the
probe takes a non-blocking flock and drops it at once.
"""
from __future__ import annotations

import os
import stat

from shared_td.platform import try_flock


def lock_is_held(path: str) -> bool:
    """True if a process holds the lock file ``path`` (probed with a non-blocking flock).

    A missing file is not held; a symlink or other non-regular file counts as held, so
    that nobody removes it.
    """
    fd = _open_lock_file(path)
    if fd is None:
        return os.path.lexists(path)
    try:
        return not try_flock(fd)
    finally:
        os.close(fd)  # closing drops the probe's flock


def remove_unheld_lock(path: str) -> bool:
    """Remove the lock file ``path`` if no process holds it; True if it was removed.

    The file is unlinked while this process holds its flock, so a writer that opened it
    just before gets its flock on a deleted inode; it sees that and locks the new file
    (``atomic.acquired`` compares the inode it holds with the one at the path; recent
    filelock versions check the link count too): two writers never both hold it.
    """
    fd = _open_lock_file(path)
    if fd is None:
        return False
    try:
        if not try_flock(fd):
            return False
        if not os.path.samestat(os.fstat(fd), os.lstat(path)):
            return False  # replaced meanwhile: the new file is someone else's
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False
    finally:
        os.close(fd)


def _open_lock_file(path: str) -> int | None:
    """A read-only descriptor of the regular file ``path``; None if absent or not one."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    return fd
