"""What a client sends to publish a tensordict, and how an attaching client rebuilds it.

The manager process imports no torch and no container (see
:mod:`shared_td.coordinator.server`), so everything it holds is plain data made here:

* :func:`pickle_by_reference`: the tensordict's pickle, and a *reference* to every memfd
  it names (an anonymous :class:`~shared_td.storage.anonymous.Segment`, a shared
  non-tensor value's :class:`~shared_td.storage.value_slab.ValueSlab`):
  ``(pid, fd, (st_dev, st_ino), how)`` in the publishing process, ``how`` being opaque
  bytes that say how to rebuild it here. The manager opens its own descriptor on each,
  and answers an attach with ``(its pid, its fd, key, how)`` instead, so attaching works
  after the publisher exited.
* :func:`rebuild`: the attaching side. It first opens each memfd through those
  references (this process's storage caches keep one object per inode), then unpickles.
* :func:`layout_of`: the summary that :meth:`Coordinator.layout` returns.

Why the pickle sets the anonymous leaves aside: attaching a 100-leaf tensordict was
mostly unpickling its leaves one by one (each checked against its segment), again at
every attach. The pickle is ``(tree, leaves)``: ``tree`` is the tensordict pickled with
each MemoryMappedTensor over an anonymous segment replaced by its index in ``leaves``
(a pickle persistent id), and ``leaves`` is what each one pickles as (its
``_reference()``: segment, dtype, shape, strides, offset); a zero-element one has no
bytes to view and stays in the tree, pickled as itself. A process parses a published
version once (a :class:`ParsedVersion`: each leaf checked against its segment once, by
arithmetic, and kept as its spec), and each attach of that version makes new
MemoryMappedTensors of those specs (each a new tensor set to the storage of its own
bytes: ``MemoryMappedTensor._make_leaves``) and unpickles only the tree
around them, so every attach still returns new objects (new nodes, leaves whose metadata
is their own), as a plain unpickle did. A leaf that does not fit its segment is refused
before any view is made, and the error names the published name and the leaf's key.
Each attach still asks the manager for the current version first (one round trip), so
staleness, unpublishing and a dead or stopped manager are seen as before. A parsed
version lives as long as a tensordict attached from it
(:func:`shared_td.coordinator.staleness.remember` holds it), so it never keeps memory
mapped by itself. File-backed leaves stay in the tree: each attach maps their paths
anew, as before (an atomic rewrite that was not published yet is what a new attach
maps).

Example:
    >>> import os, torch, shared_td
    >>> td = shared_td.TensorDict(a=torch.zeros(2, 3), batch_size=[2]).memmap_()
    >>> blob, references = pickle_by_reference(td)
    >>> len(references), references[0][0] == os.getpid()   # one segment, ours
    (1, True)
    >>> attached, parsed = rebuild(("address", "name", 1), blob, references)
    >>> attached["a"].shape, attached["a"].data_ptr() == td["a"].data_ptr()
    (torch.Size([2, 3]), True)
    >>> layout_of(td)["leaves"]
    [{'key': 'a', 'shape': [2, 3], 'dtype': 'torch.float32', 'where': 'anonymous'}]
"""
from __future__ import annotations

import io
import pickle
import weakref
from typing import Any

import torch

from shared_td.containers.value_kinds import is_lazy_stack_class, is_leaf_nontensor
from shared_td.keys import key_repr
from shared_td.memmap_tensor import MemoryMappedTensor
from shared_td.storage.anonymous import Segment
from shared_td.storage.value_slab import ValueSlab

__all__ = ["ParsedVersion", "layout_of", "pickle_by_reference", "rebuild"]

# Pickled as ``attach(pid, fd, (st_dev, st_ino), *rest)``: a descriptor of the pickling
# process that the receiver reopens through /proc (unless it has that inode open already).
_BY_DESCRIPTOR = (Segment, ValueSlab)


class _ReferenceCollector(pickle.Pickler):
    """A plain pickler that notes the memfds it pickles in ``references``; given a
    ``leaves`` list, it also sets aside each MemoryMappedTensor over an anonymous segment
    (pickled as its index there, the list getting what the tensor pickles as)."""

    def __init__(self, file, references: dict, leaves: list | None = None):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.references = references  # (st_dev, st_ino) -> reference
        self.leaves = leaves
        self._leaf_index: dict[int, int] = {}  # id(leaf) -> its index: one object, one leaf

    def persistent_id(self, obj: Any):
        kind = type(obj)
        if kind in _BY_DESCRIPTOR:
            attach, (pid, fd, key, *rest) = obj.__reduce__()
            if key not in self.references:
                self.references[key] = (pid, fd, key, pickle.dumps((attach, tuple(rest))))
        elif (kind is MemoryMappedTensor and self.leaves is not None
              and type(obj._backing) is Segment and obj.numel()):  # no bytes, no view: pickled as itself
            index = self._leaf_index.get(id(obj))
            if index is None:
                index = self._leaf_index[id(obj)] = len(self.leaves)
                self.leaves.append(obj._reference())
            return index
        return None  # pickled as usual


