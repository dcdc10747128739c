"""``apply``, ``named_apply`` and ``_map_leaves`` of a TensorDict: a function on every
leaf, into a new TensorDict of the same structure (or in place). A mixin of TensorDict
(tensordict.py), which gives ``_tensordict``, ``_batch_size``, ``_device``, ``names``
and ``_new_unsafe``.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from shared_td.containers import batch as batch_ops
from shared_td.containers.apply_nested import nested_calls
from shared_td.containers.base import NO_DEFAULT, TensorDictBase, is_non_tensor, is_tensor_collection, parse_device
from shared_td.containers.comparisons import part_of
from shared_td.containers.nontensor import NonTensorStack
from shared_td.containers.unsupported_options import refuse_options
from shared_td.errors import BatchSizeMismatchError
from shared_td.keys import NestedKey, RAISE
from shared_td.tensorclass_protocol import is_tensorclass, unwrap_tensorclass


# apply's keywords (named_apply's but nested_keys), and tensordict's that are not built here
_APPLY_OPTIONS = frozenset(("batch_size", "names", "inplace", "device", "default", "filter_empty",
                            "call_on_nested", "out", "propagate_lock"))
_NOT_BUILT = ("is_leaf",)


class LeafMapping:
    """Mixin of TensorDict: functions mapped over its leaves."""

    def _map_leaves(self, fn: Callable[[NestedKey, Any, Any], Any], prefix: tuple = (), other: Any = None) -> Any:
        """Same structure, ``fn(key, leaf, theirs)`` on tensor and non-tensor leaves,
        ``theirs`` being the part of ``other`` at that leaf (see :func:`part_of`): a
        comparison's result, a TensorDict for a subclass of one too (as in tensordict
        0.15.3). A nested collection maps its own leaves (a lazy stack member by member)."""
        from shared_td.containers.tensordict import TensorDict  # (it imports this module)

        entries = {}
        for key, value in self._tensordict.items():
            path, theirs = prefix + (key,), part_of(other, key, value)
            if is_tensor_collection(value) and not is_non_tensor(value):
                mapped = unwrap_tensorclass(value)._map_leaves(fn, path, theirs)
                # a nested tensorclass stays one, as in tensordict: (a == b).obs.x
                entries[key] = type(value)._from_tensordict(mapped) if is_tensorclass(value) else mapped
            else:
                entries[key] = fn(path if len(path) > 1 else key, value, theirs)
        return TensorDict._new_unsafe(entries, self._batch_size, self._device, self.names)

    def apply(self, fn: Callable, *others: TensorDictBase, **options: Any) -> Any:
        """Apply ``fn`` to every tensor leaf and return the results as a new TensorDict.

        ``fn`` receives the leaf (and the same key of each of ``others``); a None
        result drops the key. Non-tensor entries are new ones holding the same values
        (as ``clone()``: a plain copy of a shared or memory-mapped one), so a write into
        the result never reaches self. The keywords are those of :meth:`named_apply`,
        which are tensordict 0.15.3's: ``batch_size``, ``names``, ``device``,
        ``inplace=True`` (writes the results into self instead), ``default``,
        ``filter_empty``, ``call_on_nested``, ``out`` and ``propagate_lock``
        (``is_leaf`` is not supported: a TypeError says so).

        Examples:
            >>> td = TensorDict(a=torch.ones(2), b={"c": torch.arange(2)}, batch_size=[2])
            >>> doubled = td.apply(lambda x: x * 2)
            >>> doubled["a"].tolist(), doubled["b", "c"].tolist()
            ([2.0, 2.0], [0, 2])
            >>> td["task"] = "walk"
            >>> out = td.apply(lambda x: x + 1)
            >>> out.get("task") is td.get("task"), out["task"]
            (False, 'walk')
            >>> td.apply(lambda x, y: x + y, TensorDict(a=torch.ones(2), batch_size=[2]), default=10)["b", "c"].tolist()
            [10, 11]
        """
        # refused here, not by named_apply, so that the error names apply
        refuse_options(self, "apply", {k: v for k, v in options.items() if k not in _APPLY_OPTIONS},
                       known=_NOT_BUILT)
        return self.named_apply(lambda key, *values: fn(*values), *others, **options)

    def named_apply(
        self,
        fn: Callable,
        *others: TensorDictBase,
        nested_keys: bool = False,
        batch_size: Any = None,
        names: Any = NO_DEFAULT,
        inplace: bool = False,
        device: Any = NO_DEFAULT,
        default: Any = NO_DEFAULT,
        filter_empty: bool | None = None,
        call_on_nested: bool = False,
        out: Any = None,
        propagate_lock: bool = False,
        _prefix: tuple | None = None,
        **unsupported: Any,
    ) -> Any:
        """Like ``apply``, but ``fn(key, leaf, *others_leaves)`` also gets the key.

        The key is the leaf's own name, or its full nested tuple if ``nested_keys``.
        The keywords are tensordict 0.15.3's:

        - ``default``: given to ``fn`` for an entry that one of ``others`` lacks (a
          nested tensordict that one lacks gives ``default`` for each of its leaves);
          without it, a missing entry raises KeyError.
        - ``filter_empty``: True leaves out the nested tensordicts with no entry in the
          result, False keeps them; None (the default) leaves out those that ``fn``
          emptied and keeps those that were empty already. The result is None when
          ``fn`` returned None for every leaf (and ``filter_empty`` is not False).
        - ``call_on_nested=True``: ``fn`` is called on each top-level entry (nested
          tensordicts and non-tensor entries included) and goes into them itself.
        - ``out``: a tensordict the results are written into (as ``out.update``),
          returned instead of a new one.
        - ``propagate_lock=True``: the result of a locked tensordict is locked.

        ``is_leaf`` and other keywords of tensordict's raise a TypeError naming them.

        Example:
            >>> td = TensorDict(a=torch.ones(2), n={"b": torch.zeros(2, 3)}, batch_size=[2])
            >>> sorted(td.named_apply(lambda key, x: x if key == "a" else None).keys())
            ['a']
            >>> td.named_apply(lambda key, x: x, call_on_nested=True)["n", "b"].shape
            torch.Size([2, 3])
        """
        refuse_options(self, "named_apply", unsupported, known=_NOT_BUILT)
        if call_on_nested:
            result = nested_calls(self, fn, others, default, batch_size, device)
        else:
            # (in place too: every result is made and checked before the first is written)
            result = self._named_apply(fn, others, nested_keys, batch_size, names, device,
                                       default, filter_empty, _prefix or ())
            if result is None and _prefix is not None:
                # a lazy stack's member (lazy_shape.named_apply passes its _prefix): the
                # stack is restacked from its members' results, which must be tensordicts
                result = self._new_unsafe({}, self._batch_size, self._device, None)
        if inplace:
            # fn's results written into the entries, as tensordict 0.15.3 writes them (a
            # tensor copied in, a nested tensordict updated in place)
            write_results(self, result)
            return self
        if result is not None and propagate_lock and self.is_locked:
            result.lock_()
        if out is not None:
            return out if result is None else out.update(result)
        return result

    def _named_apply(self, fn: Callable, others: tuple, nested_keys: bool, batch_size: Any, names: Any,
                     device: Any, default: Any, filter_empty: bool | None, _prefix: tuple) -> Any:
        """named_apply's walk: the new TensorDict (None once emptied, see filter_empty)."""
        new_batch = self._batch_size if batch_size is None else batch_ops.as_batch_size(batch_size)
        entries = {}
        for key, value in self._tensordict.items():
            if default is NO_DEFAULT:
                other_values = [o.get(key, RAISE) for o in others]
            else:  # (an other that is not a tensordict is a default given for a whole subtree)
                other_values = [o.get(key, default) if is_tensor_collection(o) else o for o in others]
            tensor = isinstance(value, torch.Tensor)  # most entries: no class to ask about
            if not tensor and is_non_tensor(value):
                if filter_empty is not False and _holds_no_value(value):
                    continue  # (as tensordict's, whose NonTensorStack is a lazy stack of no member)
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
                if isinstance(inner, LeafMapping):
                    result = inner._named_apply(
                        fn, other_values, nested_keys, None if batch_size is None else new_batch, NO_DEFAULT,
                        device, default, filter_empty, _prefix + (key,),
                    )
                else:  # a lazy stack: its own named_apply, which hands default and filter_empty on
                    result = inner.named_apply(
                        fn, *other_values, nested_keys=nested_keys,
                        batch_size=None if batch_size is None else new_batch,
                        device=device, _prefix=_prefix + (key,),
                        _default=default, _filter_empty=filter_empty,
                    )
                if result is not None and inner is not value:
                    result = value._from_tensordict(result)
            else:
                result = fn(_prefix + (key,) if nested_keys and _prefix else key, value, *other_values)
                if isinstance(result, torch.Tensor) and result.shape[: len(new_batch)] != new_batch:
                    raise _misfit_result(_prefix + (key,), result, new_batch)
            if result is not None:
                entries[key] = result
        if not entries and filter_empty is not False and (filter_empty or self._tensordict):
            return None  # (emptied by fn, or empty and filter_empty=True: left out, as tensordict)
        out_names = self.names if names is NO_DEFAULT and new_batch == self._batch_size else (
            None if names is NO_DEFAULT else names
        )
        out = self._new_unsafe(
            entries, new_batch, self._device if device is NO_DEFAULT else parse_device(device), None
        )
        out.names = out_names
        return out


