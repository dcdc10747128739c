"""Removing a directory tree with two file descriptors, never following a symlink.

An atomic write that failed because the process ran out of descriptors must still
remove its staging directory, so the removal cannot need one descriptor per level of
depth as ``shutil.rmtree`` does (two per level: the directory and its listing). Here
the directory being emptied is the only one held open, each reached from its parent
with ``O_NOFOLLOW`` (a symlink is unlinked, never entered), and the way back up goes
through ``..``, checked to be the directory we came from. An empty directory needs no
descriptor at all. Errors are raised, naming the path, never ignored.

A directory without write permission cannot be emptied, even by its owner. Removing
the trees that shared_td itself made (``make_writable=True``: an atomic write's
retired old version, which keeps the replaced save's read-only mode, and its staging
directories) first gives the owner ``rwx`` on each of its directories that this user
owns; the permissions of anything else are never changed.
"""
from __future__ import annotations

import errno
import os
import stat

_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def remove_tree(path: str, *, dir_fd: int | None = None, shown: str | None = None,
                make_writable: bool = False) -> None:
    """Remove the tree at ``path`` (a symlink or file: just it); OSError naming what stays.

    ``path`` is relative to the directory ``dir_fd`` when given (so a directory renamed
    or swapped for a symlink above it cannot redirect the removal); ``shown`` names it in
    errors (default ``path``). Needs two descriptors whatever the depth (see the module
    docstring); a directory moved while it is removed stops the removal (nothing outside
    the tree is touched). Files still mapped by readers stay valid until unmapped.
    ``make_writable``: a directory of the tree owned by this user that lacks owner
    ``rwx`` gets it first (only for a tree of shared_td's own: see the module docstring).

    Example:
        >>> import stat, tempfile
        >>> with tempfile.TemporaryDirectory() as parent:
        ...     tree = os.path.join(parent, "tree")
        ...     os.makedirs(os.path.join(tree, "child"))
        ...     open(os.path.join(tree, "child", "file"), "w").close()
        ...     os.chmod(os.path.join(tree, "child"), 0o555)  # read-only
        ...     remove_tree(tree, make_writable=True)
        ...     print(os.path.exists(tree))
        False
    """
    shown = shown or path
    try:
        info = os.stat(path, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(info.st_mode):
        os.unlink(path, dir_fd=dir_fd)
        return
    try:
        os.rmdir(path, dir_fd=dir_fd)  # an empty directory needs no descriptor at all
        return
    except OSError as error:
        if error.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
    fd = _open_directory(path, dir_fd, make_writable)
    way: list[tuple[str, os.stat_result, list[str]]] = []  # (name, its parent, parent's rest)
    try:
        if not os.path.samestat(os.fstat(fd), info):
            raise OSError(errno.ESTALE, f"{shown} was replaced while it was being removed")
        pending = _remove_files(fd, shown)
        while pending or way:
            if pending:
                name = pending.pop()
                child = _open_directory(name, fd, make_writable)
                way.append((name, os.fstat(fd), pending))
                fd, parent = child, fd
                os.close(parent)
                pending = _remove_files(fd, os.path.join(shown, *(n for n, _, _ in way)))
                continue
            name, parent_info, pending = way.pop()
            parent = os.open("..", _DIRECTORY, dir_fd=fd)
            fd, child = parent, fd
            os.close(child)
            where = os.path.join(shown, *(n for n, _, _ in way))
            if not os.path.samestat(os.fstat(fd), parent_info):
                raise OSError(errno.ESTALE, f"{where} was moved while it was being removed")
            _name_errors(os.rmdir, name, fd, where)
    finally:
        os.close(fd)
    _name_errors(os.rmdir, path, dir_fd, os.path.dirname(shown))


def remove_own_tree(path: str) -> None:
    """:func:`remove_tree` of a tree shared_td made itself (an atomic write's staging
    directory or retired old version): its directories owned by this user are given
    owner ``rwx`` to be emptied (``make_writable``)."""
    remove_tree(path, make_writable=True)


def _open_directory(name: str, dir_fd: int | None, make_writable: bool) -> int:
    """Open the directory ``name`` (never through a symlink); ``make_writable``: give its
    owner ``rwx`` first if it is ours and lacks them (without ``r`` it cannot even be
    opened, without ``wx`` not emptied)."""
    try:
        fd = os.open(name, _DIRECTORY, dir_fd=dir_fd)
    except PermissionError:
        info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False) if make_writable else None
        if info is None or not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
            raise
        # by name: it cannot be opened yet (checked just above to be our directory)
        os.chmod(name, stat.S_IMODE(info.st_mode) | stat.S_IRWXU, dir_fd=dir_fd)
        fd = os.open(name, _DIRECTORY, dir_fd=dir_fd)
    if make_writable:
        try:
            info = os.fstat(fd)
            if info.st_mode & stat.S_IRWXU != stat.S_IRWXU and info.st_uid == os.geteuid():
                os.fchmod(fd, stat.S_IMODE(info.st_mode) | stat.S_IRWXU)
        except BaseException:
            os.close(fd)
            raise
    return fd


def _remove_files(fd: int, where: str) -> list[str]:
    """Unlink every non-directory in the directory ``fd``; the names of its directories."""
    with os.scandir(fd) as listing:  # (a duplicate of fd, closed with it)
        entries = [(entry.name, entry.is_dir(follow_symlinks=False)) for entry in listing]
    for name, _ in (e for e in entries if not e[1]):
        _name_errors(os.unlink, name, fd, where)
    return [name for name, is_directory in entries if is_directory]


def _name_errors(remove, name: str, fd: int, where: str) -> None:
    try:
        remove(name, dir_fd=fd)
    except FileNotFoundError:
        pass
    except OSError as error:
        raise OSError(error.errno, f"{error.strerror}: {os.path.join(where, name)}") from None
