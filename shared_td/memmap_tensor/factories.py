"""The constructors of MemoryMappedTensor named as torch's (``empty``, ``zeros``, ``ones``,
``full`` and their ``*_like``), a mixin of the class: each is one call of the class's
``_new_filled(shape, dtype, device, filename, existsok, fill_value)``, which allocates
with the class's ``_allocate`` (tensor.py).

A constructor that fails leaves no file behind: a fill value that the dtype cannot hold
is refused before the file exists, and a file this call made is removed when any later
step fails (:func:`removed_on_failure`), so a retry does not find it "already exists"."""
from __future__ import annotations

import contextlib
import math
import os

import torch

from shared_td.memmap_tensor.shapes import _check_cpu, _parse_shape, checked_nbytes
from shared_td.storage.files import FileBacking
from shared_td.storage.mapping import mapped_backing, same_mapping

__all__ = ["Factories", "removed_on_failure", "zero_bytes"]


@contextlib.contextmanager
def removed_on_failure(result, created: bool):
    """Run the block that fills ``result`` (a new MMT); if it raises and ``created`` (the
    constructor made ``result``'s file), remove that file: only if its path still names
    the inode that ``result`` maps (this process's mapping of the inode at the path is
    ``result``'s), never a file put there since.

    Example:
        >>> import tempfile
        >>> from shared_td import MemoryMappedTensor
        >>> path = os.path.join(tempfile.mkdtemp(), "x.memmap")
        >>> t = MemoryMappedTensor.empty(2, filename=path)
        >>> with removed_on_failure(t, True):
        ...     raise ValueError("a failed fill")
        Traceback (most recent call last):
        ...
        ValueError: a failed fill
        >>> os.path.exists(path)
        False
    """
    try:
        yield
    except BaseException:
        backing = getattr(result, "_backing", None)
        if created and isinstance(backing, FileBacking) and backing.storage is not None:
            try:
                if same_mapping(mapped_backing(os.lstat(backing.path)), backing):
                    os.unlink(backing.path)
            except OSError:
                pass  # (the error to raise is the one that failed the constructor)
        raise


def zero_bytes(value) -> bool:
    """Whether filling with ``value`` writes zero bytes only, as a new file or segment
    holds already (so the fill can be skipped): ``0``, ``False``, ``0.0``, ``0j``; not
    ``-0.0`` (its sign bit is set), nor a value of another type (a tensor: it is filled).

    Example:
        >>> zero_bytes(0), zero_bytes(0.0), zero_bytes(-0.0), zero_bytes(complex(0.0, -0.0))
        (True, True, False, False)
    """
    kind = type(value)
    if kind is int or kind is bool:
        return value == 0
    if kind is float:
        return value == 0 and math.copysign(1.0, value) > 0
    if kind is complex:
        return zero_bytes(value.real) and zero_bytes(value.imag)
    return False


class Factories:
    """``MemoryMappedTensor.empty(...)`` and its kin (mixed into MemoryMappedTensor)."""

    @classmethod
    def empty(cls, *size, shape=None, dtype=None, device=None, filename=None,
              existsok: bool = False):
        """Return an uninitialised MMT (zero-filled when its storage is new).

        The shape is given as ints, as one sequence, or as ``shape=``. ``device`` other
        than CPU raises ``RuntimeError``; an existing ``filename`` needs ``existsok``.

        Example:
            >>> MemoryMappedTensor.empty((2, 3), dtype=torch.int64).shape
            torch.Size([2, 3])
        """
        return cls._new_filled(_parse_shape(size, shape), dtype, device, filename,
                               existsok, None)

    @classmethod
    def zeros(cls, *size, shape=None, dtype=None, device=None, filename=None,
              existsok: bool = False):
        """Return an MMT of zeros; arguments as in :meth:`empty`.

        Example:
            >>> MemoryMappedTensor.zeros(2)
            MemoryMappedTensor([0., 0.])
        """
        return cls._new_filled(_parse_shape(size, shape), dtype, device, filename,
                               existsok, 0)

    @classmethod
    def ones(cls, *size, shape=None, dtype=None, device=None, filename=None,
             existsok: bool = False):
        """Return an MMT of ones; arguments as in :meth:`empty`.

        Example:
            >>> MemoryMappedTensor.ones(2, dtype=torch.int32)
            MemoryMappedTensor([1, 1], dtype=torch.int32)
        """
        return cls._new_filled(_parse_shape(size, shape), dtype, device, filename,
                               existsok, 1)

    @classmethod
    def full(cls, *size, fill_value, shape=None, dtype=None, device=None, filename=None,
             existsok: bool = False):
        """Return an MMT filled with ``fill_value``; other arguments as in :meth:`empty`.

        Example:
            >>> MemoryMappedTensor.full(3, fill_value=2, dtype=torch.int64)
            MemoryMappedTensor([2, 2, 2])
        """
        return cls._new_filled(_parse_shape(size, shape), dtype, device, filename,
                               existsok, fill_value)

    @classmethod
    def empty_like(cls, input, *, filename=None):
        """Return an uninitialised MMT with the shape and dtype of ``input``.

        Example:
            >>> MemoryMappedTensor.empty_like(torch.ones(2, 3)).shape
            torch.Size([2, 3])
        """
        return cls._new_filled(input.shape, input.dtype, None, filename, False, None)

    @classmethod
    def zeros_like(cls, input, *, filename=None):
        """Return an MMT of zeros with the shape and dtype of ``input``.

        Example:
            >>> MemoryMappedTensor.zeros_like(torch.ones(2))
            MemoryMappedTensor([0., 0.])
        """
        return cls._new_filled(input.shape, input.dtype, None, filename, False, 0)

    @classmethod
    def ones_like(cls, input, *, filename=None):
        """Return an MMT of ones with the shape and dtype of ``input``.

        Example:
            >>> MemoryMappedTensor.ones_like(torch.zeros(2))
            MemoryMappedTensor([1., 1.])
        """
        return cls._new_filled(input.shape, input.dtype, None, filename, False, 1)

    @classmethod
    def full_like(cls, input, fill_value, *, filename=None):
        """Return an MMT filled with ``fill_value``, with the shape and dtype of ``input``.

        Example:
            >>> MemoryMappedTensor.full_like(torch.zeros(2, dtype=torch.int64), 7)
            MemoryMappedTensor([7, 7])
        """
        return cls._new_filled(input.shape, input.dtype, None, filename, False, fill_value)

    @classmethod
    def _new_filled(cls, shape, dtype, device, filename, existsok, fill_value):
        _check_cpu(device)
        dtype = torch.get_default_dtype() if dtype is None else dtype
        # (checked_nbytes first: a quantized dtype gets its own error)
        if fill_value is not None and checked_nbytes(shape, dtype):
            # a value the dtype cannot hold (300 for uint8, "x") fails here, before the file exists
            torch.empty((), dtype=dtype).fill_(fill_value)
        result, fresh = cls._allocate(shape, dtype, filename, existsok)
        # a fresh file or segment is already zero: skip touching every page
        if fill_value is not None and result.numel() and not (fresh and zero_bytes(fill_value)):
            with removed_on_failure(result, fresh):
                result.fill_(fill_value)
        return result
