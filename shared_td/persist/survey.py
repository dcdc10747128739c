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

from shared_td.errors import FormatError
from shared_td.keys import decode_key
from shared_td.persist import format as fmt
from shared_td.persist.format import NodeMeta
from shared_td.persist.loader import read_node_meta
from shared_td.persist.saved_tree import NODE, TENSOR, VALUE, VALUE_WIDTH, Entry, Problem, Survey

__all__ = ["NODE", "TENSOR", "VALUE", "Entry", "Problem", "Survey", "survey"]

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
        self.expected[directory] = {fmt.META}
        entry = Entry(key, NODE, directory)
        meta = self.read_meta(directory)
        if meta is None:  # what its files are for is unknown: no warning per file
            del self.expected[directory]
            entry.class_name = "?"
            return entry
        if meta.type == fmt.TENSORDICT_TYPE:
            self.tensordict(entry, meta)
        elif meta.type == fmt.LAZY_STACK_TYPE:
            self.lazy_stack(entry)
        elif meta.type == fmt.NON_TENSOR_DATA_TYPE:
            self.non_tensor_data(entry, meta.document)
        elif meta.type == fmt.NON_TENSOR_STACK_TYPE:
            self.non_tensor_stack(entry, meta.document)
        else:
            self.tensorclass(entry, meta.document, meta.type)
        return entry

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

    def tensordict(self, entry: Entry, meta: NodeMeta) -> None:
        entry.class_name = "TensorDict"
        entry.batch_size = list(meta.batch_size)
        for item in meta.entries:
            if isinstance(item, fmt.LeafMeta):
                entry.children.append(self.leaf(entry.path, item))
                continue
            name = self.find(entry.path, item.key, leaf=False)
            if name is None:
                continue
            child = self.node(item.key, os.path.join(entry.path, name))
            entry.children.append(child)
            if child.kind == NODE and child.batch_size is not None:
                try:
                    fmt.check_batch_fits(meta.path, item.key, meta.batch_size, child.batch_size)
                except FormatError as error:
                    self.problem("error", os.path.join(entry.path, fmt.META), error.detail)

    def lazy_stack(self, entry: Entry) -> None:
        entry.class_name = "LazyStackedTensorDict"
        index = 0
        while os.path.isdir(self.absolute(os.path.join(entry.path, str(index)))) and \
                not os.path.islink(self.absolute(os.path.join(entry.path, str(index)))):
            self.expected[entry.path].add(str(index))
            entry.children.append(self.node(str(index), os.path.join(entry.path, str(index))))
            index += 1
        if index == 0:
            self.problem("error", entry.path, "a lazy stack without members (no 0/ directory)")
        entry.batch_size = [index]

    def non_tensor_data(self, entry: Entry, meta: dict) -> None:
        entry.kind, entry.class_name = VALUE, "NonTensorData"
        if "data" in meta:
            entry.value = _short(repr(meta["data"]))
        else:
            entry.value = self.pickled(entry.path, fmt.OTHER_PICKLE)

    def non_tensor_stack(self, entry: Entry, meta: dict) -> None:
        entry.kind, entry.class_name = VALUE, "NonTensorStack"
        data = meta.get("data")
        if data == fmt.STACK_PICKLE:
            entry.value = self.pickled(entry.path, fmt.STACK_PICKLE)
        else:
            entry.value = _short(repr(data))
            if isinstance(data, list):
                entry.batch_size = [len(data)]

    def tensorclass(self, entry: Entry, meta: dict, type_str) -> None:
        entry.class_name = _class_name(type_str)
        child = os.path.join(entry.path, fmt.TENSORCLASS_CHILD)
        if not os.path.isdir(self.absolute(child)) or os.path.islink(self.absolute(child)):
            self.problem("error", os.path.join(entry.path, fmt.META),
                         "a tensorclass without its _tensordict/ directory: cannot be loaded")
            return
        self.expected[entry.path].add(fmt.TENSORCLASS_CHILD)
        inner = self.node(fmt.TENSORCLASS_CHILD, child)
        entry.batch_size, entry.children = inner.batch_size, inner.children
        for key, value in meta.items():  # non-tensor fields kept in meta.json itself
            if not key.startswith("_"):
                entry.children.append(Entry(key, VALUE, os.path.join(entry.path, fmt.META),
                                            "field", value=_short(repr(value))))
        if os.path.lexists(self.absolute(os.path.join(entry.path, fmt.OTHER_PICKLE))):
            value = self.pickled(entry.path, fmt.OTHER_PICKLE)
            entry.children.append(Entry("(other fields)", VALUE, os.path.join(entry.path, fmt.OTHER_PICKLE),
                                        "field", value=value))

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
            sizes = entry.path[: -len(fmt.LEAF_SUFFIX)] + ".shape" + fmt.LEAF_SUFFIX
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


def _class_name(type_str) -> str:
    """``"<class 'module.Name'>"`` -> ``"module.Name"``, without importing anything."""
    if isinstance(type_str, str) and type_str.startswith("<class '") and type_str.endswith("'>"):
        return type_str[len("<class '"): -len("'>")]
    return "?"


def _short(text: str, width: int = VALUE_WIDTH) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."
