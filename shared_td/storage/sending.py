"""How ForkingPicklers send a plain tensor over shared_td's memory: by reference.

A plain ``torch.Tensor`` over an anonymous segment or a mapped file (a view that is not
a MemoryMappedTensor: ``detach()``, ``view()``, ``.data``, the leaves of ``td.detach()``,
``td.view()``, ``td.apply(...)``) is sent by ForkingPickler (multiprocessing's, which
torch.multiprocessing and DataLoader workers use, and multiprocess's) as a view of the
same memory. Torch's own reducer sent ``DupFd(-1)`` for it (it keeps no descriptor of a
mapping made by ``torch.from_file``) and the receiver waited for ever. Importing
:mod:`shared_td.storage` registers the reducers.
"""
from __future__ import annotations

import functools
import multiprocessing.reduction
from typing import Any, Callable

import torch

from shared_td.storage.anonymous import Segment, find_segment
from shared_td.storage.mapping import FILE_ATTRIBUTE, FileBacking, find_backing

__all__ = ["mapped_memory"]

def mapped_memory(storage) -> Segment | FileBacking | None:
    """What ``storage`` (a ``torch.UntypedStorage``) maps of ours, so that a plain tensor
    over it (``detach()``, ``view()``, ``.data`` of a MemoryMappedTensor, the leaves of
    ``td.detach()``) can be sent by reference: its Segment (:func:`find_segment`), or a
    FileBacking naming the file (:func:`~shared_td.storage.mapping.find_backing`, else
    the name it was last mapped under); None for any other storage.

    Example:
        >>> seg = Segment.create(64)
        >>> mapped_memory(seg.storage) is seg, mapped_memory(torch.zeros(1).untyped_storage())
        (True, None)
    """
    # None for every storage that torch allocated itself: they cost one attribute read
    if getattr(storage, "filename", None) is None:
        return None
    segment = find_segment(storage)
    if segment is not None:
        return segment
    backing = find_backing(storage)
    if backing is None:
        # every backing of the file is gone, and plain views keep its mapping: one by
        # the name it was last mapped under (a file renamed since is not found there)
        held = getattr(storage, FILE_ATTRIBUTE, None)
        if held is not None:
            path, nbytes, shared, read_only, inode = held
            backing = FileBacking(path, storage, nbytes, shared, read_only, inode)
    return backing


def _reduce_storage(storage, fallback: Callable) -> tuple:
    """ForkingPickler's reduction of a ``torch.UntypedStorage``: a mapping of ours goes
    as its Segment (a duplicate descriptor, or the ``/proc`` route for multiprocess's
    pickler) or FileBacking (the path), so the receiver maps the same memory and its
    writes reach the sender; torch's ``reduce_storage`` would call ``DupFd(-1)`` for it
    (torch keeps no descriptor of a mapping made by ``torch.from_file``). Any other
    storage goes to ``fallback``: the reducer registered before ours (torch's, or a
    user's), else the storage's own ``__reduce_ex__``."""
    memory = mapped_memory(storage)
    if memory is None:
        return fallback(storage)
    return _storage_of, (memory,)


def _reduce_typed_storage(storage, fallback: Callable) -> tuple:
    # (multiprocess's pickler: torch registers no TypedStorage reducer there, and
    # TypedStorage.__reduce__ pickles the bytes; ours go as their untyped storage)
    if mapped_memory(storage._untyped_storage) is None:
        return fallback(storage)
    return _typed_storage, (storage._untyped_storage, storage.dtype)


def _storage_of(memory) -> Any:
    return memory.storage


def _typed_storage(untyped, dtype) -> Any:
    return torch.TypedStorage(wrap_storage=untyped, dtype=dtype, _internal=True)


def _register_storage_reducers(pickler: type, reducers: dict) -> None:
    """Register ``reducers`` (storage class -> our reduction) with ``pickler`` (a
    ForkingPickler class), each delegating the storages that are not ours to what the
    pickler had registered for that class before (torch registers its reducers when
    ``torch.multiprocessing`` is imported, which ``import torch`` does: they are there
    before any module of shared_td runs). A reducer registered after this import
    replaces ours."""
    registered = getattr(pickler, "_extra_reducers", {})
    for cls, reducer in reducers.items():
        previous = registered.get(cls) or _own_reduce
        pickler.register(cls, functools.partial(reducer, fallback=previous))


def _own_reduce(obj) -> tuple:
    return obj.__reduce_ex__(2)


_register_storage_reducers(multiprocessing.reduction.ForkingPickler, {torch.UntypedStorage: _reduce_storage})
try:
    import multiprocess.reduction
except ImportError:  # (a dependency of shared_td's coordinator only)
    pass
else:  # the coordinator's connections: no duplicate descriptors there (see the module doc)
    _register_storage_reducers(multiprocess.reduction.ForkingPickler, {
        torch.UntypedStorage: _reduce_storage, torch.TypedStorage: _reduce_typed_storage})

