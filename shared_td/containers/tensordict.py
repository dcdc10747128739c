"""TensorDict: a dict of tensors (and nested collections) that share leading batch dims.

This module holds what builds TensorDicts and reads their entries: construction, the
conversion and check of each value set, the batch size, ``empty`` and indexing,
with the replay buffer's hot paths (the row read ``td[i]``, the entry of the row write
``td[i] = step``), which build TensorDicts directly with no call between. The mixins add
the rest: names of batch dims (naming.py), key operations (keyops.py), batch reshaping
(reshaping.py), ``apply`` (tensordict_apply.py), the general, checked write of ``td[index] = value`` (index_writes.py;
its fast lane is row_writes.py) and torch's tensor methods applied to every leaf
(tensor_methods.py).
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Sequence

import numpy as np
import torch

from shared_td.containers import batch as batch_ops
from shared_td.containers.batch_dim_ops import BatchDimOps
from shared_td.containers.base import (
    NO_DEFAULT,
    TensorDictBase,
    check_write_into,
    is_non_tensor,
    is_tensor_collection,
    parse_device,
    self_nesting_error,
)
from shared_td.containers.value_kinds import nested_tensor_error
from shared_td.containers.convenience_ops import TensorData
from shared_td.containers.index_writes import IndexWrites
from shared_td.containers.keyops import KeyOps
from shared_td.containers.locking import LockingOps
from shared_td.containers.naming import NamedBatchDims, check_names, resized_names
from shared_td.containers.nontensor_ops import kept_by_empty, list_to_entry, list_to_tensor
from shared_td.containers.nontensor_options import list_to_stack
from shared_td.nontensor_values import same_value
from shared_td.containers.reshaping import BatchShapeOps
from shared_td.containers.row_writes import write_rows
from shared_td.containers.tensor_methods import TensorMethods
from shared_td.containers.tensordict_apply import LeafMapping
from shared_td.errors import BatchSizeMismatchError
from shared_td.keys import unravel_key
from shared_td.memmap_tensor import MemoryMappedTensor
from shared_td.memmap_tensor.tensor import basic_views
from shared_td.tensorclass_protocol import unwrap_tensorclass


class TensorDict(NamedBatchDims, KeyOps, BatchShapeOps, BatchDimOps, IndexWrites, TensorMethods, LeafMapping,
                 TensorData, TensorDictBase):
    """A nested mapping of str keys to tensors, tensordicts, tensorclasses and non-tensors.

    Every entry's leading dims equal ``batch_size``; operations along batch dims
    (indexing, stacking, reshaping, ...) apply to all entries at once.

    Args:
        source: a dict (or tensordict) of entries; nested dicts become TensorDicts.
        batch_size: the leading shape shared by all entries (default: ``[]``).
        device: if given, every tensor is moved there.
        names: optional names of the batch dims.
        non_blocking: accepted for compatibility with tensordict, and ignored (every
            copy here is synchronous).
        lock: if True, the new tensordict is locked (``lock_()``).
        **kwargs: more entries, as in ``dict(**kwargs)``.

    Examples:
        >>> td = TensorDict({"obs": torch.zeros(4, 3)}, batch_size=[4], reward=torch.ones(4))
        >>> td["obs"].shape, td[1:3].batch_size
        (torch.Size([4, 3]), torch.Size([2]))
        >>> td["task"] = "walk"          # a NonTensorData
        >>> td[0]["task"]
        'walk'
    """

    #: the cached leaves of ``td[index] = other`` (see row_writes; checked at each use)
    _row_write_plan = None

    def __init__(
        self,
        source: Any = None,
        batch_size: Any = None,
        device: Any = None,
        names: Sequence[str | None] | None = None,
        non_blocking: bool | None = None,
        lock: bool = False,
        **kwargs: Any,
    ):
        self._tensordict: dict[str, Any] = {}
        self._batch_size = batch_ops.as_batch_size(batch_size)
        self._device = parse_device(device)
        self._names = None
        self._is_locked = False
        self._is_shared = False
        self._is_memmap = False
        self._memmap_prefix = None
        self._lock_parents: dict = {}
        self._context_ops: list = []
        entries = {}
        if source is not None:
            entries.update(source.items() if hasattr(source, "items") else source)
        entries.update(kwargs)
        if names is not None:
            # named first, as in tensordict: each entry set then takes these names, and
            # one that names a dim otherwise is an error (not silently renamed)
            named = check_names(names, self._batch_size)
            self._names = named if any(name is not None for name in named) else None
        self._set_initial(entries)
        if lock:
            self.lock_()

    def _set_initial(self, entries: dict) -> None:
        """The entries given to ``__init__``: a tensor or a plain dict under a str key (what
        code builds from nested dicts) is checked and stored here, anything else goes
        through ``set``. Building the 1000-node tree from dicts was 1.6x tensordict's,
        mostly ``set``'s general path (lock, in-place and conversion checks that a
        tensordict being made never needs)."""
        batch_size, device, stored = self._batch_size, self._device, self._tensordict
        batch_dims = len(batch_size)
        for key, value in entries.items():
            if type(key) is not str or self._names is not None:  # (named: set() names each child)
                self.set(key, value)
            elif type(value) is torch.Tensor and not value.is_nested:
                fits = value.shape[:batch_dims] == batch_size and device is None
                stored[key] = value if fits else self._fitted(key, value, value.shape)
            elif type(value) is dict:
                stored[key] = TensorDict(value, batch_size, device)
            else:
                self.set(key, value)

    @classmethod
    def _new_unsafe(
        cls, entries: dict, batch_size: torch.Size, device=None, names=None
    ) -> "TensorDict":
        """Build from already validated entries (internal fast path)."""
        td = cls.__new__(cls)
        td._tensordict = entries
        td._batch_size = batch_size
        td._device = device
        td._names = None if names is None or all(n is None for n in names) else list(names)
        td._is_locked = td._is_shared = td._is_memmap = False
        td._memmap_prefix = None
        td._lock_parents = {}
        td._context_ops = []
        return td

    def _non_tensor_through(self, path: tuple[str, ...], value: Any) -> Any:
        # a lazy stack's non-tensor entry found through this tensordict writes into its
        # members, as the stack's own get() gives it (imported here: a rare case, and
        # lazy_nontensor sits above this module)
        from shared_td.containers.lazy_nontensor import through_nested_lazy

        return through_nested_lazy(self, path, value)

    # ---------------------------------------------------------------- storage hooks
    def _get_str(self, key: str, default: Any) -> Any:
        return self._tensordict.get(key, default)

    def _keys_str(self):
        return iter(list(self._tensordict))

    def _items_str(self):
        # over a copy (one C call, as atomic as list(items()) under the GIL): entries
        # set or deleted meanwhile do not break the iteration; no tuple is made ahead
        # (a walk of a 1000-node tree spent a third of its time making them)
        return iter(self._tensordict.copy().items())

    def _collection_children(self) -> list:
        """LockingOps's, over the entries themselves: lock_() and unlock_() of a tree
        call it once per node (the lock of a loaded 1000-node tree was mostly lookups).
        Tensors, most entries, are passed over first (a tensor is never a collection):
        the lock of each attach of a 100-leaf tensordict was ~25 us of unwrapping them."""
        others = [value for value in self._tensordict.values() if not isinstance(value, torch.Tensor)]
        return [child for child in map(unwrap_tensorclass, others) if isinstance(child, TensorDictBase)]

    def _del_str(self, key: str) -> None:
        del self._tensordict[key]

    def _empty_child(self) -> "TensorDict":
        return TensorDict._new_unsafe({}, self._batch_size, self._device, self._names)  # (named as set() keeps it)

    def _set_str(self, key: str, value: Any, *, inplace: bool, validated: bool) -> None:
        if not isinstance(key, str):
            unravel_key(key)  # raises the KeyTypeError
        current = self._tensordict.get(key)
        if not validated:
            if value is self:  # td["a"].set("x", td["a"]), update({"x": td}), ...
                raise self_nesting_error(key)
            value = self._convert(key, value, into=current if inplace else None)
        if inplace and current is not None:
            _write_into(current, value, key)
            return
        self._check_unlocked((key,), "add" if current is None else "replace")
        if not isinstance(value, torch.Tensor) and is_tensor_collection(value):
            value = self._adopt_names(key, value)
        self._tensordict[key] = value

    def _convert(self, key: str, value: Any, into: Any = None) -> Any:
        """Turn ``value`` into an entry (tensor, collection or NonTensorData) and check it.

        ``into`` is the entry an in-place write goes to: a Python value written into a
        non-tensor entry stays Python data (``True`` is not turned into a tensor).
        """
        if isinstance(value, torch.Tensor):  # most entries: none of the conversions below applies
            try:
                shape = value.shape
            except RuntimeError:  # (checked only here: a set pays nothing for it)
                if value.is_nested:  # torch's "Internal error ... Please file an issue"
                    raise nested_tensor_error(key, "Cannot store the entry") from None
                raise
            return self._fitted(key, value, shape)
        from shared_td.containers.nontensor import NonTensorData, NonTensorStack, as_non_tensor

        if into is not None and is_non_tensor(into) and not is_tensor_collection(value):
            if isinstance(value, list):  # one value per element, as set() takes it (a NonTensorData refuses it)
                if isinstance(into, NonTensorData) and (same_value(value, into.data) or not list_to_stack()):
                    # the list it holds, written again (td.update_(td.to_dict())): one value, as tensordict takes it
                    return NonTensorData(value, batch_size=self._batch_size, device=self._device)
                return as_non_tensor(value, self._batch_size, key, self._device)
            if isinstance(into, NonTensorStack):
                return value  # per-element values, checked by the stack itself
            return NonTensorData(value, batch_size=self._batch_size, device=self._device)
        if isinstance(value, dict):
            value = TensorDict(value, batch_size=self._batch_size, device=self._device, names=self._names)
        elif isinstance(value, np.ndarray) and value.dtype.kind in "biufc":  # (str, bytes, dates: data)
            value = torch.as_tensor(value)
        elif isinstance(value, (bool, int, float, np.number)):
            # a Python complex stays a Python value, as in tensordict
            value = torch.as_tensor(value)
        elif isinstance(value, list):
            value = list_to_entry(value, self._device)
        elif isinstance(value, tuple) and not is_tensor_collection(value):
            value = list_to_tensor(value)
        if not isinstance(value, torch.Tensor) and not is_tensor_collection(value):
            value = NonTensorData(value, batch_size=self._batch_size, device=self._device)
        if is_non_tensor(value) and value.batch_size != self._batch_size:
            value = value._with_batch_size(self._batch_size, key)
        elif is_tensor_collection(value) and value.batch_size[: len(self._batch_size)] != self._batch_size:
            value = self._resized_child(value, key)  # (as tensordict: a copy resized)
        return self._fitted(key, value, value.batch_size if is_tensor_collection(value) else value.shape)

    def _fitted(self, key: str, value: Any, shape: torch.Size) -> Any:
        """``value`` (of leading ``shape``) checked against the batch size, on this
        tensordict's device."""
        if shape[: len(self._batch_size)] != self._batch_size:
            raise BatchSizeMismatchError(  # (its start worded as tensordict's, which handlers match)
                f"batch dimension mismatch, got self.batch_size={self._batch_size!r} and value.shape="
                f"{torch.Size(shape)!r} for key {key!r}: its shape {list(shape)} must start with the "
                f"batch size {list(self._batch_size)} (expand, reshape or index the value, or change batch_size)."
            )
        if self._device is not None and value.device != self._device:
            value = value.to(self._device)
        return value

    # ---------------------------------------------------------------- properties
    @property
    def batch_size(self) -> torch.Size:
        """The leading shape shared by all entries. Settable (checked against entries)."""
        return self._batch_size

    @batch_size.setter
    def batch_size(self, new_size: Any) -> None:
        new_size = batch_ops.as_batch_size(new_size)
        self._check_batch_size(new_size)
        self._apply_batch_size(new_size)

    def _check_batch_size(self, new_size: torch.Size) -> None:
        """Raise, before anything changes, if some leaf does not start with ``new_size``."""
        for key, value in self._tensordict.items():
            if isinstance(value, TensorDict) and value.batch_dims < len(new_size):
                value._check_batch_size(new_size)
                continue
            if is_non_tensor(value):
                value._with_batch_size(new_size, key)  # raises if it cannot follow
                continue
            shape = value.batch_size if is_tensor_collection(value) else value.shape
            if shape[: len(new_size)] != new_size:
                raise BatchSizeMismatchError(  # (its end worded as tensordict's, which handlers match)
                    f"Cannot set batch_size to {list(new_size)}: key {key!r} has shape {list(shape)}, which "
                    f"does not start with it: the {type(value).__name__} {key} has shape {torch.Size(shape)!r} "
                    f"which is incompatible with the batch-size {torch.Size(new_size)!r}."
                )

    def _apply_batch_size(self, new_size: torch.Size) -> None:
        for key, value in self._tensordict.items():
            if is_non_tensor(value):
                self._tensordict[key] = value._with_batch_size(new_size, key)
            elif isinstance(value, TensorDict) and value.batch_dims < len(new_size):
                value._apply_batch_size(new_size)
        self._batch_size = new_size
        if self._names is not None and len(self._names) != len(new_size):
            self._rename_after_resize()

    @property
    def device(self) -> torch.device | None:
        """The device of every tensor, or None if they may differ."""
        return self._device

    # ---------------------------------------------------------------- mapping entries
    def _map_entries(
        self,
        op: Callable[[Any], Any],
        batch_size: torch.Size,
        names: list | None = None,
        *,
        is_view: bool = False,
        device: Any = NO_DEFAULT,
    ) -> "TensorDict":
        """A new TensorDict with ``op`` applied to every entry (tensor or collection).

        ``is_view`` keeps the lock and memmap/shared flags, as the result shares storage,
        but not the directory: a view is not memory-mapped there (see ``_index_rows``).
        """
        entries = {key: op(value) for key, value in self._tensordict.items()}
        out = type(self)._new_unsafe(  # (a subclass's results are of its class, as in tensordict)
            entries, batch_size, self._device if device is NO_DEFAULT else device, names
        )
        if is_view:
            out._is_memmap, out._is_shared = self._is_memmap, self._is_shared
            if self._is_locked:
                out.lock_()
        return out

    # ---------------------------------------------------------------- indexing
    def __getitem__(self, index: Any) -> Any:
        # a replay buffer's row read, ``td[i]`` with an int in range, goes straight to
        # _index_rows (what index_and_size gives it); anything else as TensorDictBase
        if type(index) is int:
            size = self._batch_size
            if size and -size[0] <= index < size[0]:
                return self._index_rows((index,), size[1:], True)
        return TensorDictBase.__getitem__(self, index)

    __getitems__ = __getitem__  # a DataLoader's batch of indices (a list) in one index, as tensordict

    def _index(self, index: Any) -> "TensorDict":
        index, new_size = batch_ops.index_and_size(index, self._batch_size)
        return self._index_rows(index, new_size, batch_ops.is_basic_index(index))

    def _index_rows(self, index: tuple, new_size: torch.Size, is_view: bool) -> "TensorDict":
        """``self[index]`` for a normalized ``index`` that gives batch size ``new_size``.

        Nested tensordicts are indexed by this method too: the index is normalised and
        checked once per call, at the top. A view (basic index) keeps the lock and the
        memmap/shared flags, as in tensordict 0.15.3, but never the parent's directory:
        its shape is not the save's, so memmap_() with no prefix, saved_path,
        memmap_refresh_ and make_memmap treat it as a tree with no directory (a save
        there would overwrite the parent's meta.json and the leading bytes of its
        files). This is the row read of a replay buffer: the memory-mapped
        leaves are viewed at once without re-checking their storage (``basic_views``),
        and a locked view is built locked, with no second walk of its entries.
        """
        depth = len(self._batch_size)
        leaf_index = index[0] if len(index) == 1 else index  # torch takes an int faster than (int,)
        entries = {}
        mapped = []  # (key, memory-mapped leaf): viewed by basic_views, in their places
        collections = []  # the entries a locked view links to itself (see _link_view)
        for key, value in self._tensordict.items():
            kind = type(value)
            if kind is MemoryMappedTensor and is_view:
                entries[key] = value  # keeps the key's place; its view replaces it below
                mapped.append((key, value))
            elif kind is torch.Tensor:
                entries[key] = value[leaf_index]
            elif kind is TensorDict:
                # a nested node's own batch dims usually end where ours do: no Size to build
                size = new_size if len(value._batch_size) == depth else new_size + value._batch_size[depth:]
                entries[key] = child = value._index_rows(index, size, is_view)
                collections.append(child)
            else:
                entries[key] = child = value[index]
                if not isinstance(child, torch.Tensor):
                    collections.append(child)
        if mapped:
            basic_views(mapped, leaf_index, entries)
        names = None if self._names is None else batch_ops.indexed_names(self._names, index)
        if not (is_view and self._is_locked):
            out = type(self)._new_unsafe(entries, new_size, self._device, names)
            if is_view:
                out._is_memmap, out._is_shared = self._is_memmap, self._is_shared
            return out
        # a locked view: _new_unsafe's attributes in its order (the instances share one
        # table of attribute names), then the view's flags and lock, set once
        out = _NEW(type(self))
        out._tensordict = entries
        out._batch_size = new_size
        out._device = self._device
        out._names = None if names is None or all(name is None for name in names) else names
        out._is_locked = True
        out._is_shared = self._is_shared
        out._is_memmap = self._is_memmap
        out._memmap_prefix = None  # (set all the same: the attribute order is the table's)
        out._lock_parents = {}
        out._context_ops = []
        out._last_op = "lock_"
        if collections:
            _link_view(out, collections)
        return out

    def _set_rows(self, index: Any, value: Any) -> None:
        """``td[index] = value`` (TensorDictBase.__setitem__), the index normalized once:
        the source checked as ``_row_source`` checks it, then written."""
        index, target_batch = batch_ops.index_and_size(index, self._batch_size)
        self._set_at_index(index, self._row_source(index, value, target_batch), target_batch)

    def _set_at_index(self, index: Any, value: Any, target_batch: torch.Size | None = None) -> None:
        """Write a tensordict, dict or scalar into the indexed rows (``target_batch``:
        their batch size when ``index`` is normalized already).

        Everything is checked before the first byte is written, so a failing write
        leaves self unchanged.
        """
        if target_batch is None:
            index, target_batch = batch_ops.index_and_size(index, self._batch_size)
        if type(value) is TensorDict and write_rows(self, index, target_batch, value):
            return  # the same structure as before: leaf by leaf over the cached plan
        if isinstance(value, dict):  # (td[idx] = dict comes converted: see TensorDictBase.__setitem__)
            value = TensorDict(value, batch_size=[])
        else:
            value = unwrap_tensorclass(value)
        writes: list[Callable[[], None]] = []
        self._plan_index_writes(index, value, writes, target_batch, check_classes=True)
        for write in writes:
            write()

    # ---------------------------------------------------------------- new tensordicts
    def empty(self, recurse: bool = False, *, batch_size: Any = None, device: Any = NO_DEFAULT) -> "TensorDict":
        """A tensordict with the same batch size and device but no entries.

        ``recurse=True`` keeps, as tensordict 0.15.3, the nested collections emptied
        (tensordicts, tensorclasses of their class, lazy stacks of their members
        emptied) and the non-tensor entries (see :func:`kept_by_empty`). With another
        ``batch_size``, as in tensordict, every nested collection must agree with it on
        the dims they both have (a RuntimeError names the first that does not), and a
        shorter nested tensordict or tensorclass gets it (a lazy stack cannot)."""
        size = self._batch_size if batch_size is None else batch_ops.as_batch_size(batch_size)
        entries = {}
        if recurse:
            if size != self._batch_size:
                _refuse_misfit(self, size, ())
            for key, value in self._tensordict.items():
                if is_non_tensor(value):
                    if (kept := kept_by_empty(value, size)) is not None:
                        entries[key] = kept
                elif is_tensor_collection(value):
                    entries[key] = _emptied_for(value, size, key)
        names = self.names
        if names is not None and len(size) != len(names):  # (as the batch_size setter names them)
            names = resized_names(names, len(size))
            names = names if any(n is not None for n in names) else None
        return type(self)._new_unsafe(
            entries, size, self._device if device is NO_DEFAULT else parse_device(device), names
        )

    @classmethod
    def from_dict(
        cls, input_dict: dict, batch_size: Any = None, device: Any = None,
        names: Any = None, auto_batch_size: bool = False, batch_dims: int | None = None,
    ) -> "TensorDict":
        """Build a TensorDict from a nested dict.

        ``batch_size=None`` gives ``[]`` unless ``auto_batch_size=True`` or ``batch_dims``:
        ``auto_batch_size_(batch_dims)``, as in tensordict. A Python number under a batch size
        with dims is a NonTensorData, as in tensordict (a 0-d tensor cannot have those
        dims), so ``to_dict()`` of a tree holding ``NonTensorData(3)`` comes back. Lists
        and tuples are read as tensordict's ``from_dict`` reads them (stricter than the
        constructor, see :func:`~shared_td.containers.nontensor_ops.from_dict_values`):
        ``[1, 2.5]`` is a NonTensorStack, ``(1, "x")`` a nested TensorDict.
        """
        from shared_td.containers.nontensor_ops import from_dict_values

        with_dims = cls._from_dict_has_batch_dims(batch_size, batch_dims)  # (raises for both)
        entries = from_dict_values(input_dict, device, batch_size if with_dims else None)
        td = cls(entries, batch_size=batch_size, device=device)
        if (auto_batch_size or batch_dims is not None) and batch_size is None:
            td.auto_batch_size_(batch_dims)  # (non-tensors and nested ones too, as tensordict's)
        if names is not None:
            td.names = names
        return td


