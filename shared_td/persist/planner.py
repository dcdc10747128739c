"""The plan step of the persistence engine (see persist/writer.py): walk a tree once and
decide, for every leaf, where its bytes go.

Every check (keys, paths inside the prefix, symlinks, existing files, files elsewhere,
files a leaf views that this write overwrites) happens here, before any byte is
written; a leaf already memory-mapped to its own file, the very file there now, is kept.
"""
from __future__ import annotations

import bisect
import errno
import os
import stat
from dataclasses import dataclass, field
from typing import Any

import torch

from shared_td.errors import ReadOnlyError
from shared_td.keys import encode_key, is_safe_legacy_name
from shared_td.memmap_tensor import MemoryMappedTensor
from shared_td.memmap_tensor.tensor import maps_file_at
from shared_td.persist import format as fmt
from shared_td.persist import nodes
from shared_td.storage import files
from shared_td.storage.files import FileBacking
from shared_td.storage.writing import not_regular_error

# tensordict's own words for a leaf that already has a file and is asked into another
# prefix: code written for tensordict matches this text (pytest.raises(match=...))
_HAS_FILE = "A filename was provided but the tensor already has a file associated"


@dataclass
class Options:
    """The parameters of one memmap call, checked."""

    prefix: str | None
    inplace: bool
    like: bool = False
    copy_existing: bool = False
    num_threads: int = 0
    existsok: bool = True
    robust_key: bool = True
    share_non_tensor: bool = False
    atomic_target: str | None = None  # with atomic=True: the prefix being replaced


# slots: a tree has a plan per leaf and per node; without a __dict__ each, a big tree
# allocates half the objects the garbage collector has to walk while the write runs.
@dataclass(slots=True)
class LeafPlan:
    key: str
    source: torch.Tensor
    path: str | None  # None: anonymous memory
    name: str = ""  # the file's name in its directory (with a path)
    keep: bool = False  # the source already is an MMT at ``path`` (kept by identity)
    replace: bool = False  # write a new file (inode) at ``path``: the old one's mappings keep its bytes
    offset: int = 0  # anonymous: byte offset in the tree's segment
    data: memoryview | None = None  # the bytes to write, when staged with other leaves'
    result: torch.Tensor | None = None


@dataclass(slots=True)
class NodePlan:
    obj: Any
    kind: nodes.NodeKind
    directory: str | None
    exists: bool = False  # the directory existed when the write was planned
    leaves: dict[str, LeafPlan] = field(default_factory=dict)
    children: dict[str, "NodePlan"] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)  # entry keys in insertion order
    stale: list[str] = field(default_factory=list)  # what an older save left, removed once in place
    premade: bool = False  # obj is a copy's value made and shared before the write (api)

    def walk(self):
        """Every node of the tree, children before their parent."""
        for child in self.children.values():
            yield from child.walk()
        yield self


