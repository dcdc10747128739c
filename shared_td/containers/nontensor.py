"""Non-tensor entries: NonTensorData (one value for the whole batch) and NonTensorStack
(one value per batch element).

``td["task"] = "walk"`` stores a NonTensorData; stacking tensordicts turns their
NonTensorData into a NonTensorStack.  Batch-dim operations on a stack are delegated to
torch: the same operation is applied to a tensor of element positions, and the values
are gathered at the resulting positions, so indexing, permute, expand, ... follow
torch's rules exactly.

The mechanics both classes share are in nontensor_base.py (NonTensorBase), the helpers
on plain Python values in nontensor_values.py.
"""
from __future__ import annotations

import functools
import itertools
import textwrap
from typing import Any, Callable, Sequence

import torch

from shared_td.containers import batch as batch_ops
from shared_td.containers.linked_list import linked_values
from shared_td.containers.nontensor_base import NonTensorBase
from shared_td.containers.nontensor_options import capture_non_tensor_stack
from shared_td.nontensor_values import identical_value, nest, nested_shape, one_member, same_value
from shared_td.errors import BatchSizeMismatchError


class NonTensorDataBase(NonTensorBase):
    """The base class of NonTensorData, as in tensordict 0.15.3 (where MetaData derives
    from it too). A NonTensorStack is not one: ``is_non_tensor`` tests for both."""

    _one_value = True


