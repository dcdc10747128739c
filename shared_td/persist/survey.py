"""What a save holds, read from its meta.json files only (nothing is mapped).

``survey(prefix)`` walks a directory (or an archive, through the same code:
survey_files.py) written by shared_td or tensordict 0.15.3 the way the loader would,
without mapping a leaf or unpickling a value, and returns the tree
(keys, classes, shapes, dtypes, sizes on disk, non-tensor values shown as short text)
with every problem found: a meta.json that the loader would refuse (read and checked
by the loader's own ``read_meta``), a batch size that does not fit a child, a
missing, short or special (FIFO, socket, device) leaf file, a symlink (never followed:
it could lead out of the directory), a file that no meta.json names; in an archive, a
member whose data do not match its stored checksum. ``shared-td inspect`` prints the
tree, ``shared-td verify`` the problems.
A directory is read through its root opened once, as a load reads it: a survey that
races an atomic rewrite reports the one version it opened, or starts again on the new
one if that was swapped in meanwhile (never a tree mixed from two versions).
The tree's types are in saved_tree.py.

Examples:
    >>> found = survey("data/buffer")
    >>> [leaf.key for leaf in found.root.children]
    ['obs', 'next']
    >>> found.errors
    []
"""
from __future__ import annotations

import errno
import math
import os
from typing import Any

from shared_td.errors import FormatError, NotASaveError
from shared_td.keys import decode_key
from shared_td.persist import format as fmt
from shared_td.persist import nodes
from shared_td.persist.archive import looks_like_zip
from shared_td.persist.node_meta import ChildMeta, LeafMeta, NodeMeta
from shared_td.persist.saved_tree import NODE, TENSOR, VALUE, VALUE_WIDTH, Entry, Problem, Survey
from shared_td.persist.sub_directories import SubDirectories
from shared_td.persist.survey_files import DIRECTORY, FILE, SYMLINK, InArchive, OnDisk, Progress

__all__ = ["NODE", "TENSOR", "VALUE", "Entry", "NodeView", "Problem", "Survey", "survey"]

def survey(prefix: str, progress: Progress = None) -> Survey:
    """Read the tree saved at ``prefix`` (a directory or an archive) and check it (see
    the module docstring). ``progress(done, total)``, if given, is called as an
    archive's data are read for their checksums (bytes so far, bytes in all): the one
    part whose time grows with the data (a directory's files are only looked at).

    Raises:
        FileNotFoundError: ``prefix`` does not exist or holds no meta.json.
        OSError: ``prefix`` is a symlink loop (errno ELOOP) or cannot be looked at.
        NotASaveError: (a NotADirectoryError and the ValueError tensordict raises)
            ``prefix`` is a file but no zip archive.
        FormatError: its meta.json is not that of a save (format.not_a_save says why),
            or the archive's index is damaged or refused (what a load refuses).
        OSError: (errno EAGAIN) the directory was replaced by an atomic rewrite during
            each of :data:`TRIES` surveys: it is being rewritten continually.

    Each error raised for the root has a ``survey_path``: the path it concerns, relative
    to the prefix (``"meta.json"``, or ``"."`` for the prefix itself), for a report that
    lists it as a problem (``shared-td verify --json``).
    """
    root = os.path.abspath(os.fspath(prefix))
    try:
        return _survey(root, progress)
    except (OSError, FormatError) as error:
        if not hasattr(error, "survey_path"):
            error.survey_path = os.curdir
        raise


#: How many times a survey starts again when the directory it read was replaced (an
#: atomic rewrite swapped a new version in, and may have been removing the one read)
#: before it says that the prefix is being rewritten instead of reporting a mix.
TRIES = 20


