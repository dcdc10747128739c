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

import errno
import functools
import multiprocessing.reduction
from typing import Any, Callable

import torch

from shared_td.storage.anonymous import SEGMENT_ATTRIBUTE, Segment, find_segment
from shared_td.errors import FileReplacedError
from shared_td.storage.mapping import FILE_ATTRIBUTE, FileBacking, cached_backing, find_backing, inode_at
from shared_td.storage.slices import storage_slice, whole_storage

__all__ = ["backing_to_send", "mapped_memory"]

def mapped_memory(storage) -> Segment | FileBacking | None:
    """What ``storage`` (a ``torch.UntypedStorage``) maps of ours, so that a plain tensor
    over it (``detach()``, ``view()``, ``.data`` of a MemoryMappedTensor, the leaves of
    ``td.detach()``) can be sent by reference: its Segment (:func:`find_segment`), or a
    FileBacking naming the file by a path that names it now (:func:`backing_to_send`:
    a FileReplacedError when none does); None for any other storage.

    Example:
        >>> seg = Segment.create(64)
        >>> mapped_memory(seg.storage) is seg, mapped_memory(torch.zeros(1).untyped_storage())
        (True, None)
    """
    # Ours by our own attributes only (never by ``filename``: a private mapping has
    # none, a user's torch.from_file has one): any other storage costs two attribute
    # reads, no search of this process's segments and files
    if getattr(storage, SEGMENT_ATTRIBUTE, None) is not None:
        return find_segment(storage)
    return backing_to_send(storage)


def backing_to_send(storage) -> FileBacking | None:
    """A backing naming the file that ``storage`` maps, by a path that names that very
    file now, for sending a plain view of it by reference; None when ``storage`` is no
    mapping of ours (it carries no ``FILE_ATTRIBUTE``: no search). A private
    (copy-on-write) mapping's too: the receiver maps the file privately, as for a
    MemoryMappedTensor. A file moved, deleted or replaced since it was mapped, with no
    live name of it known, is a :class:`FileReplacedError`, as
    :func:`~shared_td.storage.mapping.find_backing` says (its path names other bytes now).

    Example:
        >>> import tempfile
        >>> from shared_td.storage.mapping import open_file_backing
        >>> with tempfile.NamedTemporaryFile() as f:
        ...     _ = f.write(b"abcd"); f.flush()
        ...     backing = open_file_backing(f.name)
        ...     backing_to_send(backing.storage) is backing, backing_to_send(torch.zeros(1).untyped_storage())
        (True, None)
    """
    held = getattr(storage, FILE_ATTRIBUTE, None)
    if held is None:
        return None
    path, nbytes, shared, read_only, inode, mapped = held
    if mapped is None:  # (the file was gone when it was recorded: what find_backing finds)
        return find_backing(storage)
    cached = cached_backing(mapped) if shared else None
    origin = None if cached is None else cached.origin or cached
    if origin is not None and origin.storage is storage:
        for candidate in (cached, origin, *(origin.aliases or ())):
            if inode_at(candidate.path) == mapped:
                return candidate
    if inode_at(path) == mapped:  # (a live mapping keeps its inode: never reused meanwhile)
        return FileBacking(path, storage, nbytes, shared, read_only, inode, mapped=mapped)
    raise FileReplacedError(errno.ENOENT, (
        f"The file this tensor maps is no longer at {path} (it was moved, deleted or replaced "
        "since it was mapped), and no name of it is known: it cannot be sent by reference. "
        "Send a copy (tensor.clone()), or map the file again by its new name."))


def _reduce_storage(storage, fallback: Callable) -> tuple:
    """ForkingPickler's reduction of a ``torch.UntypedStorage``: a mapping of ours goes
    as its Segment (a duplicate descriptor, or the ``/proc`` route for multiprocess's
    pickler) or FileBacking (the path), so the receiver maps the same memory and its
    writes reach the sender; torch's ``reduce_storage`` would call ``DupFd(-1)`` for it
    (torch keeps no descriptor of a mapping made by ``torch.from_file``). Any other
    storage goes to ``fallback``: the reducer registered before ours (torch's, or a
    user's), else the storage's own ``__reduce_ex__``."""
    whole, start = whole_storage(storage)  # a leaf's own bytes: a slice of the mapping's
    memory = mapped_memory(whole)
    if memory is None:
        return fallback(storage)
    if whole is storage:
        return _storage_of, (memory,)
    return _storage_slice_of, (memory, start, storage.nbytes())


def _reduce_typed_storage(storage, fallback: Callable) -> tuple:
    # (multiprocess's pickler: torch registers no TypedStorage reducer there, and
    # TypedStorage.__reduce__ pickles the bytes; ours go as their untyped storage)
    if mapped_memory(whole_storage(storage._untyped_storage)[0]) is None:
        return fallback(storage)
    return _typed_storage, (storage._untyped_storage, storage.dtype)


def _storage_of(memory) -> Any:
    return memory.storage


def _storage_slice_of(memory, start: int, nbytes: int) -> Any:
    return storage_slice(memory.storage, start, nbytes)


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

