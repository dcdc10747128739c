"""The pickle of a consolidated tree: its one buffer once, plus a small skeleton.

A consolidated tensordict over a plain buffer pickles as ONE reduce: the buffer (one
``PickleBuffer`` with protocol 5, so a pipe or a file gets it without a copy), the runs
of its leaves (consolidated_layout.py: a 1000-node tree of like leaves is one run) and a
skeleton of plain tuples that the C pickler writes without calling back into Python.
Loading makes the payload the new tree's buffer, the leaves views of it (one
``unbind`` per run) and the nodes straight from the skeleton: a consolidated tree is a
valid one, so nothing is checked or converted again.

The skeleton of a tensordict node is ``(class, batch size, device, names, locked, keys,
items)``; ``items`` is None when every entry is the next leaf of the buffer, else one
item per key: None (the next leaf), a tuple (a nested node, or ``(class, node)`` for a
tensorclass) or ``[value]`` for any other value (a non-tensor, a lazy stack, a tensor
no longer in the buffer, a node of an unusual class or state), which is pickled as
itself, its own views of the buffer as ``_leaf(index)`` and its nodes of this tree by
their state. A tree whose one node appears twice is pickled that way as a whole, so
that it comes back as one object.

The skeleton is a pickle inside the pickle, and it names no global of its own: every
object in it that is not a tuple, list, dict, str, number, a view of the buffer or a
container of shared_td (a class, a device, a tensor outside the buffer, a
MemoryMappedTensor, a shared value, any user object) is one of its ``extras``, a list
that the OUTER pickler pickles with the tree's reduction, so with its own rules:
multiprocessing's ForkingPickler shares such a tensor and sends a segment or a shared
value as a duplicate descriptor, exactly as in a tree that is not consolidated, and an
unpickler that restricts the globals it loads restricts them here too (the skeleton's
loader resolves only ``_leaf``, ``_layout``, ``_extra`` and ``_value``, never an import).
Such an object may hold a node or a leaf of the tree: then the values are pickled after
the tree (``_value(index)`` in the skeleton), so that those come back as the rebuilt
tree's, with the buffer once (consolidated_extras.py).

The walk that makes the skeleton is consolidated_skeleton.py.

A tree over shared memory or a file pickles node by node (its leaves by reference);
:func:`unlocked_on_arrival` makes it arrive unlocked by the same rule as a plain one.
"""
from __future__ import annotations

import copy
import copyreg
import functools
import io
import multiprocessing.reduction
import pickle
import weakref
from typing import Any

import numpy as np
import torch

from shared_td.containers import consolidated_extras as extras_
from shared_td.containers.consolidated_extras import _Reduced
from shared_td.containers.consolidated_layout import Layout, runs_of, views_of_runs
from shared_td.containers.consolidated_skeleton import ALIASED, Skeleton, is_aliased, place
from shared_td.containers.deep_copy import copied_collection
from shared_td.containers.locking import LockingOps
from shared_td.memmap_tensor import MemoryMappedTensor
from shared_td.tensorclass_protocol import unwrap_tensorclass

_BYTE = torch.uint8
_Pending = extras_.Pending


# An extra that may hold a node or a leaf of the tree (a user object): the same for the
# tree's values, then pickled after it (consolidated_extras.py).
_HOLDER = object()


def reduce_tree(obj: Any, layout: Layout, protocol: int, node_class: type,
                tensordict: type, tensorclass: type, one_step: bool = False) -> tuple:
    """``obj.__reduce_ex__(protocol)`` for a consolidated ``obj`` over a plain buffer.
    ``node_class``: the class of the tree's nodes (TensorDictBase's consolidate mixin);
    ``tensordict`` and ``tensorclass``: the classes whose pickling the skeleton mirrors;
    ``one_step``: its values in its skeleton, never after it (consolidated_extras.Tree)."""
    if not one_step:
        reduced = extras_.reference(obj, layout)  # (a node of a tree whose values are being saved)
        if reduced is not None:
            return reduced
    classes = (node_class, tensordict, tensorclass, one_step)
    skeleton = Skeleton(layout, tensordict, tensorclass)
    try:
        tree = skeleton.record(obj)
        if tree is not None:
            return _reduction(obj, tree, skeleton, layout, protocol, classes)
    except LookupError as error:  # (also raised by the pickler: a node of the skeleton in a value)
        if not is_aliased(error):
            raise
    return _reduction(obj, None, Skeleton(layout, tensordict, tensorclass), layout, protocol, classes)


