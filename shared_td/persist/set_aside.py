"""Leaf files set aside by a writer, and putting back those of dead writers.

A view written into its parent's own directory (``td[1].memmap_(td's prefix)``) maps
the very file it is written to: the writer (persist/writer.py) renames the old file to
``.<NAME>.viewed-<pid>-<n>`` in the same directory (its mappings keep its bytes), writes
a new ``NAME``, and removes the old one when the write is over (or renames it back when
the write fails). A writer killed in between (SIGKILL, power loss) leaves it there:

* ``NAME`` missing (killed after the rename, before the new file was made): the file set
  aside holds the only copy of the leaf's bytes, and the save does not load without it.
  :func:`put_back_or_remove` renames it back to ``NAME``;
* ``NAME`` there (the new file was made): the old bytes are not the save's any more
  (a write that is not atomic leaves what it wrote so far); the file set aside is removed.

Only names exactly of this form are touched: a key's file always ends with ``.memmap``
(a user's key ``.a.memmap.viewed-1-0`` is the file ``.a.memmap.viewed-1-0.memmap``),
and only regular files (a nested key of that name is a directory). A live writer's
(its pid still runs, or it is this process) are left alone. ``shared_td.gc(prefix)``
(persist/leftovers.py) and ``shared-td gc`` do it, under the prefix lock.
"""
from __future__ import annotations

import errno
import os
import re
import stat

from shared_td.persist import format as fmt
from shared_td.platform import pid_alive

_SET_ASIDE_NAME = re.compile(
    rf"\.(?P<name>.+{re.escape(fmt.LEAF_SUFFIX)})\.viewed-(?P<pid>[1-9][0-9]*)-(?:0|[1-9][0-9]*)",
    re.DOTALL,
)


def set_aside_name(name: str, index: int) -> str:
    """The name a writer (this process) gives the leaf file ``name`` it sets aside, its
    ``index``-th in one write.

    Example:
        >>> set_aside_name("a.memmap", 0) == f".a.memmap.viewed-{os.getpid()}-0"
        True
    """
    return f".{name}.viewed-{os.getpid()}-{index}"


def parse_set_aside_name(entry: str) -> tuple[str, int] | None:
    """``(leaf file name, writer pid)`` of a name :func:`set_aside_name` made, else None.

    Examples:
        >>> parse_set_aside_name(".a.memmap.viewed-4242-0")
        ('a.memmap', 4242)
        >>> parse_set_aside_name(".a.memmap.viewed-4242-0.memmap") is None  # a user's key
        True
    """
    match = _SET_ASIDE_NAME.fullmatch(entry)
    return (match["name"], int(match["pid"])) if match else None


def is_dead_writers(directory: str, entry: str) -> bool:
    """Whether ``entry`` in ``directory`` is a regular file set aside by a writer that no
    longer runs (never this process's own)."""
    parsed = parse_set_aside_name(entry)
    if parsed is None or parsed[1] == os.getpid() or pid_alive(parsed[1]):
        return False
    try:
        return stat.S_ISREG(os.lstat(os.path.join(directory, entry)).st_mode)
    except OSError:
        return False


def put_back_or_remove(path: str) -> bool:
    """Rename the set-aside file ``path`` back to its leaf file's name if that name is
    missing (True), else remove it (False). Never replaces a file: the name is linked
    (no-clobber), so one that appears meanwhile stays and ``path`` goes."""
    directory, entry = os.path.split(path)
    parsed = parse_set_aside_name(entry)
    if parsed is None:
        raise ValueError(f"{path} is not the name of a leaf file set aside by a writer")
    try:
        os.link(path, os.path.join(directory, parsed[0]), follow_symlinks=False)
        put_back = True
    except FileExistsError:
        put_back = False
    except OSError as error:  # a filesystem without hard links: a rename, checked first
        if error.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise
        put_back = not os.path.lexists(os.path.join(directory, parsed[0]))
        if put_back:
            os.rename(path, os.path.join(directory, parsed[0]))
            return True
    os.unlink(path)
    return put_back
