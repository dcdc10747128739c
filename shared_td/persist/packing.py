"""How the small leaves of a tree are packed: one layout, one copy.

A tree of many small leaves spends its time in per-leaf calls, not in bytes. So its
small leaves are laid out back to back (:func:`packed_layout`, shared by an anonymous
``memmap_`` and ``consolidate()``) and copied by one torch call (:func:`copy_all`):
into views of the tree's segment that become its leaves (:func:`packed_views`), or,
for leaves written to files, into one staging buffer whose slices are then written
(:func:`stage_small_leaves`).
"""
from __future__ import annotations

import operator

import torch

from shared_td.storage.anonymous import align
from shared_td.storage.slices import no_view_tracking, storage_slices

# (read by map(): a loop in C, 3-4x faster over a tree's 2000 leaves than one in Python)
_itemsize = operator.attrgetter("itemsize")
_nbytes = operator.attrgetter("nbytes")

# Leaves up to this size are packed together (into the tree's segment, or the staging
# buffer of a write to files); bigger ones are written one by one.
_PACKED_LEAF_BYTES = 64 << 10
# The staging buffer of a write to files stays below this size (an extra copy held in
# memory); past it, leaves are taken one by one.
_STAGED_BYTES = 64 << 20


def leaf_nbytes(tensor: torch.Tensor) -> int:
    """The bytes of ``tensor``'s elements (of its file or place in a segment)."""
    return tensor.numel() * tensor.element_size()


def packed_layout(sources: list[torch.Tensor]) -> tuple[list[int], list[int], int]:
    """Where each of ``sources`` lies when a tree's leaves are packed into one buffer
    (the layout of an anonymous memmap_, shared with ``consolidate()``).

    Returns ``(offsets, small, total)``: small leaves (``small``: their indices, in
    packing order) lie back to back from byte 0, the largest element size first (so each
    stays aligned to its dtype); bigger ones start at 64-byte boundaries; ``total`` is
    the number of bytes used.

    Example:
        >>> packed_layout([torch.zeros(3, dtype=torch.int8), torch.zeros(2)])
        ([8, 0], [1, 0], 11)
    """
    element_sizes = list(map(_itemsize, sources))
    sizes = list(map(_nbytes, sources))
    small = [i for i, n in enumerate(sizes) if 0 < n <= _PACKED_LEAF_BYTES]
    if len(set(element_sizes)) > 1:  # (a tree of one element size keeps its order: no sort)
        small.sort(key=lambda i: -element_sizes[i])
    offsets = [0] * len(sources)
    total = 0
    for i in small:
        offsets[i], total = total, total + sizes[i]
    for i, n in enumerate(sizes):
        if n > _PACKED_LEAF_BYTES:
            offsets[i] = align(total)
            total = offsets[i] + n
    return offsets, small, total


def packed_views(storage, sources: list[torch.Tensor], offsets: list[int], order: list[int]) -> list[torch.Tensor]:
    """For each index ``i`` of ``order``, a plain C-order tensor over ``storage`` with
    the dtype and shape of ``sources[i]``, at byte ``offsets[i]`` (a layout of
    :func:`packed_layout`, which keeps them in bounds and aligned: not checked again).

    Each is a tensor of its own over a storage of its own bytes (a slice of ``storage``,
    see shared_td.storage.slices: a plain view of it pickles those, not the whole
    segment), not a view of another one, so that an in-place write to one leaf never
    bumps the version counter (autograd) of another.
    """
    empty_of: dict = {}  # dtype -> an empty tensor: new() of it is the cheapest new tensor
    views = []
    pieces = storage_slices(storage, [(offsets[i], sources[i].nbytes) for i in order])
    with no_view_tracking():  # (each a tensor of its own, made from nothing)
        for i, piece in zip(order, pieces):
            source = sources[i]
            dtype = source.dtype
            empty = empty_of.get(dtype)
            if empty is None:
                empty = empty_of[dtype] = torch.empty(0, dtype=dtype)
            views.append(empty.new().set_(piece, 0, source.shape))
    return views


def _staging_views(buffer: torch.Tensor, sources: list[torch.Tensor], offsets: list[int],
                   order: list[int]) -> list[torch.Tensor]:
    """:func:`packed_views` over a temporary uint8 ``buffer``, made faster: the leaves of
    one dtype that lie back to back are cut from one view by one split (views of one
    tensor share its version counter, which a buffer thrown away after the copy may)."""
    views: list[torch.Tensor] = []
    start, count = 0, len(order)
    while start < count:
        dtype = sources[order[start]].dtype
        end = start + 1
        while end < count and sources[order[end]].dtype == dtype:
            end += 1
        run = [sources[i] for i in order[start:end]]
        sizes = [source.numel() for source in run]
        first = offsets[order[start]]
        parts = buffer[first:first + sum(sizes) * dtype.itemsize].view(dtype).split_with_sizes(sizes)
        views.extend(part if source.dim() == 1 else part.view(source.shape) for part, source in zip(parts, run))
        start = end
    return views


def copy_all(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """Copy each of ``sources`` into its target (same shape and dtype), in one torch
    call for CPU sources: strides, conjugate and negative bits are resolved by the copy."""
    with torch.no_grad():
        if all(source.is_cpu for source in sources):
            torch._foreach_copy_(targets, sources)
        else:
            for target, source in zip(targets, sources):
                target.copy_(source)


def stage_small_leaves(leaves: list) -> None:
    """Give the small leaves among ``leaves`` (the writer's LeafPlans of a write to
    files: ``.source`` is read, ``.data`` set) their bytes, copied into one
    buffer by one call, as ``leaf.data``: six torch calls per leaf to get its bytes
    one by one cost more than writing it. Leaves that would make the buffer bigger
    than ``_STAGED_BYTES`` in all keep ``data=None`` (their bytes are taken one by one)."""
    sources = [leaf.source for leaf in leaves]
    offsets, small, _ = packed_layout(sources)
    if not small:
        return
    end = offsets[small[-1]] + leaf_nbytes(sources[small[-1]])
    if end > _STAGED_BYTES:
        return
    buffer = torch.empty(end, dtype=torch.uint8)
    copy_all(_staging_views(buffer, sources, offsets, small), [sources[i] for i in small])
    data = memoryview(buffer.numpy())
    for i in small:
        offset = offsets[i]
        leaves[i].data = data[offset:offset + leaf_nbytes(sources[i])]
