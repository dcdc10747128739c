"""The non-tensor API of every tensordict class (tensordict 0.15.3's names):
``set_non_tensor``, ``non_tensor_items``, ``filter_non_tensor_data``; and what a Python
list becomes in a tensordict, and the check of an indexed write into non-tensor data.

``get_non_tensor`` lives beside ``get`` in ``base``.
"""
from __future__ import annotations

import numbers
from typing import Any, Iterator

import torch

from shared_td.containers import batch as batch_ops
from shared_td.containers.nontensor_options import list_to_stack
from shared_td.nontensor_values import same_value
from shared_td.containers.value_kinds import is_lazy_stack, is_leaf_nontensor, is_non_tensor, is_tensor_collection
from shared_td.errors import BatchSizeMismatchError
from shared_td.keys import NestedKey, key_repr
from shared_td.tensorclass_protocol import unwrap_tensorclass


class NonTensorOps:
    """Mixin of TensorDictBase, whose methods tensorclasses get too (it relies on
    ``set``, ``items``, ``exclude``, ``batch_size`` and ``device``)."""

    def set_non_tensor(self, key: NestedKey, value: Any) -> Any:
        """Store ``value`` as a Python value (a NonTensorData), whatever its type: even
        a tensor or a number is kept as it is, not converted; returns self.

        Raises:
            LockedTensorDictError: when locked (as ``set``).
        """
        from shared_td.containers.nontensor import NonTensorData

        return self.set(key, NonTensorData(value, batch_size=self.batch_size, device=self.device))

    def non_tensor_items(self, include_nested: bool = False) -> Iterator[tuple[NestedKey, Any]]:
        """``(key, entry)`` of every NonTensorData and NonTensorStack entry (nested ones
        too, as tuple keys, with ``include_nested``); the entries, not their values. A
        lazy stack reads only its non-tensor keys (every member holds non-tensor data
        there): a tensor key whose members' shapes differ cannot be read stacked."""
        if is_lazy_stack(self):
            for key in self.keys(include_nested, True, is_leaf_nontensor):
                if _non_tensor_in_every_member(self, key):
                    yield key, self.get(key)
            return
        for key, value in self.items():  # a nested lazy stack answers for its own keys
            if is_non_tensor(value):
                yield key, value
            elif include_nested and is_tensor_collection(value):
                for inner, entry in unwrap_tensorclass(value).non_tensor_items(True):
                    yield (key, *inner) if isinstance(inner, tuple) else (key, inner), entry

    def filter_non_tensor_data(self) -> Any:
        """A new tensordict without the non-tensor entries, at any depth (the nested
        tensordicts stay, even when they become empty); it shares the tensors."""
        return self.exclude(*[key for key, _ in self.non_tensor_items(include_nested=True)])


def _non_tensor_in_every_member(stack: Any, key: NestedKey) -> bool:
    """Whether every member of the lazy ``stack`` (and of lazy stacks in it) holds
    non-tensor data at ``key``, read member by member (never stacked)."""
    for member in stack.tensordicts:
        member = unwrap_tensorclass(member)
        if is_lazy_stack(member):
            if not _non_tensor_in_every_member(member, key):
                return False
        elif not is_non_tensor(member.get(key, None)):
            return False
    return True


# ------------------------------------------------- what a Python value becomes
def check_non_tensor_write(current: Any, index: tuple, source: Any, key: str | tuple) -> None:
    """Raise unless ``current._set_at(index, source)`` can write ``source``'s values
    (one, or one per indexed element) into the indexed elements, and store them where
    ``current`` keeps its values (a shared cell, files: ``_check_storable``); writes
    nothing. ``key``: the entry's key (a tuple: its full nested key), for the errors."""
    from shared_td.containers.nontensor import NonTensorData, as_non_tensor, broadcast_values

    name = key_repr(key) if isinstance(key, tuple) else repr(key)
    if is_tensor_collection(source) and not is_non_tensor(source):
        # (as set_/update_ refuse it, and tensordict 0.15.3: it became every indexed
        # element's Python value, the whole tensordict in each, not its rows)
        from shared_td.errors import InPlaceKindError

        raise InPlaceKindError(
            f"Cannot write a {type(source).__name__} into the non-tensor entry {name} at an "
            "index: replace the entry with set() (not in place), or wrap a value meant as "
            "Python data in NonTensorData(value)."
        )
    source = as_non_tensor(source)  # (a list: one value per indexed element)
    current._refuse_copy_write_at(index, source)  # a piece of a stored stack: the write would be lost
    shared_or_files = current._shared_value is not None or current.is_memmap()
    if isinstance(current, NonTensorData) and shared_or_files and not current._stays_one_value(index, source):
        # one value for the whole batch, shared with other processes or kept in files:
        # per-element values would turn it into a private in-memory stack
        raise RuntimeError(
            f"Cannot write per-element values into the non-tensor entry {name}: it is a "
            "NonTensorData (one value for the whole batch) that is "
            + ("shared with share_non_tensor=True: write the whole value with set_() or update_()."
               if current._shared_value is not None else
               "memory-mapped: write the whole value with set_() or update_(), or unlock_() first.")
        )
    target = batch_ops.indexed_batch_size(current.batch_size, index)
    try:
        values = broadcast_values(source, target)
    except BatchSizeMismatchError as error:
        raise BatchSizeMismatchError(f"Cannot write into non-tensor entry {name}: {error}") from None
    current._check_storable(values, key)


