"""The object returned by ``td.keys()``: iterable, sized, and ``in`` understands nested keys."""
from __future__ import annotations

from typing import Any, Iterator

import torch

from shared_td.keys import is_nested_key, unravel_key
from shared_td.tensorclass_protocol import unwrap_tensorclass


#: what KeysView.pairs gives for a value that only ``get(key)`` can give
UNSEEN = object()


def _first(pair: tuple) -> Any:
    return pair[0]


class KeysView:
    """A live view of the keys of a tensordict.

    Examples:
        >>> td = TensorDict(a=torch.zeros(()), b={"c": torch.zeros(())})
        >>> ("b", "c") in td.keys(include_nested=True)
        True
    """

    def __init__(self, td: Any, include_nested: bool, leaves_only: bool, sort: bool, is_leaf=None):
        self._td = td
        self._is_leaf = is_leaf
        self._include_nested = include_nested
        self._leaves_only = leaves_only
        self._sort = sort

    def __iter__(self) -> Iterator:
        return map(_first, self.pairs())

    def pairs(self) -> Iterator[tuple]:
        """``(key, value)`` in this view's order, the value as the walk found it, or
        UNSEEN where only ``get(key)`` gives it (below a lazy stack, whose walk peeks at
        its members): values() and items() need no second walk from the root per key."""
        pairs = self._walk(self._td, (), True)
        if self._sort:
            pairs = iter(sorted(pairs, key=lambda pair: (pair[0],) if isinstance(pair[0], str) else pair[0]))
        return pairs

    def _walk(self, td: Any, prefix: tuple, exact: bool) -> Iterator:
        from shared_td.containers.base import default_is_leaf, is_non_tensor, is_tensor_collection

        is_leaf = self._is_leaf or default_is_leaf
        # a tensor is a leaf of the default is_leaf: said without a call per tensor (the
        # walk of a 1000-node tree spent a third of its time asking)
        tensors_are_leaves = self._is_leaf is None
        # A lazy stack peeks at its members instead of stacking every value: what its
        # walk finds (and all below it) is not what get() gives
        peek = getattr(td, "_peek_str", None)
        exact = exact and peek is None
        for key in td._keys_str():
            value = td._get_str(key, None) if peek is None else peek(key, None)
            if tensors_are_leaves and isinstance(value, torch.Tensor):
                yield (prefix + (key,) if prefix else key), (value if exact else UNSEEN)
                continue
            full = prefix + (key,)
            leaf = is_leaf(type(value))
            if leaf or not self._leaves_only:
                yield (full[0] if len(full) == 1 else full), (value if exact else UNSEEN)
            # non-tensor containers have no keys to walk into
            if not leaf and self._include_nested and is_tensor_collection(value) and not is_non_tensor(value):
                inner = unwrap_tensorclass(value)
                yield from self._walk(inner, full, exact)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __contains__(self, key: Any) -> bool:
        if not is_nested_key(key):
            return False
        path = unravel_key(key)
        if len(path) > 1 and not self._include_nested:
            return False
        wanted = path[0] if len(path) == 1 else path
        return any(k == wanted for k in self)

    def __repr__(self) -> str:
        return f"_TensorDictKeysView({list(self)}, include_nested={self._include_nested}, leaves_only={self._leaves_only})"
