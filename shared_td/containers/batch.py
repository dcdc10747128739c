"""Batch-size arithmetic shared by every container.

Every entry of a tensordict starts with the batch dimensions, so an operation along
batch dims (indexing, unsqueeze, permute, ...) is the same tensor operation applied to
every leaf.  This module turns user arguments (negative dims, Ellipsis, lists, masks)
into the explicit form that can be applied to leaves with more trailing dims.
"""
from __future__ import annotations

import functools
import warnings
from typing import Any, Sequence

import numpy as np
import torch

from shared_td.errors import BatchDimError, BatchSizeMismatchError, IndexTypeError

_BASIC_INDEX_TYPES = (int, slice, type(None), type(Ellipsis))


def as_batch_size(batch_size: Any) -> torch.Size:
    """Return ``batch_size`` (None, an int, a sequence of ints or a Size) as a Size."""
    if type(batch_size) is torch.Size and min(batch_size, default=0) >= 0:
        return batch_size  # (a nested tensordict made with its parent's: once per node)
    if batch_size is None:
        return torch.Size([])
    if isinstance(batch_size, (int, np.integer)):
        return torch.Size([int(batch_size)])
    if isinstance(batch_size, torch.Tensor):
        batch_size = batch_size.tolist()
    try:
        size = torch.Size([int(d) for d in batch_size])
    except (TypeError, ValueError):
        raise TypeError(
            f"batch_size must be a sequence of ints (e.g. [3, 4]), got {batch_size!r}."
        ) from None
    if any(d < 0 for d in size):
        raise ValueError(f"batch_size cannot have negative dims, got {list(size)}.")
    return size


def shape_args(shape: tuple, size: Any = None) -> torch.Size:
    """Accept ``f(2, 3)``, ``f((2, 3))`` and ``f(torch.Size([2, 3]))`` alike, and
    ``f(size=(2, 3))`` (the ``size`` keyword of tensordict's reshape and view)."""
    if size is not None:
        if shape:
            raise TypeError(f"Pass the shape either by position or as size=, not both (got {shape} and {size}).")
        shape = (size,)
    if len(shape) == 1 and not isinstance(shape[0], (int, np.integer)):
        shape = tuple(shape[0])
    return torch.Size([int(d) for d in shape])


def normalize_dim(dim: int, ndim: int, *, what: str = "dim") -> int:
    """Turn a possibly negative ``dim`` into a non-negative one, checking its range.

    ``ndim`` is the number of valid positions (the batch dims, for an op along one of
    them); an op that inserts a dim checks it with :func:`insertion_dim` instead.
    """
    if not -ndim <= dim < ndim:
        if not ndim:  # (there is no range to give)
            raise BatchDimError(f"{what}={dim} is out of range: the tensordict has no batch dims (batch_size=[]).")
        raise BatchDimError(
            f"{what}={dim} is out of range: expected {-ndim} <= {what} <= {ndim - 1} "
            "(a batch dim, counted from 0 or from the end with a negative dim)."
        )
    return dim % ndim


def insertion_dim(dim: int, batch_dims: int, op: str = "unsqueeze", *, what: str = "dim") -> int:
    """``dim`` of an op that inserts a batch dim (unsqueeze, stack) into tensordicts of
    ``batch_dims`` batch dims, as a non-negative position: it may be any of the
    ``batch_dims + 1`` positions, from ``-batch_dims - 1`` to ``batch_dims``.

    Raises:
        BatchDimError: (an IndexError, as torch raises, and a RuntimeError, as
            tensordict raises) naming ``op``, its argument ``what`` and the range.

    Example:
        >>> insertion_dim(-1, 2), insertion_dim(2, 2)
        (2, 2)
    """
    if not -batch_dims - 1 <= dim <= batch_dims:
        plural = "" if batch_dims == 1 else "s"
        raise BatchDimError(
            f"{op}({what}={dim}) is out of range for tensordicts with {batch_dims} batch "
            f"dim{plural}: the new dim goes at {-batch_dims - 1} <= {what} <= {batch_dims} "
            f"(a negative {what} counts from the end). Pass a {what} in that range."
        )
    return dim % (batch_dims + 1)


