"""The MemoryMappedTensor class: how a tensor is built over a backing (the hooks that the
loader, the coordinator's attach and the other constructors end in), ``from_tensor``, and
the tensor protocol (indexing and views that stay MMTs, pickling by reference).

Its constructors over memory that exists already (``from_filename``, ``from_storage``,
``from_handler``) are in existing_memory.py, those named as torch's (``empty``,
``zeros``...) in factories.py: mixins of the class. The package's opening says how an
MMT is built.
"""

from __future__ import annotations

import os
import stat

import numpy as np
import torch

from shared_td.memmap_tensor.existing_memory import FromExistingMemory
from shared_td.memmap_tensor.factories import Factories, removed_on_failure
from shared_td.memmap_tensor.shapes import _checked_span, checked_nbytes, checked_shape
from shared_td.storage import files
from shared_td.storage.anonymous import Segment
from shared_td.storage.files import FileBacking
from shared_td.storage.mapping import same_mapping
from shared_td.storage.slices import no_view_tracking, storage_slice, whole_storage

__all__ = ["MemoryMappedTensor", "checked_shape", "maps_file_at"]

# A non-contiguous input up to this size is made contiguous and written with pwrite;
# bigger ones (e.g. an expanded scalar) are copied through the mapping, with no temporary.
_CONTIGUOUS_COPY_LIMIT = 1 << 26


