"""Comparisons of tensordicts (``==``, ``<``, ...), ``all()``, ``any()`` and ``is_empty()``:
the mixin ComparisonOps of TensorDictBase."""
from __future__ import annotations

import numbers
import operator
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch

from shared_td.containers.value_kinds import is_leaf_nontensor, is_non_tensor, is_tensor_collection
from shared_td.errors import BatchSizeMismatchError
from shared_td.tensorclass_protocol import is_tensorclass, unwrap_tensorclass

if TYPE_CHECKING:  # (base imports this module)
    from shared_td.containers.base import TensorDictBase


class ComparisonOps:
    """Element-wise comparisons over the leaves, and the truth of a whole tree."""

    def _compare(self, other: Any, op: Callable, other_type: bool = False) -> "TensorDictBase | bool":
        from shared_td.containers.base import TensorDictBase  # (base imports this module)

        if isinstance(other, dict):
            other = type(self)(other, batch_size=self.batch_size)
        given = other
        other = unwrap_tensorclass(other)  # td == tc compares entry by entry, as tc == td
        if not isinstance(other, (TensorDictBase, torch.Tensor, numbers.Number)):
            # As tensordict 0.15.3: a value of another type (None, a str, a list, an
            # array) is not compared leaf by leaf: ``td == "z"`` is False, ``!=`` True.
            return other_type
        if isinstance(other, TensorDictBase):
            mine = set(self.keys(True, True, is_leaf_nontensor))
            missing = mine ^ set(other.keys(True, True, is_leaf_nontensor))
            excused = _none_field_entries(self, given, mine, missing) if missing else set()
            if missing - excused:
                raise KeyError(f"Cannot compare tensordicts with different keys: {sorted(map(str, missing - excused))}.")
            return self._map_leaves(lambda key, value, theirs: _ignored(value) if key in excused else op(value, theirs),
                                    (), other)
        if isinstance(other, torch.Tensor) and other.ndim:
            return self._compare_batch_tensor(other, op)
        return self._map_leaves(lambda key, value, theirs: op(value, theirs), (), other)

    def _compare_batch_tensor(self, other: torch.Tensor, op: Callable) -> "TensorDictBase":
        """``td == t`` for a tensor with dims, as tensordict 0.15.3: ``t``'s dims line up
        with the batch dims (from the right among them; the batch broadcasts with them,
        as ``expand``), and every leaf sees ``t`` over its own trailing dims: ``td ==
        torch.tensor([0., 1., 0.])`` of batch [3] compares row ``i`` of each leaf with
        ``t[i]`` (torch alone would line ``t`` up with a leaf's last dim)."""
        try:
            size = torch.broadcast_shapes(self.batch_size, other.shape)
        except RuntimeError as err:
            raise BatchSizeMismatchError(
                f"Cannot compare a tensordict of batch size {list(self.batch_size)} with a tensor of shape "
                f"{list(other.shape)}: the tensor's dims line up with the batch dims (from the right) and must "
                "broadcast with them. Index the tensordict, or reshape the tensor.") from err
        source = self if size == self.batch_size else self.expand(size)

        def leaf(key: Any, value: Any, theirs: torch.Tensor) -> Any:
            # (theirs: ``other`` over the batch dims of the node holding ``value``)
            feature_dims = 0 if is_non_tensor(value) else value.ndim - theirs.ndim
            return op(value, theirs.reshape(*theirs.shape, *[1] * feature_dims) if feature_dims else theirs)

        return source._map_leaves(leaf, (), other.expand(size))

    # Comparisons map over the leaves, as tensordict 0.15.3: tensors compare with torch's
    # operator; a non-tensor entry compares its values with the same entry of another
    # tensordict (== and !=), and is ignored otherwise (see _equal and _ordered), so
    # ``(td == 0).all()`` looks at the tensors only.
    def __eq__(self, other: Any) -> "TensorDictBase":  # type: ignore[override]
        return self._compare(other, _equal)

    def __ne__(self, other: Any) -> "TensorDictBase":  # type: ignore[override]
        return self._compare(other, _not_equal, other_type=True)

    def __lt__(self, other: Any) -> "TensorDictBase":
        return self._compare(other, _ordered(operator.lt))

    def __le__(self, other: Any) -> "TensorDictBase":
        return self._compare(other, _ordered(operator.le))

    def __gt__(self, other: Any) -> "TensorDictBase":
        return self._compare(other, _ordered(operator.gt))

    def __ge__(self, other: Any) -> "TensorDictBase":
        return self._compare(other, _ordered(operator.ge))

    __hash__ = None  # type: ignore[assignment]

    def all(self, dim: int | None = None) -> "bool | TensorDictBase":
        """True if every element of every tensor leaf is true; with ``dim`` (a batch dim,
        negative counts from the end), a TensorDict of each leaf's ``all(dim)``, whose
        batch size and names lose that dim (as tensordict 0.15.3).

        Raises:
            BatchDimError: ``dim`` is not a batch dim (a RuntimeError, as tensordict
                raises, and an IndexError, as torch does).

        Example:
            >>> td = TensorDict(a=torch.tensor([[True, False], [True, True]]), batch_size=[2, 2])
            >>> td.all(), td.all(dim=1)["a"].tolist()
            (False, [False, True])
        """
        if dim is not None:
            return self._reduced("all", dim)
        return all(bool(v.all()) for v in self._leaf_tensors())

    def any(self, dim: int | None = None) -> "bool | TensorDictBase":
        """True if some element of some tensor leaf is true; ``dim`` as for :meth:`all`."""
        if dim is not None:
            return self._reduced("any", dim)
        return any(bool(v.any()) for v in self._leaf_tensors())

    def _reduced(self, op: str, dim: int) -> "TensorDictBase":
        """``all(dim)``/``any(dim)``: each entry reduced along the batch dim ``dim``."""
        from shared_td.containers.batch_dim_ops import batch_dim
        from shared_td.containers.tensordict import TensorDict

        dim = batch_dim(f"{op}(dim={dim})", dim, self.batch_dims, "dim")
        size = torch.Size([n for i, n in enumerate(self.batch_size) if i != dim])
        if is_non_tensor(self):
            return _reduced_non_tensor(self, dim, size)
        names = self._reduced_names()
        entries = {}
        for key, value in self.items():  # (a nested tensordict, stack or tensorclass reduces itself)
            entries[key] = _reduced_non_tensor(value, dim, size) if is_non_tensor(value) else getattr(value, op)(dim)
        return TensorDict(entries, batch_size=size, device=self.device,
                          names=None if names is None else names[:dim] + names[dim + 1 :])

    def _reduced_names(self) -> list | None:
        """The dim names that ``all(dim)``/``any(dim)`` keep (a lazy stack's differ)."""
        return self.names

    def _leaf_tensors(self) -> Iterator[torch.Tensor]:
        """The tensors held, node by node: a nested collection gives its own (a lazy
        stack its members' tensors, not stacked copies of them, which zero_() and
        fill_() would write into for nothing)."""
        for _, value in self._items_str():
            if isinstance(value, torch.Tensor):
                yield value
            elif is_tensor_collection(value) and not is_non_tensor(value):
                yield from unwrap_tensorclass(value)._leaf_tensors()

    def is_empty(self) -> bool:
        """True if the tensordict holds no leaf (tensor or non-tensor) at any depth."""
        return next(iter(self.keys(True, True, is_leaf_nontensor)), None) is None


