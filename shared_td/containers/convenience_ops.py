"""Small operations of every tensordict class that ported code uses every day:
``detach``, ``update_at_``, ``to_tensordict``, ``copy``, ``get_at``, ``set_at_``,
``setdefault``, ``sorted_keys``, ``clear``, ``popitem``, ``create_nested``, ``entry_class``,
``ndimension``, ``to_lazystack``, ``copy_at_`` and the ``TensorDict.lazy_stack`` classmethod
(tensordict 0.15.3's names and signatures)."""
from __future__ import annotations

from typing import Any, Sequence

from shared_td.containers.new_tensor import DATA_DEVICE, new_tensor, non_tensor_like
from shared_td.containers.value_kinds import is_leaf_nontensor, is_non_tensor, is_tensor_collection
from shared_td.errors import KeyThroughLeafError, KeyTypeError
from shared_td.keys import NestedKey, RAISE, unravel_key
from shared_td.tensorclass_protocol import unwrap_tensorclass

#: what a lookup of a key that is not there reads
_ABSENT = object()


class ConvenienceOps:
    """Mixin of TensorDictBase, whose methods tensorclasses get too (it relies on
    ``apply``, ``lock_``, ``_set_at_index`` and ``_get_path``)."""

    def detach(self) -> Any:
        """A tensordict of the tensors detached from the autograd graph (sharing their
        storage, as ``torch.Tensor.detach``); its non-tensor entries are new ones
        holding the same values (as ``apply``), a locked tensordict gives a locked one."""
        out = self.apply(lambda tensor: tensor.detach(), filter_empty=False)  # (all kept, as tensordict's)
        return out.lock_() if self.is_locked else out

    def detach_(self) -> Any:
        """Detach every tensor from the autograd graph in place
        (``torch.Tensor.detach_``), the members of lazy stacks too; returns self. A
        locked tensordict allows it (its leaves stay the same objects), as tensordict's.

        Example:
            >>> td = TensorDict(a=torch.ones(2, requires_grad=True) * 2, batch_size=[2])
            >>> td.detach_() is td, td["a"].requires_grad
            (True, False)
        """
        _detach_leaves(self)
        return self

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
        from shared_td.containers.base import TensorDictBase  # (base imports this module)
        from shared_td.containers.lazy import LazyStackedTensorDict
        from shared_td.containers.tensordict import TensorDict

        target = self if isinstance(self, TensorDictBase) else self._tensordict  # a tensorclass's
        source = input_dict_or_td
        dense_or_lazy = isinstance(target, (TensorDict, LazyStackedTensorDict))
        if dense_or_lazy and index_writes.reads_entry_dims(idx, target.batch_size):
            # tensordict 0.15.3 writes key by key as set_at_, the index read on each
            # entry's dims: mirrored where its writes fit (see entry_index_writes)
            batch_paths = index_writes.tensordict_values(unwrap_tensorclass(source))
            python_paths = index_writes.python_values(source)
        else:
            batch_paths = python_paths = None
        if isinstance(source, dict):
            source = TensorDict(index_writes.numbers_kept(source, target), batch_size=[])
        elif not isinstance(source, TensorDictBase):  # a tensorclass
            source = source._tensordict
        if keys_to_update is not None:
            source = source.select(*keys_to_update, strict=False)
        rows = _ABSENT  # a lazy stack's rows at idx, read once: the members written there may
        for key in source.keys(True, True, is_leaf_nontensor):  # hold keys that the others lack
            if target._get_path(unravel_key(key), None) is None:
                if isinstance(target, LazyStackedTensorDict):
                    rows = _rows_at(target, idx) if rows is _ABSENT else rows
                    if rows is not None and rows._get_path(unravel_key(key), None) is not None:
                        continue
                if isinstance(target, TensorDict):  # (the cause, as in tensordict: ValueError)
                    _refuse_other_tensorclass(target, source, unravel_key(key))
                raise KeyError(
                    f"update_at_() writes into existing entries, but key {key!r} does not "
                    f"exist in {type(self).__name__}; add it with set() first."
                )
        if clone:
            source = source.clone()
        writes, error = None, None
        if batch_paths is not None:
            writes, error = index_writes.entry_index_writes(target, source, idx, batch_paths, python_paths)
        if writes is None:  # (a source shaped as the rows td[idx], which tensordict refuses, too)
            try:
                target._set_at_index(idx, source)
            except (RuntimeError, IndexError, TypeError, ValueError):
                if error is None:
                    raise
                # neither meaning fits: the error of the entry-dims one (tensordict's), which
                # names the entry at fault (the rows' one named the first entry it tried)
                raise error from None
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
        """``self.get(key)[index]``, or ``default`` when the key is missing (None
        without a default, as ``get`` gives)."""
        value = self.get(key) if default is _ABSENT else self.get(key, _ABSENT)
        if value is None or value is _ABSENT:
            return None if default is _ABSENT else default
        return value[index]

    def set_at_(self, key: NestedKey, value: Any, index: Any, *, non_blocking: bool = False) -> Any:
        """Write ``value`` at batch index ``index`` of the existing entry ``key``, in place
        (allowed when locked); returns self. ``non_blocking`` is accepted for
        compatibility, and ignored (the write is done on return).

        A non-tensor entry is written as ``td[index] = ...`` writes it, checked first:
        a memory-mapped or shared NonTensorData (one value for the batch) refuses
        per-element values, a value its files or shared cell cannot store is a
        TypeError naming the key, and a memory-mapped entry's files are written first.

        Example:
            >>> td = TensorDict(text=NonTensorData("x"), batch_size=[2]).memmap_()
            >>> try:
            ...     td.set_at_("text", "y", 0)
            ... except RuntimeError as error:
            ...     print(str(error).split(" into")[0])
            set_at_('text', ..., 0): Cannot write per-element values
            >>> TensorDict(text=NonTensorData("x"), batch_size=[2]).set_at_("text", "y", 0)["text"]
            LinkedList(['y', 'x'])

        Raises:
            KeyError: naming the key, when it is missing.
        """
        entry = self.get(key, RAISE)
        path = unravel_key(key)
        parent = unwrap_tensorclass(self.get(path[:-1], RAISE) if len(path) > 1 else self)
        try:
            if getattr(entry, "_is_non_tensor", False) and hasattr(entry, "_set_at") and hasattr(parent, "_tensordict"):
                # a NonTensorData holds one value for the batch: written at some rows it
                # becomes a NonTensorStack, which replaces the entry (as tensordict); below
                # a lazy stack (no _tensordict) the stack writes it into its members.
                # Checked as td[index] = ... checks it (index_writes): this assignment
                # skips the lock, so a memory-mapped NonTensorData must refuse to become
                # a stack in memory, which its files would never see
                from shared_td.containers import batch as batch_ops  # (same layer)
                from shared_td.containers.nontensor_ops import check_non_tensor_write

                rows = batch_ops.index_and_size(index, entry.batch_size)[0]
                check_non_tensor_write(entry, rows, value, path)
                parent._tensordict[path[-1]] = entry._set_at(rows, value)  # (files first: _store)
            else:  # (below a lazy stack, entry is a new stacked tensor: written through the stack)
                import numpy as np
                import torch

                from shared_td.containers.index_writes import plan_set_at

                if isinstance(value, np.ndarray):  # as set() takes one: a tensor (tensordict)
                    value = torch.as_tensor(value, device=getattr(entry, "device", None))
                writes: list = []  # checked (below lazy stacks too) before anything is written
                plan_set_at(unwrap_tensorclass(self), path, value, index, writes)
                for write in writes:
                    write()
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

    # --- dict methods, as tensordict 0.15.3 has them (a locked tensordict refuses them:
    # the first ``del`` raises before anything is removed).
    def clear(self) -> Any:
        """Remove every entry; returns self.

        Example:
            >>> TensorDict(a=torch.zeros(2), batch_size=[2]).clear().is_empty()
            True
        """
        entries = unwrap_tensorclass(self)  # a tensorclass: its fields' tensordict (no __delitem__ of its own)
        for key in list(entries.keys()):
            del entries[key]
        return self

    def popitem(self) -> tuple:
        """Remove the entry added last and return ``(key, value)``; KeyError if empty.

        Example:
            >>> TensorDict(a=torch.zeros(2), b=torch.ones(2), batch_size=[2]).popitem()[0]
            'b'
        """
        keys = list(self.keys())
        if not keys:
            raise KeyError(f"popitem(): the {type(self).__name__} has no entry.")
        return keys[-1], self.pop(keys[-1])

    def create_nested(self, key: NestedKey) -> Any:
        """Set an empty tensordict of this batch size, device and names at ``key``
        (its missing parents too); returns self.

        Example:
            >>> td = TensorDict(batch_size=[2]).create_nested(("a", "b"))
            >>> td["a", "b"].batch_size
            torch.Size([2])
        """
        from shared_td.containers.tensordict import TensorDict

        return self.set(key, TensorDict(batch_size=self.batch_size, device=self.device, names=self.names))

    def entry_class(self, key: NestedKey) -> type:
        """The class of the entry at ``key``: ``NoneType`` when there is none, as
        tensordict 0.15.3 (whose ``get(key)`` returns None for a missing key); a key
        that is not one or that runs through a leaf still raises.

        Example:
            >>> td = TensorDict(a=torch.zeros(2), batch_size=[2])
            >>> td.entry_class("a"), td.entry_class("missing")
            (<class 'torch.Tensor'>, <class 'NoneType'>)
        """
        try:
            return type(self.get(key))
        except (KeyTypeError, KeyThroughLeafError):
            raise  # both are KeyErrors too: not a missing key but a wrong one
        except KeyError:
            return type(None)

    def ndimension(self) -> int:
        """The number of batch dims (``batch_dims``, as ``torch.Tensor.ndimension``)."""
        return self.batch_dims

    def to_lazystack(self, dim: int = 0) -> Any:
        """A lazy stack along batch dim ``dim`` of this tensordict's elements (views of
        it); a lazy stack along ``dim`` already is returned as it is. The dim names are
        kept (tensordict 0.15.3 drops the name of ``dim``).

        Example:
            >>> td = TensorDict(a=torch.zeros(2, 3), batch_size=[2, 3], names=["x", "y"])
            >>> lazy = td.to_lazystack(1)
            >>> type(lazy).__name__, lazy.stack_dim, lazy.names
            ('LazyStackedTensorDict', 1, ['x', 'y'])
        """
        from shared_td.containers import batch as batch_ops
        from shared_td.containers.lazy import LazyStackedTensorDict

        dim = batch_ops.normalize_dim(dim, self.batch_dims)
        if isinstance(self, LazyStackedTensorDict) and self.stack_dim == dim:
            return self
        names = self.names
        return LazyStackedTensorDict.lazy_stack(list(self.unbind(dim)), dim,
                                                stack_dim_name=None if names is None else names[dim])

    def copy_at_(self, tensordict: Any, idx: Any, non_blocking: bool = False, *, fast: bool = True) -> Any:
        """``update_at_(tensordict, idx)`` under tensordict 0.15.3's other name.
        ``non_blocking`` and ``fast`` are accepted and change nothing: non-tensor
        entries are written too (tensordict raises for them with ``fast=True``)."""
        return self.update_at_(tensordict, idx)

    @classmethod
    def lazy_stack(cls, input: Sequence[Any], dim: int = 0, *, out: Any = None, **kwargs: Any) -> Any:
        """``TensorDict.lazy_stack(tds, dim)``: the same as ``shared_td.lazy_stack``."""
        from shared_td.containers.lazy import LazyStackedTensorDict

        return LazyStackedTensorDict.lazy_stack(input, dim, out=out, **kwargs)

    # --- tensordict 0.15.3's tensor-like constructors and copies along the batch dims
    def stack_tensors(self, *keys: NestedKey, out_key: NestedKey, dim: int = 0,
                      keep_entries: bool = False) -> Any:
        """Set ``out_key`` to ``torch.stack`` of the tensors at ``keys`` along ``dim`` (a
        dim of the tensors, as torch counts it) and remove ``keys`` unless
        ``keep_entries``; returns self.

        Example:
            >>> td = TensorDict(a=torch.zeros(2, 3), b=torch.ones(2, 3), batch_size=[2])
            >>> td.stack_tensors("a", "b", out_key="ab", dim=-1)["ab"].shape, sorted(td.keys())
            (torch.Size([2, 3, 2]), ['ab'])
        """
        import torch

        return self._joined_tensors(torch.stack, keys, out_key, dim, keep_entries)

    def cat_tensors(self, *keys: NestedKey, out_key: NestedKey, dim: int = 0,
                    keep_entries: bool = False) -> Any:
        """As :meth:`stack_tensors`, with ``torch.cat``."""
        import torch

        return self._joined_tensors(torch.cat, keys, out_key, dim, keep_entries)

    def _joined_tensors(self, join: Any, keys: tuple, out_key: NestedKey, dim: int, keep_entries: bool) -> Any:
        # set first: a locked tensordict raises before anything is removed
        self.set(out_key, join([self.get(key, RAISE) for key in keys], dim))
        if not keep_entries:
            for key in keys:
                if unravel_key(key) != unravel_key(out_key):
                    del self[key]
        return self

    def new_tensor(self, data: Any, *, dtype: Any = None, device: Any = DATA_DEVICE, requires_grad: bool = False,
                   pin_memory: bool | None = None) -> Any:
        """:func:`~shared_td.containers.new_tensor.new_tensor`: a tensordict whose leaves
        are copies of ``data`` (or of its leaves), each of the dtype of this one's leaf;
        a tensorclass gives one of its class, its non-tensor fields kept."""
        out = new_tensor(self._tensordict if getattr(self, "_is_tensorclass", False) else self, data,
                         dtype=dtype, device=device, requires_grad=requires_grad, pin_memory=pin_memory)
        return _tensorclass_new_like(self, out) if getattr(self, "_is_tensorclass", False) else out

    def new_empty(self, *size: Any, dtype: Any = None, device: Any = None, requires_grad: bool = False,
                  **ignored: Any) -> Any:
        """A new tensordict of batch size ``size`` with this one's entries, each an
        uninitialized tensor of its dtype and feature shape (``dtype``/``device``
        override them). ``layout``, ``pin_memory`` and ``empty_lazy`` are accepted and
        ignored; a lazy stack gives a TensorDict."""
        return self._new_like(size, lambda x, shape, kw: x.new_empty(shape, **kw), dtype, device, requires_grad)

    def new_zeros(self, *size: Any, dtype: Any = None, device: Any = None, requires_grad: bool = False,
                  **ignored: Any) -> Any:
        """As :meth:`new_empty`, filled with zeros.

        Example:
            >>> TensorDict(a=torch.ones(3, 4), batch_size=[3]).new_zeros(2, 5)["a"].shape
            torch.Size([2, 5, 4])
        """
        return self._new_like(size, lambda x, shape, kw: x.new_zeros(shape, **kw), dtype, device, requires_grad)

    def new_ones(self, *size: Any, dtype: Any = None, device: Any = None, requires_grad: bool = False,
                 **ignored: Any) -> Any:
        """As :meth:`new_empty`, filled with ones."""
        return self._new_like(size, lambda x, shape, kw: x.new_ones(shape, **kw), dtype, device, requires_grad)

    def new_full(self, size: Any, fill_value: Any, *, dtype: Any = None, device: Any = None,
                 requires_grad: bool = False, **ignored: Any) -> Any:
        """As :meth:`new_empty`, filled with ``fill_value``."""
        return self._new_like((size,), lambda x, shape, kw: x.new_full(shape, fill_value, **kw),
                              dtype, device, requires_grad)

    def _new_like(self, size: tuple, make: Any, dtype: Any, device: Any, requires_grad: bool) -> Any:
        from shared_td.containers import batch as batch_ops

        import torch

        size = tuple(batch_ops.shape_args(size))
        if getattr(self, "_is_tensorclass", False):  # its tensordict's, wrapped again (no _map_entries)
            return _tensorclass_new_like(self, self._tensordict._new_like(size, make, dtype, device, requires_grad))
        dense = self._dense_for_copy()
        nb = dense.batch_dims
        # the names stay with the last dims, as tensordict 0.15.3 keeps them
        names = None if dense.names is None or len(size) < nb else [None] * (len(size) - nb) + dense.names

        def entry(x: Any) -> Any:
            if isinstance(x, torch.Tensor):
                kw = {"dtype": dtype or x.dtype, "device": device or x.device, "requires_grad": requires_grad}
                return make(x, (*size, *x.shape[nb:]), kw)
            if is_non_tensor(x):
                return non_tensor_like(x, torch.Size([*size, *x.batch_size[nb:]]), x.device)
            return x._new_like((*size, *x.batch_size[nb:]), make, dtype, device, requires_grad)  # nested

        return dense._map_entries(entry, torch.Size(size), names)

    def repeat(self, *repeats: int) -> Any:
        """Repeat the batch dims as ``torch.Tensor.repeat`` does (one count per batch
        dim; the feature dims are kept). Each entry repeats itself: a non-tensor entry
        moves its values, a nested tensordict keeps its own dims past ours. A lazy
        stack gives a TensorDict, unless that would lose entries (its members differ in
        keys or shapes): then a lazy stack of the members repeated, as tensordict's.

        Example:
            >>> TensorDict(a=torch.arange(2), s=NonTensorStack("x", "y"), batch_size=[2]).repeat(2)["s"]
            LinkedList(['x', 'y', 'x', 'y'])
        """
        from shared_td.containers import batch as batch_ops

        repeats = batch_ops.shape_args(repeats)
        size = batch_ops._probe(self.batch_size).repeat(*repeats).shape  # (torch's checks of the counts)
        if _keeps_members(self):  # the stack dim tiles the members; each repeats along the others
            counts = list(repeats)
            dim = self.stack_dim + len(counts) - self.batch_dims  # (counts past ours add leading dims)
            order = list(range(len(self.tensordicts))) * counts.pop(dim)
            out = _restacked(self, order, lambda m: m.repeat(*counts) if counts else m.clone(), dim, size)
        else:
            dense = self._dense_for_copy()
            nb = dense.batch_dims
            names = None if dense.names is None else [None] * (len(size) - nb) + dense.names  # (as tensordict)
            # (a tensor, a non-tensor entry or a nested collection: one count per dim past ours)
            out = dense._map_entries(lambda x: x.repeat(*repeats, *[1] * (_dims(x) - nb)), size, names)
        return out.lock_() if self.is_locked else out  # (locked as self, as in tensordict)

    def repeat_interleave(self, repeats: Any, dim: int | None = None, *, output_size: int | None = None) -> Any:
        """``torch.repeat_interleave`` along batch dim ``dim`` (of the flattened batch
        dims when ``dim`` is None), as tensordict does; each entry repeats itself, as in
        :meth:`repeat`. A lazy stack gives a TensorDict, or a lazy stack as ``repeat``.

        Example:
            >>> TensorDict(a=torch.arange(2), s=NonTensorStack("x", "y"), batch_size=[2]).repeat_interleave(2)["s"]
            LinkedList(['x', 'x', 'y', 'y'])
        """
        import torch

        from shared_td.containers import batch as batch_ops

        lazy = _keeps_members(self)
        node = self if lazy else self._dense_for_copy()
        if dim is None:
            node, dim = node.reshape(-1), 0  # (a lazy stack's along its members: one still)
        dim = batch_ops.normalize_dim(dim, node.batch_dims)
        size = batch_ops._probe(node.batch_size).repeat_interleave(repeats, dim=dim, output_size=output_size).shape
        if not lazy:
            out = node._map_entries(lambda x: x.repeat_interleave(repeats, dim=dim, output_size=output_size),
                                    size, node.names)
        elif dim == node.stack_dim:  # each member taken as many times as its count, in place
            counts = torch.as_tensor(repeats).expand(len(node.tensordicts)).tolist()
            order = [at for at, count in enumerate(counts) for _ in range(count)]
            out = _restacked(node, order, lambda m: m.clone(), dim, size)
        else:  # each member along its own dim
            inner = dim - (dim > node.stack_dim)
            out = _restacked(node, range(len(node.tensordicts)), lambda m: m.repeat_interleave(
                repeats, dim=inner, output_size=output_size), node.stack_dim, size)
        return out.lock_() if self.is_locked else out

    def _dense_for_copy(self) -> Any:
        """Self, or for a lazy stack its dense copy (new-tensor ops give a TensorDict)."""
        from shared_td.containers.lazy import LazyStackedTensorDict

        return self.contiguous() if isinstance(self, LazyStackedTensorDict) else self


