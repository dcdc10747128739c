"""Batch-dim reshaping of a TensorDict: expand, reshape, view, unsqueeze, squeeze, permute.

Each is one tensor operation on the leading (batch) dims, applied to every entry by
``TensorDict._map_entries``: tensors and child collections answer the same methods.
Views (view, unsqueeze, squeeze, permute) keep the lock and memmap/shared flags.
"""
from __future__ import annotations

from typing import Any

import torch

from shared_td.containers import batch as batch_ops


class BatchShapeOps:
    """Mixin of TensorDict (it relies on ``_map_entries``, ``_batch_size``, ``_names``)."""

    def expand(self, *shape: Any) -> "TensorDict":
        """Expand the batch dims to ``shape`` (new leading dims allowed), as torch does."""
        size = batch_ops.shape_args(shape)
        nb = self.batch_dims
        probe = torch.zeros((), dtype=torch.uint8).expand(self._batch_size)
        size = probe.expand(size).shape
        return self._map_entries(
            lambda v: v.expand(*size, *v.shape[nb:]), size, None
        )

    def reshape(self, *shape: Any) -> "TensorDict":
        """Reshape the batch dims (``-1`` allowed); feature dims are kept."""
        nb = self.batch_dims
        size = torch.zeros((), dtype=torch.uint8).expand(self._batch_size).reshape(
            batch_ops.shape_args(shape)
        ).shape
        return self._map_entries(lambda v: v.reshape(*size, *v.shape[nb:]), size)

    def view(self, *shape: Any) -> "TensorDict":
        """A view with reshaped batch dims (the storage is shared; raises if impossible)."""
        if len(shape) == 1 and isinstance(shape[0], torch.dtype):
            raise TypeError("TensorDict.view(dtype) is not supported; use .to(dtype).")
        nb = self.batch_dims
        size = torch.empty(self._batch_size, device="meta").view(batch_ops.shape_args(shape)).shape
        return self._map_entries(lambda v: v.view(*size, *v.shape[nb:]), size, is_view=True)

    def unsqueeze(self, dim: int) -> "TensorDict":
        """Insert a batch dim of size 1 at ``dim`` (a view)."""
        dim = batch_ops.normalize_dim(dim, self.batch_dims + 1)
        size = torch.Size(list(self._batch_size[:dim]) + [1] + list(self._batch_size[dim:]))
        names = None if self._names is None else self._names[:dim] + [None] + self._names[dim:]
        return self._map_entries(lambda v: v.unsqueeze(dim), size, names, is_view=True)

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
        return out

    def permute(self, *dims: Any) -> "TensorDict":
        """Reorder the batch dims (a view); feature dims stay last."""
        order = [batch_ops.normalize_dim(d, self.batch_dims) for d in batch_ops.shape_args(dims)]
        if sorted(order) != list(range(self.batch_dims)):
            raise ValueError(f"permute needs each of the {self.batch_dims} batch dims once, got {list(dims)}.")
        nb = self.batch_dims
        size = torch.Size([self._batch_size[d] for d in order])
        names = None if self._names is None else [self._names[d] for d in order]
        return self._map_entries(
            lambda v: v.permute(*order, *range(nb, v.ndim)), size, names, is_view=True
        )
