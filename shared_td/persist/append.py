"""``append_memmap``: rows added to a saved tensordict along its first batch dimension,
in one step that a SIGKILL cannot tear.

How: under the prefix's writer lock (the one ``atomic=True`` writers take), a staging
directory beside the prefix mirrors the save. Every file is a hard link to the saved one
(no byte is copied), except the meta.json of each TensorDict node, written anew with the
new number of rows. Each leaf file then grows in place: the new rows' bytes go after the
bytes its meta.json declares. Nobody maps those (a reader of the old version maps the
declared bytes only), and a load ignores bytes past the declared size, so an append cut
short leaves the save as it was. Then the staging directory is swapped in
(``RENAME_EXCHANGE``): every level of the save goes from the old number of rows to the
new one at once. A SIGKILL at any moment leaves the old save or the new one, never a
mix (tensordict 0.15.3 replaces its meta.json files one at a time, and a kill between
two leaves levels with different numbers of rows, which a reader may then load).

What cannot grow is refused before anything is written (ValueError naming the key): a
lazy stack, a NonTensorStack, a nested tensor, an archive, rows whose keys, classes,
dtypes or shapes past the first dimension differ from the save's, and a non-tensor
value that differs from the saved one (a NonTensorData holds one value for all rows).

Needs hard links (every local Linux filesystem has them): where the filesystem refuses
them, an OSError says so and nothing changes. Readers that mapped the save before keep
its old rows (their leaves are views of the old sizes); a load after the append sees
the new ones.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
import warnings
from typing import Any

import torch

from shared_td.persist import atomic, nodes
from shared_td.persist import format as fmt
from shared_td.errors import FormatError
from shared_td.persist.bounded_reads import MAX_META_BYTES
from shared_td.persist.loader import Loader
from shared_td.keys import key_repr
from shared_td.nontensor_values import same_value
from shared_td.storage import files
from shared_td.storage.writing import pwrite_all

__all__ = ["append_memmap"]


def append_memmap(prefix: Any, rows: Any, *, allow_pickle: bool | None = None) -> None:
    """Append ``rows`` (a TensorDict or tensorclass) to the tensordict saved at
    ``prefix`` (a directory that ``memmap``/``save`` wrote, by shared_td or tensordict
    0.15.3), along its first batch dimension, as tensordict 0.15.3's
    ``append_memmap``, but in one step: a failure or a SIGKILL at any moment leaves the
    save as it was or with every row appended (see the module's opening).

    ``rows`` must have the save's keys, classes, dtypes and shapes, its batch size may
    differ in the first dimension only, and each non-tensor entry must hold the saved
    value (one value, or a NonTensorStack of that value). ``allow_pickle``: whether the
    save's pickled non-tensor values may be read to compare them (as in
    ``load_memmap``). Appends to one prefix are serialised with its other writers (the
    ``atomic=True`` lock).

    Raises:
        TypeError: ``rows`` is no TensorDict, lazy stack or tensorclass instance.
        ValueError: ``prefix`` is no saved directory (an archive: unpack it first; a
            nested level of a save: append to the save), or ``rows`` cannot be
            appended (names the key and what differs); nothing changed.
        OSError: the filesystem refuses hard links, or a file cannot be written
            (a read-only save, a full disk); nothing changed.

    Example:
        >>> td = TensorDict(obs=torch.zeros(3, 2), batch_size=[3])
        >>> _ = td.memmap("data/replay")
        >>> shared_td.append_memmap("data/replay", TensorDict(obs=torch.ones(2, 2), batch_size=[2]))
        >>> shared_td.load_memmap("data/replay")["obs"].sum(-1).tolist()
        [0.0, 0.0, 0.0, 2.0, 2.0]
    """
    target = _saved_directory(prefix)
    try:
        nodes.kind_for_object(rows)
    except TypeError:  # before the save is read, as tensordict 0.15.3 checks it
        cls = type(rows)
        name = cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
        raise TypeError(f"append_memmap: rows are a TensorDict, a lazy stack or a tensorclass instance of "
                        f"shared_td, not a {name}.") from None
    with atomic.acquired(target):
        try:
            atomic.sweep_leftovers(target)
        except OSError as error:  # what dead writers left does not stop this one
            warnings.warn(str(error), RuntimeWarning, stacklevel=2)
        # the structure and values only: the rows are checked against each leaf's saved
        # dtype and shape, never its bytes, so no file is mapped (half the time of an
        # append of one row to 100 leaves was mapping them and unmapping them again)
        saved = Loader(allow_pickle=bool(allow_pickle), map_leaves=False).load(target)
        growth = _Growth(target)
        try:
            _match(saved, rows, (), growth)
        finally:
            growth.saved.close()
        if not growth.rows:
            return  # no row to add: the save stays as it is
        staging = atomic.Staging(target)
        staged = _Levels(staging.path)
        grown: list[tuple[str, int]] = []
        staged_meta = None
        try:
            _mirror(target, staged, growth.rows)
            for leaf_file, declared, source, shared in growth.leaves:  # (its twin in staging: the same inode)
                grown.append((os.path.relpath(leaf_file, target), declared))
                if shared:  # other names share it: grow a copy, not them
                    _unshare(staged, *grown[-1])
                _grow(staged, *grown[-1], source, saved=leaf_file)
            staged.close()
            staging.finish()
            staged_meta = os.stat(os.path.join(staging.path, fmt.META))
            atomic.swap_into_place(staging.path, target)
        except BaseException as error:
            if not _is_live(target, staged_meta):  # (once swapped in, the grown files are the save's)
                _shrink(staged, grown)  # the saved files (the same inodes) back to their declared bytes
            staged.close()
            staging.discard(error)
            raise


def _saved_directory(prefix: Any) -> str:
    """The directory to append to (a symlink resolved, as atomic writes do); ValueError
    unless it is a saved tensordict's directory."""
    if prefix is None:
        raise ValueError("append_memmap: pass the directory that memmap/save wrote, not None.")
    target = atomic.resolve(prefix)
    if os.path.isfile(target):
        raise ValueError(f"append_memmap: {target} is a file (an archive cannot grow: unpack_memmap it into a "
                         "directory, append there, then pack_memmap it again).")
    if not os.path.isdir(target):
        raise ValueError(f"append_memmap: {target} is not a directory: save the first rows with memmap/save.")
    why = fmt.not_a_save(target)
    if why is not None:
        raise ValueError(f"append_memmap: {target} is not a saved tensordict: {why}.")
    parent = os.path.dirname(target)
    if fmt.not_a_save(parent) is None and _is_nested_level(parent, os.path.basename(target)):
        # a nested node of that save: growing it alone leaves the save's levels disagreeing
        raise ValueError(f"append_memmap: {target} lies inside the save {parent} (one of its nested levels): "
                         "append rows to that save as a whole.")
    return target


