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
from shared_td.containers.base import TensorDictBase, is_leaf_nontensor, is_non_tensor, is_tensor_collection
from shared_td.errors import BatchSizeMismatchError
from shared_td.keys import key_repr, unravel_key

if TYPE_CHECKING:  # for the annotations only: lazy.py imports this module
    from shared_td.containers.lazy import LazyStackedTensorDict


class LazyWriteOps:
    """Mixin of LazyStackedTensorDict (it relies on ``tensordicts``, ``_stack_dim``,
    ``batch_size``, ``_restack`` and, for ``lazy[idx] = ...``, LazyShapeOps's
    ``_locate``, ``_positions`` and ``_element``)."""

    # ---------------------------------------------------------------- set, del, update
    def _set_str(self, key: str, value: Any, *, inplace: bool, validated: bool) -> None:
        if not isinstance(key, str):
            unravel_key(key)  # raises the KeyTypeError
        parts = self._split_value(key, value)
        for member, part in zip(self.tensordicts, parts):  # check everything first
            current = _peek(member, key)
            if current is None or not inplace:
                action = "add" if current is None else "replace"
                super()._check_unlocked((key,), action)
                member._check_unlocked((key,), action)
            elif isinstance(current, torch.Tensor) and not _is_lazy(member):
                _check_fits(part, current.shape, repr(key))
        for member, part in zip(self.tensordicts, parts):
            member._set_str(key, part, inplace=inplace, validated=False)

    def _split_value(self, key: str, value: Any) -> list:
        """``value`` as one part per member (split along ``stack_dim``)."""
        from shared_td.containers.tensordict import TensorDict

        if isinstance(value, dict):
            value = TensorDict(value, batch_size=self.batch_size)
        elif isinstance(value, (list, tuple, np.ndarray, numbers.Number)) and not is_tensor_collection(value):
            try:
                value = torch.as_tensor(value)
            except (TypeError, ValueError, RuntimeError):
                pass
        if isinstance(value, torch.Tensor) or is_tensor_collection(value):
            shape = value.batch_size if is_tensor_collection(value) else value.shape
            if shape[: self.batch_dims] != self.batch_size:
                raise BatchSizeMismatchError(
                    f"Batch dimension mismatch for key {key!r}: the value has shape "
                    f"{list(shape)} but the lazy stack has batch_size {list(self.batch_size)}."
                )
            return self._unbind_like(value)
        return [value] * len(self.tensordicts)  # a non-tensor: every member gets it

    def _convert(self, key: str, value: Any, into: Any = None) -> Any:
        """Check ``value`` for ``key`` (the base class's update planning calls it); the
        value is split into the members when it is written."""
        self._split_value(key, value)
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
            if _is_lazy(member):  # (a lazy member checks all its own members in its del_)
                member._check_unlocked(path, "remove")
            else:
                member._parent_for_write(path, create=False)._check_unlocked(path, "remove")
        for member in holders:
            member.del_(path)
        return self

    def _empty_child(self) -> "LazyStackedTensorDict":
        return self._restack([m._empty_child() for m in self.tensordicts])

    def update(self, other: Any, clone: bool = False, inplace: bool = False, *, keys_to_update=None,
               non_blocking: bool = False) -> "LazyStackedTensorDict":
        """As TensorDict.update, member by member: ``other`` is split along ``stack_dim``
        (a lazy stack of the same layout gives its members). Checked before writing."""
        parts = self._update_parts(other)
        for member, part in zip(self.tensordicts, parts):
            _check_write(member, part, replace=not inplace)
        for member, part in zip(self.tensordicts, parts):
            member.update(part, clone, inplace=inplace, keys_to_update=keys_to_update)
        return self

    def update_(self, other: Any, *, keys_to_update=None, non_blocking: bool = False) -> "LazyStackedTensorDict":
        """As TensorDict.update_, member by member (see ``update``)."""
        parts = self._update_parts(other)
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
            _check_write(member, part)
        for member, part in zip(self.tensordicts, parts):
            member.update_(part, keys_to_update=keys_to_update)
        return self

    def _update_parts(self, other: Any) -> list:
        if self._same_layout(other):
            return list(other.tensordicts)
        if not isinstance(other, dict) and not _is_branch(other):
            other = dict(other)
        return self._split_value("update", other)

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
        is indexed along the batch dims only.

        Raises:
            KeyError: naming the key, when it is missing.
        """
        path = unravel_key(key)
        try:
            stacked = self.get(path)
        except RuntimeError:  # shapes differ between members: index member by member
            stacked = None
        try:
            if isinstance(stacked, torch.Tensor):
                # get() of a lazy stack is a new tensor: write into it with torch's
                # rules (this raises before any member is touched), then copy the
                # selected elements back into the members
                touched = torch.zeros(stacked.shape, dtype=torch.bool)
                touched[index] = True
                stacked[index] = value
                self._write_touched(path, stacked, touched)
            else:
                self._set_at_members(path, value, index)
        except (RuntimeError, IndexError, TypeError) as err:
            raise type(err)(f"set_at_({key!r}, ..., {index!r}): {err}") from err
        return self

    def _write_touched(self, path: tuple, stacked: torch.Tensor, touched: torch.Tensor) -> None:
        """Copy the elements of ``stacked`` that ``touched`` marks into the members."""
        for member, part, mask in zip(self.tensordicts, stacked.unbind(self._stack_dim),
                                      touched.unbind(self._stack_dim)):
            if not mask.any():
                continue
            if _is_lazy(member):
                member._write_touched(path, part, mask)
            else:
                member.get(path)[mask] = part[mask].to(member.get(path).device)

    def _set_at_members(self, path: tuple, value: Any, index: Any) -> None:
        """``set_at_`` of a ragged or non-tensor entry: each member affected by the batch
        index writes its part (a tensor value split along the stack dim)."""
        where = self._locate(index)
        if where[0] == "one":
            self.tensordicts[where[1]].set_at_(path, value, where[2])
            return
        shaped = isinstance(value, torch.Tensor) and value.ndim > 0
        if where[0] == "many":
            _, chosen, rest, out, out_batch = where
            targets = [(self.tensordicts[i], rest) for i in chosen]
            if shaped:
                value = value.expand(*out_batch, *value.shape[len(out_batch):]) if value.ndim >= len(out_batch) else value
                sources = list(value.unbind(out)) if value.ndim >= len(out_batch) else [value] * len(targets)
            else:
                sources = [value] * len(targets)
        else:
            positions = self._positions(where[1])
            targets = [self._element(int(f)) for f in positions.flatten().tolist()]
            if shaped and value.ndim >= positions.ndim:
                value = value.expand(*positions.shape, *value.shape[positions.ndim:])
                sources = [value[tuple(c)] for c in np.ndindex(*positions.shape)]
            else:
                sources = [value] * len(targets)
        for (member, sub), source in zip(targets, sources):
            member.set_at_(path, source, sub)

    # ---------------------------------------------------------------- lazy[idx] = value
    def _set_at_index(self, index: Any, value: Any) -> None:
        """``lazy[index] = value``: write into the affected members (checked first)."""
        from shared_td.containers.tensordict import TensorDict

        if isinstance(value, dict):
            value = TensorDict(value, batch_size=[])
        where = self._locate(index)
        if where[0] == "one":
            member, rest = self.tensordicts[where[1]], where[2]
            member._set_at_index(rest, value)
            return
        if where[0] == "many":
            _, chosen, rest, out, out_batch = where
            targets = [(self.tensordicts[i], rest) for i in chosen]
            if is_tensor_collection(value):
                sources = list(_expand_to(value, out_batch).unbind(out))
            else:
                sources = [value] * len(targets)
        else:
            positions = self._positions(where[1])
            targets = [self._element(int(f)) for f in positions.flatten().tolist()]
            if is_tensor_collection(value):
                value = _expand_to(value, positions.shape)
                sources = [value[tuple(c)] for c in np.ndindex(*positions.shape)]
            else:
                sources = [value] * len(targets)
        for (member, sub), source in zip(targets, sources):
            if is_tensor_collection(source):
                _check_write(member, source, sub)
        for (member, sub), source in zip(targets, sources):
            member._set_at_index(sub, source)


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


def _is_lazy(value: Any) -> bool:
    """True for a LazyStackedTensorDict: the only class with this mixin (it cannot be
    named here without importing lazy.py, which imports this module)."""
    return isinstance(value, LazyWriteOps)


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


def _check_write(member: TensorDictBase, source: Any, index: tuple = (), replace: bool = False) -> None:
    """Raise if writing ``source`` into ``member[index]`` (in place, or replacing the
    entries when ``replace``) would fail; checked for plain TensorDicts before writing."""
    from shared_td.containers.tensordict import TensorDict

    if not isinstance(member, TensorDict) or not isinstance(source, TensorDict):
        return
    target = batch_ops.indexed_batch_size(member.batch_size, batch_ops.normalize_index(index, member.batch_size))
    for key in source.keys(True, True, is_leaf_nontensor):
        path = unravel_key(key)
        current = member._get_path(path, None)
        if current is None or replace:
            if member.is_locked:
                member._check_unlocked(path, "add" if current is None else "replace")
        elif isinstance(current, torch.Tensor):
            _check_fits(source.get(key), torch.Size(target + current.shape[member.batch_dims :]), key_repr(path))

