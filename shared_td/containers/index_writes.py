"""The general write of ``td[index] = value`` into a TensorDict: every entry checked,
then written, so that a failing write leaves the tensordict unchanged.

``TensorDict._set_at_index`` (tensordict.py) first tries the fast lane of a write of the
same structure as the last one (row_writes.py); anything else comes here:
``_plan_index_writes`` walks the source and the destination together, raises (naming the
key and the shapes) at the first entry that cannot take its value, and otherwise
appends one closure per write to the caller's list, which runs them once all are planned.
A key that the destination lacks gets a new zero entry of the destination's batch size,
added by its own closure, so that a failing write adds no key either. What torch itself
would refuse inside a closure is settled here too (``row_writes.fit_source``): a source
of another dtype is cast to the entry's, as torch casts it into a slice (its
``index_put_`` refuses it), and a write that torch refuses for memory overlap raises.
"""
from __future__ import annotations

import numbers
from typing import Any, Callable

import torch

from shared_td.containers import batch as batch_ops
from shared_td.containers.base import is_non_tensor, is_tensor_collection
from shared_td.containers.nontensor import NonTensorData, NonTensorStack
from shared_td.containers.nontensor_ops import check_non_tensor_write
from shared_td.containers.row_writes import fit_source
from shared_td.containers.tensorclass_compat import check_row_write
from shared_td.errors import BatchSizeMismatchError, IndexTypeError
from shared_td.keys import RAISE, key_repr, unravel_key
from shared_td.memmap_tensor import refuse_read_only
from shared_td.tensorclass_protocol import unwrap_tensorclass


class IndexWrites:
    """Mixin of TensorDict (it relies on ``_tensordict``, ``_batch_size``, ``batch_dims``,
    ``_leaf_tensors`` and ``_check_unlocked``)."""

    def _plan_index_writes(self, index: tuple, value: Any, writes: list, target_batch: torch.Size,
                           *, path: tuple = (), check_classes: bool = False) -> None:
        """Check ``self[index] = value`` and append the closures that perform it to
        ``writes``; nothing is written here. ``target_batch``: the batch size after
        indexing (``batch_ops.index_and_size``). ``path``: where self is in the
        tensordict written into, so that errors name the full key. ``check_classes``:
        refuse a tensorclass of another class with other fields written into a nested
        tensorclass, at every depth (``td[idx] = src``, as tensordict's __setitem__),
        but not below a lazy stack, whose members take it in tensordict too."""
        # ``index`` names batch dims only (normalized), so an entry's indexed shape is
        # the indexed batch size followed by its own feature dims.
        if not path:  # (the top of the write: nested tensordicts get the index owned here)
            index = own_index(index, self)
        if not is_tensor_collection(value):  # one tensor or number for every tensor leaf
            if not isinstance(value, (torch.Tensor, bool, int, float, complex)):
                raise TypeError(
                    f"Cannot write a {type(value).__name__} at index {index!r} of a "
                    "tensordict: give a tensordict, a dict, a tensor or a number."
                )
            # Entry by entry, a nested tensordict or lazy stack planning its own (a lazy
            # stack's leaves read through it are stacked copies: its members are written),
            # with the keys, so that a value that does not fit names the entry.
            for key, entry in self._tensordict.items():
                if isinstance(entry, torch.Tensor):
                    refuse_read_only(entry, "td[index] = value")
                    if isinstance(value, torch.Tensor):
                        check_indexed_fits(value, target_batch + entry.shape[self.batch_dims:], path + (key,), index)
                    fitted = fit_source(entry, index, value, path + (key,))  # (cast to its dtype)
                    writes.append(lambda entry=entry, fitted=fitted: entry.__setitem__(index, fitted))
                elif is_tensor_collection(entry) and not is_non_tensor(entry):
                    inner = unwrap_tensorclass(entry)
                    inner_batch = target_batch + inner.batch_size[self.batch_dims:]
                    inner._plan_index_writes(index, value, writes, inner_batch, path=path + (key,))
                # (non-tensor entries take no tensor or number)
            return
        for key in value._keys_str():
            source = value._get_str(key, None)
            current = self._tensordict.get(key)
            added = current is None
            if added:
                self._check_unlocked((key,), "add")
                # A new, detached entry: filled by the closures planned below.
                current = _zeros_like_entry(source, self._batch_size, target_batch)
                writes.append(lambda key=key, entry=current: self._tensordict.__setitem__(key, entry))
            if isinstance(current, torch.Tensor):
                if not isinstance(source, torch.Tensor):
                    raise TypeError(f"Cannot write a {type(source).__name__} into tensor entry {key!r}.")
                check_indexed_fits(source, target_batch + current.shape[self.batch_dims:], path + (key,), index)
                refuse_read_only(current, "td[index] = value")
                # (cast to the entry's dtype, and torch's overlap refusals checked: see row_writes)
                source = fit_source(current, index, source, path + (key,))
                writes.append(lambda current=current, source=source: current.__setitem__(index, source))
            elif is_non_tensor(current):
                check_non_tensor_write(current, index, source, path + (key,))
                write = lambda key=key, current=current, source=source: self._tensordict.__setitem__(  # noqa: E731
                    key, current._set_at(index, source)
                )
                if added:  # (a new key: filled after the closure that adds it)
                    writes.append(write)
                else:
                    store_first(writes, write)
            else:
                # A tensor goes into every tensor leaf of the nested tensordict, as in
                # tensordict 0.15.3 (it was refused before).
                if not isinstance(source, torch.Tensor) and (
                    not is_tensor_collection(source) or is_non_tensor(source)
                ):
                    raise TypeError(
                        f"Cannot write a {type(source).__name__} into the nested tensordict "
                        f"{key!r}: give a tensordict or dict of its entries, or a tensor "
                        "for every one of its leaves."
                    )
                # (a nested TensorDict or lazy stack: each plans its writes, checked
                # here, so that one failing below a lazy stack leaves the tree unchanged;
                # a nested tensorclass takes another class only with the same fields, as
                # tensordict's __setitem__ at every depth)
                inner = unwrap_tensorclass(current)
                inner_batch = target_batch + inner.batch_size[self.batch_dims:]
                checks = {}
                # (below a lazy stack only keys that are no field are refused: they would
                # be added into the tensorclass, whose copies then read as TensorDicts)
                check_row_write(current, source, path + (key,), fields_only=not check_classes)
                if check_classes and type(inner) is type(self):  # (a lazy stack's members are not checked)
                    checks = {"check_classes": True}
                inner._plan_index_writes(index, unwrap_tensorclass(source), writes, inner_batch,
                                         path=path + (key,), **checks)


