"""tensordict 0.15.3's keywords of ``update`` beyond the entries to write: entries given
as keywords (``td.update(a=x)``), ``ignore_lock`` (deprecated there: it warns and does
not lift the lock) and the option shared_td does not build (``is_leaf``), which raises
a TypeError naming it.
"""
from __future__ import annotations

import warnings
from typing import Any

from shared_td.containers.unsupported_options import refuse_options
from shared_td.tensorclass_protocol import unwrap_tensorclass
from shared_td.containers.value_kinds import is_non_tensor, is_tensor_collection

__all__ = ["update_source"]

_NOT_BUILT = ("is_leaf",)


def update_source(td: Any, other: Any, entries: dict, ignore_lock: bool) -> Any:
    """What ``td.update(other, **entries)`` writes: ``other``, with the keyword
    ``entries`` as top-level entries that win over ``other``'s of the same key. As in
    tensordict 0.15.3, a tensordict ``other`` is written first and the keywords after
    it: a nested dict or tensordict of both is merged (the keywords' leaves win); a dict
    ``other`` is updated by the keywords (its entry of the same key replaced).

    Example:
        >>> td = TensorDict(a=torch.zeros(2), batch_size=[2])
        >>> sorted(dict(update_source(td, {"a": 1, "b": 2}, {"a": 3}, False)).items())
        [('a', 3), ('b', 2)]
        >>> other = TensorDict(n={"q": 1}, batch_size=[])
        >>> sorted(update_source(td, other, {"n": {"r": 2}}, False)["n"].keys())
        ['q', 'r']
    """
    other = unwrap_tensorclass(other)  # (a tensorclass was iterated as rows: TypeError)
    for name in _NOT_BUILT:
        if name in entries:
            value = entries.pop(name)
            if value is not None and value is not False:  # (their "off" values change nothing)
                refuse_options(td, "update", {name: value}, known=_NOT_BUILT)
    if ignore_lock:  # tensordict's words, so that code written for it reads the same
        warnings.warn("update(ignore_lock=True) is deprecated and will be removed in TensorDict 0.17. "
                      "Use 'with td.unlock_(): td.update(...)' instead.", DeprecationWarning, stacklevel=3)
    if not entries:
        return {} if other is None else other
    if other is None:
        return list(entries.items())
    if isinstance(other, dict) or not _branch(other):
        return [(k, v) for k, v in other.items() if k not in entries] + list(entries.items())
    # a shallow copy of other (its batch size, names, a lazy stack's members and their own
    # keys kept: a dict of its items lost them, audit 21) with the keywords written over it
    merged = other.copy()
    for key, value in entries.items():
        _write_over(merged, key, value)
    return merged


def _branch(value: Any) -> bool:
    return isinstance(value, dict) or (is_tensor_collection(value) and not is_non_tensor(value))


def _write_over(node: Any, key: str, value: Any) -> None:
    """Set ``key`` of ``node`` (a copy, see update_source) to ``value`` as ``update``
    writes it: a nested tensordict of both is merged key by key, in a copy of the nested
    one (so that neither input changes)."""
    current = node.get(key, None) if key in node.keys() else None
    if current is not None and _branch(value) and is_tensor_collection(current) and not is_non_tensor(current):
        current = unwrap_tensorclass(current).copy()
        for nested, item in value.items():
            _write_over(current, nested, item)
        value = current
    node.set(key, value)
