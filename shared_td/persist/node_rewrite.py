"""Rewrites of one existing node's files after an in-place change (see persist/writer.py
for whole-tree writes): a non-tensor value written through a shared view
(:func:`rewrite_node`), entries added to a saved tensordict (:func:`node_rewrite`).

Each rewrite takes the node directory's ``flock`` (writers of one node take turns, at
most NODE_LOCK_S each) and checks that the directory is still the one it was mapped
from: a stale view never writes into a newer save.
"""
from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import time
from typing import Any, Callable, Iterator

import torch

from shared_td import platform
from shared_td.errors import SaveChangedError
from shared_td.persist import format as fmt
from shared_td.persist import nodes
from shared_td.persist.loader import read_meta
from shared_td.persist.node_commit import put_node_in_place, stage_node_files
from shared_td.persist.node_meta import ChildMeta, LeafMeta, NodeMeta
from shared_td.storage.files import Directory


def rewrite_node(obj: Any, directory: str, expected: tuple[int, int] | None = None) -> None:
    """Rewrite the files of ``obj``'s existing node ``directory`` from what ``obj``
    holds now (after an in-place write of non-tensor data): through a temporary each,
    renamed over the old file; a failure leaves the old files and no temporary. Under
    the node's flock, SaveChangedError (nothing written) if ``directory`` is no longer
    the ``expected`` ``(st_dev, st_ino)`` it was mapped from: a stale view's write never
    reaches a newer save's files (written through the descriptor checked)."""
    with Directory.open(directory) as opened, _held(opened, expected is not None):
        if expected is not None:
            st = os.fstat(opened.fd)
            if (st.st_dev, st.st_ino) != tuple(expected):
                raise SaveChangedError(
                    f"The non-tensor entry in {directory} was written through a stale view: the directory was "
                    "replaced since this value was mapped or loaded (an atomic rewrite, or a new save at that "
                    "prefix). Nothing was written. Refresh the view (shared_td.refresh, or attach / load_memmap "
                    "again) and write through the new one.")
        _rewrite_in(obj, opened)


def _rewrite_in(obj: Any, opened: Directory) -> None:
    kind = nodes.kind_for_object(obj)
    built = nodes.node_document(obj, kind, _entries_now(kind, obj))
    put_node_in_place(opened, kind, built, stage_node_files(opened, kind, True, built))


def _entries_now(kind: nodes.NodeKind, obj: Any) -> tuple:
    return tuple(
        LeafMeta.of(key, value) if isinstance(value, torch.Tensor)
        else ChildMeta(key, nodes.kind_for_object(value).child_type_name(value))
        for key, value in kind.entries(obj)
    )


#: Seconds a node rewrite (:func:`node_rewrite`) waits for another process's rewrite of
#: the same node directory to end (each takes milliseconds: a longer wait is a stalled
#: or stopped process).
NODE_LOCK_S = 30.0


@contextlib.contextmanager
def node_rewrite(obj: Any, directory: str) -> Iterator[Callable[[], None]]:
    """``with node_rewrite(node, directory) as rewrite:`` add entries to ``node`` (their
    files too), then ``rewrite()`` its meta.json, with no lost update between processes.

    On entry the node directory's ``flock`` is taken (other rewrites of it wait, at
    most NODE_LOCK_S) and its meta.json must describe ``node`` as it is now, else
    SaveChangedError before anything is written: another process added an entry since
    this tensordict was loaded (its rewrite would be dropped by ours), or rewrote the
    save with ``atomic=True`` (ours would name files the new version does not have,
    and it would no longer load). After the block, SaveChangedError if ``directory``
    was replaced meanwhile (what the block wrote went to the old version)."""
    kind = nodes.kind_for_object(obj)
    expected = kind.metadata(obj, _entries_now(kind, obj))[0]
    with Directory.open(directory) as opened, _held(opened):
        on_disk = read_meta(opened)
        if not _same_layout(on_disk, expected):
            raise SaveChangedError(
                f"{opened.join(fmt.META)} no longer describes this memory-mapped tensordict: the save was "
                "changed since it was loaded or written (by another process: an entry added, an atomic "
                "rewrite), or this tensordict was changed in memory (an entry set, deleted or renamed "
                "without writing it). Nothing was written (its meta.json would drop the other change, or "
                "name files the save does not have). Load the save again (load_memmap) and retry, or "
                "write the whole tensordict with memmap_().")
        yield lambda: _rewrite_in(obj, opened)
        if not _still_at(opened, directory):
            raise SaveChangedError(
                f"{directory} was replaced (an atomic rewrite) while an entry was added to it: the entry "
                "went to the old version, which is gone. Load the save again (load_memmap) and retry.")


def _lock_node(opened: Directory) -> None:
    """Take the ``flock`` of ``opened`` (dropped when it is closed), waiting at most
    NODE_LOCK_S."""
    deadline = time.monotonic() + NODE_LOCK_S
    pause = 0.001
    while not platform.try_flock(opened.fd):
        if time.monotonic() > deadline:
            raise TimeoutError(f"Another process has been rewriting {opened.path} for more than {NODE_LOCK_S:g} s "
                               "(it holds the directory's flock): it is stalled or stopped.")
        time.sleep(pause)
        pause = min(2 * pause, 0.05)


@contextlib.contextmanager
def _held(opened: Directory, take: bool = True) -> Iterator[None]:
    """The node's flock (:func:`_lock_node`) for the block, given back explicitly at its
    end: a child forked meanwhile shares the descriptor's open file description, and a
    flock that only the close drops would stay held by the child's copy for its whole
    life (every later rewrite of the node, the parent's and the child's, waited
    NODE_LOCK_S and raised TimeoutError)."""
    if not take:
        yield
        return
    try:  # (taken inside: a Ctrl-C right after the flock still gives it back; LOCK_UN of one not held is a no-op)
        _lock_node(opened)
        yield
    finally:
        fcntl.flock(opened.fd, fcntl.LOCK_UN)


def _same_layout(first: NodeMeta, second: NodeMeta) -> bool:
    """Whether two meta.json documents describe the same node (whoever wrote them)."""
    return dataclasses.replace(first, path=None) == dataclasses.replace(second, path=None)


def _still_at(opened: Directory, path: str) -> bool:
    try:
        return os.path.samestat(os.fstat(opened.fd), os.stat(path))
    except OSError:
        return False