class MemoryMappedTensor(FromExistingMemory, Factories, torch.Tensor):
    """A CPU tensor stored in a file or in anonymous shared memory, shared without copies.

    Pickling (plain ``pickle``, multiprocessing queues, ``multiprocess``/dill, DataLoader
    workers) sends a reference, never the data: the receiver maps the same file or
    segment, and writes on either side are seen by the other. Anonymous tensors can be
    received while their sender holds them; file-backed ones while the file exists.

    Build one with :meth:`from_tensor`, :meth:`empty`, :meth:`zeros`, :meth:`ones`,
    :meth:`full`, the ``*_like`` variants, :meth:`from_filename` or :meth:`from_storage`.
    The constructor dispatches to them: ``MemoryMappedTensor(path, dtype=, shape=)``
    maps a file, a storage goes to :meth:`from_storage`, and a tensor is copied as by
    :meth:`from_tensor` (*ours*: tensordict re-wraps a plain tensor without any backing,
    giving a tensor that cannot be pickled).

    ``torch.unbind``/``torch.chunk`` (function forms) return plain tensor views; the
    methods ``t.unbind()``/``t.chunk()``/``t.split()`` and ``torch.split`` return MMTs.

    Example:
        >>> t = MemoryMappedTensor.zeros(2, 3)
        >>> t[0] = 1.0
        >>> t
        MemoryMappedTensor([[1., 1., 1.],
                            [0., 0., 0.]])
        >>> type(t[1]).__name__, type(t + 1).__name__
        ('MemoryMappedTensor', 'Tensor')
    """

    __torch_function__ = torch._C._disabled_torch_function_impl

    #: the FileBacking or Segment whose storage this tensor views; None for an empty
    #: anonymous tensor (or a tensor made with ``as_subclass``, which cannot be pickled)
    _backing = None
    #: the shape this tensor's first MMT was built with (views keep it); see parent_shape
    _parent_shape = None

    def __new__(cls, source, *, dtype=None, shape=None, index=None, device=None,
                handler=None, filename=None):
        if device is not None and torch.device(device).type != "cpu":
            raise ValueError(f"{cls.__name__} device must be cpu!")
        if isinstance(source, (str, os.PathLike)):
            if filename is not None:
                raise TypeError("Duplicated filename argument.")
            if dtype is None or shape is None:
                raise TypeError("dtype and shape are required to map a file.")
            return cls.from_filename(source, dtype, shape, index)
        if isinstance(source, (torch.UntypedStorage, torch.TypedStorage)):
            return cls.from_storage(source, shape=shape, dtype=dtype, index=index,
                                    filename=filename, handler=handler)
        if handler is not None:
            result = cls._from_backing(handler, 0, dtype, shape)
        else:
            if dtype is not None and filename is not None:
                raise TypeError("Cannot pass new dtype if source is provided.")
            tensor = source if isinstance(source, torch.Tensor) else torch.as_tensor(source)
            if dtype is not None:
                tensor = tensor.to(dtype)
            result = cls.from_tensor(tensor, filename=filename, shape=shape)
        return result if index is None else result[index]

    def __init__(self, *args, **kwargs):
        # __new__ did all the work; torch.Tensor.__init__ would reject the arguments
        pass

    # ----------------------------------------------------------------- internal hooks

    @classmethod
    def _from_backing(cls, backing, byte_offset: int, dtype: torch.dtype, shape,
                      stride=None) -> MemoryMappedTensor:
        """Build an MMT over ``backing`` (a FileBacking or Segment) at ``byte_offset``.

        The hook for code that packs many leaves into one segment or file. ``stride``
        defaults to C order. Raises ``ValueError`` for a misaligned offset and
        :class:`FileTooShortError` (a ``ValueError``) when the bytes run past the backing.

        Example:
            >>> seg = Segment.create(128)
            >>> a = MemoryMappedTensor._from_backing(seg, 0, torch.int64, (2,))
            >>> b = MemoryMappedTensor._from_backing(seg, 64, torch.float32, (3,))
            >>> b._backing is a._backing, b._byte_offset()
            (True, 64)
        """
        shape = torch.Size(shape)
        view = cls._checked_view(backing, byte_offset, dtype, shape, stride)
        if view is None:
            return cls._empty_leaf(backing, dtype, shape)
        result = view.as_subclass(_class_for(cls, backing))
        result._backing = backing
        result._parent_shape = shape
        return result

    @staticmethod
    def _checked_view(backing, byte_offset: int, dtype: torch.dtype, shape: torch.Size, stride=None):
        """The plain tensor over ``backing`` that :meth:`_from_backing` wraps, after the
        checks of :func:`_checked_span` (its errors); None for zero elements (nothing
        to map)."""
        span = _checked_span(backing, byte_offset, dtype, shape, stride)
        if not span:
            return None
        # over a storage of its own bytes (see shared_td.storage.slices): a plain view
        # of it pickles those, not the whole segment or file
        storage = storage_slice(backing.storage, byte_offset, span)
        if stride is None:  # C order (a leaf of a load or a write): set_ makes the strides
            return torch.empty(0, dtype=dtype).set_(storage, 0, shape)
        return torch.empty(0, dtype=dtype).set_(storage, 0, shape, stride)

    @staticmethod
    def _leaf_specs(references: list) -> list:
        """The anonymous leaves that :meth:`_reference` described (a published version's),
        each checked to lie within its segment (the errors of :func:`_checked_span`; a
        zero-element leaf, which pickles as itself, is refused), as ``(storage, empty,
        shape, strides, segment, parent shape)`` for :meth:`_make_leaves`: ``storage`` of
        the leaf's own bytes (see shared_td.storage.slices), ``empty`` a tensor of its
        dtype with no elements. Each layout (dtype, shape, strides) is checked once: a
        leaf of a layout met before costs its offset's checks only."""
        layouts: dict = {}  # (dtype, shape, strides) -> (item size, bytes spanned, empty, Size)
        specs = []
        for backing, dtype, shape, stride, byte_offset, parent_shape in references:
            layout = layouts.get((dtype, shape, stride))
            if (layout is None or type(backing) is not Segment or byte_offset < 0
                    or byte_offset % layout[0] or byte_offset + layout[1] > backing.nbytes):
                # a new layout, or a leaf that does not fit: the whole check (its error)
                itemsize, span = _checked_layout(backing, byte_offset, dtype, shape, stride)
                with torch.inference_mode(False):  # a normal tensor, so are the leaves
                    empty = torch.empty(0, dtype=dtype)
                # (one torch.Size per layout: each is an object the garbage collector
                # tracks for the leaf's life, and a tree has few shapes)
                layout = layouts[dtype, shape, stride] = (itemsize, span, empty, torch.Size(shape))
            size = layout[3] if parent_shape == shape else torch.Size(parent_shape)
            storage = storage_slice(backing.storage, byte_offset, layout[1])
            specs.append((storage, layout[2], shape, stride, backing, size))
        return specs

    @staticmethod
    def _make_leaves(specs: list) -> list:
        """New MMTs over the ``specs`` of :meth:`_leaf_specs`, each a new tensor ``set_``
        to its storage (``new()`` of an empty one, under ``no_view_tracking``: ~0.9 us a
        leaf here, where a base tensor made per leaf at the first attach and viewed with
        ``as_strided`` at each cost 1.3 us more at the first attach of a version, which
        every refresh after a publish is, and 0.35 us less at a later one), made an MMT
        by assigning its class (as :func:`basic_views` does; ``as_subclass`` would make
        a second tensor). Each is
        a tensor of its own, with its own version counter: an in-place write to one
        leaf never fails autograd's backward of another that it saved. A normal tensor
        even in inference mode: an attach under ``inference_mode()`` must not make
        inference tensors (no in-place write outside it)."""
        made = []
        with torch.inference_mode(False), no_view_tracking():
            for storage, empty, shape, stride, backing, parent_shape in specs:
                leaf = empty.new().set_(storage, 0, shape, stride)
                leaf.__class__ = MemoryMappedTensor
                leaf._backing = backing
                leaf._parent_shape = parent_shape
                made.append(leaf)
        return made

    @classmethod
    def _empty_leaf(cls, backing, dtype, shape) -> MemoryMappedTensor:
        # zero elements: nothing to map; only a file backing's path is worth keeping
        result = torch.empty(shape, dtype=dtype).as_subclass(_class_for(cls, backing))
        result._backing = backing if isinstance(backing, FileBacking) else None
        result._parent_shape = torch.Size(shape)
        return result

    @classmethod
    def _wrap_views(cls, backing, views: list, shapes: dict | None = None) -> list:
        """MMTs of ``backing`` over ``views``: plain tensors that already view its
        storage (the leaves of a tree packed into one segment or file, laid out and
        bounds-checked by their packer), without ``_from_backing``'s per-leaf checks.
        The views themselves become the MMTs (their class is assigned, as in
        :meth:`_make_leaves`: ``as_subclass`` would make a second tensor of each, 3x the
        time), so a caller passes views that nothing else holds.

        Leaves of equal shapes share one ``torch.Size`` (``shapes``: the ones met so far,
        kept by a caller that wraps a tree's leaves in several calls): each is an object
        the garbage collector tracks for the leaf's life, and a big tree has few shapes."""
        klass = _class_for(cls, backing)
        if shapes is None:
            shapes = {}
        wrapped = []
        for view in views:
            view.__class__ = klass
            view._backing = backing
            shape = view.shape
            view._parent_shape = shapes.setdefault(shape, shape)
            wrapped.append(view)
        return wrapped

    def _byte_offset(self) -> int:
        """Byte offset of this tensor's first element in its backing's storage."""
        return whole_storage(self.untyped_storage())[1] + self.storage_offset() * self.element_size()

    def _wrap(self, tensor: torch.Tensor):
        # a result that still views our storage is an MMT of the same backing; a copy
        # (advanced indexing) is a plain tensor
        if tensor.untyped_storage().data_ptr() != self.untyped_storage().data_ptr():
            return tensor
        result = tensor.as_subclass(type(self))
        result._backing = self._backing
        result._parent_shape = self._parent_shape
        return result

    @classmethod
    def _allocate(cls, shape: torch.Size, dtype, filename, existsok, data=None):
        """New storage for ``shape``/``dtype``, pre-filled with bytes ``data`` if given.

        Returns ``(tensor, fresh)``; ``fresh`` means the bytes are known to be zero (a
        new file or segment and no data written).
        """
        nbytes = checked_nbytes(shape, dtype)  # (its errors come before any file exists)
        if filename is None:
            if nbytes == 0:
                return cls._empty_leaf(None, dtype, shape), True
            segment = Segment.create(nbytes)
            if data is not None:
                segment.write(0, data)
            return cls._from_backing(segment, 0, dtype, shape), data is None
        path = os.path.abspath(os.fsdecode(filename))
        backing, created = files.create_file(path, nbytes, existsok=existsok, data=data)
        if nbytes == 0:
            return cls._empty_leaf(FileBacking(path, None, 0, True), dtype, shape), True
        return cls._from_backing(backing, 0, dtype, shape), created and data is None

    # ------------------------------------------------------------------- constructors

    @classmethod
    def from_tensor(cls, input, *, filename=None, existsok: bool = False,
                    copy_existing: bool = False, copy_data: bool = True, shape=None):
        """Return a MemoryMappedTensor holding a copy of ``input``.

        An MMT ``input`` is returned as is when ``filename`` is None and it is anonymous,
        or when ``filename`` is its own file, the very file it maps: if that file was
        deleted or replaced since, ``input`` is written to ``filename`` again (over a
        new file there only with ``existsok=True``). A file-backed MMT with ``filename=None`` is
        copied to anonymous memory; to another file only with ``copy_existing=True``.
        ``copy_data=False`` allocates without copying (zeros for a new file or segment,
        old bytes of a reused file). ``shape`` broadcasts ``input`` to another shape.
        Non-CPU inputs are copied to CPU. Raises ``TypeError`` for numpy arrays and
        ``RuntimeError`` for tensors that require grad or existing files without
        ``existsok``.

        Example:
            >>> t = MemoryMappedTensor.from_tensor(torch.arange(3))
            >>> t, MemoryMappedTensor.from_tensor(t) is t
            (MemoryMappedTensor([0, 1, 2]), True)
        """
        if filename is not None:
            filename = os.fsdecode(filename)  # bytes name the file they name for os.open
        if isinstance(input, MemoryMappedTensor):
            backing = input._backing
            own = backing.path if isinstance(backing, FileBacking) else None
            if filename is None and own is None:
                return input
            if filename is not None and own is not None:
                same = _names_path(filename, own)
                # a copy-on-write mapping may hold writes that its file lacks
                if same and backing.shared:
                    if maps_file_at(backing, own):
                        return input
                    # its file was deleted or replaced since it was mapped: returning
                    # input would leave the file at ``filename`` without its values
                    if not existsok and os.path.lexists(own):
                        raise RuntimeError(
                            f"The file {own} is no longer the file this tensor maps: it was "
                            "replaced (or resized) since the tensor was mapped. Pass "
                            "existsok=True to write this tensor's values into the file there "
                            "now, or map that file with MemoryMappedTensor.from_filename("
                            f"{own!r}, dtype, shape)."
                        )
                if not same and not copy_existing:
                    raise RuntimeError(
                        "A filename was provided but the tensor already has a file "
                        f"associated ({own}). To copy the tensor onto the new location, "
                        "pass copy_existing=True."
                    )
        elif isinstance(input, np.ndarray):
            raise TypeError("Convert input to torch.Tensor before calling "
                            "MemoryMappedTensor.from_tensor.")
        elif not isinstance(input, torch.Tensor):
            raise TypeError(f"from_tensor expects a torch.Tensor, got {type(input).__name__}.")
        if input.requires_grad:
            raise RuntimeError("MemoryMappedTensor.from_tensor is incompatible with "
                               "tensor.requires_grad.")
        if input.is_nested or input.layout != torch.strided:
            raise NotImplementedError("MemoryMappedTensor stores strided dense tensors only.")
        if hasattr(input, "full_tensor"):  # a DTensor: gather it first
            input = input.full_tensor()
        shape = input.shape if shape is None else checked_shape(shape)
        if copy_data and shape != input.shape:
            input.expand(shape)  # not broadcastable: copy_'s error, before any file exists
        nbytes = checked_nbytes(shape, input.dtype)
        data = None
        if copy_data and nbytes and input.shape == shape and (
            input.is_contiguous() or nbytes <= _CONTIGUOUS_COPY_LIMIT
        ):
            # bytes go in with pwrite before mapping: the fast path for big leaves
            data = files.tensor_bytes(input.cpu())
        result, fresh = cls._allocate(shape, input.dtype, filename, existsok, data)
        if copy_data and nbytes and data is None:
            with removed_on_failure(result, fresh):  # (fresh: a file this call made)
                result.copy_(input)
        return result

    # ---------------------------------------------------------------- tensor protocol

    @property
    def _handler(self):
        """What this tensor's memory is, for :meth:`from_handler`: its Segment (anonymous)
        or FileBacking (a file); None for an empty anonymous tensor."""
        return self._backing

    def is_shared(self) -> bool:
        """True when its memory is shared between processes already: an anonymous
        segment, or a file mapped shared (torch's own answer is False for a leaf of a
        segment or file that holds several, whose storage is a slice of the mapping's:
        see shared_td.storage.slices). A private (copy-on-write) mapping: torch's answer.

        Example:
            >>> MemoryMappedTensor.zeros(3).is_shared()
            True
        """
        backing = self._backing
        if backing is None or not getattr(backing, "shared", True):
            return super().is_shared()
        return True

    def share_memory_(self) -> "MemoryMappedTensor":
        """Self, when its memory is shared already (:meth:`is_shared`): torch would copy a
        leaf of a segment or file into new shared memory, away from the memory the other
        processes map."""
        return self if self.is_shared() else super().share_memory_()

    @property
    def parent_shape(self) -> torch.Size:
        """The shape of the tensor that this tensor was built from.

        The shape a constructor (``empty``, ``from_filename``, ``from_handler``, a load...)
        gave, before its ``index``; views made by indexing, ``unbind``, ``split`` or
        ``chunk`` keep it, and so does pickling. A tensor made otherwise (``as_subclass``)
        gives its own shape. (tensordict 0.15.3 deprecates it; it is kept here.)

        Example:
            >>> t = MemoryMappedTensor.empty(4, 3)
            >>> t[1:].parent_shape
            torch.Size([4, 3])
        """
        return self.shape if self._parent_shape is None else self._parent_shape

    @property
    def filename(self) -> str:
        """Absolute path of the file holding the data; ``RuntimeError`` when anonymous."""
        backing = self._backing
        if isinstance(backing, FileBacking):
            return backing.path
        raise RuntimeError("The MemoryMappedTensor has no file associated.")

    def __getitem__(self, item):
        return self._wrap(super().__getitem__(item))

    def unbind(self, dim=0):
        """Views along ``dim``, as :meth:`torch.Tensor.unbind`, each an MMT.

        Example:
            >>> [type(x).__name__ for x in MemoryMappedTensor.zeros(2, 2).unbind(0)]
            ['MemoryMappedTensor', 'MemoryMappedTensor']
        """
        return tuple(self._wrap(piece) for piece in super().unbind(dim))

    def split(self, split_size, dim=0):
        """Views of ``split_size`` along ``dim``, as :meth:`torch.Tensor.split`, each an MMT.

        Example:
            >>> [p.shape[0] for p in MemoryMappedTensor.zeros(5).split(2)]
            [2, 2, 1]
        """
        return tuple(self._wrap(piece) for piece in super().split(split_size, dim))

    def chunk(self, chunks, dim=0):
        """``chunks`` views along ``dim``, as :meth:`torch.Tensor.chunk`, each an MMT.

        Example:
            >>> [p.shape[0] for p in MemoryMappedTensor.zeros(5).chunk(2)]
            [3, 2]
        """
        return tuple(self._wrap(piece) for piece in super().chunk(chunks, dim))

    def __reduce_ex__(self, protocol):
        backing = self._backing
        if self.numel() == 0:
            path = backing.path if isinstance(backing, FileBacking) else None
            return _rebuild_empty, (path, self.dtype, tuple(self.shape))
        return _rebuild, self._reference()

    def __reduce__(self):
        # object.__reduce__ (torch.Tensor has none of its own) fails for a tensor subclass
        # ("Cannot directly construct TensorBase"); code that calls it directly, as
        # tensordict's own MemoryMappedTensor.__reduce__ allows, gets what pickle uses
        return self.__reduce_ex__(2)

    def _reference(self) -> tuple:
        """What this (non-empty) tensor pickles as: ``(backing, dtype, shape, stride,
        byte offset, parent shape)``, the arguments of its rebuild. RuntimeError when it
        has no backing or no longer views it."""
        backing = self._backing
        if backing is None:
            raise RuntimeError(
                "Could not find handler or filename: this MemoryMappedTensor has no file "
                "or shared-memory segment (was it made with as_subclass?), so it cannot "
                "be pickled by reference."
            )
        if whole_storage(self.untyped_storage())[0].data_ptr() != backing.storage.data_ptr():
            raise RuntimeError("This MemoryMappedTensor no longer views the storage of "
                               f"{backing!r} (was set_ called on it?); cannot pickle it.")
        return (backing, self.dtype, tuple(self.shape), self.stride(),
                self._byte_offset(), tuple(self.parent_shape))

    def __deepcopy__(self, memo):
        # A deep copy owns new memory: an anonymous copy (a filename cannot be invented).
        result = type(self).from_tensor(self.as_subclass(torch.Tensor))
        memo[id(self)] = result
        return result


