"""LazyStackedTensorDict: tensordicts stacked along a batch dim without copying them.

The members are kept as they are (``lazy.tensordicts`` holds the very objects), so their
entries may have different feature shapes; reading a key stacks the members' values,
writing a key splits the value along ``stack_dim`` into the members.

This module holds the class: construction, properties, reads (``get``, ``pop``, keys;
the reads of entries whose shapes differ across members are in lazy_ragged.py) and
``_restack``, which builds new stacks. The rest comes from mixins, each in its own
module: lazy_members.py (LazyMembers: append, insert, extend, the members given as
tensorclasses), lazy_convert.py (LazyConversions: to_tensordict, to_dict, comparisons,
repr), lazy_writes.py (LazyWriteOps: set, update, ``lazy[idx] = ...``, del),
lazy_apply.py (LazyApplyOps: apply, named_apply), lazy_shape.py (LazyShapeOps:
indexing, shape ops, torch.cat, member-wise maps such as clone), lazy_names.py
(LazyNames: ``names``, its setter and ``stack_dim_name``) and batch_dim_ops.py
(LazyBatchDimOps: transpose, flatten, unflatten). They do not import this module; the
class is named only here.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from shared_td.containers import batch as batch_ops
from shared_td.containers.base import NO_DEFAULT, TensorDictBase
from shared_td.containers.batch_dim_ops import LazyBatchDimOps
from shared_td.containers.convenience_ops import TensorData
from shared_td.containers.keysview import peek_path
from shared_td.containers.lazy_ragged import Ragged, has_ragged_leaf, members_values, stacked
from shared_td.containers.lazy_apply import LazyApplyOps
from shared_td.containers.lazy_convert import LazyConversions
from shared_td.containers.lazy_members import LazyMembers
from shared_td.containers.lazy_names import LazyNames, checked_stack_dim_name
from shared_td.containers.lazy_shape import LazyShapeOps, set_batch_size, stacked_into
from shared_td.containers.lazy_writes import LazyWriteOps, _is_branch, _peek
from shared_td.containers.value_kinds import is_non_tensor, is_tensor_collection
from shared_td.errors import BatchSizeMismatchError
from shared_td.keys import NestedKey, RAISE, is_nested_key, unravel_key
from shared_td.tensorclass_protocol import is_tensorclass, unwrap_tensorclass


# The mixins come before TensorDictBase so that their methods override its own; their
# ``super()`` calls (e.g. ``_check_unlocked`` in ``_set_str``) reach TensorDictBase.
class LazyStackedTensorDict(LazyMembers, LazyConversions, LazyApplyOps, LazyNames, LazyShapeOps, LazyBatchDimOps,
                            LazyWriteOps, TensorData, TensorDictBase):
    """Tensordicts stacked along ``stack_dim``, kept as they are (``tensordicts``).

    Members share their batch size (unlike tensordict, different ones are refused) but
    their entries may differ in feature shape. Keys are those of every member, as in
    tensordict 0.15.3 (the others are shown as ``exclusive_fields``; ``get`` of one
    raises a KeyError where tensordict returns None). ``get`` stacks equal-shape tensors
    (a copy) and non-tensors (a NonTensorStack); nested tensordicts give a lazy stack of
    the members' children. Tensors of different shapes raise a RuntimeError unless
    ``as_list``, ``as_padded_tensor`` or ``as_nested_tensor`` is given. Writes (``set``,
    ``set_``, ``update_``, ``lazy[idx] = ...``, ``del``) split the value along
    ``stack_dim`` into the members. A member given as a tensorclass is held as its
    tensordict (in ``tensordicts``); ``lazy[i]``, iteration and ``unbind`` give it back
    as that tensorclass and a save writes it so, as in tensordict 0.15.3.

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
        from shared_td.containers.tensor_methods import refuse_mapped_nodes, share_checked
        from shared_td.containers.unpicklable import check_picklable, share_values_together

        refuse_mapped_nodes(self.tensordicts, "a member of this stack, or a tensordict in one")
        check_picklable(self, "share_memory_()", shared=True)
        share_values_together(self)  # (then found shared by the members)
        for member in self.tensordicts:
            share_checked(member)
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
        the stack if it is one of its members (identity, as tensordict 0.15.3): a
        tensorclass by its tensordict (the stack holds that), so that the one given and
        ``lazy[0]`` are in the stack."""
        if not is_nested_key(key):
            if is_tensor_collection(key):
                inner = unwrap_tensorclass(key)
                return any(inner is member for member in self.tensordicts)
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
        as_members = as_list or as_padded_tensor or as_nested_tensor
        if as_members and len(path) > 1:  # (peeked: a lazy stack in the members may hold it ragged)
            peeked = [peek_path(m, path) for m in self.tensordicts]
            if peeked and all(v is not None and not is_non_tensor(v) for v in peeked):
                return members_values(self, path, as_list, as_padded_tensor, as_nested_tensor, padding_side,
                                      padding_value, layout)
        value = self._get_path(path, NO_DEFAULT)
        if value is NO_DEFAULT:
            return self._default_for_missing(path, default)
        if not as_members or is_non_tensor(value):
            if isinstance(value, Ragged):
                raise value.error()
            return self._written_through(path, value)  # (a non-tensor: its writes reach the members)
        return members_values(self, path, as_list, as_padded_tensor, as_nested_tensor, padding_side, padding_value,
                              layout)

    def __getitems__(self, indices: Sequence[int]) -> Any:
        """The rows at ``indices`` in one index operation (torch's DataLoader calls it
        with a batch of indices): ``self[indices]``, as in tensordict."""
        return self[torch.as_tensor(list(indices), dtype=torch.long)]

    def pop(self, key: NestedKey, default: Any = NO_DEFAULT) -> Any:
        """Remove the entry ``key`` from every member and return its stacked value."""
        value = self.get(key, RAISE if default is NO_DEFAULT else default)
        if key in self:
            self.del_(key)
        return value

    # ---------------------------------------------------------------- new stacks
    def _restack(self, members: list, stack_dim: int | None = None,
                 batch_size: Any = None, *, same_stack_dim: bool = True,
                 member_wise: bool = False, sources: list | None = None) -> "LazyStackedTensorDict":
        """A new lazy stack of ``members`` (along this one's ``stack_dim`` by default): how
        the mixins build stacks, since they cannot import this module. ``batch_size`` is
        only needed when ``members`` may be empty (see ``__init__``). The new stack dim
        is this one's (moved, maybe), so it keeps its name, unless ``same_stack_dim`` is
        False (a stack of elements along a new dim: a reshape). ``member_wise``: member i
        of ``members`` is a result of this stack's member i with the same fields (clone,
        to, a shape op), so a member given as a tensorclass stays one; else only the very
        same member objects do (a slice): never by position (audit 21: a reordering index
        or a nested branch saved members as another member's tensorclass). ``sources``:
        for each of ``members``, the member of this stack it was taken from (an index
        that selects whole members, maybe indexing inside them: ``lazy[[1, 0]]``,
        ``lazy[None, [1, 0]]``), whose tensorclass it keeps, as in tensordict 0.15.3."""
        sd = self._stack_dim if stack_dim is None else stack_dim
        name = self._stack_dim_name if same_stack_dim else None
        if members:
            out = LazyStackedTensorDict(*members, stack_dim=sd, stack_dim_name=name)
            if getattr(self, "_tensorclass_members", None):  # the members given as tensorclasses
                # stay so: the same objects (a slice), or the members' results, one each
                if sources is None and member_wise and same_stack_dim and len(members) == len(self.tensordicts):
                    sources = self.tensordicts
                for at, member in enumerate(members):
                    cls = self._tensorclass_of(member) or (sources is not None and self._tensorclass_of(sources[at]))
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
