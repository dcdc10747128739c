"""``copy.deepcopy`` of a container that is not a consolidated tree over plain memory.

tensordict 0.15.3's ``__deepcopy__`` is ``clone()``; so is ours, with the deepcopy's
memo kept: the copy has new private leaves (plain tensors, neither shared nor
memory-mapped), is unlocked and has nothing of the original's (a shared non-tensor
value becomes a private one holding the current value, deep-copied as tensordict deep-
copies it), and an object met twice in what is copied (a leaf at two keys, a node held
also by a non-tensor value, a leaf copied beside its tree) is copied once. Before, a
deepcopy went through the pickle of the node: its flags came along (a copy of a shared
tree said ``is_shared()`` and was locked, over private leaves) and so did the shared
cells of its non-tensor values (a write into the copy changed the original).

A node is put in the memo before its entries are copied, so that a value holding its
own tree (``td["h"] = NonTensorData(holder_of(td))``) gets the copy. (Not a lazy
stack: it is made from its members, as tensordict's.)

Example:
    >>> import copy, torch
    >>> from shared_td import TensorDict
    >>> td = TensorDict(a=torch.zeros(2), s="walk", batch_size=[2]).share_memory_()
    >>> out = copy.deepcopy(td)
    >>> out.is_shared(), out.is_locked, out["a"].is_shared()
    (False, False, False)
    >>> _ = out.set_("s", "run"); td["s"]
    'walk'
"""
from __future__ import annotations

import copy
from typing import Any

import torch


def copied_collection(obj: Any, memo: dict) -> Any:
    """``copy.deepcopy(obj, memo)`` for a TensorDict, lazy stack or non-tensor entry
    (another container: its ``clone()``)."""
    # imported here: they import base.py, which calls this
    from shared_td.containers.lazy import LazyStackedTensorDict
    from shared_td.containers.nontensor import NonTensorData, NonTensorStack
    from shared_td.containers.tensordict import TensorDict

    if isinstance(obj, TensorDict):
        entries: dict = {}
        out = type(obj)._new_unsafe(entries, obj._batch_size, obj._device, obj.names)  # (a subclass stays one)
        _remember(obj, out, memo)
        for key, value in obj._tensordict.items():
            entries[key] = copied_value(value, memo)
        return out
    if isinstance(obj, NonTensorData):
        out = type(obj)(None, batch_size=obj._batch_size, device=obj._device)
        _remember(obj, out, memo)
        out.data = copy.deepcopy(obj.data, memo)  # (a shared one: the value it holds now)
        return out
    if isinstance(obj, NonTensorStack):
        out = type(obj)._from_flat([], obj._batch_size, obj._device, obj._members)
        _remember(obj, out, memo)
        out._values = copy.deepcopy(list(obj._values), memo)
        return out
    if isinstance(obj, LazyStackedTensorDict):
        return obj._restack([copy.deepcopy(member, memo) for member in obj.tensordicts], member_wise=True)
    return obj.clone()


def copied_value(value: Any, memo: dict) -> Any:
    """The copy of an entry: a tensor as ``clone()`` copies it (a plain tensor, its
    autograd history kept, as tensordict's), once per deepcopy; anything else by
    ``copy.deepcopy`` (a container: its own ``__deepcopy__``)."""
    if not isinstance(value, torch.Tensor):
        return copy.deepcopy(value, memo)
    found = memo.get(id(value))
    if found is not None:  # (also a Parameter that a module copied earlier made anew)
        return found
    # A leaf of autograd (a Parameter, a leaf that requires grad) is cloned into a memo of
    # this tree's copies only: in the caller's memo its clone (a non-leaf tied to the
    # original's graph) would stand for it in a module copied later in the same deepcopy
    # (its weight then no Parameter, refused by optimizers), where torch makes a new leaf.
    grad_leaf = isinstance(value, torch.nn.Parameter) or (value.is_leaf and value.requires_grad)
    own = memo.setdefault(_GRAD_LEAVES, {}) if grad_leaf else memo
    found = own.get(id(value))
    if found is None:
        found = value.clone()
        own[id(value)] = found
        _remember(value, None if grad_leaf else found, memo)
    return found


#: the memo key of the clones of autograd leaves (see copied_value)
_GRAD_LEAVES = ("shared_td.deep_copy", "grad leaves")


def _remember(obj: Any, out: Any, memo: dict) -> None:
    """``out`` as the copy of ``obj`` in ``memo`` (None: only keep ``obj`` alive)."""
    if out is not None:
        memo[id(obj)] = out
    # kept alive for as long as the memo, as copy.deepcopy keeps what it copies: a freed
    # object's id could be reused by another one met later in the same deepcopy
    memo.setdefault(id(memo), []).append(obj)