def pickle_by_reference(obj: Any) -> tuple[bytes, list[tuple]]:
    """``obj``'s pickle as ``(tree, leaves)`` (see the module doc), and a
    ``(pid, fd, key, how)`` reference to each memfd it names."""
    references: dict = {}
    leaves: list = []
    tree = io.BytesIO()
    _ReferenceCollector(tree, references, leaves).dump(obj)
    blob = io.BytesIO()
    _ReferenceCollector(blob, references).dump((tree.getvalue(), leaves))
    return blob.getvalue(), list(references.values())


class ParsedVersion:
    """One published version as this process parsed it: ``blob`` (what the manager sent),
    the memfds it names opened here, its anonymous leaves checked against their segments
    once and kept as their specs, never as tensors handed out: :meth:`build` makes new
    objects of them. Immutable once made, so threads build from it at once.

    Raises what :meth:`MemoryMappedTensor._leaf_specs` raises for a leaf that does not
    fit its segment (or whose dtype is not one), its message naming ``name`` and the
    leaf's key."""

    __slots__ = ("blob", "_tree", "_leaves", "_opened", "__weakref__")

    def __init__(self, blob: bytes, references: list, name: str = "?"):
        opened = []  # held while this lives: the storage caches are weak
        for pid, fd, key, how in references:
            attach, rest = pickle.loads(how)
            opened.append(attach(pid, fd, tuple(key), *rest))
        self._opened = opened
        self.blob = blob
        self._tree, leaves = pickle.loads(blob)
        try:
            self._leaves = MemoryMappedTensor._leaf_specs(leaves)
        except (TypeError, ValueError) as err:
            raise _refused(name, self._tree, leaves, err) from err

    def build(self) -> Any:
        """A new tensordict of this version: the tree unpickled around new leaf objects."""
        fresh = MemoryMappedTensor._make_leaves(self._leaves)
        unpickler = pickle.Unpickler(io.BytesIO(self._tree))
        unpickler.persistent_load = fresh.__getitem__
        return unpickler.load()


def _refused(name: str, tree: bytes, leaves: list, err: Exception) -> Exception:
    """``err`` (a leaf of the version of ``name`` refused), its message naming the leaf's
    key. Only on that error: the leaves are checked again one by one to find it, and its
    key is found in the tree unpickled around a stand-in tensor per leaf."""
    index = None
    for index, leaf in enumerate(leaves):
        try:
            MemoryMappedTensor._leaf_specs([leaf])
        except (TypeError, ValueError):
            break
    where = f"leaf number {index}"
    try:
        stand_ins: dict[int, int] = {}  # id(stand-in) -> index of its leaf

        def stand_in(i: int) -> torch.Tensor:
            tensor = torch.empty(0)
            stand_ins[id(tensor)] = i
            return tensor

        unpickler = pickle.Unpickler(io.BytesIO(tree))
        unpickler.persistent_load = stand_in
        for key, value in _summary_leaves(unpickler.load(), ()):
            if stand_ins.get(id(value)) == index:
                where = f"leaf {key_repr(key)}"
                break
    except Exception:  # a tree that does not unpickle: the leaf stays named by its number
        pass
    return type(err)(f"Cannot attach {name!r}: its {where} is refused: {err} The published "
                     "pickle is damaged; publish the tensordict again.")


# (address, name, version) -> the ParsedVersion that the tensordicts attached from it
# hold alive (see the module doc); gone with the last of them
_PARSED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def rebuild(version_key: tuple, blob: bytes, references: list) -> tuple[Any, ParsedVersion]:
    """What :func:`pickle_by_reference` pickled, rebuilt over the memfds that
    ``references`` now name (the manager's), and the :class:`ParsedVersion` it was built
    from, which the caller keeps alive with the result. ``version_key`` names the
    published version (``(address, name, version)``): one this process parsed already,
    and still holds, is reused when ``blob`` is the same."""
    parsed = _PARSED.get(version_key)
    if parsed is None or parsed.blob != blob:
        parsed = ParsedVersion(blob, references, version_key[1])
        _PARSED[version_key] = parsed
    return parsed.build(), parsed


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


def _summary_leaves(td: Any, prefix: tuple):
    """(key path, leaf) of ``td``: tensors and non-tensor values, lazy stacks member by member."""
    if is_lazy_stack_class(type(td)):
        for index, member in enumerate(td.tensordicts):
            yield from _summary_leaves(member, prefix + (str(index),))
        return
    for key, value in td.items(True, True, lambda cls: is_leaf_nontensor(cls) or is_lazy_stack_class(cls)):
        key = prefix + ((key,) if isinstance(key, str) else tuple(key))
        if is_lazy_stack_class(type(value)):
            yield from _summary_leaves(value, key)
        else:
            yield key, value
