"""The constructors of MemoryMappedTensor over memory that exists already: a raw file
(:meth:`~FromExistingMemory.from_filename`), a storage (``from_storage``) and the handler
of another tensor (``from_handler``), a mixin of the class.

They map or view that memory and never copy a byte, unlike ``from_tensor`` and the
factories (``empty``, ``zeros``...: factories.py), which allocate a new file or segment.
Each ends in the class's ``_from_backing(backing, byte_offset, dtype, shape)`` or
``_empty_leaf(backing, dtype, shape)`` (tensor.py), which check the bytes' bounds and
pick the class (read-only for a read-only file); here only the backing is found.
"""
from __future__ import annotations

import os

import torch

from shared_td.memmap_tensor.shapes import _contiguous_strides, _extent, checked_shape
from shared_td.storage import anonymous, files
from shared_td.storage.anonymous import Segment
from shared_td.storage.files import FileBacking
from shared_td.storage.slices import whole_storage

__all__ = ["FromExistingMemory"]


class FromExistingMemory:
    """``MemoryMappedTensor.from_filename(...)``, ``from_storage`` and ``from_handler``
    (mixed into MemoryMappedTensor; they rely on its ``_from_backing`` and ``_empty_leaf``)."""

    @classmethod
    def from_filename(cls, filename, dtype, shape, index=None, mode=None):
        """Map an existing raw file (C order, no header) as a tensor of ``dtype``/``shape``.

        A missing file raises ``FileNotFoundError`` (nothing is created); a file shorter
        than the tensor raises :class:`~shared_td.storage.files.FileTooShortError` (a
        ``ValueError``); a longer file is accepted and only its leading bytes are used.
        ``mode="r+"`` maps it shared and raises ``PermissionError`` if it is not
        writable; ``mode="r"`` maps it copy-on-write (writes stay in this process and are
        lost when pickled); ``None`` (default, as in tensordict) is ``"r+"`` for writable
        files and ``"r"`` otherwise. ``index`` is applied to the result. A zero-element
        shape maps nothing and does not need the file.

        Symlinks in ``filename`` are followed once, here: the tensor records the resolved
        path (``os.path.realpath``; tensordict records the path as given), so that its
        path never ends in a link. A FIFO, socket, device or directory is an ``OSError``
        naming it (``IsADirectoryError`` for a directory), found without opening it, and
        a pickled tensor whose file was replaced by one of them, or by a symlink, is a
        :class:`~shared_td.errors.FileReplacedError` in the receiver: mapping any of
        them by path maps a regular file only.

        Example:
            >>> import tempfile
            >>> path = os.path.join(tempfile.mkdtemp(), "x.memmap")
            >>> _ = MemoryMappedTensor.from_tensor(torch.arange(6), filename=path)
            >>> MemoryMappedTensor.from_filename(path, torch.int64, (2, 3), index=1)
            MemoryMappedTensor([3, 4, 5])
        """
        if mode not in (None, "r", "r+"):
            raise ValueError(f"mode must be 'r', 'r+' or None, got {mode!r}.")
        # realpath: the user's own path may run through links (a link to a data disk);
        # what it names now is what the tensor maps, and pickles, from now on
        path = os.path.realpath(os.fsdecode(filename))
        shape = torch.Size(shape)
        if shape.numel() == 0:
            result = cls._empty_leaf(FileBacking(path, None, 0, True), dtype, shape)
        else:
            writable = os.access(path, os.W_OK)
            if mode == "r+" and not writable and os.path.exists(path):
                raise PermissionError(f"Cannot open {path} with mode='r+': the file is "
                                      "not writable.")
            backing = files.open_file_backing(path, shared=mode != "r" and writable)
            result = cls._from_backing(backing, 0, dtype, shape)
        return result if index is None else result[index]

    @classmethod
    def from_storage(cls, storage, *, shape=None, dtype=None, device=None, index=None,
                     filename=None, handler=None):
        """View an existing storage as an MMT, without copying.

        A storage mapped from a file (``torch.UntypedStorage.from_file``) keeps its
        filename and the result pickles by path (*ours*: tensordict's cannot be pickled);
        it is assumed to be a shared mapping. The storage of an existing MMT, or of a
        :class:`Segment` passed as ``handler``, keeps that MMT's backing. Other storages
        give a tensor that cannot be pickled. ``dtype`` defaults to the storage's (``int64`` for an untyped one, as
        in tensordict) and ``shape`` to 1-D. A file moved since this process mapped it
        is recorded by a name it has now (its old name may hold another file): the
        name it was opened by, or ``filename`` (which must name that file); with no such
        name known, a :class:`~shared_td.errors.FileReplacedError` asks for ``filename``.

        Example:
            >>> import tempfile
            >>> path = os.path.join(tempfile.mkdtemp(), "x.memmap")
            >>> _ = MemoryMappedTensor.from_tensor(torch.arange(6.0), filename=path)
            >>> st = torch.UntypedStorage.from_file(path, shared=True, nbytes=24)
            >>> MemoryMappedTensor.from_storage(st, dtype=torch.float32, shape=(2, 3))[1]
            MemoryMappedTensor([3., 4., 5.])
        """
        if device is not None and torch.device(device).type != "cpu":
            raise ValueError(f"{cls.__name__} device must be cpu!")
        if isinstance(storage, torch.TypedStorage):
            dtype = storage.dtype if dtype is None else dtype
            storage = storage.untyped()
        dtype = torch.int64 if dtype is None else dtype
        numel = storage.nbytes() // dtype.itemsize
        shape = torch.Size([numel]) if shape is None else checked_shape(shape)
        # a leaf's own storage is a slice of its mapping's: the backing is the mapping's
        whole, start = whole_storage(storage)
        backing = _storage_backing(whole, filename, handler)
        if backing is not None:
            result = cls._from_backing(backing, start, dtype, shape)
        else:
            if _extent(dtype, shape) * dtype.itemsize > storage.nbytes():
                # set_ would grow (reallocate) the caller's storage: its data moves
                raise RuntimeError(f"shape '{list(shape)}' is invalid for input of size {numel}: "
                                   f"the storage holds {storage.nbytes()} bytes.")
            tensor = torch.empty(0, dtype=dtype).set_(storage, 0, shape,
                                                      _contiguous_strides(shape))
            result = tensor.as_subclass(cls)
        return result if index is None else result[index]

    @classmethod
    def from_handler(cls, handler, dtype, shape, index=None):
        """A tensor of ``dtype``/``shape`` over the memory of ``handler``, without copying.

        The handler is what ``t._handler`` gives: for an anonymous tensor a
        :class:`~shared_td.storage.anonymous.Segment` (a memfd mapped once in this
        process, which pickles by reference), for a file-backed one its
        :class:`~shared_td.storage.files.FileBacking` (*ours*: tensordict's handler is its
        private ``_FileHandler``/shared-memory buffer, and it deprecates this method; here
        it is supported). The tensor starts at the handler's first byte, in C order;
        ``dtype`` may reinterpret the bytes. A shape smaller than the handler uses its
        leading bytes (*ours*: tensordict requires the exact size); a larger one raises
        :class:`~shared_td.storage.files.FileTooShortError` (a ``ValueError``).
        ``index`` is applied to the result, whose :attr:`parent_shape` is ``shape``: a
        view of the handler's memory for a basic index (ints, slices); for an advanced
        one (an index tensor, list or mask), which copies as in torch, a
        MemoryMappedTensor holding the copy in a new anonymous segment (tensordict 0.15.3
        gives a MemoryMappedTensor too, not a plain tensor), which the handler does not see.

        Example:
            >>> t = MemoryMappedTensor.zeros(4, 3)
            >>> u = MemoryMappedTensor.from_handler(t._handler, torch.float32, (4, 3), index=1)
            >>> _ = u.fill_(2.0)
            >>> t[1].tolist(), u.parent_shape
            ([2.0, 2.0, 2.0], torch.Size([4, 3]))
            >>> rows = MemoryMappedTensor.from_handler(t._handler, torch.float32, (4, 3), index=torch.tensor([1, 3]))
            >>> type(rows).__name__, rows.shape, rows.parent_shape
            ('MemoryMappedTensor', torch.Size([2, 3]), torch.Size([4, 3]))
        """
        if not isinstance(handler, (Segment, FileBacking)):
            raise TypeError(
                f"from_handler takes the handler of a MemoryMappedTensor (t._handler: a "
                f"Segment or FileBacking), got {type(handler).__name__}. For a storage use "
                "from_storage, for a path from_filename."
            )
        if isinstance(shape, torch.Tensor):
            raise NotImplementedError("from_handler: nested shapes (a tensor of shapes) are "
                                      "not supported: nested tensors cannot be memory-mapped yet.")
        shape = checked_shape(shape)
        result = cls._from_backing(handler, 0, dtype, shape)
        if index is None:
            return result
        indexed = result[index]
        if isinstance(indexed, cls):
            return indexed
        copy = cls.from_tensor(indexed)  # (advanced indexing copied: see above)
        copy._parent_shape = shape
        return copy


def _storage_backing(storage, filename, handler):
    """The backing that a storage given to from_storage pickles by, or None."""
    if handler is not None:
        if storage.data_ptr() != handler.storage.data_ptr():
            raise ValueError("The storage is not the mapping of the given handler.")
        return handler
    # (a file moved since it was mapped is recorded by a name it has now: find_backing)
    backing = files.find_backing(storage, filename) or anonymous.find_segment(storage)
    own_file = getattr(storage, "filename", None)
    # our own mappings are made through /proc/self/fd paths, which name nothing later
    if backing is None and own_file is not None and not own_file.startswith("/proc/"):
        backing = FileBacking(os.path.abspath(own_file), storage, storage.nbytes(), True)
    if filename is not None:
        if not isinstance(backing, FileBacking):
            raise ValueError(f"The storage was not mapped from a file, so it cannot be "
                             f"associated with {filename}.")
        if os.path.abspath(filename) != backing.path:
            raise RuntimeError(
                "Providing a storage with an associated filename that differs from the "
                "filename argument is not permitted unless filename=None. Got "
                f"filename={filename}, storage.filename={backing.path}"
            )
    return backing