class NonTensorData(NonTensorDataBase):
    """One Python value shared by every element of a batch.

    Examples:
        >>> td = TensorDict(batch_size=[3])
        >>> td["task"] = "walk"
        >>> td.get("task")
        NonTensorData(data=walk, batch_size=torch.Size([3]), device=None)
        >>> td["task"], td[0]["task"]
        ('walk', 'walk')
    """

    def __init__(self, data: Any = None, batch_size: Any = None, device: Any = None, names: Any = None):
        if isinstance(data, NonTensorData):
            data = data.data
        self.data = data
        self._init_flags(batch_size, device)

    @property
    def data(self) -> Any:
        """The value (read from shared memory when shared with share_non_tensor=True)."""
        return self._payload

    @data.setter
    def data(self, value: Any) -> None:
        self._payload = value
        if "_piece_of" in self.__dict__:  # a view of a plain NonTensorStack: the stack takes it too,
            self._after_update()  # as tensordict's, whose views hold the stack's members

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Call the value (a function held as a non-tensor), as tensordict 0.15.3 does:
        ``td.apply(lambda x, f: f(x), fns)`` calls each held function."""
        return self.data(*args, **kwargs)

    def _python_value(self) -> Any:
        return self.data

    _read_value = _python_value  # (what td[key] and a tensorclass field give: the value)

    def tolist(self) -> Any:
        """The value repeated along the batch dims, as nested lists."""
        out: Any = self.data
        for n in reversed(self._batch_size):
            out = [out] * n
        return out

    def _flat_values(self) -> list:
        return [self.data] * self._batch_size.numel()

    def _transform(self, op: Callable[[torch.Tensor], torch.Tensor], keep_members: bool = False,
                   added_dims: int = 0) -> "NonTensorData":
        base = torch.zeros((), dtype=torch.uint8).expand(self._batch_size)
        taken = op(base)
        if not taken.numel() or taken.untyped_storage().data_ptr() != base.untyped_storage().data_ptr():
            # an index list, tensor or mask (or nothing selected): a copy, as a tensor's,
            # whose writes stay in it (a shared or memory-mapped value's copy kept its cell
            # or its files: a write into a sampled row replaced the source's value)
            return NonTensorData(self.data, batch_size=taken.shape, device=self._device)
        return self._same_value(taken.shape)

    def _with_batch_size(self, batch_size: torch.Size, key: str) -> "NonTensorData":
        if self._batch_size == batch_size:
            return self
        return self._same_value(batch_size)

    def _same_value(self, batch_size: torch.Size) -> "NonTensorData":
        """This value with another batch size (an indexed, reshaped or unbound view). A
        shared value stays the one cell, as in tensordict: a ``set_`` through
        ``td[1]`` reaches every process (and the files of a memory-mapped entry, written
        by the entry itself); before, the view held a private copy and the write was
        lost to all but itself."""
        origin = self.__dict__.get("_origin", self)
        if self._shared_value is None and not (origin._is_memmap and origin._memmap_prefix is not None):
            return NonTensorData(self.data, batch_size=batch_size, device=self._device)
        # a memory-mapped value (not shared) is one value too: the view reads and writes
        # the entry's own payload (the _payload property), so td[1].set_ reaches the parent
        # and its files; a private copy lost the write silently (td[1] = ... raises instead)
        view = NonTensorData(None, batch_size=batch_size, device=self._device)
        view._shared_value, view._is_shared, view._is_memmap = self._shared_value, self._is_shared, self._is_memmap
        view.__dict__.pop("_local_payload", None)
        view._origin = origin  # whose files a write rewrites (_store), whose payload it holds
        return view

    def clone(self, recurse: bool = True) -> "NonTensorData":
        """A new NonTensorData holding the same value (not a copy of it); with
        ``recurse=False`` a shared value stays shared (``td.clone(False)``, ``copy()``),
        as in tensordict."""
        if recurse:
            return NonTensorData(self.data, batch_size=self._batch_size, device=self._device)
        return self._same_value(self._batch_size)

    def _check_update(self, value: Any) -> None:
        self._refuse_copy_write()
        self._refuse_tensor_value(value)
        if isinstance(value, NonTensorStack):
            raise ValueError(
                "Cannot write a NonTensorStack or a list (one value per element) in place into a "
                "NonTensorData (one value for the batch); replace the entry with set() instead, "
                "or write NonTensorData(the_list) to keep a list as one value."
            )

    def _update_(self, value: Any) -> None:
        self._check_update(value)
        with self._updating():  # so that the files end with the last value written
            self._store(value.data if isinstance(value, NonTensorData) else value)  # (files first)

    def _set_at(self, index: tuple, source: Any) -> "NonTensorBase":
        """``td[index] = ...`` for this entry: returns the entry to store (maybe a stack)."""
        source = as_non_tensor(source)  # (a list: one value per indexed element)
        if self._holds_only(index, source):
            return self  # as tensordict: writing the value it holds keeps one value
        self._refuse_copy_write()
        if self._stays_one_value(index, source):  # in place: a shared or mapped entry shares it
            self._update_(source)
            return self
        if self._shared_value is not None:
            raise RuntimeError(
                "Cannot write per-element values into a NonTensorData shared with "
                "share_non_tensor=True (one value for the whole batch): write the whole "
                "value with update_() or set_()."
            )
        stack = NonTensorStack._from_flat(self._flat_values(), self._batch_size, self._device)
        return stack._set_at(index, source)

    def _set_at_index(self, index: Any, value: Any) -> None:
        """``data[index] = value``: refused, as in tensordict 0.15.3 (a ValueError),
        unless one value is written over the whole of a 0-d entry (then in place) or the
        value held is written again (nothing changes; tensordict 0.15.3 takes it as a
        NonTensorData). A NonTensorData holds one value for the whole batch and cannot
        turn itself into a stack; before, this was an AttributeError ('_set_at_index'). A
        tensordict that holds the entry can: ``td[index] = ...`` there replaces it with a
        stack."""
        values = broadcast_values(as_non_tensor(value), batch_ops.indexed_batch_size(self._batch_size, index))
        if values and all(identical_value(v, values[0]) for v in values):
            if not self._batch_size:
                self._update_(NonTensorData(values[0], batch_size=[]))
                return
            if identical_value(values[0], self.data):
                return
        raise ValueError(
            "A NonTensorData holds one value for all its elements, so it cannot take "
            f"another value at index {index!r}. Call maybe_to_stack() to get a "
            "NonTensorStack, which holds a value per element, or write through the "
            "tensordict that holds the entry (td[index] = ...)."
        )

    def maybe_to_stack(self) -> "NonTensorBase":
        """A NonTensorStack holding this value (not a copy) at every element, which
        takes per-element writes; self when the batch size is empty (as tensordict
        0.15.3)."""
        if not self._batch_size:
            return self
        return NonTensorStack._from_flat(self._flat_values(), self._batch_size, self._device)

    def _stays_one_value(self, index: tuple, source: Any) -> bool:
        """True if ``self[index] = source`` leaves one value for the whole batch: the one
        held written again, one value written into the only element of a 0-dim entry
        (which tensordict 0.15.3 keeps a NonTensorData), or one value written over every
        element of an entry shared or memory-mapped, which cannot become a stack
        (``lazy[:] = value`` gives each member its part so: tensordict 0.15.3 writes it
        into a memory-mapped stack's members, where this refused it; an entry in memory
        becomes a NonTensorStack, as in tensordict)."""
        if self._holds_only(index, source):
            return True
        if isinstance(source, NonTensorStack):
            return False
        if not self._batch_size:
            return True
        if not (self._is_shared or self._is_memmap):
            return False
        touched, _ = flat_positions(index, self._batch_size)
        return len(set(touched)) == self._batch_size.numel() and isinstance(as_non_tensor(source), NonTensorData)

    def _holds_only(self, index: tuple, source: Any) -> bool:
        """True if every value that ``self[index] = source`` writes is the one held."""
        source = as_non_tensor(source)
        values = broadcast_values(source, batch_ops.indexed_batch_size(self._batch_size, index))
        return all(identical_value(v, self.data) for v in values)

    def __repr__(self) -> str:
        shown = str(self.data)
        if len(shown) > 200:  # as tensordict: a long value is cut in its middle
            shown = f"{shown[:20]}  ...  {shown[-20:]}"
        return f"NonTensorData(data={shown}, batch_size={self._batch_size}, device={self._device})"


class NonTensorStack(NonTensorBase):
    """One Python value per batch element.

    ``NonTensorStack("a", "b")`` stacks values along a new first dim;
    ``NonTensorStack.from_list([["a", "b"], ["c", "d"]])`` builds a 2-D stack.

    Examples:
        >>> td = torch.stack([TensorDict(task="walk"), TensorDict(task="run")])
        >>> td["task"]
        LinkedList(['walk', 'run'])
        >>> td[1]["task"]
        'run'
    """

    def __init__(self, *values: Any, stack_dim: int = 0, batch_size: Any = None, device: Any = None):
        if values and all(isinstance(v, NonTensorBase) for v in values):
            stack = stack_non_tensors(values, stack_dim)
        else:
            stack = NonTensorStack.from_list(list(values), device=device)
        self._values = stack._values
        self._init_flags(stack._batch_size, device)
        if batch_size is not None and batch_ops.as_batch_size(batch_size) != self._batch_size:
            raise BatchSizeMismatchError(
                f"{len(values)} values do not fit batch_size {list(batch_ops.as_batch_size(batch_size))}."
            )

    # Which stacked NonTensorData each value comes from, as tensordict keeps its members:
    # one ``(member id, member's batch dims)`` per value, or None (a value of its own).
    # Indexing that leaves exactly (part of) one member gives that NonTensorData back:
    # ``torch.stack([td1, td2])[0]["task"]`` is td1's single "task" value.
    _members: list | None = None

    @classmethod
    def _from_flat(cls, values: list, batch_size: torch.Size, device: Any = None,
                   members: list | None = None) -> "NonTensorStack":
        stack = cls.__new__(cls)
        stack._values = list(values)
        stack._init_flags(batch_size, device)
        if members is not None and any(m is not None for m in members):
            stack._members = members
        return stack

    @classmethod
    def from_list(cls, values: Sequence, device: Any = None) -> "NonTensorStack":
        """Build a stack from nested lists (equal-length inner lists become a dim)."""
        shape, flat = nested_shape(values)
        return cls._from_flat(flat, torch.Size(shape), device)

    @property
    def _values(self) -> list:
        # the flat values in C order (read from shared memory when shared)
        return self._payload

    @_values.setter
    def _values(self, values: list) -> None:
        self._payload = values

    def _python_value(self) -> list:
        return self.tolist()

    def _read_value(self) -> list:
        """What ``td[key]`` and a tensorclass field give of this entry: its values as a
        LinkedList whose item assignments write into it, as tensordict 0.15.3's."""
        return linked_values(self) if self._batch_size else self.tolist()

    def tolist(self) -> list:
        """The values as nested lists, one level per batch dim."""
        return nest(self._values, list(self._batch_size))

    @property
    def data(self) -> list:
        """Same as ``tolist()``."""
        return self.tolist()

    def _flat_values(self) -> list:
        return list(self._values)

    def _transform(self, op: Callable[[torch.Tensor], torch.Tensor], keep_members: bool = False,
                   added_dims: int = 0) -> "NonTensorBase":
        """``op`` applied to the positions of the values. Only indexing and unsqueeze
        keep the stacked members (as tensordict's lazy stack of them does); a reshape,
        expand or permute gives one value per element. ``added_dims``: the dims of size
        1 that an index's ``None`` adds, which are no dim of the stack: ``stack[0, None]``
        is its member with a dim added, a NonTensorData, as in tensordict 0.15.3."""
        positions = torch.arange(len(self._values)).reshape(self._batch_size)
        new_positions = op(positions)
        taken = new_positions.reshape(-1).tolist()
        values = [self._values[i] for i in taken]
        members = None if self._members is None or not keep_members else [self._members[i] for i in taken]
        if (new_positions.ndim == added_dims and len(values) == 1  # (its dims all indexed away)
                or one_member(members, values, new_positions.ndim - added_dims)):
            piece = NonTensorData(values[0], batch_size=new_positions.shape, device=self._device)
        else:
            piece = NonTensorStack._from_flat(values, new_positions.shape, self._device, members)
        if not new_positions.numel() or (
                new_positions.untyped_storage().data_ptr() != positions.untyped_storage().data_ptr()):
            pass  # an index list, tensor or mask: a copy, as tensordict's, whose writes stay in it
        elif self._is_memmap or self._is_shared or self._shared_value is not None:
            piece._copy_of_stored_stack = True  # (see NonTensorBase._refuse_copy_write)
        else:
            # a view (an int or slice index, a reshape, permute, unsqueeze...): its in-place
            # writes reach this stack, as tensordict's pieces, which hold its members (a
            # sample of a buffer edited in place must not write into the buffer: a copy)
            piece._piece_of = (self, taken)
        return piece

    def _write_positions(self, positions: list, values: list) -> None:
        """Put ``values`` at the flat ``positions``, in place: the write of a piece
        (``_piece_of``), passed on to the stack this one is a piece of."""
        with self._updating():
            stored = list(self._values)
            for position, value in zip(positions, values):
                stored[position] = value
            self._store(stored, positions)  # (a memory-mapped stack's files first)
            self._members = None  # new values: no longer the stacked members

    # Set on what ``lazy.get(key)`` gives (lazy_nontensor.written_through): called with
    # the new flat values and the positions written, it writes them into the lazy
    # stack's members (all checked first), before ``_store`` changes this stack.
    _through_members: Callable[[list, list | None], None] | None = None

    def _store(self, payload: Any, touched: list | None = None) -> None:
        if self._through_members is not None:
            self._through_members(payload, touched)
        super()._store(payload, touched)

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        if state.pop("_through_members", None) is not None:  # a pickled one is a copy of the values
            state.update(_is_shared=False, _is_memmap=False, _is_locked=False)
        return state

    def _flat_members(self) -> list:
        return [None] * len(self._values) if self._members is None else list(self._members)

    def clone(self, recurse: bool = True) -> "NonTensorStack":
        """A new NonTensorStack holding the same values (not copies of them). ``recurse``
        is accepted for compatibility with tensordict, and ignored."""
        return NonTensorStack._from_flat(self._values, self._batch_size, self._device, self._members)

    def _new_values(self, value: Any) -> list:
        source = value if isinstance(value, NonTensorBase) else NonTensorStack.from_list(value)
        return broadcast_values(source, self._batch_size)

    def _check_update(self, value: Any) -> None:
        self._refuse_copy_write()
        self._refuse_tensor_value(value)
        self._new_values(value)

    def _update_(self, value: Any) -> None:
        self._refuse_copy_write()
        self._refuse_tensor_value(value)
        values = self._new_values(value)
        with self._updating():
            self._store(values)  # (a memory-mapped stack's files first: a failure changes nothing)
            self._members = None  # new values: no longer the stacked members

    def _set_at(self, index: tuple, source: Any) -> "NonTensorStack":
        """Write ``source`` at ``index``, in place (so a shared stack shares the write).

        The replay buffer's row write: the positions come from the index (``flat_positions``),
        and a stack in this process's memory changes its list in place, so one row costs
        O(1), not O(rows). A shared or memory-mapped stack stores a new list (its cell
        pickles the whole list, its files hold the whole column: O(rows) per write)."""
        touched, shape = flat_positions(index, self._batch_size)
        source = as_non_tensor(source)  # (a list: one value per indexed element, as tensordict)
        new_values = broadcast_values(source, shape)
        self._refuse_copy_write_at(index, source)
        if self._copy_of_stored_stack:
            return self  # it holds those values already: nothing changes
        with self._updating():  # read-modify-write: no other process's write is lost
            values = self._values
            # the list itself only when nothing can fail after it changed and nothing else
            # holds it: not a shared cell's cached value (its write may fail: memory full),
            # nor one whose files or lazy stack's members are written first (may refuse)
            if not (self._shared_value is None and self._through_members is None and "_origin" not in
                    self.__dict__ and not (self._is_memmap and self._memmap_prefix is not None)):
                values = list(values)
            for position, value in zip(touched, new_values):
                values[position] = value
            self._store(values, touched)  # (a memory-mapped stack's files first)
            self._members = None  # new values: no longer the stacked members
        return self

    def _holds_only(self, index: tuple, source: Any) -> bool:
        """True if the elements at ``index`` already hold the values that
        ``self[index] = source`` writes."""
        source = as_non_tensor(source)
        touched, shape = flat_positions(index, self._batch_size)
        new_values = broadcast_values(source, shape)
        values = self._values
        return all(identical_value(values[p], v) for p, v in zip(touched, new_values))

    def maybe_to_stack(self) -> "NonTensorStack":
        """A new stack of the same values (not copies of them), as tensordict 0.15.3."""
        return self.clone()

    def _set_at_index(self, index: Any, value: Any) -> None:
        """``stack[index] = value``, in place (as tensordict 0.15.3): a memory-mapped
        stack rewrites its files, a shared one is seen by every process."""
        self._set_at(batch_ops.normalize_index(index, self._batch_size), value)

    def __repr__(self) -> str:
        # tensordict 0.15.3's layout: one part a line, the values cut after 50 characters
        shown = str(self.tolist())
        if len(shown) > 50:
            shown = f"{shown[:50]}..."
        parts = (shown, f"batch_size={self._batch_size}", f"device={self._device}")
        return "NonTensorStack(\n" + ",\n".join(textwrap.indent(part, "    ") for part in parts) + ")"


