"""``apply``, ``named_apply``, ``exclude`` and ``flatten_keys`` of a NonTensorData or
NonTensorStack, as tensordict 0.15.3 has them: a non-tensor container has no key and no
tensor leaf, so ``fn`` is never called and the result is a new container holding the
same values (as ``clone()``); ``inplace=True`` gives the container itself.
"""
from __future__ import annotations

from typing import Any, Callable

__all__ = ["NonTensorMaps"]


class NonTensorMaps:
    """Mixin of NonTensorBase: the key and leaf maps, which have nothing to map."""

    def apply(self, fn: Callable, *others: Any, inplace: bool = False, **kwargs: Any) -> Any:
        """A new container with the same values (``fn`` is not called: no tensor leaf).

        Example:
            >>> value = NonTensorData("walk", batch_size=[2])
            >>> out = value.apply(lambda x: x + 1)
            >>> out is value, out.data
            (False, 'walk')
        """
        return self if inplace else self.clone()

    def named_apply(self, fn: Callable, *others: Any, inplace: bool = False, **kwargs: Any) -> Any:
        """As :meth:`apply` (``fn`` is not called)."""
        return self if inplace else self.clone()

    def exclude(self, *keys: Any, inplace: bool = False) -> Any:
        """A new container with the same values (it has no key to exclude)."""
        return self if inplace else self.clone()

    def flatten_keys(self, separator: str = ".", inplace: bool = False, is_leaf: Any = None) -> Any:
        """A new container with the same values (it has no nested key)."""
        return self if inplace else self.clone()