def part_of(other: Any, key: str, entry: Any) -> Any:
    """The part of ``other`` (what a node is compared with, in ``_map_leaves``) that
    lines up with the node's entry ``key`` holding ``entry``: a tensordict's (or
    tensorclass's) own entry ``key``; a tensor over the node's batch dims, over the
    batch dims of ``entry`` when it is a collection (its extra dims broadcast, as
    ``expand``); anything else (a number, None) as it is.

    Example:
        >>> part_of(torch.zeros(2), "n", TensorDict(batch_size=[2, 3])).shape
        torch.Size([2, 3])
    """
    if isinstance(other, torch.Tensor):
        if other.ndim and is_tensor_collection(entry) and not is_non_tensor(entry):
            size = entry.batch_size
            return other.reshape(*other.shape, *[1] * (len(size) - other.ndim)).expand(size)
        return other
    if is_tensor_collection(other):
        return unwrap_tensorclass(other)._get_str(key, None)
    return other


def _equal(value: Any, other: Any) -> Any:
    if is_non_tensor(value):
        if is_non_tensor(other):  # the same entry of another tensordict
            return value._compare_data(other)
        return _ignored(value)  # a scalar or tensor compares with the tensors only
    return value == other


def _not_equal(value: Any, other: Any) -> Any:
    result = _equal(value, other)
    return ~result if isinstance(result, torch.Tensor) else result


