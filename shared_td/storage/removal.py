"""Removing a directory tree with two file descriptors, never following a symlink.

An atomic write that failed because the process ran out of descriptors must still
remove its staging directory, so the removal cannot need one descriptor per level of
depth as ``shutil.rmtree`` does (two per level: the directory and its listing). Here
the directory being emptied is the only one held open, each reached from its parent
with ``O_NOFOLLOW`` (a symlink is unlinked, never entered), and the way back up goes
through ``..``, checked to be the directory we came from. An empty directory needs no
descriptor at all. Errors are raised, naming the path, never ignored.
"""
from __future__ import annotations

import errno
import os
import stat

_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def remove_tree(path: str, *, dir_fd: int | None = None, shown: str | None = None) -> None:
    """Remove the tree at ``path`` (a symlink or file: just it); OSError naming what stays.

    ``path`` is relative to the directory ``dir_fd`` when given (so a directory renamed
    or swapped for a symlink above it cannot redirect the removal); ``shown`` names it in
    errors (default ``path``). Needs two descriptors whatever the depth (see the module
    docstring); a directory moved while it is removed stops the removal (nothing outside
    the tree is touched). Files still mapped by readers stay valid until unmapped.
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
    fd = os.open(path, _DIRECTORY, dir_fd=dir_fd)
    way: list[tuple[str, os.stat_result, list[str]]] = []  # (name, its parent, parent's rest)
    try:
        if not os.path.samestat(os.fstat(fd), info):
            raise OSError(errno.ESTALE, f"{shown} was replaced while it was being removed")
        pending = _remove_files(fd, shown)
        while pending or way:
            if pending:
                name = pending.pop()
                child = os.open(name, _DIRECTORY, dir_fd=fd)
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