def _survey(root: str, progress: Progress) -> Survey:
    """One version of the save at ``root``, read whole: a directory's survey is read
    through the root opened once (survey_files.OnDisk) and starts again if the root
    was replaced meanwhile (as a load does), at most :data:`TRIES` times."""
    for _ in range(TRIES):
        files = _open(root)
        if files is None:
            continue  # replaced between the look and the open
        try:
            try:
                found = _read(root, files, progress)
            except (OSError, FormatError):
                if not files.replaced():
                    raise
                continue
            if not files.replaced():
                return found
        finally:
            files.close()
    raise _os_error(OSError, errno.EAGAIN, f"{root} was replaced by a new version during each of "
                    f"{TRIES} surveys: it is being rewritten (atomic=True) continually; run "
                    "again when its writers pause")


def _open(root: str) -> OnDisk | InArchive | None:
    """The save at ``root``, opened; None if a directory there was gone by the time
    it was opened (a rewrite's two renames)."""
    if not os.path.exists(root):
        _missing(root)
    if not os.path.isdir(root):
        if looks_like_zip(root):
            return InArchive(root)  # read through one descriptor: one version
        kind = fmt.file_kind(os.stat(root).st_mode) or "a file"
        raise NotASaveError(f"{root} is {kind}, neither a saved tensordict directory nor an archive.")
    try:
        return OnDisk(root)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as error:
        raise _os_error(type(error), error.errno, f"cannot look at {root}: {error.strerror}") from None


def _read(root: str, files: OnDisk | InArchive, progress: Progress) -> Survey:
    if files.found(fmt.META) is None:
        error = FileNotFoundError(f"No saved tensordict at {root}: {fmt.META} is missing.")
        error.survey_path = fmt.META
        raise error
    why = files.not_a_save()
    if why is not None:
        error = fmt.FormatError(root, f"not a saved tensordict: {why}.")
        error.survey_path = fmt.META
        raise error
    walker = _Walker(files)
    tree = walker.node("", "")
    walker.check_directories()
    for member, why in files.damaged(progress):
        walker.problem("error", member, why)
    return Survey(root, tree, walker.problems)


def _missing(root: str) -> None:
    """Raise why ``root``, which os.path.exists does not see, cannot be surveyed: a
    symlink loop or a dangling symlink is said to be one (not "no such directory")."""
    try:
        os.stat(root)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise _os_error(OSError, errno.ELOOP, f"{root} is a symlink loop (ELOOP: too many levels of "
                          "symbolic links): fix or remove the link, or give the saved "
                          "tensordict's real path") from None
        if os.path.islink(root):
            raise _os_error(FileNotFoundError, errno.ENOENT, f"{root} is a symlink to {os.readlink(root)}, "
                                    "which does not exist: fix the link or give the saved "
                                    "tensordict's real path") from None
        if error.errno not in (errno.ENOENT, errno.ENOTDIR):
            raise _os_error(OSError, error.errno, f"cannot look at {root}: {error.strerror}") from None
    raise FileNotFoundError(f"No such directory: {root}")


def _os_error(kind: type, code: int, message: str) -> OSError:
    """An OSError with ``errno`` ``code`` whose str() is ``message`` alone."""
    error = kind(message)
    error.errno = code
    return error