def flat_positions(index: tuple, batch_size: torch.Size) -> tuple[list, torch.Size]:
    """The flat (C-order) positions that the normalized ``index`` selects in a batch of
    ``batch_size``, and the indexed shape. The replay buffer's indices on one batch dim
    (an int, a slice, an integer tensor: its values are the positions) are computed
    without a tensor of every position; anything else indexes one read-only tensor of
    the positions, made once per batch size (``_all_positions``).

    Example:
        >>> flat_positions((-1,), torch.Size([5])), flat_positions((slice(1, 5, 2),), torch.Size([5]))
        (([4], torch.Size([])), ([1, 3], torch.Size([2])))
        >>> flat_positions((torch.tensor([0, -1]),), torch.Size([5]))
        ([0, 4], torch.Size([2]))
        >>> flat_positions((1,), torch.Size([2, 3]))
        ([3, 4, 5], torch.Size([3]))
    """
    if len(batch_size) == 1 and len(index) == 1:
        part, rows = index[0], batch_size[0]
        kind = type(part)
        if kind is int and -rows <= part < rows:
            return [part + rows if part < 0 else part], torch.Size([])
        if kind is slice and (part.step is None or (type(part.step) is int and part.step > 0)):
            taken = range(*part.indices(rows))
            return list(taken), torch.Size([len(taken)])
        if isinstance(part, torch.Tensor) and part.dtype in _POSITION_DTYPES:
            flat = part.reshape(-1).tolist()
            if all(-rows <= p < rows for p in flat):  # (else torch's IndexError, below)
                return [p + rows if p < 0 else p for p in flat], part.shape
    targets = _all_positions(batch_size)[index]
    return targets.reshape(-1).tolist(), targets.shape