def one_value_into(current: Any, value: Any) -> Any:
    """``value`` as one value when it is written in place into ``current``, a
    NonTensorData (one value for its batch), and holds one value per element that are
    all the same: a NonTensorStack of equal values, or (written again) a tensor whose
    elements all equal the number ``current`` holds. Anything else is returned as it is
    (the write's own check then refuses what it must).

    A lazy stack splits a value along its stack dim, so ``lazy.update_(lazy.to_dict())``
    gives each member's NonTensorData one value per element: taken so, that round trip
    works as it does for a TensorDict. Any other tensor stays refused (it would hide a
    write meant for a tensor entry), and so do values that differ.

    Example:
        >>> from shared_td.containers.nontensor import NonTensorData, NonTensorStack
        >>> one_value_into(NonTensorData("walk", batch_size=[2]), NonTensorStack.from_list(["run", "run"])).data
        'run'
        >>> one_value_into(NonTensorData(6, batch_size=[2]), torch.tensor([6, 6])).data
        6
        >>> type(one_value_into(NonTensorData("walk", batch_size=[2]), NonTensorStack.from_list(["a", "b"]))).__name__
        'NonTensorStack'
    """
    from shared_td.containers.nontensor import NonTensorData, NonTensorStack

    if not isinstance(current, NonTensorData):
        return value
    if isinstance(value, NonTensorStack) and value.batch_size == current.batch_size:
        values = value._flat_values()
        if not values:  # a stack of no element (a 0-sized batch dim) writes no value: current's is kept
            return NonTensorData(current.data, batch_size=current.batch_size, device=current.device)
        if all(same_value(v, values[0]) for v in values[1:]):
            return NonTensorData(values[0], batch_size=current.batch_size, device=current.device)
    elif (isinstance(value, torch.Tensor) and value.shape == current.batch_size and value.numel()
          and isinstance(current.data, numbers.Number) and same_value(value, current.data)):
        return NonTensorData(current.data, batch_size=current.batch_size, device=current.device)
    return value


def non_tensor_over_rows(leaf: Any, part_batch: torch.Size, rows: torch.Size) -> Any:
    """The non-tensor entry ``leaf`` of a source written into ``rows`` of a lazy stack,
    where the entry's part has batch size ``part_batch``, broadcast as a tensor would be:
    a NonTensorData is one value for every row, a NonTensorStack's values (one per element
    of a nested node) are repeated over the part's leading dims (left to the row-by-row
    path, the node's first dim was taken as the rows'). None if ``leaf``'s batch size is
    not the last dims of ``part_batch`` (it does not broadcast there).

    Example:
        >>> from shared_td import NonTensorStack
        >>> non_tensor_over_rows(NonTensorStack("a", "b"), torch.Size([3, 2]), torch.Size([3])).tolist()
        [['a', 'b'], ['a', 'b'], ['a', 'b']]
    """
    from shared_td.containers.nontensor import NonTensorData

    size = leaf.batch_size
    lead = len(part_batch) - len(size)
    if lead < 0 or tuple(part_batch[lead:]) != tuple(size):
        return None
    if isinstance(leaf, NonTensorData):
        return NonTensorData(leaf.data, batch_size=rows)
    values = leaf.tolist()
    for dim in reversed(part_batch[:lead]):
        values = [values] * dim
    return type(leaf).from_list(values)


def list_to_tensor(value: list | tuple) -> Any:
    """Numbers become a tensor (as tensordict does); other values stay Python."""
    try:
        return torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError):
        return value


