"""``update(source, update_batch_size=True)``: the tensordicts of the destination whose
batch size the source's cannot fit take the source's, as in tensordict 0.15.3, before
the update writes the source's entries.

A node of the destination is *rebatched* when its batch size and its source's differ
within their common dims (``[3]`` and ``[5]``; not ``[3]`` and ``[3, 4]``, a batch size
that starts the other, kept as it is). A rebatched TensorDict keeps its identity and its
nested tensordicts (rebatched in turn), loses its leaves (every one of its keys is in the
source: checked) and its dim names, and takes the source's batch size; the update then
writes the source's entries into it. A lazy stack given a source of another number of
members is refilled: with fewer, the source's members become its members (by reference);
with more, its members are updated and copies (``copy()``) of the extra ones appended.

Everything is checked before the first node changes, and the update that follows is
checked before its first write: if it fails all the same, every rebatched node is put
back as it was (the ``undo`` that :func:`rebatch_for_update` returns).
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from shared_td.containers.consolidated_tree import locked_path
from shared_td.containers.value_kinds import is_lazy_stack, is_nested_node
from shared_td.errors import LockedTensorDictError
from shared_td.keys import key_repr, unravel_key
from shared_td.tensorclass_protocol import unwrap_tensorclass

__all__ = ["planned_after_rebatch", "rebatch_for_update"]

_NODE, _REFILL, _MEMBERS = "node", "refill", "members"  # the kinds of job (see _plan)


def planned_after_rebatch(dest: Any, source: Any, plan: Callable[[], Any], *, update_batch_size: bool,
                          inplace: bool, keys_to_update: Any) -> Any:
    """``plan()`` (an update's checks, which write nothing), run after
    :func:`rebatch_for_update` when ``update_batch_size``; if it raises, every rebatched
    node is put back before the error goes on."""
    undo = rebatch_for_update(dest, source, inplace=inplace, keys_to_update=keys_to_update) if update_batch_size else None
    try:
        return plan()
    except BaseException:
        if undo is not None:
            undo()
        raise


def rebatch_for_update(dest: Any, source: Any, *, inplace: bool, keys_to_update: Any) -> Callable[[], None] | None:
    """Rebatch the nodes of ``dest`` (a tensordict, lazy stack or tensorclass) that the
    tensordict ``source`` of ``dest.update(source, update_batch_size=True)`` cannot fit
    (see the module's docstring). Returns what puts them back as they were (for an update
    that fails after this), or None when nothing changed (a dict source is written as
    ``update`` writes it: no batch size to take).

    Raises, with nothing changed: RuntimeError for ``inplace=True`` or ``keys_to_update``
    where a batch size changes, for a key of a rebatched node that the source lacks, and
    for a lazy stack given a source it cannot be split into (as tensordict 0.15.3);
    LockedTensorDictError (a RuntimeError) naming the locked tensordict a change would reach.

    Example:
        >>> td = TensorDict(a=torch.zeros(3), next=TensorDict(b=torch.zeros(3, 2), batch_size=[3]), batch_size=[3])
        >>> nested = td["next"]
        >>> src = TensorDict(a=torch.ones(5), next=TensorDict(b=torch.ones(5, 2), batch_size=[5]), batch_size=[5])
        >>> _ = td.update(src, update_batch_size=True)
        >>> td.batch_size, td["next"] is nested, td["next", "b"].shape
        (torch.Size([5]), True, torch.Size([5, 2]))
    """
    source = unwrap_tensorclass(source)
    if not is_nested_node(source):
        return None
    jobs: list = []
    selected = None if keys_to_update is None else [unravel_key(key) for key in keys_to_update]
    _plan(unwrap_tensorclass(dest), source, (), jobs, selected)
    if not jobs:
        return None
    for kind, path, node, part in jobs:
        _check(kind, path, node, part, inplace, keys_to_update)
    undo = _Undo()
    try:  # (a nested lazy stack the checks did not reach may still refuse its source)
        _make_changes(jobs, undo)
    except BaseException:
        undo()
        raise
    return undo


def _make_changes(jobs: list, undo: "_Undo") -> None:
    """Make the changes ``jobs`` (from :func:`_plan`) list, in their order, saving each node in ``undo`` first."""
    for kind, path, node, part in jobs:
        undo.save(node)
        if kind == _REFILL:
            _refill(node, part, path, undo)
        elif kind == _MEMBERS:  # its members were rebatched by their own jobs, before this one
            node._member_batch = node.tensordicts[0].batch_size
        else:
            _rebatch(node, part, path, undo)


def _differ(mine: torch.Size, theirs: torch.Size) -> bool:
    """Whether two batch sizes differ within their common dims (tensordict's test)."""
    common = min(len(mine), len(theirs))
    return tuple(mine[:common]) != tuple(theirs[:common])


def _plan(node: Any, source: Any, path: tuple, jobs: list, selected: list | None = None) -> None:
    """Append to ``jobs`` the ``(kind, path, node, source)`` changes that ``source``
    needs of ``node`` and of its nested tensordicts, in the order they are made (a lazy
    stack's members before the stack). A nested tensordict that no key of ``selected``
    (``keys_to_update``) reaches is not planned: the update leaves it as it is."""
    if is_lazy_stack(node):
        parts = _parts(node, source)
        # (a stack of no member given a source of no row still takes its other dims)
        if parts is None or len(parts) != len(node.tensordicts) or (
                not parts and _differ(node.batch_size, source.batch_size)):
            jobs.append((_REFILL, path, node, source))
            return
        before = len(jobs)
        for member, part in zip(node.tensordicts, parts):
            _plan(member, unwrap_tensorclass(part), path, jobs, selected)
        if len(jobs) > before and parts and _differ(node._member_batch, parts[0].batch_size):
            jobs.append((_MEMBERS, path, node, source))
        return
    if not hasattr(node, "_tensordict"):  # (a class of its own: left to its update)
        return
    if _differ(node.batch_size, source.batch_size):
        jobs.append((_NODE, path, node, source))
        return
    for key, value in source.items():
        if selected is not None and not any(_on_path(path + (key,), chosen) for chosen in selected):
            continue
        child = unwrap_tensorclass(node._tensordict.get(key))
        value = unwrap_tensorclass(value)
        if is_nested_node(child) and is_nested_node(value):
            _plan(child, value, path + (key,), jobs, selected)


def _on_path(path: tuple, chosen: tuple) -> bool:
    """Whether the selected key ``chosen`` is ``path``, below it, or above it."""
    common = min(len(path), len(chosen))
    return path[:common] == chosen[:common]


def _parts(lazy: Any, source: Any) -> list | None:
    """``source`` as the members it gives ``lazy`` (a lazy stack along the same dim: its
    own; a tensordict: its slices along the stack dim), or None if it has no such dim."""
    if is_lazy_stack(source) and source.stack_dim == lazy.stack_dim:
        return list(source.tensordicts)
    if source.batch_dims <= lazy.stack_dim:
        return None
    return list(source.unbind(lazy.stack_dim))


def _split(lazy: Any, source: Any, path: tuple) -> list:
    """``_parts(lazy, source)``; RuntimeError naming ``path`` when there are none."""
    parts = _parts(lazy, source)
    if parts is None:
        raise RuntimeError(
            f"update(update_batch_size=True) cannot split the source of batch size {list(source.batch_size)} "
            f"into the members of {_where(path)}, a lazy stack along dim {lazy.stack_dim}: it has no such dim. "
            "Nothing was written.")
    return parts


def _where(path: tuple) -> str:
    return f"the tensordict at {key_repr(path)}" if path else "the destination"


def _check(kind: str, path: tuple, node: Any, source: Any, inplace: bool, keys_to_update: Any) -> None:
    where = _where(path)
    grows = kind != _REFILL or len(_split(node, source, path)) > len(node.tensordicts)
    if grows and inplace:
        raise RuntimeError(
            f"update(update_batch_size=True, inplace=True): {where} has batch size {list(node.batch_size)} and "
            f"its source {list(source.batch_size)}, which inplace=True cannot give it (its tensors keep their "
            "shapes). Pass inplace=False. Nothing was written.")
    if grows and keys_to_update is not None:
        raise RuntimeError(
            f"update(update_batch_size=True, keys_to_update=...): {where} would change batch size "
            f"({list(node.batch_size)} -> {list(source.batch_size)}), which would drop the keys not updated. "
            "Select the keys first (source.select(...)). Nothing was written.")
    missing = _missing_keys(node, source)
    if missing:
        raise RuntimeError(
            f"update(update_batch_size=True): {where} has batch size {list(node.batch_size)} and its source "
            f"{list(source.batch_size)}, and the keys {sorted(map(key_repr, missing))} are not in the source: "
            "their values would not fit the new batch size. Add them to the source, or remove them first. "
            "Nothing was written.")
    locked = locked_path(node)
    if locked is not None:
        raise LockedTensorDictError(
            f"update(update_batch_size=True) would change the batch size of {where}, but the tensordict at "
            f"{key_repr(path + locked) if path + locked else 'the root'} is locked. Unlock it first "
            "(with td.unlock_(): ...). Nothing was written.")


def _missing_keys(node: Any, source: Any, prefix: tuple = ()) -> set:
    """The full keys (tuples) of ``node`` and of the tensordicts below it that ``source``
    lacks, a lazy stack's member by member against the part of ``source`` it takes (a key
    only some members hold included: ``keys(True)`` of a lazy stack leaves it out, and the
    rebatched member would lose it silently)."""
    node, source = unwrap_tensorclass(node), unwrap_tensorclass(source)
    if is_lazy_stack(node):
        parts = _parts(node, source) if is_nested_node(source) else None
        if parts is None:  # (refused by the split, with its own message)
            return set()
        return set().union(*(_missing_keys(member, part, prefix) for member, part in zip(node.tensordicts, parts)))
    theirs = set(source.keys())
    missing = set()
    for key in node.keys():
        if key not in theirs:
            missing.add(prefix + (key,))
            continue
        child = node.get(key)
        if is_nested_node(child):  # (a leaf of the source is not read: a ragged one would not stack)
            value = source.get(key)
            if is_nested_node(value):
                missing |= _missing_keys(child, value, prefix + (key,))
    return missing


def _rebatch(node: Any, source: Any, path: tuple, undo: "_Undo") -> None:
    """``node`` (a TensorDict) emptied of its leaves, its nested tensordicts rebatched to
    their sources', and given ``source``'s batch size, unnamed."""
    for key, value in list(node._tensordict.items()):
        child = unwrap_tensorclass(value)
        part = unwrap_tensorclass(source.get(key, None)) if is_nested_node(child) else None  # (a leaf's is not read)
        if is_nested_node(part) and (is_lazy_stack(child) or hasattr(child, "_tensordict")):
            _follow(child, part, path + (key,), undo)
        else:  # a leaf, or a tensordict the source replaces by a leaf: the update writes the source's
            del node._tensordict[key]
    node._names = None
    node._batch_size = torch.Size(source.batch_size)


def _follow(node: Any, source: Any, path: tuple, undo: "_Undo") -> None:
    """A nested tensordict (or lazy stack) of a changed node, saved, then given ``source``'s
    batch size (or members)."""
    undo.save(node)
    (_refill if is_lazy_stack(node) else _rebatch)(node, source, path, undo)


def _refill(lazy: Any, source: Any, path: tuple, undo: "_Undo") -> None:
    """The members of ``lazy`` made those ``source`` gives (see the module's docstring)."""
    parts = _split(lazy, source, path)
    members = lazy.tensordicts
    if len(parts) < len(members) or not parts:
        kept = {name: lazy.__dict__[name] for name in ("_lock_parents", "_context_ops", "_stack_dim_name")
                if name in lazy.__dict__}
        # (with no part left, the members' batch size is the source's less the stack dim:
        # the stack of 0 rows keeps its other dims, as any node takes its source's)
        whole, dim = unwrap_tensorclass(source).batch_size, lazy.stack_dim
        member_batch = None if parts else whole[:dim] + whole[dim + 1:]
        type(lazy).__init__(lazy, *parts, stack_dim=dim, batch_size=member_batch)
        lazy.__dict__.update(kept)
        return
    for member, part in zip(members, parts):
        # (planned as a node of its own: a member of the same batch size may still hold a
        # nested tensordict of another one, which its update alone could not write)
        jobs: list = []
        _plan(member, unwrap_tensorclass(part), path, jobs)
        _make_changes(jobs, undo)
    if members:
        lazy._member_batch = members[0].batch_size
    elif parts:
        lazy._member_batch = unwrap_tensorclass(parts[0]).batch_size
    lazy.extend([part.copy() for part in parts[len(members):]])


class _Undo:
    """The state of each node changed, saved before its first change, and put back on call."""

    def __init__(self) -> None:
        self._saved: list = []

    def save(self, node: Any) -> None:
        # (its entries, members, records of member classes and locked parents are dicts
        # and lists that a change mutates: copied)
        state = {name: value.copy() if type(value) in (dict, list) else value for name, value in node.__dict__.items()}
        self._saved.append((node, state))

    def __call__(self) -> None:
        for node, state in reversed(self._saved):  # (the first saving of a node wins)
            node.__dict__.clear()
            node.__dict__.update(state)