_POSITION_DTYPES = frozenset({torch.int64, torch.int32, torch.int16, torch.int8})  # (uint8: a mask)


@functools.lru_cache(maxsize=8)
def _all_positions(batch_size: torch.Size) -> torch.Tensor:
    """``arange(numel).reshape(batch_size)``, made once per batch size (making it costs
    O(numel) at each write otherwise). Only ever read (indexed)."""
    return torch.arange(batch_size.numel()).reshape(batch_size)


def stack_non_tensors(items: Sequence[NonTensorBase], dim: int) -> NonTensorBase:
    """``torch.stack`` of non-tensor entries: one value per element, each NonTensorData
    stacked remembered as a member (with ``set_capture_non_tensor_stack(True)``, a
    NonTensorData when every item is one of one equal value)."""
    dim = batch_ops.insertion_dim(dim, len(items[0].batch_size), "torch.stack")  # the error of every tensordict's
    stacked = _combine(items, lambda positions: torch.stack(positions, dim), members=True)
    return _one_value(items, stacked) if capture_non_tensor_stack() else stacked


def cat_non_tensors(items: Sequence[NonTensorBase], dim: int) -> NonTensorBase:
    """``torch.cat`` of non-tensor entries: one value per element; a NonTensorData when
    every item is one and their values are equal, as in tensordict 0.15.3."""
    return _one_value(items, _combine(items, lambda positions: torch.cat(positions, dim), members=False))


