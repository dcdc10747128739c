"""The memmap family for every container: memmap_, memmap, memmap_like, load_memmap.

The container methods of the same names call these functions.
"""
from __future__ import annotations

import os
import warnings
from typing import Any, Callable

import torch

from shared_td.memmap_tensor import MemoryMappedTensor
from shared_td.persist import archive as archives
from shared_td.persist import archive_write
from shared_td.persist import atomic, in_flight, nodes
from shared_td.storage import files
from shared_td.storage.files import FileBacking
from shared_td.storage.shared_value import adopt_new_slabs, collecting_new_slabs, share_together
from shared_td.persist.future import TensorDictFuture
from shared_td.persist.loader import Loader, load_written_archive
from shared_td.persist.planner import VALUE_KINDS, NodePlan, Options, Planner
from shared_td.persist.leaf_checks import check_leaf_layouts
from shared_td.persist.writer import tree_documents, write_tree

_CPU = torch.device("cpu")


def memmap(
    obj: Any,
    prefix: Any = None,
    copy_existing: bool = False,
    *,
    inplace: bool,
    like: bool = False,
    num_threads: int = 0,
    return_early: bool = False,
    share_non_tensor: bool = False,
    existsok: bool = True,
    robust_key: bool | None = True,
    atomic: bool = False,
    archive: bool | None = None,
    compression: Any = None,
    on_early_failure: Callable[[], None] | None = None,
    handover: Any = None,
) -> Any:
    """Write ``obj``'s leaves to memory-mapped files (or anonymous shared memory).

    ``inplace=True`` is memmap_ (obj's leaves are replaced), False is memmap (a new
    tree); ``like=True`` writes no data (memmap_like). See TensorDictBase.memmap_.
    ``archive`` (None: a prefix ending with ``.tdz``) writes one zip file instead
    (``persist.archive``), ``compression`` its payloads. ``on_early_failure``: called
    by the background thread of a ``return_early`` write that failed, before its
    future is given the error (memmap_ puts back the locks it took for the write).
    ``handover`` (an ``in_flight.Handover``): tells a failing caller whether that write
    runs (it then owns the clean-up) or never will.
    """
    if not isinstance(num_threads, int):
        # a TypeError, as tensordict 0.15.3 raises for a str or None (and as load_memmap does)
        raise TypeError(f"num_threads must be an int, got {num_threads!r} of type {type(num_threads).__name__}.")
    # as in tensordict 0.15.3, a count below 2 (-1 too) writes in the calling thread
    num_threads = max(num_threads, 0)
    prefix = prefix_path(prefix, "memmap_" if inplace else "memmap_like" if like else "memmap (or save)")
    if inplace and archive:
        raise ValueError("memmap_ cannot write an archive: its leaves would have to be the "
                         "archive's, read-only. Use memmap(prefix, archive=True) or save().")
    # memmap_ writes a directory whatever the prefix's name, as in tensordict 0.15.3
    if not inplace and archives.wants_archive(prefix, archive):
        return _memmap_to_archive(obj, prefix, like=like, return_early=return_early,
                                  existsok=existsok, robust_key=robust_key, compression=compression)
    if compression is not None:
        raise ValueError("compression is only for an archive: pass archive=True or a prefix "
                         f"ending with {archives.ARCHIVE_SUFFIX!r}.")
    if prefix is None and not like:
        # (memmap_like never writes into the source's own files: anonymous memory)
        prefix = own_directory(obj)
    # an earlier return_early write of this tree or to this directory ends first
    in_flight.wait_for(obj, None if prefix is None else os.path.abspath(prefix))
    options = Options(
        prefix=None if prefix is None else os.path.abspath(prefix),
        inplace=inplace,
        like=like,
        copy_existing=copy_existing,
        num_threads=num_threads,
        existsok=existsok,
        robust_key=True if robust_key is None else bool(robust_key),
        share_non_tensor=share_non_tensor,
    )
    if atomic:
        return _memmap_atomically(obj, options, return_early)
    planner = Planner(options)
    root = planner.plan(obj)
    check_leaf_layouts(root)
    undo = _share_values_first(root, options)
    if return_early and num_threads > 1:
        handover = in_flight.Handover() if handover is None else handover
        try:
            # made here, as the plan is: an unpicklable value is an error of this call
            documents = None if root.directory is None else tree_documents(root)
            description = f"memmap to {options.prefix or 'shared memory'}"
            future = in_flight.run_in_background(
                lambda: _execute(planner, root, options, documents, undo), description,
                "shared_td-memmap", prefix=options.prefix, nodes=(node.obj for node in root.walk()),
                on_failure=on_early_failure, handover=handover)
        except BaseException:
            if handover.kept_by_caller():  # (else the running write owns undo)
                undo()
            raise
        # memmap_'s result is the source itself, known now (as tensordict's resulting_td)
        return TensorDictFuture(future, description,
                                **({"resulting_td": obj} if inplace else {}))
    return _execute(planner, root, options, undo=undo)