def _reduction(obj: Any, tree: tuple | None, skeleton: Skeleton, layout: Layout, protocol: int,
               classes: tuple) -> tuple:
    node_class, tensordict, tensorclass, one_step = classes
    runs, count = skeleton.runs() if tree is not None else ([], 0)
    locked_root = obj if obj.is_locked else None
    # a node locked only by its locked parent (td["n"] of a consolidated tree) arrives
    # locked, as in tensordict 0.15.3: only a tree locked as a whole arrives unlocked
    by_parent = obj.is_locked and unwrap_tensorclass(obj)._locked_parent() is not None

    def pickler(value_ids: set[int], first: int = count) -> _TreePickler:
        return _TreePickler(io.BytesIO(), protocol, layout, locked_root, node_class, first, skeleton.seen_nodes,
                            value_ids)

    whole = pickler(set())
    whole.probe = tree is not None and not one_step
    try:
        whole.dump([obj] if tree is None else tree)
    except LookupError as error:
        if error.args != (_HOLDER,):
            raise
        # a value holds an object the outer pickler pickles, which may hold a node or a
        # leaf of this tree: the values pickled after it (consolidated_extras.py)
        whole_tree = functools.partial(reduce_tree, obj, layout, node_class=node_class, tensordict=tensordict,
                                       tensorclass=tensorclass, one_step=True)
        return extras_.values_after(obj, tree, skeleton, (_Payload(layout.buffer), runs), by_parent, pickler,
                                    whole_tree)
    if whole.leaves:
        runs = runs + runs_of(whole.leaves)
    args = (_Payload(layout.buffer), runs, whole.file.getvalue())
    if by_parent:
        return _unpickle_consolidated, (*args, whole.extras, True)
    return _unpickle_consolidated, (*args, whole.extras) if whole.extras else args


def deepcopy_collection(obj: Any, memo: dict) -> Any:
    """``copy.deepcopy`` of a container (``TensorDictBase.__deepcopy__``): ``clone()``'s
    semantics, as tensordict 0.15.3's, the memo kept (deep_copy.py). A consolidated tree
    over a plain CPU buffer (every leaf still a view of it) is copied through its
    reduction (:func:`reduce_tree`): a new buffer once, the leaves views of it, its
    values' nodes and leaves the copy's; then unlocked, root and nested (a sub-tree
    locked by its parent came back locked).
    Defined in this module because consolidated_extras looks for the deepcopy's memo in
    the first frame outside this module and its own (see its ``_asker``)."""
    layout = obj.__dict__.get("_consolidated")
    if layout is None or not layout.buffer.is_cpu or isinstance(layout.buffer, MemoryMappedTensor) \
            or not obj.is_consolidated():  # (a leaf replaced since: memory-mapped, with a history...)
        return copied_collection(obj, memo)
    function, args, *rest = obj.__reduce_ex__(4)
    out = function(*copy.deepcopy(args, memo))
    memo[id(obj)] = out  # (before the state: a value in it may hold obj; kept alive by deepcopy)
    if rest and rest[0] is not None:
        out.__setstate__(copy.deepcopy(rest[0], memo))
    if function is _unpickle_consolidated or function is extras_.finish:  # (the tree itself)
        _unlock_arrived(out)
    return out


class _Payload:
    """The buffer of a consolidated tree in its pickle: with protocol 5 its bytes, one
    ``PickleBuffer`` (so a pipe or a file gets them without a copy); below, the buffer
    tensor itself, which torch reduces as any tensor: ``torch.save`` (protocol 2) writes
    it as one storage record, which ``torch.load(mmap=True)`` maps (as bytes it was a
    string inside data.pkl: the file 1.5x its size, held in memory twice on saving and
    loading); plain pickle and ``copy.deepcopy`` as torch pickles and copies a tensor.
    Under multiprocessing's ForkingPickler (process arguments, queues, DataLoader
    workers) it is the buffer tensor too, which torch's reductions move to shared memory
    and send as a handle, as they send any tensor: a child's writes reach the parent, as
    with an unconsolidated tree (by value, the child wrote a copy)."""

    __slots__ = ("buffer",)

    def __init__(self, buffer: torch.Tensor):
        self.buffer = buffer

    def __reduce_ex__(self, protocol: int) -> tuple:
        buffer = self.buffer
        if protocol >= 5:
            return _as_is, (pickle.PickleBuffer(buffer.numpy()),)
        if buffer.untyped_storage().nbytes() != buffer.nbytes:
            buffer = buffer.clone()  # (torch pickles a tensor's whole storage: only the buffer's bytes)
        return _as_is, (buffer,)


