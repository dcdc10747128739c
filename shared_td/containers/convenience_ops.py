"""Small operations of every tensordict class that ported code uses every day:
``detach``, ``update_at_`` and the ``TensorDict.lazy_stack`` classmethod (tensordict
0.15.3's names and signatures)."""
from __future__ import annotations

from typing import Any, Sequence

from shared_td.keys import NestedKey, unravel_key


class ConvenienceOps:
    """Mixin of TensorDictBase, whose methods tensorclasses get too (it relies on
    ``apply``, ``lock_``, ``_set_at_index`` and ``_get_path``)."""

    def detach(self) -> Any:
        """A tensordict of the tensors detached from the autograd graph (sharing their
        storage, as ``torch.Tensor.detach``); non-tensors are kept, a locked tensordict
        gives a locked one."""
        out = self.apply(lambda tensor: tensor.detach())
        return out.lock_() if self.is_locked else out

    def update_at_(self, input_dict_or_td: Any, idx: Any, clone: bool = False, *,
                   non_blocking: bool = False, keys_to_update: Sequence[NestedKey] | None = None) -> Any:
        """Write the entries of ``input_dict_or_td`` at batch index ``idx`` of the
        existing entries, in place (allowed when locked); returns self.

        ``keys_to_update`` restricts the write to those keys; ``clone=True`` copies the
        source first. Everything is checked before the first byte is written.

        Raises:
            KeyError: naming the key, if the source has a key that self lacks.
        """
        from shared_td.containers.base import TensorDictBase, is_leaf_nontensor
        from shared_td.containers.tensordict import TensorDict

        target = self if isinstance(self, TensorDictBase) else self._tensordict  # a tensorclass's
        source = input_dict_or_td
        if isinstance(source, dict):
            source = TensorDict(source, batch_size=[])
        elif not isinstance(source, TensorDictBase):  # a tensorclass
            source = source._tensordict
        if keys_to_update is not None:
            source = source.select(*keys_to_update, strict=False)
        for key in source.keys(True, True, is_leaf_nontensor):
            if target._get_path(unravel_key(key), None) is None:
                raise KeyError(
                    f"update_at_() writes into existing entries, but key {key!r} does not "
                    f"exist in {type(self).__name__}; add it with set() first."
                )
        if clone:
            source = source.clone()
        target._set_at_index(idx, source)
        return self

    @classmethod
    def lazy_stack(cls, input: Sequence[Any], dim: int = 0, *, out: Any = None, **kwargs: Any) -> Any:
        """``TensorDict.lazy_stack(tds, dim)``: the same as ``shared_td.lazy_stack``."""
        from shared_td.containers.lazy import LazyStackedTensorDict

        return LazyStackedTensorDict.lazy_stack(input, dim, out=out)