def wait_for_background_writes(obj: Any, prefix: Any) -> None:
    """Wait for the ``return_early`` writes still running of ``obj``'s tree or to
    ``prefix`` (see ``persist.in_flight``): memmap_ calls it before it locks the tree,
    which such a write holds locked until it ends."""
    prefix = prefix_path(prefix, "memmap_")
    in_flight.wait_for(obj, None if prefix is None else os.path.abspath(prefix))


def prefix_path(prefix: Any, call: str) -> str | None:
    """``prefix`` as a str path (None stays None), for every call that takes one.

    A str or a ``pathlib.Path``, as tensordict 0.15.3 takes, and also bytes (or a
    PathLike giving bytes), decoded with ``os.fsdecode`` as the ``os`` module does, so
    that a path from ``os.fsencode`` or ``os.listdir(b".")`` names the same directory
    (tensordict fails on bytes with a TypeError from deep inside). Anything else is a
    TypeError naming ``call``'s argument, what was given and the fix.

    Example:
        >>> import pathlib
        >>> prefix_path(b"data/saved", "memmap"), prefix_path(pathlib.Path("data"), "memmap")
        ('data/saved', 'data')
    """
    if prefix is None:
        return None
    try:
        return os.fsdecode(prefix)
    except TypeError:
        raise TypeError(
            f"{call}: prefix must be a path (a str, a pathlib.Path or bytes), got "
            f"{type(prefix).__name__} {prefix!r}. Pass the directory as a string, e.g. "
            "prefix='data/saved'."
        ) from None


def own_directory(obj: Any) -> str | None:
    """The directory ``obj`` was memory-mapped to or loaded from (None if none)."""
    return nodes.kind_for_object(obj).directory(obj)


def _nothing() -> None:
    pass


def _execute(planner: Planner, root: NodePlan, options: Options, documents: dict | None = None,
             undo: Callable[[], None] = _nothing) -> Any:
    try:
        write_tree(root, planner.leaves, options, documents=documents)
        return _finish(root, options)
    except BaseException:
        undo()  # (write_tree removed what it made)
        raise


def _share_values_first(root: NodePlan, options: Options) -> Callable[[], None]:
    """memmap_(share_non_tensor=True): share the tree's non-tensor values before any byte
    is written; returns what puts them back as they were, for a write that fails later.

    Sharing hands the new cells' slab to a coordinator (``adopt_new_slabs``: a round trip,
    which fails when it is gone or reports an earlier hand-over error). Done after the
    write, as _build shares them, that failure came once the leaves were adopted and
    the files written: a half-converted tree. Here it comes first, and leaves the values
    as they were; _build then finds them shared and makes no new cell. Their state is
    copied whole, as the kinds' ``adopt`` (which shares them) sets their fields.
    """
    if not options.share_non_tensor:
        return _nothing
    values = [node for node in root.walk() if node.kind.name in VALUE_KINDS]
    if not options.inplace:
        _share_copies_first(values)
        return _nothing
    states = [(node.obj, dict(vars(node.obj))) for node in values]

    def undo() -> None:
        for obj, state in states:
            vars(obj).clear()
            vars(obj).update(state)

    try:
        with collecting_new_slabs() as slabs:
            share_together([node.obj for node in values])
            for node in values:
                node.kind.adopt(node.obj, {}, node.directory, share_non_tensor=True)
        adopt_new_slabs(slabs)
    except BaseException:
        undo()
        raise
    return undo


