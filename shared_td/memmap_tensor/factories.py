"""The constructors of MemoryMappedTensor named as torch's (``empty``, ``zeros``, ``ones``,
``full`` and their ``*_like``), a mixin of the class: each is one call of the class's
``_new_filled(shape, dtype, device, filename, existsok, fill_value)`` (tensor.py)."""
from __future__ import annotations

import math

from shared_td.memmap_tensor.shapes import _parse_shape

__all__ = ["Factories", "zero_bytes"]


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