class Planner:
    """Walks a tree once and checks every write before any is made."""

    def __init__(self, options: Options, *, fresh_root: bool = False):
        self.options = options
        self.fresh_root = fresh_root  # the prefix was just created empty (atomic staging)
        self.leaves: list[LeafPlan] = []
        self.root = os.path.abspath(options.prefix) if options.prefix is not None else None
        # (path, lstat) of the existing files this write overwrites in place
        self.overwritten: list[tuple[str, os.stat_result]] = []
        # memmap_ to a directory: id of each container planned -> its path (one at two
        # places of the tree would be adopted twice, its first place's files orphaned)
        self.placed: dict[int, tuple] | None = {} if options.inplace else None

    def plan(self, obj: Any) -> NodePlan:
        root = self._plan(obj, self.root, (), parent_exists=not self.fresh_root)
        if self.overwritten and not self.options.like:
            self._copy_sources_overwritten()
        return root

    def _copy_sources_overwritten(self) -> None:
        """Copy now the source of every leaf that views a file this write overwrites.

        A leaf may read the very file another leaf's bytes go to: two keys whose
        memory-mapped tensors were swapped, a key given another key's tensor, then
        ``memmap_(copy_existing=True)`` into their own directory. Unless it is read
        first, the other file may be written before it and the leaf would get the
        other's new bytes. (Small leaves are copied out before any write by the
        staging; bigger ones are read when their own file is written.)
        """
        candidates = []
        for leaf in self.leaves:
            source = leaf.source
            if leaf.keep or leaf.path is None or not source.is_cpu or not source.numel() \
                    or source.layout is not torch.strided:  # (no storage: the write says so)
                continue
            storage = source.untyped_storage()
            # memory of torch's own allocator (the resizable kind) maps no file: a tree
            # built in memory costs no look-up (0.1 us a leaf)
            if not storage.resizable():
                candidates.append((leaf, storage))
        if not candidates:
            return
        paths = {path for path, _ in self.overwritten}
        # every mapping of those files in this process, whoever made it: a plain view
        # outlives the FileBacking cached for it, and torch.from_file, numpy.memmap or a
        # hard link map them without any; by inode, so another name of a file counts
        mapped = _mapped_ranges({(st.st_dev, st.st_ino) for _, st in self.overwritten})
        if mapped is None:  # no /proc/self/maps: this process's cached mappings only
            mapped = sorted(_range_of(backing.storage) for _, st in self.overwritten
                            if (backing := files.mapped_backing(st)) is not None
                            and backing.storage is not None)
        starts = [start for start, _ in mapped]
        for leaf, storage in candidates:
            backing = getattr(leaf.source, "_backing", None)
            # by path too: a copy-on-write mapping of the file reads its new bytes where
            # it was not written to; by address: any view of a mapping (a plain tensor
            # too) lies inside the mapping
            if (isinstance(backing, FileBacking) and backing.path in paths) or \
                    (mapped and _overlaps(_range_of(storage), mapped, starts)):
                leaf.source = leaf.source.clone()

    def _plan(self, obj: Any, directory: str | None, path: tuple, *, parent_exists: bool) -> NodePlan:
        kind = nodes.kind_for_object(obj)
        if self.placed is not None:
            self._check_in_place(obj, kind, directory, path)
        # Inside a directory that does not exist yet nothing exists either: a new save
        # skips every per-file check (they cost a system call per file).
        exists = directory is not None and parent_exists and _lstat(directory, path) is not None
        if exists and directory != self.root and os.path.islink(directory):
            raise RuntimeError(
                f"Refusing to write a memory-mapped TensorDict through symlink {directory} "
                f"(key {path})."
            )
        node = NodePlan(obj, kind, directory, exists=exists)
        if exists:
            node.stale = _stale_entries(kind, obj, directory, path)
        # the key path that messages name: a tensorclass's tensordict holds its fields
        # under the tensorclass's own key (its directory name is no key of the user's)
        inner = (lambda name: path) if kind.name == nodes.TENSORCLASS else (lambda name: path + (name,))
        for name, child in kind.children(obj):
            node.children[name] = self._plan(
                child, _join(directory, name), inner(name), parent_exists=exists
            )
        self._plan_entries(node, kind.entries(obj), directory, path)
        return node

    def _check_in_place(self, obj: Any, kind: nodes.NodeKind, directory: str | None, path: tuple) -> None:
        """memmap_: RuntimeError, before anything is written, for a node it cannot make
        memory-mapped in place: one in torch shared memory (share_memory_() of it or of
        a tree it was in; processes that received it would no longer see its writes), or
        a container found at a second place of a tree saved to a directory."""
        # every tensordict, and a root of any kind but a lazy stack (its members are
        # checked: its is_shared() raises for a mix, naming neither memmap nor a fix) or
        # a non-tensor value (a shared one is memory-mapped and stays shared, as nested
        # and as in tensordict 0.15.3)
        checked = kind.name == nodes.TENSORDICT or (
            not path and kind.name != nodes.LAZY and kind.name not in VALUE_KINDS)
        if checked and _in_shared_memory(obj):
            where = "this tensordict" if not path else f"the tensordict at {path}"
            raise RuntimeError(
                f"memmap and shared memory are mutually exclusive features: {where} is in "
                "shared memory (share_memory_()). Use memmap() to make a memory-mapped copy, "
                f"or unlock_() {where} first."
            )
        if directory is None:
            return  # anonymous memory: the two places stay one object (as in tensordict)
        # a non-tensor value too: it records one directory, so a set_ rewrote the files of
        # one place only and a reload gave two values (tensordict 0.15.3 does the same)
        first = self.placed.setdefault(id(obj), path)
        if first is not path:
            raise RuntimeError(
                f"memmap_: the same {type(obj).__name__} is at {first} and at {path} of this "
                "tree; written in place, each place would get its own files and a write through "
                "one would not reach the other's. Nothing was written. clone() one of them, or "
                "use memmap() for a copy (each place then is a copy of its own)."
            )

    def _plan_entries(self, node: NodePlan, entries, directory: str | None, path: tuple) -> None:
        used_names = {fmt.META}
        for key, value in entries:
            node.order.append(key)
            target = name = None  # anonymous memory: no file, so no file name to check
            if directory is not None:
                name = self._file_name(key, path, leaf=isinstance(value, torch.Tensor))
                if name in used_names:
                    raise ValueError(
                        f"Key {path + (key,)} would be written to {name!r}, which another "
                        "entry of the same tensordict (or meta.json) uses: rename one of them."
                    )
                used_names.add(name)
                target = _join(directory, name)
            if isinstance(value, torch.Tensor):
                node.leaves[key] = self._plan_leaf(key, value, target, name, path, node.exists)
            else:
                node.children[key] = self._plan(
                    value, target, path + (key,), parent_exists=node.exists
                )

    def _file_name(self, key: str, path: tuple, *, leaf: bool) -> str:
        if self.options.robust_key:
            name = encode_key(key)
        else:
            if not is_safe_legacy_name(key, directory=not leaf):
                raise ValueError(
                    f"Key {path + (key,)} is not one file name on this system (it holds "
                    "'/' or NUL, or is ''/'.'/'..' for a nested tensordict), so "
                    "robust_key=False cannot write it inside the prefix: use "
                    "robust_key=True (the default), which encodes it."
                )
            name = key
        if leaf:
            name += fmt.LEAF_SUFFIX  # so a leaf "." is the file "..memmap", inside
        if os.sep in name or name in ("", ".", ".."):  # never reached by the rules above
            raise ValueError(f"Key {path + (key,)} would be written outside the prefix.")
        return name

    def _plan_leaf(
        self, key: str, tensor: torch.Tensor, target: str | None, name: str | None, path: tuple,
        in_existing: bool,
    ) -> LeafPlan:
        if tensor.requires_grad:
            tensor = tensor.detach()
        if tensor.is_nested:
            raise NotImplementedError(f"Key {path + (key,)}: nested tensors cannot be memory-mapped yet.")
        leaf = LeafPlan(key, tensor, target, name)
        if type(tensor) is torch.Tensor:  # the common case: a plain tensor, always written
            if target is not None and in_existing:
                self._check_existing(leaf, path)
            self.leaves.append(leaf)
            return leaf
        backing = getattr(tensor, "_backing", None) if isinstance(tensor, MemoryMappedTensor) else None
        if isinstance(backing, FileBacking) and not backing.shared and not self.options.like:
            # a private (copy-on-write) mapping: its bytes live in this process only, so
            # it is never kept as if memory-mapped; it is copied, as a plain tensor is
            if target is not None and backing.path == target:
                if backing.read_only:
                    raise ReadOnlyError(
                        f"Key {path + (key,)} cannot be memory-mapped to its own file "
                        f"{target}: that file was loaded read-only because "
                        f"{backing.read_only}. Write the tensordict to a new prefix "
                        "(memmap_(new_prefix)), take a writable copy in memory with "
                        ".clone(), or load the save from a place this process may write."
                    )
                leaf.source = tensor.clone()  # the write overwrites the bytes it maps
        elif isinstance(backing, FileBacking) and not self.options.like:  # like copies no data
            if target is not None and backing.path == target and maps_file_at(backing, target):
                if tensor.storage_offset() == 0 and tensor.is_contiguous():
                    leaf.keep = True
                else:
                    # a view (slice, stride) of the very file it is written to: keeping it
                    # would record a shape that the file's leading bytes do not hold, so
                    # it is written; copied out first, as the write overlaps its bytes,
                    # into a new file: the tensor it views (td in td[1].memmap_(td's
                    # directory)) keeps the old one, and its bytes (written over, they
                    # read as the view's)
                    leaf.source, leaf.replace = tensor.clone(), True
            elif backing.path == target:
                # its file was deleted or replaced since it was mapped (the directory
                # removed, another process's atomic rewrite): written again, else the
                # meta.json would name a file that holds something else, or nothing
                pass
            elif not self.options.copy_existing and target is not None:
                if self.options.atomic_target is not None:
                    raise RuntimeError(
                        f"{_HAS_FILE} (key {path + (key,)} is already memory-mapped to "
                        f"{backing.path}); atomic=True writes a new copy of every leaf (the "
                        f"new version of {self.options.atomic_target}). Pass copy_existing=True."
                    )
                raise RuntimeError(
                    f"{_HAS_FILE} (key {path + (key,)} is already memory-mapped to "
                    f"{backing.path}); writing it to {target} would copy it. Pass "
                    "copy_existing=True to copy it, or write to its own prefix."
                )
        elif target is None and isinstance(tensor, MemoryMappedTensor) and backing is not None:
            leaf.keep = not self.options.like  # already anonymous shared memory
        if target is not None and not leaf.keep and in_existing:
            self._check_existing(leaf, path)
        self.leaves.append(leaf)
        return leaf

    def _check_existing(self, leaf: LeafPlan, path: tuple) -> None:
        """What is at the leaf's place must take its bytes. The write overwrites an
        existing file in place, one leaf after the other: a file there that refuses the
        write (a directory, a FIFO, a file this process may not write) is refused here,
        before the first leaf's old bytes are overwritten (found by the write, it failed
        it with the earlier leaves' files holding the new bytes under the old meta.json)."""
        key, target = leaf.key, leaf.path
        st = _lstat(target, path + (key,))
        if st is None:
            return  # nothing there (or no directory there: the write will say so)
        if stat.S_ISLNK(st.st_mode):
            raise RuntimeError(f"Refusing to write memory-mapped tensor through symlink {target}.")
        if not self.options.existsok:
            raise RuntimeError(
                f"The file {target} already exists (key {path + (key,)}); pass "
                "existsok=True to overwrite it."
            )
        if leaf.source.numel():  # (an empty leaf gets no file: what is there stays untouched)
            if stat.S_ISDIR(st.st_mode):
                raise leaf_is_a_directory(key, target)
            # a "like" leaf and a view of the very file get new files: the old one is unlinked
            overwritten_in_place = not (self.options.like or leaf.replace)
            if overwritten_in_place and not stat.S_ISREG(st.st_mode):
                raise not_regular_error(errno.EINVAL, f"file {target}", st.st_mode)
            if overwritten_in_place and not os.access(target, os.W_OK, effective_ids=True, follow_symlinks=False):
                raise PermissionError(errno.EACCES, (
                    f"Cannot write key {key!r} to {target}: this process may not write that file (its "
                    "mode, a read-only file system or an immutable file). Nothing was written: make it "
                    "writable, or write with atomic=True (a new version of the save, made beside it, "
                    "replaces it)."))
        self.overwritten.append((target, st))