class _Growth:
    """What an append writes: ``rows`` new rows; ``leaves``: (leaf file in the save,
    bytes its meta.json declares, the new rows' tensor) per leaf. ``saved``: the levels
    of the save ``target``, through which its leaf files are looked at."""

    def __init__(self, target: str):
        self.saved = _Levels(target)
        self.rows: int | None = None
        # (file, declared bytes, rows, whether the file has other names: hard links, grown as a copy)
        self.leaves: list[tuple[str, int, torch.Tensor, bool]] = []


def _is_nested_level(parent: str, name: str) -> bool:
    """Whether the directory ``name`` in the save ``parent`` is one of its nested levels
    (a key its meta.json lists, or a tensorclass's tensordict), not a save of its own
    that was only written inside that directory."""
    if name == fmt.TENSORCLASS_CHILD:
        return True
    try:
        with open(os.path.join(parent, fmt.META), "rb") as file:
            meta = json.loads(file.read().decode("utf-8"))
    except (OSError, ValueError):
        return True  # (a parent save whose meta.json cannot be read now: taken as listing it)
    if not isinstance(meta, dict):
        return True
    return any(name in fmt.file_names(key, leaf=False) for key in fmt.node_entries(meta))


def _match(saved: Any, rows: Any, path: tuple, growth: _Growth) -> None:
    """Check that ``rows`` (at key ``path``) can be appended to the loaded ``saved``
    node, and record its leaves in ``growth`` (ValueError naming the key otherwise)."""
    where = key_repr(path) if path else "the root"
    kind = nodes.kind_for_object(saved)
    if kind.name in (nodes.LAZY, nodes.NON_TENSOR_STACK):
        what = "a lazy stack" if kind.name == nodes.LAZY else "a NonTensorStack"
        raise ValueError(f"append_memmap: {where} of the save is {what}, which cannot grow: save such a tree "
                         "as a whole instead.")
    try:
        other = nodes.kind_for_object(rows)
    except TypeError:
        other = None
    if other is not None and other.name == nodes.LAZY and kind.name == nodes.TENSORDICT:
        rows = rows.contiguous()  # rows of a lazy stack (tensordict 0.15.3 appends them too); keeps tensorclasses
        other = nodes.kind_for_object(rows)
    if other is None or other.name != kind.name or (kind.name == nodes.TENSORCLASS and type(rows) is not type(saved)):
        raise ValueError(f"append_memmap: {where} of the save is a {_class_name(saved, rows)}, the rows hold a "
                         f"{_class_name(rows, saved)} there.")
    if kind.name == nodes.TENSORCLASS:
        (_, inner), = kind.children(saved)
        (_, rows_inner), = other.children(rows)
        _match(inner, rows_inner, path, growth)
        return
    _match_batch(saved, rows, where, growth)
    saved_entries, rows_entries = dict(kind.entries(saved)), dict(other.entries(rows))
    if saved_entries.keys() != rows_entries.keys():
        missing, extra = saved_entries.keys() - rows_entries.keys(), rows_entries.keys() - saved_entries.keys()
        differ = [f"lack the keys {sorted(missing)}"] * bool(missing) + [f"hold {sorted(extra)}, which the save "
                                                                          "lacks"] * bool(extra)
        raise ValueError(f"append_memmap: the rows at {where} {' and '.join(differ)}: they must have the save's keys.")
    directory = kind.directory(saved)
    for key, value in saved_entries.items():
        if isinstance(value, torch.Tensor):
            _match_leaf(value, rows_entries[key], path + (key,), growth, directory)
        elif nodes.kind_for_object(value).name == nodes.NON_TENSOR_DATA:
            _match_value(value, rows_entries[key], path + (key,))
        else:
            _match(value, rows_entries[key], path + (key,), growth)