def _refuse_misfit(td: TensorDict, size: torch.Size, prefix: tuple) -> None:
    """Raise (RuntimeError, as tensordict 0.15.3) if a nested collection that
    ``td.empty(True, batch_size=size)`` keeps, nested ones too, disagrees with ``size``
    on the dims that both have: the tree would be invalid. (A non-tensor entry is
    re-batched or left out instead: see :func:`kept_by_empty`.)"""
    for key, value in td._tensordict.items():
        if not is_tensor_collection(value) or is_non_tensor(value):
            continue
        common = min(len(value.batch_size), len(size))
        if tuple(value.batch_size[:common]) != tuple(size[:common]):
            raise _misfit_error(size, prefix + (key,), value, "they differ on the dims both have")
        inner = unwrap_tensorclass(value)
        if isinstance(inner, TensorDict):
            _refuse_misfit(inner, size, prefix + (key,))


def _emptied_for(value: Any, size: torch.Size, key: str) -> Any:
    """``value.empty(recurse=True)``, given ``size`` if its batch size is shorter (a
    lazy stack cannot take more dims: RuntimeError, as in tensordict 0.15.3)."""
    if len(value.batch_size) >= len(size):
        return value.empty(recurse=True)
    if not isinstance(unwrap_tensorclass(value), TensorDict):
        raise _misfit_error(size, (key,), value, "a lazy stack cannot take more batch dims")
    return value.empty(recurse=True, batch_size=size)


