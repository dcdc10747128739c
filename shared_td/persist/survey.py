"""What a saved directory holds, read from its meta.json files only (nothing is mapped).

``survey(prefix)`` walks a directory written by shared_td or tensordict 0.15.3 the way
the loader would, without mapping a leaf or unpickling a value, and returns the tree
(keys, classes, shapes, dtypes, sizes on disk, non-tensor values shown as short text)
with every problem found: a meta.json that the loader would refuse (read and checked
by the loader's own ``read_node_meta``), a batch size that does not fit a child, a
missing, short or special (FIFO, socket, device) leaf file, a symlink (never followed:
it could lead out of the directory), a file that no meta.json names. ``shared-td inspect`` prints the tree, ``shared-td verify`` the problems.
The tree's types are in saved_tree.py.

Examples:
    >>> found = survey("data/buffer")
    >>> [leaf.key for leaf in found.root.children]
    ['obs', 'next']
    >>> found.errors
    []
"""
from __future__ import annotations

import math
import os
import stat
from typing import Any

from shared_td.errors import FormatError
from shared_td.keys import decode_key
from shared_td.persist import format as fmt
from shared_td.persist import nodes
from shared_td.persist.archive import is_memmap_archive
from shared_td.persist.format import NodeMeta
from shared_td.persist.loader import read_node_meta
from shared_td.persist.saved_tree import NODE, TENSOR, VALUE, VALUE_WIDTH, Entry, Problem, Survey

__all__ = ["NODE", "TENSOR", "VALUE", "Entry", "NodeView", "Problem", "Survey", "survey"]

def survey(prefix: str) -> Survey:
    """Read the tree saved at ``prefix`` and check it (see the module docstring).

    Raises:
        FileNotFoundError: ``prefix`` does not exist or holds no meta.json.
        NotADirectoryError: ``prefix`` is a file.
        FormatError: its meta.json is not that of a save (format.not_a_save says why).
    """
    root = os.path.abspath(os.fspath(prefix))
    if not os.path.exists(root):
        raise FileNotFoundError(f"No such directory: {root}")
    if not os.path.isdir(root):
        if is_memmap_archive(root):
            raise NotADirectoryError(
                f"{root} is an archive (one zip file), which is not surveyed file by file: "
                f"unpack it first (shared_td.unpack_memmap({root!r}, 'some/directory')), or "
                "load it with shared_td.load_memmap, which checks what it maps.")
        raise NotADirectoryError(f"{root} is a file, not a saved tensordict directory.")
    if not os.path.lexists(os.path.join(root, fmt.META)):
        raise FileNotFoundError(f"No saved tensordict at {root}: {fmt.META} is missing.")
    why = fmt.not_a_save(root)  # the words atomic=True uses to refuse replacing it
    if why is not None:
        raise fmt.FormatError(root, f"not a saved tensordict: {why}.")
    walker = _Walker(root)
    tree = walker.node("", "")
    walker.check_directories()
    return Survey(root, tree, walker.problems)