def _share_copies_first(values: list[NodePlan]) -> None:
    """memmap()/memmap_like(share_non_tensor=True): the copy's values, made and shared
    (handed to the coordinator) before any byte is written, as memmap_ shares its own:
    a hand-over that fails then leaves nothing on disk (made by _build after the write,
    it left a complete save behind a ConnectionError). _build adopts them as they are."""
    copies = [node.obj.clone() for node in values]
    with collecting_new_slabs() as slabs:
        share_together(copies)
    adopt_new_slabs(slabs)  # (the source's values are left alone: nothing to undo)
    for node, copy in zip(values, copies):
        node.obj, node.premade = copy, True


def _finish(root: NodePlan, options: Options) -> Any:
    if not options.share_non_tensor:
        result = _build(root, options)
    else:
        with collecting_new_slabs() as slabs:
            result = _build(root, options)
        # a coordinator holds them too, so they outlive this process (one round trip)
        adopt_new_slabs(slabs)
    result.lock_()
    return result


def _memmap_atomically(obj: Any, options: Options, return_early: bool) -> Any:
    """Write into a sibling directory, then swap it in under the prefix's writer lock."""
    if return_early:
        raise NotImplementedError(
            "atomic=True cannot be combined with return_early=True: the swap must follow "
            "the last write. Call memmap_ with return_early=False."
        )
    target = atomic.check_target(options.prefix, existsok=options.existsok)  # a symlink resolved
    with atomic.acquired(target):
        try:
            atomic.sweep_leftovers(target)
        except OSError as error:  # what dead writers left does not stop this one
            warnings.warn(str(error), RuntimeWarning, stacklevel=3)
        # checked again: another writer may have changed the prefix while we waited
        if atomic.check_target(target, existsok=options.existsok) != target:
            raise RuntimeError(f"atomic=True: {target} became a symlink while this writer waited "
                               "for its lock; nothing was written. Try again.")
        staging = atomic.Staging(target)
        undo = _nothing
        try:
            options.prefix, options.atomic_target = staging.path, target
            planner = Planner(options, fresh_root=True)
            root = planner.plan(obj)
            check_leaf_layouts(root)
            undo = _share_values_first(root, options)
            write_tree(root, planner.leaves, options, clean_up=False)
            staging.finish()
            atomic.swap_into_place(staging.path, target)
        except BaseException as error:
            staging.discard(error)
            undo()
            raise
        # still under the lock: _relocate looks the files up by name, and _finish records
        # which directories the values live in (a stale view's write is checked against
        # them): once the lock is released another writer may already have swapped its own
        # save in there (audit 21: a writer then took the other save's directory for its own)
        _relocate(root, staging.path, target)
        return _finish(root, options)