def _lstat(place: str, key: tuple) -> os.stat_result | None:
    """``os.lstat`` of the place of ``key`` in an existing directory; None if nothing is
    there. A place past PATH_MAX, which no path reaches (ENAMETOOLONG), is refused:
    taken as missing, an existing deep level of an in-place rewrite was planned as new,
    and the write failed once the leaves above it were overwritten."""
    try:
        return os.lstat(place)
    except OSError as error:
        if error.errno != errno.ENAMETOOLONG:
            return None
    raise OSError(errno.ENAMETOOLONG, (
        f"Cannot rewrite key {key} in place: its place ({len(os.fsencode(place))} bytes of path) lies past "
        "PATH_MAX, where an in-place rewrite cannot look. Nothing was written: rewrite the save with "
        "atomic=True (a new version made beside it, which works there) or write to a new prefix."))


def leaf_is_a_directory(key: str, target: str) -> IsADirectoryError:
    """The error for a leaf whose file would go where a directory is."""
    return IsADirectoryError(errno.EISDIR, f"Cannot write key {key!r} to {target}: it is a directory, not a file. "
                                           "Remove that directory (or write to another prefix) and write again.")


# the kinds of non-tensor values: views of one value (one shared cell, or the payload
# of a memory-mapped entry: _same_value) may sit at several places, which its own
# writes handle; one value object at two places of a directory save is refused
VALUE_KINDS = (nodes.NON_TENSOR_DATA, nodes.NON_TENSOR_STACK)