def _ordered(op: Callable) -> Callable:
    """``<``, ``<=``, ``>``, ``>=`` on one leaf: non-tensor entries are kept as they
    are (not compared), as tensordict does."""
    return lambda value, other: value if is_non_tensor(value) else op(value, other)


def _none_field_entries(mine: Any, theirs: Any, my_keys: set, missing: set) -> set:
    """The keys of ``missing`` (on one side only) that are a tensorclass field set to
    None on the side without them and a None entry (``NonTensorData(None)``) on the
    other: a tensorclass holds no entry for a None field, while ``to_dict()`` gives it as
    None and a tensordict built from that dict holds it; tensordict 0.15.3 compares the
    two as equal (``td == td.to_dict()`` of a tree holding ``MyClass(y=None)``)."""
    from shared_td.containers.nontensor import NonTensorData

    fields = _none_fields(mine) | _none_fields(theirs)

    def none_entry(key: Any) -> bool:
        value = (mine if key in my_keys else unwrap_tensorclass(theirs)).get(key)
        return isinstance(value, NonTensorData) and value.data is None

    return {key for key in missing if key in fields and none_entry(key)}


def _none_fields(value: Any, prefix: tuple = ()) -> set:
    """The keys (as ``keys(True)`` gives them) of the tensorclass fields set to None in
    ``value``, a tensorclass or a tensordict holding some at any depth."""
    keys = set()
    if is_tensorclass(value):
        held = set(value._tensordict.keys())
        keys = {prefix + (name,) for name in type(value)._tc_field_names
                if name not in held and getattr(value, name) is None}
        value = value._tensordict
    if not is_tensor_collection(value) or is_non_tensor(value):
        return keys
    for key, entry in value.items():
        if is_tensor_collection(entry) and not is_non_tensor(entry):
            keys |= _none_fields(entry, prefix + (key,))
    return {key[0] if len(key) == 1 else key for key in keys}


def _ignored(value: Any) -> "TensorDictBase":
    """What ``td == 0`` holds at a non-tensor entry: an empty tensordict of the entry's
    batch size (as tensordict), which ``all()`` and ``any()`` skip."""
    from shared_td.containers.tensordict import TensorDict

    return TensorDict._new_unsafe({}, value.batch_size, value.device)


def _reduced_non_tensor(value: Any, dim: int, size: torch.Size) -> "TensorDictBase":
    """What ``all(dim)``/``any(dim)`` keep of a non-tensor entry, as tensordict 0.15.3: a
    NonTensorData keeps its value over the remaining dims; a NonTensorStack, whose
    values may differ along ``dim``, gives an empty tensordict (skipped by all()/any())."""
    from shared_td.containers.nontensor import NonTensorData
    from shared_td.containers.tensordict import TensorDict

    if isinstance(value, NonTensorData):
        return type(value)(value.data, batch_size=[*size, *value.batch_size[len(size) + 1 :]],
                           device=value.device)
    return TensorDict._new_unsafe({}, torch.Size([*size, *value.batch_size[len(size) + 1 :]]), value.device)
