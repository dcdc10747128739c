"""The persistence engine: plan, write, commit (memmap_, memmap, memmap_like).

* **plan** (persist/planner.py) walks the tree once and decides, for every leaf, where
  its bytes go; every check (keys, paths inside the prefix, symlinks, existing files,
  files elsewhere) happens there, before any byte is written.
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
* **commit** writes every meta.json (children first, the root's last) and only then
  puts the new leaves into the tensordict (or a new one). A node directory that existed
  gets its files as temporaries renamed into place; a new one (this save made it) gets
  them written directly, each created with ``O_EXCL`` (persist/node_commit.py). A view
  written into its parent's own directory (the files its leaves map) stages each such
  leaf as ``.<NAME>.shared_td.<pid>.<tid>.tmp``, renamed over ``NAME`` just before its
  node's meta.json: until then the old file, and its mappings, keep their bytes (a
  killed writer leaves only a dead writer's temporary, which ``shared_td.gc`` removes).

Rewrites of one existing node after an in-place change are persist/node_rewrite.py's.
"""
from __future__ import annotations

import contextlib
import errno
import os
import threading

import torch

from shared_td.memmap_tensor import MemoryMappedTensor
from shared_td.persist import format as fmt
from shared_td.persist import in_flight
from shared_td.persist.node_commit import node_files, put_node_in_place, stage_node_files
from shared_td.persist.node_rewrite import NODE_LOCK_S, node_rewrite, rewrite_node
from shared_td.persist.packing import copy_all, leaf_nbytes, packed_layout, packed_views, stage_small_leaves
from shared_td.persist.planner import LeafPlan, NodePlan, Options, leaf_is_a_directory
from shared_td.storage import files
from shared_td.storage.anonymous import Segment, align
from shared_td.storage.files import Directory, FileBacking
from shared_td.thread_pool import ThreadPool

# The engine's writes, as one module for its callers: the node rewrites (non-tensor writes,
# added entries) live in node_rewrite.py and a node's own files in node_commit.py, and are
# reached through here too (containers/memmap_methods.py: writer.node_rewrite).
__all__ = ["NODE_LOCK_S", "node_files", "node_rewrite", "packed_layout", "rewrite_node", "tree_documents",
           "write_tree"]

# With num_threads > 1, leaves at least this big are written by the pool, one leaf per
# task: pwrite releases the GIL, and distinct files do not share an inode lock. One leaf
# is never split between threads: writes into one file take turns on its inode lock, so
# splitting only added overhead (measured ~15% slower for a 256 MiB leaf on ext4).
# Smaller leaves are written by the calling thread: a hop to the pool costs more.
_POOL_LEAF_BYTES = 1 << 20
# Existing directories a rewrite keeps open from their files' staging to their renaming
# (a second open each costs ~4 us); more are opened again, so descriptors stay bounded.
_KEPT_DIRECTORIES = 256


# ------------------------------------------------------------------------------ write
def tree_documents(root: NodePlan) -> dict:
    """The meta.json bytes and side files (pickles) of every node of a planned tree to
    files, by node id: made before any byte is written, so an unpicklable value raises
    here. ``memmap_(return_early=True)`` makes them in the calling thread, so that such
    an error is raised by the call itself (naming its key), not by ``result()``."""
    built: dict = {}
    return {id(node): node_files(node, built) for node in root.walk()}