def _in_shared_memory(obj: Any) -> bool:
    """Whether share_memory_() moved ``obj``'s leaves to shared memory. A tensordict on a
    CUDA device counts as shared (``is_shared()``) without that, and memmap_ copies its
    leaves to the CPU as for any other (tensordict checks the same mark)."""
    device = obj.device
    return obj.is_shared() and not (device is not None and device.type == "cuda")


def _stale_entries(kind: nodes.NodeKind, obj: Any, directory: str, path: tuple) -> list[str]:
    """The entries of ``directory`` that a load would read as children of ``obj``
    although this write makes none such (the members of a longer lazy stack saved there
    before), which the write removes once its files are in place. RuntimeError, before
    anything is written, for one that is not part of an older save there: the user's
    own directory or file named so (a save's ``2/`` removed a directory of results in an
    experiment folder; kept, it would be read as a member and break the load)."""
    stale = kind.stale_children(obj, lambda name: os.path.lexists(_join(directory, name)))
    if not stale:
        return stale
    not_a_save = fmt.not_a_save(directory)
    for name in stale:
        entry = _join(directory, name)
        if not_a_save is not None:
            why = f"{directory} is not a save: {not_a_save}"
        elif os.path.islink(entry):
            why = f"{entry} is a symlink"
        else:
            why = fmt.not_a_save(entry)
            why = why and f"{entry} is not a save: {why}"
        if why is not None:
            where = f" (key {path})" if path else ""
            raise RuntimeError(
                f"Refusing to write a memory-mapped tensordict at {directory}{where}: it holds {name!r}, "
                f"which a load would read as a member of this stack of {len(kind.children(obj))}, and which is "
                f"not part of an earlier save there ({why}), so it is not removed. Nothing was written. Move "
                "it away, or write to another prefix."
            )
    return stale


