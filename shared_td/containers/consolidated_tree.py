"""The walks of consolidate() over a tree, and what tells whether it still is consolidated.

None of them is generic (``apply``, ``items``): each visits what a node kind holds, in
``apply`` order (entries in order, nested collections where they stand, lazy-stack
members one after another), so the i-th tensor leaf of :func:`stored_leaves` is the one
that :func:`build_consolidated` and :func:`adopt_views` give the i-th view, and the one
that :func:`leaf_location` names when its copy fails.

A consolidated node keeps its :class:`Layout` in ``__dict__["_consolidated"]``; it still
is consolidated while every leaf is a contiguous view of that buffer
(:func:`leaf_offsets`): after ``unlock_()`` an entry may have been replaced.
"""
from __future__ import annotations

from typing import Any, Iterator

import torch

from shared_td.containers.consolidated_layout import Layout
from shared_td.containers.locking import lock_built
from shared_td.keys import key_repr
from shared_td.persist import nodes
from shared_td.storage.slices import whole_storage
from shared_td.tensorclass_protocol import unwrap_tensorclass

_CPU = torch.device("cpu")
_Tensor = torch.Tensor

# type -> node kind name, learnt once per class from the registered node kinds
_KIND_NAMES: dict[type, str] = {}


def kind_name(node: Any) -> str:
    """The name of ``node``'s registered node kind (``nodes.TENSORDICT``, ...)."""
    cls = type(node)
    name = _KIND_NAMES.get(cls)
    if name is None:
        name = _KIND_NAMES[cls] = nodes.kind_for_object(node).name
    return name


def _is_non_tensor_kind(name: str) -> bool:
    return name in (nodes.NON_TENSOR_DATA, nodes.NON_TENSOR_STACK)


def _collect(node: Any, leaves: list) -> None:
    """Append the tensor leaves of ``node``'s tree in ``apply`` order."""
    kind = _KIND_NAMES.get(type(node)) or kind_name(node)
    if kind == nodes.TENSORDICT:
        for value in node._tensordict.values():
            if isinstance(value, _Tensor):
                leaves.append(value)
            else:
                _collect(value, leaves)
    elif kind == nodes.TENSORCLASS:
        _collect(node._tensordict, leaves)
    elif kind == nodes.LAZY:
        for member in node.tensordicts:
            _collect(member, leaves)


def stored_leaves(obj: Any) -> list[torch.Tensor]:
    """The tensor leaves that ``obj``'s tree holds, in ``apply`` order: the members'
    own of a lazy stack (not the stacks its ``values()`` makes), a tensorclass's fields."""
    leaves: list[torch.Tensor] = []
    _collect(obj, leaves)
    return leaves


def leaf_location(obj: Any, index: int) -> str:
    """How an error names the ``index``-th leaf of :func:`stored_leaves`: its key, and
    for a leaf of a lazy stack's member, which member (its key is that of every member).
    Walked again only when there is an error to name."""
    found = _locate(obj, index, (), ())
    if not isinstance(found, tuple):
        return f"number {index}"
    path, members = found
    where = key_repr(path) if path else "(the root)"
    for stack_path, member in members:
        stack = f" at {key_repr(stack_path)}" if stack_path else ""
        where += f" of member {member} of the lazy stack{stack}"
    return where


def _locate(node: Any, remaining: int, path: tuple, members: tuple) -> tuple | int:
    """``(key path, ((lazy stack path, member index), ...))`` of leaf number ``remaining``
    in ``node``'s tree, or how many leaves are left to skip after this tree."""
    kind = kind_name(node)
    if kind == nodes.TENSORCLASS:
        return _locate(node._tensordict, remaining, path, members)
    if kind == nodes.TENSORDICT:
        for key, value in node._tensordict.items():
            if isinstance(value, _Tensor):
                if remaining == 0:
                    return path + (key,), members
                remaining -= 1
            else:
                remaining = _locate(value, remaining, path + (key,), members)
                if isinstance(remaining, tuple):
                    return remaining
    elif kind == nodes.LAZY:
        for number, member in enumerate(node.tensordicts):
            remaining = _locate(member, remaining, path, members + ((path, number),))
            if isinstance(remaining, tuple):
                return remaining
    return remaining


def locked_path(node: Any, path: tuple = ()) -> tuple | None:
    """The key path of the first locked tensordict of ``node``'s tree (() for the root),
    or None: inplace=True cannot replace the leaves of a locked node."""
    kind = kind_name(node)
    if _is_non_tensor_kind(kind):
        return None
    if kind == nodes.TENSORCLASS:
        return locked_path(node._tensordict, path)
    if node._is_locked:
        return path
    if kind == nodes.LAZY:
        children = [(path, member) for member in node.tensordicts]
    else:
        children = [(path + (key,), value) for key, value in node._tensordict.items()
                    if not isinstance(value, torch.Tensor)]
    for child_path, child in children:
        found = locked_path(child, child_path)
        if found is not None:
            return found
    return None