class _Walker:
    """Reads the nodes; remembers which names each node directory should hold."""

    def __init__(self, root: str):
        self.root = root
        self.problems: list[Problem] = []
        self.expected: dict[str, set[str]] = {}  # node directory -> names it owns
        self.reported: set[str] = set()  # paths already named in a problem

    def problem(self, severity: str, path: str, message: str) -> None:
        self.problems.append(Problem(severity, os.path.normpath(path), message))
        self.reported.add(os.path.normpath(path))

    def absolute(self, path: str) -> str:
        return os.path.join(self.root, path)

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
            if isinstance(item, fmt.LeafMeta):
                entry.children.append(self.leaf(entry.path, item))
            else:
                self.child(entry, meta, item)
        view = NodeView(self, entry)
        try:
            names = kind.child_names(meta, lambda name: self.is_directory(os.path.join(directory, name)))
        except FormatError as error:
            self.problem("error", directory, error.detail)
            names = []
        for name in names:
            self.expected[directory].add(name)
            view.children[name] = self.node(name, os.path.join(directory, name))
        kind.inspect(meta, view)
        return entry

    def child(self, entry: Entry, meta: NodeMeta, item: fmt.ChildMeta) -> None:
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
        absolute = self.absolute(path)
        return os.path.isdir(absolute) and not os.path.islink(absolute)

    def read_meta(self, directory: str) -> NodeMeta | None:
        """The node's checked meta.json, read by the loader's own code; None (and the
        error the loader would raise, as a problem) when it would refuse it."""
        path = os.path.join(directory, fmt.META)
        try:
            return read_node_meta(self.absolute(directory))
        except FileNotFoundError:
            self.problem("error", path, f"{fmt.META} is missing: this directory is no saved node")
        except FormatError as error:
            self.problem("error", path, error.detail)
        except RuntimeError as error:  # the loader refuses symlinks
            symlink = os.path.islink(self.absolute(path))
            self.problem("error", path, f"cannot read {fmt.META}: a symlink (not followed)" if symlink
                         else str(error))
        except OSError as error:
            self.problem("error", path, f"cannot read {fmt.META}: {error.strerror}")
        return None

    # -------------------------------------------------------------------- files
    def leaf(self, directory: str, leaf: fmt.LeafMeta) -> Entry:
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

    def regular_file_size(self, path: str) -> int | None:
        """Its size; None (and a problem) when missing or not a regular file."""
        try:
            info = os.lstat(self.absolute(path))
        except FileNotFoundError:
            self.problem("error", path, "missing: meta.json lists it")
            return None
        if stat.S_ISLNK(info.st_mode):
            self.problem("error", path, f"a symlink (to {os.readlink(self.absolute(path))}), not followed")
            return None
        if not stat.S_ISREG(info.st_mode):  # never opened: a FIFO would block
            self.problem("error", path, f"{fmt.file_kind(info.st_mode)}, not a regular file")
            return None
        return info.st_size

    def find(self, directory: str, key: str, *, leaf: bool, required: bool = True) -> str | None:
        """The existing name of ``key``'s file or directory (see format.file_names)."""
        names = fmt.file_names(key, leaf=leaf)
        for name in names:
            path = os.path.join(directory, name)
            if os.path.lexists(self.absolute(path)):
                self.expected[directory].add(name)
                if not leaf and (os.path.islink(self.absolute(path)) or not os.path.isdir(self.absolute(path))):
                    kind = "a symlink, not followed" if os.path.islink(self.absolute(path)) else "not a directory"
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
        for directory, dirnames, filenames in os.walk(self.root):
            relative = os.path.relpath(directory, self.root)
            relative = "" if relative == os.curdir else relative  # the root's own key
            for name in sorted(dirnames + filenames):
                path = os.path.normpath(os.path.join(relative, name))
                if path in self.reported:
                    continue
                absolute = os.path.join(directory, name)
                if os.path.islink(absolute):
                    target = os.readlink(absolute)
                    inside = _inside(os.path.join(directory, target), self.root)
                    where = "inside the prefix" if inside else "escapes the prefix"
                    self.problem("error", path, f"a symlink to {target} ({where}); never followed")
                elif relative in self.expected and name not in self.expected[relative]:
                    self.problem("warning", path, _unknown(name, os.path.isdir(absolute)))


def _unknown(name: str, is_directory: bool) -> str:
    if is_directory:
        return "an unknown directory: no meta.json names it"
    if name.endswith(fmt.LEAF_SUFFIX):
        key = decode_key(name[: -len(fmt.LEAF_SUFFIX)])
        return f"an unknown file: a leaf file of key {key!r}, which no meta.json lists"
    return "an unknown file: no meta.json names it"


def _inside(path: str, root: str) -> bool:
    real, root = os.path.realpath(path), os.path.realpath(root)
    return real == root or real.startswith(root + os.sep)


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
        return os.path.lexists(self._walker.absolute(os.path.join(self.entry.path, name)))

    @staticmethod
    def shown(value: Any, width: int = VALUE_WIDTH) -> str:
        """A value as inspect shows it: its repr, cut to ``width`` characters."""
        text = repr(value)
        return text if len(text) <= width else text[: width - 3] + "..."
