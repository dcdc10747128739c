"""The layout of a replicated name: what another node needs to rebuild the owner's tree.

A replicated name is whatever one node publishes in anonymous memory -- a TensorDict, a
tensorclass, a LazyStackedTensorDict, nested in each other in any way -- whose tensor
leaves all lie in ONE anonymous segment (what ``memmap_()`` without a prefix makes). Its
layout is plain JSON, signed in the store
(:class:`~shared_td.coordinator.cluster_store.SignedStore`)::

    {"batch_size": [...],                 # the root's
     "nbytes": 4096,                      # the segment's data bytes
     "nodes":  [{"path": [...], "meta": {...}}, ...],
     "leaves": [{"key": [...], "dtype": "float32", "shape": [...], "offset": 0, "row": 2?}, ...],
     "values": [{"key": [...], "class": "NonTensorData", "batch_size": [...]}, ...]}

* ``nodes``: the tree's structure in the on-disk format, not a second one: each
  container node's meta.json document, exactly as a save writes it (the node kinds of
  :mod:`shared_td.containers.node_kinds`: batch size, names, the ordered entries of a
  TensorDict, a lazy stack's ``stack_dim``, a tensorclass's ``_type``), under its path in
  the tree, whose parts are the directory names of a save: an entry's key, ``"0"``,
  ``"1"``... for the members of a lazy stack, ``"_tensordict"`` for a tensorclass's fields.
* ``leaves``: each tensor's byte ``offset`` in the segment (a transfer is one contiguous
  copy of ``nbytes``); ``row`` is set on the leaves of a member of a lazy stack stacked
  along the root's first dimension: that whole leaf is row ``row`` of a push
  (:func:`shared_td.coordinator.cluster_replica.pack_rows`).
* ``values``: the NonTensorData and NonTensorStack values, shared with
  ``share_non_tensor=True``; their contents travel separately, as signed pickles
  (:mod:`~shared_td.coordinator.cluster_values`), never in the layout.

:func:`rebuild` reads it as the loader reads a save (each document checked by
``NodeMeta.from_json``, the node rebuilt by the kind its ``_type`` names), over the
replica's own segment. **Nothing in it is unpickled or imported**: a tensorclass's
``_type`` (``"<class 'pkg.mod.Step'>"``) is looked up among the tensorclasses defined in
the attaching process (:func:`~shared_td.containers.tensorclass.tensorclass_for_type_string`,
the rule of every load), so a node must import the module that defines the class before
it attaches; otherwise the attach is a RuntimeError that says so. (A process that
attaches through its node's Coordinator gets the replica pickled by its own manager, on
the machine: as every single-node attach, authenticated by the Coordinator's authkey.)

What does not replicate is refused by :func:`check_kinds` with a TypeError naming the
leaf: non-tensor values of a name published without ``share_non_tensor=True``, a root
that is not a container; anything the engine cannot memory-map is its TypeError.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch

from shared_td.containers.base import is_tensor_collection
from shared_td.containers.nontensor import NonTensorData, NonTensorStack
from shared_td.memmap_tensor import MemoryMappedTensor
from shared_td.persist import nodes
from shared_td.persist.node_meta import ChildMeta, LeafMeta, NodeMeta
from shared_td.persist.sub_directories import SubDirectories
from shared_td.storage.anonymous import Segment

__all__ = ["check_kinds", "describe", "rebuild", "tensor_leaves", "value_cells"]

# The non-tensor containers that replicate, by name: each from the payload of its shared
# cell (one value; a stack's flat list of values in C order) and its batch size.
_VALUE_CLASSES = {
    "NonTensorData": lambda value, batch_size: NonTensorData(value, batch_size=batch_size),
    "NonTensorStack": lambda values, batch_size: NonTensorStack._from_flat(values, torch.Size(batch_size)),
}


@dataclass
class _Tree:
    """A walk of a tree by its node kinds: its container nodes (path -> meta document;
    None: not wanted), tensor leaves (path, tensor, row) and non-tensor values (path,
    value), in order; ``user_keys``: the user's key of each leaf and value by its path
    (what messages name: a tensorclass's field without the ``_tensordict`` of the path)."""

    documents: dict | None = field(default_factory=dict)
    leaves: list = field(default_factory=list)
    values: list = field(default_factory=list)
    user_keys: dict = field(default_factory=dict)


def _is_value(obj) -> bool:
    return type(obj) in (NonTensorData, NonTensorStack)


def _walk(obj, tree: _Tree, path: tuple = (), row: int | None = None, key_path: tuple = ()) -> None:
    """Add ``obj``'s node at ``path`` (the user's key ``key_path``) and everything
    below it to ``tree``. ``row``: the row of the root's first dimension that all of
    ``obj`` is (None: ``obj``'s own first batch dimension is the root's)."""
    kind = nodes.kind_for_object(obj)  # TypeError for what the engine cannot memory-map
    documented = tree.documents is not None
    entries = []
    for key, value in kind.entries(obj):
        if isinstance(value, torch.Tensor):
            if documented:
                entries.append(LeafMeta.of(key, value))
            tree.leaves.append((path + (key,), value, row))
            tree.user_keys[path + (key,)] = key_path + (key,)
            continue
        if documented:
            entries.append(ChildMeta(key, nodes.kind_for_object(value).child_type_name(value)))
        if _is_value(value):
            tree.values.append((path + (key,), value))
            tree.user_keys[path + (key,)] = key_path + (key,)
        else:
            _walk(value, tree, path + (key,), row, key_path + (key,))
    if documented:
        meta, side_files = kind.metadata(obj, tuple(entries))
        if side_files:  # no container node has any; non-tensor data is not walked here
            raise TypeError(f"The node {list(path)} needs pickled side files: it cannot be replicated.")
        tree.documents[path] = json.loads(meta.to_json())
    # a lazy stack along the root's first dimension: each member is one row of it
    stacked_rows = row is None and kind.name == nodes.LAZY and obj.stack_dim == 0
    # a tensorclass's tensordict holds its fields under the tensorclass's own key
    inner = (lambda child: key_path) if kind.name == nodes.TENSORCLASS else (lambda child: key_path + (child,))
    for index, (child, member) in enumerate(kind.children(obj)):
        _walk(member, tree, path + (child,), index if stacked_rows else row, inner(child))


def _survey(td, name: str) -> _Tree:
    if not is_tensor_collection(td) or _is_value(td):
        raise TypeError(f"{name!r}: a replicated name is a TensorDict, a tensorclass or a lazy stack "
                        f"of them, not a {type(td).__name__}.")
    tree = _Tree()
    _walk(td, tree)
    return tree


def check_kinds(td, name: str, share_non_tensor: bool) -> _Tree:
    """TypeError, naming the leaf, for what does not replicate (checked before anything
    is memory-mapped or published): a root that is not a container; non-tensor values
    without ``share_non_tensor=True``; what no node kind handles. Returns the walk."""
    tree = _survey(td, name)
    if tree.values and not share_non_tensor:
        key = tree.user_keys[tree.values[0][0]]
        raise TypeError(
            f"{name!r}: the leaf {key} is a non-tensor value; a replicated name shares its "
            "non-tensor values across the cluster only when published with share_non_tensor=True "
            "(publish(name, td, replicate=True, share_non_tensor=True))."
        )
    return tree


def describe(td, name: str, share_non_tensor: bool = False) -> tuple[dict, Segment, list]:
    """The JSON layout of ``td`` (memory-mapped: its tensor leaves in one anonymous
    segment), that segment, and the shared cells of its non-tensor values (in the order
    of ``layout["values"]``)."""
    tree = check_kinds(td, name, share_non_tensor)
    segment = None
    for key, leaf, _row in tree.leaves:
        if not leaf.numel():
            continue
        backing = getattr(leaf, "_backing", None)
        if not isinstance(backing, Segment):
            raise ValueError(
                f"{name!r}: the leaf {tree.user_keys[key]} is not in anonymous shared memory; publish with "
                "replicate=True without a prefix, so that the whole tree lies in one segment."
            )
        if segment is not None and backing is not segment:
            raise ValueError(f"{name!r}: the leaves lie in several segments; replicate a tree made "
                             "by one memmap_() without a prefix.")
        if not leaf.is_contiguous():
            raise ValueError(f"{name!r}: the leaf {tree.user_keys[key]} is not contiguous.")
        segment = backing
    if segment is None:
        raise ValueError(f"{name!r}: nothing to replicate (no tensor with elements).")
    leaves = []
    for key, leaf, row in tree.leaves:
        entry = {"key": list(key), "dtype": str(leaf.dtype).removeprefix("torch."), "shape": list(leaf.shape),
                 "offset": leaf._byte_offset() if leaf.numel() else 0}
        if row is not None:
            entry["row"] = row
        leaves.append(entry)
    layout = {
        "batch_size": list(td.batch_size),
        "nbytes": segment.nbytes,
        "nodes": [{"path": list(path), "meta": document} for path, document in tree.documents.items()],
        "leaves": leaves,
        "values": [{"key": list(key), "class": type(value).__name__, "batch_size": list(value.batch_size)}
                   for key, value in tree.values],
    }
    return layout, segment, [value._shared_value for _key, value in tree.values]


def rebuild(name: str, layout: dict, values: list, segment: Segment):
    """The owner's tree over ``segment`` (this node's, at least ``nbytes`` long): the
    same classes, batch sizes, names, stack dims and keys, the tensor leaves at the
    owner's offsets, and the non-tensor ``values`` (not shared yet:
    ``memmap_(share_non_tensor=True)`` does it). RuntimeError for a tensorclass not
    defined in this process (module doc)."""
    documents = {tuple(node["path"]): node["meta"] for node in layout["nodes"]}
    leaves = {tuple(leaf["key"]): leaf for leaf in layout["leaves"]}
    made = {tuple(entry["key"]): _VALUE_CLASSES[entry["class"]](value, entry["batch_size"])
            for entry, value in zip(layout.get("values", ()), values)}

    def no_pickle(side_file: str):
        raise ValueError(f"The layout of {name!r} names the pickle {side_file}: a layout never holds one.")

    def build(path: tuple, parent_batch):
        if path not in documents:
            raise ValueError(f"The layout of {name!r} has no node {list(path)}.")
        meta = NodeMeta.from_json(documents[path], where=f"the layout of {name!r}, node {list(path)}")
        kind = nodes.kind_for_type_string(meta.type)
        built = {}
        for entry in meta.entries:
            where = path + (entry.key,)
            if isinstance(entry, LeafMeta):
                built[entry.key] = _leaf(name, segment, leaves.get(where), entry, where)
            else:
                built[entry.key] = made[where] if where in made else build(where, meta.batch_size)
        # (with the node's names: a lazy stack's member lost however far before the next one)
        listing = SubDirectories(lambda part: path + (part,) in documents,
                                 lambda: [key[-1] for key in documents
                                          if len(key) == len(path) + 1 and key[:-1] == path])
        for child in kind.child_names(meta, listing):
            built[child] = build(path + (child,), meta.batch_size)
        return kind.rebuild(meta, built, directory=None, parent_batch=parent_batch, unpickle=no_pickle)

    return build((), None)


def _leaf(name: str, segment: Segment, leaf: dict | None, meta: LeafMeta, key: tuple) -> torch.Tensor:
    if leaf is None or leaf["dtype"] != str(meta.dtype).removeprefix("torch.") or tuple(leaf["shape"]) != meta.shape:
        raise ValueError(f"The layout of {name!r} does not describe its leaf {list(key)} as its node does.")
    return MemoryMappedTensor._from_backing(segment, leaf["offset"], meta.dtype, meta.shape)


def tensor_leaves(td):
    """The tensor leaves of a tree, by its node kinds (any nesting of containers, lazy
    stacks of members of different shapes included)."""
    tree = _Tree(documents=None)
    _walk(td, tree)
    return [leaf for _key, leaf, _row in tree.leaves]


def value_cells(td, layout: dict) -> list:
    """The shared cells of the non-tensor values of ``td`` listed in ``layout``."""
    tree = _Tree(documents=None)
    _walk(td, tree)
    found = dict(tree.values)
    return [found[tuple(entry["key"])]._shared_value for entry in layout.get("values", ())]