def _one_value(items: Sequence[NonTensorBase], combined: NonTensorStack) -> NonTensorBase:
    """A NonTensorData of ``combined``'s batch size when every item is a NonTensorData
    of one equal value, else ``combined``."""
    first = items[0]
    if all(isinstance(item, NonTensorData) and same_value(item.data, first.data) for item in items):
        return NonTensorData(first.data, batch_size=combined.batch_size, device=first.device)
    return combined


def _combine(items: Sequence[NonTensorBase], op: Callable, members: bool) -> NonTensorStack:
    values: list = []
    origins: list = []  # the member of each value (see NonTensorStack._members)
    positions = []
    for item in items:
        flat = item._flat_values()
        positions.append(torch.arange(len(values), len(values) + len(flat)).reshape(item.batch_size))
        values.extend(flat)
        if not members:
            origins.extend([None] * len(flat))
        elif isinstance(item, NonTensorData):
            origins.extend([(next(_MEMBER_IDS), item.batch_dims)] * len(flat))
        else:
            origins.extend(item._flat_members())
    combined = op(positions)
    taken = combined.reshape(-1).tolist()
    return NonTensorStack._from_flat([values[i] for i in taken], combined.shape, items[0].device,
                                     [origins[i] for i in taken])


_MEMBER_IDS = itertools.count()