def _rows_at(lazy: Any, idx: Any) -> Any:
    """``lazy[idx]`` (its tensordict where the rows are a member given as a tensorclass),
    or None for an index that the write refuses itself (with its own error)."""
    try:
        return unwrap_tensorclass(lazy[idx])
    except (IndexError, TypeError, ValueError, RuntimeError):
        return None


def _keeps_members(node: Any) -> bool:
    """True for a lazy stack whose dense copy would lose entries (its repeats stay lazy)."""
    from shared_td.containers.lazy import LazyStackedTensorDict

    return isinstance(node, LazyStackedTensorDict) and node._dense_copy_loses_entries()


def _restacked(lazy: Any, order: Sequence[int], make: Any, dim: int, size: Any) -> Any:
    """A lazy stack along ``dim`` of ``make(member)`` (a new copy) for each member at ``order``."""
    sources = [lazy.tensordicts[at] for at in order]
    return lazy._restack([make(member) for member in sources], dim, size, sources=sources)


def _tensorclass_new_like(tc: Any, out: Any) -> Any:
    """``out`` (the new_* copy of ``tc``'s tensordict) as a ``type(tc)``; the non-tensor
    fields (``z: str``) keep their values, as in tensordict 0.15.3, where a copy of a
    tensorclass has the same Python fields.

    >>> import torch
    >>> from shared_td import tensorclass
    >>> @tensorclass
    ... class Point:
    ...     x: torch.Tensor
    ...     label: str
    >>> p = Point(x=torch.ones(3), label="a", batch_size=[3]).new_zeros(2)
    >>> type(p).__name__, p.x.tolist(), p.label
    ('Point', [0.0, 0.0], 'a')
    """
    from shared_td.containers.nontensor import NonTensorData  # (it imports this module)

    for key, value in tc._tensordict.items():
        # one value for the batch; a NonTensorStack has none for the new rows, and out
        # keeps the empty tensordict there, as tensordict 0.15.3 (it held the old rows' list)
        if type(value) is NonTensorData:
            out.set_non_tensor(key, value.data)
    return type(tc)._from_tensordict(out)


