"""The commit step's files of one node (see persist/writer.py): its meta.json and side
files (pickles), built from the plan before any byte is written, then staged (as
temporaries in a directory that existed, directly in a new one) and renamed into place.

Shared by the tree writer (persist/writer.py), the node rewrites of non-tensor writes
and added entries (persist/node_rewrite.py) and archives (persist/archive_write.py).
"""
from __future__ import annotations

from shared_td.persist import format as fmt
from shared_td.persist import nodes
from shared_td.persist.node_meta import ChildMeta, LeafMeta
from shared_td.persist.planner import NodePlan
from shared_td.storage.files import Directory


def stage_node_files(directory: Directory, kind: nodes.NodeKind, existed: bool, built: tuple,
                     made: list[str] | None = None) -> list[tuple[str, str]]:
    """Write one node's ``built`` files (``(meta.json bytes, side files)``) into its
    directory: directly in a new one (each name added to ``made`` once written, for the
    clean-up), else as temporaries, returned as ``(temporary, final name)`` for
    :func:`put_node_in_place`. On failure no temporary is left."""
    document, side = built
    staged: list[tuple[str, str]] = []
    try:
        for name, data in [*side.items(), (fmt.META, document)]:
            if existed:
                staged.append((fmt.write_temporary(directory, name, data), name))
            else:
                directory.write_new_file(name, data)
                if made is not None:
                    made.append(name)
    except BaseException:
        for temporary, _ in staged:
            directory.unlink(temporary)
        raise
    return staged


def put_node_in_place(directory: Directory, kind: nodes.NodeKind, built: tuple, staged: list[tuple[str, str]]) -> None:
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
        LeafMeta.of(key, node.leaves[key].source) if key in node.leaves
        else ChildMeta(key, node.children[key].kind.child_type_name(node.children[key].obj))
        for key in node.order
    )
