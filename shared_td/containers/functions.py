"""torch functions applied to tensordicts: ``torch.stack``, ``torch.cat`` and friends.

``TensorDictBase.__torch_function__`` looks the function up in ``TORCH_FUNCTIONS``.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from shared_td.containers import batch as batch_ops
from shared_td.containers.base import TensorDictBase, is_leaf_nontensor, is_non_tensor, is_tensor_collection
from shared_td.errors import BatchSizeMismatchError
from shared_td.tensorclass_protocol import unwrap_tensorclass


def _check_members(items: Sequence[Any], what: str) -> list:
    items = list(items)
    if not items:
        raise ValueError(f"torch.{what} needs at least one tensordict, got an empty list.")
    for item in items:
        if not is_tensor_collection(item):
            raise TypeError(
                f"torch.{what} of tensordicts got a {type(item).__name__}; every item must "
                "be a tensordict (or tensorclass) of the same type."
            )
    kinds = {type(item) for item in items if not is_non_tensor(item)}
    if len(kinds) > 1 and not all(issubclass(k, TensorDictBase) for k in kinds):
        raise TypeError(f"torch.{what} cannot mix {sorted(k.__name__ for k in kinds)}.")
    return items


def _check_same_keys(items: Sequence[TensorDictBase], what: str) -> list[str]:
    """The top-level keys of the first item; KeyError naming the keys (nested ones
    included) that some item lacks or adds."""
    first = set(items[0].keys(include_nested=True))
    for i, item in enumerate(items[1:], start=1):
        other = set(item.keys(include_nested=True))
        if other != first:
            missing, extra = sorted(first - other, key=str), sorted(other - first, key=str)
            differences = ([f"lacks {missing}"] if missing else []) + (
                [f"has extra keys {extra}"] if extra else []
            )
            raise KeyError(
                f"torch.{what} needs the same keys in every tensordict: item {i} "
                f"{' and '.join(differences)} compared with item 0. Select or exclude "
                "keys so that they match."
            )
    return list(items[0]._keys_str())


def _leaf_shapes_match(items: Sequence[TensorDictBase]) -> bool:
    first = items[0]
    if any(item.batch_size != first.batch_size for item in items):
        return False
    for key in first.keys(True, True, is_leaf_nontensor):
        shapes = {tuple(getattr(item.get(key), "shape", ())) for item in items}
        if len(shapes) > 1:
            return False
    return True


def stack(items: Sequence[Any], dim: int = 0, *, out: Any = None) -> Any:
    """Stack tensordicts along a new batch dim ``dim``.

    Members with identical shapes give a dense TensorDict (a copy); members whose
    shapes differ give a LazyStackedTensorDict that keeps them as they are.
    """
    from shared_td.containers.nontensor import stack_non_tensors
    from shared_td.containers.tensordict import TensorDict

    items = _check_members(items, "stack")
    if all(is_non_tensor(item) for item in items):
        return stack_non_tensors(items, dim)
    first = items[0]
    if not isinstance(first, TensorDictBase):  # tensorclass
        return type(first)._from_tensordict(stack([unwrap_tensorclass(item) for item in items], dim))
    dim = batch_ops.normalize_dim(dim, first.batch_dims + 1)
    for i, item in enumerate(items):
        if item.batch_size != first.batch_size:
            raise BatchSizeMismatchError(
                f"torch.stack needs tensordicts of the same batch_size: item {i} has "
                f"{list(item.batch_size)} but item 0 has {list(first.batch_size)}."
            )
    if all(type(item) is TensorDict for item in items):
        _check_same_keys(items, "stack")  # before comparing shapes key by key
    if not all(type(item) is TensorDict for item in items) or not _leaf_shapes_match(items):
        from shared_td.containers.lazy import LazyStackedTensorDict

        return LazyStackedTensorDict.lazy_stack(items, dim)
    keys = list(first._keys_str())  # the same in every item, checked above
    entries = {}
    for key in keys:
        values = [item._get_str(key, None) for item in items]
        entries[key] = stack(values, dim) if is_tensor_collection(values[0]) else torch.stack(values, dim)
    size = torch.Size(list(first.batch_size[:dim]) + [len(items)] + list(first.batch_size[dim:]))
    result = TensorDict._new_unsafe(entries, size, first.device)
    if out is not None:
        out.update_(result)
        return out
    return result


def cat(items: Sequence[Any], dim: int = 0, *, out: Any = None) -> Any:
    """Concatenate tensordicts along the existing batch dim ``dim`` (a copy)."""
    from shared_td.containers.nontensor import cat_non_tensors
    from shared_td.containers.tensordict import TensorDict

    items = _check_members(items, "cat")
    if all(is_non_tensor(item) for item in items):
        return cat_non_tensors(items, dim)
    first = items[0]
    if not isinstance(first, TensorDictBase):  # tensorclass
        return type(first)._from_tensordict(cat([unwrap_tensorclass(item) for item in items], dim))
    if not first.batch_dims:
        raise ValueError("torch.cat needs tensordicts with at least one batch dim.")
    dim = batch_ops.normalize_dim(dim, first.batch_dims)
    for i, item in enumerate(items):
        other = list(item.batch_size)
        if len(other) != first.batch_dims or other[:dim] + other[dim + 1 :] != list(first.batch_size[:dim]) + list(first.batch_size[dim + 1 :]):
            raise BatchSizeMismatchError(
                f"torch.cat along dim {dim}: item {i} has batch_size {other}, which differs "
                f"from item 0's {list(first.batch_size)} outside dim {dim}."
            )
    from shared_td.containers.lazy import LazyStackedTensorDict

    if any(isinstance(item, LazyStackedTensorDict) for item in items):
        return LazyStackedTensorDict._cat(items, dim, out=out)  # stays lazy
    if not all(isinstance(item, TensorDict) for item in items):
        items = [item.to_tensordict() if hasattr(item, "to_tensordict") else item for item in items]
    keys = _check_same_keys(items, "cat")
    entries = {}
    for key in keys:
        values = [item._get_str(key, None) for item in items]
        entries[key] = cat(values, dim) if is_tensor_collection(values[0]) else torch.cat(values, dim)
    size = list(first.batch_size)
    size[dim] = sum(item.batch_size[dim] for item in items)
    result = TensorDict._new_unsafe(entries, torch.Size(size), first.device)
    if out is not None:
        out.update_(result)
        return out
    return result


TORCH_FUNCTIONS = {
    torch.stack: stack,
    torch.cat: cat,
    torch.concat: cat,
    torch.unbind: lambda td, dim=0: td.unbind(dim),
    torch.split: lambda td, split_size_or_sections, dim=0: td.split(split_size_or_sections, dim),
    torch.chunk: lambda td, chunks, dim=0: td.chunk(chunks, dim),
    torch.unsqueeze: lambda td, dim: td.unsqueeze(dim),
    torch.squeeze: lambda td, dim=None: td.squeeze(dim),
    torch.permute: lambda td, dims: td.permute(*dims),
    torch.reshape: lambda td, shape: td.reshape(shape),
    torch.clone: lambda td: td.clone(),
}