def store_first(writes: list, write: Callable[[], None]) -> None:
    """Put ``write``, a store of new values into an existing non-tensor entry, before
    the tensor writes planned so far, after the other such stores. A store may fail in a
    way no plan can check (a shared cell's memory or a memory-mapped entry's disk is
    full): run first, it then fails before any tensor leaf is written. (The entries are
    distinct: no write reads what another one writes.)

    Example:
        >>> writes = [lambda: "tensor a"]
        >>> store_first(writes, lambda: "text s"); store_first(writes, lambda: "text t")
        >>> [write() for write in writes]
        ['text s', 'text t', 'tensor a']
    """
    write.stores_first = True
    at = 0
    while at < len(writes) and getattr(writes[at], "stores_first", False):
        at += 1
    writes.insert(at, write)


def check_indexed_fits(source: torch.Tensor, expected: torch.Size, key: tuple, index: tuple) -> None:
    """Raise unless ``source`` fits ``expected``, the shape of the indexed entry ``key``
    (its full path: a top-level key is named as a string), as torch's ``leaf[index] =
    source`` takes it: extra leading size-1 dims dropped, then broadcast."""
    if not batch_ops.fits_indexed_write(source.shape, expected):
        name = repr(key[0] if len(key) == 1 else key)
        raise BatchSizeMismatchError(
            f"Cannot write a value of shape {list(source.shape)} into entry {name} at "
            f"{index!r}: expected shape {list(expected)} (or one that broadcasts to it)."
        )


