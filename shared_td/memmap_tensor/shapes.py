"""Shapes and strides of the tensors MemoryMappedTensor builds: parsed and checked once;
where such a tensor starts in its backing, checked to lie within it."""
from __future__ import annotations

import sys

import torch

from shared_td.storage.files import FileBacking, FileTooShortError


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def checked_shape(shape) -> torch.Size:
    """``shape`` as a ``torch.Size``; ``ValueError`` for a negative size (torch.Size takes
    one, and a file would be created before anything failed).

    Example:
        >>> checked_shape([2, 3])
        torch.Size([2, 3])
    """
    size = torch.Size(shape)
    if any(n < 0 for n in size):
        raise ValueError(f"Shape {list(size)} has a negative size: sizes must be 0 or more.")
    return size


# dtypes whose bytes alone are not the tensor (a scale and zero point go with them)
_QUANTIZED = frozenset(getattr(torch, name) for name in ("qint8", "quint8", "qint32", "quint4x2", "quint2x4")
                       if hasattr(torch, name))


def checked_nbytes(shape: torch.Size, dtype: torch.dtype) -> int:
    """The bytes of a new ``dtype`` tensor of ``shape``, checked before any file or
    segment is made for it: ``ValueError`` for a negative size or more bytes than a file
    or a mapping can hold (``sys.maxsize``), ``NotImplementedError`` for a quantized
    dtype (its scale and zero point are no bytes of the tensor).

    Example:
        >>> checked_nbytes(torch.Size([2, 3]), torch.float32)
        24
        >>> checked_nbytes(torch.Size([2**61]), torch.int64)
        Traceback (most recent call last):
        ...
        ValueError: A torch.int64 tensor of shape (2305843009213693952,) needs 18446744073709551616 bytes, ...
    """
    if dtype in _QUANTIZED:
        raise NotImplementedError(f"MemoryMappedTensor cannot store a quantized tensor ({dtype}): "
                                  "dequantize it first (tensor.dequantize()) or store its int_repr().")
    nbytes = _extent(dtype, shape) * dtype.itemsize
    if nbytes > sys.maxsize:
        raise ValueError(f"A {dtype} tensor of shape {tuple(shape)} needs {nbytes} bytes, more "
                         f"than a file or a mapping can hold ({sys.maxsize} bytes).")
    return nbytes


def _parse_shape(size: tuple, shape) -> torch.Size:
    # the shape may come as varargs ints, one sequence, or the shape= keyword
    if size:
        if shape is not None:
            raise TypeError("Pass the shape either positionally or as shape=, not both.")
        first = size[0]
        # one sequence (or 1-D tensor/array) rather than a single int-like size
        if len(size) == 1 and (isinstance(first, (list, tuple)) or getattr(first, "ndim", 0)):
            return checked_shape(first)
        return checked_shape(size)
    if shape is None:
        raise TypeError("Could not find the shape argument in the arguments.")
    return checked_shape(shape)


def _check_cpu(device) -> None:
    if device is not None and torch.device(device).type != "cpu":
        raise RuntimeError("Only CPU tensors are supported.")


def _extent(dtype, shape, stride=None) -> int:
    """How many elements of its storage a ``dtype`` tensor of ``shape`` (and ``stride``;
    C order when None) spans, from its first element to its last; 0 when it has none.

    Sizes are multiplied as Python ints: a shape whose element count overflows 64 bits
    (torch's ``numel()`` then wraps, to 0 for ``(2**62, 2**62)``) is too big, not empty.

    Raises:
        TypeError: ``dtype`` is not a torch dtype.
        ValueError: a negative size or stride, a stride of another rank than the shape.
    """
    if type(dtype) is not torch.dtype:
        raise TypeError(f"The dtype of a tensor over shared memory is a torch.dtype, not {dtype!r}.")
    count = 1
    if stride is None:
        for n in shape:  # a loop, not math.prod: this runs per leaf of a load
            if n < 0:
                raise ValueError(f"A tensor of shape {tuple(shape)}: a size is negative.")
            count *= n
        return count
    if len(stride) != len(shape):
        raise ValueError(f"A tensor of shape {tuple(shape)} cannot have the stride {tuple(stride)}.")
    extent = 1
    for n, step in zip(shape, stride):
        if n < 0 or step < 0:
            raise ValueError(f"A tensor of shape {tuple(shape)} and stride {tuple(stride)}: "
                             "a size or stride is negative.")
        count *= n
        extent += (n - 1) * step
    return extent if count else 0


def _checked_span(backing, byte_offset: int, dtype, shape, stride=None) -> int:
    """How many bytes a ``dtype`` tensor of ``shape`` (and ``stride``) at ``byte_offset``
    of ``backing`` spans, from its first element to its last, once checked to lie within
    the backing's bytes; 0 when it has no element (nothing to map, nothing to check).

    Raises:
        TypeError, ValueError: as :func:`_extent`; ValueError also for a negative offset
            or one that is not a multiple of the dtype's size.
        FileTooShortError: the bytes run past the end of the backing.
    """
    extent = _extent(dtype, shape, stride)
    itemsize = dtype.itemsize
    if byte_offset % itemsize:
        raise ValueError(f"Byte offset {byte_offset} is not a multiple of the "
                         f"{itemsize}-byte size of {dtype}.")
    if extent == 0:
        return 0
    if byte_offset < 0:
        raise ValueError(f"Byte offset {byte_offset} is negative.")
    offset = byte_offset // itemsize
    needed = (offset + extent) * itemsize
    if needed > backing.nbytes:
        where = f"File {backing.path}" if isinstance(backing, FileBacking) else repr(backing)
        raise FileTooShortError(
            f"{where} holds {backing.nbytes} bytes, but a {dtype} tensor of shape "
            f"{tuple(shape)} at byte offset {byte_offset} needs {needed} bytes."
        )
    return extent * itemsize