def _class_name(obj: Any, other: Any) -> str:
    """``obj``'s class name, with its module when ``other``'s has the same name (a
    tensordict.TensorDict given as rows of a shared_td save)."""
    cls, name = type(obj), type(obj).__name__
    return f"{cls.__module__}.{name}" if name == type(other).__name__ and cls is not type(other) else name


def _match_batch(saved: Any, rows: Any, where: str, growth: _Growth) -> None:
    if not saved.batch_size:
        raise ValueError(f"append_memmap: {where} of the save has no batch dimension to append rows along.")
    if len(rows.batch_size) != len(saved.batch_size) or rows.batch_size[1:] != saved.batch_size[1:]:
        raise ValueError(f"append_memmap: the rows at {where} have batch size {list(rows.batch_size)}, the save "
                         f"{list(saved.batch_size)}: they may differ in the first dimension only.")
    if growth.rows is None:
        growth.rows = rows.batch_size[0]


def _match_leaf(saved: torch.Tensor, rows: Any, path: tuple, growth: _Growth, node_directory: str) -> None:
    name = key_repr(path)
    if not isinstance(rows, torch.Tensor):
        raise ValueError(f"append_memmap: the entry {name} is a tensor in the save, a {type(rows).__name__} "
                         "in the rows.")
    if rows.is_nested or saved.is_nested:
        raise ValueError(f"append_memmap: the entry {name} is a nested tensor, which cannot grow.")
    if rows.dtype != saved.dtype or rows.shape[1:] != saved.shape[1:]:
        raise ValueError(f"append_memmap: the entry {name} is {saved.dtype} of shape {list(saved.shape)} in the "
                         f"save and {rows.dtype} of shape {list(rows.shape)} in the rows: the dtype and the shape "
                         "past the first dimension must be the same.")
    declared = saved.numel() * saved.element_size()
    if declared == 0:  # no file was written for it: the rows' bytes make a new one
        if rows.numel() == 0:
            return
        leaf_file, shared = fmt.file_names(path[-1], leaf=True)[0], False
    else:
        leaf_file, shared = _saved_leaf_file(growth.saved, node_directory, path, declared)
    growth.leaves.append((os.path.join(node_directory, leaf_file), declared, rows, shared))


