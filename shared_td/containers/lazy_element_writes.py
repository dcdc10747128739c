"""The element writes of ``lazy[index] = value`` for an index that spans a lazy stack's
stack dim, grouped into one write per member (see :func:`writes_per_member`)."""
from __future__ import annotations

import torch

__all__ = ["writes_per_member"]


def writes_per_member(targets: list, sources: list, stack: bool) -> tuple[list, list]:
    """The element writes ``(member, element index)`` <- source of an index that spans
    the stack dim, as one write per member: its elements' indices as index tensors, and
    their sources stacked. Written element by element, each write was planned from the
    member as it was, and a non-tensor entry, rebuilt whole by each one, kept only the
    last element's value (fuzzed upstream indexing tests: 2 of 4 rows). A member of no
    batch dim, or sources that do not stack (ragged), stay element by element. ``stack``:
    the sources are tensordicts (else one value, the same for every element)."""
    grouped: dict = {}
    for (member, sub), source in zip(targets, sources):
        grouped.setdefault(id(member), (member, [], []))
        grouped[id(member)][1].append(sub)
        grouped[id(member)][2].append(source)
    out_targets, out_sources = [], []
    for member, subs, parts in grouped.values():
        if len(subs) > 1 and subs[0]:
            index = tuple(torch.tensor(column) for column in zip(*subs))
            try:
                stacked = torch.stack(parts, 0) if stack else parts[0]
            except RuntimeError:  # (ragged sources)
                stacked = None
            if stacked is not None:
                out_targets.append((member, index))
                out_sources.append(stacked)
                continue
        out_targets += [(member, sub) for sub in subs]
        out_sources += parts
    return out_targets, out_sources
