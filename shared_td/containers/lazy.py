"""LazyStackedTensorDict: tensordicts stacked along a batch dim without copying them.

The members are kept as they are (``lazy.tensordicts`` holds the very objects), so their
entries may have different feature shapes; reading a key stacks the members' values,
writing a key splits the value along ``stack_dim`` into the members.

This module holds the class: construction, properties, reads (``get``, ``pop``, keys;
the reads of entries whose shapes differ across members are in lazy_ragged.py),
conversions and repr. The rest comes from four mixins, each in its own module:
lazy_writes.py (LazyWriteOps: set, update, ``lazy[idx] = ...``, del), lazy_shape.py
(LazyShapeOps: indexing, shape ops, torch.cat, member-wise maps such as apply and
clone), lazy_names.py (LazyNames: ``names``, its setter and ``stack_dim_name``) and
batch_dim_ops.py (LazyBatchDimOps: transpose, flatten, unflatten). They do not import
this module; the class is named only here.
"""
from __future__ import annotations

import numbers
import weakref
from typing import Any, Callable, Iterator, Sequence

import torch

from shared_td.containers import batch as batch_ops
from shared_td.containers.base import NO_DEFAULT, TensorDictBase
from shared_td.containers.batch_dim_ops import LazyBatchDimOps
from shared_td.containers.convenience_ops import TensorData
from shared_td.containers.lazy_ragged import Ragged, has_ragged_leaf, members_values, stacked
from shared_td.containers.lazy_names import LazyNames, checked_stack_dim_name, names_members_agree_on
from shared_td.containers.lazy_shape import LazyShapeOps, set_batch_size, stacked_into
from shared_td.containers.lazy_writes import LazyWriteOps, _is_branch, _peek
from shared_td.containers.value_kinds import is_non_tensor, is_tensor_collection
from shared_td.errors import BatchSizeMismatchError
from shared_td.keys import NestedKey, is_nested_key, unravel_key
from shared_td.tensorclass_protocol import is_tensorclass, unwrap_tensorclass


