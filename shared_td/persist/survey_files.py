"""What the survey sees of a save: a directory on disk, or an archive's members.

``survey`` walks both the same way through one of these views; each answers, for a path
relative to the save's root, what is there (:class:`Found`), reads a node's checked
meta.json with the loader's own code, and lists every name below the root. Only the
disk view can hold symlinks or special files (an archive holding one is refused whole
when opened, as a load refuses it); only the archive view has stored checksums, which
:meth:`InArchive.damaged` checks by reading every member.
"""
from __future__ import annotations

import os
import posixpath
import stat
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

from shared_td.errors import FormatError
from shared_td.persist import format as fmt
from shared_td.persist.archive import Archive, ArchiveNode
from shared_td.persist.bounded_reads import MAX_META_BYTES
from shared_td.persist.loader import read_meta
from shared_td.persist.node_meta import NodeMeta
from shared_td.storage.files import Directory

__all__ = ["Found", "InArchive", "OnDisk", "Progress"]

#: ``progress(done, total)``: bytes checked so far and in all (see ``InArchive.damaged``)
Progress = Optional[Callable[[int, int], None]]

DIRECTORY, FILE, SYMLINK = "directory", "file", "symlink"


@dataclass(frozen=True)
class Found:
    """What lies at a path: ``kind`` is DIRECTORY, FILE, SYMLINK or the words for a
    special file ("a FIFO"...); ``size`` the bytes of a file (uncompressed, in an
    archive); ``target`` a symlink's."""

    kind: str
    size: int = 0
    target: str = ""


class OnDisk:
    """The save as the directory ``root`` (symlinks are reported, never followed).

    The root is opened once, and every look below it goes through that descriptor and
    the sub-directories opened from it (``O_NOFOLLOW``), as the loader reads: an atomic
    rewrite that swaps a new version in at ``root`` meanwhile cannot mix the two. What
    was read is the version opened, whole, unless the writer has begun removing it:
    :meth:`replaced` says whether that may have happened (the survey starts again then).
    """

    def __init__(self, root: str):
        self.root = root
        # (a symlink given as root is followed: it names the save, like os.path.isdir)
        self._root = Directory(os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC), root, "load")
        # the sub-directories open now, one per level below the root, and their names:
        # the walk is depth first, so keeping the last path's chain opens each one about
        # once, and no more descriptors than the tree is deep are ever held
        self._chain: list[Directory] = []
        self._names: list[str] = []

    def found(self, path: str) -> Found | None:
        parent, name = os.path.split(path)
        try:
            directory = self._directory(parent)
        except (FileNotFoundError, NotADirectoryError, RuntimeError):
            return None  # a parent missing, or a symlink: nothing of the save lies below
        if not name:
            return Found(DIRECTORY)
        info = directory.lstat(name)
        if info is None:
            return None
        if stat.S_ISLNK(info.st_mode):
            return Found(SYMLINK, target=os.readlink(name, dir_fd=directory.fd))
        if stat.S_ISDIR(info.st_mode):
            return Found(DIRECTORY)
        if stat.S_ISREG(info.st_mode):
            return Found(FILE, info.st_size)
        return Found(fmt.file_kind(info.st_mode))

    def read_meta(self, directory: str) -> NodeMeta:
        """The checked meta.json of ``directory``, read by the loader's own
        ``loader.read_meta`` (a symlinked directory: RuntimeError)."""
        return read_meta(self._directory(directory))

    def not_a_save(self) -> str | None:
        """Why the root is no save (the words atomic=True uses to refuse replacing it).

        The one look by path, so that format.not_a_save stays the only reader of those
        words: should it read another version than the one opened, the root was
        replaced meanwhile, which :meth:`replaced` then says (atomic=True only ever
        swaps a save in, and the survey starts again anyway)."""
        return fmt.not_a_save(self.root)

    def listing(self) -> Iterator[tuple[str, list[str]]]:
        """(directory relative to the root, the names in it) for every directory below
        the opened root (symlinks not followed; one that cannot be listed is skipped)."""
        for directory, dirnames, filenames, _ in os.fwalk(os.curdir, dir_fd=self._root.fd):
            relative = os.path.normpath(directory)
            yield ("" if relative == os.curdir else relative), sorted(dirnames + filenames)

    def escapes(self, path: str, target: str) -> bool:
        """Whether the symlink at ``path`` leads out of the root."""
        real = os.path.realpath(os.path.join(self.root, os.path.dirname(path), target))
        root = os.path.realpath(self.root)
        return not (real == root or real.startswith(root + os.sep))

    def refused_leaf(self, path: str, nbytes: int) -> str | None:
        return None  # a file's size says it all (checked by the caller)

    def names_in(self, directory: str) -> list[str] | None:
        """The names in ``directory``; None if it cannot be listed (what it holds is then
        looked at name by name: a lazy stack's next member index only, as the loader)."""
        try:
            return os.listdir(self._directory(directory).fd)
        except (OSError, RuntimeError):
            return None

    def replaced(self) -> bool:
        """Whether ``root`` names another directory than the one opened (an atomic
        rewrite swapped a new version in, and may be removing the one read)."""
        try:
            current = os.stat(self.root)
        except (FileNotFoundError, NotADirectoryError):
            return True
        opened = os.fstat(self._root.fd)
        return (current.st_dev, current.st_ino) != (opened.st_dev, opened.st_ino)

    def damaged(self, progress: Progress = None) -> list[tuple[str, str]]:
        return []  # files on disk carry no checksum (nothing to read: no progress)

    def close(self) -> None:
        self._directory("")
        self._root.close()

    def _directory(self, relative: str) -> Directory:
        """The sub-directory ``relative`` of the root, opened name by name (a symlink is
        a RuntimeError, a missing one a FileNotFoundError)."""
        names = relative.split(os.sep) if relative else []
        keep = 0
        while keep < min(len(names), len(self._names)) and names[keep] == self._names[keep]:
            keep += 1
        for directory in reversed(self._chain[keep:]):
            directory.close()
        del self._chain[keep:], self._names[keep:]
        for name in names[keep:]:
            self._chain.append((self._chain[-1] if self._chain else self._root).child(name))
            self._names.append(name)
        return self._chain[-1] if self._chain else self._root


