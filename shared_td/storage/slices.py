"""A storage of its own for each leaf of a mapping that holds several (a segment of a
tree, an archive): a slice of the mapping's storage, the same memory.

Why: torch pickles and saves a plain tensor with the *whole* storage it views. A plain
view of a leaf (``reshape``, ``view``, ``flatten``, the leaves of ``td.reshape(...)``)
over the one storage of a tree's segment carried every other leaf's bytes with it: one
1 MiB leaf of a 10 MiB tree pickled as 10 MiB, ``pickle.dumps(td.reshape(...))`` as ten
times the tree, and ``torch.save`` of two such views of different dtypes failed ("Cannot
save multiple tensors or storages that view the same data as different types"), where
tensordict, with a storage per leaf, pickles each leaf's own bytes.

A slice keeps the mapping alive (torch holds the mapping's storage for it) and says
which mapping it cuts and where (:data:`SLICE_ATTRIBUTE`), so that what is sent or
pickled by reference (a MemoryMappedTensor, a plain view through ForkingPickler) still
names the mapping and the slice's offset in it.
"""
from __future__ import annotations

import torch

# torch's slicing of a storage without its Python wrapper's check of a meta device (our
# mappings are CPU memory): 0.3 us instead of 0.75 a leaf, paid by every leaf of a tree
_SLICE = getattr(getattr(torch._C, "StorageBase", None), "__getitem__", None) or torch.UntypedStorage.__getitem__

__all__ = ["SLICE_ATTRIBUTE", "in_shared_mapping", "no_view_tracking", "storage_slice", "storage_slices",
           "whole_storage"]

#: the context to make many tensors ``set_`` to slices in: below torch's dispatch key of
#: views and version counters, which a tensor made from nothing needs neither of (0.85 us
#: a tensor instead of 1.1: the leaves of a tree's memmap_ and of an attach)
no_view_tracking = torch._C._AutoDispatchBelowADInplaceOrView

#: the attribute of a slice's storage that holds ``(the mapping's storage, byte start)``
SLICE_ATTRIBUTE = "_shared_td_slice"


def storage_slice(storage, start: int, nbytes: int):
    """The ``nbytes`` bytes of ``storage`` (a mapping's ``torch.UntypedStorage``) from
    byte ``start``, as a storage of their own over the same memory; ``storage`` itself
    when that is all of it.

    Example:
        >>> import torch
        >>> whole = torch.UntypedStorage(16)
        >>> piece = storage_slice(whole, 8, 4)
        >>> piece.nbytes(), piece.data_ptr() - whole.data_ptr(), whole_storage(piece)[1]
        (4, 8, 8)
        >>> storage_slice(whole, 0, 16) is whole
        True
    """
    if start == 0 and nbytes == storage.nbytes():
        return storage
    piece = _SLICE(storage, slice(start, start + nbytes))
    # (torch keeps one Python object per storage while a tensor views it: the attribute
    # stays with every view of the slice)
    setattr(piece, SLICE_ATTRIBUTE, (storage, start))
    return piece


def storage_slices(storage, spans: list) -> list:
    """:func:`storage_slice` of each ``(start, nbytes)`` of ``spans``, in one loop (the
    leaves of a tree: a call per leaf costs as much as the slice; storage_slice keeps
    its own three lines for the same reason: through this loop, a first attach of 100
    leaves took 23 us more)."""
    whole = storage.nbytes()
    pieces = []
    for start, nbytes in spans:
        if start == 0 and nbytes == whole:
            pieces.append(storage)
            continue
        piece = _SLICE(storage, slice(start, start + nbytes))
        setattr(piece, SLICE_ATTRIBUTE, (storage, start))
        pieces.append(piece)
    return pieces


def whole_storage(storage) -> tuple:
    """``(the mapping's storage, byte offset of storage in it)`` for a slice made by
    :func:`storage_slice`; ``(storage, 0)`` for any other storage."""
    held = getattr(storage, SLICE_ATTRIBUTE, None)
    return (storage, 0) if held is None else held


def in_shared_mapping(storage) -> bool:
    """Whether ``storage`` is a slice of a mapping shared between processes (a segment's,
    a shared file's). Torch says such a slice is not shared (``is_shared()`` is False),
    and its ``share_memory_()`` would copy it away from the memory the other processes
    map: a tree's ``share_memory_()`` leaves such a tensor as it is."""
    held = getattr(storage, SLICE_ATTRIBUTE, None)
    return held is not None and held[0].is_shared()