def _misfit_error(size: torch.Size, path: tuple, value: Any, why: str) -> RuntimeError:
    name = path[0] if len(path) == 1 else path
    return RuntimeError(
        f"empty(recurse=True) cannot give the batch size {list(size)} to the entry {name!r} "
        f"(a {type(value).__name__} of batch size {list(value.batch_size)}): {why}."
    )


def _write_into(current: Any, value: Any, key: str) -> None:
    """In-place write of a converted ``value`` into the existing entry ``current``."""
    check_write_into(current, value, key)
    if isinstance(current, torch.Tensor):
        current.copy_(value)
    elif is_non_tensor(current):
        current._update_(value)
    else:
        current.update_(value)


_NEW = object.__new__


def _link_view(view: TensorDict, collections: list) -> None:
    """The rest of ``view.lock_()`` for a locked view that ``_index_rows`` just built
    from a locked tensordict, whose collection entries are ``collections``: its nested
    TensorDicts were built and locked by the same call, so they only get their link to
    ``view``; any other nested collection is locked by lock_()."""
    link = weakref.ref(view)
    for value in collections:
        if type(value) is TensorDict and value._is_locked:
            value._lock_parents[id(view)] = link
            continue
        child = unwrap_tensorclass(value)
        if isinstance(child, LockingOps):  # what lock_() reaches
            child._lock_parents[id(view)] = link
            child.lock_()