def write_tree(root: NodePlan, leaves: list[LeafPlan], options: Options, *, clean_up: bool = True,
               documents: dict | None = None) -> None:
    """Write the leaves and every meta.json; on failure remove what this write created,
    and only that: the files and directories it made (``clean_up=False``: the caller
    made the root and removes it whole, as an atomic write's staging directory does
    with the descriptors it reserved for that).

    A root missing when the write was planned is made here with a plain ``mkdir``: if
    it appeared meanwhile (another writer, thread or process, made it), that is a
    FileExistsError before anything is written, never a write among its files.

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
    it was, and no reader ever sees a half-written one. Those temporaries are made
    before any leaf's bytes, so that a directory that cannot take them (read-only)
    fails the write before a byte of an old leaf file changes. ``documents``: the
    tree's :func:`tree_documents`, if the caller made them already.
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
    if documents is None:
        documents = tree_documents(root)
    made_root = clean_up and not root.exists
    directory, made = _make_root(root.directory) if made_root else (Directory.open(root.directory), [])
    pool = ThreadPool.start(options.num_threads, "shared_td-write") if options.num_threads > 1 else None
    writer = _TreeWriter(options, pool, documents)
    try:
        writer.write(root, directory)
        if root.exists:
            writer.put_in_place(root, directory)
    except BaseException as error:
        writer.close_kept()
        if clean_up:
            writer.remove_what_was_made(root, directory, error)
        directory.close()
        # the root, emptied above, and the parents made for it: what is left there is not this write's
        _remove_made(made, error)
        raise
    finally:
        writer.close_kept()
        if pool is not None:
            pool.shutdown()
    directory.close()
    if writer.not_removed:
        raise OSError(
            f"The save at {root.directory} is written, but what an older save left there "
            f"could not be removed: {'; '.join(writer.not_removed)}. Loading it would take "
            "that as part of the new save (an extra lazy-stack member): remove it."
        )


class _TreeWriter:
    """Writes the files of a tree, node by node, and knows what it created.

    With a pool, leaves of at least ``_POOL_LEAF_BYTES`` are written by its threads:
    the calling thread opens the file (in its directory) and hands the descriptor
    over; at most two per thread wait, so descriptors stay few.
    """

    def __init__(self, options: Options, pool: ThreadPool | None, documents: dict):
        self.options = options
        self.pool = pool
        self.documents = documents  # node id -> (meta.json bytes, side files)
        self.slots = threading.BoundedSemaphore(2 * options.num_threads) if pool else None
        self.futures: list = []  # (leaf, future) of every leaf handed to the pool
        self.made_directories: set[int] = set()  # id() of the nodes whose directory this made
        self.made_files: dict[int, list[str]] = {}  # node id -> names of the files this made
        self.staged: dict[int, list[tuple[str, str]]] = {}  # node id -> (temporary, final)
        self.staged_leaves: dict[int, list[tuple[str, str]]] = {}  # the same, of existing leaf files
        self.kept: dict[int, Directory] = {}  # node id -> its existing directory, still open
        self.shapes: dict = {}  # one torch.Size per shape of the leaves (MMT._wrap_views)
        self.empty_of: dict = {}  # dtype -> an empty tensor of it
        self.not_removed: list[str] = []  # stale entries put_in_place could not remove

    def close_kept(self) -> None:
        for opened in self.kept.values():
            opened.close()
        self.kept.clear()

    def write(self, root: NodePlan, directory: Directory) -> None:
        """Write every file below ``root``; raise the first error once all writes
        ended (so that the files made are all known, for the clean-up). The files of
        existing directories are staged first, before any leaf's bytes."""
        try:
            if root.exists:
                self._stage_existing(root, directory)
            self._write_node(root, directory, root=True)
        except BaseException:
            for _, future in self.futures:
                future.exception()  # wait; the first error is the one raised
            raise

    def _stage_existing(self, node: NodePlan, directory: Directory) -> None:
        """Write the meta.json (and side files) of ``node``, an existing directory, and
        of the existing directories below it, as temporaries (renamed by put_in_place)."""
        self.staged[id(node)] = stage_node_files(directory, node.kind, True, self.documents[id(node)])
        for child in node.children.values():
            if child.exists:
                opened = directory.child(os.path.basename(child.directory))
                try:
                    self._stage_existing(child, opened)
                finally:
                    if len(self.kept) < _KEPT_DIRECTORIES:
                        self.kept[id(child)] = opened  # for _write_node, without a new open
                    else:
                        opened.close()

    def _write_node(self, node: NodePlan, directory: Directory, root: bool = False) -> None:
        for leaf in node.leaves.values():
            if leaf.path is not None and not leaf.keep:
                self._write_leaf(leaf, node, directory)
        for child in node.children.values():
            name = os.path.basename(child.directory)
            if not child.exists:
                directory.mkdir(name)
                self.made_directories.add(id(child))
            opened = self.kept.pop(id(child), None) or directory.child(name)
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
        if id(node) not in self.staged:  # a new directory (an existing one's are staged)
            made = self.made_files.setdefault(id(node), [])
            self.staged[id(node)] = stage_node_files(directory, node.kind, node.exists,
                                                     self.documents[id(node)], made)

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
        if leaf.replace and directory.exists(name):
            # a view of the very file it is written to (see the planner): its bytes go to a new
            # file, staged under a temporary name and renamed over NAME at the node's commit,
            # just before its meta.json (put_in_place). Until then NAME, and the mappings of
            # it (the source's own), keep the old bytes: a failure unlinks the temporary, and a
            # writer killed meanwhile leaves only a dead writer's temporary, which gc removes.
            staged = fmt.staged_leaf_name(name)
            try:
                directory.unlink(staged)  # left by a killed writer of the same pid and thread id
                fd, _ = files.reserve_file(directory, staged, existsok=False)
            except (IsADirectoryError, PermissionError, FileExistsError) as error:  # (not a file there)
                raise type(error)(error.errno, f"Cannot write key {leaf.key!r}: its new bytes are staged as "
                                  f"{directory.join(staged)}, where something other than a file is (left by "
                                  "a writer of the same process id?). Remove it and write again.") from None
            self.staged_leaves.setdefault(id(node), []).append((staged, name))
            self._hand_over(leaf, fd, source, nbytes, True)
            return
        if options.like and directory.exists(name):
            # a "like" file must read as zeros: a new file replaces the old one, whose
            # mappings (maybe the source's own) keep the old bytes; nothing is truncated
            try:
                directory.unlink(name)
            except IsADirectoryError:  # (one made there since the plan, which refuses it)
                raise leaf_is_a_directory(leaf.key, leaf.path) from None
        try:
            fd, is_new = files.reserve_file(directory, name, existsok=options.existsok)
        except IsADirectoryError:  # (as above; a FIFO, socket or device there: its own message)
            raise leaf_is_a_directory(leaf.key, leaf.path) from None
        if is_new:
            self.made_files.setdefault(id(node), []).append(name)
        self._hand_over(leaf, fd, source, nbytes, is_new)

    def _hand_over(self, leaf: LeafPlan, fd: int, source: torch.Tensor, nbytes: int, is_new: bool) -> None:
        """Fill ``fd`` with ``leaf``'s bytes here, or, for a big leaf, on the pool."""
        if self.pool is None or nbytes < _POOL_LEAF_BYTES:
            leaf.result = self._fill(leaf, fd, source, is_new)
            return
        try:
            self.slots.acquire()
        except BaseException:
            os.close(fd)
            raise
        # fd (and the slot) are the job's once it starts, else ours: a submit that failed
        # (a pool refusing work at exit) or a Ctrl-C landing in it or as it returned closes
        # fd here only if the job never runs (closed twice before: the job still wrote
        # through it, or through another file given its number meanwhile).
        handover = in_flight.Handover()
        try:
            future = self.pool.submit(self._fill, leaf, fd, source, is_new, pooled=True, handover=handover)
        except BaseException:
            if handover.kept_by_caller():
                os.close(fd)
                self.slots.release()
            raise
        self.futures.append((leaf, future))

    def _fill(self, leaf: LeafPlan, fd: int, source: torch.Tensor, created: bool,
              pooled: bool = False, handover: in_flight.Handover | None = None) -> torch.Tensor | None:
        """Write (or reserve) the bytes of ``leaf`` into ``fd`` (``created``: a new
        file), map it, close ``fd``; nothing when the caller that handed it over failed
        first (``handover``: fd is then the caller's)."""
        if handover is not None and not handover.taken_by_write():
            return None
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
        over the old ones, children first; then remove what an older save left there
        that would be read as part of the new one (a longer lazy stack's members, each
        checked to be part of that save when the write was planned)."""
        for child in node.children.values():
            if child.exists:
                opened = self.kept.pop(id(child), None) or directory.child(os.path.basename(child.directory))
                with opened:
                    self.put_in_place(child, opened)
        # the new leaf files just before the meta.json that names them (the old ones' mappings
        # keep their bytes): a reader sees the old save or the new one, but for a writer killed
        # between these renames (the leaves' new bytes under the node's old meta.json)
        put_node_in_place(directory, node.kind, self.documents[id(node)],
                          self.staged_leaves.get(id(node), []) + self.staged[id(node)])
        for name in node.stale:  # found and checked when planned (planner._stale_entries)
            try:
                directory.remove_tree(name)
            except OSError as error:  # raised once the write is over: nothing to undo
                self.not_removed.append(f"{directory.join(name)} ({error})")

    def remove_what_was_made(self, node: NodePlan, directory: Directory, error: BaseException) -> None:
        """Remove the files, temporaries and directories this write made after ``error``;
        what cannot be removed is named in a note on it (a directory swapped for a
        symlink meanwhile is left alone, never followed)."""
        for name in self.made_files.get(id(node), ()):
            _note_failure(error, directory.join(name), directory.unlink, name)
        for temporary, _ in (*self.staged_leaves.get(id(node), ()), *self.staged.get(id(node), ())):
            _note_failure(error, directory.join(temporary), directory.unlink, temporary)
        for child in node.children.values():
            name = os.path.basename(child.directory)
            made = id(child) in self.made_directories
            if not (made or child.exists):
                continue  # not reached by the write
            try:
                with directory.child(name) as opened:
                    self.remove_what_was_made(child, opened, error)
            except (OSError, RuntimeError) as failure:
                error.add_note(f"What this write made in {directory.join(name)} was not removed: {failure}")
                continue
            if made:  # emptied of what this write put there; anything else stays, and it with it
                _note_failure(error, directory.join(name), directory.rmdir, name)


def _make_root(path: str) -> tuple[Directory, list[str]]:
    """Make the directory ``path`` (a prefix missing when the write was planned) and its
    missing parents one by one, and open it; returns it and the directories it made,
    outermost first (a failure here removes them: :func:`_remove_made`). One that
    exists now was made by another writer since: its files are not this write's to
    write among, nor to remove if it fails (nor is a parent made by another meanwhile).
    Such a parent vanishes again when that writer fails and removes it (still empty):
    the missing parents are then found and made again (a few times at most)."""
    name, made, opened = os.path.basename(path), [], None
    try:
        for tries_left in reversed(range(8)):
            missing, parent = [], os.path.dirname(path)
            while parent and not os.path.isdir(parent):
                missing.append(parent)
                parent = os.path.dirname(parent)
            try:
                for each in reversed(missing):
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(each, 0o777)
                        made.append(each)  # (this write's: no other writer removes it)
                above = Directory.open(os.path.dirname(path))
            except FileNotFoundError:
                if tries_left:
                    continue
                raise
            with above:
                try:
                    above.mkdir(name)
                except FileExistsError:
                    raise FileExistsError(
                        errno.EEXIST,
                        f"{path} did not exist when this write was planned, but it does now: another "
                        "writer (a thread or a process) made it meanwhile. Nothing was written. Write "
                        "again (that write rewrites what is there), or make the writers take turns "
                        "with atomic=True.", path) from None
                except FileNotFoundError:  # (the directory opened was removed since)
                    if tries_left:
                        continue
                    raise
                made.append(path)
                # (held here, not in flight as the return value: a Ctrl-C landing as
                # ``above`` closed left it open, its directory removed below)
                opened = above.child(name)
            return opened, made
    except BaseException as error:  # (opening it needs a descriptor: there may be none)
        if opened is not None:
            opened.close()
        _remove_made(made, error)
        raise


def _remove_made(made: list[str], error: BaseException) -> None:
    """Remove the emptied directories a failed write ``made``, innermost first; the
    first that cannot be (something not this write's is in it) stops it, in a note."""
    for path in reversed(made):
        try:
            os.rmdir(path)
        except OSError as failure:
            error.add_note(f"{path}, made by this write, could not be removed: {failure}")
            return


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
