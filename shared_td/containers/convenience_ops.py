"""Small operations of every tensordict class that ported code uses every day:
``detach``, ``update_at_``, ``to_tensordict``, ``copy``, ``get_at``, ``set_at_``,
``setdefault``, ``sorted_keys`` and the ``TensorDict.lazy_stack`` classmethod (tensordict
0.15.3's names and signatures)."""
from __future__ import annotations

from typing import Any, Sequence

from shared_td.keys import NestedKey, unravel_key
from shared_td.tensorclass_protocol import unwrap_tensorclass

#: what a lookup of a key that is not there reads
_ABSENT = object()


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

        An index with an Ellipsis before its last part, or with more parts than batch
        dims, is read as tensordict 0.15.3 reads it (``set_at_`` key by key): on each
        tensor entry's own dims, so ``update_at_({"a": v}, (..., 0))`` writes
        ``td["a"][..., 0]`` (a tensordict given as a value is indexed on its batch dims);
        on a lazy stack too, the selected elements written into its members.
        A source that does not fit so, such as one shaped as the rows ``td[..., 0]``
        (which tensordict refuses), is written into those rows, as ``td[idx] = source``.

        Example:
            >>> td = TensorDict(a=torch.zeros(3, 4, 5), batch_size=[3, 4])
            >>> td.update_at_({"a": torch.ones(3, 4)}, (..., 0))["a"][..., 0].sum().item()
            12.0
            >>> td.update_at_({"a": torch.full((3, 5), 2.0)}, (..., 1))["a"][:, 1].sum().item()
            30.0

        Raises:
            KeyError: naming the key, if the source has a key that self lacks.
        """
        from shared_td.containers import index_writes
        from shared_td.containers.base import TensorDictBase, is_leaf_nontensor
        from shared_td.containers.lazy import LazyStackedTensorDict
        from shared_td.containers.tensordict import TensorDict

        target = self if isinstance(self, TensorDictBase) else self._tensordict  # a tensorclass's
        source = input_dict_or_td
        dense_or_lazy = isinstance(target, (TensorDict, LazyStackedTensorDict))
        if dense_or_lazy and index_writes.reads_entry_dims(idx, target.batch_size):
            # tensordict 0.15.3 writes key by key as set_at_, the index read on each
            # entry's dims: mirrored where its writes fit (see entry_index_writes)
            batch_paths = index_writes.tensordict_values(unwrap_tensorclass(source))
        else:
            batch_paths = None
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
        writes = None if batch_paths is None else index_writes.entry_index_writes(target, source, idx, batch_paths)
        if writes is None:  # (a source shaped as the rows td[idx], which tensordict refuses, too)
            target._set_at_index(idx, source)
        else:
            for write in writes:
                write()
        return self

    def to_tensordict(self, *, retain_none: bool | None = None) -> Any:
        """A plain TensorDict copy of the tree, as tensordict 0.15.3's: every tensor
        cloned into regular memory (memory-mapped and shared ones too), nested
        tensorclasses and lazy stacks as TensorDicts, non-tensor entries as new ones
        holding the same values, nothing locked. ``retain_none`` is accepted for
        compatibility, and ignored (no entry holds None here).

        Example:
            >>> import torch
            >>> from shared_td import TensorDict
            >>> td = TensorDict(a=torch.zeros(2), b={"c": torch.ones(2)}, batch_size=[2]).memmap_()
            >>> plain = td.to_tensordict()
            >>> plain.is_locked, type(plain["a"]).__name__, plain["a"].data_ptr() != td["a"].data_ptr()
            (False, 'Tensor', True)
        """
        from shared_td.containers.base import is_non_tensor, is_tensor_collection
        from shared_td.containers.lazy import LazyStackedTensorDict
        from shared_td.containers.tensordict import TensorDict

        node = unwrap_tensorclass(self)
        if is_non_tensor(node):
            return node.clone()
        if isinstance(node, LazyStackedTensorDict):
            node = node.contiguous()  # dense (its nested tensorclasses are converted below)
        entries = {key: value.to_tensordict() if is_tensor_collection(value) and not is_non_tensor(value)
                   else value.clone() for key, value in node.items()}
        return TensorDict(entries, batch_size=node.batch_size, device=node.device, names=node.names)

    def copy(self) -> Any:
        """A shallow copy: ``clone(recurse=False)`` (the tree's structure is new, the
        tensors are the same)."""
        return self.clone(recurse=False)

    def get_at(self, key: NestedKey, index: Any, default: Any = _ABSENT) -> Any:
        """``self.get(key)[index]``, or ``default`` when the key is missing (without a
        default, the KeyError of ``get``)."""
        value = self.get(key) if default is _ABSENT else self.get(key, _ABSENT)
        return default if value is _ABSENT else value[index]

    def set_at_(self, key: NestedKey, value: Any, index: Any, *, non_blocking: bool = False) -> Any:
        """Write ``value`` at batch index ``index`` of the existing entry ``key``, in place
        (allowed when locked); returns self. ``non_blocking`` is accepted for
        compatibility, and ignored (the write is done on return).

        Raises:
            KeyError: naming the key, when it is missing.
        """
        entry = self.get(key)
        try:
            if getattr(entry, "_is_non_tensor", False) and hasattr(entry, "_set_at"):
                # a NonTensorData holds one value for the batch: written at some rows it
                # becomes a NonTensorStack, which replaces the entry (as tensordict)
                from shared_td.containers import batch as batch_ops  # (same layer)

                path = unravel_key(key)
                parent = unwrap_tensorclass(self.get(path[:-1]) if len(path) > 1 else self)
                rows = batch_ops.index_and_size(index, entry.batch_size)[0]
                parent._tensordict[path[-1]] = entry._set_at(rows, value)
            else:  # (below a lazy stack, entry is a new stacked tensor: written through the stack)
                from shared_td.containers.index_writes import leaf_write

                leaf_write(unwrap_tensorclass(self), unravel_key(key), entry, value, index)()
        except (RuntimeError, IndexError, TypeError) as err:
            raise type(err)(f"set_at_({key!r}, ..., {index!r}): {err}") from err
        return self

    def setdefault(self, key: NestedKey, default: Any, inplace: bool = False) -> Any:
        """The entry at ``key``; when it is missing, ``default`` is set there first (as
        ``set(key, default, inplace=inplace)``)."""
        if self.get(key, _ABSENT) is _ABSENT:
            self.set(key, default, inplace=inplace)
        return self.get(key)

    @property
    def sorted_keys(self) -> list[str]:
        """The keys of this level, sorted."""
        return sorted(self.keys())

    @classmethod
    def lazy_stack(cls, input: Sequence[Any], dim: int = 0, *, out: Any = None, **kwargs: Any) -> Any:
        """``TensorDict.lazy_stack(tds, dim)``: the same as ``shared_td.lazy_stack``."""
        from shared_td.containers.lazy import LazyStackedTensorDict

        return LazyStackedTensorDict.lazy_stack(input, dim, out=out, **kwargs)
