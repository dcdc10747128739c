"""The members of a LazyStackedTensorDict, as a mixin (LazyMembers): adding members
(``append``, ``insert``, ``extend``) and the record of the members given as tensorclasses
(a save writes such a member as its class, as tensordict 0.15.3 does; see
node_kinds._members_as_given), which pickling carries.

This module does not import lazy.py (lazy.py imports it).
"""
from __future__ import annotations

import weakref
from typing import Any

from shared_td.containers.lazy_writes import _is_branch
from shared_td.containers.tensorclass_compat import check_row_write
from shared_td.tensorclass_protocol import unwrap_tensorclass


class LazyMembers:
    """Mixin of LazyStackedTensorDict (it relies on ``tensordicts``, ``_member_batch``,
    ``device`` and ``_tensorclass_members``, set by its ``__init__``)."""

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
        # the lock first, as tensordict 0.15.3 (a locked stack refuses any member, whatever its
        # device or batch size); locked is what ``is_locked`` says: the stack's own lock, or
        # every member's (a reshape or view of a locked stack, whose members are locked views)
        action = "insert a member into the lazy stack"
        super()._check_unlocked((), action)
        if self.is_locked:
            for locked in self.tensordicts:
                locked._check_unlocked((), action)
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

    def _member_as_given(self, member: Any, value: Any = None) -> Any:
        """``value`` (``member`` itself by default, or a part of it: ``lazy[0, 1:]``) as
        the tensorclass ``member`` was given as, if any, as tensordict 0.15.3 gives it;
        a view of the member either way (a write through it reaches the stack).

        The whole member is the instance the stack holds, given back without running
        ``__post_init__`` or a frozen class's lock (tensordict returns the stored object):
        a read of a locked (shared, memory-mapped) stack whose class's ``__post_init__``
        assigns a field raised, and reading one of a frozen class locked the member. A
        part of it is rebuilt, as tensordict rebuilds it (``__post_init__`` runs).

        Example:
            >>> @shared_td.tensorclass
            ... class Obs:
            ...     x: torch.Tensor
            ...     def __post_init__(self):
            ...         self.x = self.x.float()
            >>> lazy = LazyStackedTensorDict(Obs(x=torch.zeros(2, dtype=torch.long), batch_size=[2]))
            >>> type(lazy.share_memory_()[0]).__name__, lazy[0]._tensordict is lazy.tensordicts[0]
            ('Obs', True)
        """
        cls = self._tensorclass_of(member)
        if cls is None:
            return member if value is None else value
        if value is None or value is member:
            return cls._from_tensordict(member, _stored=True)
        return cls._from_tensordict(value)

    def _keep_classes_of(self, items: Any, sd: int) -> None:
        """Record on this new stack, whose member i was built from the members i of the
        lazy stacks ``items`` along ``sd`` (``torch.stack``, ``torch.cat`` along another
        dim), the tensorclass that all those members were given as, so that its members
        read, clone and save as that class (and refuse keys that are no field), as in
        tensordict 0.15.3 (they read as TensorDicts)."""
        if not all(getattr(item, "_tensorclass_members", None) and item.stack_dim == sd
                   and len(item.tensordicts) == len(self.tensordicts) for item in items):
            return
        for i, member in enumerate(self.tensordicts):
            classes = {item._tensorclass_of(item.tensordicts[i]) for item in items}
            if len(classes) == 1 and None not in classes:
                self._record_class(member, classes.pop())

    def _keep_classes_joined(self, items: Any) -> None:
        """Record on this new stack, whose members are those of the lazy stacks ``items``
        (``torch.cat`` along the stack dim), the tensorclass each was given as."""
        for item in items:
            for member in item.tensordicts:
                cls = item._tensorclass_of(member)
                if cls is not None:
                    self._record_class(member, cls)

    def _refuse_keys_no_field(self, member: Any, source: Any, path: tuple = ()) -> None:
        """ValueError naming them when ``source`` (a tensordict or dict written into
        ``member``: its part of a row write or an update) holds keys that are no field of
        the tensorclass ``member`` was given as, as the member's own ``update()``
        refuses them (added, its copies read as TensorDicts, and tensordict 0.15.3 could
        not load its save). A member given as a tensordict takes any key."""
        if self._tensorclass_of(member) is not None:
            check_row_write(self._member_as_given(member), source, path, fields_only=True)

    def _refuse_new_key_no_field(self, member: Any, key: str) -> None:
        """The AttributeError of the member's own ``set()`` when the new ``key`` is no
        field of the tensorclass ``member`` was given as (see _refuse_keys_no_field)."""
        cls = self._tensorclass_of(member)
        if cls is not None and key not in cls._tc_field_names:
            from shared_td.containers.tensorclass_members import _no_field_message

            raise AttributeError(_no_field_message(cls, key))

    def _one_class_view(self, stack: Any) -> Any:
        """``stack`` (a new stack that indexing this one built) as tensordict 0.15.3 gives
        it: when every member of it was given as one tensorclass, that class over the
        stack of their tensordicts, as ``lazy_stack([tc1, tc2])`` gives (its save is
        that class around a lazy stack, as tensordict's); else ``stack`` itself, whose
        members given as tensorclasses are saved so."""
        cls = None if stack is self else stack._one_tensorclass()
        if cls is None:
            return stack
        stack._tensorclass_members = None  # (the class is around the stack now, not on its members)
        # (a frozen class does not lock the new stack: that locked the members it shares)
        return cls._from_tensordict(stack, _lock=False)

    def _one_tensorclass(self) -> type | None:
        """The tensorclass every member was given as; None when one was not, or they
        were of two classes (or there is no member)."""
        if not getattr(self, "_tensorclass_members", None) or not self.tensordicts:
            return None
        classes = {self._tensorclass_of(member) for member in self.tensordicts}
        return classes.pop() if len(classes) == 1 and None not in classes else None