def _dims(entry: Any) -> int:
    """The dims of a tensor, the batch dims of a collection or non-tensor entry."""
    import torch

    return entry.ndim if isinstance(entry, torch.Tensor) else entry.batch_dims


def _refuse_other_tensorclass(target: Any, source: Any, path: tuple) -> None:
    """Raise the ValueError of ``td[idx] = source`` when the key ``path`` of ``source``
    is missing from ``target`` because a tensorclass on its way is of another class with
    other fields there (tensordict's ``update_at_`` raises it; below a lazy stack, whose
    members take such a write, nothing is raised here)."""
    from shared_td.containers.lazy import LazyStackedTensorDict
    from shared_td.containers.tensorclass_compat import check_row_write

    for depth in range(1, len(path)):
        entry = target._get_path(path[:depth], None)
        if entry is None or isinstance(entry, LazyStackedTensorDict):
            return
        check_row_write(entry, source._get_path(path[:depth], None), path[:depth])


def _detach_leaves(node: Any) -> None:
    """``detach_()`` of every tensor of ``node`` (a tensordict, lazy stack or
    tensorclass), at every depth: a lazy stack's own members (its ``get`` gives copies)."""
    import torch

    from shared_td.containers.lazy import LazyStackedTensorDict

    node = unwrap_tensorclass(node)
    if isinstance(node, LazyStackedTensorDict):
        for member in node.tensordicts:
            _detach_leaves(member)
        return
    for value in node._tensordict.values():
        if isinstance(value, torch.Tensor):
            value.detach_()
        elif is_tensor_collection(value) and not is_non_tensor(value):
            _detach_leaves(value)


class TensorData:
    """``td.data`` of a TensorDict or a lazy stack (tensordict 0.15.3's property): not a
    mixin of TensorDictBase, so that a tensorclass field or a non-tensor's value may be
    named ``data`` (as in tensordict, ``NonTensorData.data`` is its value)."""

    @property
    def data(self) -> Any:
        """A tensordict of each tensor's ``.data`` (the same storage, outside autograd:
        a memory-mapped leaf's is a plain tensor over the same memory); non-tensor
        entries are new ones holding the same values, and a locked tensordict gives a
        locked one, as tensordict's.

        Example:
            >>> td = TensorDict(x=torch.ones(2, requires_grad=True), batch_size=[2])
            >>> td.data["x"].requires_grad, td.data["x"].data_ptr() == td["x"].data_ptr()
            (False, True)
        """
        out = self.apply(lambda tensor: tensor.data, filter_empty=False)
        return out.lock_() if self.is_locked else out