def _zeros_like_entry(source: Any, batch_size: torch.Size, target_batch: torch.Size) -> Any:
    """A zero entry for ``td[idx] = other`` when ``other`` has a key self lacks."""
    if isinstance(source, torch.Tensor):
        feature = source.shape[len(target_batch):]
        return torch.zeros(batch_size + feature, dtype=source.dtype, device=source.device)
    if is_non_tensor(source):
        # As tensordict 0.15.3: one value (a NonTensorData) fills the new entry's every
        # row, the rows not written included; a stack's values leave None in the others.
        value = None if isinstance(source, NonTensorStack) else source.data
        return NonTensorData(value, batch_size=batch_size)
    if not hasattr(source, "empty"):
        return source
    # the source's own batch dims past the indexed ones stay, as a tensor's feature dims
    entry = source.empty(batch_size=batch_size + source.batch_size[len(target_batch):])
    # (a lazy stack of tensorclasses is that class around the stack: its members are inside)
    members, lazy = getattr(unwrap_tensorclass(entry), "tensordicts", None), unwrap_tensorclass(source)
    if members and getattr(lazy, "tensordicts", None) is not None:
        # a lazy stack of empty members: a member whose rows the index does not reach would
        # get no key, and the stack (the keys its members share) none either. Each member
        # starts with zero entries of the source's keys, as tensordict 0.15.3's zeros.
        dim = lazy.stack_dim
        source_member = lazy.batch_size[:dim] + lazy.batch_size[dim + 1:]
        for key in lazy._keys_str():
            value = lazy._get_str(key, None)
            if isinstance(value, NonTensorStack):  # (its members' values, not the first's: None when they differ)
                row = value
            elif isinstance(value, torch.Tensor):
                row = value.select(dim, 0)
            else:  # (a NonTensorData: its one value; a collection: one member's shape)
                row = value[(slice(None),) * dim + (0,)]
            for member in members:
                member.set(key, _zeros_like_entry(row, member.batch_size, source_member))
    return entry


def reads_entry_dims(index: Any, batch_size: torch.Size) -> bool:
    """True when ``index`` means something else on an entry than on the batch dims: an
    Ellipsis before its last part (on an entry it also covers the entry's own dims) or
    more parts than there are batch dims (they reach the entries' own dims).

    Example:
        >>> reads_entry_dims((Ellipsis, 0), torch.Size([3, 4])), reads_entry_dims((0, Ellipsis), torch.Size([3, 4]))
        (True, False)
    """
    parts = index if isinstance(index, tuple) else (index,)
    if any(part is Ellipsis for part in parts[:-1]):
        return True
    try:
        batch_ops.normalize_index(index, batch_size)
    except IndexTypeError:
        raise  # not an index on any dims (a float, a str): the TypeError and IndexError, as td[idx]
    except IndexError:
        return True
    return False


def entry_index_writes(target: Any, source: Any, index: Any, batch_paths: set, python_paths: Any = ()) -> tuple:
    """The writes of tensordict 0.15.3's ``target.update_at_(source, index)``, which is
    ``set_at_`` key by key: a tensor written into a tensor entry goes to ``entry[index]``,
    the index read on the entry's own dims (``(..., 0)`` is the entry's last dim), and a
    tensordict at one of ``batch_paths`` (a tensordict given as a value, not made from a
    nested dict) goes to the nested entry's ``[index]``, read on its batch dims; a
    NonTensorData goes into a non-tensor entry at ``[index]`` read on its batch dims (as
    set_at_ writes it), unless it was a plain Python value of the dict given (one of
    ``python_paths``), which tensordict refuses there. ``target`` is a TensorDict or a
    lazy stack (whose members are written).

    Everything is checked first, below lazy stacks and read-only members too; returns
    ``(writes, None)``, the closures that write, or ``(None, error)`` when a value does not
    fit so (or is not a tensor): the caller then writes as ``td[index] = source``, and
    raises ``error`` (which names the entry at fault) if that fails too.
    """
    writes: list = []
    index = own_index(index, target, [(key,) for key, _ in source._items_str()])

    def plan(node: Any, prefix: tuple, index: Any) -> None:
        for key, value in node._items_str():
            path = prefix + (key,)
            entry = unwrap_tensorclass(target._get_path(path, None))
            value = unwrap_tensorclass(value)
            branch = is_tensor_collection(entry) and not is_non_tensor(entry)
            if path in batch_paths and branch:  # a TensorDict or lazy stack: at its rows
                rows_index, rows = batch_ops.index_and_size(index, entry.batch_size)
                entry._plan_index_writes(rows_index, value, writes, rows, path=path)
            elif isinstance(value, torch.Tensor) and isinstance(entry, torch.Tensor):
                plan_set_at(target, path, value, index, writes, "update_at_", entry)
            elif is_non_tensor(value) and is_non_tensor(entry) and path not in python_paths:
                # decided entry by entry: a non-tensor entry is written at the index read
                # on its batch dims (tensordict's set_at_), and the tensor entries beside
                # it keep the entry-dims meaning (refusing it wrote the whole source as rows)
                plan_set_at(target, path, value, index, writes, "update_at_")
            elif hasattr(value, "_items_str") and not is_non_tensor(value) and branch:
                plan(value, path, index)  # a nested dict: its leaves are written as leaves
            else:  # (written as td[index] = ..., unless that fails too)
                kind = "non-tensor value" if is_non_tensor(value) else type(value).__name__
                hint = ("give a tensor, or NonTensorData(value) for a non-tensor entry (a plain "
                        "Python value is refused there, as in tensordict 0.15.3)." if path in python_paths
                        else "give a tensor.")
                raise TypeError(
                    f"update_at_(..., {index!r}): cannot write a {kind} into "
                    f"entry {key_repr(path)} with the index read on the entry's own dims: {hint}"
                )

    try:
        plan(source, (), index)
    except (RuntimeError, IndexError, TypeError, ValueError) as error:
        return None, error
    return writes, None