# The mixins come before TensorDictBase so that their methods override its own; their
# ``super()`` calls (e.g. ``_check_unlocked`` in ``_set_str``) reach TensorDictBase.
class LazyStackedTensorDict(LazyNames, LazyShapeOps, LazyBatchDimOps, LazyWriteOps, TensorData, TensorDictBase):
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

    def __init__(self, *tensordicts: Any, stack_dim: int = 0, batch_size: Any = None,
                 device: Any = None, stack_dim_name: str | None = None, strict_shape: bool = True):
        """``batch_size`` and ``device`` are those of the members, as in tensordict 0.15.3:
        only needed for a stack of no member (``LazyStackedTensorDict(stack_dim=1,
        batch_size=[1, 2])`` has batch size ``[1, 0, 2]``); with members, ``device`` moves
        those on another device there. ``stack_dim_name`` names the batch dim
        ``stack_dim`` (see ``names``). ``strict_shape`` is accepted for compatibility:
        the members' batch sizes must always be equal here."""
        if device is not None:
            device = torch.device(device)
            tensordicts = tuple(td if td.device == device else td.to(device) for td in tensordicts)
        members = []
        for i, item in enumerate(tensordicts):
            if not _is_branch(item):
                raise TypeError(f"LazyStackedTensorDict stacks tensordicts, but item {i} is a {type(item).__name__}.")
            members.append(unwrap_tensorclass(item))
            if members[i].batch_size != members[0].batch_size:
                raise BatchSizeMismatchError(
                    f"Cannot lazily stack tensordicts of different batch sizes: item 0 has "
                    f"batch_size {list(members[0].batch_size)} but item {i} has {list(members[i].batch_size)}."
                )
        # the class of each member given as a tensorclass, by id() of its tensordict (None:
        # none): the stack works on the tensordicts, and a save writes such a member as its
        # class, as tensordict 0.15.3 does (node_kinds._members_as_given)
        self._tensorclass_members: dict | None = None
        for item, member in zip(tensordicts, members):
            if member is not item:
                self._record_class(member, type(item))
        member_batch = members[0].batch_size if members else torch.Size([])
        if not members and batch_size is not None:
            member_batch = torch.Size(batch_size)
        # a stack of no member has no member to tell its device
        self._empty_device = device if not members else None
        self._stack_dim = batch_ops.insertion_dim(stack_dim, len(member_batch), "LazyStackedTensorDict", what="stack_dim")
        self.tensordicts: list = members
        self._member_batch = member_batch
        if stack_dim_name is not None:
            self._stack_dim_name = checked_stack_dim_name(stack_dim_name, members)
        self._is_locked = self._is_shared = self._is_memmap = False
        self._lock_parents: dict = {}
        self._context_ops: list = []

    @classmethod
    def lazy_stack(cls, items: Sequence[Any], dim: int = 0, *, out: Any = None,
                   stack_dim_name: str | None = None, strict_shape: bool = True) -> Any:
        """Stack ``items`` lazily along ``dim`` (tensors, and non-tensor items, are stacked
        by ``torch.stack``: a NonTensorStack for the latter); ``stack_dim_name`` names
        that new batch dim, as in tensordict 0.15.3.

        Example:
            >>> td = TensorDict(a=torch.zeros(3), batch_size=[3], names=["env"])
            >>> LazyStackedTensorDict.lazy_stack([td, td.clone()], dim=0, stack_dim_name="time").names
            ['time', 'env']
        """
        items = list(items)
        if not items:
            raise RuntimeError("lazy_stack needs at least one tensordict: items cannot be empty.")
        if all(isinstance(item, torch.Tensor) for item in items):
            return torch.stack(items, dim)
        if all(is_non_tensor(item) for item in items):
            # NonTensorData / NonTensorStack items: their NonTensorStack, as tensordict
            # 0.15.3 gives (a lazy stack holds tensordicts only)
            return torch.stack(items, dim) if out is None else torch.stack(items, dim, out=out)
        if is_tensor_collection(items[0]):  # so that an error names lazy_stack's dim, not stack_dim
            batch_ops.insertion_dim(dim, items[0].batch_dims, "lazy_stack")
        tc_class = type(items[0]) if is_tensorclass(items[0]) else None
        if out is None and tc_class is not None and all(type(item) is tc_class for item in items):
            # tensorclasses of one class stack into that class over the lazy stack, as in tensordict
            inner = cls(*map(unwrap_tensorclass, items), stack_dim=dim, stack_dim_name=stack_dim_name)
            return tc_class._from_tensordict(inner)
        return stacked_into(out, cls(*items, stack_dim=dim, stack_dim_name=stack_dim_name))

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

    batch_size = batch_size.setter(set_batch_size)  # (its own size only, as in tensordict)

    @property
    def device(self) -> torch.device | None:
        """The members' common device, or None if they differ (or have none)."""
        if not self.tensordicts:
            return getattr(self, "_empty_device", None)  # (not set on objects built without __init__)
        devices = {member.device for member in self.tensordicts}
        return devices.pop() if len(devices) == 1 else None

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

    def _locked_parent(self, ignore: int | None = None):
        # A stack is a view of its members: ``stack.get("nested")`` of a locked stack
        # stacks members nested in locked tensordicts, so unlocking it would unlock them.
        parent = super()._locked_parent(ignore)
        for member in self.tensordicts:
            if parent is None:
                parent = member._locked_parent(ignore=id(self))
        return parent

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
        """Move every member to shared memory and lock; returns self.

        Everything is checked before the first member is shared (the members are shared
        one by one: a failure in member 1 left member 0 shared and locked, and
        ``is_shared()`` then raised a "shared status mismatch").

        Raises:
            RuntimeError: if a member, or a tensordict nested in one, is memory-mapped.
            TypeError: naming its key, if a non-tensor value cannot be pickled.
        """
        from shared_td.containers.unpicklable import check_picklable

        pending = list(self.tensordicts)
        while pending:  # (every nested node: a member's share_memory_ refuses any mapped one)
            node = unwrap_tensorclass(pending.pop())
            if is_non_tensor(node):
                continue
            if getattr(node, "_is_memmap", False):
                raise RuntimeError(
                    "memmap and shared memory are mutually exclusive features: a member of "
                    "this stack, or a tensordict in one, is memory-mapped already."
                )
            pending += node._collection_children()
        check_picklable(self, "share_memory_()", shared=True)
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
        if isinstance(value, Ragged):  # read through a parent: the same error as get()
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
        return stacked(self, path, values)

    def _has_ragged_leaf(self) -> bool:
        """True when the members' tensors under some key differ in shape (reading that
        key stacked raises; LazyShapeOps._empty_selection asks)."""
        return has_ragged_leaf(self)


    def _peek_str(self, key: str, default: Any) -> Any:
        """The entry ``key`` without stacking tensors: the first member's leaf, or a lazy
        stack of the members' nested tensordicts (used to walk keys)."""
        values = [_peek(m, key) for m in self.tensordicts]
        if not values or any(v is None for v in values):
            return default
        if all(_is_branch(v) for v in values):
            return self._restack(values)
        return values[0]

    def __contains__(self, key: NestedKey) -> bool:
        """``key in lazy``: a key every member has; a tensordict or tensorclass is in
        the stack if it is one of its members (identity, as tensordict 0.15.3)."""
        if not is_nested_key(key):
            if is_tensor_collection(key):
                return any(key is member for member in self.tensordicts)
            return super().__contains__(key)  # raises the TypeError
        if not isinstance(key, str):
            key = unravel_key(key)
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
            return self._default_for_missing(path, default)
        if not (as_list or as_padded_tensor or as_nested_tensor) or is_non_tensor(value):
            if isinstance(value, Ragged):
                raise value.error()
            return self._written_through(path, value)  # (a non-tensor: its writes reach the members)
        return members_values(self, path, as_list, as_padded_tensor, as_nested_tensor, padding_side, padding_value,
                              layout)

    def __getitems__(self, indices: Sequence[int]) -> Any:
        """The rows at ``indices`` in one index operation (torch's DataLoader calls it
        with a batch of indices): ``self[indices]``, as in tensordict."""
        return self[torch.as_tensor(list(indices), dtype=torch.long)]

    def append(self, tensordict: Any) -> None:
        """Add ``tensordict`` as the last member (see ``insert``)."""
        self.insert(len(self.tensordicts), tensordict)

    def extend(self, tensordicts: Any) -> None:
        """Append each of ``tensordicts`` (see ``insert``); all or none: every item is
        checked before the first is added. ``lazy.extend(lazy.tensordicts)`` appends the
        members as they were (the items are read once, before any append)."""
        items = list(tensordicts)  # (iterating the growing member list itself never ended)
        members = [self._checked_member(item) for item in items]
        if len({member.device for member in members}) > 1:  # (an empty stack checks none of them)
            raise ValueError(f"Devices differ: the new members are on {[str(m.device) for m in members]}.")
        for item, member in zip(items, members):
            self._add_member(len(self.tensordicts), item, member)

    def insert(self, index: int, tensordict: Any) -> None:
        """Insert ``tensordict`` as member ``index`` (``list.insert``), as tensordict 0.15.3.

        Raises:
            TypeError: if it is not a tensordict or tensorclass.
            ValueError: if its batch size (or its device) is not the members'.
            LockedTensorDictError: if the stack is locked.
        """
        self._add_member(index, tensordict, self._checked_member(tensordict))

    def _checked_member(self, tensordict: Any) -> Any:
        """The tensordict that ``tensordict`` adds as a member; raises as ``insert`` says."""
        if not _is_branch(tensordict):
            raise TypeError(
                f"Expected new value to be TensorDictBase instance but got {type(tensordict).__name__}: "
                "a lazy stack's members are tensordicts or tensorclasses."
            )
        member = unwrap_tensorclass(tensordict)
        if self.tensordicts and member.device != self.device:
            raise ValueError(
                f"Devices differ: the stack is on {self.device}, the new member on {member.device}; "
                "move it with .to(device) first."
            )
        if member.batch_size != self._member_batch:
            raise ValueError(
                f"Batch sizes in tensordicts differs: the members have batch_size "
                f"{list(self._member_batch)}, the new one {list(member.batch_size)}."
            )
        super()._check_unlocked((), "insert a member into the lazy stack")
        return member

    def _add_member(self, index: int, given: Any, member: Any) -> None:
        self.tensordicts.insert(index, member)
        if member is not given:  # a tensorclass: saved as one (see __init__)
            self._record_class(member, type(given))

    def _record_class(self, member: Any, cls: type) -> None:
        """Record that ``member`` is written as the tensorclass ``cls``. The record holds
        a weak reference to the member, so that one removed from the stack is not kept
        alive by it (its entry goes with it, before its id() can be reused)."""
        record = self._tensorclass_members
        if record is None:
            record = self._tensorclass_members = {}
        key = id(member)
        record[key] = (weakref.ref(member, lambda _, record=record, key=key: record.pop(key, None)), cls)

    def _tensorclass_of(self, member: Any) -> type | None:
        """The tensorclass ``member`` was given as (``_record_class``), or None (an
        example: node_kinds._members_as_given)."""
        entry = (getattr(self, "_tensorclass_members", None) or {}).get(id(member))
        return entry[1] if entry is not None and entry[0]() is member else None

    def __getstate__(self) -> dict:
        # (weak references do not pickle: the classes go as a list beside the members)
        state = super().__getstate__()
        state["_tensorclass_members"] = [self._tensorclass_of(m) for m in self.tensordicts] \
            if state.get("_tensorclass_members") else None
        return state

    def __setstate__(self, state: dict) -> None:
        classes = state.pop("_tensorclass_members", None)
        super().__setstate__(dict(state, _tensorclass_members=None))
        for member, cls in zip(self.tensordicts, classes or ()):
            if cls is not None:
                self._record_class(member, cls)

    def pop(self, key: NestedKey, default: Any = NO_DEFAULT) -> Any:
        """Remove the entry ``key`` from every member and return its stacked value."""
        value = self.get(key, default)
        if key in self:
            self.del_(key)
        return value

    # ---------------------------------------------------------------- conversions
    def to_tensordict(self, *, retain_none: bool | None = None) -> Any:
        """A dense TensorDict (a copy); raises a RuntimeError naming a heterogeneous key.
        ``retain_none`` is accepted, as tensordict 0.15.3 takes it, and ignored (no entry
        holds None here)."""
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
        """A nested dict of stacked values (raises on heterogeneous shapes, as tensordict).

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
                entries[key] = unwrap_tensorclass(value)._map_leaves(fn, path)
            else:
                entries[key] = fn(path if len(path) > 1 else key, value)
        return TensorDict._new_unsafe(entries, self.batch_size, self.device)

    def _compare(self, other: Any, op: Callable, other_type: bool = False) -> "LazyStackedTensorDict | bool":
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
    def _restack(self, members: list, stack_dim: int | None = None,
                 batch_size: Any = None, *, same_stack_dim: bool = True,
                 member_wise: bool = False) -> "LazyStackedTensorDict":
        """A new lazy stack of ``members`` (along this one's ``stack_dim`` by default): how
        the mixins build stacks, since they cannot import this module. ``batch_size`` is
        only needed when ``members`` may be empty (see ``__init__``). The new stack dim
        is this one's (moved, maybe), so it keeps its name, unless ``same_stack_dim`` is
        False (a stack of elements along a new dim: a reshape). ``member_wise``: member i
        of ``members`` is a result of this stack's member i with the same fields (clone,
        to, a shape op), so a member given as a tensorclass stays one; else only the very
        same member objects do (a slice): never by position (audit 21: a reordering index
        or a nested branch saved members as another member's tensorclass)."""
        sd = self._stack_dim if stack_dim is None else stack_dim
        name = self._stack_dim_name if same_stack_dim else None
        if members:
            out = LazyStackedTensorDict(*members, stack_dim=sd, stack_dim_name=name)
            if getattr(self, "_tensorclass_members", None):  # the members given as tensorclasses
                # stay so: the same objects (a slice), or the members' results, one each
                aligned = member_wise and same_stack_dim and len(members) == len(self.tensordicts)
                for at, member in enumerate(members):
                    cls = self._tensorclass_of(member) or (aligned and self._tensorclass_of(self.tensordicts[at]))
                    if cls:
                        out._record_class(member, cls)
            return out
        if batch_size is None:  # the same dims as this one
            member_batch = self._member_batch
        else:  # ``batch_size`` is the new stack's: its members' lack the stack dim
            sd = batch_ops.normalize_dim(sd, len(batch_size), what="stack_dim")
            member_batch = list(batch_size[:sd]) + list(batch_size[sd + 1 :])
        return LazyStackedTensorDict(stack_dim=sd, batch_size=member_batch, device=self.device,
                                     stack_dim_name=name)
