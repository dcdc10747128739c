"""What NonTensorData and NonTensorStack share (NonTensorBase): no keys, batch-dim
operations through ``_transform``, comparisons, and the payload that may live in a cell
shared between processes.

A subclass says how its values follow an operation on the batch dims (``_transform``:
the operation applied to a tensor of element positions), what its values are
(``_flat_values``) and how an in-place write checks and lands (``_check_update``,
``_update_``). The payload is ``_payload``: a private attribute, or a SharedValue after
``share_memory_()`` or a memmap with ``share_non_tensor=True``, so that an in-place write
in one process is seen by all (``_updating`` keeps such a write whole, and
``_store`` rewrites the files of a memory-mapped entry first).
"""
from __future__ import annotations

import contextlib
import numbers
import os
import pickle
from typing import Any, Callable

import torch

from shared_td.containers import batch as batch_ops
from shared_td.containers.base import TensorDictBase, is_non_tensor, is_tensor_collection, parse_device
from shared_td.containers.batch_dim_ops import NonTensorBatchDimOps
from shared_td.containers.nontensor_maps import NonTensorMaps
from shared_td.nontensor_values import same_value
from shared_td.containers.reshaping import permute_order
from shared_td.containers.to_args import parse_to
from shared_td.errors import BatchSizeMismatchError, ReadOnlyError
from shared_td.keys import key_repr


def record_node(value: "NonTensorBase", directory: str | None) -> None:
    """``value`` lives in the node directory ``directory`` (None: in memory), as mapped
    or loaded now: its path, and which directory that is (``(st_dev, st_ino)``), which an
    in-place write checks before it rewrites the files (see ``_store``).

    Example:
        >>> import tempfile
        >>> value = NonTensorData("x")
        >>> with tempfile.TemporaryDirectory() as d:
        ...     record_node(value, d)
        ...     value._memmap_prefix == d, value._memmap_node == (os.stat(d).st_dev, os.stat(d).st_ino)
        (True, True)
    """
    state = value.__dict__
    if value._shared_value is None and "_origin" in state and "_local_payload" not in state:
        # a view of a memory-mapped value (_same_value) saved on its own: its value lives
        # here now, no longer in the entry it was made from (whose files its set_ rewrote)
        state["_local_payload"] = state.pop("_origin")._payload
    value._memmap_prefix = directory
    node = None
    if directory is not None:
        try:
            st = os.stat(directory)
            node = (st.st_dev, st.st_ino)
        except OSError:
            pass  # (nothing to check against: a write finds the path as it finds it)
    value._memmap_node = node