_TENSOR_GETITEM = torch.Tensor.__getitem__


_NO_SUBCLASS_DISPATCH = torch._C.DisableTorchFunctionSubclass


def basic_views(leaves: list, index, out: dict) -> None:
    """``out[key] = leaf[index]`` for each ``(key, leaf)`` of ``leaves`` (exact
    MemoryMappedTensors) and an ``index`` of ints, slices, None and Ellipsis only: the
    memory-mapped leaves of a tensordict's row read, in one call instead of one method
    call per leaf. Each is always a view of its leaf's storage, so ``_wrap``'s check of
    the storage is skipped (only for this exact class: a read-only tensor's views go
    through its ``__torch_function__``).

    Torch returns a new tensor object for every index, even ``t[...]`` (an alias), that
    no one else holds yet, so it is made an MMT by assigning its class: the same object
    ``as_subclass`` would give, without the second alias tensor that ``as_subclass``
    makes (as costly as the indexing itself, ~1 µs a leaf).

    Torch looks up ``__torch_function__`` on every subclass it indexes, even this class
    that disables it (~350 instructions a leaf; entering the dispatch-off context costs
    about as much as one lookup): with subclass dispatch off it does not, and gives the
    same plain view (none of these leaves overrides torch)."""
    with _NO_SUBCLASS_DISPATCH():
        for key, leaf in leaves:
            view = _TENSOR_GETITEM(leaf, index)
            view.__class__ = MemoryMappedTensor
            view._backing = leaf._backing
            view._parent_shape = leaf._parent_shape
            out[key] = view

