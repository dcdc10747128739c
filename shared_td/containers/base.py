"""TensorDictBase: what every tensordict class shares.

A concrete class provides the storage primitives ``_get_str``, ``_set_str``,
``_del_str``, ``_keys_str``, the batch-size properties and ``_index``; this class builds
the mapping API (nested keys, get/set/update/select, comparisons, locking) on them.
Batch-dim operations (unsqueeze, permute, ...) are applied uniformly to every entry:
tensors and child collections answer the same method names, so one ``op(value)`` works
for both (see ``TensorDict._map_entries``).
"""
from __future__ import annotations

from typing import Any, Callable, Iterator

import torch

from shared_td.containers import batch as batch_ops
from shared_td.containers.comparisons import ComparisonOps
from shared_td.containers.consolidated_pickle import deepcopy_collection
from shared_td.containers.consolidation import ConsolidateMethods
from shared_td.containers.convenience_ops import ConvenienceOps
from shared_td.containers.distributed_ops import DistributedOps
from shared_td.containers.extra_names import ExtraNameOps
from shared_td.containers.keysview import UNSEEN, KeysView, peek_path
from shared_td.containers.locking import LockingOps
from shared_td.containers.parallel_map import MapOps
from shared_td.containers.nontensor_ops import NonTensorOps
from shared_td.containers.pinning import PinningOps
from shared_td.containers.splitting import BatchSplitOps
from shared_td.containers.state_dicts import StateDictOps
from shared_td.containers.tree_resets import TreeResets
from shared_td.containers.updates import UpdateOps
# the value kinds live below this module; also importable from here, where code
# outside the package has always found them (__all__)
from shared_td.containers.value_kinds import (
    TensorDictRoot, check_write_into, default_is_leaf, is_lazy_stack, is_leaf_nontensor, is_non_tensor,
    is_non_tensor_class, is_tensor_collection, on_cuda, parse_device, self_nesting_error)
from shared_td.errors import KeyThroughLeafError
from shared_td.keys import NestedKey, RAISE, is_below, is_nested_key, key_repr, unravel_key
from shared_td.containers.memmap_methods import MemmapMethods
from shared_td.tensorclass_protocol import unwrap_tensorclass

__all__ = [
    "NO_DEFAULT", "TensorDictBase", "check_write_into", "default_is_leaf", "is_leaf_nontensor", "is_non_tensor",
    "is_non_tensor_class", "is_tensor_collection", "on_cuda", "parse_device", "self_nesting_error",
]

NO_DEFAULT = object()
#: the options of a lazy stack's ``get`` that ``get`` passes on to one on a key's path
_AS_MEMBERS = frozenset({"as_list", "as_padded_tensor", "as_nested_tensor", "padding_side", "padding_value", "layout"})