def plan_set_at(target: Any, path: tuple, value: Any, index: Any, writes: list, op: str = "set_at_",
                entry: Any = None) -> None:
    """Check ``target.set_at_(path, value, index)`` (``index`` read on the entry) and
    append the closure that writes it. Below a lazy stack (whose ``get`` gives a new
    stacked tensor) the stack plans it: the selected elements go into its members, whose
    tensors are checked (read-only ones too) here, before anything is written.
    ``entry``: the tensor at ``path``, when the caller has it already.

    Example:
        >>> td, writes = TensorDict(a=torch.zeros(3, 4), batch_size=[3]), []
        >>> plan_set_at(td, ("a",), torch.ones(3), (..., 0), writes)
        >>> td["a"].sum().item(), [write() for write in writes] and td["a"].sum().item()
        (0.0, 3.0)
    """
    index = own_index(index, target, [path])
    for depth in range(len(path)):
        node = target if depth == 0 else unwrap_tensorclass(target._get_path(path[:depth], None))
        if hasattr(node, "_plan_set_at"):  # a lazy stack
            node._plan_set_at(path[depth:], value, index, writes)
            return
    if entry is None:
        entry = unwrap_tensorclass(target.get(path, RAISE))  # (a KeyError naming a missing key)
    if is_tensor_collection(entry) and not is_non_tensor(entry):  # a nested tensordict: its rows
        rows_index, rows = batch_ops.index_and_size(index, entry.batch_size)
        entry._plan_index_writes(rows_index, entry._row_source(rows_index, value, rows), writes, rows, path=path)
        return
    if not isinstance(entry, torch.Tensor):  # a non-tensor: written by its node's set_at_
        node = unwrap_tensorclass(target.get(path[:-1], RAISE)) if len(path) > 1 else target
        check_non_tensor_write(entry, batch_ops.index_and_size(index, entry.batch_size)[0], value, path)
        store_first(writes, lambda: node.set_at_(path[-1], value, index))
        return
    if isinstance(value, torch.Tensor):
        check_indexed_fits(value, batch_ops.indexed_batch_size(entry.shape, index), path, index)
    refuse_read_only(entry, op)
    # (cast to the entry's dtype, and torch's overlap refusals checked: see row_writes)
    value = fit_source(entry, index, value, path, normalized=False)
    writes.append(lambda: entry.__setitem__(index, value))


def own_index(index: Any, root: Any, paths: Any = None) -> Any:
    """``index`` with each tensor in it that lies in the memory of a tensor of ``root``
    (its leaves, those of its nested tensordicts and of the members of its lazy stacks;
    only those at or below ``paths``, the keys written, when given) replaced by a copy,
    read before anything is written: the mask that is the buffer's own "done" leaf
    (``env[env["done"]] = reset``) selects for every entry the rows it selected before
    the write, whatever the order of the entries, and torch's refusal of an index in the
    memory it writes (which would fail the write halfway) cannot happen.

    Example:
        >>> from shared_td import TensorDict
        >>> env = TensorDict(done=torch.tensor([True, False]), obs=torch.ones(2), batch_size=[2])
        >>> env[env["done"]] = 0
        >>> env["done"].tolist(), env["obs"].tolist()
        ([False, False], [0.0, 1.0])
    """
    parts = index if isinstance(index, tuple) else (index,)
    tensors = [at for at, part in enumerate(parts) if isinstance(part, torch.Tensor)]
    if not tensors:
        return index
    leaves = _tree_tensors(root) if paths is None else (
        leaf for path in paths for leaf in _tree_tensors(root, path))
    # (a sparse or other non-strided leaf has no storage to compare, and a write never
    # reads its index from one: torch refuses such an index)
    spans = [_span(leaf) for leaf in leaves if leaf.layout == torch.strided]
    parts = list(parts)
    for at in tensors:
        low, high = _span(parts[at])
        if any(low < end and start < high for start, end in spans):
            parts[at] = parts[at].clone()
    return tuple(parts) if isinstance(index, tuple) else parts[0]


