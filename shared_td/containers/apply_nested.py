"""``apply(fn, call_on_nested=True)`` (and ``named_apply``'s), tensordict 0.15.3's option:
``fn`` is called on each top-level entry of the tensordict -- a tensor, a nested
tensordict or tensorclass, a non-tensor entry -- and goes into the nested ones itself.
"""
from __future__ import annotations

from typing import Any, Callable

from shared_td.containers.value_kinds import is_tensor_collection
from shared_td.keys import RAISE

__all__ = ["nested_calls"]


def nested_calls(td: Any, fn: Callable, others: tuple, default: Any, batch_size: Any, device: Any) -> Any:
    """A new tensordict with ``fn(key, entry, *others_entries)`` for each top-level
    entry of ``td`` (a None result leaves the key out); ``default`` is given for an
    entry that one of ``others`` lacks (else that raises KeyError).

    Example:
        >>> from shared_td.containers.base import NO_DEFAULT
        >>> td = TensorDict(a=torch.zeros(2), n={"b": torch.ones(2)}, batch_size=[2])
        >>> seen = []
        >>> _ = nested_calls(td, lambda key, value: seen.append((key, type(value).__name__)), (),
        ...                  NO_DEFAULT, None, NO_DEFAULT)
        >>> seen
        [('a', 'Tensor'), ('n', 'TensorDict')]
    """
    from shared_td.containers.base import NO_DEFAULT  # (base imports the mixins that import this)

    kwargs = {} if batch_size is None else {"batch_size": batch_size}
    if device is not NO_DEFAULT:
        kwargs["device"] = device
    out = td.empty(**kwargs)
    for key in list(td.keys()):
        value = td._tensordict[key]
        if default is NO_DEFAULT:
            other_values = [other.get(key, RAISE) for other in others]
        else:
            other_values = [other.get(key, default) if is_tensor_collection(other) else other
                            for other in others]
        result = fn(key, value, *other_values)  # (a top-level key is a string, nested_keys or not)
        if result is not None:
            out.set(key, result)
    return out