def _as_index_part(part: Any) -> Any:
    """Lists and numpy arrays become tensors (a uint8 one a bool mask, as torch takes
    it); numpy scalars become ints."""
    if isinstance(part, list):
        array = np.asarray(part)  # numpy makes ``[]`` and ``[[]]`` float: torch takes them as no rows
        return torch.as_tensor(array.astype(np.int64) if not array.size else array)
    if isinstance(part, np.ndarray):
        part = torch.as_tensor(part)
    if isinstance(part, np.integer):
        return int(part)
    if isinstance(part, range):
        return torch.arange(part.start, part.stop, part.step)
    if isinstance(part, torch.Tensor) and part.dtype == torch.uint8:
        # torch takes a uint8 index tensor as a mask (deprecated, with this warning): so
        # does every leaf, and the batch dims and names must count it so
        warnings.warn("indexing with dtype torch.uint8 is now deprecated, please use a dtype torch.bool instead.",
                      UserWarning, stacklevel=4)
        return part.bool()
    return part


def normalize_index(index: Any, batch_size: torch.Size) -> tuple:
    """Return ``index`` as a tuple that names every batch dim explicitly.

    Ellipsis is expanded into full slices of the batch dims only, so the same tuple
    indexes a leaf that has more (feature) dims than the batch.

    Raises:
        IndexError: if the index uses more dims than the batch has.
        IndexTypeError: (a TypeError and an IndexError, as torch raises) if a part of
            the index is not an int, slice, None, Ellipsis, bool or integer tensor, list
            or array.
    """
    parts = index if isinstance(index, tuple) else (index,)
    parts = tuple(_as_index_part(p) for p in parts)
    consumed = 0
    for part in parts:
        if isinstance(part, torch.Tensor):
            if part.dtype == torch.bool:
                consumed += part.ndim  # a 0-d mask (tensor(True)) uses no dim, as True
            elif part.is_floating_point() or part.is_complex():
                raise IndexTypeError(
                    f"Index tensors must be integer or bool, got dtype {part.dtype}."
                )
            else:
                consumed += 1
        elif isinstance(part, bool):
            consumed += 0
        elif isinstance(part, (int, slice)):
            consumed += 1
        elif part is None or part is Ellipsis:
            continue
        else:
            # (np.True_: a NumPy bool scalar, which torch 2.x refuses too, named as tensordict names it)
            numpy_bool = " (a NumPy bool scalar)" if isinstance(part, np.bool_) else ""
            raise IndexTypeError(
                f"Cannot index a tensordict with {part!r} of type {type(part).__name__}{numpy_bool}: "
                "use ints, slices, None, Ellipsis, or bool/integer tensors or lists."
            )
    if sum(p is Ellipsis for p in parts) > 1:
        raise IndexError("An index can hold at most one Ellipsis (...).")
    if consumed > len(batch_size):
        raise IndexError(
            f"Too many indices for a tensordict with batch size {list(batch_size)}: "
            f"{index!r} indexes {consumed} dims but there are {len(batch_size)} (as torch says: "
            f"too many indices for tensor of dimension {len(batch_size)})."
        )
    if Ellipsis in [p for p in parts if not isinstance(p, torch.Tensor)]:
        position = next(
            i for i, p in enumerate(parts) if not isinstance(p, torch.Tensor) and p is Ellipsis
        )
        fill = (slice(None),) * (len(batch_size) - consumed)
        parts = parts[:position] + fill + parts[position + 1 :]
    return parts


def index_and_size(index: Any, batch_size: torch.Size) -> tuple[tuple, torch.Size]:
    """``normalize_index(index)`` and the batch size it gives, computed once per call.

    The replay buffer's common indices, an int in range and a slice of step 1 with int
    bounds, are done in plain Python (the same result as torch's), and an integer tensor
    skips the part-by-part normalisation; anything else, and every error, goes through
    ``normalize_index`` and ``indexed_batch_size``.

    Examples:
        >>> index_and_size(-1, torch.Size([5, 2]))
        ((-1,), torch.Size([2]))
        >>> index_and_size(slice(3, 9), torch.Size([5]))
        ((slice(3, 9, None),), torch.Size([2]))
    """
    if batch_size:
        kind, rows = type(index), batch_size[0]
        if kind is int and -rows <= index < rows:
            return (index,), batch_size[1:]
        if kind is slice and index.step is None and type(index.start) in _SLICE_BOUNDS and type(index.stop) in _SLICE_BOUNDS:
            start, stop, _ = index.indices(rows)
            return (index,), torch.Size([max(stop - start, 0)]) + batch_size[1:]
        if kind is torch.Tensor and index.dtype in _INTEGER_DTYPES:  # a sample's indices
            index = (index,)
            return index, indexed_batch_size(batch_size, index)  # checks the range
    index = normalize_index(index, batch_size)
    return index, indexed_batch_size(batch_size, index)