def _holds_no_value(entry: Any) -> bool:
    """True for a NonTensorStack with a 0 in its batch size, which ``apply`` leaves out
    unless ``filter_empty=False``, as tensordict 0.15.3 (a NonTensorData is kept)."""
    return isinstance(entry, NonTensorStack) and entry.batch_size.numel() == 0


def _misfit_result(path: tuple, result: torch.Tensor, batch_size: torch.Size) -> BatchSizeMismatchError:
    """The error of a result of ``fn`` whose shape does not start with the batch size
    (kept, it made an invalid tree; tensordict 0.15.3 raises too)."""
    key = path[0] if len(path) == 1 else path
    return BatchSizeMismatchError(
        f"batch dimension mismatch, got self.batch_size={batch_size!r} and value.shape={result.shape!r} "
        f"for key {key!r}: apply's function returned a tensor of shape {list(result.shape)}, which must "
        f"start with the batch size {list(batch_size)} (pass batch_size= to apply for another one)."
    )


def write_results(target: Any, results: Any) -> None:
    """``apply(..., inplace=True)``: the tensors of ``results`` (what ``target``'s apply
    made, which no one else holds; None: nothing) written into ``target``'s entries.
    ``update_`` checks every write before the first one (see updates.py), so a result
    that does not fit leaves ``target`` unchanged (before, the results were written key
    by key, and the keys before it stayed written)."""
    if results is not None:
        target.update_(_without_non_tensors(unwrap_tensorclass(results), target))


def _without_non_tensors(results: Any, source: Any) -> Any:
    """``results`` (a tensordict that ``source.apply`` just made, which no one else
    holds) without the non-tensor entries that ``apply`` passed through from ``source``
    (new ones holding the same values: ``fn`` never sees a non-tensor), removed in
    place: writing one back into itself would write a shared value over what another
    process may have written since. (A non-tensor that ``fn`` returned for a tensor
    leaf stays, and ``update_`` refuses it.)"""
    from shared_td.containers.lazy import LazyStackedTensorDict  # (lazy.py imports this module)

    if isinstance(results, LazyStackedTensorDict):  # (made member by member from source's)
        for member, origin in zip(results.tensordicts, source.tensordicts):
            _without_non_tensors(unwrap_tensorclass(member), unwrap_tensorclass(origin))
        return results
    for key, value in list(results._items_str()):
        origin = source._get_str(key, None)
        if getattr(value, "_is_non_tensor", False) and getattr(origin, "_is_non_tensor", False):
            results._del_str(key)
        elif is_tensor_collection(value) and is_tensor_collection(origin):
            _without_non_tensors(unwrap_tensorclass(value), unwrap_tensorclass(origin))
    return results