def _mapped_ranges(inodes: set[tuple[int, int]]) -> list[tuple[int, int]] | None:
    """The sorted address ranges where this process maps the files ``inodes``
    (``(st_dev, st_ino)`` each), read from /proc/self/maps; None where that cannot be
    read (not Linux). One read for the whole write."""
    try:
        with open("/proc/self/maps", "rb") as maps:
            lines = maps.read().splitlines()
    except OSError:
        return None
    numbers = {str(ino).encode() for _, ino in inodes}
    ranges = []
    for line in lines:
        # "start-end perms offset major:minor inode path": the inode is compared first,
        # as bytes, so the lines of other mappings cost one split each
        fields = line.split(None, 5)
        if len(fields) < 5 or fields[4] not in numbers:
            continue
        major, minor = fields[3].split(b":")
        if (os.makedev(int(major, 16), int(minor, 16)), int(fields[4])) in inodes:
            start, end = fields[0].split(b"-")
            ranges.append((int(start, 16), int(end, 16)))
    ranges.sort()
    return ranges


def _range_of(storage: Any) -> tuple[int, int]:
    start = storage.data_ptr()
    return start, start + storage.nbytes()


def _overlaps(span: tuple[int, int], ranges: list[tuple[int, int]], starts: list[int]) -> bool:
    """Whether ``span`` meets one of the sorted, disjoint ``ranges`` (``starts``: theirs)."""
    start, end = span
    index = bisect.bisect_right(starts, start) - 1  # the last range starting at or before it
    if index >= 0 and ranges[index][1] > start:
        return True
    return index + 1 < len(ranges) and ranges[index + 1][0] < end


def _join(directory: str | None, name: str) -> str | None:
    """os.path.join for an absolute ``directory`` and one checked file name (a third
    of the planning of a big tree was os.path.join's generality)."""
    if directory is None:
        return None
    return directory + name if directory.endswith(os.sep) else directory + os.sep + name
