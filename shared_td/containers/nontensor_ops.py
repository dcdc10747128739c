"""The non-tensor API of every tensordict class (tensordict 0.15.3's names):
``set_non_tensor``, ``non_tensor_items``, ``filter_non_tensor_data``.

``get_non_tensor`` lives beside ``get`` in ``base``.
"""
from __future__ import annotations

from typing import Any, Iterator

from shared_td.keys import NestedKey


class NonTensorOps:
    """Mixin of TensorDictBase, whose methods tensorclasses get too (it relies on
    ``set``, ``items``, ``exclude``, ``batch_size`` and ``device``)."""

    def set_non_tensor(self, key: NestedKey, value: Any) -> Any:
        """Store ``value`` as a Python value (a NonTensorData), whatever its type: even
        a tensor or a number is kept as it is, not converted; returns self.

        Raises:
            LockedTensorDictError: when locked (as ``set``).
        """
        from shared_td.containers.nontensor import NonTensorData

        return self.set(key, NonTensorData(value, batch_size=self.batch_size, device=self.device))

    def non_tensor_items(self, include_nested: bool = False) -> Iterator[tuple[NestedKey, Any]]:
        """``(key, entry)`` of every NonTensorData and NonTensorStack entry (nested ones
        too, as tuple keys, with ``include_nested``); the entries, not their values."""
        from shared_td.containers.base import is_leaf_nontensor, is_non_tensor

        for key, value in self.items(include_nested, True, is_leaf_nontensor):
            if is_non_tensor(value):
                yield key, value

    def filter_non_tensor_data(self) -> Any:
        """A new tensordict without the non-tensor entries, at any depth (the nested
        tensordicts stay, even when they become empty); it shares the tensors."""
        return self.exclude(*[key for key, _ in self.non_tensor_items(include_nested=True)])
