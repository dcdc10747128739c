"""``with td.view(...) as v:`` (also ``unsqueeze``, ``squeeze``, ``permute``,
``transpose``, ``flatten``, ``unflatten``, ``flatten_keys``, ``unflatten_keys``): leaving
the block writes ``v``'s entries back into ``td``, as tensordict 0.15.3 does, so that keys
added and entries replaced inside the block reach ``td`` (before, they were lost in
silence; values written in place reach ``td`` anyway: ``v``'s leaves are views of
``td``'s).

An unlocked ``td`` gets ``update(..., inplace=False)`` of ``v`` brought back to its batch
shape (new keys added, replaced entries replaced); a locked one ``update_`` of the keys
it has (the values copied in place: a locked tree takes no new key). A block that raises
writes nothing back. The result holds its source weakly: a chain of views made in a loop
keeps no earlier tree alive, and a source gone meanwhile gets nothing.

Example:
    >>> td = TensorDict(a=torch.zeros(3, 4), batch_size=[3, 4])
    >>> with td.view(-1) as flat:
    ...     flat["b"] = torch.ones(12)
    >>> td["b"].shape
    torch.Size([3, 4])
"""
from __future__ import annotations

import weakref
from typing import Any, Callable

import torch

from shared_td.containers.keysview import tensors_at
from shared_td.containers.value_kinds import is_leaf_nontensor, is_non_tensor
from shared_td.keys import unravel_key

__all__ = ["back_to_types_of", "inverse_order", "unsqueezed", "with_write_back"]


def with_write_back(source: Any, result: Any, restore: Callable[[Any], Any]) -> Any:
    """``result`` (of a batch-shape op on ``source``), marked so that leaving ``with
    result:`` writes ``restore(result)`` (``result`` brought back to ``source``'s batch
    shape) into ``source``; ``result`` itself when it is ``source`` (nothing to write)."""
    if result is source:
        return result
    held = weakref.ref(source)

    def write_back(out: Any) -> None:
        target = held()
        if target is None:
            return
        back = restore(out)
        if target.is_locked:
            # in place, and only the keys it has: a locked tree takes no new key (one added
            # in a flatten_keys block), skipped as tensordict 0.15.3's update_ skips it
            present = set(target.keys(True, True, is_leaf_nontensor))
            target.update_(back, keys_to_update=[key for key in back.keys(True, True, is_leaf_nontensor)
                                                 if key in present])
        else:
            # an entry the block left alone still views target's own storage: not written, so
            # that target keeps its leaves (a lazy stack's `back` reads them stacked, as copies;
            # writing those replaced every leaf, and tensors held from before no longer reached
            # target), as tensordict 0.15.3 keeps them
            # a non-tensor entry the block left alone (its value as target's) is not written
            # either: rewriting it put a new object there (a NonTensorStack read before the
            # block no longer reached target, and a squeeze turned a stack into one value)
            present = set(target.keys(True))
            leaves = set(back.keys(True, True, is_leaf_nontensor))
            changed = [key for key in back.keys(True)
                       if key not in present or (key in leaves and not _still_views(back, target, key)
                                                 and not _same_non_tensor(back, target, key))]
            if changed:
                target.update(back, inplace=False, keys_to_update=changed)

    result._last_op = ("write_back", write_back, restore)  # (restore: a tensorclass checks its fields)
    return result


def _still_views(back: Any, target: Any, key: Any) -> bool:
    """Whether every tensor of ``back``'s entry at ``key`` views a storage of ``target``'s
    entry there (the block did not replace it); False for a non-tensor entry."""
    path = unravel_key(key)
    try:
        new, old = list(tensors_at(back, path)), list(tensors_at(target, path))
    except KeyError:
        return False
    if not new or not old:
        return False
    storages = {t.untyped_storage().data_ptr() for t in old}
    return all(t.untyped_storage().data_ptr() in storages for t in new)


def _same_non_tensor(back: Any, target: Any, key: Any) -> bool:
    """Whether ``back`` and ``target`` both hold a non-tensor at ``key`` with the same
    values, element by element (False where they cannot be compared)."""
    try:
        new, old = back.get(key), target.get(key)
        if not (is_non_tensor(new) and is_non_tensor(old)) or new.batch_size != old.batch_size:
            return False
        return bool(new.tolist() == old.tolist())
    except Exception:  # (values whose == gives no bool, an array; an entry read as ragged): written
        return False


def inverse_order(order: list) -> list:
    """The permutation that undoes ``permute(order)``."""
    inverse = [0] * len(order)
    for position, dim in enumerate(order):
        inverse[dim] = position
    return inverse


def unsqueezed(result: Any, dims: list) -> Any:
    """``result`` with a dim of size 1 put back at each of ``dims`` (the batch dims a
    ``squeeze`` removed, as they were numbered before it)."""
    for dim in sorted(dims):
        result = result.unsqueeze(dim)
    return result


def back_to_types_of(source: Any, dtypes: bool) -> Callable[[Any], Any]:
    """The ``restore`` of ``source.to(...)``'s write-back (``with td.to(torch.float64) as
    t:``): ``t`` with each tensor back on the device of ``source``'s entry at its key, and
    back in its dtype when ``dtypes`` (``to`` cast them), as tensordict 0.15.3 writes it
    back; an entry ``source`` lacks (added in the block) as it is. Holds ``source``
    weakly, as :func:`with_write_back` does."""
    held = weakref.ref(source)

    def restore(result: Any) -> Any:
        target, back = held(), result.clone(recurse=False)
        for key, value in result.items(True, True, is_leaf_nontensor):
            old = target.get(key, None)
            if isinstance(value, torch.Tensor) and isinstance(old, torch.Tensor):
                back.set(key, value.to(device=old.device, dtype=old.dtype if dtypes else value.dtype))
        return back

    return restore
