"""torch's ``default_collate`` for tensordicts and tensorclasses, as tensordict 0.15.3 has it.

A ``DataLoader`` whose dataset returns one tensordict (or tensorclass) per index collates
each batch with ``default_collate``, which looks the element's type up in torch's
``default_collate_fn_map``. tensordict adds its classes to that map when it is imported;
this module adds ours (``setdefault``: an entry someone registered first is kept), so
that code written for tensordict keeps working after changing its import:

* a list of samples is stacked along a new first dim: densely where their keys and
  shapes match, as a lazy stack where they differ;
* a batch read in one index operation (a dataset's ``__getitems__``, as our replay
  buffers have it) is returned as it is;
* samples with different numbers of batch dims, different tensorclasses, or tensordicts
  mixed with other values are a TypeError that names them.

Example:
    >>> import torch
    >>> from torch.utils.data import default_collate
    >>> from shared_td import TensorDict
    >>> batch = default_collate([TensorDict(obs=torch.zeros(3)), TensorDict(obs=torch.ones(3))])
    >>> batch.batch_size, batch["obs"].shape
    (torch.Size([2]), torch.Size([2, 3]))
"""
from __future__ import annotations

import abc
from typing import Any

from torch.utils.data._utils.collate import default_collate_fn_map

from shared_td.containers.base import TensorDictBase, is_leaf_nontensor, is_tensor_collection
from shared_td.containers.functions import stack
from shared_td.containers.lazy import LazyStackedTensorDict


class _TensorClassInstance(abc.ABC):
    """What ``isinstance(x, _TensorClassInstance)`` is True for: the instances of our
    tensorclasses, which have no common base class (torch looks its map's keys up with
    isinstance). Not tensordict's (they have ``_is_tensorclass`` too), which its own
    entry collates."""

    @classmethod
    def __subclasshook__(cls, candidate: type) -> bool:
        return True if _is_tensorclass(candidate) else NotImplemented


def _is_tensorclass(cls: type) -> bool:
    return getattr(cls, "_is_tensorclass", False) and hasattr(cls, "_tc_field_names")


def collate_tensor_collections(batch: Any, *, collate_fn_map: dict | None = None) -> Any:
    """The entry of ``default_collate_fn_map`` for our tensordicts and tensorclasses
    (see the module's opening)."""
    del collate_fn_map  # the members are stacked as tensordicts, not collated one by one
    if is_tensor_collection(batch):
        return batch  # read in one index operation (__getitems__)
    items = list(batch)
    types = {type(item) for item in items}
    if not all(is_tensor_collection(item) for item in items):
        raise TypeError("Cannot collate a batch that mixes tensordicts or tensorclasses with other "
                        f"types: got {sorted(cls.__name__ for cls in types)}.")
    if len(types) > 1 and any(_is_tensorclass(cls) for cls in types):
        raise TypeError("Cannot collate a batch of different tensorclasses, or of tensorclasses and "
                        f"tensordicts: got {sorted(cls.__name__ for cls in types)}.")
    batch_dims = {item.batch_dims for item in items}
    if len(batch_dims) > 1:
        raise TypeError("Cannot collate a batch of tensordicts or tensorclasses with different "
                        f"numbers of batch dims: got {sorted(batch_dims)}.")
    if len({item.batch_size for item in items}) > 1 or not _same_keys(items):
        return LazyStackedTensorDict.lazy_stack(items, 0)
    return stack(items, 0)  # dense where the shapes match, else lazy


def _same_keys(items: list) -> bool:
    first = set(items[0].keys(True, True, is_leaf_nontensor))
    return all(set(item.keys(True, True, is_leaf_nontensor)) == first for item in items[1:])


default_collate_fn_map.setdefault(TensorDictBase, collate_tensor_collections)
default_collate_fn_map.setdefault(_TensorClassInstance, collate_tensor_collections)