def _memmap_to_archive(obj: Any, prefix: Any, *, like: bool, return_early: bool,
                       existsok: bool, robust_key: bool | None, compression: Any) -> Any:
    """memmap/memmap_like/save to one archive file, written atomically from memory (see
    ``persist.archive_write``); returns the archive loaded (memmap_like: mode="r+", so
    that writes fill it) and locked. An archive is always a copy, written by the
    calling thread (``copy_existing`` and ``num_threads`` do not apply)."""
    archives.check_compression(compression)
    if return_early:
        raise NotImplementedError("return_early=True cannot write an archive: the zip is made "
                                  "once every leaf is written. Call it with return_early=False.")
    # checked early (nothing planned for nothing) and again under the writer lock
    target = archive_write.check_archive_target(prefix, existsok=existsok)
    # planned before the lock: a key the archive cannot hold leaves nothing on disk.
    # An archive is always a copy: leaves mapped to files elsewhere are copied too
    planned = archive_write.plan_tree(obj, like=like, robust_key=robust_key, where=target)

    def fill(members: archive_write.Members) -> None:
        archive_write.add_tree(members, planned)

    def load(fd: int) -> Any:
        # through the descriptor of the file this call wrote, never by the name: any
        # process may have renamed its own file over it since (the lock only orders
        # shared_td's writers); the pickles are this call's own bytes, not the file's
        try:
            return load_written_archive(target, fd, writable=like,
                                        pickles=archive_write.planned_pickles(planned))
        except Exception as err:
            err.add_note(f"The archive {target} was written completely and is in place: only "
                         "loading it back into this process failed. Load it with "
                         "shared_td.load_memmap once the cause is fixed.")
            raise

    loaded = archive_write.write_archive(target, fill, compression, existsok=existsok, then=load)
    return loaded.lock_()


def _relocate(root: NodePlan, staging: str, target: str) -> None:
    """After the swap, every node and leaf names its place under ``target``."""
    def moved(path: str) -> str:
        return target + path[len(staging):]

    for node in root.walk():
        node.directory = moved(node.directory)
        for leaf in node.leaves.values():
            tensor, backing = leaf.result, leaf.result._backing
            new_backing = FileBacking(moved(backing.path), None, 0, True)
            if tensor.numel():
                new_backing = files.relocated(backing, moved(backing.path))
                leaf.result = MemoryMappedTensor._from_backing(
                    new_backing, tensor._byte_offset(), tensor.dtype, tensor.shape, tensor.stride()
                )
            else:
                leaf.result = MemoryMappedTensor._empty_leaf(new_backing, tensor.dtype, tensor.shape)


def _build(node: NodePlan, options: Options) -> Any:
    """Put the written leaves into the tree (in place) or into a new tree."""
    built = {name: _build(child, options) for name, child in node.children.items()}
    values = {key: node.leaves[key].result if key in node.leaves else built[key]
              for key in node.order} if node.order else built
    put = node.kind.adopt if options.inplace or node.premade else node.kind.copy
    return put(node.obj, values, node.directory, share_non_tensor=options.share_non_tensor)


def load_memmap(
    prefix: Any, device: Any = None, non_blocking: bool = False, *,
    robust_key: bool | None = True, subpath: Any = None, mode: str | None = None,
    num_threads: int = 0, allow_pickle: bool | None = False,
) -> Any:
    """Load what memmap/save wrote at ``prefix`` (by shared_td or tensordict 0.15.3).

    The class is the one recorded on disk. Leaves are MemoryMappedTensors over the
    files (or copies on ``device`` if it is not the CPU); the result is unlocked.
    ``subpath`` (a nested key) loads one nested tensordict of the save, ``mode`` is
    None, "r" (read-only leaves) or "r+" (writable or an error), ``num_threads`` maps
    the files on that many threads (see ``persist.loader``).
    """
    prefix = prefix_path(prefix, "load_memmap (or load)")
    if prefix is None:
        raise TypeError("load_memmap (or load): prefix is None; pass the directory (or "
                        "archive) that memmap/save wrote, e.g. load_memmap('data/saved').")
    loader = Loader(robust_key=robust_key, allow_pickle=allow_pickle, mode=mode,
                    num_threads=num_threads)
    result = loader.load(prefix, subpath)
    if device is not None and torch.device(device) != _CPU:
        result = result.to(device, non_blocking=non_blocking)
    return result
