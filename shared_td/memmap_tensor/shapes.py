"""Shapes and strides of the tensors MemoryMappedTensor builds: parsed and checked once."""
from __future__ import annotations

import torch


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