def _shared_payload(payload: _Payload) -> tuple:
    return _as_is, (payload.buffer,)


def _as_is(value: Any) -> Any:
    return value


multiprocessing.reduction.ForkingPickler.register(_Payload, _shared_payload)


class _TreePickler(pickle.Pickler):
    """Pickles a skeleton. The values it holds as themselves have their views of the
    buffer written as ``_leaf(index)`` (their entries listed in ``leaves``; the
    skeleton's own leaves come first) and their nodes of this tree by their state, the
    layout as ``_layout()``: names that _TreeUnpickler resolves to its own views and
    layout. The containers of shared_td (nodes, lazy stacks, tensorclasses) are pickled
    here by their own reduction, since they may hold views of the buffer; any other
    object (and the classes and functions those reductions name) is ``_extra(index)``,
    listed in ``extras`` for the outer pickler. With ``value_ids``, the skeleton's
    values are ``_value(index)`` instead, listed in ``values`` (pickled after the tree
    by another _TreePickler). (``reducer_override``, unlike
    ``persistent_id``, is not called for the tuples, lists, str and int that make the
    skeleton, nor for an object already memoised: once per class.)"""

    def __init__(self, file: Any, protocol: int, layout: Layout, locked_root: Any, node_class: type,
                 first_index: int, in_skeleton: set[int], value_ids: set[int]):
        super().__init__(file, protocol)
        self.file = file
        self.in_skeleton = in_skeleton
        self.value_ids = value_ids  # the skeleton's values: stand-ins, listed in values
        self.values: list[Any] = []
        self.probe = False  # whether an extra that may hold a part of the tree stops the dump
        self.layout = layout
        self.node_class = node_class
        self.leaves: list[tuple] = []
        self.extras: list[Any] = []
        self.first_index = first_index
        self.locked_root = locked_root

    def reducer_override(self, obj: Any) -> Any:
        if self.value_ids and id(obj) in self.value_ids:  # (the memo: once per value)
            self.values.append(obj)
            return _value, (len(self.values) - 1,)
        if isinstance(obj, torch.Tensor):
            entry = place(self.layout, obj)
            if entry is None:
                return self._extra(obj)  # no longer a view of the buffer: the outer pickler's
            self.leaves.append(entry)
            return _leaf, (self.first_index + len(self.leaves) - 1,)
        elif isinstance(obj, self.node_class):
            if obj.__dict__.get("_consolidated") is not self.layout:
                return NotImplemented  # a container: its own reduction, here
            # a node of this tree: its state, as object.__reduce_ex__ gives it (not
            # through its own __reduce_ex__, which would start another tree pickle)
            if id(obj) in self.in_skeleton:
                raise LookupError(ALIASED)
            state = obj.__getstate__()
            if self.locked_root is not None and obj is not self.locked_root:
                # the root's lock (on loading) locks its whole tree once; each node
                # locking its own sub-tree as well cost O(nodes x depth)
                state["_is_locked"] = False
            return copyreg.__newobj__, (type(obj),), state
        elif obj is self.layout:
            return _layout, ()
        elif obj is _leaf or obj is _layout or obj is _extra or obj is _value \
                or getattr(type(obj), "_is_tensorclass", False):
            return NotImplemented  # a name _TreeUnpickler resolves; a tensorclass: a container
        return self._extra(obj)

    def _extra(self, obj: Any) -> tuple:
        if self.probe and not extras_.holds_nothing(obj):
            raise LookupError(_HOLDER)  # (stops the dump at once)
        # (the pickler's memo makes a second meeting of obj this same item)
        self.extras.append(obj)
        return _extra, (len(self.extras) - 1,)


