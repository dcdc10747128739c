"""Leaf files set aside by a writer, and what gc does with those of dead writers.

A view written into its parent's own directory (``td[1].memmap_(td's prefix)``) maps
the very file it is written to: the writer (persist/writer.py) renames the old file to
``.<NAME>.viewed-<pid>-<n>`` in the same directory (its mappings keep its bytes), makes
a new ``NAME`` (``O_EXCL``: a file that reappears there is refused, never written into),
renames its staged ``meta.json.<pid>.<thread>.tmp`` over meta.json (the commit), and
then removes the old file (or renames it back when the write fails). It holds the
``flock`` of the directory it writes into (the tree's root) from before it stages its
temporaries until the last file set aside is gone. A writer killed in between (SIGKILL,
power loss) leaves them; :func:`node_leftovers` decides, per node directory:

* the writer's staged meta.json temporary is still there: its commit never happened, and
  meta.json still describes the bytes set aside. Every file it set aside there goes back
  over ``NAME`` (the new ``NAME``, if any, is the dead write's), then its temporaries go;
* none is left (it committed, then died before removing them): the files set aside hold
  bytes the save no longer names, and are removed with its temporaries.

A file is never removed, nor put back, while ``NAME`` is anything but a regular file (or
missing, for a put-back): it is left, with the writer's temporaries, and said. Nor when
more than one dead writer set a file aside for one ``NAME`` (which holds the save's bytes
is unknown). A live writer is never touched: its pid runs here, or (another pid
namespace: a container on a shared volume) it holds the flock of the directory or of
one above it (:func:`locked_chain`, taken without waiting by gc, which skips such a
directory as busy). Only names exactly of these forms are looked at: a key's file always
ends with ``.memmap`` (a user's key ``.a.memmap.viewed-1-0`` is the file
``.a.memmap.viewed-1-0.memmap``), and only regular files. ``shared_td.gc(prefix)``
(persist/leftovers.py) and ``shared-td gc`` do it, under the prefix lock.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import errno
import os
import stat
import re
from typing import Iterable, Iterator

from shared_td.persist import format as fmt
from shared_td.platform import pid_alive, try_flock

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


@dataclasses.dataclass
class NodeLeftovers:
    """What dead writers left in one node directory, and what gc does with it: the files
    set aside to put back over their ``NAME`` (``(set-aside path, NAME path)``), the
    files to remove (set-aside files, then temporaries), and what is left, with why."""

    directory: str
    put_back: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    remove: list[str] = dataclasses.field(default_factory=list)
    left: list[str] = dataclasses.field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.put_back or self.remove or self.left)

    def acted_on(self) -> list[str]:
        """The paths gc removes or renames (put back), in the order it does it."""
        return [aside for aside, _ in self.put_back] + self.remove


def _dead(pid: int) -> bool:
    return pid != os.getpid() and not pid_alive(pid)


def _mode(path: str) -> int | None:
    try:
        return os.lstat(path).st_mode
    except FileNotFoundError:
        return None


def node_leftovers(directory: str, names: Iterable[str]) -> NodeLeftovers:
    """Decide what gc does with the dead writers' files among ``names`` (the entries of
    ``directory``); nothing is changed (see the module doc for the rules).

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as d:
        ...     for name in (".a.memmap.viewed-999999999-0", "meta.json.999999999.1.tmp"):
        ...         open(os.path.join(d, name), "w").close()
        ...     found = node_leftovers(d, os.listdir(d))  # killed before its commit
        ...     [os.path.basename(p) for pair in found.put_back for p in pair], found.left
        (['.a.memmap.viewed-999999999-0', 'a.memmap'], [])
    """
    temporaries: dict[int, list[str]] = collections.defaultdict(list)
    asides: dict[int, list[tuple[str, str]]] = collections.defaultdict(list)
    for name in sorted(names):
        pid = fmt.temporary_writer_pid(name)
        if pid is not None:
            if _dead(pid):
                temporaries[pid].append(name)
            continue
        parsed = parse_set_aside_name(name)
        if parsed is not None and _dead(parsed[1]):
            mode = _mode(os.path.join(directory, name))
            if mode is not None and stat.S_ISREG(mode):  # (a nested key of that name is a directory)
                asides[parsed[1]].append((name, parsed[0]))
    writers_of = collections.Counter(own for files in asides.values() for own in {own for _, own in files})
    found = NodeLeftovers(directory)
    for pid in sorted(set(asides) | set(temporaries)):
        committed = not any(name.startswith(fmt.META + ".") for name in temporaries[pid])
        put_back, remove, left = [], [], []
        for entry, own in asides[pid]:
            path, own_path = os.path.join(directory, entry), os.path.join(directory, own)
            mode = _mode(own_path)
            if writers_of[own] > 1:
                left.append(f"{path} (dead writers {sorted(p for p in asides if any(o == own for _, o in asides[p]))} "
                            f"each set a file aside for {own}: which holds the save's bytes is unknown)")
            elif mode is not None and not stat.S_ISREG(mode):
                left.append(f"{path} ({own_path} is not a regular file: the set-aside file may be the only copy "
                            "of the leaf's bytes)")
            elif not committed:
                put_back.append((path, own_path))
            elif mode is None:
                left.append(f"{path} ({own_path} is missing although the writer committed: the set-aside file "
                            "is the only copy of bytes there)")
            else:
                remove.append(path)
        temporary_paths = [os.path.join(directory, name) for name in temporaries[pid]]
        if left:  # the writer's files stay together, so that what it did stays decidable
            found.left += left + [f"{path} (kept with the files pid {pid} set aside)" for path in temporary_paths]
            found.left += [f"{path} (kept with the other files pid {pid} set aside)"
                           for path in (*(p for p, _ in put_back), *remove)]
        else:
            found.put_back += put_back
            found.remove += remove + temporary_paths
    return found


def act(found: NodeLeftovers, done: list[str]) -> None:
    """Put back and remove what :func:`node_leftovers` decided (under
    :func:`locked_chain`), appending each path acted on to ``done`` (as it goes: an
    error leaves there what was done before it). A ``NAME`` that appeared where one was
    missing is never replaced: that file set aside is left, in ``found.left``."""
    for aside, own in found.put_back:
        if _mode(own) is None:
            if not _put_back_no_clobber(aside, own, found):
                continue
        else:  # the dead write's own file (checked regular when decided, under the locks)
            os.replace(aside, own)
        done.append(aside)
    for path in found.remove:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        done.append(path)


def _put_back_no_clobber(aside: str, own: str, found: NodeLeftovers) -> bool:
    """Rename ``aside`` to the missing ``own`` without ever replacing a file made there
    meanwhile: a hard link (which fails on an existing name), then the unlink."""
    try:
        os.link(aside, own, follow_symlinks=False)
    except FileExistsError:
        found.left.append(f"{aside} ({own} appeared meanwhile: left as it is)")
        return False
    except OSError as error:
        if error.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
            raise
        # no hard links here: a rename could replace a file made at that instant
        found.left.append(f"{aside} (this filesystem has no hard links: put it back with mv -n {aside} {own})")
        return False
    os.unlink(aside)
    return True


@contextlib.contextmanager
def locked_chain(directory: str, root: str) -> Iterator[bool]:
    """Take, without waiting, the ``flock`` of ``directory`` and of every directory
    above it up to ``root``, and beyond while one holds a meta.json (a writer holds its
    tree's root's: a node, or the save, above). Yields False, with none held, where any
    is held by another (a live writer: busy), else True while they are held."""
    held: list[int] = []
    try:
        current = os.path.abspath(directory)
        root = os.path.abspath(root)
        while True:
            try:
                fd = os.open(current, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            except OSError:
                fd = None  # (one that cannot be opened holds no writer's lock of ours)
            if fd is not None:
                held.append(fd)
                if not try_flock(fd):
                    yield False
                    return
            parent = os.path.dirname(current)
            inside = current != root and os.path.commonpath([root, current]) == root
            if parent == current or not (inside or os.path.lexists(os.path.join(parent, fmt.META))):
                break
            current = parent
        yield True
    finally:
        for fd in held:
            os.close(fd)  # (drops its flock)