_SLICE_BOUNDS = (int, type(None))
_INTEGER_DTYPES = frozenset({torch.int64, torch.int32, torch.int16, torch.int8})  # uint8 is a mask to torch


def broadcasts_to(shape: torch.Size, target: torch.Size) -> bool:
    """True if a tensor of ``shape`` broadcasts to ``target`` (torch's rule, in plain
    Python: ``torch.broadcast_shapes`` costs ~40 µs and raises on a mismatch).

    Examples:
        >>> broadcasts_to(torch.Size([1, 3]), torch.Size([4, 3])), broadcasts_to(torch.Size([2]), torch.Size([3]))
        (True, False)
    """
    return len(shape) <= len(target) and all(
        have in (want, 1) for have, want in zip(reversed(shape), reversed(target))
    )


def fits_indexed_write(shape: torch.Size, target: torch.Size) -> bool:
    """True if a tensor of ``shape`` can be written by ``leaf[index] = value`` where
    ``leaf[index]`` has shape ``target``: torch drops the value's leading size-1 dims
    beyond the target's (``x[0] = ones(1, 2)`` into a row of 2), then broadcasts.
    (``copy_``, an in-place ``set_``, drops none: use :func:`broadcasts_to` there.)

    Examples:
        >>> fits_indexed_write(torch.Size([1, 1, 2]), torch.Size([2]))
        True
        >>> fits_indexed_write(torch.Size([2, 1]), torch.Size([2]))  # (torch refuses it too)
        False
    """
    extra = len(shape) - len(target)
    if extra > 0 and all(size == 1 for size in shape[:extra]):
        shape = shape[extra:]
    return broadcasts_to(shape, target)


def is_basic_index(index: tuple) -> bool:
    """True if indexing with ``index`` gives a view (no copy), as in torch."""
    if len(index) == 1 and type(index[0]) is int:
        return True  # one row (a replay buffer's read): the common case first
    return all(isinstance(p, _BASIC_INDEX_TYPES) and not isinstance(p, bool) for p in index)


def indexed_batch_size(batch_size: torch.Size, index: tuple) -> torch.Size:
    """The batch size after indexing, computed by torch itself on a 0-stride tensor.

    Raises IndexError (naming the index and the batch size) when out of range.
    """
    try:
        return _probe(batch_size)[index].shape
    except IndexError as error:
        raise IndexError(
            f"{error} (while indexing a tensordict of batch size {list(batch_size)} "
            f"with {index!r})"
        ) from None


@functools.lru_cache(maxsize=64)
def _probe(batch_size: torch.Size) -> torch.Tensor:
    """A 0-stride tensor of shape ``batch_size`` (one byte of memory), made once per
    batch size: making it costs more than indexing it (~6 µs against ~3 µs for 256
    indices). Only ever read."""
    return torch.zeros((), dtype=torch.uint8).expand(batch_size)


def indexed_names(names: Sequence[str | None] | None, index: tuple) -> list | None:
    """Dim names after indexing with a normalized ``index`` (as tensordict names them).

    Basic parts: ints drop a dim, None inserts an unnamed one, slices keep the name.
    Advanced parts (index tensors, masks) give torch's block of result dims: a single
    1-D int tensor or 1-D mask keeps the name of the dim it indexes; any other block
    (several tensors, a 2-D mask, a 2-D int tensor) has unnamed dims. As in torch, the
    block sits where the tensors are when they are adjacent (ints do not separate them;
    slices and None do), else first.
    """
    if names is None:
        return None
    if not is_basic_index(index):
        return _advanced_indexed_names(names, index)
    out: list = []
    remaining = list(names)
    for part in index:
        if part is None:
            out.append(None)
        elif isinstance(part, int):
            remaining.pop(0)
        else:
            out.append(remaining.pop(0))
    return out + remaining