def _leaf(index: int) -> torch.Tensor:
    raise pickle.UnpicklingError("a consolidated leaf can only be read by _TreeUnpickler")


def _layout() -> Layout:
    raise pickle.UnpicklingError("a consolidated layout can only be read by _TreeUnpickler")


def _extra(index: int) -> Any:
    raise pickle.UnpicklingError("a consolidated tree's value can only be read by _TreeUnpickler")


def _value(index: int) -> Any:
    raise pickle.UnpicklingError("a consolidated tree's value can only be read by _TreeUnpickler")


class _TreeUnpickler(pickle.Unpickler):
    """Reads what _TreePickler wrote; the views are made before (from their runs), the
    extras are what the outer unpickler loaded. It resolves no other global: a forged
    skeleton can call nothing that the outer unpickler did not let through."""

    def __init__(self, file: Any, layout: Layout, extras: Any):
        super().__init__(file)
        self.names = {"_leaf": layout.views.__getitem__, "_layout": lambda: layout,
                      "_extra": extras.__getitem__, "_value": _Pending}

    def find_class(self, module: str, name: str) -> Any:
        found = self.names.get(name) if module == __name__ else None
        if found is None:
            raise pickle.UnpicklingError(
                f"A consolidated tree's skeleton names {module}.{name}: refused (it names only "
                "its own leaves, layout and values, which the outer pickle carries). The pickle "
                "was not made by shared_td's consolidate(), or was altered.")
        return found


class _Builder:
    """Makes the nodes of a skeleton (known to be valid: nothing is checked again), the
    skeleton's leaves taken from ``views`` in order, each node locked as it is built
    (what ``lock_()`` of the root does, once per node) when ``keep_locks``, else every
    node unlocked (see :func:`_unpickle_consolidated`)."""

    def __init__(self, layout: Layout, keep_locks: bool):
        self.layout = layout
        self.keep_locks = keep_locks
        self.next_views = iter(layout.views)
        self.sizes: dict[tuple, torch.Size] = {}  # one torch.Size per batch size
        self.pending: list[tuple] = []  # (entries, key, value index, locked node or None)

    def build(self, record: Any) -> Any:
        if type(record) is list:
            value = record[0]  # pickled as itself: a collection comes back with its own lock
            collection = unwrap_tensorclass(value)
            if not self.keep_locks and isinstance(collection, LockingOps) and collection._is_locked:
                collection.unlock_()
            return value
        if len(record) == 2:  # a tensorclass around its tensordict
            cls, inner = record
            obj = cls.__new__(cls)
            object.__setattr__(obj, "_tensordict", self.build(inner))
            return obj
        cls, size, device, names, locked, keys, items = record
        locked = locked and self.keep_locks
        children, pending = [], None
        if items is None:
            entries = dict(zip(keys, self.next_views))  # (zip stops at the keys' end)
        else:
            entries = {}
            for key, item in zip(keys, items):
                if item is None:
                    entries[key] = next(self.next_views)
                    continue
                entries[key] = child = self.build(item)
                if type(item) is list:  # a value pickled as itself: a collection?
                    if type(child) is _Pending:  # a value loaded after the tree (extras_.finish)
                        pending = pending or []
                        pending.append((entries, key, child.index))
                        continue
                    child = unwrap_tensorclass(child)
                    if not isinstance(child, LockingOps):
                        continue
                elif len(item) == 2:  # a tensorclass: its tensordict is the one locked
                    child = child._tensordict
                children.append(child)
        batch_size = self.sizes.get(size)
        if batch_size is None:
            batch_size = self.sizes[size] = torch.Size(size)
        node = cls.__new__(cls)
        node.__dict__.update(
            _tensordict=entries, _batch_size=batch_size, _device=device, _names=names,
            _is_locked=locked, _is_shared=False, _is_memmap=False, _memmap_prefix=None,
            _lock_parents={}, _context_ops=[], _consolidated=self.layout)
        if locked:
            node._last_op = "lock_"
            for child in children:  # each locked as lock_() would (those pickled as themselves)
                if not child._is_locked:
                    child.lock_()
                child._lock_parents[id(node)] = weakref.ref(node)
        if pending:
            self.pending.extend((*spot, node if locked else None) for spot in pending)
        return node


