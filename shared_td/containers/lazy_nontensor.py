"""What ``lazy.get(key)`` gives for a non-tensor key: a NonTensorStack of the members'
values whose in-place writes reach the members, as in tensordict 0.15.3 (whose stack
holds the members' own NonTensorData objects).

The stack holds its own copy of the values (as every NonTensorStack does); a write into
it (``update_``, ``stack[i] = v``, a write into a plain row of it) is first written into
the members it was read from (the objects: a member inserted into the lazy stack later
takes none of it) -- the elements written only, so an element a member took since
(another process's write into a shared member) is kept; every member checked before the
first is written, a memory-mapped member's files and a shared member's cell included --
and then into the stack's own values, so a failure changes nothing. A write made into
the lazy stack afterwards is not seen by an earlier ``get`` (read it again).

Its ``is_shared()``, ``is_memmap()`` and ``is_locked`` are the members' entries' (all of
them): so, as for a shared or memory-mapped NonTensorStack, its rows hold copies and
refuse in-place writes, saying to write through the stack.

LazyWriteOps (lazy_writes.py) imports this module and gives ``written_through`` to the
class as ``_written_through``; this module imports lazy_writes inside a function only.
"""
from __future__ import annotations

from typing import Any, Iterator

import torch

from shared_td.containers.nontensor import NonTensorData, NonTensorStack
from shared_td.nontensor_values import same_value
from shared_td.tensorclass_protocol import unwrap_tensorclass


def written_through(lazy: Any, path: tuple, value: Any) -> Any:
    """``value`` (the stacked entry ``path`` of ``lazy``), linked to the members when it
    is a NonTensorStack; anything else as it is. The members are those of ``lazy`` now
    (the objects, as tensordict's stack holds them): a member inserted into or removed
    from ``lazy`` afterwards does not move a write to another member.

    Example:
        >>> lazy = shared_td.lazy_stack([TensorDict(text="a"), TensorDict(text="b")])
        >>> lazy.get("text")[1] = "B"
        >>> lazy.tensordicts[1]["text"]
        'B'
    """
    if not isinstance(value, NonTensorStack) or not lazy.tensordicts:
        return value
    # the flags from the members' own entries, not their get(): a lazy member would
    # stack (and link) its whole entry again for each level of nesting
    entries = list(_member_entries(lazy, path))
    value._is_shared = bool(entries) and all(entry.is_shared() for entry in entries)
    value._is_memmap = bool(entries) and all(entry.is_memmap() for entry in entries)
    value._is_locked = bool(entries) and all(entry.is_locked for entry in entries)
    members, dim, size = list(lazy.tensordicts), lazy._stack_dim, value.batch_size
    value._through_members = lambda payload, touched: _write_members(members, dim, path, size, payload, touched)
    return value


def through_nested_lazy(node: Any, path: tuple, value: Any) -> Any:
    """``value``, the entry ``path`` that ``node.get(path)`` found (``node``: a plain
    tensordict), linked as ``written_through`` links it when the path goes through a
    lazy stack (``td.get(("lazy", "text"))`` writes into the stack's members, as
    ``td["lazy"].get("text")`` does); else ``value`` as it is.

    Example:
        >>> td = TensorDict(lazy=shared_td.lazy_stack([TensorDict(text="a"), TensorDict(text="b")]))
        >>> td.get(("lazy", "text"))[1] = "B"
        >>> td["lazy"].tensordicts[1]["text"]
        'B'
    """
    if not isinstance(value, NonTensorStack):
        return value
    for depth in range(1, len(path)):
        inner = unwrap_tensorclass(node._get_path(path[:depth], None))
        if hasattr(inner, "_written_through"):  # the first lazy stack on the path
            return written_through(inner, path[depth:], value)
    return value


def _member_entries(node: Any, path: tuple) -> Iterator[Any]:
    """The non-tensor entries ``path`` of the plain tensordicts below ``node`` (a lazy
    stack, or a tensordict whose path may go through one), unstacked."""
    node = unwrap_tensorclass(node)
    for depth in range(len(path)):
        inner = node if depth == 0 else unwrap_tensorclass(node._get_path(path[:depth], None))
        if hasattr(inner, "_written_through"):  # a lazy stack
            for member in inner.tensordicts:
                yield from _member_entries(member, path[depth:])
            return
        if inner is None:
            break
    entry = node._get_path(path, None)
    if entry is not None:
        yield entry


def _write_members(members: list, dim: int, path: tuple, size: torch.Size, payload: list,
                   touched: list | None) -> None:
    """Write the flat values ``payload`` (of a stack of batch size ``size``, stacked
    along ``dim`` from ``members``) at the flat positions ``touched`` (None: all) into
    the entry ``path`` of the members holding them, every member checked before the
    first is written. Only those elements are written: the others keep what the member
    holds now (another process may have written them since the stack was read). A
    member written whole takes its part as ``member.update_`` (a part whose values are
    all equal is one value: a NonTensorData entry, memory-mapped or shared, stays one);
    a member written in part takes the elements as ``member.set_at_`` writes them (a
    NonTensorData entry in memory becomes a NonTensorStack; a memory-mapped or shared
    one refuses values that differ from the one it holds)."""
    from shared_td.containers.index_writes import plan_set_at
    from shared_td.containers.lazy_writes import check_write  # (lazy_writes imports this module)

    if not payload or not size[dim]:
        return
    parts = torch.arange(len(payload)).reshape(size).unbind(dim)  # each member's flat positions
    chosen = set(range(len(payload)) if touched is None else touched)
    whole, writes = [], []
    for member, part in zip(members, parts):
        positions = part.reshape(-1).tolist()
        local = [j for j, p in enumerate(positions) if p in chosen]  # (C order: a mask keeps it)
        if not local:
            continue
        values = [payload[positions[j]] for j in local]
        if len(local) < len(positions):
            mask = torch.zeros(part.numel(), dtype=torch.bool)
            mask[local] = True
            source = NonTensorStack._from_flat(values, torch.Size([len(local)]))
            plan_set_at(unwrap_tensorclass(member), path, source, mask.reshape(part.shape), writes)  # (checks)
        elif all(same_value(v, values[0]) for v in values):
            whole.append((member, {path: NonTensorData(values[0], batch_size=part.shape)}))
        else:
            whole.append((member, {path: NonTensorStack._from_flat(values, part.shape)}))
    for member, source in whole:  # all checked (locks, files, shared cells) before the first write
        check_write(member, source, inplace=True, add_missing=False)
    for member, source in whole:
        member.update_(source)
    for write in writes:
        write()
