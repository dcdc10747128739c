"""tensordict 0.15.3's keywords of ``update`` beyond the entries to write: entries given
as keywords (``td.update(a=x)``), ``ignore_lock`` (deprecated there: it warns and does
not lift the lock) and the options shared_td does not build (``is_leaf``,
``update_batch_size``), which raise a TypeError naming them.
"""
from __future__ import annotations

import warnings
from typing import Any

from shared_td.containers.unsupported_options import refuse_options
from shared_td.containers.value_kinds import is_non_tensor, is_tensor_collection

__all__ = ["update_source"]

_NOT_BUILT = ("is_leaf", "update_batch_size")


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
        >>> sorted(dict(update_source(td, other, {"n": {"r": 2}}, False))["n"])
        ['q', 'r']
    """
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
    merged = dict(other.items())
    for key, value in entries.items():
        merged[key] = _merged(merged[key], value) if key in merged else value
    return list(merged.items())


def _branch(value: Any) -> bool:
    return isinstance(value, dict) or (is_tensor_collection(value) and not is_non_tensor(value))


def _merged(first: Any, second: Any) -> Any:
    """``second`` written over ``first`` as ``update`` writes it: nested dicts and
    tensordicts key by key (a plain dict of both, so that neither is changed)."""
    if not (_branch(first) and _branch(second)):
        return second
    merged = dict(first.items())
    for key, value in second.items():
        merged[key] = _merged(merged[key], value) if key in merged else value
    return merged
