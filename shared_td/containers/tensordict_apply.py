"""``apply``, ``named_apply`` and ``_map_leaves`` of a TensorDict: a function on every
leaf, into a new TensorDict of the same structure (or in place). A mixin of TensorDict
(tensordict.py), which gives ``_tensordict``, ``_batch_size``, ``_device``, ``names``
and ``_new_unsafe``.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from shared_td.containers import batch as batch_ops
from shared_td.containers.base import NO_DEFAULT, TensorDictBase, is_non_tensor, is_tensor_collection, parse_device
from shared_td.keys import NestedKey
from shared_td.tensorclass_protocol import is_tensorclass, unwrap_tensorclass


class LeafMapping:
    """Mixin of TensorDict: functions mapped over its leaves."""

    def _map_leaves(self, fn: Callable[[NestedKey, Any], Any], prefix: tuple = ()) -> Any:
        """Same structure, ``fn(key, leaf)`` on tensor and non-tensor leaves."""
        entries = {}
        for key, value in self._tensordict.items():
            path = prefix + (key,)
            if is_tensor_collection(value) and not is_non_tensor(value):
                mapped = unwrap_tensorclass(value)._map_leaves(fn, path)
                # a nested tensorclass stays one, as in tensordict: (a == b).obs.x
                entries[key] = type(value)._from_tensordict(mapped) if is_tensorclass(value) else mapped
            else:
                entries[key] = fn(path if len(path) > 1 else key, value)
        return self._new_unsafe(entries, self._batch_size, self._device, self.names)

    def apply(
        self,
        fn: Callable,
        *others: TensorDictBase,
        batch_size: Any = None,
        names: Any = NO_DEFAULT,
        inplace: bool = False,
        device: Any = NO_DEFAULT,
    ) -> Any:
        """Apply ``fn`` to every tensor leaf and return the results as a new TensorDict.

        ``fn`` receives the leaf (and the same key of each of ``others``); a None
        result drops the key. Non-tensor entries are new ones holding the same values
        (as ``clone()``: a plain copy of a shared or memory-mapped one), so a write into
        the result never reaches self. ``inplace=True`` writes the results into self
        instead.

        Examples:
            >>> td = TensorDict(a=torch.ones(2), b={"c": torch.arange(2)}, batch_size=[2])
            >>> doubled = td.apply(lambda x: x * 2)
            >>> doubled["a"].tolist(), doubled["b", "c"].tolist()
            ([2.0, 2.0], [0, 2])
            >>> td["task"] = "walk"
            >>> out = td.apply(lambda x: x + 1)
            >>> out.get("task") is td.get("task"), out["task"]
            (False, 'walk')
        """
        return self.named_apply(
            lambda key, *values: fn(*values), *others, batch_size=batch_size,
            names=names, inplace=inplace, device=device,
        )

    def named_apply(
        self,
        fn: Callable,
        *others: TensorDictBase,
        nested_keys: bool = False,
        batch_size: Any = None,
        names: Any = NO_DEFAULT,
        inplace: bool = False,
        device: Any = NO_DEFAULT,
        _prefix: tuple = (),
    ) -> Any:
        """Like ``apply``, but ``fn(key, leaf, *others_leaves)`` also gets the key.

        The key is the leaf's own name, or its full nested tuple if ``nested_keys``.
        """
        new_batch = self._batch_size if batch_size is None else batch_ops.as_batch_size(batch_size)
        entries = {}
        for key, value in self._tensordict.items():
            other_values = [o.get(key) for o in others]
            tensor = isinstance(value, torch.Tensor)  # most entries: no class to ask about
            if not tensor and is_non_tensor(value):
                if inplace:
                    continue  # (only tensors are written in place)
                # A new entry holding the same values (as clone()), as tensordict's: a
                # write into the result must not reach the source (nor, for a shared or
                # memory-mapped source, the other processes or its files), and the
                # README's ``td.apply(MemoryMappedTensor.from_tensor).lock_()`` must not
                # lock td's own entries.
                result = value.clone()
                if new_batch != self._batch_size:
                    result = result._with_batch_size(new_batch, key)
            elif not tensor and is_tensor_collection(value):
                inner = unwrap_tensorclass(value)
                result = inner.named_apply(
                    fn, *other_values, nested_keys=nested_keys,
                    batch_size=None if batch_size is None else new_batch,
                    inplace=inplace, device=device, _prefix=_prefix + (key,),
                )
                if inner is not value:
                    result = value._from_tensordict(result)
            else:
                result = fn(_prefix + (key,) if nested_keys and _prefix else key, value, *other_values)
            if result is not None:
                entries[key] = result
        if inplace:
            for key, result in entries.items():
                if isinstance(result, torch.Tensor):
                    self._tensordict[key].copy_(result)
            return self
        out_names = self.names if names is NO_DEFAULT and new_batch == self._batch_size else (
            None if names is NO_DEFAULT else names
        )
        out = self._new_unsafe(
            entries, new_batch, self._device if device is NO_DEFAULT else parse_device(device), None
        )
        out.names = out_names
        return out