class InArchive:
    """The save as the members of the archive ``root`` (its index checked on opening:
    a member escaping the archive, a symlink or a duplicate is a FormatError then)."""

    def __init__(self, root: str):
        self.root = root
        self.archive = Archive(root)
        self._refused: set[str] = set()  # members refused as leaves: not read through

    def found(self, path: str) -> Found | None:
        name = _member(path)
        if name in self.archive.members:
            return Found(FILE, self.archive.members[name].size)
        if name in self.archive.directories:
            return Found(DIRECTORY)
        return None

    def read_meta(self, directory: str) -> NodeMeta:
        name = _member(directory)
        if name not in self.archive.directories:
            raise FileNotFoundError(f"No directory {name!r} in the archive {self.root}")
        return read_meta(ArchiveNode(self.archive, name))

    def not_a_save(self) -> str | None:
        """Why the root is no save; a root meta.json whose data do not match its stored
        checksum is said to be damaged (not "not valid JSON")."""
        member = self.archive.members.get(fmt.META)
        if member is not None and member.size <= MAX_META_BYTES:  # (a bigger one is refused unread below)
            try:
                self.archive.check(fmt.META)
            except FormatError as error:
                cause = error.detail.rpartition("checksum: ")[2]  # zipfile's words
                return (f"its {fmt.META} does not match its stored checksum ({cause}): the "
                        "archive is damaged; save it again or restore it from a copy")
        return self.archive.not_a_save()

    def listing(self) -> Iterator[tuple[str, list[str]]]:
        below: dict[str, list[str]] = {directory: [] for directory in self.archive.directories}
        for name in list(self.archive.members) + [d for d in self.archive.directories if d]:
            below[posixpath.dirname(name)].append(posixpath.basename(name))
        for directory in sorted(below):
            yield directory, sorted(below[directory])

    def escapes(self, path: str, target: str) -> bool:
        return True  # never asked: an archive holding a symlink is refused when opened

    def names_in(self, directory: str) -> list[str]:
        """The names of the sub-directories of ``directory`` (those a node may own)."""
        name = _member(directory)
        inside = name + "/" if name else ""
        return [d[len(inside):] for d in self.archive.directories
                if d.startswith(inside) and d != inside[:-1] and "/" not in d[len(inside):]]

    def replaced(self) -> bool:
        return False  # read through the one descriptor opened: one version, even if renamed over

    def refused_leaf(self, path: str, nbytes: int) -> str | None:
        """Why the member at ``path`` cannot hold a leaf of ``nbytes`` bytes (what a load
        says before reading it), else None; such a member is not read for its CRC
        (:meth:`damaged`): it may decompress to any size."""
        name = _member(path)
        why = self.archive.size_problem(name, nbytes)
        if why is not None:
            self._refused.add(name)
        return why

    def damaged(self, progress: Progress = None) -> list[tuple[str, str]]:
        """(member, why) for each member whose data do not match its stored CRC (every
        member is read through once, except those :meth:`refused_leaf` refused);
        ``progress(done, total)``, if given, is called with the bytes of data read so
        far and in all as the reading goes on."""
        problems = []
        members = {name: member for name, member in self.archive.members.items() if name not in self._refused}
        total, done = sum(member.size for member in members.values()), 0

        def advance(count: int) -> None:
            nonlocal done
            done += count
            progress(done, total)

        for name in sorted(members):
            try:
                self.archive.check(name, None if progress is None else advance)
            except FormatError as error:
                problems.append((name, error.detail))
        if progress is not None:
            progress(total, total)  # (a damaged member was not read to its end)
        return problems

    def close(self) -> None:
        self.archive.close()


def _member(path: str) -> str:
    """The archive member name of a survey path ("" or "a/b")."""
    path = os.path.normpath(path) if path else ""
    return "" if path == os.curdir else path.replace(os.sep, "/")