def list_to_entry(value: list, device: Any) -> Any:
    """A list as tensordict 0.15.3 stores it: numbers (nested lists of numbers) become a
    tensor (numpy scalars and complex numbers too, where tensordict keeps them as
    values), tensors of one shape are stacked, anything else (tensors beside numbers
    too) is a NonTensorStack with one value per element (equal-length inner lists are
    more dims), whose batch size is then checked like a tensor's: ``["a", "b", "c"]``
    fits a batch size of ``[3]``."""
    from shared_td.containers.nontensor import NonTensorData, NonTensorStack

    tensors = [isinstance(v, torch.Tensor) for v in value]
    if value and all(tensors) and len({v.shape for v in value}) == 1:
        return torch.stack(value)
    if not list_to_stack():  # set_list_to_stack(False): a list that is no tensor is one value
        converted = list_to_tensor(value)
        return converted if isinstance(converted, torch.Tensor) else NonTensorData(value, device=device)
    if any(tensors):  # of several shapes, or beside other values: one value each, as tensordict keeps them
        return NonTensorStack._from_flat(value, torch.Size([len(value)]), device)
    converted = list_to_tensor(value)
    if isinstance(converted, torch.Tensor):
        return converted
    return NonTensorStack.from_list(value, device=device)


def kept_by_empty(entry: Any, batch_size: torch.Size) -> Any:
    """What ``empty(recurse=True)`` keeps of a non-tensor entry (None: nothing): the
    entry itself, shared, as tensordict 0.15.3 does, when its batch shape begins with
    ``batch_size``; for another batch size, a NonTensorData's value re-batched, while a
    NonTensorStack's values belong to the old batch elements and are left out."""
    from shared_td.containers.nontensor import NonTensorData

    if tuple(entry.batch_size[: len(batch_size)]) == tuple(batch_size):
        return entry
    if isinstance(entry, NonTensorData):
        return NonTensorData(entry.data, batch_size=batch_size, device=entry.device)
    return None


def from_dict_values(entries: dict, device: Any = None, numbers_batch: Any = None) -> dict:
    """``entries`` (nested dicts too) with lists and tuples read as tensordict 0.15.3's
    ``from_dict`` reads them (its ``from_any``), which is stricter than the constructor:
    a list becomes a tensor only when its numbers (nested lists' too, of one length)
    are all of one Python type, else a NonTensorStack (``[True, 1.5]``, ``[1, 2.5]``,
    ``[tensor, tensor]``); a tuple becomes a nested dict keyed ``"0"``, ``"1"``, ...
    (a named tuple: by its fields). With ``numbers_batch`` (a batch size with dims),
    each Python number is a NonTensorData of it, as tensordict's from_dict makes it (a
    0-d tensor cannot have those dims).

    Example:
        >>> type(from_dict_values({"a": [1, 2.5]})["a"]).__name__
        'NonTensorStack'
        >>> from_dict_values({"a": [1, 2], "t": (3, "x")})
        {'a': [1, 2], 't': {'0': 3, '1': 'x'}}
    """
    from shared_td.containers.nontensor import NonTensorData, NonTensorStack

    out = {}
    for key, value in entries.items():
        if isinstance(value, tuple):
            fields = getattr(value, "_fields", None)  # a named tuple
            value = dict(zip(fields, value)) if fields else {str(i): v for i, v in enumerate(value)}
        if isinstance(value, dict):
            value = from_dict_values(value, device, numbers_batch)
        elif isinstance(value, list) and _number_list_shape(value) is None:
            value = NonTensorStack.from_list(value, device=device)
        elif numbers_batch is not None and isinstance(value, (bool, int, float, complex)):
            value = NonTensorData(value, batch_size=numbers_batch)
        out[key] = value
    return out


def _number_list_shape(value: list) -> tuple | None:
    """(shape, {its one Python number type}) of a list of numbers (nested lists of one
    shape too; an empty list has no type), or None if it is anything else."""
    kinds, shapes = set(), set()
    for item in value:
        if isinstance(item, list):
            inner = _number_list_shape(item)
            if inner is None:
                return None
            shapes.add(inner[0])
            kinds.update(inner[1])
        elif isinstance(item, numbers.Number) and not isinstance(item, torch.Tensor):
            kinds.add(type(item))
        else:
            return None
        if len(kinds) > 1 or len(shapes) > 1:
            return None
    return ((len(value), *next(iter(shapes), ())), kinds)