def _saved_leaf_file(saved: _Levels, node_directory: str, path: tuple, declared: int) -> tuple[str, bool]:
    """The name of the file of the saved leaf ``path`` in ``node_directory`` (its robust
    name, else its legacy one, as the loader looks them up), and whether it has other
    names too (hard links: a `cp -al` copy, another key, the retired version of an
    earlier append that could not be removed): such a file is grown as a copy
    (:func:`_unshare`), never in place. A FormatError (a ValueError and the RuntimeError
    a load raises for a damaged save) naming the key when it is missing, not a regular
    file or shorter than the ``declared`` bytes (growing it would put the rows at the
    wrong place). ``saved``: the save's levels (looked at through them, as the loader
    does, so that a save nested past PATH_MAX grows too)."""
    for name in fmt.file_names(path[-1], leaf=True):
        file = os.path.join(node_directory, name)
        directory, _ = saved.leaf(os.path.relpath(file, saved.root))
        info = directory.lstat(name)
        if info is None:
            continue
        if not stat.S_ISREG(info.st_mode):
            raise FormatError(file, f"append_memmap: the file of the entry {key_repr(path)} is not a regular file: "
                                    "nothing changed")
        if info.st_size < declared:
            raise FormatError(file, f"append_memmap: the file of the entry {key_repr(path)} holds {info.st_size} "
                                    f"bytes and its {fmt.META} declares {declared}: the save is damaged, nothing "
                                    "changed")
        return name, info.st_nlink > 1
    raise FormatError(os.path.join(node_directory, fmt.META), f"append_memmap: the save lacks the file of the "
                      f"entry {key_repr(path)} in {node_directory}: it is damaged, nothing changed")


def _match_value(saved: Any, rows: Any, path: tuple) -> None:
    """A saved NonTensorData holds one value for every row: the rows' must be that value."""
    name = key_repr(path)
    kind = nodes.kind_for_object(rows) if not isinstance(rows, torch.Tensor) else None
    if kind is None or kind.name not in (nodes.NON_TENSOR_DATA, nodes.NON_TENSOR_STACK):
        raise ValueError(f"append_memmap: the entry {name} is a non-tensor value in the save, a "
                         f"{type(rows).__name__} in the rows.")
    # (a stack's values one per element: tolist() nests them, and a list value would be
    # taken apart with the nesting)
    values = [rows.data] if kind.name == nodes.NON_TENSOR_DATA else rows._flat_values()
    for value in values:
        if not same_value(value, saved.data):
            raise ValueError(f"append_memmap: the entry {name} holds {saved.data!r} for every row of the save and "
                             f"{value!r} in the rows: a saved non-tensor value cannot change (save the tree anew).")


