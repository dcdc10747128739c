"""``update``, ``update_`` and ``copy_``: the mixin UpdateOps of TensorDictBase. Every
entry is checked before the first one is written, so a failing update changes nothing.
Also ``_resized_child``: a tensordict set with another batch size, as tensordict takes it."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from shared_td.containers.update_batch import planned_after_rebatch
from shared_td.containers.update_options import update_source
from shared_td.containers.value_kinds import is_lazy_stack, is_non_tensor, is_tensor_collection
from shared_td.errors import BatchSizeMismatchError
from shared_td.keys import key_repr, unravel_key
from shared_td.memmap_tensor import refuse_read_only
from shared_td.tensorclass_protocol import is_tensorclass, unwrap_tensorclass

if TYPE_CHECKING:  # (base imports this module)
    from shared_td.containers.base import TensorDictBase


class UpdateOps:
    """Writing the entries of another dict or tensordict into this one."""

    def update(
        self, input_dict_or_td: Any = None, clone: bool = False, inplace: bool = False, *,
        keys_to_update=None, non_blocking: bool = False, ignore_lock: bool = False,
        update_batch_size: bool = False, **entries: Any,
    ) -> "TensorDictBase":
        """Set every entry of ``input_dict_or_td`` (a dict or tensordict; tensordict's
        name, so that ``td.update(other=x)`` is an entry, as there), merging nested ones.

        Keywords that are not options are top-level entries, as in tensordict:
        ``td.update(a=x)`` writes ``x`` at ``"a"`` (written after a tensordict's entries,
        so merged into a nested one of the same key; it replaces a dict's). ``ignore_lock=True`` warns (a DeprecationWarning, as tensordict
        0.15.3's) and, as there, does not lift the lock; tensordict's ``is_leaf`` raises a
        TypeError saying shared_td does not support it.

        A tensordict source must have a batch size that starts this one's or is started
        by it (BatchSizeMismatchError), unless ``update_batch_size=True``: then this
        tensordict, and each nested one whose source's batch size differs, takes the
        source's batch size (see ``shared_td.containers.update_batch``; every key of
        such a tensordict must be in the source, and ``inplace=True`` or a
        ``keys_to_update`` that selects it is refused); a lazy stack given a source of
        more or fewer members gets as many. A batch size that starts the source's (``[]`` for a
        source of ``[2]``) is kept, as in tensordict 0.15.3.

        With ``clone=True`` the entries added or replaced are copies of ``other``'s (as
        tensordict 0.15.3; ``clone`` and ``inplace`` may be passed by position, as
        there). With ``inplace=True`` existing entries are written in place (allowed on
        a locked tensordict) and missing ones are added. Every entry is checked before
        the first one is written, so a failing update leaves self unchanged.

        Example:
            >>> src = TensorDict(a=torch.zeros(2), batch_size=[2])
            >>> td = TensorDict(batch_size=[2]).update(src, clone=True)
            >>> td["a"] is src["a"], td["a"].tolist()
            (False, [0.0, 0.0])
            >>> td.update(TensorDict(a=torch.ones(5), batch_size=[5]), update_batch_size=True).batch_size
            torch.Size([5])
        """
        other = update_source(self, input_dict_or_td, entries, ignore_lock)
        selected = None if keys_to_update is None else [unravel_key(k) for k in keys_to_update]

        def plan() -> list:  # (checks only: nothing is written before it returns)
            check_source_batch(self, other)
            return _stores_first(self._plan_update(other, (), inplace, True, selected))

        for path, value, in_place, _ in planned_after_rebatch(self, other, plan, update_batch_size=update_batch_size,
                                                              inplace=inplace, keys_to_update=keys_to_update):
            if isinstance(value, (_NestedUpdate, _EmptyField)):
                value.write(clone)
            elif in_place:
                self._write_in_place(path, value)  # (checked by the plan)
            else:
                self.set(path, value.clone() if clone and hasattr(value, "clone") else value)
        return self

    def update_(self, input_dict_or_td: Any = None, clone: bool = False, *, keys_to_update=None,
                non_blocking: bool = False, **entries: Any) -> "TensorDictBase":
        """Write every entry of ``input_dict_or_td`` (and the keyword ``entries``, as
        ``update`` takes them: ``td.update_(a=x)``) into the existing entries, in place.
        ``clone`` is accepted for tensordict's signature: an in-place write copies anyway.

        Raises KeyError (naming the key) if one is missing; as every entry is checked
        before the first one is written, a failing update_ leaves self unchanged. (A
        non-tensor entry that is shared or memory-mapped stores its new values where the
        plan cannot check everything -- a full disk --: such entries are written first,
        so that this fails before any tensor is written.)
        """
        other = update_source(self, input_dict_or_td, entries, False)
        selected = None if keys_to_update is None else [unravel_key(k) for k in keys_to_update]
        for path, value, _, _ in _stores_first(self._plan_update(other, (), True, False, selected)):
            if isinstance(value, _NestedUpdate):
                value.write(False)
            else:
                self._write_in_place(path, value)  # (checked by the plan)
        return self

    def _plan_update(
        self, other: Any, prefix: tuple, inplace: bool, add_missing: bool, selected: list | None,
        names_of: dict | None = None,
    ) -> list:
        """The checked ``(path, value, in_place, store)`` writes of ``update``/``update_``
        (``store``: an in-place write into a non-tensor entry, see :func:`_stores_first`).

        Nothing is written here: every failure (missing key, lock, batch size, shape,
        dim names, a value that a shared or memory-mapped non-tensor entry cannot store)
        is raised before the caller writes the first entry. ``names_of``:
        the names that the tensordicts at some paths will have once the writes planned
        so far are done (a child set into an unnamed tensordict names it).
        """
        from shared_td.containers.base import TensorDictBase  # (base imports this module)

        names_of = {} if names_of is None else names_of
        plan = []
        items = other.items() if isinstance(other, (dict, TensorDictBase)) else other
        for key, value in items:
            path = prefix + unravel_key(key)
            is_mapping = isinstance(value, (dict, TensorDictBase)) and not is_non_tensor(value)
            if selected is not None and not any(path[: len(s)] == s for s in selected):
                # Only some keys below this one are selected: descend into a mapping, or
                # into a tensorclass's fields (skipped before: its selected fields not written).
                node = value if is_mapping else unwrap_tensorclass(value)
                if not (is_mapping or node is not value) or not any(s[: len(path)] == path for s in selected):
                    continue
                if node is not value and add_missing and self._get_path(path, None) is None:
                    plan.append(self._planned_set(path, value, names_of))  # (added whole, as tensordict's)
                else:
                    plan += self._plan_nested(node, path, inplace, add_missing, selected, names_of)
                continue
            current = self._get_path(path, None)
            owner = _field_owner(self, path) if value is None else None
            if owner is not None and (current is None or add_missing):
                # None for a declared field of a tensorclass is "no value" (what to_dict()
                # gives for an empty field), as tensordict 0.15.3 takes it: update empties
                # the field (no NonTensorData(None) entry), update_ leaves an empty one be
                # (one that holds a value is written in place, below, as there)
                if current is not None:
                    unwrap_tensorclass(owner)._check_unlocked(path, "remove")
                    plan.append((path, _EmptyField(owner, path[-1]), True, False))
            elif not inplace and selected is None and _restacks(current, value):
                plan.append(self._planned_set(path, _restacked(current, value), names_of))
            elif is_mapping and isinstance(current, TensorDictBase) and not is_non_tensor(current):
                plan += self._plan_nested(value, path, inplace, add_missing, selected, names_of)
            elif _merges_into_tensorclass(current, value):
                plan += self._plan_nested(unwrap_tensorclass(value), path, inplace, add_missing, selected, names_of)
            elif current is None and not add_missing:
                raise KeyError(
                    f"update_() writes in place, but key {key_repr(path)} does not exist "
                    f"in {type(self).__name__}. Use update() to add it."
                )
            elif inplace and current is not None:
                value = self._checked_set_(path, current, value)
                refuse_read_only(current, "update_")  # (mode="r": before any entry is written)
                store = is_non_tensor(current)
                if store:  # (a shared cell, files: pickled or JSON)
                    current._check_storable(value._flat_values() if is_non_tensor(value) else [value], path)
                plan.append((path, value, True, store))
            else:
                plan.append(self._planned_set(path, value, names_of))
        return plan

    def _planned_set(self, path: tuple, value: Any, names_of: dict) -> tuple:
        """The checked write ``set(path, value)`` of the plan (see :meth:`_plan_update`)."""
        value = self._checked_set(path, value)
        self._plan_names(path, value, names_of)
        return path, value, False, False

    def _plan_nested(self, value: Any, path: tuple, inplace: bool, add_missing: bool, selected: list | None,
                     names_of: dict) -> list:
        """The plan of the mapping ``value`` merged into the collection at ``path``:
        entry by entry, or, for a lazy stack there and a tensordict ``value`` of its batch
        size, one ``_NestedUpdate`` that the stack does itself, member by member (its
        entries read from here would be stacked copies, which raise when the members'
        shapes differ). (A dict, or a tensordict of fewer batch dims, a parent's
        ``to_dict()`` made into a tensordict, is written entry by entry, each split.)"""
        from shared_td.containers.base import TensorDictBase  # (base imports this module)
        from shared_td.containers.lazy_writes import _is_lazy

        target, value = unwrap_tensorclass(self._get_path(path, None)), unwrap_tensorclass(value)
        if not (_is_lazy(target) and isinstance(value, TensorDictBase)
                and value.batch_size[: target.batch_dims] == target.batch_size):
            return self._plan_update(value, path, inplace, add_missing, selected, names_of)
        if selected is not None and not any(path[: len(s)] == s for s in selected):
            selected = [s[len(path):] for s in selected if s[: len(path)] == path]
        else:
            selected = None
        return [(path, _NestedUpdate(target, value, inplace, add_missing, selected), True, False)]

    def _plan_names(self, path: tuple, value: Any, names_of: dict) -> None:
        """Raise, as ``set(path, value)`` would when it writes, if ``value`` names its
        dims otherwise than the tensordict it goes into will (``names_of``, updated)."""
        from shared_td.containers.naming import carries_names, names_after_set

        child = unwrap_tensorclass(value)
        parent = self._planned_node(path[:-1])
        if not carries_names(child) or not hasattr(parent, "_adopt_names"):
            return  # (a leaf, or a lazy stack's key: its members check)
        names = self._planned_names(path[:-1], names_of)
        after = names_after_set(names, parent.batch_dims, path[-1], child)
        exists = not path[:-1] or self._get_path(path[:-1], None) is not None
        if names is None and after is not None and exists:
            parent._rename_leading(after, check_only=True)  # (its other children follow)
        names_of[path[:-1]] = after

    def _planned_node(self, path: tuple) -> Any:
        """The tensordict at ``path``, or the nearest one above it (which a write would
        give the missing ones, of its batch size and names)."""
        node = unwrap_tensorclass(self._get_path(path, None)) if path else self
        return self._planned_node(path[:-1]) if node is None else node

    def _planned_names(self, path: tuple, names_of: dict) -> list | None:
        """The names the tensordict at ``path`` will have (see _plan_update)."""
        if path in names_of:
            return names_of[path]
        node = unwrap_tensorclass(self._get_path(path, None)) if path else self
        if not path:
            return self.names
        above = self._planned_names(path[:-1], names_of)
        if node is None:  # missing: made with the names of the one above
            return above
        try:
            own = node.names
        except ValueError:  # (a lazy stack whose members name their dims otherwise)
            own = None
        if above is None:
            return own
        return above + (own or [None] * node.batch_dims)[len(above):]

    def _merged_in_place(self, key: Any, value: Any) -> bool:
        """``set(key, value, inplace=True)`` when ``key`` holds a nested tensordict (or
        tensorclass, or lazy stack) and ``value`` is a dict or tensordict: as tensordict
        0.15.3 does, ``update(value, inplace=True)`` of that entry, whose entries are then
        written in place and the keys it lacks added (``set_`` refuses those). Returns
        whether it was written so (everything checked before the first write).

        Example:
            >>> td = TensorDict(v=TensorDict(a=torch.zeros(2), batch_size=[2]), batch_size=[2])
            >>> a = td["v", "a"]
            >>> _ = td.set("v", {"a": torch.ones(2), "b": torch.ones(2)}, inplace=True)
            >>> sorted(td["v"].keys()), td["v", "a"] is a, a.tolist()
            (['a', 'b'], True, [1.0, 1.0])
        """
        import torch

        from shared_td.containers.base import TensorDictBase  # (base imports this module)

        if isinstance(value, torch.Tensor):
            return False  # (most values: nothing to look up)
        current = self.get(key, None)
        if is_non_tensor(current):  # a shared or memory-mapped one: what it cannot store, named (as set_)
            current._check_storable_write(value, unravel_key(key))
            return False
        if not isinstance(value, (dict, TensorDictBase)) and not is_tensorclass(value):
            return False
        if not is_tensor_collection(current) or is_non_tensor(value):
            return False
        current.update(value, inplace=True)
        return True

    def _check_set_(self, path: tuple, current: Any, value: Any) -> None:
        """What ``set_(path, value)`` checks before it writes, each error naming the full
        key and ``set_``: a value that ``current``, a shared or memory-mapped non-tensor
        entry, cannot store (a TypeError), or a key that the nested tensordict
        ``current`` lacks (a KeyError; ``update_``, which writes it, would name itself).

        Example:
            >>> td = TensorDict(next=TensorDict(a=torch.zeros(2), batch_size=[2]), batch_size=[2])
            >>> try:
            ...     td.set_("next", {"a": torch.ones(2), "b": torch.ones(2)})
            ... except KeyError as error:
            ...     print(error.args[0][:60])
            set_() writes in place, but key ('next', 'b') does not exist
        """
        if is_non_tensor(current):
            current._check_storable_write(value, path)
        elif is_tensor_collection(current):
            missing = _missing_key(current, value, path)
            if missing is not None:
                raise KeyError(
                    f"set_() writes in place, but key {key_repr(missing)} does not exist in "
                    f"{type(self).__name__}. Use set({key_repr(path)}, ..., inplace=True) or "
                    "update(..., inplace=True) to add it."
                )

    def _resized_child(self, value: Any, key: str | None = None) -> Any:
        """``value``, a tensordict or tensorclass about to be set into this tensordict,
        whose leading dims are not our batch size, as tensordict 0.15.3 takes it: a
        shallow copy (``clone(recurse=False)``: the same tensors; ``value`` is not
        changed) given our batch size, when its entries allow it (an empty
        ``TensorDict()``, or one whose tensors start with our batch size; the dims of
        ``value`` past it are dropped). Otherwise ``value`` itself, which the caller then
        refuses, naming the key: a lazy stack (its batch_size setter takes only its
        own size, as tensordict's), or entries that do not fit. Given the ``key``, those raise here instead, naming the
        key and the entry at fault (as tensordict names the entry).

        Raises:
            BatchSizeMismatchError: (a ValueError and a RuntimeError) with ``key``: an
                entry of ``value`` does not start with our batch size.

        Example:
            >>> td = TensorDict(a=torch.zeros(3, 4), batch_size=[3])
            >>> td["empty"] = TensorDict()
            >>> td["empty"].batch_size
            torch.Size([3])
        """
        from shared_td.errors import BatchSizeMismatchError

        setter = getattr(type(value), "batch_size", None)
        if not isinstance(setter, property) or setter.fset is None:
            return value
        copy = value.clone(recurse=False)
        try:
            copy.batch_size = self.batch_size
        except BatchSizeMismatchError as error:
            if key is None:
                return value
            raise BatchSizeMismatchError(
                f"batch dimension mismatch for key {key!r}: the {type(value).__name__} set there "
                f"(batch_size {list(value.batch_size)}) cannot take this tensordict's batch_size "
                f"{list(self.batch_size)}, as tensordict 0.15.3 would give it: {error}"
            ) from None
        return copy

    def copy_(self, other: Any, non_blocking: bool = False) -> "TensorDictBase":
        """Copy ``other`` into self, in place (same as ``update_``).

        ``non_blocking`` is accepted for compatibility with tensordict, and ignored (every
        copy here is synchronous).
        """
        return self.update_(other)


class _NestedUpdate:
    """A planned ``update``/``update_`` of a nested lazy stack by its own method (member
    by member), checked when planned (as every write of the plan)."""

    def __init__(self, target: Any, source: Any, inplace: bool, add_missing: bool, selected: list | None):
        from shared_td.containers.lazy_writes import check_write  # (base imports this module)

        check_write(target, source, inplace=inplace, add_missing=add_missing, selected=selected)
        self.target, self.source, self.inplace, self.add_missing, self.selected = (
            target, source, inplace, add_missing, selected)

    def write(self, clone: bool) -> None:
        if self.add_missing:
            self.target.update(self.source, clone, inplace=self.inplace, keys_to_update=self.selected)
        else:
            self.target.update_(self.source, keys_to_update=self.selected)


class _EmptyField:
    """A planned ``update`` that empties the field ``name`` of the tensorclass ``owner``
    (given None); its lock is checked when planned."""

    def __init__(self, owner: Any, name: str):
        self.owner, self.name = owner, name

    def write(self, clone: bool) -> None:
        setattr(self.owner, self.name, None)  # (the tensorclass removes the entry)


def _restacks(current: Any, value: Any) -> bool:
    """Whether ``update`` writes the lazy stack ``value`` over the TensorDict ``current``
    (whose batch size starts the stack's) as tensordict 0.15.3 does: ``current`` becomes a lazy stack of
    its slices along the stack's dim, updated member by member (:func:`_restacked`)."""
    if not is_lazy_stack(value):  # (almost every entry of an update: nothing imported)
        return False
    from shared_td.containers.tensordict import TensorDict  # (it imports this module)

    # (tensordict restacks a TensorDict whose batch size starts the stack's too, when the
    # stack dim is one of its dims: the slices then take the rest of the members' batch)
    return (isinstance(current, TensorDict) and value.stack_dim < current.batch_dims
            and value.batch_size[: current.batch_dims] == current.batch_size)


def _restacked(current: Any, value: Any) -> Any:
    """A new lazy stack of ``current``'s slices along ``value``'s stack dim, updated with
    ``value``'s members (so it holds what each member gives, ragged or not; the slices
    are new tensordicts over the same tensors, and none of them is written here: a
    failure changes nothing). ``current`` itself is left as it is, as in tensordict."""
    lazy = type(value)(*current.unbind(value.stack_dim), stack_dim=value.stack_dim)
    return lazy.update(value)


def _field_owner(td: Any, path: tuple) -> Any:
    """The tensorclass instance in ``td`` of which ``path`` names a declared field, or
    None."""
    owner = td._get_path(path[:-1], None) if len(path) > 1 else None
    if is_tensorclass(owner) and not isinstance(owner, type) and path[-1] in type(owner)._tc_field_names:
        return owner
    return None


def _stores_first(plan: list) -> list:
    """``plan`` (of ``_plan_update``) with the in-place writes into non-tensor entries
    first, in their order: a shared or memory-mapped one may fail in a way no plan can
    check (a full memory or disk), which then happens before any tensor is written.
    (The entries are distinct: no write reads what another one writes.)

    Example:
        >>> [w[0] for w in _stores_first([(("a",), 1, True, False), (("s",), "x", True, True)])]
        [('s',), ('a',)]
    """
    stores = [write for write in plan if write[3]]
    return plan if not stores else stores + [write for write in plan if not write[3]]


def _missing_key(node: Any, value: Any, prefix: tuple) -> tuple | None:
    """The full key of the first entry of ``value`` (a dict, tensordict or tensorclass
    written in place into the collection ``node`` at ``prefix``) that ``node`` lacks;
    None when there is none, or when ``value`` is not such a mapping."""
    from shared_td.containers.base import TensorDictBase  # (base imports this module)

    node, value = unwrap_tensorclass(node), unwrap_tensorclass(value)
    if not isinstance(value, (dict, TensorDictBase)) or is_non_tensor(value) or is_non_tensor(node):
        return None
    for key, sub in value.items():
        path = unravel_key(key)
        try:
            entry = node._get_path(path, None)
        except Exception:  # (a lazy stack whose members differ: its update_ checks member by member)
            continue
        if entry is None:
            return prefix + path
        if is_tensor_collection(entry):
            found = _missing_key(entry, sub, prefix + path)
            if found is not None:
                return found
    return None


def _merges_into_tensorclass(current: Any, value: Any) -> bool:
    """True when ``value`` (a dict, tensordict or tensorclass) updates the nested
    tensorclass ``current`` field by field, as tensordict does, instead of replacing it
    by a TensorDict; only when every key it names is a field of ``current``."""
    from shared_td.containers.base import TensorDictBase  # (base imports this module)

    if not is_tensorclass(current) or isinstance(current, type):
        return False
    value = unwrap_tensorclass(value)
    if not isinstance(value, (dict, TensorDictBase)) or getattr(value, "_is_non_tensor", False):
        return False
    return {unravel_key(key)[0] for key in value.keys()} <= type(current)._tc_field_names


def check_source_batch(td: Any, source: Any) -> None:
    """BatchSizeMismatchError (a RuntimeError, as tensordict 0.15.3 raises) when the
    tensordict ``source`` of ``td.update(source)`` has a batch size that neither starts
    ``td``'s nor is started by it: even an empty one, whose nested tensordicts would
    otherwise be re-batched to ``td``'s in silence."""
    if not is_tensor_collection(source):
        return
    theirs, mine = tuple(unwrap_tensorclass(source).batch_size), tuple(td.batch_size)
    shorter = min(len(theirs), len(mine))
    if theirs[:shorter] != mine[:shorter]:
        raise BatchSizeMismatchError(
            f"update() got a source with batch size {list(theirs)} for a destination with batch size "
            f"{list(mine)}: neither starts the other, so its entries cannot fit; nothing was written. "
            "Make the batch sizes agree first, or pass update_batch_size=True to give the destination the "
            "source's batch size."
        )