def _advanced_indexed_names(names: Sequence[str | None], index: tuple) -> list | None:
    out: list = []
    remaining = list(names)
    # per advanced part (index tensor, mask, bool): the shape it broadcasts with and the
    # names of the dims it consumes (a bool consumes none: it adds a dim of 1 or 0)
    shapes, taken = [], []
    place, separated, after_tensor, masks = None, False, False, 0
    for part in index:
        if isinstance(part, torch.Tensor) and part.ndim == 0:
            # torch selects with a 0-d integer tensor as with an int; a 0-d mask is a bool
            part = bool(part) if part.dtype == torch.bool else 0
        if isinstance(part, (torch.Tensor, bool)):
            if isinstance(part, bool):
                consumed, shape = 0, (1,)
            elif part.dtype == torch.bool:
                consumed, shape = part.ndim, (int(part.sum()),)
                masks += 1
            else:
                consumed, shape = 1, tuple(part.shape)
            shapes.append(shape)
            taken.append(remaining[:consumed])
            del remaining[:consumed]
            if place is None:
                place = len(out)
            elif not after_tensor:
                separated = True
            after_tensor = True
        elif isinstance(part, int):
            remaining.pop(0)  # ints do not separate the tensors (torch selects them first)
        else:  # None or a slice: they separate the tensors (torch puts the block first)
            out.append(None if part is None else remaining.pop(0))
            after_tensor = False if place is not None else after_tensor
    if place is None:
        return out + remaining
    position = 0 if separated else place
    return out[:position] + _block_names(shapes, taken, masks) + out[position:] + remaining


def _block_names(shapes: list, taken: list, masks: int = 0) -> list:
    """Names of the dims of torch's block of advanced-index dims, as tensordict gives
    them: a block dim along which one part alone varies (size != 1) takes the name of
    the dim that part consumed, if it consumed one dim and varies along this block dim
    only (a name cannot be repeated); so does a lone 1-D index (or mask) of size 1. Any
    other block dim is unnamed, and so is every dim of a block of two or more masks
    (``masks``: tensordict 0.15.3 names none, whatever the number of True each holds).

    Example:
        >>> _block_names([(2,), (1,)], [["d0"], ["d1"]]), _block_names([(2,), (1,)], [["d0"], ["d1"]], masks=2)
        (['d0'], [None])
    """
    ndim = len(torch.broadcast_shapes(*[torch.Size(s) for s in shapes]))
    if masks > 1:
        return [None] * ndim
    aligned = [(1,) * (ndim - len(s)) + tuple(s) for s in shapes]
    varying = [[j for j, n in enumerate(s) if n != 1] for s in aligned]
    block: list = []
    for j in range(ndim):
        parts = [i for i, dims in enumerate(varying) if j in dims]
        if not parts and len(shapes) == 1 and len(shapes[0]) == 1:  # one 1-D index of size 1
            parts, varying = [0], [[j]]
        one = len(parts) == 1 and len(varying[parts[0]]) == 1 and len(taken[parts[0]]) == 1
        block.append(taken[parts[0]][0] if one else None)
    return block


def rows_source(index: Any, source: Any, rows: torch.Size, batch_size: torch.Size, *,
                broadcast: bool = False) -> Any:
    """The tensordict ``source`` of ``td[index] = source`` fitted to the indexed ``rows``,
    as tensordict 0.15.3 fits it: a source whose batch size (of one dim or more) is the
    last dims of ``rows`` is expanded along the leading ones (``td[:1] = td[0]``); one
    whose entries start with ``rows`` is taken with that batch size (a shallow copy);
    with ``broadcast`` (a lazy stack's rows: tensordict's lazy stack does so, its
    TensorDict does not) any other whose batch size broadcasts to the rows, as torch
    broadcasts shapes (``[]``, ``[1, 3]`` or ``[2, 1]`` into rows ``[2, 3]``, anything
    of 1s into no rows), is expanded to them; any other raises (without ``broadcast``
    a batch of 1 is not repeated; never is one of 3 written into 2 rows).

    Example:
        >>> from shared_td import TensorDict
        >>> src = TensorDict(a=torch.zeros(3, 5), batch_size=[3])
        >>> rows_source((slice(0, 1),), src, torch.Size([1, 3]), torch.Size([4, 3])).batch_size
        torch.Size([1, 3])
    """
    size = source.batch_size
    if 0 < len(size) < len(rows) and rows[len(rows) - len(size):] == size:
        return source.expand(rows)
    try:
        fitted = source.copy()
        fitted.batch_size = rows
        return fitted
    except (RuntimeError, ValueError, AttributeError):  # (the raise below names both sizes)
        pass
    if broadcast and len(size) <= len(rows) and all(
            n in (1, r) for n, r in zip(reversed(size), reversed(rows))):
        return source.expand(rows)
    raise BatchSizeMismatchError(
        f"td[{index!r}] = value: the indexed rows have batch size {list(rows)} (of "
        f"{list(batch_size)}; the indexed destination TensorDict batch size is the one a source "
        "must have), which differs from the source batch size: the source tensordict "
        f"{list(size)} must have the rows' batch size, or their last dims (as in tensordict). "
        "Index the source to those rows, or write a number or tensor, which broadcasts to every leaf.")