class NonTensorBase(NonTensorMaps, NonTensorBatchDimOps, TensorDictBase):
    """Shared mechanics: no keys, batch-dim ops through ``_transform``."""

    _is_non_tensor = True
    _one_value = False  # a NonTensorData: one value for the whole batch

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
        """The batch size. Settable, as in tensordict 0.15.3: a NonTensorData (one value)
        takes any batch size; a NonTensorStack only its own (its values are laid out so).

        Examples:
            >>> value = NonTensorData("walk", batch_size=[3])
            >>> value.batch_size = [2, 5]
            >>> value.batch_size
            torch.Size([2, 5])
        """
        return self._batch_size

    @batch_size.setter
    def batch_size(self, new_size: Any) -> None:
        new_size = batch_ops.as_batch_size(new_size)
        if new_size != self._batch_size and not self._one_value:
            raise BatchSizeMismatchError(
                f"Cannot set the batch_size of a {type(self).__name__} of batch_size "
                f"{list(self._batch_size)} to {list(new_size)}: it holds one value per element. "
                "Reshape it (reshape, unsqueeze...), or make a new stack."
            )
        self._batch_size = new_size

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

    def _transform(self, op: Callable[[torch.Tensor], torch.Tensor], keep_members: bool = False,
                   added_dims: int = 0) -> "NonTensorBase":
        raise NotImplementedError

    def _index(self, index: Any) -> "NonTensorBase":
        index = batch_ops.normalize_index(index, self._batch_size)
        batch_ops.indexed_batch_size(self._batch_size, index)  # range checks
        return self._transform(lambda positions: positions[index], keep_members=True,
                               added_dims=sum(part is None for part in index))

    def expand(self, *shape: Any) -> "NonTensorBase":
        """The values broadcast to ``shape``, as ``reshape``: a NonTensorData stays one
        (tensordict 0.15.3 gives a NonTensorStack of the value)."""
        size = batch_ops.shape_args(shape)
        return self._transform(lambda positions: positions.expand(size))

    def reshape(self, *shape: Any) -> "NonTensorBase":
        """The values in the batch shape ``shape`` (``view`` is the same). A stack's
        result is a view, as tensordict's: its in-place writes (``set_``, index writes)
        reach self; a NonTensorData's holds the same value (the same cell when shared).
        reshape, view, expand and permute give one value per element, not the stacked
        members; the other methods of this kind say how they differ from tensordict's.

        Example:
            >>> from shared_td import NonTensorStack
            >>> NonTensorStack("a", "b", "c", "d").reshape(2, 2).tolist()
            [['a', 'b'], ['c', 'd']]
        """
        size = batch_ops.shape_args(shape)
        return self._transform(lambda positions: positions.reshape(size))

    view = reshape

    def unsqueeze(self, dim: int) -> "NonTensorBase":
        """A new batch dim of size 1 at ``dim``, as ``reshape`` (a stack's members are
        kept); a NonTensorData stays one (tensordict 0.15.3: a NonTensorStack)."""
        dim = batch_ops.insertion_dim(dim, len(self._batch_size))  # the error of every tensordict's
        return self._transform(lambda positions: positions.unsqueeze(dim), keep_members=True)

    def squeeze(self, dim: int | None = None) -> "NonTensorBase":
        """The batch dims of size 1 (or ``dim``) removed, as ``reshape``; always a new
        container (tensordict 0.15.3 returns self when nothing is removed)."""
        return self._transform(lambda p: p.squeeze() if dim is None else p.squeeze(dim))

    def permute(self, *dims_list: Any, dims: Any = None) -> "NonTensorBase":
        """The batch dims in the order ``dims_list`` (or ``dims``), as ``reshape``."""
        order = permute_order(dims_list, len(self._batch_size), dims)  # (the leading dims may do, as a TensorDict's)
        return self._transform(lambda positions: positions.permute(tuple(order)))  # (one tuple: () for 0 dims)

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
        """A new container holding the same values (as ``clone()``: a write into it never
        reaches self); tensordict 0.15.3 returns a NonTensorStack itself."""
        return self.clone()

    def to(self, *args: Any, **kwargs: Any) -> "NonTensorBase":
        """A new entry holding the same values (as ``clone()``) on the device asked;
        a dtype casts nothing. As tensordict's, the result has its own values, never the
        shared cell or files of self: a write into ``td.to(device)`` or
        ``td.to(torch.float64)`` reaches neither ``td`` nor another process.

        Example:
            >>> shared = NonTensorData("a", batch_size=[2]).share_memory_()
            >>> moved = shared.to("cpu", torch.float64)
            >>> moved.update_(NonTensorData("b")).data, shared.data, moved.device
            ('b', 'a', device(type='cpu'))
        """
        device, dtype, _ = parse_to(args, kwargs)
        if device is None and dtype is None:
            return self
        out = self.clone()
        if device is not None:
            out._device = device
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
        # Worded as tensordict's error starts, so handlers matching on it still match.
        raise BatchSizeMismatchError(
            f"batch dimension mismatch for key {key!r}: the non-tensor entry has batch_size "
            f"{list(self._batch_size)}, which does not start with the tensordict's batch_size "
            f"{list(batch_size)}."
        )

    def _compare_data(self, other: Any) -> torch.Tensor:
        if isinstance(other, NonTensorBase) and other.batch_size != self._batch_size:
            # another batch size (a ``from_dict(auto_batch_size=False)`` copy's [] beside
            # its source's [2]): one value compares with each of ours, in our batch shape,
            # as in tensordict 0.15.3; a stack's values broadcast with ours
            from shared_td.containers.nontensor import NonTensorData

            if isinstance(other, NonTensorData):
                other = other.data
            else:
                size = torch.broadcast_shapes(self._batch_size, other.batch_size)
                return self.expand(size)._compare_data(other.expand(size))
        values = self._flat_values()
        if isinstance(other, NonTensorBase):
            others = other._flat_values()
        else:
            others = [other] * len(values)
        # (same_value: a value whose == is element-wise, a tensor or an array, is equal
        # where it is equal everywhere; bool() of it raised)
        equal = [same_value(a, b) for a, b in zip(values, others)]
        return torch.tensor(equal, dtype=torch.bool).reshape(self._batch_size)

    def __eq__(self, other: Any) -> Any:  # type: ignore[override]
        # Another value: a bool tensor of the batch shape, as tensordict gives for two
        # non-tensors. A number or a tensor compares with tensors only, as in a
        # TensorDict (whose non-tensor entries it ignores): an empty TensorDict of our
        # batch size, as tensordict 0.15.3 gives, so ``(nt == 0).all()`` is True.
        if isinstance(other, (numbers.Number, torch.Tensor)):
            return self._no_tensors()
        return self._compare_data(other)

    def __ne__(self, other: Any) -> Any:  # type: ignore[override]
        if isinstance(other, (numbers.Number, torch.Tensor)):
            return self._no_tensors()
        return ~self._compare_data(other)

    def _no_tensors(self) -> TensorDictBase:
        """The result of comparing with a number or tensor (see ``__eq__``).

        Example:
            >>> nt = NonTensorData("a", batch_size=[2])
            >>> (nt == 0).batch_size, list((nt == 0).keys()), (nt == 0).all()
            (torch.Size([2]), [], True)
        """
        from shared_td.containers.tensordict import TensorDict

        return TensorDict(batch_size=self._batch_size, device=self._device)

    def __lt__(self, other: Any) -> Any:
        return NotImplemented  # no order between Python values of any type

    __le__ = __gt__ = __ge__ = __lt__

    def _flat_values(self) -> list:
        raise NotImplementedError

    # A SharedValue holding the payload after share_memory_(), or when memory-mapped
    # with share_non_tensor=True: in-place writes in one process are then seen by all.
    _shared_value = None

    def _share(self, cell=None) -> None:
        """Move the payload into a process-shared cell (share_memory_(),
        memmap_(share_non_tensor=True)): ``cell`` if given (made holding the payload
        already, with the other values of a tree: one memfd for all), else a new one."""
        from shared_td.storage.shared_value import SharedValue

        self._shared_value = SharedValue.create(self._payload) if cell is None else cell
        # the cell holds the value now: a stale private copy would be pickled (by value)
        # with every entry sent to another process; a view of a memory-mapped value
        # (_same_value) no longer writes through the entry it was made from (audit 21: a
        # row saved with share_non_tensor=True rewrote its parent's files)
        self.__dict__.pop("_local_payload", None)
        self.__dict__.pop("_origin", None)

    @property
    def _payload(self) -> Any:
        if self._shared_value is not None:
            return self._shared_value.get()
        state = self.__dict__
        if "_local_payload" not in state and "_origin" in state:
            return state["_origin"]._payload  # a view of a memory-mapped value (_same_value)
        return self._local_payload

    @_payload.setter
    def _payload(self, value: Any) -> None:
        state = self.__dict__
        if self._shared_value is not None:
            self._shared_value.set(value)
        elif "_local_payload" not in state and "_origin" in state:
            state["_origin"]._payload = value  # the entry's one value: the parent sees the write
        else:
            self._local_payload = value

    def _updating(self) -> Any:
        """A block in which an update (read, write, rewrite of the files) of a shared
        entry is not interleaved with another process's."""
        return contextlib.nullcontext() if self._shared_value is None else self._shared_value.updating()

    def _check_storable(self, values: list, key: Any) -> None:
        """Raise, naming the entry ``key``, unless ``values`` (the new values of a planned
        in-place write) can be stored where this entry keeps them: a shared cell holds
        them pickled, a memory-mapped entry's files as JSON, else pickled, so what pickles
        is stored. A multi-entry write (``td[idx] = ...``, ``update_``, ``update_at_``)
        checks it when planned, so a lambda or a lock fails before any entry is written.
        An entry in memory takes any object (no check, no cost). (Pickling 64 short
        strings takes ~2 us: less than walking them to see whether they are JSON.)

        Example:
            >>> shared = NonTensorStack("a", "b").share_memory_()
            >>> shared._check_storable(["c"], "s")  # fine: nothing raised
            >>> try:
            ...     shared._check_storable(["c", lambda: 1], "s")
            ... except TypeError as error:
            ...     print(str(error).split(":")[0])
            Cannot write a function into the non-tensor entry 's'
        """
        entry = self.__dict__.get("_origin", self)
        shared = self._shared_value is not None
        if not shared and not (entry._is_memmap and entry._memmap_prefix is not None):
            return
        name = key_repr(key) if isinstance(key, tuple) else repr(key)
        try:
            pickle.dumps(values)  # (a value given for many elements is pickled once: memo)
        except Exception as whole:
            for value in values:  # (the failure path only: name the value at fault)
                try:
                    pickle.dumps(value)
                except Exception as error:
                    where = ("shared between processes (share_memory_(), share_non_tensor=True): its cell "
                             "holds its values pickled" if shared else
                             "memory-mapped: its files hold its values as JSON, else pickled")
                    raise TypeError(
                        f"Cannot write a {type(value).__name__} into the non-tensor entry "
                        f"{name}: the entry is {where}, "
                        f"and this value cannot be pickled "
                        f"({error}). Nothing was written. Write a picklable value (a function "
                        "defined at module level, not a lambda; no lock or open file), or keep "
                        "such values in a tensordict that is neither shared nor memory-mapped."
                    ) from error
            raise TypeError(  # (each pickles alone, not together: still the one rule, a TypeError)
                f"Cannot write these values into the non-tensor entry {name}: they cannot be "
                f"pickled together ({whole}). Nothing was written.") from whole

    def _check_storable_write(self, value: Any, key: Any) -> None:
        """``_check_storable`` for an in-place write of the whole entry (``set_``,
        ``set(..., inplace=True)``) of ``value``: a NonTensorData or NonTensorStack, or
        the Python value (a stack: the per-element values) given. Nothing to check for an
        entry in memory, or for a tensor (which the write refuses: _refuse_tensor_value).

        Example:
            >>> td = TensorDict(s=NonTensorData("x"), batch_size=[]).share_memory_()
            >>> try:
            ...     td.set_("s", lambda: 1)
            ... except TypeError as error:
            ...     print(str(error).split(":")[0])
            Cannot write a function into the non-tensor entry 's'
        """
        entry = self.__dict__.get("_origin", self)
        if self._shared_value is None and not (entry._is_memmap and entry._memmap_prefix is not None):
            return
        if isinstance(value, NonTensorBase):
            values = value._flat_values()
        elif isinstance(value, torch.Tensor) or is_tensor_collection(value):
            return
        elif self._one_value:
            values = [value]
        else:
            try:
                values = self._new_values(value)
            except Exception:  # (values that do not fit: the write raises its own error)
                values = [value]
        self._check_storable(values, key)

    def _store(self, payload: Any, touched: list | None = None) -> None:
        """Store ``payload``, the new values of an in-place write (called inside
        ``_updating()``), then pass the write on (``_after_update``). A memory-mapped
        entry's files (those of the entry a view of its shared value was made from) are
        rewritten first, from a private copy holding ``payload``: a write that they
        cannot take (a full disk) changes neither them nor the values in memory (nor the
        shared cell), so memory and files agree after a failure; should the cell then
        refuse the value (a full memory), the files are put back.

        A writer killed (SIGKILL) before the files' renames leaves the old files and cell;
        between files and cell, the files hold the new value, the cell the old one (the
        cell wins while it exists: sharing processes read it, a fresh load_memmap the
        files, as a killed tensor write leaves its bytes; the next write rewrites both).
        Files first, because then every error a write raises (a full disk, a stale view's
        SaveChangedError) changes nothing any process can read: with the cell first it
        would take back a value other processes may have read (lock-free)."""
        entry = self.__dict__.get("_origin", self)
        if not (entry._is_memmap and entry._memmap_prefix is not None):
            self._payload = payload
        else:
            from shared_td.persist.node_rewrite import rewrite_node

            before = self._payload if self._shared_value is not None else None
            # the directory it was mapped from or loaded from (see record_node): a stale
            # view's write must never rewrite a newer save's files at the same path
            expected = entry.__dict__.get("_memmap_node")
            rewrite_node(entry._holding(payload), entry._memmap_prefix, expected)
            try:
                self._payload = payload  # (an attribute, or the shared cell)
            except BaseException:
                with contextlib.suppress(Exception):  # the cell's error is the one to raise
                    rewrite_node(entry._holding(before), entry._memmap_prefix, expected)
                raise
        self._after_update(touched)

    def _holding(self, payload: Any) -> "NonTensorBase":
        """A private copy of this entry (its class, batch size, device; no shared cell,
        no view links) holding ``payload``: what ``_store`` writes the files from."""
        copy = object.__new__(type(self))
        copy.__dict__.update(self.__dict__)
        for link in ("_shared_value", "_origin", "_piece_of"):
            copy.__dict__.pop(link, None)
        copy._local_payload = payload
        return copy

    def _after_update(self, touched: list | None = None) -> None:
        """After ``_store``: the in-place write of a view of a plain NonTensorStack
        reaches the stack: the flat positions ``touched`` (None: all), never the others,
        which the view holds as they were when it was made (another write may have
        changed them in the stack since)."""
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

    def _refuse_tensor_value(self, value: Any) -> None:
        """A tensor or tensordict written in place into a non-tensor entry
        (``td.set_("text", torch.ones(3))``, ``set(..., inplace=True)``, ``update_``) is
        refused, as tensordict 0.15.3 refuses it: it would become the entry's Python value
        (a stack: one row per element), hiding a write meant for a tensor entry. A
        ``NonTensorData`` holding a tensor is a value, and is written."""
        if isinstance(value, torch.Tensor) or (is_tensor_collection(value) and not is_non_tensor(value)):
            raise TypeError(
                f"Cannot write a {type(value).__name__} in place into a {type(self).__name__} "
                "(a non-tensor entry): replace the entry with set() (not in place), or wrap "
                "a value meant as Python data in NonTensorData(value)."
            )

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
                "a write would change this process's copy only, never the save. Replace the "
                "value in memory with set() (not in place), and save the tree again to keep it.")
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