def _mirror(source: str, staged: _Levels, rows: int) -> None:
    """``staged`` (the staging directory) made a copy of the save ``source`` of hard
    links, but for the meta.json of each TensorDict node, written with ``rows`` more
    rows. Every name is taken relative to its opened level, never as a whole path (a
    save nested past PATH_MAX has paths no system call takes)."""
    made = {"."}  # the levels made in the staging directory, each to be walked
    errors: list[OSError] = []  # (fwalk skips a level it cannot open or list, silently by default)
    # (closing: fwalk's descriptors are closed on an error too)
    with contextlib.closing(os.fwalk(source, onerror=errors.append)) as walk:
        for directory, subdirectories, names, fd in walk:
            relative = os.path.relpath(directory, source)
            made.discard(relative)
            into = staged.level(() if relative == "." else tuple(relative.split(os.sep)))
            here = files.Directory(fd, directory, "append rows")  # (fwalk's own descriptor: never closed here)
            for name in list(subdirectories):
                if here.is_symlink(name):  # (fwalk does not go in: linked, as a file)
                    subdirectories.remove(name)
                    names.append(name)
                else:
                    into.mkdir(name)
                    made.add(os.path.normpath(os.path.join(relative, name)))
            for name in names:
                grown = _grown_meta(here, rows) if name == fmt.META else None
                if grown is None:
                    _link(here, into, name)
                else:
                    into.write_new_file(name, grown)
    if made:  # (levels fwalk skipped: it could not open or list them, or they were swapped since listed)
        error = errors[0] if errors else OSError(errno.ESTALE, "it was replaced since it was listed")
        raise OSError(error.errno, f"append_memmap could not copy the levels {sorted(made)} of the save {source} "
                                   f"into its new version: {error.strerror}; nothing changed.")


def _grown_meta(directory: files.Directory, rows: int) -> bytes | None:
    """The meta.json in ``directory`` with ``rows`` more rows, for a TensorDict node
    (None: another node's, which records no batch size)."""
    raw = directory.read(fmt.META, limit=MAX_META_BYTES)
    document = json.loads(raw)  # (checked by the load that came before, under the same lock)
    if nodes.kind_for_type_string(document["_type"]).name != nodes.TENSORDICT:
        return None
    document["shape"][0] += rows
    for entry in fmt.node_entries(document).values():
        if "shape" in entry:  # a leaf (its first dim is the batch's first)
            entry["shape"][0] += rows
    return fmt.dumps(document, compact=b'", "' not in raw)


def _link(directory: files.Directory, into: files.Directory, name: str) -> None:
    """Hard-link the entry ``name`` of ``directory`` (a symlink itself) into ``into``."""
    try:
        os.link(name, name, src_dir_fd=directory.fd, dst_dir_fd=into.fd, follow_symlinks=False)
    except OSError as error:
        source = directory.join(name)
        if error.errno == errno.EXDEV:  # (a mount inside the save: its files are on another filesystem)
            raise OSError(error.errno, f"append_memmap links the saved files into the new version of the save, "
                                       f"and {source} is on another filesystem than the save's directory (a mount "
                                       "inside it). Nothing changed: keep a save on one filesystem.") from None
        raise OSError(error.errno, f"append_memmap links the saved files into the new version of the save, and "
                                   f"{source} could not be linked: {error.strerror}. Nothing changed; on a "
                                   "filesystem without hard links, load the save, concatenate the rows and "
                                   "save the result anew.") from None


def _is_live(target: str, staged_meta: Any) -> bool:
    """Whether the staged version (its meta.json ``staged_meta``) is the save at
    ``target`` now: an error raised after the swap (a RuntimeWarning made an error, a
    KeyboardInterrupt) must not cut the files its meta.json declares."""
    if staged_meta is None:
        return False
    try:
        return os.path.samestat(os.stat(os.path.join(target, fmt.META)), staged_meta)
    except OSError:
        return False


