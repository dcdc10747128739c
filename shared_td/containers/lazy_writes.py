"""Writes into a LazyStackedTensorDict, as a mixin (LazyWriteOps).

A write is split along ``stack_dim`` into one part per member and every part is
checked before the first member is written, so a failing ``set``, ``update``,
``update_`` or ``lazy[idx] = ...`` leaves all the members unchanged.

This module does not import lazy.py (lazy.py imports it, and its reads use ``_peek``
and ``_is_branch`` from here): ``_is_lazy`` tells a lazy stack by this mixin.
"""
from __future__ import annotations

import numbers
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from shared_td.containers import batch as batch_ops
from shared_td.containers.base import (TensorDictBase, check_write_into, is_leaf_nontensor, is_non_tensor,
                                       is_tensor_collection)
from shared_td.containers.value_kinds import is_lazy_stack, nested_tensor_error
from shared_td.containers.index_writes import check_indexed_fits, number_kept, numbers_kept, plan_set_at
from shared_td.containers.lazy_element_writes import writes_per_member
from shared_td.containers.lazy_nontensor import written_through
from shared_td.containers.nontensor import NonTensorData, as_non_tensor
from shared_td.containers.nontensor_ops import list_to_entry, non_tensor_over_rows, one_value_into
from shared_td.containers.update_options import update_source
from shared_td.containers.update_batch import planned_after_rebatch
from shared_td.containers.updates import check_source_batch
from shared_td.errors import BatchSizeMismatchError
from shared_td.keys import RAISE, key_repr, unravel_key
from shared_td.memmap_tensor import refuse_read_only
from shared_td.tensorclass_protocol import is_tensorclass, unwrap_tensorclass

if TYPE_CHECKING:  # for the annotations only: lazy.py imports this module
    from shared_td.containers.lazy import LazyStackedTensorDict