def _unpickle_consolidated(payload: Any, runs: list[tuple], tree: bytes, extras: Any = (),
                           locked_by_parent: bool = False) -> Any:
    """Rebuild a pickled consolidated tensordict: the payload (its bytes, or the buffer
    tensor shared by ForkingPickler) becomes its one buffer; ``extras`` are the values
    its skeleton names by index (see _TreePickler)."""
    layout = _arrived_layout(payload, runs)
    skeleton = _TreeUnpickler(io.BytesIO(tree), layout, extras).load()
    # As tensordict 0.15.3: a tree locked as a whole (as consolidate() leaves it) comes
    # back unlocked, root and nested, so that a receiver may add keys at once; in a tree
    # whose root was unlocked, a node locked on its own stays locked (tensordict pickles
    # such a tree node by node, its locks with it), and so does a sub-tree sent alone
    # that was locked by its parent.
    return _Builder(layout, keep_locks=locked_by_parent or not _root_locked(skeleton)).build(skeleton)


def _arrived_layout(payload: Any, runs: list[tuple]) -> Layout:
    """The layout of an arrived tree: its payload as buffer, its views made from runs."""
    if isinstance(payload, torch.Tensor):
        buffer = payload
    elif isinstance(payload, np.ndarray):  # (an out-of-band buffer given to pickle.loads: no copy)
        buffer = torch.from_numpy(payload.reshape(-1).view(np.uint8))
    else:
        data = payload if isinstance(payload, bytearray) else bytearray(payload)
        buffer = torch.frombuffer(data, dtype=_BYTE) if data else torch.empty(0, dtype=_BYTE)  # len: 64 * n
    layout = Layout(buffer)
    layout.record(views_of_runs(buffer, runs), runs=runs)
    return layout


def _root_locked(record: Any) -> bool:
    """Whether the root of a skeleton was locked when pickled."""
    if type(record) is list:  # pickled as itself
        return bool(getattr(unwrap_tensorclass(record[0]), "_is_locked", False))
    if len(record) == 2:  # a tensorclass around its tensordict
        return _root_locked(record[1])
    return bool(record[4])


def unlocked_on_arrival(obj: Any, reduced: tuple, protocol: int) -> tuple:
    """``reduced`` (the reduction of the node ``obj`` of a consolidated tree whose
    buffer is shared memory or a file: its state, the leaves by reference), made to
    arrive as _unpickle_consolidated makes a plain one arrive: a tree locked as a whole
    (its root ``obj`` locked on its own, as consolidate() leaves it) comes back
    unlocked, root and nested, so that a receiver may add keys (as in tensordict
    0.15.3). A node locked only by a locked parent keeps its reduction: that parent's
    arrival unlocks it. An unlocked node keeps the locks of the nodes nested in it that
    were locked on their own (their reductions are taken here, unchanged, so that they
    do not take themselves for the root of a tree locked as a whole)."""
    if obj._is_locked:
        return reduced if obj._locked_parent() is not None else (_unlock_arrived, (_Reduced(reduced),))
    state = reduced[2] if len(reduced) > 2 else None
    entries = state.get("_tensordict") if isinstance(state, dict) else None
    if not isinstance(entries, dict):
        return reduced
    layout = obj.__dict__.get("_consolidated")
    kept = {key: value for key, value in entries.items()
            if isinstance(value, LockingOps) and value._is_locked and value._locked_parent() is None
            and value.__dict__.get("_consolidated") is layout}
    if kept:
        state["_tensordict"] = {key: _Reduced(object.__reduce_ex__(kept[key], protocol)) if key in kept
                                else value for key, value in entries.items()}
    return reduced


# a pickle made before consolidated_extras took over _Reduced names its _new here
_new = extras_._new


def _unlock_arrived(obj: Any) -> Any:
    """Unlock an unpickled tree, root and nested; its sharing flags stay (unlock_()
    would clear them: they still hold, the leaves are those of the same memory)."""
    pending = [unwrap_tensorclass(obj)]
    while pending:
        node = pending.pop()
        if isinstance(node, LockingOps) and node._is_locked:
            node._is_locked = False
            for child in node._collection_children():
                child._lock_parents.pop(id(node), None)
                pending.append(child)
    return obj