def as_non_tensor(value: Any, batch_size: Any = None, key: Any = None, device: Any = None) -> NonTensorBase:
    """``value`` as non-tensor data written into a tensordict of batch size
    ``batch_size`` under ``key``: the list rule of every write path (``set``, ``set_``,
    ``update_``, ``set_at_``, ``td[idx] = ...``, a lazy stack's members, a ``nocast``
    tensorclass field). A list holds one value per element (nested lists of equal
    length a dim each), so its shape must start with ``batch_size`` (a
    BatchSizeMismatchError naming ``key`` otherwise, as ``TensorDict.set`` raises); a
    NonTensorData or NonTensorStack is kept; anything else is one value for the batch.
    ``batch_size=None``: the rows of an indexed write, to which a list broadcasts as
    torch broadcasts (``broadcast_values``).

    Example:
        >>> as_non_tensor(["a", "b"], torch.Size([2]), "s").tolist()
        ['a', 'b']
        >>> try:
        ...     as_non_tensor(["a", "b"], torch.Size([3]), "s")
        ... except BatchSizeMismatchError as error:
        ...     print(str(error).split(":")[0])
        batch dimension mismatch for key 's'
    """
    if isinstance(value, NonTensorBase):
        return value
    if isinstance(value, list):
        stack = NonTensorStack.from_list(value, device=device)
        if batch_size is None:
            return stack
        try:
            return stack._with_batch_size(batch_ops.as_batch_size(batch_size), key)
        except BatchSizeMismatchError as error:  # say how to keep the list whole, as the ValueError does
            raise BatchSizeMismatchError(
                f"{error} A list is one value per element: write NonTensorData(the_list) to keep "
                "a list as one value.") from None
    return NonTensorData(value, batch_size=[] if batch_size is None else batch_size, device=device)


def broadcast_values(source: NonTensorBase, shape: torch.Size) -> list:
    """The values of ``source`` broadcast to ``shape``, flat in C order (what a write of
    ``source`` into a slot of that shape writes); BatchSizeMismatchError if they do not fit."""
    if isinstance(source, NonTensorData):
        return [source.data] * shape.numel()
    positions = torch.arange(len(source._values)).reshape(source.batch_size)
    try:
        positions = positions.expand(shape)
    except RuntimeError:
        raise BatchSizeMismatchError(
            f"Cannot write {list(source.batch_size)} non-tensor values into a slot of shape {list(shape)}."
        ) from None
    return [source._values[i] for i in positions.reshape(-1).tolist()]
