"""The persistence engine: plan, write, commit (memmap_, memmap, memmap_like).

* **plan** walks the tree once and decides, for every leaf, where its bytes go; every
  check (keys, paths inside the prefix, symlinks, existing files, files elsewhere)
  happens here, before any byte is written.
* **write** copies the leaves: into files with ``pwrite`` (big leaves on
  ``num_threads`` threads, one file each), or into ONE anonymous segment for the whole tree
  (so file descriptors do not grow with the number of leaves). Small leaves are copied
  together by one torch call (into their views of the segment, or into one buffer whose
  slices are then written to their files): per-leaf torch calls cost more than the
  bytes of a small leaf. A meta.json is built once for nodes that are alike. A failure
  removes the files this write created and re-raises; the tensordict is untouched.
  Every file and directory below the prefix is reached from the prefix's descriptor,
  one name at a time, never through a symlink: what the plan checked by path is not
  trusted to still hold when the bytes go out (another process may have swapped a
  directory since).
* **commit** writes every meta.json (children first, the root's last, each through a
  rename) and only then puts the new leaves into the tensordict (or a new one).
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from shared_td.errors import ReadOnlyError
from shared_td.keys import encode_key, is_safe_legacy_name
from shared_td.memmap_tensor import MemoryMappedTensor
from shared_td.persist import format as fmt
from shared_td.persist import nodes
from shared_td.persist.packing import copy_all, leaf_nbytes, packed_layout, packed_views, stage_small_leaves
from shared_td.storage import files
from shared_td.storage.anonymous import Segment, align
from shared_td.storage.files import Directory, FileBacking
from shared_td.storage.removal import remove_tree

# With num_threads > 1, leaves at least this big are written by the pool, one leaf per
# task: pwrite releases the GIL, and distinct files do not share an inode lock. One leaf
# is never split between threads: writes into one file take turns on its inode lock, so
# splitting only added overhead (measured ~15% slower for a 256 MiB leaf on ext4).
# Smaller leaves are written by the calling thread: a hop to the pool costs more.
_POOL_LEAF_BYTES = 1 << 20
# Existing directories a rewrite keeps open from their files' staging to their renaming
# (a second open each costs ~4 us); more are opened again, so descriptors stay bounded.
_KEPT_DIRECTORIES = 256


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

    def plan(self, obj: Any) -> NodePlan:
        return self._plan(obj, self.root, (), parent_exists=not self.fresh_root)

    def _plan(self, obj: Any, directory: str | None, path: tuple, *, parent_exists: bool) -> NodePlan:
        kind = nodes.kind_for_object(obj)
        # Inside a directory that does not exist yet nothing exists either: a new save
        # skips every per-file check (they cost a system call per file).
        exists = directory is not None and parent_exists and os.path.lexists(directory)
        if exists and directory != self.root and os.path.islink(directory):
            raise RuntimeError(
                f"Refusing to write a memory-mapped TensorDict through symlink {directory} "
                f"(key {path})."
            )
        node = NodePlan(obj, kind, directory, exists=exists)
        for name, child in kind.children(obj):
            node.children[name] = self._plan(
                child, _join(directory, name), path + (name,), parent_exists=exists
            )
        self._plan_entries(node, kind.entries(obj), directory, path)
        return node

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
                self._check_existing(key, target, path)
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
            if target is not None and backing.path == target:
                if tensor.storage_offset() == 0 and tensor.is_contiguous():
                    leaf.keep = True
                else:
                    # a view (slice, stride) of the very file it is written to: keeping it
                    # would record a shape that the file's leading bytes do not hold, so
                    # it is written; copied out first, as the write overlaps its bytes
                    leaf.source = tensor.clone()
            elif not self.options.copy_existing and target is not None:
                if self.options.atomic_target is not None:
                    raise RuntimeError(
                        f"Key {path + (key,)} is already memory-mapped to {backing.path}; "
                        "atomic=True writes a new copy of every leaf (the new version of "
                        f"{self.options.atomic_target}). Pass copy_existing=True."
                    )
                raise RuntimeError(
                    f"Key {path + (key,)} is already memory-mapped to {backing.path}; "
                    f"writing it to {target} would copy it. Pass copy_existing=True to "
                    "copy it, or write to its own prefix."
                )
        elif target is None and isinstance(tensor, MemoryMappedTensor) and backing is not None:
            leaf.keep = not self.options.like  # already anonymous shared memory
        if target is not None and not leaf.keep and in_existing:
            self._check_existing(key, target, path)
        self.leaves.append(leaf)
        return leaf

    def _check_existing(self, key: str, target: str, path: tuple) -> None:
        if os.path.islink(target):
            raise RuntimeError(f"Refusing to write memory-mapped tensor through symlink {target}.")
        if not self.options.existsok and os.path.lexists(target):
            raise RuntimeError(
                f"The file {target} already exists (key {path + (key,)}); pass "
                "existsok=True to overwrite it."
            )


def _join(directory: str | None, name: str) -> str | None:
    """os.path.join for an absolute ``directory`` and one checked file name (a third
    of the planning of a big tree was os.path.join's generality)."""
    if directory is None:
        return None
    return directory + name if directory.endswith(os.sep) else directory + os.sep + name


# ------------------------------------------------------------------------------ write
def write_tree(root: NodePlan, leaves: list[LeafPlan], options: Options, *, clean_up: bool = True) -> None:
    """Write the leaves and every meta.json; on failure remove what this write created
    (``clean_up=False``: the caller removes the whole root, as an atomic write's staging
    directory does with the descriptors it reserved for that).

    Every directory below the prefix is made with ``mkdirat`` and opened with
    ``O_NOFOLLOW`` relative to its parent's descriptor, every file with ``openat`` in
    its directory: another process that swaps directories of the prefix, or puts
    symlinks in their place, gets a refusal, never a write outside the prefix. One
    walk does it all, so only the directories from the root to the node being written
    are open at a time, and each is opened once.

    Every meta.json is built (and every pickle made) before the first byte is written,
    so an unpicklable value writes nothing. A node's files come after its children's,
    the root's after every leaf. In a directory this write created they are written
    directly; where files may exist, under temporary names, renamed into place only
    when every node is written: a failure (a full disk) leaves every old meta.json as
    it was, and no reader ever sees a half-written one.
    """
    anonymous = [leaf for leaf in leaves if leaf.path is None and not leaf.keep]
    if anonymous:
        _write_anonymous(anonymous, options)
    for leaf in leaves:
        if leaf.keep:
            leaf.result = leaf.source
    if root.directory is None:
        return  # anonymous memory only: no file, no meta.json
    if not options.like:
        stage_small_leaves([leaf for leaf in leaves if not leaf.keep])
    built: dict = {}
    documents = {id(node): node_files(node, built) for node in root.walk()}
    pool = ThreadPoolExecutor(options.num_threads) if options.num_threads > 1 else None
    writer = _TreeWriter(options, pool, documents)
    directory = Directory.open(root.directory, create=not root.exists)
    try:
        writer.write(root, directory)
        if root.exists:
            writer.put_in_place(root, directory)
    except BaseException as error:
        writer.close_kept()
        if clean_up:
            writer.remove_what_was_made(root, directory, error)
        directory.close()
        if clean_up and not root.exists:  # the whole prefix is this write's
            _note_failure(error, root.directory, remove_tree, root.directory)
        raise
    finally:
        writer.close_kept()
        if pool is not None:
            pool.shutdown()
    directory.close()


class _TreeWriter:
    """Writes the files of a tree, node by node, and knows what it created.

    With a pool, leaves of at least ``_POOL_LEAF_BYTES`` are written by its threads:
    the calling thread opens the file (in its directory) and hands the descriptor
    over; at most two per thread wait, so descriptors stay few.
    """

    def __init__(self, options: Options, pool: ThreadPoolExecutor | None, documents: dict):
        self.options = options
        self.pool = pool
        self.documents = documents  # node id -> (meta.json bytes, side files)
        self.slots = threading.BoundedSemaphore(2 * options.num_threads) if pool else None
        self.futures: list = []  # (leaf, future) of every leaf handed to the pool
        self.made_directories: set[int] = set()  # id() of the nodes whose directory this made
        self.made_files: dict[int, list[str]] = {}  # node id -> names of the files this made
        self.staged: dict[int, list[tuple[str, str]]] = {}  # node id -> (temporary, final)
        self.kept: dict[int, Directory] = {}  # node id -> its existing directory, still open
        self.shapes: dict = {}  # one torch.Size per shape of the leaves (MMT._wrap_views)
        self.empty_of: dict = {}  # dtype -> an empty tensor of it

    def close_kept(self) -> None:
        for opened in self.kept.values():
            opened.close()
        self.kept.clear()

    def write(self, root: NodePlan, directory: Directory) -> None:
        """Write every file below ``root``; raise the first error once all writes
        ended (so that the files made are all known, for the clean-up)."""
        try:
            self._write_node(root, directory, root=True)
        except BaseException:
            for _, future in self.futures:
                future.exception()  # wait; the first error is the one raised
            raise

    def _write_node(self, node: NodePlan, directory: Directory, root: bool = False) -> None:
        for leaf in node.leaves.values():
            if leaf.path is not None and not leaf.keep:
                self._write_leaf(leaf, node, directory)
        for child in node.children.values():
            name = os.path.basename(child.directory)
            if not child.exists:
                directory.mkdir(name)
                self.made_directories.add(id(child))
            opened = directory.child(name)
            try:
                self._write_node(child, opened)
            finally:
                if child.exists and len(self.kept) < _KEPT_DIRECTORIES:
                    self.kept[id(child)] = opened  # for put_in_place, without a new open
                else:
                    opened.close()
        if root:
            # The root's meta.json, which readers open first, comes after every byte
            # of the tree. (Other nodes' files need not wait for their leaves: a new
            # directory is named by no meta.json before the root's, and files in an
            # existing one are renamed into place only at the end.)
            for leaf, future in self.futures:
                leaf.result = future.result()
        self.staged[id(node)] = _stage_node_files(directory, node.kind, node.exists, self.documents[id(node)])

    def _write_leaf(self, leaf: LeafPlan, node: NodePlan, directory: Directory) -> None:
        options, source, name = self.options, leaf.source, leaf.name
        if leaf.data is None:
            source = source.cpu()
            nbytes = leaf_nbytes(source)
        else:
            nbytes = len(leaf.data)
        if nbytes == 0:
            files.check_new_empty_file(directory, name, existsok=options.existsok)
            leaf.result = MemoryMappedTensor._empty_leaf(
                FileBacking(leaf.path, None, 0, True), source.dtype, source.shape
            )
            return
        if options.like and directory.exists(name):
            # a "like" file must read as zeros: a new file replaces the old one, whose
            # mappings (maybe the source's own) keep the old bytes; nothing is truncated
            directory.unlink(name)
        fd, is_new = files.reserve_file(directory, name, existsok=options.existsok)
        if is_new:
            self.made_files.setdefault(id(node), []).append(name)
        if self.pool is None or nbytes < _POOL_LEAF_BYTES:
            leaf.result = self._fill(leaf, fd, source, is_new)
            return
        try:
            self.slots.acquire()
            future = self.pool.submit(self._fill, leaf, fd, source, is_new, pooled=True)
        except BaseException:
            os.close(fd)
            raise
        self.futures.append((leaf, future))

    def _fill(self, leaf: LeafPlan, fd: int, source: torch.Tensor, created: bool,
              pooled: bool = False) -> torch.Tensor:
        """Write (or reserve) the bytes of ``leaf`` into ``fd`` (``created``: a new
        file), map it, close ``fd``."""
        try:
            if self.options.like:
                files.reserve_space(fd, leaf_nbytes(source), leaf.path)
            else:
                data = files.tensor_bytes(source) if leaf.data is None else leaf.data
                files.pwrite_all(fd, data, 0, where=f"file {leaf.path}")
            backing = files.backing_from_fd(leaf.path, fd, created=created)
        finally:
            os.close(fd)
            if pooled:
                self.slots.release()
        # the file holds the whole leaf from byte 0 (written or reserved just now):
        # nothing for _from_backing to check
        dtype = source.dtype
        empty = self.empty_of.get(dtype)
        if empty is None:  # new() of an empty tensor of the dtype: the cheapest new tensor
            empty = self.empty_of[dtype] = torch.empty(0, dtype=dtype)
        view = empty.new().set_(backing.storage, 0, source.shape)
        return MemoryMappedTensor._wrap_views(backing, [view], self.shapes)[0]

    def put_in_place(self, node: NodePlan, directory: Directory) -> None:
        """Rename the staged files of ``node`` and of the existing directories below it
        over the old ones, children first."""
        for child in node.children.values():
            if child.exists:
                opened = self.kept.pop(id(child), None) or directory.child(os.path.basename(child.directory))
                with opened:
                    self.put_in_place(child, opened)
        _put_in_place(directory, node.kind, self.documents[id(node)], self.staged[id(node)])

    def remove_what_was_made(self, node: NodePlan, directory: Directory, error: BaseException) -> None:
        """Remove the files, temporaries and directories this write made after ``error``;
        what cannot be removed is named in a note on it (a directory swapped for a
        symlink meanwhile is left alone, never followed)."""
        for name in self.made_files.get(id(node), ()):
            _note_failure(error, directory.join(name), directory.unlink, name)
        for temporary, _ in self.staged.get(id(node), ()):
            _note_failure(error, directory.join(temporary), directory.unlink, temporary)
        for child in node.children.values():
            name = os.path.basename(child.directory)
            if id(child) in self.made_directories:
                # it holds only what this write put there
                _note_failure(error, directory.join(name), directory.remove_tree, name)
            elif child.exists:
                try:
                    with directory.child(name) as opened:
                        self.remove_what_was_made(child, opened, error)
                except (OSError, RuntimeError) as failure:
                    error.add_note(f"What this write made in {directory.join(name)} was not removed: {failure}")


def _note_failure(error: BaseException, shown: str, remove, *args) -> None:
    """``remove(*args)``; a failure becomes a note on ``error`` naming ``shown``."""
    try:
        remove(*args)
    except OSError as failure:
        error.add_note(f"{shown}, written before this error, could not be removed: {failure}")


def _write_anonymous(leaves: list[LeafPlan], options: Options) -> None:
    """Pack all anonymous leaves of the tree into one segment (one descriptor).

    The layout is :func:`packed_layout`'s. Each small leaf's result is a view of the
    segment made first, and all are filled by one copy (:func:`copy_all`): per-leaf
    work dominated a tree of many small leaves. Big leaves are written one by one with
    ``pwrite`` (no first-touch faults through the fresh mapping).
    """
    sources = [leaf.source for leaf in leaves]
    offsets, small, total = packed_layout(sources)
    segment = Segment.create(align(total)) if total else None
    if small:
        views = packed_views(segment.storage, sources, offsets, small)
        if not options.like:
            copy_all(views, [sources[i] for i in small])
        for i, result in zip(small, MemoryMappedTensor._wrap_views(segment, views)):
            leaves[i].result = result
    for leaf, offset in zip(leaves, offsets):
        leaf.offset = offset
        if leaf.result is not None:
            continue
        source = leaf.source
        if source.numel() == 0:
            leaf.result = MemoryMappedTensor.empty(source.shape, dtype=source.dtype)
            continue
        if not options.like:
            segment.write(offset, files.tensor_bytes(source.cpu()))
        leaf.result = MemoryMappedTensor._from_backing(segment, offset, source.dtype, source.shape)


# ----------------------------------------------------------------------------- commit
def _stage_node_files(directory: Directory, kind: nodes.NodeKind, existed: bool, built: tuple) -> list[tuple[str, str]]:
    """Write one node's ``built`` files (``(meta.json bytes, side files)``) into its
    directory: directly in a new one, else as temporaries, returned as
    ``(temporary, final name)`` for :func:`_put_in_place`. On failure none is left."""
    document, side = built
    staged: list[tuple[str, str]] = []
    try:
        for name, data in [*side.items(), (fmt.META, document)]:
            if existed:
                staged.append((fmt.write_temporary(directory, name, data), name))
            else:
                directory.write_new_file(name, data)
    except BaseException:
        for temporary, _ in staged:
            directory.unlink(temporary)
        raise
    return staged


def _put_in_place(directory: Directory, kind: nodes.NodeKind, built: tuple, staged: list[tuple[str, str]]) -> None:
    """Rename the staged files of one node over the old ones; then remove the pickle
    side files the node no longer needs."""
    for temporary, final in staged:
        directory.replace(temporary, final)
    if staged:  # the node existed: old side files may remain
        for name in kind.side_files:
            if name not in built[1]:
                directory.unlink(name)


def node_files(node: NodePlan, built: dict | None = None) -> tuple[bytes, dict[str, bytes]]:
    """The meta.json bytes of a planned node and its side files (pickles), built from
    the plan before any byte is written (an unpicklable value writes nothing).

    ``built`` (a dict the caller keeps for one tree) holds the documents made so far, by
    what they are made of: a node whose kind has a ``metadata_key`` and whose entries
    are alike (keys, shapes, dtypes, child types) gets the same bytes without building
    them again (building one cost more than writing it)."""
    if built is not None:
        base = node.kind.metadata_key(node.obj)
        if base is not None:
            key = (node.kind, base, _entry_signature(node))
            document = built.get(key)
            if document is None:
                document = built[key] = nodes.node_document(node.obj, node.kind, _entries(node))
            return document
    return nodes.node_document(node.obj, node.kind, _entries(node))


def _entry_signature(node: NodePlan) -> tuple:
    """What :func:`_entries` records of a node's entries, as a key."""
    leaves, children = node.leaves, node.children
    return tuple(
        (key, leaf.source.shape, leaf.source.dtype) if (leaf := leaves.get(key)) is not None
        else (key, (child := children[key]).kind.child_type_name(child.obj))
        for key in node.order
    )


def _entries(node: NodePlan) -> tuple:
    """The metadata of a node's keyed entries, as they will be written: built from the
    sources (shape and dtype) before any byte is written."""
    return tuple(
        fmt.LeafMeta.of(key, node.leaves[key].source) if key in node.leaves
        else fmt.ChildMeta(key, node.children[key].kind.child_type_name(node.children[key].obj))
        for key in node.order
    )


def rewrite_node(obj: Any, directory: str) -> None:
    """Rewrite the files of ``obj``'s existing node ``directory`` from what ``obj``
    holds now (after make_memmap added an entry, or an in-place write of non-tensor
    data): through a temporary each, renamed over the old file; a failure leaves the
    old files and no temporary."""
    kind = nodes.kind_for_object(obj)
    entries = tuple(
        fmt.LeafMeta.of(key, value) if isinstance(value, torch.Tensor)
        else fmt.ChildMeta(key, nodes.kind_for_object(value).child_type_name(value))
        for key, value in kind.entries(obj)
    )
    built = nodes.node_document(obj, kind, entries)
    with Directory.open(directory) as opened:
        _put_in_place(opened, kind, built, _stage_node_files(opened, kind, True, built))
