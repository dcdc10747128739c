"""What NonTensorData and NonTensorStack share (NonTensorBase): no keys, batch-dim
operations through ``_transform``, comparisons, and the payload that may live in a cell
shared between processes.

A subclass says how its values follow an operation on the batch dims (``_transform``:
the operation applied to a tensor of element positions), what its values are
(``_flat_values``) and how an in-place write checks and lands (``_check_update``,
``_update_``). The payload is ``_payload``: a private attribute, or a SharedValue after
``share_memory_()`` or a memmap with ``share_non_tensor=True``, so that an in-place write
in one process is seen by all (``_updating`` keeps such a write whole, and
``_after_update`` rewrites the files of a memory-mapped entry).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch

from shared_td.containers import batch as batch_ops
from shared_td.containers.base import TensorDictBase, parse_device
from shared_td.containers.batch_dim_ops import NonTensorBatchDimOps
from shared_td.containers.reshaping import permute_order
from shared_td.errors import BatchSizeMismatchError, ReadOnlyError


class NonTensorBase(NonTensorBatchDimOps, TensorDictBase):
    """Shared mechanics: no keys, batch-dim ops through ``_transform``."""

    _is_non_tensor = True

    def _init_flags(self, batch_size: Any, device: Any) -> None:
        self._batch_size = batch_ops.as_batch_size(batch_size)
        self._device = parse_device(device)
        self._names = None
        self._is_locked = self._is_shared = self._is_memmap = False
        self._memmap_prefix = None
        self._lock_parents: dict = {}
        self._context_ops: list = []

    @property
    def batch_size(self) -> torch.Size:
        """The batch size."""
        return self._batch_size

    @property
    def device(self) -> torch.device | None:
        """The device recorded for the data (non-tensor data itself lives in Python)."""
        return self._device

    @property
    def names(self) -> None:
        """Non-tensor containers carry no dim names."""
        return None

    def _keys_str(self):
        return iter(())

    def _get_str(self, key: str, default: Any) -> Any:
        return default

    def _set_str(self, key: str, value: Any, *, inplace: bool, validated: bool) -> None:
        raise KeyError(f"{type(self).__name__} holds a value, not keys: cannot set {key!r}.")

    def _del_str(self, key: str) -> None:
        raise KeyError(key)

    def _transform(self, op: Callable[[torch.Tensor], torch.Tensor], keep_members: bool = False) -> "NonTensorBase":
        raise NotImplementedError

    def _index(self, index: Any) -> "NonTensorBase":
        index = batch_ops.normalize_index(index, self._batch_size)
        batch_ops.indexed_batch_size(self._batch_size, index)  # range checks
        return self._transform(lambda positions: positions[index], keep_members=True)

    def expand(self, *shape: Any) -> "NonTensorBase":
        size = batch_ops.shape_args(shape)
        return self._transform(lambda positions: positions.expand(size))

    def reshape(self, *shape: Any) -> "NonTensorBase":
        size = batch_ops.shape_args(shape)
        return self._transform(lambda positions: positions.reshape(size))

    view = reshape

    def unsqueeze(self, dim: int) -> "NonTensorBase":
        dim = batch_ops.insertion_dim(dim, len(self._batch_size))  # the error of every tensordict's
        return self._transform(lambda positions: positions.unsqueeze(dim), keep_members=True)

    def squeeze(self, dim: int | None = None) -> "NonTensorBase":
        return self._transform(lambda p: p.squeeze() if dim is None else p.squeeze(dim))

    def permute(self, *dims_list: Any, dims: Any = None) -> "NonTensorBase":
        order = permute_order(dims_list, len(self._batch_size), dims)  # (the leading dims may do, as a TensorDict's)
        return self._transform(lambda positions: positions.permute(*order))

    def repeat(self, *repeats: Any) -> "NonTensorBase":
        """The batch dims repeated as ``torch.Tensor.repeat`` does: a new entry (a copy,
        not a view: its writes do not reach self), as in tensordict 0.15.3.

        Example:
            >>> from shared_td import NonTensorStack
            >>> NonTensorStack("a", "b").repeat(2).tolist()
            ['a', 'b', 'a', 'b']
        """
        counts = batch_ops.shape_args(repeats)
        return self._transform(lambda positions: positions.repeat(*counts)).clone()

    def repeat_interleave(self, repeats: Any, dim: int | None = None, *, output_size: int | None = None) -> "NonTensorBase":
        """``torch.repeat_interleave`` of the batch dims (flattened when ``dim`` is None):
        a new entry, as ``repeat``.

        Example:
            >>> from shared_td import NonTensorStack
            >>> NonTensorStack("a", "b").repeat_interleave(2).tolist()
            ['a', 'a', 'b', 'b']
        """
        return self._transform(
            lambda positions: positions.repeat_interleave(repeats, dim=dim, output_size=output_size)).clone()

    def contiguous(self) -> "NonTensorBase":
        return self.clone()

    def to(self, *args: Any, **kwargs: Any) -> "NonTensorBase":
        """Record a new device (``to(dtype)`` leaves non-tensor data as it is)."""
        target = args[0] if args else kwargs.get("device", kwargs.get("dtype"))
        if isinstance(target, torch.dtype) or target is None:
            return self
        out = self.clone(recurse=False)
        out._device = parse_device(target)
        return out

    def share_memory_(self) -> "NonTensorBase":
        """Move the value into a cell shared between processes (see
        ``TensorDict.share_memory_``) and lock; returns self."""
        if self._shared_value is None:
            self._share()
        self._is_shared = True
        return self.lock_()

    def _with_batch_size(self, batch_size: torch.Size, key: str) -> "NonTensorBase":
        if self._batch_size[: len(batch_size)] == batch_size:
            return self
        raise BatchSizeMismatchError(
            f"Non-tensor entry {key!r} has batch_size {list(self._batch_size)}, which "
            f"does not start with the tensordict's batch_size {list(batch_size)}."
        )

    def _compare_data(self, other: Any) -> torch.Tensor:
        values = self._flat_values()
        if isinstance(other, NonTensorBase):
            others = other.expand(self._batch_size)._flat_values() if other.batch_size != self._batch_size else other._flat_values()
        else:
            others = [other] * len(values)
        equal = [bool(a == b) for a, b in zip(values, others)]
        return torch.tensor(equal, dtype=torch.bool).reshape(self._batch_size)

    def __eq__(self, other: Any) -> torch.Tensor:  # type: ignore[override]
        # A bool tensor of the batch shape, as tensordict gives (no keys to map over).
        return self._compare_data(other)

    def __ne__(self, other: Any) -> torch.Tensor:  # type: ignore[override]
        return ~self._compare_data(other)

    def __lt__(self, other: Any) -> Any:
        return NotImplemented  # no order between Python values of any type

    __le__ = __gt__ = __ge__ = __lt__

    def _flat_values(self) -> list:
        raise NotImplementedError

    # A SharedValue holding the payload after share_memory_(), or when memory-mapped
    # with share_non_tensor=True: in-place writes in one process are then seen by all.
    _shared_value = None

    def _share(self) -> None:
        """Move the payload into a process-shared cell (share_memory_(),
        memmap_(share_non_tensor=True))."""
        from shared_td.storage.shared_value import SharedValue

        payload = self._payload
        self._shared_value = SharedValue.create(payload)
        # the cell holds the value now: a stale private copy would be pickled (by value)
        # with every entry sent to another process
        self.__dict__.pop("_local_payload", None)

    @property
    def _payload(self) -> Any:
        return self._local_payload if self._shared_value is None else self._shared_value.get()

    @_payload.setter
    def _payload(self, value: Any) -> None:
        if self._shared_value is None:
            self._local_payload = value
        else:
            self._shared_value.set(value)

    def _updating(self) -> Any:
        """A block in which an update (read, write, rewrite of the files) of a shared
        entry is not interleaved with another process's."""
        return contextlib.nullcontext() if self._shared_value is None else self._shared_value.updating()

    def _after_update(self, touched: list | None = None) -> None:
        """An in-place write of a memory-mapped entry also rewrites its files (those of
        the entry a view of its shared value was made from, with that entry's batch size);
        that of a view of a plain NonTensorStack reaches the stack: the flat positions
        ``touched`` (None: all), never the others, which the view holds as they were
        when it was made (another write may have changed them in the stack since)."""
        entry = self.__dict__.get("_origin", self)
        if entry._is_memmap and entry._memmap_prefix is not None:
            from shared_td.persist.writer import rewrite_node

            rewrite_node(entry, entry._memmap_prefix)
        piece_of = self.__dict__.get("_piece_of")
        if piece_of is not None:  # a piece of a plain NonTensorStack: the write reaches the stack
            stack, taken = piece_of
            values = self._flat_values()
            written = range(len(taken)) if touched is None else touched
            stack._write_positions([taken[i] for i in written], [values[i] for i in written])

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        # the stack a piece writes into stays here: a pickled row (a DataLoader worker's
        # td[i]) would carry the whole stack, and a copy's writes reach no stack anyway
        state.pop("_piece_of", None)
        return state

    def _check_update(self, value: Any) -> None:
        """Raise if ``_update_(value)`` would fail (it writes nothing)."""
        raise NotImplementedError

    # True for a piece (a row, a slice, a reshape...) of a memory-mapped or shared
    # NonTensorStack: it holds copies of the stack's values, so an in-place write into it
    # would reach neither the stack, its files nor another process (set by
    # NonTensorStack._transform).
    _copy_of_stored_stack = False

    # Why this entry may not be written in place: it was loaded with mode="r" or from an
    # archive, whose files a write does not reach (set by its NodeKind's rebuild); None
    # when writable. (Its tensors' ReadOnlyError said so; a non-tensor write changed this
    # process's copy only, silently.)
    _read_only_reason: str | None = None

    def _refuse_copy_write_at(self, index: tuple, source: Any) -> None:
        """``self[index] = source`` on such a copy, or on a read-only entry: raise unless
        the elements already hold those values (then nothing changes and no write is lost)."""
        if (self._copy_of_stored_stack or self._read_only_reason) and not self._holds_only(index, source):
            self._refuse_copy_write()

    def _refuse_copy_write(self) -> None:
        """Raise if self is such a copy, or read-only: the write would be lost silently
        (tensordict 0.15.3 refuses it for a memory-mapped stack too)."""
        if self._read_only_reason:
            raise ReadOnlyError(
                f"Cannot write into this {type(self).__name__} in place: {self._read_only_reason}, so "
                "a write would change this process's copy only, never the save. Load it with "
                "mode='r+' (an archive: unpack_memmap it first), or set() a new value.")
        if self._copy_of_stored_stack:
            raise RuntimeError(
                "Cannot update a leaf NonTensorDataBase from a memmaped parent "
                f"NonTensorStack: this {type(self).__name__} is a copy of values of a "
                "memory-mapped or shared NonTensorStack, so an in-place write would change "
                "the copy only, never the stack. Write through the stack at the proper "
                "index instead: stack[index] = value, td[index] = ... or "
                "td.update_at_(..., index)."
            )

    def update_(self, other: Any, *, keys_to_update: Any = None, non_blocking: bool = False, **kwargs: Any) -> "NonTensorBase":
        """Write the value(s) of the NonTensorData or NonTensorStack ``other`` into self,
        in place; returns self. Allowed when locked; a shared entry's write is seen by
        every process and a memory-mapped one's files are rewritten. (A non-tensor
        entry has no keys: ``keys_to_update`` is accepted and ignored, as in
        tensordict.)

        Raises:
            TypeError: if ``other`` is not a NonTensorData or NonTensorStack.
            ValueError: if its values do not fit self (a stack into a NonTensorData,
                a stack of another batch size); self is then unchanged.
        """
        if not isinstance(other, NonTensorBase):
            raise TypeError(
                f"{type(self).__name__}.update_() and copy_() need a NonTensorData or "
                f"NonTensorStack source, got a {type(other).__name__}: wrap the value in "
                "NonTensorData(value)."
            )
        self._update_(other)
        return self

    def update(self, other: Any, *, inplace: bool = False, keys_to_update: Any = None,
               non_blocking: bool = False, **kwargs: Any) -> "NonTensorBase":
        """Set the value(s) of the NonTensorData or NonTensorStack ``other``; returns self.

        Raises:
            LockedTensorDictError: (a RuntimeError) when locked and not ``inplace``,
                as a locked TensorDict refuses ``update``.
        """
        if not inplace:
            self._check_unlocked((), f"replace the value of this locked {type(self).__name__} "
                                     "(update(other, inplace=True) writes it in place)")
        return self.update_(other, keys_to_update=keys_to_update)
