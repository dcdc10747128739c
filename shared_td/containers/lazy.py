"""LazyStackedTensorDict: tensordicts stacked along a batch dim without copying them.

The members are kept as they are (``lazy.tensordicts`` holds the very objects), so their
entries may have different feature shapes; reading a key stacks the members' values,
writing a key splits the value along ``stack_dim`` into the members.
"""
from __future__ import annotations

import numbers
from typing import Any, Callable, Sequence

import numpy as np
import torch

from shared_td.containers import batch as batch_ops
from shared_td.containers.base import NO_DEFAULT, TensorDictBase, is_non_tensor, is_tensor_collection
from shared_td.errors import BatchSizeMismatchError
from shared_td.keys import NestedKey, key_repr, unravel_key


class _Ragged:
    """What ``_get_path`` finds under a key whose tensors differ in shape across members."""

    def __init__(self, path: tuple, values: list):
        self.path, self.values = path, values

    def error(self) -> RuntimeError:
        shapes = [getattr(v, "shape", "ragged") for v in self.values]
        return RuntimeError(
            f"Failed to stack tensors within a tensordict under the key {key_repr(self.path)}: "
            f"their shapes are {shapes}. To read them, pass as_padded_tensor=True, "
            "as_nested_tensor=True or as_list=True to get()."
        )


def _is_branch(value: Any) -> bool:
    return is_tensor_collection(value) and not is_non_tensor(value)


def _as_td(value: Any) -> TensorDictBase:
    """A tensordict itself, or the inner tensordict of a tensorclass instance."""
    return value if isinstance(value, TensorDictBase) else value._tensordict


def _peek(td: TensorDictBase, key: str) -> Any:
    """The entry ``key`` of ``td`` without stacking anything (None when missing)."""
    if isinstance(td, LazyStackedTensorDict):
        return td._peek_str(key, None)
    return td._get_str(key, None)


def _trivial(index: tuple) -> bool:
    return all(isinstance(p, slice) and p == slice(None) for p in index)