class _Walker:
    """Reads the nodes; remembers which names each node directory should hold."""

    def __init__(self, files: OnDisk | InArchive):
        self.files = files
        self.problems: list[Problem] = []
        self.expected: dict[str, set[str]] = {}  # node directory -> names it owns
        self.reported: set[str] = set()  # paths already named in a problem

    def problem(self, severity: str, path: str, message: str) -> None:
        self.problems.append(Problem(severity, os.path.normpath(path), message))
        self.reported.add(os.path.normpath(path))

    # -------------------------------------------------------------------- nodes
    def node(self, key: str, directory: str) -> Entry:
        """The entry of the node saved in ``directory``: its keyed entries from its
        meta.json, its fixed-name children as its kind names them; the kind fills the
        rest (class, batch size, value)."""
        self.expected[directory] = {fmt.META}
        entry = Entry(key, NODE, directory)
        meta = self.read_meta(directory)
        if meta is None:  # what its files are for is unknown: no warning per file
            del self.expected[directory]
            entry.class_name = "?"
            return entry
        kind = nodes.kind_for_type_string(meta.type)
        for item in meta.entries:
            if isinstance(item, LeafMeta):
                entry.children.append(self.leaf(entry.path, item))
            else:
                self.child(entry, meta, item)
        view = NodeView(self, entry)
        try:
            # (with its names: a lazy stack's member lost however far before the next one)
            found = SubDirectories(lambda name: self.is_directory(os.path.join(directory, name)),
                                   lambda: self.files.names_in(directory))
            names = kind.child_names(meta, found)
        except FormatError as error:
            self.problem("error", directory, error.detail)
            names = []
        for name in names:
            self.expected[directory].add(name)
            view.children[name] = self.node(name, os.path.join(directory, name))
        kind.inspect(meta, view)
        return entry

    def child(self, entry: Entry, meta: NodeMeta, item: ChildMeta) -> None:
        """A sub-collection listed in ``meta``: found by its key, and its batch size checked."""
        name = self.find(entry.path, item.key, leaf=False)
        if name is None:
            return
        child = self.node(item.key, os.path.join(entry.path, name))
        entry.children.append(child)
        if child.kind == NODE and child.batch_size is not None:
            try:
                fmt.check_batch_fits(meta.path, item.key, meta.batch_size, child.batch_size)
            except FormatError as error:
                self.problem("error", os.path.join(entry.path, fmt.META), error.detail)

    def is_directory(self, path: str) -> bool:
        """A directory (never through a symlink)."""
        found = self.files.found(path)
        return found is not None and found.kind == DIRECTORY

    def read_meta(self, directory: str) -> NodeMeta | None:
        """The node's checked meta.json, read by the loader's own code; None (and the
        error the loader would raise, as a problem) when it would refuse it."""
        path = os.path.join(directory, fmt.META)
        try:
            return self.files.read_meta(directory)
        except FileNotFoundError:
            self.problem("error", path, f"{fmt.META} is missing: this directory is no saved node")
        except FormatError as error:
            self.problem("error", path, error.detail)
        except RuntimeError as error:  # the loader refuses symlinks
            found = self.files.found(path)
            symlink = found is not None and found.kind == SYMLINK
            self.problem("error", path, f"cannot read {fmt.META}: a symlink (not followed)" if symlink
                         else str(error))
        except OSError as error:
            self.problem("error", path, f"cannot read {fmt.META}: {error.strerror}")
        return None

    # -------------------------------------------------------------------- files
    def leaf(self, directory: str, leaf: LeafMeta) -> Entry:
        key = leaf.key
        entry = Entry(key, TENSOR, os.path.join(directory, fmt.file_names(key, leaf=True)[0]))
        entry.dtype, entry.shape = fmt.dtype_name(leaf.dtype), list(leaf.shape)
        numel = math.prod(leaf.shape)
        nested = leaf.is_nested
        if not nested:
            entry.nbytes = leaf.nbytes
        if numel == 0 and not nested:  # zero-element leaves have no file
            name = self.find(directory, key, leaf=True, required=False)
            entry.size_on_disk = 0
        else:
            name = self.find(directory, key, leaf=True)
        if name is None:
            return entry
        entry.path = os.path.join(directory, name)
        entry.size_on_disk = self.regular_file_size(entry.path)
        if nested:  # its shape is that of the int64 sizes file beside the data file
            sizes = fmt.nested_sizes_name(entry.path)
            self.expected[directory].add(os.path.basename(sizes))
            entry.class_name = "nested"
            self.problem("error", entry.path, f"key {key!r} is a nested tensor: tensordict "
                         "0.15.3 loads it, shared_td cannot yet")
            self.check_size(sizes, self.regular_file_size(sizes), numel * 8, entry)
        elif entry.nbytes is not None:
            self.check_size(entry.path, entry.size_on_disk, entry.nbytes, entry)
        return entry

    def check_size(self, path: str, size: int | None, needed: int, entry: Entry) -> None:
        if size is not None and size < needed:
            self.problem("error", path, f"{size} bytes, but shape {entry.shape} of "
                         f"{entry.dtype} needs {needed}: the file is truncated")
        elif size is not None and (why := self.files.refused_leaf(path, needed)) is not None:
            # (a compressed member announcing another size: a load refuses it unread)
            self.problem("error", path, f"shape {entry.shape} of {entry.dtype} needs {needed} bytes, but "
                         f"the member {why}: a load refuses it")

    def regular_file_size(self, path: str) -> int | None:
        """Its size; None (and a problem) when missing or not a regular file."""
        found = self.files.found(path)
        if found is None:
            self.problem("error", path, "missing: meta.json lists it")
            return None
        if found.kind == SYMLINK:
            self.problem("error", path, f"a symlink (to {found.target}), not followed")
            return None
        if found.kind != FILE:  # never opened: a FIFO would block
            self.problem("error", path, f"{found.kind}, not a regular file")
            return None
        return found.size

    def find(self, directory: str, key: str, *, leaf: bool, required: bool = True) -> str | None:
        """The existing name of ``key``'s file or directory (see format.file_names)."""
        names = fmt.file_names(key, leaf=leaf)
        for name in names:
            path = os.path.join(directory, name)
            found = self.files.found(path)
            if found is not None:
                self.expected[directory].add(name)
                if not leaf and found.kind != DIRECTORY:
                    kind = "a symlink, not followed" if found.kind == SYMLINK else "not a directory"
                    self.problem("error", path, f"the directory of key {key!r} is {kind}")
                    return None
                return name
        if required:
            kind = "file" if leaf else "directory"
            self.problem("error", os.path.join(directory, names[0]),
                         f"missing: the {kind} of key {key!r} listed in {os.path.join(directory, fmt.META)}")
        return None

    def pickled(self, directory: str, name: str) -> str:
        size = self.regular_file_size(os.path.join(directory, name))
        self.expected[directory].add(name)
        return "<pickled, ? bytes>" if size is None else f"<pickled, {size} bytes>"

    # -------------------------------------------------------------------- directories
    def check_directories(self) -> None:
        """Symlinks anywhere are errors; names no meta.json owns are warnings.

        Unknown directories are walked too (for symlinks), without a warning per file.
        """
        for relative, names in self.files.listing():
            for name in names:
                path = os.path.normpath(os.path.join(relative, name))
                if path in self.reported:
                    continue
                found = self.files.found(path)
                if found is None:  # gone since it was listed
                    continue
                if found.kind == SYMLINK:
                    where = "escapes the prefix" if self.files.escapes(path, found.target) else "inside the prefix"
                    self.problem("error", path, f"a symlink to {found.target} ({where}); never followed")
                elif relative in self.expected and name not in self.expected[relative]:
                    self.problem("warning", path, _unknown(name, found.kind == DIRECTORY))


def _unknown(name: str, is_directory: bool) -> str:
    if is_directory:
        return "an unknown directory: no meta.json names it"
    if name.endswith(fmt.LEAF_SUFFIX):
        key = decode_key(name[: -len(fmt.LEAF_SUFFIX)])
        return f"an unknown file: a leaf file of key {key!r}, which no meta.json lists"
    return "an unknown file: no meta.json names it"


class NodeView:
    """A node as a kind's ``inspect`` fills it: ``entry`` (class name, batch size,
    value, children) and ``children``, the entries of its fixed-name sub-directories
    by name (a kind decides whether they are shown as they are)."""

    def __init__(self, walker: _Walker, entry: Entry):
        self._walker = walker
        self.entry = entry
        self.children: dict[str, Entry] = {}

    def pickled(self, name: str) -> str:
        """A pickle side file of the node as shown (its size; never unpickled)."""
        return self._walker.pickled(self.entry.path, name)

    def has_file(self, name: str) -> bool:
        return self._walker.files.found(os.path.join(self.entry.path, name)) is not None

    @staticmethod
    def shown(value: Any, width: int = VALUE_WIDTH) -> str:
        """A value as inspect shows it: its repr, cut to ``width`` characters."""
        return fmt.shown_value(value, width)
