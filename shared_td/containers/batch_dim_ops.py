"""transpose, flatten and unflatten of the batch dims: the mixins BatchDimOps (TensorDict),
LazyBatchDimOps (LazyStackedTensorDict) and NonTensorBatchDimOps (NonTensorBase).

They follow tensordict 0.15.3. ``transpose`` is a ``permute`` that swaps two dims (a view;
the names are swapped too; the lock and the memmap/shared flags are kept). ``flatten``
and ``unflatten`` give leaves that are views where torch can make one; the result keeps
the lock but not the memmap/shared flags (tensordict does the same: its leaves may be
copies). Names: the flattened dim is unnamed, the others keep theirs; after
``unflatten`` the last new dim keeps the name of ``dim`` and the others are unnamed.

A dense tensordict applies the op to each entry: torch's op on a tensor, the same method
on a nested tensordict (so its own names and deeper entries follow), and ``permute`` /
``reshape`` on a non-tensor entry (NonTensorData keeps one value, a NonTensorStack moves
its values). A lazy stack reuses its own ``permute`` and ``reshape`` (views of the
members, no copy).

Unlike tensordict 0.15.3, a ``start_dim``/``end_dim`` outside the batch dims raises a
BatchDimError (tensordict warns and flattens the dims of the leaves; it will raise from
0.17), and a lazy stack's ``flatten``/``unflatten`` name the dims as a TensorDict's do
(tensordict drops every name in ``flatten`` and moves the name of an unflattened stack
dim to the first new dim).
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable

import torch

from shared_td.containers import batch as batch_ops
from shared_td.containers.shape_write_back import with_write_back
from shared_td.containers.value_kinds import is_non_tensor
from shared_td.errors import BatchDimError, TransposeDimError
from shared_td.tensorclass_protocol import unwrap_tensorclass

if TYPE_CHECKING:  # for the annotations only: tensordict.py and lazy.py import this module
    from shared_td.containers.base import TensorDictBase


class BatchDimOps:
    """Mixin of TensorDict (it relies on ``permute``, ``_map_entries``, ``_tensordict``,
    ``_batch_size`` and ``_names``); LazyBatchDimOps adapts it to lazy stacks."""

    def transpose(self, dim0: int, dim1: int) -> "TensorDictBase":
        """The batch dims ``dim0`` and ``dim1`` swapped, with their names (a view: an
        in-place write into the result reaches self). The same dim twice gives self.

        Raises:
            TransposeDimError: (an IndexError, a RuntimeError and a ValueError) if a dim
                is not a batch dim.

        Example:
            >>> td = TensorDict(a=torch.zeros(3, 4, 5), batch_size=[3, 4], names=["t", "env"])
            >>> td.transpose(0, -1).batch_size, td.transpose(0, 1).names
            (torch.Size([4, 3]), ['env', 't'])
        """
        ndim = self.batch_dims
        order = list(range(ndim))
        dim0 = batch_dim("transpose", dim0, ndim, "dim0", TransposeDimError)
        dim1 = batch_dim("transpose", dim1, ndim, "dim1", TransposeDimError)
        if dim0 == dim1:
            return self
        order[dim0], order[dim1] = dim1, dim0
        # (permute keeps the lock and the memmap/shared flags, which unlock_() clears: a
        # shared or memory-mapped result is locked, as tensordict makes it)
        return self.permute(order)

    swapaxes = swapdims = transpose  # (torch's names for it, as tensordict 0.15.3)

    def movedim(self, source: Any, destination: Any) -> "TensorDictBase":
        """The batch dims ``source`` (an int or a sequence) moved to ``destination``, the
        others kept in order, as ``torch.movedim`` (a ``permute``: a view, with the
        names; ``moveaxis`` is the same).

        Raises:
            BatchDimError: a dim outside the batch dims (an IndexError and a RuntimeError).
            ValueError: ``source`` and ``destination`` of different lengths, or a dim
                given twice.

        Example:
            >>> td = TensorDict(a=torch.zeros(2, 3, 4), batch_size=[2, 3, 4], names=["x", "y", "z"])
            >>> td.movedim(0, -1).batch_size, td.movedim(0, -1).names
            (torch.Size([3, 4, 2]), ['y', 'z', 'x'])
        """
        ndim = self.batch_dims
        sources = [source] if isinstance(source, int) else list(source)
        destinations = [destination] if isinstance(destination, int) else list(destination)
        if len(sources) != len(destinations):
            raise ValueError(f"movedim: source {source} and destination {destination} must have the same "
                             "number of dims.")
        sources = [batch_dim("movedim", d, ndim, "source") for d in sources]
        destinations = [batch_dim("movedim", d, ndim, "destination") for d in destinations]
        if len(set(sources)) != len(sources) or len(set(destinations)) != len(destinations):
            raise ValueError(f"movedim: a dim is given twice in source {source} or destination {destination}.")
        order: list = [None] * ndim
        for moved, place in zip(sources, destinations):
            order[place] = moved
        rest = iter(d for d in range(ndim) if d not in sources)
        return self.permute([next(rest) if d is None else d for d in order])

    moveaxis = movedim

    def flatten(self, start_dim: int | None = None, end_dim: int | None = None, *,
                inplace: bool = False) -> "TensorDictBase":
        """The batch dims ``start_dim`` to ``end_dim`` (default: all) flattened into one,
        which is unnamed; the leaves keep their feature dims and are views where torch
        can make one. A tensordict without batch dims gets one batch dim of size 1.

        With ``inplace=True`` self keeps its identity (and its nested tensordicts theirs),
        its entries are replaced and self is returned; a lazy stack, or a tensordict
        holding one, raises NotImplementedError (call ``to_tensordict()`` first).

        Raises:
            BatchDimError: a dim outside the batch dims (an IndexError and a RuntimeError).
            ValueError: ``end_dim`` before ``start_dim``.

        Example:
            >>> td = TensorDict(a=torch.arange(24).view(2, 3, 4), batch_size=[2, 3], names=["x", "y"])
            >>> flat = td.flatten()
            >>> flat.batch_size, flat["a"].shape, flat.names
            (torch.Size([6]), torch.Size([6, 4]), None)
        """
        ndim = self.batch_dims
        if not ndim and start_dim in (None, 0) and end_dim in (None, -1, 0):
            return self.unsqueeze(0)  # (also for inplace=True, as in tensordict)
        start = batch_dim("flatten", 0 if start_dim is None else start_dim, ndim, "start_dim")
        end = batch_dim("flatten", -1 if end_dim is None else end_dim, ndim, "end_dim")
        if end < start:
            raise ValueError(
                f"flatten(start_dim={start_dim}, end_dim={end_dim}): the end dimension must be "
                "greater or equal to the start dim."
            )
        size = self.batch_size
        new_size = torch.Size([*size[:start], math.prod(size[start : end + 1]), *size[end + 1 :]])
        out = self._batch_dims_changed(
            "flatten", new_size, lambda names: [*names[:start], None, *names[end + 1 :]], inplace,
            tensor_op=lambda v: torch.flatten(v, start, end),
            nested_op=lambda v: v.flatten(start, end),
        )
        return with_write_back(self, out, lambda result: result.unflatten(start, size[start : end + 1]))

    def unflatten(self, dim: int, unflattened_size: Any, *, inplace: bool = False) -> "TensorDictBase":
        """The batch dim ``dim`` split into dims of ``unflattened_size`` (one of them may
        be -1), as ``torch.unflatten``; the last new dim keeps the name of ``dim``, the
        others are unnamed. ``inplace`` as for :meth:`flatten`.

        Raises:
            BatchDimError: ``dim`` is not a batch dim (an IndexError and a RuntimeError).
            RuntimeError: sizes whose product is not ``batch_size[dim]`` (torch's error).

        Example:
            >>> td = TensorDict(a=torch.zeros(6, 5), batch_size=[6], names=["t"])
            >>> out = td.unflatten(0, (2, -1))
            >>> out.batch_size, out["a"].shape, out.names
            (torch.Size([2, 3]), torch.Size([2, 3, 5]), [None, 't'])
        """
        ndim = self.batch_dims
        dim = batch_dim("unflatten", dim, ndim, "dim")
        sizes = list(torch.empty(self.batch_size, device="meta").unflatten(dim, unflattened_size)
                     .shape[dim : dim + len(unflattened_size)])
        size = self.batch_size
        new_size = torch.Size([*size[:dim], *sizes, *size[dim + 1 :]])
        out = self._batch_dims_changed(
            "unflatten", new_size, lambda names: [*names[:dim], *[None] * (len(sizes) - 1), *names[dim:]], inplace,
            tensor_op=lambda v: v.unflatten(dim, sizes),
            nested_op=lambda v: v.unflatten(dim, sizes),
        )
        return with_write_back(self, out, lambda result: result.flatten(dim, dim + len(sizes) - 1))

    # ---------------------------------------------------------------- dense helpers
    def _batch_dims_changed(self, op: str, new_size: torch.Size, rename: Callable, inplace: bool, *,
                            tensor_op: Callable, nested_op: Callable) -> "TensorDictBase":
        """The result of flatten/unflatten: ``tensor_op`` on tensors, ``nested_op`` on
        nested tensordicts, a reshape on non-tensor entries; ``rename(names)`` gives the
        new names of a tensordict's batch dims (of a nested one too) from its own."""
        if inplace:
            self._change_in_place(op, new_size, rename, tensor_op)
            return self
        nb = self.batch_dims

        def entry(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                return tensor_op(value)
            if is_non_tensor(value):  # reshaped: the values follow their positions
                return value.reshape(*new_size, *value.batch_size[nb:])
            return nested_op(value)

        names = None if self.names is None else rename(self.names)
        out = self._map_entries(entry, new_size, names)
        if self._is_locked:
            out.lock_()  # as tensordict: the lock is kept, the memmap/shared flags are not
        return out

    def _change_in_place(self, op: str, new_size: torch.Size, rename: Callable, tensor_op: Callable) -> None:
        """flatten/unflatten(inplace=True): self and every tensordict nested in it keep
        their identity; each is changed once, also one held under two keys (tensordict
        0.15.3 changes it twice and fails halfway), and every new entry is made before
        the first is stored, so that nothing changes when it raises."""
        nb = self.batch_dims
        planned = []
        for node in self._nodes_in_place(op, {}).values():
            entries = {}
            for key, value in node._tensordict.items():
                if isinstance(value, torch.Tensor):
                    entries[key] = tensor_op(value)
                elif is_non_tensor(value):  # reshaped: the values follow their positions
                    entries[key] = value.reshape(*new_size, *value.batch_size[nb:])
            names = None if node._names is None else rename(node._names)
            planned.append((node, entries, torch.Size([*new_size, *node.batch_size[nb:]]), names))
        for node, entries, size, names in planned:
            node._tensordict.update(entries)
            node._batch_size = size
            node._names = None if names is None or all(n is None for n in names) else names

    def _nodes_in_place(self, op: str, nodes: dict) -> dict:
        """``nodes`` (by id) with self and the tensordicts nested in it (also inside
        tensorclasses), each once; raises before anything changes if an in-place ``op``
        cannot run on this tree (a lock, a lazy stack)."""
        self._check_unlocked((), f"{op} in place")
        nodes[id(self)] = self
        for key, value in self._tensordict.items():
            value = unwrap_tensorclass(value)
            if isinstance(value, torch.Tensor) or is_non_tensor(value) or id(value) in nodes:
                continue
            if not isinstance(value, BatchDimOps) or isinstance(value, LazyBatchDimOps):
                raise NotImplementedError(
                    f"{op}(inplace=True) is not supported on a tensordict that holds a "
                    f"{type(value).__name__} (at key {key!r}). Use inplace=False, or call "
                    "to_tensordict() on it first."
                )
            value._nodes_in_place(op, nodes)
        return nodes


class LazyBatchDimOps(BatchDimOps):
    """Mixin of LazyStackedTensorDict: transpose is its ``permute`` (the members are
    transposed and the stack dim moves); flatten/unflatten are its ``reshape`` (nested
    lazy stacks of views of the members), then named as a TensorDict's dims."""

    def flatten(self, start_dim: int | None = None, end_dim: int | None = None, *,
                inplace: bool = False) -> "TensorDictBase":
        """See :meth:`BatchDimOps.flatten`; flattening one dim gives self, and
        ``inplace=True`` raises NotImplementedError (as in tensordict).

        Example:
            >>> members = [TensorDict(a=torch.full((3,), float(i)), batch_size=[3]) for i in range(2)]
            >>> flat = shared_td.lazy_stack(members).flatten()
            >>> flat.batch_size, flat["a"].tolist()
            (torch.Size([6]), [0.0, 0.0, 0.0, 1.0, 1.0, 1.0])
        """
        if inplace:
            raise NotImplementedError(
                "flatten(inplace=True) is not supported on a LazyStackedTensorDict; call "
                ".to_tensordict() first or use inplace=False."
            )
        ndim = self.batch_dims
        if ndim:
            start = batch_dim("flatten", 0 if start_dim is None else start_dim, ndim, "start_dim")
            end = batch_dim("flatten", -1 if end_dim is None else end_dim, ndim, "end_dim")
            if start == end:
                return self  # as torch.flatten and tensordict: nothing to flatten
        return super().flatten(start_dim, end_dim)

    def unflatten(self, dim: int, unflattened_size: Any, *, inplace: bool = False) -> "TensorDictBase":
        """See :meth:`BatchDimOps.unflatten`; sizes that keep the batch size give self,
        and ``inplace=True`` raises NotImplementedError (as in tensordict)."""
        if inplace:
            raise NotImplementedError(
                "unflatten(inplace=True) is not supported on a LazyStackedTensorDict; call "
                ".to_tensordict() first or use inplace=False."
            )
        return super().unflatten(dim, unflattened_size)

    def _batch_dims_changed(self, op: str, new_size: torch.Size, rename: Callable, inplace: bool, *,
                            tensor_op: Callable, nested_op: Callable) -> "TensorDictBase":
        if new_size == self.batch_size:
            return self
        names = None if self.names is None else rename(self.names)
        out = self.reshape(new_size)
        if names is not None and any(n is not None for n in names):
            out.names = names
        if self.is_locked:
            out.lock_()
        return out


class NonTensorBatchDimOps(BatchDimOps):
    """Mixin of NonTensorData and NonTensorStack (NonTensorBase): flatten and unflatten
    are a reshape (a NonTensorData keeps its one value, a NonTensorStack moves its
    values), transpose its ``permute``; in place, they raise NotImplementedError as in
    tensordict 0.15.3 (a non-tensor entry of a TensorDict is replaced instead)."""

    def _batch_dims_changed(self, op: str, new_size: torch.Size, rename: Callable, inplace: bool, *,
                            tensor_op: Callable, nested_op: Callable) -> "TensorDictBase":
        if inplace:
            raise NotImplementedError(
                f"{op}(inplace=True) is not supported on a {type(self).__name__}; use inplace=False."
            )
        return self.reshape(new_size)


def batch_dim(op: str, dim: int, ndim: int, what: str, error: type = BatchDimError) -> int:
    """``dim`` as a non-negative batch dim; the error names ``op``."""
    try:
        return batch_ops.normalize_dim(dim, ndim, what=what)
    except BatchDimError as out_of_range:
        # (transpose: with tensordict 0.15.3's words too, which ported code may match)
        also = " dim0 and dim1 must be within the range of the number of dimensions." if op == "transpose" else ""
        raise error(f"{op}: {out_of_range}{also}") from None