class LazyStackedTensorDict(TensorDictBase):
    """Tensordicts stacked along ``stack_dim``, kept as they are (``tensordicts``).

    Members share their batch size (unlike tensordict, different ones are refused) but
    their entries may differ in feature shape. Keys are those of every member, as in
    tensordict 0.15.3 (the others are shown as ``exclusive_fields``; ``get`` of one
    raises a KeyError where tensordict returns None). ``get`` stacks equal-shape tensors
    (a copy) and non-tensors (a NonTensorStack); nested tensordicts give a lazy stack of
    the members' children. Tensors of different shapes raise a RuntimeError unless
    ``as_list``, ``as_padded_tensor`` or ``as_nested_tensor`` is given. Writes (``set``,
    ``set_``, ``update_``, ``lazy[idx] = ...``, ``del``) split the value along
    ``stack_dim`` into the members.

    Examples:
        >>> lazy = LazyStackedTensorDict(TensorDict(a=torch.zeros(2)), TensorDict(a=torch.ones(3)))
        >>> lazy
        LazyStackedTensorDict(batch_size=[2], stack_dim=0, fields={a: f32[-1]})
        >>> lazy.get("a", as_list=True)
        [tensor([0., 0.]), tensor([1., 1., 1.])]
        >>> lazy[1] is lazy.tensordicts[1]
        True
    """

    def __init__(self, *tensordicts: Any, stack_dim: int = 0, batch_size: Any = None):
        """``batch_size`` is only needed for a stack of no member (e.g. ``lazy[2:2]``)."""
        members = []
        for i, item in enumerate(tensordicts):
            if not _is_branch(item):
                raise TypeError(f"LazyStackedTensorDict stacks tensordicts, but item {i} is a {type(item).__name__}.")
            members.append(_as_td(item))
            if members[i].batch_size != members[0].batch_size:
                raise BatchSizeMismatchError(
                    f"Cannot lazily stack tensordicts of different batch sizes: item 0 has "
                    f"batch_size {list(members[0].batch_size)} but item {i} has {list(members[i].batch_size)}."
                )
        member_batch = members[0].batch_size if members else torch.Size([])
        if not members and batch_size is not None and len(batch_size):  # keep the other dims
            dim = batch_ops.normalize_dim(stack_dim, len(batch_size), what="stack_dim")
            member_batch = torch.Size(list(batch_size[:dim]) + list(batch_size[dim + 1 :]))
        self._stack_dim = batch_ops.normalize_dim(stack_dim, len(member_batch) + 1, what="stack_dim")
        self.tensordicts: list = members
        self._member_batch = member_batch
        self._is_locked = self._is_shared = self._is_memmap = False
        self._lock_parents: dict = {}
        self._context_ops: list = []

    @classmethod
    def lazy_stack(cls, items: Sequence[Any], dim: int = 0, *, out: Any = None) -> Any:
        """Stack ``items`` lazily along ``dim`` (tensors are stacked by ``torch.stack``)."""
        items = list(items)
        if not items:
            raise RuntimeError("lazy_stack needs at least one tensordict: items cannot be empty.")
        if all(isinstance(item, torch.Tensor) for item in items):
            return torch.stack(items, dim)
        return _into(out, cls(*items, stack_dim=dim))

    # ---------------------------------------------------------------- properties
    @property
    def stack_dim(self) -> int:
        """The batch dim along which the members are stacked."""
        return self._stack_dim

    @property
    def batch_size(self) -> torch.Size:
        """The members' batch size with ``len(tensordicts)`` inserted at ``stack_dim``."""
        mb, sd = list(self._member_batch), self._stack_dim
        return torch.Size(mb[:sd] + [len(self.tensordicts)] + mb[sd:])

    @property
    def device(self) -> torch.device | None:
        """The members' common device, or None if they differ (or have none)."""
        devices = {member.device for member in self.tensordicts}
        return devices.pop() if len(devices) == 1 else None

    @property
    def names(self) -> list | None:
        """The first member's dim names with None at ``stack_dim`` (None if unnamed)."""
        names = self.tensordicts[0].names if self.tensordicts else None
        if names is None:
            return None
        return list(names[: self._stack_dim]) + [None] + list(names[self._stack_dim :])

    @property
    def is_locked(self) -> bool:
        """True if the stack is locked, or if every member is."""
        members = self.tensordicts
        return self._is_locked or (bool(members) and all(m.is_locked for m in members))

    @is_locked.setter
    def is_locked(self, value: bool) -> None:
        self.lock_() if value else self.unlock_()

    def _check_unlocked(self, path: tuple, action: str) -> None:
        super()._check_unlocked(path, action)
        for member in self.tensordicts:
            member._check_unlocked(path, action)

    def _collection_children(self) -> list:
        return list(self.tensordicts)

    def is_shared(self) -> bool:
        """True if every member is shared; mixed members raise a RuntimeError (as tensordict)."""
        shared = [m.is_shared() for m in self.tensordicts]
        if any(shared) and not all(shared):
            raise RuntimeError(
                f"tensordicts shared status mismatch, got {sum(shared)} shared tensordicts "
                f"and {len(shared) - sum(shared)} non shared tensordict."
            )
        return bool(shared) and all(shared)

    def is_memmap(self) -> bool:
        """True if every member is memory-mapped."""
        return bool(self.tensordicts) and all(m.is_memmap() for m in self.tensordicts)

    def share_memory_(self) -> "LazyStackedTensorDict":
        """Move every member to shared memory and lock; returns self."""
        if any(m.is_memmap() for m in self.tensordicts):
            raise RuntimeError(
                "memmap and shared memory are mutually exclusive features: a member of "
                "this stack is memory-mapped already."
            )
        for member in self.tensordicts:
            member.share_memory_()
        self._is_shared = True
        return self.lock_()

    # ---------------------------------------------------------------- storage hooks
    def _keys_str(self):
        if not self.tensordicts:
            return iter(())
        common = set.intersection(*(set(m._keys_str()) for m in self.tensordicts))
        return iter([k for k in self.tensordicts[0]._keys_str() if k in common])

    def _exclusive_keys(self) -> dict:
        common = set(self._keys_str())
        extra = {i: [k for k in m._keys_str() if k not in common] for i, m in enumerate(self.tensordicts)}
        return {i: keys for i, keys in extra.items() if keys}

    def _get_str(self, key: str, default: Any) -> Any:
        value = self._get_path((key,), default)
        if isinstance(value, _Ragged):  # read through a parent: the same error as get()
            raise value.error()
        return value

    def _get_path(self, path: tuple, default: Any) -> Any:
        values = []
        for member in self.tensordicts:
            value = member._get_path(path, NO_DEFAULT)
            if value is NO_DEFAULT:
                return default
            values.append(value)
        if not values:
            return default
        return self._combine(path, values)

    def _combine(self, path: tuple, values: list) -> Any:
        from shared_td.containers.nontensor import stack_non_tensors

        if any(isinstance(v, _Ragged) for v in values):
            return _Ragged(path, values)
        if all(isinstance(v, torch.Tensor) for v in values):
            if len({v.shape for v in values}) > 1:
                return _Ragged(path, values)
            return torch.stack(values, self._stack_dim)
        if all(is_non_tensor(v) for v in values):
            return stack_non_tensors(values, self._stack_dim)
        if all(_is_branch(v) for v in values):
            return LazyStackedTensorDict(*values, stack_dim=self._stack_dim)
        raise TypeError(
            f"Cannot stack the entry {key_repr(path)}: the members hold "
            f"{sorted({type(v).__name__ for v in values})}."
        )

    def _peek_str(self, key: str, default: Any) -> Any:
        """The entry ``key`` without stacking tensors: the first member's leaf, or a lazy
        stack of the members' nested tensordicts (used to walk keys)."""
        values = [_peek(m, key) for m in self.tensordicts]
        if not values or any(v is None for v in values):
            return default
        if all(_is_branch(v) for v in values):
            return LazyStackedTensorDict(*values, stack_dim=self._stack_dim)
        return values[0]

    def __contains__(self, key: NestedKey) -> bool:
        if not isinstance(key, str):
            try:
                key = unravel_key(key)
            except (TypeError, ValueError):
                return super().__contains__(key)  # raises the TypeError
        return bool(self.tensordicts) and all(key in m for m in self.tensordicts)

    def get(self, key: NestedKey, default: Any = NO_DEFAULT, *, as_list: bool = False,
            as_padded_tensor: bool = False, as_nested_tensor: bool = False,
            padding_side: str = "right", padding_value: Any = 0.0, layout: Any = None) -> Any:
        """The stacked entry ``key`` (see the class doc), or ``default``.

        ``as_list=True`` gives the members' values as a list; ``as_padded_tensor=True``
        pads them (with ``padding_value`` on ``padding_side``) to a common shape and stacks
        them along dim 0; ``as_nested_tensor=True`` gives a ``torch.nested`` tensor (jagged
        layout unless ``layout`` says otherwise).

        Raises:
            KeyError: when ``key`` is missing from some member and no default is given.
            RuntimeError: when the members' tensors differ in shape and none of the
                three options is given (the message names the key and the shapes).
        """
        path = unravel_key(key)
        value = self._get_path(path, NO_DEFAULT)
        if value is NO_DEFAULT:
            if default is not NO_DEFAULT:
                return default
            raise KeyError(self._missing_key_message(path))
        if not (as_list or as_padded_tensor or as_nested_tensor) or is_non_tensor(value):
            if isinstance(value, _Ragged):
                raise value.error()
            return value
        values = [m.get(path) for m in self.tensordicts]
        if as_list:
            return values
        if not all(isinstance(v, torch.Tensor) for v in values):
            raise TypeError(f"as_padded_tensor/as_nested_tensor need tensors under {key_repr(path)}.")
        if as_nested_tensor:
            return torch.nested.nested_tensor(values, layout=layout or torch.jagged)
        return _pad_stack(values, padding_value, padding_side, path)

    def pop(self, key: NestedKey, default: Any = NO_DEFAULT) -> Any:
        """Remove the entry ``key`` from every member and return its stacked value."""
        value = self.get(key, default)
        if key in self:
            self.del_(key)
        return value

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
            elif isinstance(current, torch.Tensor) and not isinstance(member, LazyStackedTensorDict):
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
        if isinstance(other, LazyStackedTensorDict) and other._stack_dim == self._stack_dim:
            return list(other.tensordicts)
        return list(other.unbind(self._stack_dim))

    def _del_str(self, key: str) -> None:
        self._check_unlocked((key,), "remove")
        for member in self.tensordicts:
            member._del_str(key)

    def _empty_child(self) -> "LazyStackedTensorDict":
        return self._restack([m._empty_child() for m in self.tensordicts])

    def update(self, other: Any, *, inplace: bool = False, keys_to_update=None) -> "LazyStackedTensorDict":
        """As TensorDict.update, member by member: ``other`` is split along ``stack_dim``
        (a lazy stack of the same layout gives its members). Checked before writing."""
        parts = self._update_parts(other)
        for member, part in zip(self.tensordicts, parts):
            _check_write(member, part, replace=not inplace)
        for member, part in zip(self.tensordicts, parts):
            member.update(part, inplace=inplace, keys_to_update=keys_to_update)
        return self

    def update_(self, other: Any, *, keys_to_update=None) -> "LazyStackedTensorDict":
        """As TensorDict.update_, member by member (see ``update``)."""
        parts = self._update_parts(other)
        for key in parts[0].keys(include_nested=True, leaves_only=True) if parts else ():
            if key not in self:
                raise KeyError(
                    f"update_() writes in place, but key {key_repr(unravel_key(key))} does not "
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
        same_dim = isinstance(other, LazyStackedTensorDict) and other._stack_dim == self._stack_dim
        return same_dim and other.batch_size == self.batch_size

    # ---------------------------------------------------------------- indexing
    def _locate(self, index: Any) -> tuple:
        """Where ``index`` goes: ``("one", i, rest)`` for one member, ``("many", members,
        rest, stack_dim, batch_size)`` for several, or ``("positions", positions)``."""
        size, sd = self.batch_size, self._stack_dim
        parts = batch_ops.normalize_index(index, size)
        out_batch = batch_ops.indexed_batch_size(size, parts)
        parts = tuple(
            int(p) if isinstance(p, torch.Tensor) and p.ndim == 0 and p.dtype != torch.bool else p
            for p in parts
        )
        widths = [_dims(p)[0] for p in parts]
        parts += (slice(None),) * (len(size) - sum(widths))
        widths += [1] * (len(parts) - len(widths))
        tensors = sum(isinstance(p, torch.Tensor) for p in parts)
        general = ("positions", parts)
        if tensors > 1 or any(isinstance(p, bool) for p in parts):
            return general
        dim = out = 0
        for i, (part, width) in enumerate(zip(parts, widths)):
            if width and dim <= sd < dim + width:
                break
            dim += width
            out += _dims(part)[1]
        if width != 1 or (tensors and not isinstance(part, (slice, torch.Tensor))):
            return general
        rest = parts[:i] + parts[i + 1 :]
        count = len(self.tensordicts)
        if isinstance(part, int):
            return ("one", part % count, rest)
        if isinstance(part, slice):
            chosen = list(range(count))[part]
        elif part.dtype == torch.bool:
            chosen = part.nonzero().flatten().tolist()
        elif part.ndim == 1:
            chosen = [j % count for j in part.tolist()]
        else:
            return general
        return ("many", chosen, rest, out, out_batch)

    def _index(self, index: Any) -> Any:
        where = self._locate(index)
        if where[0] == "one":
            member = self.tensordicts[where[1]]
            return member if _trivial(where[2]) else member._index(where[2])
        if where[0] == "many":
            _, chosen, rest, out, out_batch = where
            members = [self.tensordicts[i] for i in chosen]
            if not _trivial(rest):
                members = [m._index(rest) for m in members]
            return LazyStackedTensorDict(*members, stack_dim=out, batch_size=out_batch)
        return self._from_positions(self._positions(where[1]))

    def _positions(self, parts: tuple) -> torch.Tensor:
        """The flat positions of the elements that ``parts`` selects (torch's rules)."""
        return torch.arange(self.numel()).reshape(self.batch_size)[parts]

    def _element(self, flat: int) -> tuple:
        """(member, index in the member) of the element at flat position ``flat``."""
        coords = []
        for n in reversed(self.batch_size):
            coords.append(flat % n)
            flat //= n
        coords.reverse()
        sd = self._stack_dim
        return self.tensordicts[coords[sd]], tuple(coords[:sd] + coords[sd + 1 :])

    def _from_positions(self, positions: torch.Tensor) -> Any:
        """Nested lazy stacks (along dim 0) of the elements at ``positions`` (views)."""
        if positions.ndim == 0:
            member, sub = self._element(int(positions))
            return member._index(sub) if sub else member
        return LazyStackedTensorDict(
            *[self._from_positions(p) for p in positions.unbind(0)],
            stack_dim=0, batch_size=positions.shape,
        )

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

    # ---------------------------------------------------------------- conversions
    def to_tensordict(self) -> Any:
        """A dense TensorDict (a copy); raises a RuntimeError naming a heterogeneous key."""
        from shared_td.containers.tensordict import TensorDict

        entries = {}
        for key in self._keys_str():
            value = self._get_str(key, None)  # raises on a heterogeneous key
            if isinstance(value, LazyStackedTensorDict):
                value = value.to_tensordict()
            entries[key] = value
        return TensorDict._new_unsafe(entries, self.batch_size, self.device, self.names)

    def contiguous(self) -> Any:
        """Same as ``to_tensordict()``: a dense TensorDict."""
        return self.to_tensordict()

    def to_dict(self) -> dict:
        """A nested dict of stacked values (raises on heterogeneous shapes, as tensordict)."""
        out = {}
        for key in self._keys_str():
            value = self.get(key)
            if is_non_tensor(value):
                out[key] = value._python_value()
            else:
                out[key] = value.to_dict() if is_tensor_collection(value) else value
        return out

    def _map_leaves(self, fn: Callable, prefix: tuple = ()) -> Any:
        """Dense: ``fn(key, stacked leaf)`` for every leaf (used inside a parent TensorDict)."""
        from shared_td.containers.tensordict import TensorDict

        entries = {}
        for key in self._keys_str():
            path, value = prefix + (key,), self.get(key)
            if _is_branch(value):
                entries[key] = _as_td(value)._map_leaves(fn, path)
            else:
                entries[key] = fn(path if len(path) > 1 else key, value)
        return TensorDict._new_unsafe(entries, self.batch_size, self.device)

    def _compare(self, other: Any, op: Callable) -> "LazyStackedTensorDict":
        if isinstance(other, dict) or _is_branch(other):
            parts = self._split_value("other", other)  # raises on a batch size mismatch
        elif isinstance(other, torch.Tensor) and other.ndim and other.shape[: self.batch_dims] == self.batch_size:
            parts = list(other.unbind(self._stack_dim))
        else:
            parts = [other] * len(self.tensordicts)
        return self._restack([m._compare(o, op) for m, o in zip(self.tensordicts, parts)])

    def all(self) -> bool:
        """True if every element of every leaf of every member is true."""
        return all(m.all() for m in self.tensordicts)

    def any(self) -> bool:
        """True if some element of some leaf of some member is true."""
        return any(m.any() for m in self.tensordicts)

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
        if isinstance(value, LazyStackedTensorDict):
            return "", _entries(value)
        return _entry(value, self.tensordicts[0])

    def _leaf_signature(self, key: str) -> tuple | None:
        """(dtype, feature dims with -1 where members differ) of a tensor leaf, or None."""
        signatures = []
        for member in self.tensordicts:
            if isinstance(member, LazyStackedTensorDict):
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

    # ---------------------------------------------------------------- new stacks
    def _restack(self, members: list, stack_dim: int | None = None) -> "LazyStackedTensorDict":
        sd = self._stack_dim if stack_dim is None else stack_dim
        return LazyStackedTensorDict(*members, stack_dim=sd)

    def apply(self, fn: Callable, *others: Any, batch_size: Any = None, names: Any = NO_DEFAULT,
              inplace: bool = False, device: Any = NO_DEFAULT) -> Any:
        """Apply ``fn`` to every tensor leaf of every member; the results are stacked lazily."""
        return self.named_apply(
            lambda key, *values: fn(*values), *others, batch_size=batch_size, names=names,
            inplace=inplace, device=device,
        )

    def named_apply(self, fn: Callable, *others: Any, nested_keys: bool = False,
                    batch_size: Any = None, names: Any = NO_DEFAULT, inplace: bool = False,
                    device: Any = NO_DEFAULT, _prefix: tuple = ()) -> Any:
        """Like ``apply`` with the key: ``fn(key, leaf, *others_leaves)`` per member.

        With ``batch_size`` the stack is made dense first (``to_tensordict()``) and the
        result is a TensorDict, as in tensordict.
        """
        if batch_size is not None:
            if inplace:
                raise ValueError("named_apply on a lazy stack cannot combine batch_size and inplace=True.")
            return self.to_tensordict().named_apply(
                fn, *others, nested_keys=nested_keys, batch_size=batch_size, names=names,
                device=device, _prefix=_prefix,
            )
        split = [self._unbind_like(other) for other in others]
        results = [
            member.named_apply(
                fn, *[parts[i] for parts in split], nested_keys=nested_keys,
                inplace=inplace, device=device, _prefix=_prefix,
            )
            for i, member in enumerate(self.tensordicts)
        ]
        return self if inplace else self._restack(results)

    def clone(self, recurse: bool = True) -> "LazyStackedTensorDict":
        """A lazy stack of clones of the members (``recurse=False`` shares the tensors)."""
        return self._restack([m.clone(recurse) for m in self.tensordicts])

    def to(self, *args: Any, **kwargs: Any) -> "LazyStackedTensorDict":
        """Every member moved or cast (self when nothing changes)."""
        moved = [m.to(*args, **kwargs) for m in self.tensordicts]
        if all(a is b for a, b in zip(moved, self.tensordicts)):
            return self
        return self._restack(moved)

    def empty(self, recurse: bool = False) -> "LazyStackedTensorDict":
        """A lazy stack of the members' ``empty()``."""
        return self._restack([m.empty(recurse) for m in self.tensordicts])

    def select(self, *keys: NestedKey, inplace: bool = False, strict: bool = True) -> "LazyStackedTensorDict":
        """A lazy stack of the members' ``select(*keys)``."""
        out = [m.select(*keys, inplace=inplace, strict=strict) for m in self.tensordicts]
        return self if inplace else self._restack(out)

    def exclude(self, *keys: NestedKey, inplace: bool = False) -> "LazyStackedTensorDict":
        """A lazy stack of the members' ``exclude(*keys)``."""
        out = [m.exclude(*keys, inplace=inplace) for m in self.tensordicts]
        return self if inplace else self._restack(out)

    def zero_(self) -> "LazyStackedTensorDict":
        """Fill every tensor of every member with zeros; returns self."""
        for member in self.tensordicts:
            member.zero_()
        return self

    # ---------------------------------------------------------------- shape ops
    def _member_dim(self, dim: int) -> int:
        return dim if dim < self._stack_dim else dim - 1

    def unbind(self, dim: int = 0) -> tuple:
        """The members themselves along ``stack_dim``; lazy stacks of views otherwise."""
        dim = batch_ops.normalize_dim(dim, self.batch_dims)
        if dim == self._stack_dim:
            return tuple(self.tensordicts)
        prefix = (slice(None),) * dim
        return tuple(self._index(prefix + (i,)) for i in range(self.batch_size[dim]))

    def unsqueeze(self, dim: int) -> "LazyStackedTensorDict":
        """Insert a batch dim of size 1 in every member; ``stack_dim`` shifts if needed."""
        dim = batch_ops.normalize_dim(dim, self.batch_dims + 1)
        if dim <= self._stack_dim:
            return self._restack([m.unsqueeze(dim) for m in self.tensordicts], self._stack_dim + 1)
        return self._restack([m.unsqueeze(dim - 1) for m in self.tensordicts])

    def squeeze(self, dim: int | None = None) -> Any:
        """Remove batch dims of size 1; squeezing ``stack_dim`` gives the single member."""
        if dim is None:
            out: Any = self
            for d in reversed(range(self.batch_dims)):
                if self.batch_size[d] == 1:
                    out = out.squeeze(d)
            return out
        dim = batch_ops.normalize_dim(dim, self.batch_dims)
        if self.batch_size[dim] != 1:
            return self
        if dim == self._stack_dim:
            return self.tensordicts[0]
        sd = self._stack_dim - (dim < self._stack_dim)
        return self._restack([m.squeeze(self._member_dim(dim)) for m in self.tensordicts], sd)

    def permute(self, *dims: Any) -> "LazyStackedTensorDict":
        """Reorder the batch dims: each member is permuted and ``stack_dim`` moves."""
        order = [batch_ops.normalize_dim(d, self.batch_dims) for d in batch_ops.shape_args(dims)]
        if sorted(order) != list(range(self.batch_dims)):
            raise ValueError(f"permute needs each of the {self.batch_dims} batch dims once, got {list(dims)}.")
        sd = self._stack_dim
        member_order = [self._member_dim(d) for d in order if d != sd]
        return self._restack([m.permute(*member_order) for m in self.tensordicts], order.index(sd))

    def expand(self, *shape: Any) -> "LazyStackedTensorDict":
        """Expand the batch dims (each member is expanded: views, no copy)."""
        probe = torch.zeros((), dtype=torch.uint8).expand(self.batch_size)
        size = probe.expand(batch_ops.shape_args(shape)).shape
        sd = self._stack_dim + len(size) - self.batch_dims
        members = self.tensordicts
        if size[sd] != len(members):  # only possible from a single member
            members = members * size[sd]
        member_size = torch.Size(size[:sd] + size[sd + 1 :])
        return self._restack([m.expand(member_size) for m in members], sd)

    def reshape(self, *shape: Any) -> Any:
        """Reshape the batch dims: nested lazy stacks of the members' elements (views)."""
        positions = torch.arange(self.numel()).reshape(self.batch_size)
        positions = positions.reshape(batch_ops.shape_args(shape))
        if positions.shape == self.batch_size:
            return self
        return self._from_positions(positions)

    view = reshape

    # ---------------------------------------------------------------- torch.cat
    @classmethod
    def _cat(cls, items: Sequence[Any], dim: int, out: Any = None) -> "LazyStackedTensorDict":
        """``torch.cat`` with lazy stacks: along ``stack_dim`` the members are joined, along
        another dim the i-th members are concatenated."""
        sd = next(item for item in items if isinstance(item, cls))._stack_dim

        def parts(item: Any) -> list:
            if isinstance(item, cls) and item._stack_dim == sd:
                return list(item.tensordicts)
            return list(item.unbind(sd))

        if dim == sd:
            result = cls(*[m for item in items for m in parts(item)], stack_dim=sd)
        else:
            member_dim = dim if dim < sd else dim - 1
            groups = zip(*[parts(item) for item in items])
            result = cls(*[torch.cat(list(group), member_dim) for group in groups], stack_dim=sd)
        return _into(out, result)


def _into(out: Any, result: Any) -> Any:
    """``result``, or ``out`` updated in place with it (the ``out=`` of torch functions)."""
    return result if out is None else out.update_(result)


def _dims(part: Any) -> tuple[int, int]:
    """How many batch dims an index part consumes and how many it produces (when it is
    the only tensor of the index)."""
    if part is None or isinstance(part, bool):
        return 0, 1
    if isinstance(part, torch.Tensor):
        return (max(part.ndim, 1), 1) if part.dtype == torch.bool else (1, part.ndim)
    return 1, 0 if isinstance(part, int) else 1


def _expand_to(value: Any, size: torch.Size) -> Any:
    try:
        return value if value.batch_size == size else value.expand(size)
    except RuntimeError:
        raise BatchSizeMismatchError(
            f"Cannot write a value of batch_size {list(value.batch_size)} into an index of shape {list(size)}."
        ) from None


def _check_fits(part: Any, shape: torch.Size, name: str) -> None:
    """Raise before writing if ``part`` cannot be copied into an entry of ``shape``."""
    try:
        fits = not isinstance(part, torch.Tensor) or torch.broadcast_shapes(part.shape, shape) == shape
    except RuntimeError:
        fits = False
    if not fits:
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
    for key in source.keys(include_nested=True, leaves_only=True):
        path = unravel_key(key)
        current = member._get_path(path, None)
        if current is None or replace:
            if member.is_locked:
                member._check_unlocked(path, "add" if current is None else "replace")
        elif isinstance(current, torch.Tensor):
            _check_fits(source.get(key), torch.Size(target + current.shape[member.batch_dims :]), key_repr(path))


def _pad_stack(values: list, padding_value: Any, side: str, path: tuple) -> torch.Tensor:
    """Pad ``values`` to their largest shape and stack them along dim 0."""
    if len({v.ndim for v in values}) > 1:
        raise ValueError(f"Cannot pad the tensors under {key_repr(path)}: their numbers of dims differ.")
    if side not in ("left", "right"):
        raise ValueError(f"padding_side must be 'left' or 'right', got {side!r}.")
    shape = [max(sizes) for sizes in zip(*[v.shape for v in values])]
    out = torch.full([len(values), *shape], padding_value, dtype=values[0].dtype, device=values[0].device)
    for i, value in enumerate(values):
        if side == "right":
            region = tuple(slice(0, n) for n in value.shape)
        else:
            region = tuple(slice(m - n, m) for n, m in zip(value.shape, shape))
        out[i][region] = value
    return out