class _Levels:
    """The levels of the directory ``root`` (the save, or its staging copy), each opened
    once, one below the other, without following a symlink (a nested level of the save
    swapped for a symlink after the load, which refuses one, was mirrored as that
    symlink, and must not send the rows, or the cut of a failed append, into a file
    outside the save: a RuntimeError). :meth:`close` closes them (it may be called
    again)."""

    def __init__(self, root: str):
        self.root = root
        self.opened: dict[tuple, files.Directory] = {}

    def level(self, levels: tuple) -> files.Directory:
        """The opened directory of the names ``levels`` below the root. Only the levels
        above it stay open (the save is gone through in order): a save of many nested
        nodes must not hold a descriptor per node (past RLIMIT_NOFILE, often 1024, a
        save that memmap and load_memmap handle could not grow)."""
        for other in [opened for opened in self.opened if levels[:len(opened)] != opened]:
            self.opened.pop(other).close()
        if () not in self.opened:
            self.opened[()] = files.Directory.open(self.root, action="append rows")
        for depth in range(1, len(levels) + 1):
            if levels[:depth] not in self.opened:
                self.opened[levels[:depth]] = self.opened[levels[:depth - 1]].child(levels[depth - 1])
        return self.opened[levels]

    def leaf(self, relative: str) -> tuple[files.Directory, str]:
        """The opened directory of the leaf file ``relative`` (below the root), and its name."""
        *levels, name = relative.split(os.sep)
        return self.level(tuple(levels)), name

    def close(self) -> None:
        for directory in self.opened.values():
            directory.close()
        self.opened.clear()


def _unshare(staged: _Levels, relative: str, declared: int) -> None:
    """Replace the staged leaf file ``relative`` (a hard link to the saved file, which
    has other names) by a copy of its ``declared`` bytes, so that growing it changes no
    other name's file."""
    directory, name = staged.leaf(relative)
    source = directory.open_regular(name)  # (a FIFO or symlink put there meanwhile: refused)
    try:
        directory.unlink(name)
        copy = directory.open_file(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        try:
            done = 0
            while done < declared:
                sent = os.sendfile(copy, source, done, declared - done)
                if sent == 0:
                    raise ValueError(f"append_memmap: the leaf file {relative} was cut during the append: "
                                     "nothing changed.")
                done += sent
        finally:
            os.close(copy)
    finally:
        os.close(source)


def _shrink(staged: _Levels, grown: list[tuple[str, int]]) -> None:
    """After a failed append, cut the bytes it wrote past each leaf's declared size
    (best effort: the next append overwrites or cuts what is left)."""
    for relative, declared in grown:
        try:
            directory, name = staged.leaf(relative)
            fd = directory.open_regular(name, os.O_WRONLY)
        except (OSError, RuntimeError, ValueError):
            continue
        try:
            if os.fstat(fd).st_size > declared:
                os.ftruncate(fd, declared)
        except OSError:
            pass
        finally:
            os.close(fd)


def _grow(staged: _Levels, relative: str, declared: int, source: torch.Tensor, saved: str) -> None:
    """Write ``source``'s bytes into the staged leaf file ``relative`` (made from the
    ``saved`` file, which errors name) after its ``declared`` bytes (bytes past them,
    left by an append cut short, are overwritten or cut)."""
    data = source.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
    directory, name = staged.leaf(relative)
    if declared == 0 and not directory.exists(name):  # (an empty leaf's file: none was saved)
        os.close(directory.open_file(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL))
    try:
        fd, size = directory.open_regular_stat(name, os.O_WRONLY)  # (a FIFO, a symlink: refused)
    except PermissionError as error:  # (the staged name is gone once the call returns: name the saved one)
        raise PermissionError(error.errno, f"append_memmap: cannot write the leaf file {saved}: "
                              f"{os.strerror(error.errno)} (a read-only file or save: make it writable, e.g. "
                              "chmod u+w, or save the tree anew); nothing changed.") from None
    path = directory.join(name)
    try:
        if size.st_size < declared:  # (checked before, but a writer that takes no lock may have replaced it)
            raise ValueError(f"append_memmap: the leaf file {path} holds {size.st_size} bytes, fewer than the "
                             f"{declared} its {fmt.META} declares: the save changed during the append, nothing "
                             "changed.")
        pwrite_all(fd, data, declared, where=path)
        if size.st_size > declared + data.size:
            os.ftruncate(fd, declared + data.size)
    finally:
        os.close(fd)
