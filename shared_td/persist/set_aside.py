"""Leaf files set aside by a writer, and what gc does with those of dead writers.

A view written into its parent's own directory (``td[1].memmap_(td's prefix)``) maps
the very file it is written to: the writer (persist/writer.py) takes the shared
``flock`` of its tree's root (:func:`hold_root`), renames the old file to
``.<NAME>.viewed-<pid>-<n>-<ino>`` in the same directory (``<n>``: new in the process,
``<ino>``: the inode of the node's meta.json then; its mappings keep the old bytes),
makes a new ``NAME`` (``O_EXCL``: a file that reappears there is refused, never written
into), renames its staged ``meta.json.<pid>.<thread>.tmp`` over meta.json (the commit),
then removes the old file (or renames it back when the write fails) and drops the
lock. Writers share
it (last writer wins); a fork child closes its copy. A writer killed in between
(SIGKILL, power loss) leaves them; :func:`node_leftovers` decides, per node directory:

* meta.json is still the inode ``<ino>``: nothing replaced it (the writer never
  committed, nor did a later save), and it describes the bytes set aside. Every file
  that writer set aside there goes back over ``NAME`` (the new ``NAME``, if any, is
  the dead write's), then its temporaries go;
* it is another (the writer committed, or a later save did): the files set aside hold
  bytes the save no longer names, and are removed with its temporaries;
* the writer committed this node but not one above it (its staged meta.json temporary
  still there: :func:`half_committed`): neither version is whole, all its files stay.

A file is never removed, nor put back, while ``NAME`` is anything but a regular file (or
missing, for a put-back): it is left, with the writer's temporaries, and said. Nor when
more than one dead writer set a file aside for one ``NAME`` (which holds the save's bytes
is unknown). A live writer is never touched: the lock alone says it lives (a free one,
whatever the pid in the names: another pid namespace's, or a dead writer's pid reused,
is a dead writer's): gc tries the exclusive flock of the directory and of those above
it (:func:`locked_chain`), without waiting, and skips a held one as busy. Only names
exactly of these forms are looked at: a key's file always ends with ``.memmap`` (a
user's key ``.a.memmap.viewed-1-0-2`` is the file ``.a.memmap.viewed-1-0-2.memmap``),
and only regular files. ``shared_td.gc(prefix)`` (persist/leftovers.py) and
``shared-td gc`` do it, under the prefix lock.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import errno
import fcntl
import itertools
import os
import re
import stat
import threading
import time
from typing import Iterable, Iterator

from shared_td.persist import format as fmt
from shared_td.platform import pid_alive, try_flock

#: Seconds a writer waits for gc's flock of its root (gc holds it while it renames a few files).
NODE_WAIT_S = 30.0

_SET_ASIDE_NAME = re.compile(
    rf"\.(?P<name>.+{re.escape(fmt.LEAF_SUFFIX)})\.viewed-(?P<pid>[1-9][0-9]*)-(?:0|[1-9][0-9]*)"
    rf"-(?P<ino>0|[1-9][0-9]*)",
    re.DOTALL,
)


# Numbers the files this process sets aside: two writers of one process (threads: they
# share the root's lock) never pick one name (a rename would replace the other's file).
_INDEX = itertools.count()


def set_aside_name(name: str, meta_ino: int) -> str:
    """A name, new in this process, that a writer gives the leaf file ``name`` it sets
    aside while its node's meta.json is the inode ``meta_ino`` (0: none): gc puts the
    file back only while meta.json is still that inode.

    Example:
        >>> set_aside_name("a.memmap", 77).startswith(f".a.memmap.viewed-{os.getpid()}-")
        True
    """
    return f".{name}.viewed-{os.getpid()}-{next(_INDEX)}-{meta_ino}"


def parse_set_aside_name(entry: str) -> tuple[str, int, int] | None:
    """``(leaf file name, writer pid, meta.json inode)`` of a name :func:`set_aside_name`
    made, else None.

    Examples:
        >>> parse_set_aside_name(".a.memmap.viewed-4242-0-77")
        ('a.memmap', 4242, 77)
        >>> parse_set_aside_name(".a.memmap.viewed-4242-0-77.memmap") is None  # a user's key
        True
    """
    match = _SET_ASIDE_NAME.fullmatch(entry)
    return (match["name"], int(match["pid"]), int(match["ino"])) if match else None


def meta_inode(directory_fd: int) -> int:
    """The inode number of the meta.json in the directory ``directory_fd``, 0 if none."""
    try:
        return os.stat(fmt.META, dir_fd=directory_fd, follow_symlinks=False).st_ino
    except FileNotFoundError:
        return 0


@dataclasses.dataclass
class NodeLeftovers:
    """What dead writers left in one node directory, and what gc does with it: the files
    set aside to put back over their ``NAME`` (``(set-aside path, NAME path)``), the
    files to remove (set-aside files, then temporaries), and what is left, with why.
    ``committed``: the writers (pids) whose set-aside files here are stale (meta.json
    changed since)."""

    directory: str
    put_back: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    remove: list[str] = dataclasses.field(default_factory=list)
    left: list[str] = dataclasses.field(default_factory=list)
    committed: set[int] = dataclasses.field(default_factory=set)
    half: set[int] = dataclasses.field(default_factory=set)  # the tree's half_committed (leftovers.py)

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


def node_leftovers(directory: str, names: Iterable[str], half: Iterable[int] = ()) -> NodeLeftovers:
    """Decide what gc does with the dead writers' files among ``names`` (the entries of
    ``directory``); nothing is changed (see the module doc for the rules). A file set
    aside counts as a dead writer's whatever its pid: the caller checks the flocks
    (:func:`locked_chain`); a temporary alone, where its pid no longer runs. The files of
    the writers in ``half`` (:func:`half_committed`) are all left.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as d:
        ...     open(os.path.join(d, "meta.json"), "w").close()
        ...     ino = os.stat(os.path.join(d, "meta.json")).st_ino
        ...     for name in (f".a.memmap.viewed-999999999-0-{ino}", "meta.json.999999999.1.tmp"):
        ...         open(os.path.join(d, name), "w").close()
        ...     found = node_leftovers(d, os.listdir(d))  # killed before its commit
        ...     [os.path.basename(p)[:21] for pair in found.put_back for p in pair], found.left
        (['.a.memmap.viewed-9999', 'a.memmap'], [])
    """
    temporaries: dict[int, list[str]] = collections.defaultdict(list)
    asides: dict[int, list[tuple[str, str, int]]] = collections.defaultdict(list)
    for name in sorted(names):
        pid = fmt.temporary_writer_pid(name)
        if pid is not None:
            temporaries[pid].append(name)
            continue
        parsed = parse_set_aside_name(name)
        if parsed is not None:
            mode = _mode(os.path.join(directory, name))
            if mode is not None and stat.S_ISREG(mode):  # (a nested key of that name is a directory)
                asides[parsed[1]].append((name, parsed[0], parsed[2]))
    writers_of = collections.Counter(own for files in asides.values() for own in {own for _, own, _ in files})
    found = NodeLeftovers(directory)
    now = _meta_inode_at(directory)
    half = set(half)
    for pid in sorted(set(asides) | {pid for pid in temporaries if _dead(pid)}):
        put_back, remove, left = [], [], []
        for entry, own, ino in asides[pid]:
            path, own_path = os.path.join(directory, entry), os.path.join(directory, own)
            mode = _mode(own_path)
            if ino != now:  # meta.json replaced since (this writer's commit, or a later save's)
                found.committed.add(pid)
            if writers_of[own] > 1:
                left.append(f"{path} (dead writers {sorted(p for p in asides if any(o == own for _, o, _ in asides[p]))} "
                            f"each set a file aside for {own}: which holds the save's bytes is unknown)")
            elif mode is not None and not stat.S_ISREG(mode):
                left.append(f"{path} ({own_path} is not a regular file: the set-aside file may be the only copy "
                            "of the leaf's bytes)")
            elif ino == now:  # meta.json still the one that describes the bytes set aside
                put_back.append((path, own_path))
            elif mode is None:
                left.append(f"{path} ({own_path} is missing although meta.json changed since: the set-aside "
                            "file is the only copy of bytes there)")
            else:
                remove.append(path)
        if pid in half:  # all its files, temporaries too: the next gc decides the same
            found.left += [f"{os.path.join(directory, name)} (half-committed tree: writer pid {pid} committed a "
                           "node below this one or here, not one above whose meta.json temporary is still there; "
                           "which version to keep is for a person to decide)"
                           for name in (*(e for e, _, _ in asides[pid]), *temporaries[pid])]
            continue
        temporary_paths = [os.path.join(directory, name) for name in temporaries[pid]]
        if left:  # the writer's files stay together, so that what it did stays decidable
            found.left += left + [f"{path} (kept with the files pid {pid} set aside)" for path in temporary_paths]
            found.left += [f"{path} (kept with the other files pid {pid} set aside)"
                           for path in (*(p for p, _ in put_back), *remove)]
        else:
            found.put_back += put_back
            found.remove += remove + temporary_paths
    return found


def _meta_inode_at(directory: str) -> int:
    try:
        return os.lstat(os.path.join(directory, fmt.META)).st_ino
    except FileNotFoundError:
        return 0


def half_committed(nodes: Iterable[NodeLeftovers], root: str) -> set[int]:
    """The writers that committed a node (its files set aside are stale) while the
    meta.json temporary they staged in a directory above it (up to ``root``, and beyond
    while one holds a meta.json: the writer's root) is still there: killed between two
    commits of one tree. Neither version is whole; gc leaves all their files."""
    found: set[int] = set()
    for node in nodes:
        for pid in sorted(node.committed - found):
            if any(pid in _staged_pids(above) for above in list(_chain(node.directory, root))[1:]):
                found.add(pid)
    return found


def _staged_pids(directory: str) -> set[int]:
    try:
        names = os.listdir(directory)
    except OSError:
        return set()
    return {pid for name in names if name.startswith(fmt.META + ".")
            and (pid := fmt.temporary_writer_pid(name)) is not None}


def _chain(directory: str, root: str) -> Iterator[str]:
    """``directory``, then each directory above it up to ``root``, and beyond while one
    holds a meta.json (the tree a writer of a node below ``root`` locked may start
    higher: a node, or the save, above)."""
    current, root = os.path.abspath(directory), os.path.abspath(root)
    while True:
        yield current
        parent = os.path.dirname(current)
        inside = current != root and os.path.commonpath([root, current]) == root
        if parent == current or not (inside or os.path.lexists(os.path.join(parent, fmt.META))):
            return
        current = parent


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
    """Take, without waiting, the exclusive ``flock`` of ``directory`` and of every
    directory above it (:func:`_chain`): a writer that set files aside holds its tree
    root's, shared (:func:`hold_root`). Yields False, with none held, where any is held
    (a live writer: busy), else True while they are held. The lock alone says a writer
    lives: a free one, whatever the pid in a file's name (another pid namespace's, or a
    dead writer's pid now reused), is a dead writer's."""
    held: list[int] = []
    try:
        for current in _chain(directory, root):
            try:
                fd = os.open(current, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            except OSError:
                continue  # (one that cannot be opened holds no writer's lock of ours)
            held.append(fd)
            if not try_flock(fd):
                yield False
                return
        yield True
    finally:
        for fd in held:
            os.close(fd)  # (drops its flock)


# The root flocks this process's writers hold (hold_root): a fork child closes its copies
# (never LOCK_UN: that would drop the parent's lock, one open file description for both),
# so that a worker forked during a write does not hold the lock for its whole life.
_HELD: set[int] = set()
_HELD_LOCK = threading.Lock()


def _close_held_in_child() -> None:
    global _HELD_LOCK
    _HELD_LOCK = threading.Lock()
    for fd in _HELD:
        with contextlib.suppress(OSError):
            os.close(fd)
    _HELD.clear()


os.register_at_fork(after_in_child=_close_held_in_child)


def hold_root(directory_fd: int, path: str) -> int:
    """Take the shared ``flock`` of the directory ``directory_fd`` (a tree write's root)
    on a descriptor of its own, returned, for :func:`release_root`. Held while the write
    has files set aside: writers share it (they never wait for each other: last writer
    wins), gc's exclusive try fails on it (busy). gc holds it a moment: waited for, at
    most NODE_WAIT_S.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as d:
        ...     fd = os.open(d, os.O_RDONLY)
        ...     held = hold_root(fd, d)
        ...     with locked_chain(d, d) as free:
        ...         busy = not free
        ...     release_root(held); os.close(fd)
        ...     with locked_chain(d, d) as free:
        ...         busy, free
        (True, True)
    """
    with _HELD_LOCK:  # (registered before a fork can copy it unregistered)
        fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=directory_fd)
        _HELD.add(fd)
    deadline = time.monotonic() + NODE_WAIT_S
    pause = 0.001
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                return fd
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"shared_td gc has held {path} (its flock) for more than {NODE_WAIT_S:g} s: "
                                       "it is stalled or stopped; nothing was written.") from None
            time.sleep(pause)
            pause = min(2 * pause, 0.05)
    except BaseException:
        release_root(fd)
        raise


def release_root(fd: int) -> None:
    """Drop a :func:`hold_root` lock (closes its descriptor)."""
    with _HELD_LOCK:
        _HELD.discard(fd)
        os.close(fd)