#: ReadOnlyMemoryMappedTensor, registered by read_only.py when it is imported (the
#: package's __init__ imports it, so it is there before any tensor is built).
READ_ONLY_CLASS: type | None = None


def _class_for(cls, backing) -> type:
    """The class of a tensor over ``backing``: read-only for a read-only file, else
    ``cls`` (a read-only tensor's new storage is writable)."""
    if isinstance(backing, FileBacking) and backing.read_only:
        return READ_ONLY_CLASS
    return MemoryMappedTensor if cls is READ_ONLY_CLASS else cls


def _rebuild(backing, dtype, shape, stride, byte_offset, parent_shape=None):
    result = MemoryMappedTensor._from_backing(backing, byte_offset, dtype, shape, stride)
    if parent_shape is not None:
        result._parent_shape = torch.Size(parent_shape)
    return result


def _rebuild_empty(path, dtype, shape):
    backing = None if path is None else FileBacking(path, None, 0, True)
    return MemoryMappedTensor._empty_leaf(backing, dtype, torch.Size(shape))


def _reduce(tensor):
    return tensor.__reduce_ex__(2)


def _checked_layout(backing, byte_offset: int, dtype, shape, stride) -> tuple[int, int]:
    """``(item size, bytes spanned)`` of a published leaf (see ``_leaf_specs``), once
    checked to lie within ``backing``, a Segment, and to have elements."""
    if type(backing) is not Segment:
        raise TypeError(f"A published leaf lives in a shared-memory segment, not in {type(backing).__name__}.")
    span = _checked_span(backing, byte_offset, dtype, shape, stride)
    if not span:
        raise ValueError(f"A {dtype} leaf of shape {tuple(shape)} has no element: a "
                         "published leaf of a segment always has some.")
    return dtype.itemsize, span


def _names_path(path, own: str) -> bool:
    """Whether the user's ``path`` names the recorded path ``own``: as an absolute path
    (the loader and ``from_tensor`` record those), or resolved (``from_filename``
    records the ``realpath``, which is computed only if the first test fails)."""
    path = os.path.abspath(os.fsdecode(path))
    return path == own or os.path.realpath(path) == own


def maps_file_at(backing: FileBacking, path: str) -> bool:
    """Whether ``backing`` maps the file at ``path`` now: this process's mapping of that
    inode is ``backing``'s (itself, or the one it shares under another name), and the
    file still holds all the bytes mapped (one lstat; reading past a shrunk file's end
    is a SIGBUS). An empty leaf maps no file: always true."""
    if backing.storage is None:
        return True
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return (stat.S_ISREG(st.st_mode) and st.st_size >= backing.nbytes
            and same_mapping(files.mapped_backing(st), backing))
