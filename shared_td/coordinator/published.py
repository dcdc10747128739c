"""What a client sends to publish a tensordict, and how an attaching client rebuilds it.

The manager process imports no torch and no container (see
:mod:`shared_td.coordinator.server`), so everything it holds is plain data made here:

* :func:`pickle_by_reference`: the tensordict's pickle, and a *reference* to every memfd
  it names (an anonymous :class:`~shared_td.storage.anonymous.Segment`, a shared
  non-tensor :class:`~shared_td.storage.shared_value.SharedValue`):
  ``(pid, fd, (st_dev, st_ino), how)`` in the publishing process, ``how`` being opaque
  bytes that say how to rebuild it here. The manager opens its own descriptor on each,
  and answers an attach with ``(its pid, its fd, key, how)`` instead, so attaching works
  after the publisher exited. :func:`unpickle` first opens each memfd through those
  references (this process's storage caches keep one object per inode), then unpickles
  the blob with plain ``pickle.loads``, which finds every memfd already open here.
* :func:`layout_of`: the summary that :meth:`Coordinator.layout` returns.

Example:
    >>> import os, torch, shared_td
    >>> td = shared_td.TensorDict(a=torch.zeros(2, 3), batch_size=[2]).memmap_()
    >>> blob, references = pickle_by_reference(td)
    >>> len(references), references[0][0] == os.getpid()   # one segment, ours
    (1, True)
    >>> unpickle(blob, references)["a"].shape
    torch.Size([2, 3])
    >>> layout_of(td)["leaves"]
    [{'key': 'a', 'shape': [2, 3], 'dtype': 'torch.float32', 'where': 'anonymous'}]
"""
from __future__ import annotations

import io
import pickle
from typing import Any

import torch

from shared_td.containers.base import is_leaf_nontensor
from shared_td.containers.lazy import LazyStackedTensorDict
from shared_td.storage.anonymous import Segment
from shared_td.storage.shared_value import SharedValue

__all__ = ["layout_of", "pickle_by_reference", "unpickle"]

# Pickled as ``attach(pid, fd, (st_dev, st_ino), *rest)``: a descriptor of the pickling
# process that the receiver reopens through /proc (unless it has that inode open already).
_BY_DESCRIPTOR = (Segment, SharedValue)


class _ReferenceCollector(pickle.Pickler):
    """A plain pickler that notes the memfds it pickles (the pickle is unchanged)."""

    def __init__(self, file):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.references: dict[tuple[int, int], tuple] = {}  # (st_dev, st_ino) -> reference

    def persistent_id(self, obj: Any):
        if type(obj) in _BY_DESCRIPTOR:
            attach, (pid, fd, key, *rest) = obj.__reduce__()
            if key not in self.references:
                self.references[key] = (pid, fd, key, pickle.dumps((attach, tuple(rest))))
        return None  # pickled as usual


def pickle_by_reference(obj: Any) -> tuple[bytes, list[tuple]]:
    """``obj``'s pickle, and a ``(pid, fd, key, how)`` reference to each memfd it names
    (see the module doc)."""
    buffer = io.BytesIO()
    collector = _ReferenceCollector(buffer)
    collector.dump(obj)
    return buffer.getvalue(), list(collector.references.values())


def unpickle(blob: bytes, references: list) -> Any:
    """Rebuild what :func:`pickle_by_reference` pickled, opening each memfd through the
    process and descriptor that ``references`` now name (the manager's)."""
    opened = []  # held while unpickling: the storage caches are weak
    for pid, fd, key, how in references:
        attach, rest = pickle.loads(how)
        opened.append(attach(pid, fd, tuple(key), *rest))
    return pickle.loads(blob)


def layout_of(td: Any) -> dict:
    """A plain-dict summary of ``td``: class, batch size, and per leaf its key, shape,
    dtype and where it lives (a file path, ``"anonymous"`` or ``"non-tensor"``). The
    leaves of a lazy stack are listed member by member (``"s.0.a"``): its members may
    have different shapes, and a stacked view would be a copy, in no shared memory."""
    leaves = []
    for key, value in _summary_leaves(td, ()):
        key_str = ".".join(key)
        if isinstance(value, torch.Tensor):
            backing_path = getattr(getattr(value, "_backing", None), "path", None)
            leaves.append({
                "key": key_str, "shape": list(value.shape), "dtype": str(value.dtype),
                "where": backing_path or "anonymous",
            })
        else:  # a non-tensor leaf (shared as a SharedValue or held in the pickle)
            leaves.append({"key": key_str, "shape": list(value.batch_size),
                           "dtype": type(value).__name__, "where": "non-tensor"})
    return {"class": type(td).__name__, "batch_size": list(td.batch_size), "leaves": leaves}


def _is_lazy_stack(cls: type) -> bool:
    return issubclass(cls, LazyStackedTensorDict) and not getattr(cls, "_is_non_tensor", False)


def _summary_leaves(td: Any, prefix: tuple):
    """(key path, leaf) of ``td``: tensors and non-tensor values, lazy stacks member by member."""
    if _is_lazy_stack(type(td)):
        for index, member in enumerate(td.tensordicts):
            yield from _summary_leaves(member, prefix + (str(index),))
        return
    for key, value in td.items(True, True, lambda cls: is_leaf_nontensor(cls) or _is_lazy_stack(cls)):
        key = prefix + ((key,) if isinstance(key, str) else tuple(key))
        if _is_lazy_stack(type(value)):
            yield from _summary_leaves(value, key)
        else:
            yield key, value