def _span(tensor: torch.Tensor) -> tuple:
    storage = tensor.untyped_storage()
    start = storage.data_ptr()
    return start, start + storage.nbytes()


def _tree_tensors(node: Any, path: tuple = ()) -> Any:
    """The tensors that a write into ``node`` (at ``path`` in it, when given) may write:
    its leaves, nested ones and the members' of its lazy stacks (whose own reads give
    new stacked tensors)."""
    node = unwrap_tensorclass(node)
    members = getattr(node, "tensordicts", None)
    if members is not None:
        for member in members:
            yield from _tree_tensors(member, path)
        return
    entries = getattr(node, "_tensordict", {})
    values = entries.values() if not path else [entries[path[0]]] if path[0] in entries else []
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif is_tensor_collection(value) and not is_non_tensor(value):
            yield from _tree_tensors(value, path[1:])


def python_values(given: Any, prefix: tuple = ()) -> set:
    """The paths of the plain Python values (a str, an object: neither a tensor nor a
    tensordict nor non-tensor data) in ``given``, a dict passed to ``update_at_``, its
    nested dicts walked into: tensordict 0.15.3 refuses them with an index read on the
    entries' dims (a TypeError), and writes a NonTensorData given there.

    Example:
        >>> sorted(python_values({"a": torch.ones(2), "s": "y", "n": {"t": "z"}}))
        [('n', 't'), ('s',)]
    """
    if not isinstance(given, dict):
        return set()
    paths = set()
    for key, value in given.items():
        path = prefix + (key,)
        if isinstance(value, dict):
            paths |= python_values(value, path)
        elif not isinstance(value, torch.Tensor) and not is_tensor_collection(value):
            paths.add(path)
    return paths


def numbers_kept(given: dict, target: Any, prefix: tuple = ()) -> dict:
    """``given``, a dict passed to ``update_at_`` (or a lazy stack's ``update_``), with
    each Python number whose entry in ``target`` is non-tensor data wrapped in a
    NonTensorData: it stays the number written (made a tensordict first, it was stored as
    ``tensor(0)``, or refused for its batch size), as ``set_at_`` and TensorDict's
    ``update_`` keep it.

    Example:
        >>> td = TensorDict(x=torch.zeros(2), s=["a", "b"], batch_size=[2])
        >>> numbers_kept({"x": 1, "s": 0}, td)["s"].data
        0
    """
    kept = {}
    for key, value in given.items():
        path = prefix + unravel_key(key)
        if isinstance(value, (dict, numbers.Number)):  # (only then is the entry looked up)
            # (a dict for a non-tensor entry is one Python value, as TensorDict.update_ keeps it)
            value = number_kept(value, target._get_path(path, None))
        if isinstance(value, dict):  # (one for a nested node: its entries in turn)
            value = numbers_kept(value, target, path)
        kept[key] = value
    return kept


def number_kept(value: Any, entry: Any) -> Any:
    """``value`` written in place into ``entry``: a Python number or dict into non-tensor
    data as a NonTensorData holding it (see :func:`numbers_kept`; a dict split as a
    tensordict was refused for its batch size), else as it is."""
    if isinstance(value, (numbers.Number, dict)) and is_non_tensor(entry):
        return NonTensorData(value)
    return value


def tensordict_values(given: Any, prefix: tuple = ()) -> set:
    """The paths of the tensordicts (and tensorclasses) given as values in ``given``, a
    dict or tensordict passed to ``update_at_``: the paths that tensordict writes along
    their batch dims (the nested dicts of a dict are walked into; a tensordict's nested
    entries are not)."""
    paths = set()
    items = given.items() if isinstance(given, dict) else given._items_str()
    for key, value in items:
        path = prefix + (key,)
        if isinstance(value, dict):
            paths |= tensordict_values(value, path)
        elif is_tensor_collection(value) and not is_non_tensor(value):
            paths.add(path)
    return paths
