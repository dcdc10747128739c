"""Batch-dim reshaping of a TensorDict: expand, reshape, view, unsqueeze, squeeze, permute.

Each is one tensor operation on the leading (batch) dims, applied to every entry by
``TensorDict._map_entries``: tensors and child collections answer the same methods.
Views (view, unsqueeze, squeeze, permute) keep the lock and memmap/shared flags.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from shared_td.containers import batch as batch_ops
from shared_td.containers.shape_write_back import inverse_order, unsqueezed, with_write_back
from shared_td.containers.value_kinds import is_non_tensor, is_tensor_collection
from shared_td.errors import BatchDimError, TransposeDimError

if TYPE_CHECKING:  # for the annotations only: tensordict.py imports this module
    from shared_td.containers.tensordict import TensorDict


class BatchShapeOps:
    """Mixin of TensorDict (it relies on ``_map_entries``, ``_batch_size``, ``_names``)."""

    def expand(self, *shape: Any) -> "TensorDict":
        """Expand the batch dims to ``shape`` (new leading dims allowed), as torch does;
        the dims keep their names, the new leading ones are unnamed (as in tensordict)."""
        size = batch_ops.shape_args(shape)
        nb = self.batch_dims
        probe = torch.zeros((), dtype=torch.uint8).expand(self._batch_size)
        size = probe.expand(size).shape
        names = None if self._names is None else [None] * (len(size) - nb) + self._names
        return self._map_entries(  # (one tuple: ``v.expand()`` of a 0-d leaf to () is a TypeError)
            lambda v: v.expand((*size, *v.shape[nb:])), size, names
        )

    def expand_as(self, other: Any) -> "TensorDict":
        """Each entry expanded as the same entry of the tensordict ``other``
        (``torch.Tensor.expand_as`` leaf by leaf); the result has ``other``'s batch size.
        A tensor ``other`` gives ``expand(other.shape)``, as in tensordict 0.15.3.

        Example:
            >>> td = TensorDict(a=torch.ones(3, 1, 4), batch_size=[3])
            >>> td.expand_as(TensorDict(a=torch.zeros(2, 3, 5, 4), batch_size=[2, 3]))["a"].shape
            torch.Size([2, 3, 5, 4])
            >>> td.expand_as(torch.zeros(2, 3)).batch_size
            torch.Size([2, 3])
        """
        if isinstance(other, torch.Tensor):
            return self.expand(other.shape)
        return self.apply(lambda value, like: value.expand_as(like), other, batch_size=other.batch_size)

    def reshape(self, *shape: Any, size: Any = None) -> "TensorDict":
        """Reshape the batch dims (``-1`` allowed); feature dims are kept. The shape may
        also be given as ``size=`` (as tensordict 0.15.3)."""
        nb = self.batch_dims
        size = torch.zeros((), dtype=torch.uint8).expand(self._batch_size).reshape(
            batch_ops.shape_args(shape, size)
        ).shape
        return self._map_entries(lambda v: v.reshape((*size, *v.shape[nb:])), size)

    def view(self, *shape: Any, size: Any = None, batch_size: Any = None) -> "TensorDict":
        """A view with reshaped batch dims (the storage is shared; raises if impossible);
        the shape may also be given as ``size=``. ``view(dtype)``: every tensor leaf
        viewed as ``dtype`` (``torch.Tensor.view(dtype)``: the same bytes read as another
        type, so a leaf's last dim changes size when the item sizes differ: a leaf
        whose last dim is a batch dim raises then), of batch size ``batch_size`` if
        given, as in tensordict 0.15.3.

        Example:
            >>> td = TensorDict(a=torch.zeros(3, 4), batch_size=[3])
            >>> td.view(torch.int32)["a"].dtype, td.view(torch.float16)["a"].shape
            (torch.int32, torch.Size([3, 8]))
        """
        if len(shape) == 1 and isinstance(shape[0], torch.dtype):
            return view_dtype(self, shape[0], batch_size)
        nb = self.batch_dims
        before = self._batch_size
        size = torch.empty(before, device="meta").view(batch_ops.shape_args(shape, size)).shape
        return with_write_back(self, self._map_entries(lambda v: v.view((*size, *v.shape[nb:])), size, is_view=True),
                               lambda out: out.view(before))

    def unsqueeze(self, dim: int) -> "TensorDict":
        """Insert a batch dim of size 1 at ``dim`` (a view)."""
        dim = batch_ops.insertion_dim(dim, self.batch_dims)
        size = torch.Size(list(self._batch_size[:dim]) + [1] + list(self._batch_size[dim:]))
        names = None if self._names is None else self._names[:dim] + [None] + self._names[dim:]
        return with_write_back(self, self._map_entries(lambda v: v.unsqueeze(dim), size, names, is_view=True),
                               lambda out: out.squeeze(dim))

    def squeeze(self, dim: int | None = None) -> "TensorDict":
        """Remove batch dims of size 1 (all of them, or only ``dim``) (a view)."""
        if dim is None:
            dims = [d for d, n in enumerate(self._batch_size) if n == 1]
        else:
            dim = batch_ops.normalize_dim(dim, self.batch_dims)
            dims = [dim] if self._batch_size[dim] == 1 else []
        out = self
        for d in reversed(dims):
            size = torch.Size(list(out._batch_size[:d]) + list(out._batch_size[d + 1 :]))
            names = None if out._names is None else out._names[:d] + out._names[d + 1 :]
            out = out._map_entries(lambda v, d=d: v.squeeze(d), size, names, is_view=True)
        return with_write_back(self, out, lambda result: unsqueezed(result, dims))

    def permute(self, *dims_list: Any, dims: Any = None) -> "TensorDict":
        """Reorder the batch dims (a view); feature dims stay last. As in tensordict
        0.15.3, fewer dims than the batch dims may be given: a reorder of the leading
        ones (negative dims count from the last batch dim), the others kept; the dims
        may also be given as ``dims=[...]``.

        Raises:
            ValueError: the dims are not each of the first ``len(dims)`` batch dims once
            (a dim out of range: a TransposeDimError, also an IndexError).

        Example:
            >>> td = TensorDict(a=torch.zeros(2, 3, 4), batch_size=[2, 3, 4])
            >>> td.permute(1, 0).batch_size, td.permute(-1, 0, 1).batch_size
            (torch.Size([3, 2, 4]), torch.Size([4, 2, 3]))
        """
        nb = self.batch_dims
        order = permute_order(dims_list, nb, dims)
        size = torch.Size([self._batch_size[d] for d in order])
        names = None if self._names is None else [self._names[d] for d in order]
        out = self._map_entries(
            # (one tuple: ``v.permute(*())`` of a 0-dim leaf is a TypeError, ``v.permute(())`` is not)
            lambda v: v.permute((*order, *range(nb, v.ndim))), size, names, is_view=True
        )
        return with_write_back(self, out, lambda result: result.permute(inverse_order(order)))

    @staticmethod
    def _from_dict_has_batch_dims(batch_size: Any, batch_dims: int | None) -> bool:
        """Whether ``from_dict(batch_size=...)`` gives the tree batch dims (its Python
        numbers then become NonTensorData).

        Raises:
            ValueError: both ``batch_size`` and ``batch_dims`` are given (as tensordict
                0.15.3 refuses them: one is a size, the other asks to infer it).
        """
        if batch_size is not None and batch_dims is not None:
            raise ValueError(
                f"from_dict got both batch_size={batch_size} and batch_dims={batch_dims}: give "
                "batch_size, or batch_dims to infer that many dims from the entries, not both.")
        return batch_size is not None and len(batch_size) > 0

    def auto_batch_size_(self, batch_dims: int | None = None, keep_compliant_size: bool = False):
        """Set the batch size to the longest leading shape that every entry shares
        (nested tensordicts first get theirs), at most ``batch_dims`` dims; returns self.

        As tensordict 0.15.3: non-tensor entries follow the new batch size, other nested
        collections (tensorclasses, lazy stacks) keep theirs, and with
        ``keep_compliant_size`` a nested tensordict that already has ``batch_dims`` dims
        or more keeps its batch size.

        Example:
            >>> td = TensorDict(a=torch.zeros(3, 4, 5), b={"c": torch.zeros(3, 4, 6)})
            >>> td.auto_batch_size_().batch_size, td["b"].batch_size
            (torch.Size([3, 4]), torch.Size([3, 4, 6]))
        """
        valid = batch_dims is None or (type(batch_dims) is int and batch_dims >= 0)
        if not valid:
            raise ValueError(f"batch_dims must be None or an int >= 0, got {batch_dims!r}.")
        shapes = []
        for value in self._tensordict.values():
            if is_non_tensor(value):
                if value.batch_size:  # as in tensordict 0.15.3, only a 0-d one follows any batch size
                    shapes.append(value.batch_size)
                continue
            if isinstance(value, BatchShapeOps):
                compliant = keep_compliant_size and batch_dims is not None and value.batch_dims >= batch_dims
                if not compliant:
                    value.auto_batch_size_(batch_dims, keep_compliant_size)
            shapes.append(value.batch_size if is_tensor_collection(value) else value.shape)
        common = _common_prefix(shapes)
        self.batch_size = common if batch_dims is None else common[:batch_dims]
        return self


def view_dtype(td: Any, dtype: torch.dtype, batch_size: Any) -> Any:
    """``td.view(dtype, batch_size=)`` of a TensorDict or lazy stack: each tensor leaf
    viewed as ``dtype``; non-tensor entries kept.

    Example:
        >>> view_dtype(TensorDict(a=torch.zeros(2, 2), s="x", batch_size=[2]), torch.int16, None)["a"].shape
        torch.Size([2, 4])
    """
    return td.apply(lambda leaf: leaf.view(dtype), batch_size=batch_size)


def permute_order(dims_list: Any, batch_dims: int, dims: Any = None) -> list:
    """The whole order of ``batch_dims`` batch dims that ``permute(*dims_list)`` (or
    ``permute(dims=dims)``) asks for: as tensordict 0.15.3, the dims may reorder only the
    leading ones (negative dims count from the last batch dim), the others stay.

    Raises:
        ValueError: the dims are not each of the first ``len(dims)`` batch dims once
            (a dim out of range: a TransposeDimError, also an IndexError).
        TypeError: dims given both ways.

    Example:
        >>> permute_order((1, 0), 3), permute_order(([-1, 0, 1],), 3), permute_order((), 2, [1, 0])
        ([1, 0, 2], [2, 0, 1], [1, 0])
    """
    if dims is not None and dims_list:
        raise TypeError(f"permute takes its dims once: {list(dims_list)} and dims={list(dims)} were given.")
    dims = dims_list if dims is None else (dims,)
    try:
        order = [batch_ops.normalize_dim(d, batch_dims) for d in batch_ops.shape_args(dims)]
    except BatchDimError as out_of_range:  # (also the ValueError tensordict raises)
        raise TransposeDimError(f"permute: {out_of_range}") from None
    if sorted(order) != list(range(len(order))):
        given = list(batch_ops.shape_args(dims))
        if len(order) > batch_dims:
            raise ValueError(f"permute got {len(order)} dims {given} for a tensordict of {batch_dims} batch dims.")
        which = (f"each of the {batch_dims} batch dims" if len(order) == batch_dims
                 else f"each of the first {len(order)} of the {batch_dims} batch dims (the others stay)")
        raise ValueError(f"permute needs {which} once, got {given}.")
    return order + list(range(len(order), batch_dims))


def _common_prefix(shapes: list) -> torch.Size:
    """The longest leading shape of all ``shapes`` (``[]`` when there is none)."""
    if not shapes:
        return torch.Size([])
    prefix = list(shapes[0])
    for shape in shapes[1:]:
        shared = min(len(prefix), len(shape))
        del prefix[next((i for i in range(shared) if prefix[i] != shape[i]), shared):]
    return torch.Size(prefix)