class TensorDictBase(TensorDictRoot, LockingOps, BatchSplitOps, NonTensorOps, ConvenienceOps, MemmapMethods,
                     ConsolidateMethods, ComparisonOps, UpdateOps, PinningOps, ExtraNameOps, TreeResets, MapOps,
                     DistributedOps, StateDictOps):
    """Common API of TensorDict, LazyStackedTensorDict and the non-tensor containers."""

    _is_non_tensor = False
    _is_locked: bool
    _is_shared: bool
    _is_memmap: bool

    # ---------------------------------------------------------------- abstract hooks
    def _get_str(self, key: str, default: Any) -> Any:
        raise NotImplementedError

    def _set_str(self, key: str, value: Any, *, inplace: bool, validated: bool) -> None:
        raise NotImplementedError

    def _del_str(self, key: str) -> None:
        raise NotImplementedError

    def _keys_str(self) -> Iterator[str]:
        raise NotImplementedError

    def _items_str(self) -> Iterator[tuple[str, Any]]:
        """``(key, value)`` of this node's own entries, as ``_keys_str`` and ``_get_str``."""
        return ((key, self._get_str(key, None)) for key in self._keys_str())

    # ---------------------------------------------------------------- shape
    @property
    def shape(self) -> torch.Size:
        """Same as ``batch_size``."""
        return self.batch_size

    @property
    def batch_dims(self) -> int:
        """Number of batch dimensions."""
        return len(self.batch_size)

    ndim = batch_dims

    def dim(self) -> int:
        """Number of batch dimensions."""
        return len(self.batch_size)

    def numel(self) -> int:
        """Number of elements of the batch (the product of ``batch_size``)."""
        return self.batch_size.numel()

    def size(self, dim: int | None = None):
        """The batch size, or its ``dim``-th entry."""
        return self.batch_size if dim is None else self.batch_size[dim]

    def __len__(self) -> int:
        return self.batch_size[0] if self.batch_dims else 0

    def __iter__(self) -> Iterator:
        # Not a generator itself, so that ``iter(td)`` of a 0-dim tensordict raises at
        # once (a StopIteration raised inside a generator becomes a RuntimeError).
        if not self.batch_dims:
            raise TypeError(
                "Iteration over a 0-dim tensordict: it has no batch dim to iterate over. "
                "Use keys(), values() or items() to iterate over its entries."
            )
        return (self[i] for i in range(self.batch_size[0]))

    def __bool__(self) -> bool:
        # RuntimeError, as torch and tensordict raise for an ambiguous truth value.
        raise RuntimeError(
            "Converting a tensordict to boolean value is not permitted (as tensordict): "
            "its truth value is ambiguous; use .all(), .any() or .is_empty()."
        )

    # ---------------------------------------------------------------- keys and values
    def keys(
        self,
        include_nested: bool = False,
        leaves_only: bool = False,
        is_leaf: Callable[[type], bool] | None = None,
        *,
        sort: bool = False,
    ) -> KeysView:
        """The keys, as a view: nested ones as tuples when ``include_nested``.

        ``is_leaf(cls)`` says which entries are leaves (listed by ``leaves_only``, not
        walked into by ``include_nested``); the default, :func:`default_is_leaf`, counts
        tensors only, as tensordict 0.15.3 does: pass :func:`is_leaf_nontensor` to list
        non-tensor entries with ``leaves_only=True``. In tensordict 0.15.3's order: a
        nested tensordict's keys come before its own key (values() and items() give it
        before its entries, as tensordict's do). ``len()`` counts without making the
        keys, and ``in`` looks the key up along its path.

        Examples:
            >>> td = TensorDict(a=torch.zeros(2), b={"c": torch.ones(2)}, batch_size=[2])
            >>> list(td.keys(include_nested=True, leaves_only=True))
            ['a', ('b', 'c')]
            >>> list(td.keys(include_nested=True))
            ['a', ('b', 'c'), 'b']
        """
        return KeysView(self, include_nested, leaves_only, sort, is_leaf)

    def values(self, include_nested: bool = False, leaves_only: bool = False, is_leaf=None, *, sort: bool = False):
        """The values in ``keys()`` order (non-tensors as NonTensorData)."""
        for key, value in self.keys(include_nested, leaves_only, is_leaf, sort=sort).pairs():
            yield self.get(key) if value is UNSEEN else value

    def items(self, include_nested: bool = False, leaves_only: bool = False, is_leaf=None, *, sort: bool = False):
        """``(key, value)`` pairs in ``keys()`` order."""
        for key, value in self.keys(include_nested, leaves_only, is_leaf, sort=sort).pairs():
            yield key, (self.get(key) if value is UNSEEN else value)

    def __contains__(self, key: NestedKey) -> bool:
        if not is_nested_key(key):
            raise TypeError(
                f"`in` tests keys of a tensordict (str or tuples of str), got {key!r}; "
                "to test values, compare tensors explicitly."
            )
        return peek_path(self, unravel_key(key)) is not None  # (a nested lazy stack's ragged leaf too)

    def _get_path(self, path: tuple[str, ...], default: Any) -> Any:
        node: Any = self
        for i, part in enumerate(path):
            if i and not is_tensor_collection(node):
                return default
            node = unwrap_tensorclass(node)
            node = node._get_str(part, default) if isinstance(node, TensorDictBase) else default
            if node is default:
                return default
        return node

    def get(self, key: NestedKey, default: Any = NO_DEFAULT, **as_members: Any) -> Any:
        """The entry at ``key`` (non-tensors as NonTensorData), or ``default`` when it is
        missing: None when no default is given, as in tensordict 0.15.3 (``td[key]``
        raises the KeyError).

        ``as_members``: a lazy stack's options (``as_list``, ``as_padded_tensor``,
        ``as_nested_tensor`` and their ``padding_side``, ``padding_value``, ``layout``),
        for a key that runs through one (``td.get(("stack", "x"), as_list=True)``), as
        tensordict takes them; elsewhere the entry is given as it is, as there.

        Raises:
            KeyThroughLeafError: a KeyError and ValueError, when no default is given and
                a part of ``key`` holds a tensor (``td.get(("x", "y"))`` with ``"x"`` a
                tensor: there can be no entry below it), as in tensordict.

        Example:
            >>> import torch
            >>> from shared_td import TensorDict
            >>> td = TensorDict({"x": torch.zeros(2)}, [2])
            >>> td.get("y") is None, td.get("y", 0)
            (True, 0)
        """
        path = unravel_key(key)
        if as_members and not as_members.keys() <= _AS_MEMBERS:
            unknown = sorted(as_members.keys() - _AS_MEMBERS)
            raise TypeError(f"get() got unexpected keyword arguments {unknown}: it takes a default and a lazy "
                            f"stack's {sorted(_AS_MEMBERS)}.")
        node = self
        for depth in range(1, len(path) if as_members else 0):  # (peeked: reading a stack's leaf could raise)
            node = unwrap_tensorclass(peek_path(node, path[depth - 1: depth]))  # (a stack of tensorclasses too)
            if node is None:
                break
            if is_lazy_stack(node):  # it reads the rest
                return node.get(path[depth:], default, **as_members)
        value = self._get_path(path, NO_DEFAULT)
        if value is NO_DEFAULT:
            return self._default_for_missing(path, default)
        if len(path) > 1 and getattr(value, "_is_non_tensor", False):
            return self._non_tensor_through(path, value)  # (a rare case: a nested non-tensor)
        return value

    def _non_tensor_through(self, path: tuple[str, ...], value: Any) -> Any:
        """The non-tensor entry ``value`` found at the nested ``path``, as ``get`` gives it
        (a TensorDict links one found through a lazy stack to the stack's members)."""
        return value

    def _default_for_missing(self, path: tuple[str, ...], default: Any) -> Any:
        """What ``get`` of the missing ``path`` gives: ``default``; None when none is
        given, unless a part of ``path`` holds a tensor (the KeyThroughLeafError of
        :meth:`_missing_key_error` raised, as tensordict raises one); with ``RAISE`` (an
        internal caller that needs the entry), the KeyError of ``_missing_key_error``."""
        if default is RAISE:
            raise self._missing_key_error(path)
        if default is NO_DEFAULT:
            leaf = self._leaf_on(path)
            if leaf is not None and not is_non_tensor(leaf[1]):
                raise self._missing_key_error(path, leaf)
            return None
        return default

    def _leaf_on(self, path: tuple[str, ...]) -> tuple[int, Any] | None:
        """``(i, value)`` of the first part ``path[i]`` of the missing ``path`` that holds
        a value no deeper key can be in (a tensor or a non-tensor), or None."""
        for i in range(len(path) - 1):
            # by prefix, through _get_path: a lazy stack's ragged leaf is read, not stacked
            node = self._get_path(path[: i + 1], None)
            if node is None:
                return None
            if not is_tensor_collection(node) or is_non_tensor(node):
                return i, node
        return None

    def _missing_key_error(self, path: tuple[str, ...], leaf: Any = NO_DEFAULT) -> KeyError:
        """The error for the missing ``path``: a KeyThroughLeafError (KeyError and the
        ValueError tensordict raises) when a part of it holds a tensor or a non-tensor
        value, so the message says why no deeper key can be there (``leaf``: the
        :meth:`_leaf_on` of ``path``, when the caller has it)."""
        leaf = self._leaf_on(path) if leaf is NO_DEFAULT else leaf
        if leaf is None:
            return KeyError(self._missing_key_message(path))
        i, node = leaf
        kind = type(node).__name__ if isinstance(node, torch.Tensor) or is_non_tensor(node) else "tensor"
        rest = path[i + 1] if i + 2 == len(path) else path[i + 1:]
        return KeyThroughLeafError(
            f"Key {key_repr(path)} not found in {type(self).__name__}: {path[i]!r} is a "
            f"{kind}, not a tensordict, so it has no entry {rest!r}. "
            f"Read {key_repr(path[: i + 1])} itself, or set another key."
        )

    def _missing_key_message(self, path: tuple[str, ...]) -> str:
        existing = [k for k in self.keys(include_nested=True)]
        return (
            f"Key {key_repr(path)} not found in {type(self).__name__} with keys "
            f"{existing}. td.get(key) gives None (or td.get(key, default) the default) for a missing key."
        )

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, str) or (isinstance(index, tuple) and is_nested_key(index)):
            value = self.get(index, RAISE)
            return value._read_value() if is_non_tensor(value) else value
        return self._index(index)

    def __setitem__(self, index: Any, value: Any) -> None:
        if isinstance(index, str) or (isinstance(index, tuple) and is_nested_key(index)):
            self.set(index, value)
        else:
            self._set_rows(index, value)

    def _set_rows(self, index: Any, value: Any) -> None:
        """``self[index] = value`` for a batch index (a class may normalize it once)."""
        self._set_at_index(index, self._row_source(index, value))

    def _row_source(self, index: Any, value: Any, rows: torch.Size | None = None) -> Any:
        """What ``self[index] = value`` writes, as tensordict checks it: a dict becomes a
        tensordict of the indexed rows' batch size (its leaves have those batch dims), and
        a tensordict's batch size must be theirs, or their last dims (it is expanded, as
        tensordict does: ``td[:1] = td[0]``; see batch.rows_source). Numbers and tensors
        broadcast to every leaf, as before. (Only here, where the user writes: the writes
        into nested entries are checked leaf by leaf.)"""
        if is_non_tensor(self) or (not isinstance(value, dict) and (
                not is_tensor_collection(value) or is_non_tensor(value))):
            return value  # (a dict written into a non-tensor container is a value)
        if rows is None:
            rows = batch_ops.index_and_size(index, self.batch_size)[1]
        if isinstance(value, dict):
            from shared_td.containers.tensordict import TensorDict  # (it imports this module)

            return TensorDict(value, batch_size=rows)
        if value.batch_size != rows:
            value = batch_ops.rows_source(index, value, rows, self.batch_size)
        return value

    def __delitem__(self, key: NestedKey) -> None:
        self.del_(key)

    def set(self, key: NestedKey, value: Any, inplace: bool = False, *, non_blocking: bool = False) -> "TensorDictBase":
        """Add or replace the entry ``key``; returns self.

        ``inplace=True`` (also by position: ``set(key, value, True)``) writes into the
        existing entry when there is one (allowed on a locked tensordict); into a nested
        tensordict as ``update(value, inplace=True)`` (keys it lacks are added, as in
        tensordict). Missing parents are created; ``non_blocking`` is ignored.

        Raises:
            LockedTensorDictError: (a RuntimeError) when locked and an entry would be added
                or replaced. BatchSizeMismatchError: (ValueError/RuntimeError) when the
                value's leading dims differ from the batch size.
        """
        if value is self:  # checked before a nested key's missing parents are added
            raise self_nesting_error(key)
        if inplace and self._merged_in_place(key, value):
            return self
        if isinstance(key, str):  # a key of this node: no path to walk (most calls)
            self._set_str(key, value, inplace=inplace, validated=False)
            return self
        path = unravel_key(key)
        parent = self._parent_for_write(path, create=True)
        parent._set_str(path[-1], value, inplace=inplace, validated=False)
        return self

    def set_(self, key: NestedKey, value: Any, *, non_blocking: bool = False) -> "TensorDictBase":
        """Write ``value`` into the existing entry ``key``, in place; returns self (allowed when locked).

        Raises:
            KeyError: if ``key``, or a key of a tensordict written into a nested one, is
                missing (use ``set`` to add it; tensordict 0.15.3 drops the latter).
        """
        path = unravel_key(key)
        current = self._get_path(path, None)
        if current is None:
            raise KeyError(
                f"set_() writes in place into an existing entry, but key {key_repr(path)} "
                f"does not exist: not found in {type(self).__name__}. Use set() to add it."
            )
        self._check_set_(path, current, value)  # (named by the full key, as set_)
        return self._write_in_place(path, value)

    def _write_in_place(self, path: tuple, value: Any) -> "TensorDictBase":
        """``set_``'s write, for one checked already (an update's plan: no check twice)."""
        self._parent_for_write(path, create=False)._set_str(path[-1], value, inplace=True, validated=False)
        return self

    def _deepest_existing_parent(self, path: tuple[str, ...]) -> tuple["TensorDictBase", int]:
        """The deepest tensordict on the way to ``path``'s parent and how many parts of
        ``path`` lead to it (``len(path) - 1`` when the parent exists).

        Raises KeyError if a part on the way holds a tensor or non-tensor value.
        """
        node: TensorDictBase = self
        for i, part in enumerate(path[:-1]):
            child = node._get_str(part, None)
            if child is None:
                return node, i
            if not is_tensor_collection(child) or is_non_tensor(child):
                raise KeyError(
                    f"Cannot write nested key {key_repr(path)}: {key_repr(path[: i + 1])} "
                    f"holds a {type(child).__name__}, not a tensordict."
                )
            node = unwrap_tensorclass(child)
        return node, len(path) - 1

    def _parent_for_write(self, path: tuple[str, ...], *, create: bool) -> "TensorDictBase":
        node, depth = self._deepest_existing_parent(path)
        if depth < len(path) - 1 and not create:
            raise KeyError(self._missing_key_message(path[: depth + 1]))
        for i in range(depth, len(path) - 1):
            node._check_unlocked(path[: i + 1], "add")
            child = node._empty_child()
            node._set_str(path[i], child, inplace=False, validated=True)
            node = child
        return node

    def _convert(self, key: str, value: Any, into: Any = None) -> Any:
        """``value`` as this class stores it, checked against the batch size (``into``:
        the entry an in-place write goes to).

        A subclass that does not override it validates in ``_set_str`` instead.
        """
        return value

    def _checked_set(self, path: tuple[str, ...], value: Any) -> Any:
        """Check, without writing anything, that ``set(path, value)`` would succeed;
        returns the converted value to pass to it."""
        node, depth = self._deepest_existing_parent(path)
        if depth < len(path) - 1:  # the missing tensordicts would be added to node
            node._check_unlocked(path[: depth + 1], "add")
        else:
            exists = node._get_str(path[-1], None) is not None
            node._check_unlocked(path, "replace" if exists else "add")
        # A missing intermediate tensordict gets node's batch size and device.
        return node._convert(path[-1], value)

    def _checked_set_(self, path: tuple[str, ...], current: Any, value: Any) -> Any:
        """Check, without writing anything, that ``set_(path, value)`` would succeed;
        returns the converted value to pass to it."""
        parent, _ = self._deepest_existing_parent(path)
        value = parent._convert(path[-1], value, into=current)
        check_write_into(current, value, path)
        return value

    def del_(self, key: NestedKey) -> "TensorDictBase":
        """Remove the entry ``key``; returns self.

        Raises:
            KeyError: if missing. LockedTensorDictError: if locked.
        """
        path = unravel_key(key)
        if self._get_path(path, None) is None:
            raise self._missing_key_error(path)
        self._check_removable(path)
        self._parent_for_write(path, create=False)._del_str(path[-1])
        return self

    def _check_removable(self, path: tuple) -> None:
        """Raise as ``del_(path)`` would for a lock, changing nothing (a path this
        tensordict lacks: nothing to check)."""
        if self._get_path(path, None) is not None:
            self._parent_for_write(path, create=False)._check_unlocked(path, "remove")

    def pop(self, key: NestedKey, default: Any = NO_DEFAULT) -> Any:
        """Remove the entry ``key`` and return it (or ``default`` when it is missing)."""
        path = unravel_key(key)
        value = self._get_path(path, NO_DEFAULT)
        if value is NO_DEFAULT:
            if default is NO_DEFAULT:
                raise self._missing_key_error(path)
            return default
        self.del_(path)
        return value

    def get_non_tensor(self, key: NestedKey, default: Any = NO_DEFAULT) -> Any:
        """The plain Python value of a non-tensor entry (``td["task"]`` does the same)."""
        value = self.get(key, RAISE if default is NO_DEFAULT else default)
        return value._python_value() if is_non_tensor(value) else value

    def is_non_tensor(self, key: NestedKey) -> bool:
        """True if the entry at ``key`` is a NonTensorData or NonTensorStack (the stored
        entry: a tensorclass's ``get`` gives the value inside). KeyError if missing."""
        return is_non_tensor(self.get(key, RAISE))

    def rename_key_(self, old_key: NestedKey, new_key: NestedKey, safe: bool = False):
        """Move entry ``old_key`` to ``new_key``; returns self. ``safe=True`` refuses to
        overwrite an existing ``new_key`` (KeyError). A lazy stack renames in each member."""
        from shared_td.containers.keyops import renamed_in_members  # (it imports this module)
        old, new = unravel_key(old_key), unravel_key(new_key)
        if renamed_in_members(self, old, new, safe):  # (its get() would give a stacked copy)
            return self
        value = self.get(old, RAISE)
        # the lock first, as tensordict: a locked tensordict refuses any rename
        self._parent_for_write(old, create=False)._check_unlocked(old, "rename")
        below = is_below(new, old)  # (renamed below itself: what is at new moves too)
        if safe and new != old and not below and new in self.keys(include_nested=True):  # (to itself: nothing)
            raise KeyError(f"Key {key_repr(new)} is already present in TensorDict; pass safe=False to replace it.")
        if getattr(value, "_through_members", None) is not None and old != new:
            # a lazy stack's non-tensor entry (a NonTensorStack whose writes reach the
            # members' entries at old): those entries leave with the rename, so the moved
            # stack is its own (its writes went to the members' old key: a KeyError)
            value._through_members = None
        if below:
            # a key renamed to a key below itself: removed first, then set under a new
            # tensordict at its old key, as tensordict 0.15.3 (setting first wrote the entry
            # into itself: a ValueError, or for a tensorclass a field, then all was deleted)
            self.del_(old)
            try:
                self.set(new, value)
            except BaseException:
                self.set(old, value)
                raise
            return self
        self.set(new, value)
        if old != new and not is_below(old, new):  # (a key renamed to its parent: the set replaced it)
            self.del_(old)
        return self

    # ---------------------------------------------------------------- pickling
    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_lock_parents"] = {}
        state.pop("_row_write_plan", None)  # a cache of this process's leaves (see row_writes)
        state["_context_ops"] = []
        if isinstance(state.get("_last_op"), tuple):  # a with-block write-back (keyops.py)
            del state["_last_op"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if self._is_locked:
            self.lock_()

    # copy.deepcopy: clone()'s semantics, the memo kept (a function of consolidated_pickle,
    # whose frame consolidated_extras skips to find the memo of a consolidated tree's copy)
    __deepcopy__ = deepcopy_collection

    # ---------------------------------------------------------------- sharing flags
    def is_shared(self) -> bool:
        """True after share_memory_() (until unlock_()), and always for a tensordict whose
        device is CUDA and that is not memory-mapped (CUDA tensors are shared between
        processes as they are, as in tensordict)."""
        return self._is_shared or (on_cuda(self.device) and not self._is_memmap)

    def is_memmap(self) -> bool:
        """True when every leaf is a MemoryMappedTensor set by memmap_() (until unlock_())."""
        return self._is_memmap

    # ---------------------------------------------------------------- conversions
    def to_dict(self, *, retain_none: bool = True) -> dict:
        """A nested dict of the entries (non-tensors as their Python values; a
        non-tensor entry itself gives its value, a stack its nested lists).

        ``retain_none=False`` leaves out, as tensordict 0.15.3, the non-tensor entries
        that hold None (a stack: only None), nested ones too, and so the empty fields
        of nested tensorclasses (which ``retain_none=True`` gives as None)."""
        if is_non_tensor(self):
            return self._python_value()
        out = {}
        for key, value in self._items_str():
            if isinstance(value, torch.Tensor):  # most entries: no class to ask about
                out[key] = value
            elif is_non_tensor(value):
                if retain_none or not holds_only_none(value):
                    out[key] = value._python_value()
            elif is_tensor_collection(value):
                out[key] = value.to_dict(retain_none=retain_none)
            else:
                out[key] = value
        return out

    def cpu(self) -> "TensorDictBase":
        """A copy on the CPU (self if already there)."""
        return self.to("cpu")

    def cuda(self, device: Any = None, **kwargs: Any) -> "TensorDictBase":
        """A copy on a CUDA device (self if already there): ``device`` None (the current
        one), an index or a CUDA device; ``kwargs`` go to :meth:`to`. A device of another
        type is a RuntimeError, as in tensordict."""
        if isinstance(device, int):
            device = f"cuda:{device}"
        device = parse_device("cuda" if device is None else device)
        if device.type != "cuda":
            raise RuntimeError(f"cuda(device={device}): a CUDA device is needed; use .to({str(device)!r}).")
        return self.to(device, **kwargs)

    def __repr__(self) -> str:
        from shared_td.containers.formatting import format_collection

        return format_collection(self)

    # ---------------------------------------------------------------- torch functions
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        from shared_td.containers.functions import TORCH_FUNCTIONS

        handler = TORCH_FUNCTIONS.get(func)
        if handler is None:  # named here (torch would say "Multiple dispatch failed"); no cost above
            from shared_td.containers.unsupported_options import unsupported_torch_function
            raise unsupported_torch_function(func, cls)
        return handler(*args, **(kwargs or {}))


def holds_only_none(entry: Any) -> bool:
    """Whether the non-tensor ``entry`` holds None only (what ``to_dict(retain_none=False)``
    leaves out): a NonTensorData of None, or a non-empty stack of None values."""
    values = entry._flat_values()
    return entry.data is None if not values else all(value is None for value in values)
