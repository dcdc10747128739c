"""What ``lazy.get(key)`` gives for a non-tensor key: a NonTensorStack of the members'
values whose in-place writes reach the members, as in tensordict 0.15.3 (whose stack
holds the members' own NonTensorData objects).

The stack holds its own copy of the values (as every NonTensorStack does); a write into
it (``update_``, ``stack[i] = v``, a write into a plain row of it) is first written into
the members it reaches, as ``member.update_`` writes them -- every member checked before
the first is written, a memory-mapped member's files and a shared member's cell
included -- and then into the stack's own values, so a failure changes nothing. A write
made into the lazy stack afterwards is not seen by an earlier ``get`` (read it again).

Its ``is_shared()``, ``is_memmap()`` and ``is_locked`` are the members' entries' (all of
them): so, as for a shared or memory-mapped NonTensorStack, its rows hold copies and
refuse in-place writes, saying to write through the stack.

LazyWriteOps (lazy_writes.py) imports this module and gives ``written_through`` to the
class as ``_written_through``; this module imports lazy_writes inside a function only.
"""
from __future__ import annotations

from typing import Any

import torch

from shared_td.containers.nontensor import NonTensorData, NonTensorStack
from shared_td.containers.nontensor_values import same_value


def written_through(lazy: Any, path: tuple, value: Any) -> Any:
    """``value`` (the stacked entry ``path`` of ``lazy``), linked to the members when it
    is a NonTensorStack; anything else as it is.

    Example:
        >>> lazy = shared_td.lazy_stack([TensorDict(text="a"), TensorDict(text="b")])
        >>> lazy.get("text")[1] = "B"
        >>> lazy.tensordicts[1]["text"]
        'B'
    """
    if not isinstance(value, NonTensorStack) or not lazy.tensordicts:
        return value
    entries = [member.get(path) for member in lazy.tensordicts]
    value._is_shared = all(entry.is_shared() for entry in entries)
    value._is_memmap = all(entry.is_memmap() for entry in entries)
    value._is_locked = all(entry.is_locked for entry in entries)
    size = value.batch_size
    value._through_members = lambda payload, touched: _write_members(lazy, path, size, payload, touched)
    return value


def _write_members(lazy: Any, path: tuple, size: torch.Size, payload: list, touched: list | None) -> None:
    """Write the flat values ``payload`` (of a stack of batch size ``size``) into the
    entry ``path`` of each member of ``lazy`` that holds one of the flat positions
    ``touched`` (None: all), as ``member.update_``: every member is checked before the
    first is written. A member's part whose values are all equal is one value (a
    NonTensorData entry, memory-mapped or shared, stays one); other parts are a
    NonTensorStack (which a NonTensorData entry refuses, as tensordict 0.15.3 does)."""
    from shared_td.containers.lazy_writes import check_write  # (lazy_writes imports this module)

    dim = lazy._stack_dim
    if not payload or not size[dim]:
        return
    member_of = torch.arange(size[dim]).reshape([-1 if d == dim else 1 for d in range(len(size))])
    member_of = member_of.expand(size).reshape(-1).tolist()
    chosen = sorted({member_of[p] for p in (range(len(payload)) if touched is None else touched)})
    parts = NonTensorStack._from_flat(payload, size).unbind(dim)
    writes = []
    for i in chosen:
        values = parts[i]._flat_values()
        if all(same_value(v, values[0]) for v in values):
            part = NonTensorData(values[0], batch_size=parts[i].batch_size)
        else:
            part = NonTensorStack._from_flat(values, parts[i].batch_size)
        writes.append((lazy.tensordicts[i], {path: part}))
    for member, source in writes:  # all checked (locks, files, shared cells) before the first write
        check_write(member, source, inplace=True, add_missing=False)
    for member, source in writes:
        member.update_(source)
