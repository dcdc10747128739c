"""Comparisons of tensordicts (``==``, ``<``, ...), ``all()``, ``any()`` and ``is_empty()``:
the mixin ComparisonOps of TensorDictBase."""
from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch

from shared_td.tensorclass_protocol import unwrap_tensorclass

if TYPE_CHECKING:  # (base imports this module)
    from shared_td.containers.base import TensorDictBase


class ComparisonOps:
    """Element-wise comparisons over the leaves, and the truth of a whole tree."""

    def _compare(self, other: Any, op: Callable) -> "TensorDictBase":
        from shared_td.containers.base import TensorDictBase, is_leaf_nontensor

        if isinstance(other, dict):
            other = type(self)(other, batch_size=self.batch_size)
        other = unwrap_tensorclass(other)  # td == tc compares entry by entry, as tc == td
        if isinstance(other, TensorDictBase):
            missing = set(self.keys(True, True, is_leaf_nontensor)) ^ set(other.keys(True, True, is_leaf_nontensor))
            if missing:
                raise KeyError(f"Cannot compare tensordicts with different keys: {sorted(map(str, missing))}.")
            return self._map_leaves(lambda key, value: op(value, other.get(key)))
        return self._map_leaves(lambda key, value: op(value, other))

    # Comparisons map over the leaves, as tensordict 0.15.3: tensors compare with torch's
    # operator; a non-tensor entry compares its values with the same entry of another
    # tensordict (== and !=), and is ignored otherwise (see _equal and _ordered), so
    # ``(td == 0).all()`` looks at the tensors only.
    def __eq__(self, other: Any) -> "TensorDictBase":  # type: ignore[override]
        return self._compare(other, _equal)

    def __ne__(self, other: Any) -> "TensorDictBase":  # type: ignore[override]
        return self._compare(other, _not_equal)

    def __lt__(self, other: Any) -> "TensorDictBase":
        return self._compare(other, _ordered(operator.lt))

    def __le__(self, other: Any) -> "TensorDictBase":
        return self._compare(other, _ordered(operator.le))

    def __gt__(self, other: Any) -> "TensorDictBase":
        return self._compare(other, _ordered(operator.gt))

    def __ge__(self, other: Any) -> "TensorDictBase":
        return self._compare(other, _ordered(operator.ge))

    __hash__ = None  # type: ignore[assignment]

    def all(self) -> bool:
        """True if every element of every leaf is true."""
        return all(bool(v.all()) for v in self._leaf_tensors())

    def any(self) -> bool:
        """True if some element of some leaf is true."""
        return any(bool(v.any()) for v in self._leaf_tensors())

    def _leaf_tensors(self) -> Iterator[torch.Tensor]:
        for value in self.values(include_nested=True, leaves_only=True):
            if isinstance(value, torch.Tensor):
                yield value

    def is_empty(self) -> bool:
        """True if the tensordict holds no leaf (tensor or non-tensor) at any depth."""
        from shared_td.containers.base import is_leaf_nontensor

        return next(iter(self.keys(True, True, is_leaf_nontensor)), None) is None


def _equal(value: Any, other: Any) -> Any:
    from shared_td.containers.base import is_non_tensor

    if is_non_tensor(value):
        if is_non_tensor(other):  # the same entry of another tensordict
            return value._compare_data(other)
        return _ignored(value)  # a scalar or tensor compares with the tensors only
    return value == other


def _not_equal(value: Any, other: Any) -> Any:
    result = _equal(value, other)
    return ~result if isinstance(result, torch.Tensor) else result


def _ordered(op: Callable) -> Callable:
    """``<``, ``<=``, ``>``, ``>=`` on one leaf: non-tensor entries are kept as they
    are (not compared), as tensordict does."""
    from shared_td.containers.base import is_non_tensor

    return lambda value, other: value if is_non_tensor(value) else op(value, other)


def _ignored(value: Any) -> "TensorDictBase":
    """What ``td == 0`` holds at a non-tensor entry: an empty tensordict of the entry's
    batch size (as tensordict), which ``all()`` and ``any()`` skip."""
    from shared_td.containers.tensordict import TensorDict

    return TensorDict._new_unsafe({}, value.batch_size, value.device)