class LazyWriteOps:
    """Mixin of LazyStackedTensorDict (it relies on ``tensordicts``, ``_stack_dim``,
    ``batch_size``, ``_restack`` and, for ``lazy[idx] = ...``, LazyShapeOps's
    ``_locate``, ``_positions`` and ``_element``)."""

    _is_lazy_stack = True  # (the marker value_kinds.is_lazy_stack reads)

    # what ``get(key)`` gives for a non-tensor key: a NonTensorStack whose writes reach the members
    _written_through = written_through

    # ---------------------------------------------------------------- set, del, update
    def _set_str(self, key: str, value: Any, *, inplace: bool, validated: bool) -> None:
        if not isinstance(key, str):
            unravel_key(key)  # raises the KeyTypeError
        parts = self._split_value(key, value)
        if inplace:
            parts = [_fit_in_place(_peek(member, key), part) for member, part in zip(self.tensordicts, parts)]
        for member, part in zip(self.tensordicts, parts):  # check everything first
            self._check_part(member, key, part, inplace)
        for member, part in zip(self.tensordicts, parts):
            member._set_str(key, part, inplace=inplace, validated=False)

    def _check_part(self, member: TensorDictBase, key: str, part: Any, inplace: bool) -> None:
        """Raise if ``member._set_str(key, part, inplace=inplace)`` would fail; writes
        nothing. A member that is a lazy stack, or a nested tensordict written in place,
        is checked all the way down (``check_write``): checking its first level only let
        a stack of stacks write its first inner stack before the second one raised."""
        current = _peek(member, key)
        if current is None:
            self._refuse_new_key_no_field(member, key)
        if current is None or not inplace:
            action = "add" if current is None else "replace"
            super()._check_unlocked((key,), action)
            member._check_unlocked((key,), action)
        elif _is_lazy(member) or _is_branch(current):
            check_write(member, {key: part}, inplace=True, add_missing=False)
        elif isinstance(current, torch.Tensor):
            _check_fits(part, current.shape, repr(key))
            refuse_read_only(current, "set_")  # (a member loaded with mode="r")
        elif is_non_tensor(current):  # a shared or memory-mapped one: what it cannot store, named
            current._check_storable_write(part, (key,))
            check_write_into(current, part, (key,))  # (a read-only one too)

    def _split_value(self, key: str, value: Any) -> list:
        """``value`` as one part per member (split along ``stack_dim``)."""
        from shared_td.containers.tensordict import TensorDict

        if isinstance(value, dict):
            value = TensorDict(value, batch_size=self.batch_size)
        elif isinstance(value, list):  # as TensorDict.set takes it: numbers a tensor, else one value per element
            value = list_to_entry(value, self.device)
        elif isinstance(value, (tuple, np.ndarray, numbers.Number)) and not is_tensor_collection(value):
            try:
                value = torch.as_tensor(value)
            except (TypeError, ValueError, RuntimeError):
                pass
        if isinstance(value, NonTensorData) and value.batch_size[: self.batch_dims] != self.batch_size:
            # one value for any batch: given the stack's, as TensorDict.set re-batches it
            # (lazy.set_non_tensor(("sub", "k"), v) makes one of the root's batch size,
            # which a nested stack with more batch dims refused)
            value = value._with_batch_size(self.batch_size, key)
        if is_tensor_collection(value) and value.batch_size[: self.batch_dims] != self.batch_size:
            value = self._resized_child(value, key)  # (an empty TensorDict(), re-batched as TensorDict.set does)
        if isinstance(value, torch.Tensor) and value.is_nested:
            raise nested_tensor_error(key, "Cannot store the entry")
        if isinstance(value, torch.Tensor) or is_tensor_collection(value):
            shape = value.batch_size if is_tensor_collection(value) else value.shape
            if shape[: self.batch_dims] != self.batch_size:
                raise BatchSizeMismatchError(
                    f"Batch dimension mismatch for key {key!r}: the value has shape "
                    f"{list(shape)} but the lazy stack has batch_size {list(self.batch_size)}."
                )
            if is_non_tensor(value):  # new objects: unbound pieces would write into this (temporary) stack
                return [part.clone() for part in self._unbind_like(value)]
            return self._unbind_like(value)
        return [value] * len(self.tensordicts)  # one Python value: every member gets it

    def _convert(self, key: str, value: Any, into: Any = None) -> Any:
        """Check ``value`` for ``key`` (the base class's update planning calls it); the
        value is split into the members when it is written. An in-place write (``into``,
        the entry now: a parent's ``update_`` plans it) is checked in every member."""
        if into is not None:
            value = number_kept(value, into)  # (the number itself, as a TensorDict writes it in place)
        parts = self._split_value(key, value)
        if into is not None:
            for member, part in zip(self.tensordicts, parts):
                self._check_part(member, key, _fit_in_place(_peek(member, key), part), inplace=True)
        return value

    def _unbind_like(self, other: Any) -> list:
        """``other`` split along ``stack_dim`` (the members of a matching lazy stack)."""
        if _is_lazy(other) and other._stack_dim == self._stack_dim:
            return list(other.tensordicts)
        return list(other.unbind(self._stack_dim))

    def _del_str(self, key: str) -> None:
        self._check_unlocked((key,), "remove")
        for member in self.tensordicts:
            if _peek(member, key) is not None:  # an exclusive key: only some members have it
                member._del_str(key)

    def del_(self, key) -> "LazyStackedTensorDict":
        """Remove the entry ``key`` from every member that has it (as tensordict, a key
        that only some members have is removed from those); returns self.

        Raises:
            KeyError: if no member has ``key``. LockedTensorDictError: if locked (checked
                for every member before any is changed).
        """
        path = unravel_key(key)
        holders, seen = [], set()
        for member in self.tensordicts:
            # a member stacked twice is one object: delete from it once
            if id(member) in seen or not _has_path(member, path):
                continue
            seen.add(id(member))
            holders.append(member)
        if not holders:
            raise self._missing_key_error(path)
        self._check_unlocked(path, "remove")
        for member in holders:  # all checks first: a failure leaves every member unchanged
            member._check_removable(path)
        for member in holders:
            member.del_(path)
        return self

    def _check_removable(self, path: tuple) -> None:
        """Raise as ``del_(path)`` would for a lock, changing nothing: this stack and,
        in each member holding ``path``, the tensordict that holds it."""
        self._check_unlocked(path, "remove")
        for member in self.tensordicts:
            member._check_removable(path)

    def _empty_child(self) -> "LazyStackedTensorDict":
        return self._restack([m._empty_child() for m in self.tensordicts])

    def update(self, input_dict_or_td: Any = None, clone: bool = False, inplace: bool = False, *,
               keys_to_update=None, non_blocking: bool = False, ignore_lock: bool = False,
               update_batch_size: bool = False, **entries: Any) -> "LazyStackedTensorDict":
        """As TensorDict.update, member by member: ``input_dict_or_td`` (and entries given
        as keywords, ``lazy.update(a=x)``) is split along ``stack_dim`` (a lazy stack of the
        same layout gives its members). Checked before writing. With
        ``update_batch_size=True`` a source of more members (a lazy stack along the same
        dim, or a tensordict of that size there) makes the stack grow by copies of the
        extra ones, and one of fewer makes its members the stack's (see TensorDict.update).

        Example:
            >>> lazy = LazyStackedTensorDict(TensorDict(a=torch.zeros(2)), TensorDict(a=torch.zeros(2)))
            >>> lazy.update(TensorDict(a=torch.ones(3, 2), batch_size=[3]), update_batch_size=True).batch_size
            torch.Size([3])
        """
        other = update_source(self, input_dict_or_td, entries, ignore_lock)
        selected = None if keys_to_update is None else [unravel_key(k) for k in keys_to_update]

        def plan() -> list:  # (checks only: nothing is written before it returns)
            check_source_batch(self, other)  # (as TensorDict.update: an empty source too)
            parts = self._update_parts(other, inplace)
            for member, part in zip(self.tensordicts, parts):
                if selected is None:
                    self._refuse_keys_no_field(member, part)
                check_write(member, part, inplace=inplace, add_missing=True, selected=selected)
            return parts

        parts = planned_after_rebatch(self, other, plan, update_batch_size=update_batch_size, inplace=inplace,
                                      keys_to_update=keys_to_update)
        for member, part in zip(self.tensordicts, parts):
            member.update(part, clone, inplace=inplace, keys_to_update=keys_to_update)
        return self

    def update_(self, input_dict_or_td: Any = None, clone: bool = False, *, keys_to_update=None,
                non_blocking: bool = False, **entries: Any) -> "LazyStackedTensorDict":
        """As TensorDict.update_, member by member (see ``update``)."""
        parts = self._update_parts(update_source(self, input_dict_or_td, entries, False), inplace=True)
        if keys_to_update is not None:  # (the other keys are neither checked nor written)
            parts = [part.select(*keys_to_update, strict=False) for part in parts]
        # (key by member: the members of a heterogeneous stack hold different keys, and
        # each is written with its own part, as tensordict 0.15.3 does -- torch.cat(...,
        # out=lazy) writes so)
        missing = next((key for member, part in zip(self.tensordicts, parts)
                        for key in part.keys(True, True, is_leaf_nontensor) if key not in member), None)
        if missing is not None:
            raise KeyError(
                f"update_() writes in place, but key {key_repr(unravel_key(missing))} does not "
                f"exist in {type(self).__name__}. Use update() to add it."
            )
        for member, part in zip(self.tensordicts, parts):
            check_write(member, part, inplace=True, add_missing=False)
        for member, part in zip(self.tensordicts, parts):
            member.update_(part)
        return self

    def _update_parts(self, other: Any, inplace: bool = False) -> list:
        """``other`` as one part per member; written ``inplace``, each part fitted to the
        member's entries (``_fit_in_place``)."""
        if self._same_layout(other):
            parts = list(other.tensordicts)
        else:
            if not isinstance(other, dict) and not _is_branch(other):
                other = dict(other)
            if inplace and isinstance(other, dict):  # (a number for a non-tensor entry is that number)
                other = numbers_kept(other, self)
            elif _is_branch(other) and other.batch_size[: self.batch_dims] != self.batch_size:
                # fewer batch dims than the stack (a TensorDict of batch []): its entries
                # split as a dict's, as TensorDict.update takes any batch size (and a
                # TensorDict's update hands a nested lazy stack its mapping so)
                other = _entries_as_dict(other)
            parts = self._split_value("update", other)
        if inplace:
            parts = [_fit_in_place(member, part) for member, part in zip(self.tensordicts, parts)]
        return parts

    def _same_layout(self, other: Any) -> bool:
        same_dim = _is_lazy(other) and other._stack_dim == self._stack_dim
        return same_dim and other.batch_size == self.batch_size

    # ---------------------------------------------------------------- set_at_
    def set_at_(self, key: Any, value: Any, index: Any, *, non_blocking: bool = False) -> "LazyStackedTensorDict":
        """Write ``value`` at ``index`` of the existing entry ``key`` in the members, in
        place (allowed when locked); returns self. ``non_blocking`` is accepted and ignored.

        The index is read on the entry, as torch and tensordict do (an Ellipsis also
        covers the entry's dims after the batch dims). Only the selected elements are
        written, so a process writing other elements of a shared stack at the same time
        keeps its values. An entry whose members' shapes differ, or a non-tensor entry,
        is indexed along the batch dims only. Everything is checked (read-only members
        too) before the first member is written.

        Example:
            >>> import numpy as np
            >>> lazy = shared_td.lazy_stack([TensorDict(a=torch.zeros(4), batch_size=[4]) for _ in range(3)])
            >>> lazy.set_at_("a", np.ones(4, dtype=np.float32), 1)["a"].sum().item()
            4.0

        Raises:
            KeyError: naming the key, when it is missing.
        """
        writes: list = []
        try:
            self._plan_set_at(unravel_key(key), value, index, writes)
        except (RuntimeError, IndexError, TypeError) as err:
            raise type(err)(f"set_at_({key!r}, ..., {index!r}): {err}") from err
        for write in writes:
            write()
        return self

    def _plan_set_at(self, path: tuple, value: Any, index: Any, writes: list) -> None:
        """Check ``set_at_(path, value, index)`` and append the closures that write it
        (index_writes.plan_set_at calls this for an entry below a lazy stack)."""
        if isinstance(value, np.ndarray):  # as the dense set_at_ and set() take one
            value = torch.as_tensor(value)
        try:
            stacked = self.get(path, RAISE)
        except RuntimeError:  # shapes differ between members: index member by member
            stacked = None
        if is_non_tensor(stacked) and isinstance(value, list):
            value = as_non_tensor(value)  # one value per selected element, split as a tensor is
        if isinstance(stacked, torch.Tensor):
            # get() of a lazy stack is a new tensor: write into it with torch's rules
            # (this raises before any member is touched); the closure copies the
            # selected elements back into the members
            touched = torch.zeros(stacked.shape, dtype=torch.bool)
            touched[index] = True
            if isinstance(value, torch.Tensor) and value.dtype != stacked.dtype:
                value = value.to(stacked.dtype)  # as tensordict casts it (index_put_ would refuse)
            if isinstance(value, torch.Tensor):  # (the dense set_at_'s error, not torch's expand one)
                check_indexed_fits(value, batch_ops.indexed_batch_size(stacked.shape, index), path, index)
            stacked[index] = value
            parts = self._touched_parts(path, stacked, touched)
            refuse_read_only([leaf for leaf, _, _ in parts], "set_at_")
            writes.append(lambda: _write_parts(parts))
        else:
            self._plan_members_set_at(path, value, index, writes)

    def _touched_parts(self, path: tuple, stacked: torch.Tensor, touched: torch.Tensor) -> list:
        """``(member tensor, its part of stacked, its part of touched)`` for each member
        tensor of ``path`` that ``touched`` marks an element of."""
        parts = []
        for member, part, mask in zip(self.tensordicts, stacked.unbind(self._stack_dim),
                                      touched.unbind(self._stack_dim)):
            if mask.any():
                parts += _member_parts(member, path, part, mask)
        return parts

    def _plan_members_set_at(self, path: tuple, value: Any, index: Any, writes: list) -> None:
        """``set_at_`` of a ragged or non-tensor entry: each member affected by the batch
        index writes its part (a tensor value split along the stack dim)."""
        where = self._locate(index)
        # (a tensor, or a tensordict written into a nested one, is split along its
        # leading dims, as the selection's)
        shape = value.batch_size if _is_branch(value) else getattr(value, "shape", torch.Size([]))
        if where[0] == "one":
            targets, sources = [(self.tensordicts[where[1]], where[2])], [value]
        elif where[0] == "many":
            _, chosen, rest, out, out_batch = where
            targets = [(self.tensordicts[i], rest) for i in chosen]
            if shape and len(shape) >= len(out_batch):
                sources = list(_expand_lead(value, out_batch, shape).unbind(out))
            else:
                sources = [value] * len(targets)
        else:
            positions = self._positions(where[1])
            targets = [self._element(int(f)) for f in positions.flatten().tolist()]
            if shape and len(shape) >= positions.ndim:
                value = _expand_lead(value, positions.shape, shape)
                sources = [value[tuple(c)] for c in np.ndindex(*positions.shape)]
            else:
                sources = [value] * len(targets)
        for (member, sub), source in zip(targets, sources):
            plan_set_at(unwrap_tensorclass(member), path, source, sub, writes)

    # ---------------------------------------------------------------- lazy[idx] = value
    def _row_source(self, index: Any, value: Any, rows: torch.Size | None = None) -> Any:
        """What ``lazy[index] = value`` writes: a tensordict as given (``_plan_index_writes``
        fits it to the rows), a dict or anything else as TensorDictBase takes it."""
        if _is_branch(value):
            return value
        return super()._row_source(index, value, rows)

    def _set_at_index(self, index: Any, value: Any) -> None:
        """``lazy[index] = value``: write into the affected members (all checked first)."""
        writes: list = []
        self._plan_index_writes(index, value, writes)
        for write in writes:
            write()

    def _plan_index_writes(self, index: Any, value: Any, writes: list, target_batch: Any = None, *,
                           path: tuple = ()) -> None:
        """Check ``self[index] = value`` and append the closures that write it, member by
        member, to ``writes`` (as TensorDict._plan_index_writes, which calls this for a
        nested lazy stack). A tensordict source is fitted to the indexed rows first as
        batch.rows_source fits it; one whose batch size broadcasts to the rows (``[]``,
        ``[1, 3]`` into rows ``[2, 3]``) and whose entries do not start with them is
        expanded into them, as tensordict 0.15.3's lazy stack does."""
        from shared_td.containers.tensordict import TensorDict

        if isinstance(value, dict):
            value = TensorDict(value, batch_size=[])
        value = unwrap_tensorclass(value)
        rows = batch_ops.index_and_size(index, self.batch_size)[1]
        if isinstance(value, torch.Tensor) and value.dim():
            value = self._tensor_rows(index, value)  # split between the members as the rows are
        elif _is_branch(value) and value.batch_size != rows and not value.batch_size:
            # a dict (or 0-d source) of tensors: each broadcast to its part, as the dense
            # TensorDict writes them (expanded to the rows, [2] would be [*rows, 2])
            rows_value = self._tensor_rows(index, value)
            value = value if rows_value is None else rows_value
        if _is_branch(value) and value.batch_size != rows:
            value = batch_ops.rows_source(index, value, rows, self.batch_size, broadcast=True)
        where = self._locate(index)
        if where[0] == "one":
            targets, sources = [(self.tensordicts[where[1]], where[2])], [value]
        elif where[0] == "many":
            _, chosen, rest, out, out_batch = where
            targets = [(self.tensordicts[i], rest) for i in chosen]
            if _is_branch(value):
                sources = list(_expand_to(value, out_batch).unbind(out))
            else:
                sources = [value] * len(targets)
        else:
            positions = self._positions(where[1])
            targets = [self._element(int(f)) for f in positions.flatten().tolist()]
            if _is_branch(value):
                value = _expand_to(value, positions.shape)
                sources = [value[tuple(c)] for c in np.ndindex(*positions.shape)]
            else:
                sources = [value] * len(targets)
            targets, sources = writes_per_member(targets, sources, stack=_is_branch(value))
        for (member, sub), source in zip(targets, sources):
            member = unwrap_tensorclass(member)
            self._refuse_keys_no_field(member, source, path)
            sub_index, sub_rows = batch_ops.index_and_size(sub, member.batch_size)
            member._plan_index_writes(sub_index, unwrap_tensorclass(source), writes, sub_rows, path=path)


    def _tensor_rows(self, index: Any, value: Any) -> Any:
        """``lazy[index] = value`` as on the dense stack, for a tensor or a tensordict of
        batch size ``[]`` of tensors and NonTensorData: each tensor broadcast to its
        entry's part ``entry[index]`` (from the right, as torch assigns), as a tensordict
        of the rows whose members' parts ``_plan_index_writes`` then writes (given whole
        to each member, a tensor as long as the rows along the stack dim met a member's
        part without that dim: tensordict 0.15.3 writes it); a NonTensorData fills every
        row. None for a tensordict with another entry, or one self lacks or holds
        otherwise (it is then fitted as a tensordict; a leaf that happened to start with
        the rows' size was taken as of their batch size there)."""
        def broadcast(key: Any, leaf: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
            try:
                return torch.broadcast_to(leaf, part.shape)
            except RuntimeError as err:
                raise BatchSizeMismatchError(
                    f"Cannot write a value of shape {list(leaf.shape)} into entry {key!r} at {index!r}: "
                    f"its part there has shape {list(part.shape)} ({str(err).splitlines()[0]}).") from None

        from shared_td.containers.tensordict import TensorDict

        view = self._index(index)  # (leaves read stacked: only their shapes are used; no member rebuilt)
        if isinstance(value, torch.Tensor):
            parts = {key: part for key, part in view.items(include_nested=True, leaves_only=True)
                     if isinstance(part, torch.Tensor)}  # (non-tensor entries take no tensor)
            leaves = dict.fromkeys(parts, value)
        else:  # (only the source's keys are read: another one may differ in shape across members)
            try:
                leaves = dict(value.items(include_nested=True, leaves_only=True, is_leaf=is_leaf_nontensor))
                parts = {key: view.get(key, None) for key in leaves}
            except RuntimeError:  # (its members' shapes differ, or those of a lazy stack the
                return None  # value holds: written member by member)
        source = TensorDict(batch_size=view.batch_size)
        for key, leaf in leaves.items():
            part = parts[key]
            if isinstance(leaf, torch.Tensor) and isinstance(part, torch.Tensor):
                source.set(key, broadcast(key, leaf, part))
            elif is_non_tensor(leaf) and is_non_tensor(part) and \
                    (entry := non_tensor_over_rows(leaf, part.batch_size, view.batch_size)) is not None:
                source.set(key, entry)
            else:
                return None
        return source


def _expand_lead(value: Any, lead: torch.Size, shape: torch.Size) -> Any:
    """``value`` (a tensor, or a tensordict of batch size ``shape``) expanded to ``lead``
    on its leading dims."""
    size = torch.Size(lead) + shape[len(lead):]
    return _expand_to(value, size) if _is_branch(value) else value.expand(size)


def _member_parts(member: Any, path: tuple, part: torch.Tensor, mask: torch.Tensor) -> list:
    """``LazyWriteOps._touched_parts`` of one member: ``[(tensor, part, mask)]`` for its
    own tensor at ``path``, walked node by node. The first lazy stack met on the way
    (the member itself, or one nested in it) gets the rest of the path: its ``get`` would
    give a new stacked tensor, and a write into that copy reaches no member."""
    node = unwrap_tensorclass(member)
    for depth, key in enumerate(path):
        if _is_lazy(node):
            return node._touched_parts(path[depth:], part, mask)
        node = unwrap_tensorclass(node._get_str(key, None))
    return [(node, part, mask)]


def _fit_in_place(current: Any, part: Any) -> Any:
    """``part``, a member's part of a value written in place into the member's entry
    ``current``, with the values that it gives a NonTensorData one per element, all the
    same, as that one value (nontensor_ops.one_value_into): splitting a value along the
    stack dim gives each member's NonTensorData one value per element, which it refuses,
    so ``lazy.update_(lazy.to_dict())`` raised. A tensordict part is walked with the
    member's tensordict (a new one returned, the source's own left as it is); a lazy
    stack met on the way fits its own members' parts when it is written.

    Example:
        >>> member = TensorDict(a=torch.zeros(2), batch_size=[2]).set_non_tensor("n", 6)
        >>> _fit_in_place(member, TensorDict(a=torch.ones(2), n=torch.tensor([6, 6]), batch_size=[2]))["n"]
        6
    """
    if current is None or isinstance(current, torch.Tensor):  # (most entries: nothing to fit)
        return part
    current = unwrap_tensorclass(current)
    if _is_lazy(current):
        return part
    if is_non_tensor(current):
        return one_value_into(current, part)
    source = unwrap_tensorclass(part)
    if _is_lazy(source) and _is_branch(current):
        # a lazy part laid out otherwise than the member (leaving `with lazy.view(-1):` on
        # a locked stack) fits as the dense tree it reads as; a ragged one cannot be one
        try:
            source = source.to_tensordict()
        except RuntimeError:
            return part
    if not _is_branch(current) or not _is_branch(source) or _is_lazy(source):
        return part
    fitted = {}
    for key, value in source._items_str():
        new = _fit_in_place(current._get_str(key, None), value)
        if new is not value:
            fitted[key] = new
    if not fitted:
        return part
    copy = source.clone(recurse=False)  # (new nested tensordicts, the same leaves)
    for key, new in fitted.items():
        copy._set_str(key, new, inplace=False, validated=True)
    return copy


def _entries_as_dict(td: Any) -> dict:
    """The entries of the tensordict ``td`` as a nested dict (its nested TensorDicts as
    dicts; lazy stacks, tensorclasses and leaves as they are)."""
    return {key: _entries_as_dict(value) if _is_branch(value) and not _is_lazy(value) and not is_tensorclass(value)
            else value for key, value in unwrap_tensorclass(td)._items_str()}


def _write_parts(parts: list) -> None:
    """Copy the selected elements of each member's part into the member's tensor."""
    for leaf, part, mask in parts:
        # (the dtype too: a member of another dtype than the stack's, which index_put_ refuses)
        leaf[mask] = part[mask].to(leaf.device, leaf.dtype)


def _is_branch(value: Any) -> bool:
    """A tensordict or tensorclass instance, not non-tensor data (a leaf)."""
    return is_tensor_collection(value) and not is_non_tensor(value)


def _peek(td: TensorDictBase, key: str) -> Any:
    """The entry ``key`` of ``td`` without stacking anything (None when missing)."""
    if _is_lazy(td):
        return td._peek_str(key, None)
    return td._get_str(key, None)


def _has_path(td: TensorDictBase, path: tuple) -> bool:
    """True if ``td`` has ``path``; a lazy stack has it if any of its members has it
    (``_get_path`` of a lazy stack only sees the keys that every member has)."""
    if _is_lazy(td):
        return any(_has_path(m, path) for m in td.tensordicts)
    return td._get_path(path, None) is not None


_is_lazy = is_lazy_stack  # (its former name, which the lazy modules import from here)


def _expand_to(value: Any, size: torch.Size) -> Any:
    try:
        return value if value.batch_size == size else value.expand(size)
    except RuntimeError:
        raise BatchSizeMismatchError(
            f"Cannot write a value of batch_size {list(value.batch_size)} into an index of shape {list(size)}."
        ) from None


def _check_fits(part: Any, shape: torch.Size, name: str) -> None:
    """Raise before writing if ``part`` cannot be copied into an entry of ``shape``."""
    if isinstance(part, torch.Tensor) and not batch_ops.broadcasts_to(part.shape, shape):
        raise BatchSizeMismatchError(
            f"Cannot write a value of shape {list(part.shape)} in place into entry {name} of shape {list(shape)}."
        )


def check_write(target: Any, source: Any, *, inplace: bool, add_missing: bool,
                selected: list | None = None) -> None:
    """Raise if ``target.update(source, inplace=inplace)`` (``add_missing``) or
    ``target.update_(source)`` (not ``add_missing``) would fail; writes nothing. A lazy
    stack checks each member with its part of ``source`` (a lazy member its own members
    in turn); any other tensordict checks with the plan of its own update, which reaches
    a lazy stack nested in it through the stack's ``_convert``. ``selected``: the keys
    of ``keys_to_update``, unravelled.

    Example:
        >>> lazy = shared_td.lazy_stack
        >>> outer = lazy([lazy([TensorDict(x=torch.zeros(2))] * 2), lazy([TensorDict(x=torch.zeros(3))] * 2)])
        >>> try:
        ...     check_write(outer, {"x": torch.ones(2, 2, 2)}, inplace=True, add_missing=False)
        ... except RuntimeError as error:
        ...     print(type(error).__name__)
        BatchSizeMismatchError
    """
    target = unwrap_tensorclass(target)
    if _is_lazy(target):
        for member, part in zip(target.tensordicts, target._update_parts(unwrap_tensorclass(source), inplace)):
            check_write(member, part, inplace=inplace, add_missing=add_missing, selected=selected)
    elif _is_branch(target):
        target._plan_update(unwrap_tensorclass(source), (), inplace, add_missing, selected)
