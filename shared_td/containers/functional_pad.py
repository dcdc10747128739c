"""tensordict 0.15.3's padding helpers of ``tensordict.functional``, which RL code
imports from the package (``from tensordict import pad_sequence``): ``pad`` (every entry
along the batch dims) and ``pad_sequence`` (samples of different lengths padded to one and
stacked, with their masks). Stacking is left to ``stack``/``maybe_dense_stack``
(functions.py, extra_constructors.py). The other helpers are in functional.py.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Sequence

import torch

from shared_td.containers.base import is_non_tensor, is_tensor_collection
from shared_td.containers.functional import leaf_keys
from shared_td.containers.value_kinds import is_lazy_stack, is_nested_node
from shared_td.errors import LockedTensorDictError
from shared_td.keys import canonical_key
from shared_td.tensorclass_protocol import is_tensorclass, unwrap_tensorclass

__all__ = ["pad", "pad_sequence"]


# ------------------------------------------------------------------ pad
def pad(tensordict: Any, pad_size: Sequence[int], value: float = 0.0, inplace: bool = False,
        safe: bool = True) -> Any:
    """Pad every entry along the batch dims: ``pad_size`` is ``(dim0_before, dim0_after,
    dim1_before, ...)`` from the first batch dim (negative sizes crop). Tensors are padded
    with ``value``, non-tensor entries with None (a NonTensorStack); nested tensordicts,
    lazy stacks (new members filled with ``value``) and tensorclasses are padded in turn.

    ``inplace=True`` keeps the tensordict and its nested tensordicts (their leaves are
    replaced) and returns it; a locked, shared or memory-mapped one is refused before
    anything changes. ``safe`` is accepted for tensordict's signature: the sizes are always
    checked first.

    Raises:
        RuntimeError: ``pad_size`` of odd length, longer than twice the batch dims, or
            giving a dim a negative size; ``inplace=True`` of a locked (LockedTensorDictError),
            shared or memory-mapped tensordict, or of a non-tensor entry.

    Example:
        >>> td = TensorDict(a=torch.ones(3, 4, 1), batch_size=[3, 4])
        >>> out = pad(td, [0, 1, 0, 2])
        >>> out.batch_size, out["a"].shape
        (torch.Size([4, 6]), torch.Size([4, 6, 1]))
    """
    pad_size = [int(p) for p in pad_size]
    size = list(tensordict.batch_size)
    if len(pad_size) % 2:
        raise RuntimeError(f"pad: pad_size must have an even length (before, after per batch dim), got {pad_size}.")
    if len(pad_size) > 2 * len(size):
        raise RuntimeError(f"pad: pad_size {pad_size} has more than 2 values per batch dim of batch size {size}.")
    pairs = [(pad_size[i], pad_size[i + 1]) for i in range(0, len(pad_size), 2)]
    for dim, (before, after) in enumerate(pairs):
        if size[dim] + before + after < 0:
            raise RuntimeError(f"pad: ({before}, {after}) on batch dim {dim} of size {size[dim]} would give "
                               "a negative size.")
        if size[dim] + before < 0 or size[dim] + after < 0:  # (torch's narrow() error, after some writes)
            raise RuntimeError(f"pad: ({before}, {after}) on batch dim {dim} of size {size[dim]} crops more "
                               "than the dim holds on one side.")
    if inplace:
        _check_inplace(tensordict, (), any(b or a for b, a in pairs))
    return _pad(tensordict, pairs, lambda key: value, (), inplace)


def _check_inplace(td: Any, path: tuple, resizes: bool) -> None:
    """Refuse ``pad(inplace=True)`` of a tree holding a node it cannot resize, before any write."""
    where = f" at key {path[0] if len(path) == 1 else path!r}" if path else ""
    td = unwrap_tensorclass(td)
    if is_non_tensor(td):
        if not path and resizes:
            raise RuntimeError("pad(..., inplace=True) of a non-tensor value cannot keep it: use inplace=False.")
        return
    if td.is_locked:  # (even with no size change: its leaves would be replaced by private copies)
        raise LockedTensorDictError(f"pad(..., inplace=True): the tensordict{where} is locked; unlock_() "
                                    "it or use inplace=False.")
    if td.is_shared() or td.is_memmap():
        raise RuntimeError(f"pad(..., inplace=True): the tensordict{where} is shared or memory-mapped, so "
                           "its batch size cannot grow in place; use inplace=False.")
    members = td.tensordicts if is_lazy_stack(td) else []
    for member in members:
        _check_inplace(member, path, resizes)
    if not members:
        for key, child in td.items():
            if is_nested_node(child):
                _check_inplace(child, path + (key,), resizes)


def _pad(td: Any, pairs: list, value_of: Callable, path: tuple, inplace: bool) -> Any:
    """``pad`` of a checked tensordict; ``value_of(key)`` gives the fill of a tensor leaf."""
    from shared_td.containers.tensordict import TensorDict

    if is_non_tensor(td):
        return _pad_non_tensor(td, pairs)
    if is_tensorclass(td):
        inner = _pad(unwrap_tensorclass(td), pairs, value_of, path, inplace)
        return td if inplace else type(td)._from_tensordict(inner)
    if is_lazy_stack(td):
        return _pad_lazy(td, pairs, value_of, path, inplace)
    entries = {}
    for key, entry in td.items():
        here = path + (key,)
        if is_tensor_collection(entry):
            entries[key] = _pad(entry, pairs, value_of, here, inplace)
        else:
            entries[key] = _pad_tensor(entry, pairs, value_of(canonical_key(here)))
    size = torch.Size([n + b + a for n, (b, a) in zip(td.batch_size, pairs + [(0, 0)] * td.batch_dims)])
    if not inplace:
        return TensorDict._new_unsafe(entries, size, td.device, td.names)
    td._tensordict.update(entries)  # (checked by _check_inplace: a plain, unlocked TensorDict)
    td._batch_size = size
    return td


def _pad_tensor(tensor: torch.Tensor, pairs: list, value: Any) -> torch.Tensor:
    """``tensor`` padded on its leading dims (``torch.nn.functional.pad`` counts from the last)."""
    widths = []
    for dim in reversed(range(tensor.dim())):
        widths += list(pairs[dim]) if dim < len(pairs) else [0, 0]
    if not any(widths):
        return tensor.as_subclass(torch.Tensor).clone()
    return torch.nn.functional.pad(tensor.as_subclass(torch.Tensor), widths, value=value)


def _pad_lazy(td: Any, pairs: list, value_of: Callable, path: tuple, inplace: bool) -> Any:
    """A lazy stack: members padded on their dims, new members (``value_of`` and None
    filled copies of the edge member) along the stack dim; out of place, the members are
    stacked by ``maybe_dense_stack`` (a TensorDict where they agree, as tensordict's)."""
    from shared_td.containers.extra_constructors import maybe_dense_stack

    sd = td.stack_dim
    before, after = pairs[sd] if sd < len(pairs) else (0, 0)
    inner = pairs[:sd] + pairs[sd + 1:]
    padded: dict[int, Any] = {}  # a member held twice is padded once (in place, twice would pad it twice)
    for member in td.tensordicts:
        if id(member) not in padded:
            padded[id(member)] = _pad(member, inner, value_of, path, inplace)
    members = [padded[id(member)] for member in td.tensordicts]
    if (before > 0 or after > 0) and not members:
        raise RuntimeError("pad: a lazy stack without members cannot grow along its stack dim.")
    first, last = (members[0], members[-1]) if members else (None, None)  # (templates kept before a crop)
    if before < 0 or after < 0:
        members = members[max(-before, 0): len(members) - max(-after, 0)]
    members = ([_filler(first, value_of, path) for _ in range(max(before, 0))] + members
               + [_filler(last, value_of, path) for _ in range(max(after, 0))])
    template = members[0] if members else first
    if inplace:
        td.tensordicts[:] = members
        if template is not None:  # (the stack's batch size is its members' with the stack dim inserted)
            td._member_batch = unwrap_tensorclass(template).batch_size
        return td
    if not members and template is not None:  # cropped to none: the members' entries, empty along the stack dim
        return maybe_dense_stack([template], sd)[(slice(None),) * sd + (slice(0, 0),)]
    return maybe_dense_stack(members, sd)


def _filler(template: Any, value_of: Callable, path: tuple) -> Any:
    """A copy of ``template`` whose tensors hold the fill value and non-tensors None."""
    out = template.empty(recurse=True) if not is_tensorclass(template) else template.clone()
    for key in leaf_keys(template):
        leaf = template.get(key)
        full = path + (key if isinstance(key, tuple) else (key,))
        if is_non_tensor(leaf):
            out.set(key, _pad_non_tensor(leaf, [(0, 0)], fill_all=True))
        else:
            out.set(key, torch.full_like(leaf.as_subclass(torch.Tensor), value_of(canonical_key(full))))
    return out


def _pad_non_tensor(entry: Any, pairs: list, fill_all: bool = False) -> Any:
    """A NonTensorStack of ``entry``'s values padded with None (or all None): the
    positions of its values are padded as a tensor is (-1: a new element), so crops and
    growth follow the tensors' rule exactly."""
    from shared_td.containers.nontensor import NonTensorData, NonTensorStack

    size = entry.batch_size
    if not size and fill_all:  # (a 0-d value, e.g. in a lazy stack's member: the filler holds None)
        return NonTensorData(None, batch_size=[], device=entry.device)
    if not size or (not fill_all and not any(b or a for b, a in pairs)):
        return entry
    values = entry._flat_values()
    positions = _pad_tensor(torch.arange(len(values)).reshape(size), pairs, -1)
    if fill_all:
        positions.fill_(-1)
    taken = [values[i] if i >= 0 else None for i in positions.reshape(-1).tolist()]
    return NonTensorStack._from_flat(taken, positions.shape, entry.device)


# ------------------------------------------------------------------ pad_sequence
def pad_sequence(list_of_tensordicts: Sequence[Any], pad_dim: int = 0, padding_value: Any = 0.0,
                 out: Any = None, return_mask: Any = False, padding_side: str = "right") -> Any:
    """Pad tensordicts to one length along ``pad_dim`` of their entries (counted from each
    entry's first dim; negative from its last) and stack them along a new first dim.

    When ``pad_dim`` is a batch dim, the batch is padded too (non-tensor entries with
    None). ``padding_value`` is a number or a mapping of keys to numbers (0 for the keys it
    does not name). ``return_mask=True`` (or a key) adds a ``"masks"`` tensordict (or one
    at that key) holding, per tensor leaf, True where the values are data. ``out``: a
    tensordict written with the result.

    Raises:
        RuntimeError: an empty list, a 0-d entry, shapes that differ outside ``pad_dim``,
            or ``return_mask`` with tensorclasses.
        KeyError: the tensordicts' keys differ, or ``padding_value`` names no entry.
        ValueError: ``padding_side`` is not "left" or "right", or a negative ``pad_dim`` lands
            on batch dims of some entries and on other dims of others (or on several batch
            dims) while the samples' batch sizes differ along it.
        IndexError: ``pad_dim`` is out of range for an entry (or for the batch size, when
            there is no tensor entry).

    Example:
        >>> tds = [TensorDict(a=torch.ones(n, 2)) for n in (3, 5)]
        >>> out = pad_sequence(tds, return_mask=True)
        >>> out["a"].shape, out["masks", "a"].sum(-1)
        (torch.Size([2, 5, 2]), tensor([3, 5]))
    """
    from shared_td.containers.functions import stack

    items = list(list_of_tensordicts)
    if not items:
        raise RuntimeError("pad_sequence: list_of_tensordicts cannot be empty.")
    if padding_side not in ("left", "right"):
        raise ValueError(f"pad_sequence: padding_side must be 'left' or 'right', got {padding_side!r}.")
    if return_mask is not False and is_tensorclass(items[0]):
        raise RuntimeError("pad_sequence: return_mask needs TensorDicts, not tensorclasses: convert them "
                           "with to_tensordict() first.")
    masks_key = None if return_mask is False else "masks" if return_mask is True else canonical_key(return_mask)
    tds = [unwrap_tensorclass(item) for item in items]
    keys = _same_leaf_keys(tds)
    values = dict(padding_value) if isinstance(padding_value, Mapping) else {}
    values = {canonical_key(k): v for k, v in values.items()}
    unknown = [k for k in values if k not in keys]
    if unknown:
        raise KeyError(f"pad_sequence: padding_value names {unknown}, which are no entries of the "
                       f"tensordicts (their entries: {sorted(keys, key=str)}).")
    default = 0.0 if isinstance(padding_value, Mapping) else padding_value
    dims = _pad_dims(tds, keys, pad_dim)  # key -> the dim padded (tensor leaves only)
    ndim = tds[0].batch_dims
    batch_dims = {d for d in dims.values() if d < ndim}
    on_batch = len(batch_dims) == 1 and all(d < ndim for d in dims.values())
    if not dims and ndim:
        if not -ndim <= pad_dim < ndim:
            raise IndexError(f"pad_sequence: pad_dim={pad_dim} is out of range for the batch size "
                             f"{list(tds[0].batch_size)} (the tensordicts hold no tensor entry).")
        on_batch, batch_dims = True, {pad_dim % ndim}
    if not on_batch and batch_dims:  # (a negative pad_dim: batch dims of some entries, other dims of others)
        differ = sorted(d for d in batch_dims if len({td.batch_size[d] for td in tds}) > 1)
        if differ:
            raise ValueError(f"pad_sequence: pad_dim={pad_dim} counts from the last dim of each entry and lands "
                             f"on batch dims {sorted(batch_dims)} of some entries and on other dims of others, "
                             "so the batch cannot be padded along it, but the samples' batch sizes differ "
                             f"along dim {differ[0]}.")
    padded = []
    if on_batch:
        (bdim,) = batch_dims
        length = max(td.batch_size[bdim] for td in tds)
        for td in tds:
            n = td.batch_size[bdim]
            pairs = [(0, 0)] * bdim + [(length - n, 0) if padding_side == "left" else (0, length - n)]
            padded.append(_pad(td, pairs, lambda key: values.get(key, default), (), False))
    else:
        lengths = {key: max(td.get(key).shape[dim] for td in tds) for key, dim in dims.items()}
        for td in tds:
            if _holds_lazy_stack(td):  # padded as the dense tree it reads as, as tensordict 0.15.3 gives it
                try:
                    td = td.contiguous()
                except RuntimeError:  # (members of other shapes: padded as they are, a lazy stack)
                    pass
            copy = td.empty(recurse=True)  # (new nodes: the input is left as it is)
            for key, dim in dims.items():
                leaf = td.get(key)
                copy.set(key, leaf if dim < ndim else _pad_along(leaf, dim, lengths[key], padding_side,
                                                                 values.get(key, default)))
            padded.append(copy)
    if masks_key is not None:
        for td, copy in zip(tds, padded):
            for key, dim in dims.items():
                copy.set(_join(masks_key, key), _mask(td, copy, key, dim, padding_side))
    _promote(padded, dims)
    try:
        result = stack(padded, 0, lazy_if_shapes_differ=False)
    except RuntimeError as error:
        raise RuntimeError(f"pad_sequence: the entries must have one shape outside pad_dim={pad_dim}: "
                           f"{error}") from error
    if is_tensorclass(items[0]):
        result = type(items[0])._from_tensordict(result)
    if out is not None:
        from shared_td.containers.lazy_shape import stacked_into

        return stacked_into(out, result)
    return result


def _holds_lazy_stack(td: Any) -> bool:
    """True when ``td`` is a lazy stack or holds one at some nested level (its nodes only:
    a non-tensor entry is no node)."""
    if is_lazy_stack(td):
        return True
    return any(is_nested_node(value) and _holds_lazy_stack(value) for value in td.values())


def _same_leaf_keys(tds: list) -> list:
    """The leaf keys of the first tensordict; a KeyError names those another lacks or adds
    (tensordict 0.15.3 returns an empty tensordict there, losing every entry)."""
    keys = leaf_keys(tds[0])
    for i, td in enumerate(tds[1:], start=1):
        other = leaf_keys(td)
        if set(other) != set(keys):
            raise KeyError(f"pad_sequence needs the same keys in every tensordict: item {i} lacks "
                           f"{sorted(set(keys) - set(other), key=str)} and adds "
                           f"{sorted(set(other) - set(keys), key=str)} compared with item 0.")
    return keys


def _pad_dims(tds: list, keys: list, pad_dim: int) -> dict:
    """key -> the dim of that tensor leaf that is padded (one for every tensordict)."""
    dims = {}
    for key in keys:
        for td in tds:
            leaf = td.get(key)
            if is_non_tensor(leaf):
                break
            if leaf.dim() == 0:
                raise RuntimeError(f"pad_sequence: cannot pad the 0-d entry {key!r} (scalars have no dim to pad).")
            dim = pad_dim if pad_dim >= 0 else leaf.dim() + pad_dim
            if not 0 <= dim < leaf.dim():
                raise IndexError(f"pad_sequence: pad_dim={pad_dim} is out of range for the entry {key!r} of "
                                 f"shape {list(leaf.shape)}.")
            if dims.setdefault(key, dim) != dim:
                raise ValueError(f"pad_sequence: pad_dim={pad_dim} lands on dim {dims[key]} of entry {key!r} "
                                 f"in item 0 but on dim {dim} in another: give the entries one number of dims.")
    return dims


def _pad_along(tensor: torch.Tensor, dim: int, length: int, side: str, value: Any) -> torch.Tensor:
    """``tensor`` padded along ``dim`` to ``length`` with ``value``, on ``side``."""
    missing = length - tensor.shape[dim]
    pairs = [(0, 0)] * dim + [(missing, 0) if side == "left" else (0, missing)]
    return _pad_tensor(tensor, pairs, value)


def _mask(td: Any, copy: Any, key: Any, dim: int, side: str) -> torch.Tensor:
    """True where ``copy``'s leaf ``key`` holds ``td``'s data (over the batch dims, and the
    padded dim when that is not one of them)."""
    at = min(dim, td.batch_dims)  # (a feature dim becomes the mask's last)
    shape = list(copy.batch_size) + ([copy.get(key).shape[dim]] if dim >= td.batch_dims else [])
    n = td.get(key).shape[dim]
    mask = torch.zeros(shape, dtype=torch.bool)
    mask.narrow(at, shape[at] - n if side == "left" else 0, n).fill_(True)
    return mask


def _join(masks_key: Any, key: Any) -> tuple:
    return (masks_key if isinstance(masks_key, tuple) else (masks_key,)) + (key if isinstance(key, tuple) else (key,))


def _promote(padded: list, dims: dict) -> None:
    """Give each tensor leaf one dtype, promoted as torch does (tensordict 0.15.3 casts every
    sample to the first's dtype: floats padded into an int sample lose their fractions)."""
    for key in dims:
        leaves = [td.get(key) for td in padded]
        dtype = leaves[0].dtype
        for leaf in leaves[1:]:
            dtype = torch.promote_types(dtype, leaf.dtype)
        for td, leaf in zip(padded, leaves):
            if leaf.dtype != dtype:
                td.set(key, leaf.to(dtype))
