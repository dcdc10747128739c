"""unbind, split and chunk along a batch dim, for every tensordict class.

They only index: each piece is ``td[..., i]`` or ``td[..., a:b]``, so a class that
supports basic indexing gets them as views that share storage. They read the rows with
``_index`` (what ``td[index]`` calls), not ``td[index]``: a lazy stack's ``td[index]``
gives members given as tensorclasses as their classes, and a piece is a tensordict, as
tensordict 0.15.3 gives it (``torch.cat(lazy.split(1))`` then works).
"""
from __future__ import annotations

import math
from typing import Sequence

from shared_td.containers import batch as batch_ops
from shared_td.errors import SplitSizeError


class BatchSplitOps:
    """Mixin of TensorDictBase."""

    def unbind(self, dim: int = 0) -> tuple:
        """Views of each element along batch dim ``dim``."""
        dim = batch_ops.normalize_dim(dim, self.batch_dims)
        prefix = (slice(None),) * dim
        return tuple(self._index(prefix + (i,)) for i in range(self.batch_size[dim]))

    def split(self, split_size: int | Sequence[int], dim: int = 0) -> tuple:
        """Views of consecutive chunks along batch dim ``dim``, as ``torch.split``."""
        dim = batch_ops.normalize_dim(dim, self.batch_dims)
        length = self.batch_size[dim]
        if isinstance(split_size, int):
            if split_size <= 0:
                raise ValueError(f"split_size must be positive, got {split_size}.")
            # (an empty dim still gives one empty piece, as torch.split)
            sizes = [min(split_size, length - s) for s in range(0, length, split_size)] or [0]
        else:
            sizes = list(split_size)
            if sum(sizes) != length:
                # tensordict raises a RuntimeError (torch.split's error); the class is both
                raise SplitSizeError(
                    f"split sizes {sizes} do not add up to {length}, the size of batch dim {dim} "
                    f"(they add up to {sum(sizes)}): they must sum exactly to it, as in torch.split."
                )
        prefix, out, start = (slice(None),) * dim, [], 0
        for n in sizes:
            out.append(self._index(prefix + (slice(start, start + n),)))
            start += n
        return tuple(out)

    def chunk(self, chunks: int, dim: int = 0) -> tuple:
        """Split into ``chunks`` views of (nearly) equal size along ``dim``, as ``torch.chunk``."""
        if chunks <= 0:
            raise ValueError(f"chunks must be positive, got {chunks}.")
        dim = batch_ops.normalize_dim(dim, self.batch_dims)
        length = self.batch_size[dim]
        if not length:  # torch.chunk of an empty dim gives ``chunks`` empty pieces
            return self.split([0] * chunks, dim)
        return self.split(math.ceil(length / chunks), dim)
