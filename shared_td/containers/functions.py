"""torch functions applied to tensordicts: ``torch.stack``, ``torch.cat`` and friends.

``TensorDictBase.__torch_function__`` looks the function up in ``TORCH_FUNCTIONS``.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from shared_td.containers import batch as batch_ops
from shared_td.containers.base import NO_DEFAULT, TensorDictBase, is_non_tensor, is_tensor_collection
from shared_td.containers.lazy_writes import _is_lazy
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
        raise TypeError(  # (torch's own wording for this case starts the message)
            f"torch.{what}: no implementation found for a mix of {sorted(k.__name__ for k in kinds)}: "
            "give items of one class (to_tensordict() converts a tensorclass)."
        )
    return items


def _check_same_keys(items: Sequence[TensorDictBase], what: str) -> list[str]:
    """The top-level keys of the first item. Raises naming the keys (nested ones
    included) that some item lacks or adds: a KeyError for ``torch.cat`` and a
    RuntimeError for ``torch.stack``, the exception classes tensordict 0.15.3 raises
    there (code written for it catches those)."""
    first = set(items[0].keys(include_nested=True))
    for i, item in enumerate(items[1:], start=1):
        other = set(item.keys(include_nested=True))
        if other != first:
            missing, extra = sorted(first - other, key=str), sorted(other - first, key=str)
            differences = ([f"lacks {missing}"] if missing else []) + (
                [f"has extra keys {extra}"] if extra else []
            )
            error = RuntimeError if what == "stack" else KeyError
            raise error(
                f"torch.{what} needs the same keys in every tensordict: item {i} "
                f"{' and '.join(differences)} compared with item 0. Select or exclude "
                "keys so that they match"
                + (", or use shared_td.lazy_stack(...) to keep different keys." if what == "stack" else ".")
            )
    return list(items[0]._keys_str())


def _leaf_shape_mismatch(items: Sequence[Any], prefix: tuple = ()) -> tuple | None:
    """``(key, i, shape_0, shape_i)`` for the first leaf whose shape in item ``i``
    differs from item 0's, or None when every leaf has one shape (the batch sizes and
    keys are checked before). Read node by node: the entries of nested lazy stacks are
    not compared (``stack`` stacks those lazily, whatever their members' shapes)."""
    first = unwrap_tensorclass(items[0])
    for key, value in first._items_str():
        path, values = prefix + (key,), [unwrap_tensorclass(item)._get_str(key, None) for item in items]
        if any(_is_lazy(unwrap_tensorclass(v)) for v in values):
            continue
        if is_tensor_collection(value) and not is_non_tensor(value):
            found = _leaf_shape_mismatch(values, path)
            if found is not None:
                return found
            continue
        shape = tuple(getattr(value, "shape", ()))
        for i, other in enumerate(values[1:], start=1):
            if tuple(getattr(other, "shape", ())) != shape:
                return path[0] if len(path) == 1 else path, i, shape, tuple(getattr(other, "shape", ()))
    return None


def _common_names(items: Sequence[TensorDictBase]) -> list | None:
    """The batch dim names every item has (None unless all have the same ones): as
    tensordict 0.15.3, a stack of tensordicts named differently is unnamed."""
    names = getattr(items[0], "_names", None)
    if names is None or any(getattr(item, "_names", None) != names for item in items[1:]):
        return None
    return list(names)


def stack(items: Sequence[Any], dim: int = 0, *, out: Any = None, lazy_if_shapes_differ: bool = True) -> Any:
    """Stack tensordicts along a new batch dim ``dim``.

    Members with identical shapes give a dense TensorDict (a copy), named as they are
    when all have the same batch dim names (the new dim unnamed). Members whose leaf
    shapes differ give a LazyStackedTensorDict that keeps them as they are when
    ``lazy_if_shapes_differ`` (what ``default_collate`` needs, collate.py: tensordict's
    ``maybe_dense_stack``); ``torch.stack`` passes False and raises instead, as
    tensordict 0.15.3 does (a RuntimeError naming the key). Lazy stacks among the items
    are copied too (see ``_stack_with_lazy``); only ``lazy_stack`` keeps its items.
    """
    from shared_td.containers.nontensor import stack_non_tensors
    from shared_td.containers.tensordict import TensorDict

    items = _check_members(items, "stack")
    if all(is_non_tensor(item) for item in items):
        return stack_non_tensors(items, dim)
    first = items[0]
    if not isinstance(first, TensorDictBase):  # tensorclass
        inner = [unwrap_tensorclass(item) for item in items]
        # (out= goes on: it was dropped, and nothing was written into it)
        return type(first)._from_tensordict(stack(inner, dim, out=unwrap_tensorclass(out),
                                                  lazy_if_shapes_differ=lazy_if_shapes_differ))
    dim = batch_ops.insertion_dim(dim, first.batch_dims, "torch.stack")
    for i, item in enumerate(items):
        if item.batch_size != first.batch_size:
            raise BatchSizeMismatchError(
                f"torch.stack needs tensordicts of the same batch_size: item {i} has "
                f"{list(item.batch_size)} but item 0 has {list(first.batch_size)}."
            )
    from shared_td.containers.lazy import LazyStackedTensorDict

    if not all(isinstance(item, TensorDict) for item in items):  # (a subclass stacks densely too)
        if any(_is_lazy(item) for item in items):
            from shared_td.containers.lazy_shape import stacked_into

            return stacked_into(out, _stack_with_lazy(items, dim, lazy_if_shapes_differ))
        return LazyStackedTensorDict.lazy_stack(items, dim)
    _check_same_keys(items, "stack")  # before comparing shapes key by key
    mismatch = _leaf_shape_mismatch(items)
    if mismatch is not None:
        if lazy_if_shapes_differ:
            return LazyStackedTensorDict.lazy_stack(items, dim)
        key, i, shape, other = mismatch
        # Before, a lazy stack came back silently: code written for tensordict expects
        # this RuntimeError (and a dense result whenever torch.stack returns).
        raise RuntimeError(
            f"torch.stack needs entries of the same shape in every tensordict: entry "
            f"{key!r} has shape {list(shape)} in item 0 but {list(other)} in item {i}. "
            "Pad or reshape the entries, or use shared_td.lazy_stack(...) to keep "
            "entries of different shapes."
        )
    keys = list(first._keys_str())  # the same in every item, checked above
    entries = {}
    for key in keys:
        values = [item._get_str(key, None) for item in items]
        entries[key] = (stack(values, dim, lazy_if_shapes_differ=lazy_if_shapes_differ)
                        if is_tensor_collection(values[0]) else torch.stack(values, dim))
    size = torch.Size(list(first.batch_size[:dim]) + [len(items)] + list(first.batch_size[dim:]))
    names = _common_names(items)
    if names is not None:
        names.insert(dim, None)  # as tensordict 0.15.3: the new dim is unnamed
    result = type(first)._new_unsafe(entries, size, first.device, names)  # (the first's class, as tensordict)
    from shared_td.containers.lazy_shape import stacked_into  # (non-tensor entries replaced)

    return stacked_into(out, result)


def _stack_with_lazy(items: list, dim: int, lazy_if_shapes_differ: bool) -> Any:
    """``stack`` of items of one batch size, some of them lazy stacks: a copy, as
    ``torch.stack`` of tensors and tensordict 0.15.3 give (a lazy stack of the items
    themselves shared them: a write into the result reached the inputs, twice for an
    item given twice). With dense items too, the lazy ones are made dense first when
    that loses nothing, so the result is dense (as tensordict's); otherwise the result
    is a lazy stack along the first lazy item's stack dim whose member i stacks (copies)
    the items' elements i along it, as tensordict stacks lazy stacks member by member.
    Elements that differ in keys raise as ``torch.stack`` does, or with
    ``lazy_if_shapes_differ`` are stacked lazily (kept, as tensordict's maybe_dense_stack)."""
    from shared_td.containers.lazy import LazyStackedTensorDict

    lazies = [item for item in items if _is_lazy(item)]
    if len(lazies) < len(items) and not any(item._dense_copy_loses_entries() for item in lazies):
        dense = [item.to_tensordict() if _is_lazy(item) else item for item in items]
        return stack(dense, dim, lazy_if_shapes_differ=lazy_if_shapes_differ)
    sd = lazies[0].stack_dim
    if not lazies[0].tensordicts:  # (no member holds data: nothing to copy or share)
        return LazyStackedTensorDict.lazy_stack(items, dim)
    elements = [item.tensordicts if _is_lazy(item) and item.stack_dim == sd else item.unbind(sd) for item in items]
    member_dim = dim if dim <= sd else dim - 1  # (dim among the batch dims of a member)

    def stack_elements(parts: list) -> Any:
        if lazy_if_shapes_differ and len({frozenset(part.keys(True)) for part in parts}) > 1:
            return LazyStackedTensorDict.lazy_stack(parts, member_dim)  # (as maybe_dense_stack keeps them)
        return stack(parts, member_dim, lazy_if_shapes_differ=lazy_if_shapes_differ)

    members = [stack_elements([parts[i] for parts in elements]) for i in range(len(elements[0]))]
    result = LazyStackedTensorDict.lazy_stack(members, sd + 1 if dim <= sd else sd)
    result._keep_classes_of(items, sd)  # (members given as one tensorclass stay so, as in tensordict)
    names = items[0].names  # (the items' stack dim names kept, as the README says)
    if names is not None and any(name is not None for name in names) and all(i.names == names for i in items):
        result.names = list(names[:dim]) + [None] + list(names[dim:])
    return result


def _torch_stack(items: Sequence[Any], dim: int = 0, *, out: Any = None) -> Any:
    """``torch.stack`` of tensordicts: leaves of different shapes raise (see stack)."""
    return stack(items, dim, out=out, lazy_if_shapes_differ=False)


def cat(items: Sequence[Any], dim: int = 0, *, out: Any = None) -> Any:
    """Concatenate tensordicts along the existing batch dim ``dim`` (a copy)."""
    from shared_td.containers.nontensor import cat_non_tensors
    from shared_td.containers.tensordict import TensorDict

    items = _check_members(items, "cat")
    if all(is_non_tensor(item) for item in items):
        return cat_non_tensors(items, dim)
    first = items[0]
    if not isinstance(first, TensorDictBase):  # tensorclass
        return type(first)._from_tensordict(cat([unwrap_tensorclass(item) for item in items], dim,
                                                out=unwrap_tensorclass(out)))
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
    # tensordict 0.15.3 keeps the first item's batch dim names (dim keeps its name)
    names = getattr(items[0], "_names", None)
    result = type(first)._new_unsafe(entries, torch.Size(size), first.device, names)
    if out is not None:
        out.update_(result)
        return out
    return result


def _like(make: Any) -> Any:
    """``torch.zeros_like(td, ...)`` and friends: ``make`` applied to every tensor leaf
    with the same arguments (``dtype=``, ``device=``, a fill value), non-tensor entries
    kept, as in tensordict; a new tensordict of plain tensors (a memory-mapped or shared
    one gives ordinary memory: use ``memmap_like`` for files)."""

    def like(td: Any, *args: Any, **kwargs: Any) -> Any:
        device = kwargs.get("device")
        return td.apply(lambda leaf: make(leaf, *args, **kwargs), filter_empty=False,
                        device=NO_DEFAULT if device is None else device)

    return like


TORCH_FUNCTIONS = {
    torch.stack: _torch_stack,
    torch.cat: cat,
    torch.concat: cat,
    torch.unbind: lambda td, dim=0: td.unbind(dim),
    torch.split: lambda td, split_size_or_sections, dim=0: td.split(split_size_or_sections, dim),
    torch.tensor_split: lambda td, indices_or_sections, dim=0: td.tensor_split(indices_or_sections, dim),
    torch.chunk: lambda td, chunks, dim=0: td.chunk(chunks, dim),
    torch.unsqueeze: lambda td, dim: td.unsqueeze(dim),
    torch.squeeze: lambda td, dim=None: td.squeeze(dim),
    torch.permute: lambda td, dims: td.permute(*dims),
    torch.transpose: lambda td, dim0, dim1: td.transpose(dim0, dim1),
    torch.flatten: lambda td, start_dim=0, end_dim=-1: td.flatten(start_dim, end_dim),
    torch.unflatten: lambda td, dim, sizes: td.unflatten(dim, sizes),
    torch.reshape: lambda td, shape: td.reshape(shape),
    torch.clone: lambda td: td.clone(),
    torch.masked_select: lambda td, mask: td[mask],  # the masked rows, as tensordict
    **{fn: _like(fn) for fn in (torch.zeros_like, torch.ones_like, torch.empty_like, torch.full_like,
                                torch.rand_like, torch.randn_like)},
}
