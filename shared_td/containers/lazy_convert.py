"""Conversions, comparisons and the repr of a LazyStackedTensorDict, as a mixin
(LazyConversions): ``to_tensordict``, ``to_dict``, the leaf map a parent TensorDict
uses (member by member), element-wise comparisons (``==``...), and how the repr shows
the entries whose shapes differ across members.

This module does not import lazy.py (lazy.py imports it): a lazy stack is recognised by
``_is_lazy``, new stacks are built with ``self._restack``.
"""
from __future__ import annotations

import numbers
from typing import Any, Callable, Iterator

import torch

from shared_td.containers.base import holds_only_none
from shared_td.containers.lazy_names import names_members_agree_on
from shared_td.containers.lazy_writes import _is_branch, _is_lazy
from shared_td.containers.value_kinds import is_non_tensor, is_tensor_collection
from shared_td.tensorclass_protocol import unwrap_tensorclass


class LazyConversions:
    """Mixin of LazyStackedTensorDict (it relies on ``tensordicts``, ``_keys_str``,
    ``_exclusive_keys``, ``_split_value`` and ``_restack``)."""

    def to_tensordict(self, *, retain_none: bool | None = None) -> Any:
        """A dense TensorDict (a copy) whose nested tensorclasses are TensorDicts, as
        tensordict 0.15.3's and TensorDict.to_tensordict; raises a RuntimeError naming a
        heterogeneous key. ``retain_none`` is accepted, as tensordict 0.15.3 takes it,
        and ignored (no entry holds None here)."""
        return _tensorclasses_unwrapped(self.contiguous())

    def _dense_copy_loses_entries(self) -> bool:
        """Whether ``to_tensordict()`` would lose entries: the members, or those of a lazy
        stack inside them, differ in keys, or the members' tensors under a key differ in
        shape. Nested entries are peeked, so no tensor is stacked to answer."""
        def loses_keys(lazy: Any) -> bool:
            inner = [unwrap_tensorclass(m) for m in lazy.tensordicts] + [lazy._peek_str(k, None) for k in lazy._keys_str()]
            return bool(lazy._exclusive_keys()) or any(_is_lazy(entry) and loses_keys(entry) for entry in inner)

        return loses_keys(self) or self._has_ragged_leaf()

    def contiguous(self) -> Any:
        """A dense TensorDict (a copy: a write into it never reaches the members): the
        members' entries stacked, nested lazy stacks made dense, nested tensorclasses
        kept as such, as tensordict 0.15.3; raises a RuntimeError naming a heterogeneous
        key."""
        from shared_td.containers.tensordict import TensorDict

        entries = {}
        for key in self._keys_str():
            value = self._get_str(key, None)  # raises on a heterogeneous key
            inner = unwrap_tensorclass(value)
            if _is_lazy(inner):  # (a tensorclass of members' entries: they would be written)
                dense = inner.contiguous()
                value = dense if inner is value else type(value)._from_tensordict(dense)
            entries[key] = value
        return TensorDict._new_unsafe(entries, self.batch_size, self.device, self.names)

    def to_dict(self, *, retain_none: bool = True) -> dict:
        """A nested dict of stacked values (raises on heterogeneous shapes, as tensordict).
        ``retain_none=False`` leaves out the non-tensor entries that hold None only, as
        TensorDict.to_dict does.

        Raises:
            RuntimeError: if a key is in only some members (as tensordict): the dict can
                only hold the keys every member has, so it would silently lose that key.
        """
        exclusive = self._exclusive_keys()
        if exclusive:
            shown = "; ".join(f"member {i} has {keys}" for i, keys in exclusive.items())
            first = next(iter(exclusive.values()))[0]
            raise RuntimeError(
                f"to_dict() cannot complete when there are exclusive keys (keys that only some "
                f"stacked tensordicts have): {shown}. A dict of stacked values would drop them. "
                f"Delete them (del td[{first!r}]), add them to every member, or convert the "
                "members one by one ([m.to_dict() for m in td.tensordicts])."
            )
        out = {}
        for key in self._keys_str():
            value = self.get(key)
            if is_non_tensor(value):
                if retain_none or not holds_only_none(value):
                    out[key] = value._python_value()
            else:
                out[key] = value.to_dict(retain_none=retain_none) if is_tensor_collection(value) else value
        return out

    def _map_leaves(self, fn: Callable, prefix: tuple = (), other: Any = None) -> Any:
        """TensorDict._map_leaves inside a parent TensorDict, member by member: a lazy
        stack of the members' results, as tensordict 0.15.3 gives ``td == td`` there (the
        members' shapes may differ). ``other``, the part of what the parent is compared
        with at this stack (see :func:`part_of`), is split along ``stack_dim``."""
        if isinstance(other, torch.Tensor) and other.ndim:  # (of this stack's batch size)
            parts = list(other.unbind(self._stack_dim))
        elif isinstance(other, dict) or _is_branch(other):
            parts = self._update_parts(unwrap_tensorclass(other))  # (a lazy stack alike: its members)
        else:
            parts = [other] * len(self.tensordicts)
        return self._restack([unwrap_tensorclass(member)._map_leaves(fn, prefix, part)
                              for member, part in zip(self.tensordicts, parts)])

    def _compare(self, other: Any, op: Callable, other_type: bool = False) -> "Any":
        if not (isinstance(other, (dict, torch.Tensor, numbers.Number)) or _is_branch(other)):
            return other_type  # (a str, None, a list: as ComparisonOps._compare)
        if isinstance(other, dict) or _is_branch(other):
            parts = self._split_value("other", other)  # raises on a batch size mismatch
        elif isinstance(other, torch.Tensor) and other.ndim and other.shape[: self.batch_dims] == self.batch_size:
            parts = list(other.unbind(self._stack_dim))
        else:
            parts = [other] * len(self.tensordicts)
        return self._restack([m._compare(o, op) for m, o in zip(self.tensordicts, parts)])

    def _reduced_names(self) -> list | None:
        # (all(dim)/any(dim): a dim the members name differently is unnamed in the
        # result, as in tensordict 0.15.3, where reading ``names`` raises)
        return names_members_agree_on(self)

    def _leaf_tensors(self) -> Iterator[torch.Tensor]:
        # (all()/any() without a dim: the members' leaves, not stacked copies of them)
        for member in self.tensordicts:
            yield from unwrap_tensorclass(member)._leaf_tensors()

    def __repr__(self) -> str:
        from shared_td.containers.formatting import _entries, _flat, format_collection

        text = format_collection(self)
        exclusive = self._exclusive_keys()
        if exclusive:  # the keys that only some members have, as tensordict shows them
            shown = []
            for i, keys in exclusive.items():
                member = self.tensordicts[i]
                only = member.exclude(*[k for k in member._keys_str() if k not in keys])
                shown.append(f"{i}: {_flat(('', _entries(only)))}")
            text = text[:-1] + ", exclusive_fields={" + ", ".join(shown) + "})"
        return text

    def _repr_entry(self, key: str) -> Any:
        """How the repr shows ``key`` (a formatting hook): the dims of a tensor that differ
        across members as -1, e.g. ``f32[-1]``."""
        from shared_td.containers.formatting import _dtype_name, _entries, _entry

        signature = self._leaf_signature(key)
        if signature is not None:
            dtype, feature = signature
            return f"{_dtype_name(dtype)}[{','.join(str(d) for d in feature)}]"
        value = self._peek_str(key, None)
        if _is_lazy(value):  # named by its first member's tensorclass, if any, as tensordict 0.15.3 shows it
            cls = value._tensorclass_of(value.tensordicts[0]) if value.tensordicts else None
            return ("" if cls is None else cls.__name__), _entries(value)
        return _entry(value, self.tensordicts[0])

    def _leaf_signature(self, key: str) -> tuple | None:
        """(dtype, feature dims with -1 where members differ) of a tensor leaf, or None."""
        signatures = []
        for member in self.tensordicts:
            if _is_lazy(member):
                signature = member._leaf_signature(key)
            else:
                value = member._get_str(key, None)
                is_tensor = isinstance(value, torch.Tensor)
                signature = (value.dtype, list(value.shape[member.batch_dims :])) if is_tensor else None
            if signature is None:
                return None
            signatures.append(signature)
        dims = [s[1] for s in signatures]
        if not dims or len({len(d) for d in dims}) > 1:
            return (signatures[0][0], [-1]) if dims else None
        return signatures[0][0], [col[0] if len(set(col)) == 1 else -1 for col in zip(*dims)]


def _tensorclasses_unwrapped(td: Any) -> Any:
    """``td``, a new dense tree, with each nested tensorclass replaced by the TensorDict
    it wraps (at every depth; nothing is copied)."""
    for key, value in td._tensordict.items():
        inner = unwrap_tensorclass(value)
        if inner is not value or (_is_branch(inner) and not is_non_tensor(inner)):
            td._tensordict[key] = _tensorclasses_unwrapped(inner)
    return td