def build_consolidated(node: Any, views: Iterator[torch.Tensor], layout: Layout,
                       moved_to: torch.device | None = None) -> Any:
    """A new, locked tree like ``node``'s whose tensor leaves are the next ``views``;
    non-tensor values are carried in new wrappers (locking the result must not lock the
    source's), as tensordict does. Its nodes' device: ``moved_to`` for a move (``to``),
    else theirs, the CPU for one on another device (consolidate: the storage is there).
    Built with the containers' unchecked constructors: keys and batch sizes are those
    of a valid tree."""
    kind = _KIND_NAMES.get(type(node)) or kind_name(node)
    if kind == nodes.TENSORDICT:
        entries, children = {}, []
        for key, value in node._tensordict.items():
            if isinstance(value, _Tensor):
                entries[key] = next(views)
            else:
                entries[key] = built = build_consolidated(value, views, layout, moved_to)
                children.append(unwrap_tensorclass(built))
        if moved_to is not None:
            device = moved_to
        else:
            device = node._device
            if device is not None and device.type != "cpu":
                device = _CPU  # consolidate: the storage is on the CPU
        new = type(node)._new_unsafe(entries, node._batch_size, device, node._names)
    elif kind == nodes.TENSORCLASS:
        return type(node)._from_tensordict(build_consolidated(node._tensordict, views, layout, moved_to))
    elif kind == nodes.LAZY:
        children = [build_consolidated(member, views, layout, moved_to) for member in node.tensordicts]
        new = type(node)(*children, stack_dim=node.stack_dim, batch_size=node._member_batch,
                         stack_dim_name=node._stack_dim_name)
        for member, child in zip(node.tensordicts, children):  # (members given as tensorclasses stay so)
            cls = node._tensorclass_of(member)
            if cls is not None:
                new._record_class(child, cls)
    else:  # non-tensor data: no layout of its own; a copy's own (clone(recurse=False) of a
        # shared or memory-mapped value keeps its cell: a write into the copy reached the source)
        new = node.clone()
        lock_built(new, ())
        return new
    new.__dict__["_consolidated"] = layout
    lock_built(new, children)
    return new


def adopt_views(node: Any, views: Iterator[torch.Tensor], layout: Layout) -> None:
    """inplace=True: ``node``'s own tensor leaves become the next ``views`` (its
    entries are unlocked: checked before)."""
    kind = kind_name(node)
    if kind == nodes.TENSORDICT:
        entries = node._tensordict
        for key, value in entries.items():
            if isinstance(value, torch.Tensor):
                entries[key] = next(views)  # an existing key: the dict keeps its size
            else:
                adopt_views(value, views, layout)
        if node._device is not None and node._device.type != "cpu":
            node._device = _CPU
    elif kind == nodes.TENSORCLASS:
        adopt_views(node._tensordict, views, layout)
        return
    elif kind == nodes.LAZY:
        for member in node.tensordicts:
            adopt_views(member, views, layout)
    else:
        return
    # its leaves are no longer the files or shared memory they may have been
    node._is_memmap = node._is_shared = False
    node._memmap_prefix = None
    node.__dict__["_consolidated"] = layout


def leaf_offsets(leaves: list[torch.Tensor], layout: Layout) -> list[int] | None:
    """The byte offset of each of a tree's ``leaves`` in ``layout``'s buffer, or None if
    one is not a contiguous view of it (the tree is no longer consolidated)."""
    offsets = []
    for leaf in leaves:
        offset = _offset_in(layout, leaf)
        if offset is None:
            return None
        offsets.append(offset)
    return offsets


def _offset_in(layout: Layout, leaf: torch.Tensor) -> int | None:
    """The byte offset of ``leaf`` in the layout's buffer, or None if it is not a
    contiguous view of it (an entry replaced after ``unlock_()``). An empty leaf holds no
    bytes: offset 0."""
    if leaf.numel() == 0:
        return 0
    storage = leaf.untyped_storage()
    buffer = layout.buffer.untyped_storage()
    if storage.data_ptr() == buffer.data_ptr():
        start = 0
    else:  # a leaf of a shared or file buffer rebuilt on its own (unpickled): the bytes of
        # the buffer's mapping that its own storage holds (see shared_td.storage.slices)
        whole, start = whole_storage(storage)
        buffer_whole, buffer_start = whole_storage(buffer)
        start -= buffer_start
        if whole.data_ptr() != buffer_whole.data_ptr() or not 0 <= start <= buffer.nbytes() - storage.nbytes():
            return None
    if not leaf.is_contiguous() or leaf.is_conj() or leaf.is_neg():  # (conj()/neg views: their
        return None  # values are not the bytes they view)
    return start + leaf.storage_offset() * leaf.element_size()


def layout_of(obj: Any) -> Layout | None:
    """The layout ``obj`` was consolidated into (None if never)."""
    return unwrap_tensorclass(obj).__dict__.get("_consolidated")
