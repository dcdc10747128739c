"""The values of a consolidated tree's pickle that may point back into the tree.

A value of a consolidated tree outside its buffer (a non-tensor's object, a tensor no
longer in the buffer) goes through the OUTER pickler (consolidated_pickle.py), which
knows nothing of the tree: an object of the value that holds one of the tree's nodes
(``h.ref = td["n"]``) or leaves (``h.t = td["a"]``) would pickle that node as a new
tree and that leaf with its whole storage, so the buffer twice, and come back as a
private copy. So a tree with such values pickles in two steps, ``finish(tree,
values)``: ``tree`` (a :class:`Tree`) rebuilds the buffer, the nodes and the leaves,
its values left as stand-ins (:class:`Pending`); ``values`` (a :class:`Values`) then carries them.
While the outer pickler saves ``values``, this thread knows the tree being pickled
(:func:`reference`): a node or leaf of it reduces to ``_node_at(tree, path)`` and
another view of the buffer to ``_view_at(tree, entry)``, so that they come back as
those of the rebuilt tree (the outer memo has ``tree`` by then), with the buffer once.
A node finds it through its own ``__reduce_ex__``; a plain tensor through a reducer
registered in ``copyreg.dispatch_table`` only while such values are being saved (a
plain pickler has no other hook for a tensor; multiprocessing's ForkingPickler uses
torch's own, which shares the one buffer's memory). ``copy.deepcopy`` goes through
:meth:`Values.__deepcopy__`, which maps the tree's nodes, leaves and storage to the
copy's in its memo. A node of the tree that only the values' pickle makes (a value that
is a node of unusual state) arrives complete, but as a node of its own: an object of
another value holding it gets a separate copy (an empty shell made with the tree would
be seen, unfilled, by that object's ``__setstate__``). Only the pickler that saves ``values`` is answered so (see :func:`_asker`; a deepcopy:
its memo): another pickle or deepcopy started meanwhile in this thread (inside a value's
own ``__getstate__`` or ``__deepcopy__``, or after a failed pickle whose error keeps
``values`` alive) has no ``tree`` in its memo, and pickles the node as a tree of its
own. Where a pickler is taken for the owner wrongly (no memo: ``fast``; a pickle started
with no frame of its own), ``tree`` pickles as the whole tree (see :class:`Tree`): it
costs identity and size, never a stand-in left in a value. A node of the same
buffer outside the tree (the root, held by a value of a sub-tree pickled alone) is
pickled node by node, as tensordict 0.15.3 pickles it: the arrived sub-tree is in it.

Example (``pickle.loads(pickle.dumps(td))`` gives the same, for a class it can name):
    >>> import copy, types
    >>> td = TensorDict(a=torch.zeros(3), n={"b": torch.ones(2)}).consolidate().unlock_()
    >>> td["h"] = NonTensorData(types.SimpleNamespace(node=td["n"], leaf=td["a"]))
    >>> out = copy.deepcopy(td)
    >>> out["h"].node is out["n"], out["h"].leaf is out["a"]
    (True, True)
"""
from __future__ import annotations

import copy
import copyreg
import functools
import io
import os
import pickle
import sys
import threading
import types
import weakref
from typing import Any

import torch

from shared_td.containers.consolidated_layout import runs_of, views_of_runs
from shared_td.containers.locking import LockingOps
from shared_td.tensorclass_protocol import unwrap_tensorclass

_Tensor = torch.Tensor
_local = threading.local()
_hook = threading.Lock()
_users = 0  # the contexts open in all threads, while the tensor reducer is registered
_previous: Any = None  # what copyreg.dispatch_table held for torch.Tensor before


def _after_fork_in_child() -> None:
    # A thread of the parent may have held _hook at the fork, and the contexts open in
    # the parent's other threads never close here: count only this thread's, and take
    # the reducer off when none is open (as _release does).
    global _hook, _users, _previous
    _hook = threading.Lock()
    stack = getattr(_local, "stack", None) or ()
    for context in stack:  # (the others, open in the parent's other threads, are not counted here)
        context.pid = os.getpid()
    _users = len(stack)
    if _users == 0 and copyreg.dispatch_table.get(_Tensor) is _reduce_tensor:
        if _previous is None:
            copyreg.dispatch_table.pop(_Tensor, None)
        else:
            copyreg.dispatch_table[_Tensor] = _previous
        _previous = None


os.register_at_fork(after_in_child=_after_fork_in_child)


class Context:
    """The tree whose values are being saved: ``root`` (pickled), ``handle`` (its
    :class:`Tree`), ``layout``, the ids of its values (not rebuilt by ``handle``: they
    come back through the outer memo) and its nodes' and leaves' paths (made when first
    asked for)."""

    __slots__ = ("root", "handle", "layout", "value_ids", "described", "_paths", "guard", "stack", "owner",
                 "_layout_ref", "suspended", "pid")

    def __init__(self, root: Any, layout: Any, value_ids: set[int], described: set[int]):
        self.root, self.layout, self.value_ids, self.described = root, layout, value_ids, described
        self.handle = Tree(self)
        self._paths: dict[int, tuple] | None = None
        self.guard: Any = None
        self.stack: list | None = None  # the stack of the thread that opened it
        self.owner: tuple = ()  # who saves its values (see _asker): the only one it answers
        self._layout_ref: Any = None
        self.suspended = 0  # answers no one while its tree is pickled whole (Tree.__reduce_ex__)
        self.pid = 0  # the process that counted it in _users (a fork child counts only its thread's)

    @property
    def paths(self) -> dict[int, tuple]:
        """``{id: path}`` of the rebuilt nodes and leaves (a path: keys; None for the
        tensordict of a tensorclass)."""
        if self._paths is None:
            self._paths = paths = {}
            pending = [(self.root, ())]
            while pending:
                obj, path = pending.pop()
                if id(obj) in paths or id(obj) in self.value_ids:
                    continue
                if isinstance(obj, _Tensor):
                    paths[id(obj)] = path
                    continue
                inner = obj.__dict__.get("_tensordict")
                if getattr(type(obj), "_is_tensorclass", False):
                    if id(inner) in self.described:  # a tensorclass the skeleton describes
                        paths[id(obj)] = path
                        pending.append((inner, path + (None,)))
                elif id(obj) in self.described:
                    paths[id(obj)] = path
                    pending.extend((value, path + (key,)) for key, value in inner.items())
        return self._paths

    def reduce(self, obj: Any) -> tuple | None:
        """The reduction of ``obj`` as a part of the rebuilt tree, or None."""
        path = self.paths.get(id(obj))
        if path is not None:
            return _node_at, (self.handle, path)
        if not isinstance(obj, _Tensor):
            # a node of the same buffer outside the tree (an ancestor of a sub-tree pickled
            # alone, held by one of its values): node by node, as tensordict 0.15.3 pickles
            # it, so that the arrived sub-tree is in it and its leaves view the one buffer
            state = obj.__getstate__()
            if "_consolidated" in state:  # (a tensorclass: in its tensordict's state)
                if self._layout_ref is None:
                    self._layout_ref = _LayoutOf(self.handle)
                state["_consolidated"] = self._layout_ref
            return _new, (type(obj),), state
        # (the buffer's storage asked now: ForkingPickler moves it to shared memory; a
        # tensor with no storage of its own, sparse or nested, cannot view it)
        if isinstance(obj, _Tensor) and obj.layout is torch.strided and not obj.is_nested and \
                obj.device == self.layout.buffer.device and \
                obj.untyped_storage().data_ptr() == self.layout.buffer.untyped_storage().data_ptr():
            from shared_td.containers.consolidated_skeleton import place

            entry = place(self.layout, obj)
            if entry is not None:
                return _view_at, (self.handle, entry)
        return None


# What a value's extras may be without holding anything (so a tree's values pickle with
# it in one step): names and plain data. (A tensor outside the buffer holds none of it.)
_INERT = (type, _Tensor, torch.Size, torch.device, torch.dtype, str, bytes, int, float, type(None),
          types.FunctionType, types.BuiltinFunctionType)
_EXACTLY = frozenset((type, torch.Size, torch.device, torch.dtype, str, type(None)))  # (most, at once)


def holds_nothing(extra: Any) -> bool:
    """Whether ``extra`` (an object a skeleton leaves to the outer pickler) cannot hold a
    node or a leaf of the tree."""
    return type(extra) in _EXACTLY or isinstance(extra, _INERT)


def values_after(root: Any, tree: tuple, skeleton: Any, start: tuple, by_parent: bool, pickler: Any,
                 whole: Any) -> tuple:
    """The reduction of ``root`` in two steps: ``tree`` (its skeleton, described by
    ``skeleton``), its values as stand-ins, then its values. ``start``: its payload
    and runs; ``pickler(value_ids, first leaf index)`` makes a _TreePickler
    (consolidated_pickle.py); ``whole(protocol)``: ``root``'s reduction in one step,
    its values in its skeleton (see :class:`Tree`)."""
    first = pickler(skeleton.value_ids)
    first.dump(tree)  # (the values met listed in first.values)
    values = pickler(set(), first.first_index + len(first.leaves))
    values.dump(first.values)
    payload, runs = start
    leaves = first.leaves + values.leaves
    if leaves:
        runs = runs + runs_of(leaves)
    context = Context(root, skeleton.layout, skeleton.value_ids, skeleton.seen_nodes)
    context.handle.reduction = (rebuild, (payload, runs, first.file.getvalue(), first.extras, by_parent))
    context.handle.whole = whole
    return finish, (context.handle, Values(context, values.file.getvalue(), values.extras))


def reference(obj: Any, layout: Any) -> tuple | None:
    """``obj.__reduce_ex__`` for a node of ``layout`` while a tree over it has its
    values saved in this thread (one of its nodes: a reference to the rebuilt one)."""
    stack = getattr(_local, "stack", None)
    if stack:
        asker = _asker()
        for context in reversed(stack):
            if context.layout is layout and _answers(context, asker):
                return context.reduce(obj)
    return None


def _reduce_tensor(tensor: torch.Tensor, fallback: Any = None) -> tuple:
    # registered for torch.Tensor while values are saved (all threads see it: those
    # with no context get torch's own reduction; its protocol argument is unused);
    # ``fallback``: what the pickler had registered before (multiprocess's, below)
    stack = getattr(_local, "stack", None)
    if stack:
        asker = _asker()
        for context in reversed(stack):
            if _answers(context, asker):
                reduced = context.reduce(tensor)
                if reduced is not None:
                    return reduced
    if fallback is not None:
        return fallback(tensor)
    previous = copyreg.dispatch_table.get(_Tensor)
    if previous is _reduce_tensor:
        previous = _previous
    return previous(tensor) if previous is not None else tensor.__reduce_ex__(2)


# multiprocess's (dill's) ForkingPickler, which the coordinator's connections use, copies
# copyreg.dispatch_table when it is made, before a tree's values are saved: the reducer is
# registered with it for good (with no context open: the reducer registered there before,
# a user's (torch.multiprocessing's reduce_tensor, to share memory); else as before)
try:
    from multiprocess.reduction import ForkingPickler as _MultiprocessPickler
except ImportError:  # (a dependency of shared_td's coordinator only)
    pass
else:
    _multiprocess_previous = getattr(_MultiprocessPickler, "_extra_reducers", {}).get(_Tensor)

    def _reduce_tensor_multiprocess(tensor: torch.Tensor) -> tuple:
        return _reduce_tensor(tensor, _multiprocess_previous)

    _MultiprocessPickler.register(_Tensor, _reduce_tensor if _multiprocess_previous is None
                                  else _reduce_tensor_multiprocess)


# The modules between a pickler and _asker: the node's __reduce_ex__, reduce_tree, this one.
_OURS = frozenset({__name__, "shared_td.containers.consolidation", "shared_td.containers.consolidated_pickle"})
_PICKLE_GLOBALS = vars(pickle)
_COPY_GLOBALS = vars(copy)
_PICKLERS = (pickle.Pickler, pickle._Pickler)
_NOBODY = (object(),)  # an asker no context answers


def _asker() -> tuple:
    """Who calls a reduction of ours now (one or two names of it): a context answers
    only the pickler that saves its values (:func:`_answers`), never another pickle or
    copy started in the meantime in this thread (inside a value's own ``__getstate__``,
    ``__reduce__`` or ``__deepcopy__``; after a failed pickle whose error, with the
    pure-Python pickler's frames, is kept). It is the pure-Python pickler
    (``pickle._Pickler``, dill) whose ``save`` calls us; a pickler's own method that
    makes reductions itself (a ``reducer_override`` returning ``obj.__reduce_ex__``):
    that pickler, and the frame that runs it; for the C pickler (which has no frame) the
    frame that runs it, the same for all its calls (a pickle started inside a value runs
    in that value's frame); for ``copy.deepcopy`` its memo (each deepcopy has its own)."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__") in _OURS:
        frame = frame.f_back
    if frame is None:
        return _NOBODY
    globals_ = frame.f_globals
    if globals_ is _COPY_GLOBALS:
        memo = frame.f_locals.get("memo")
        return _NOBODY if memo is None else (memo,)
    code = frame.f_code
    # (f_locals costs a dict per call: asked only of a method's frame)
    if code.co_argcount and code.co_varnames[0] == "self":
        pickler = frame.f_locals.get("self")
        if isinstance(pickler, _PICKLERS):
            if globals_ is _PICKLE_GLOBALS:
                return (pickler,)
            # a reducer_override making reductions itself: also the frame running the
            # C pickler (the owner's name for it); never for another method (a
            # persistent_id starting a side pickle: f_back is the outer dump's frame)
            override = getattr(type(pickler), "reducer_override", None)
            if getattr(override, "__code__", None) is code:
                return (pickler, frame.f_back)
            return (pickler,)
    return (frame,)


def _answers(context: Context, asker: tuple) -> bool:
    """Whether ``context`` answers ``asker`` (:func:`_asker`): the one that opened it
    (a name in common: a C pickler's ``reducer_override`` that reduces some objects
    itself and leaves the others to the pickler is the pickler and the frame running it)."""
    if context.suspended:
        return False
    for mine in context.owner:
        for theirs in asker:
            if mine is theirs:
                return True
    return False


def _open(context: Context) -> None:
    global _users, _previous
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    stack.append(context)
    context.stack = stack
    context.pid = os.getpid()
    with _hook:
        if _users == 0:
            _previous = copyreg.dispatch_table.get(_Tensor)
            copyreg.dispatch_table[_Tensor] = _reduce_tensor
        _users += 1


def _close(context: Context) -> None:
    # (the stack it was opened on: a guard may fire in another thread, from the cyclic
    # GC, also while another context is open above it: that one stays, it closes itself)
    stack = context.stack
    context.owner = ()  # (a frame, a pickler or a memo: not kept alive by a closed context)
    if stack and context in stack:
        stack.remove(context)
        if getattr(context, "pid", 0) == os.getpid():  # (a parent thread's, closed in a fork child: not counted)
            _release()


def _close_dropped(context: Context, _ref: Any) -> None:
    """The guard of a Values object freed unsaved: close its context (quietly at
    interpreter exit, when the module's names may be gone)."""
    try:
        _close(context)
    except Exception:  # (exit: _close or the hook's lock already None)
        pass


def _release() -> None:
    global _users, _previous
    with _hook:
        _users -= 1
        if _users == 0:
            if _previous is None:
                copyreg.dispatch_table.pop(_Tensor, None)
            else:
                copyreg.dispatch_table[_Tensor] = _previous
            _previous = None


class Tree:
    """The first argument of :func:`finish`: pickles as the reduction that rebuilds the
    tree (set by consolidated_pickle.py), its values as stand-ins, ONCE: that is the
    reduction of finish's own argument, whose values finish() puts in place. Any later
    reduction (or deepcopy) of it is another pickler's (one that :func:`_asker` took
    for the owner: it has no memo, ``fast``; or a pickle started with no frame of its
    own) or a second meeting without a memo: there, stand-ins would stay so; or the
    owner's own, after a ``reducer_override`` took the first one only to look at it.
    It pickles then as the whole tree, in one step (its values in its skeleton), its
    context answering no one meanwhile (a node of it held by a value: a tree of its
    own), and :func:`finish` takes it as it is, so that such a pickler costs identity
    and size, never a value."""

    __slots__ = ("context", "reduction", "whole")

    def __init__(self, context: Context):
        self.context, self.reduction, self.whole = context, None, None

    def __reduce_ex__(self, protocol: int) -> tuple:
        reduction, self.reduction = self.reduction, None
        if reduction is not None:
            return reduction
        context = self.context
        stack = getattr(_local, "stack", None)
        _local.stack = None  # (the root's own __reduce_ex__ would name this tree again)
        try:
            reduced = self.whole(protocol)
        finally:
            _local.stack = stack
        # (saved in order: the context suspended while the pickler saves the tree's values)
        return _whole, (_Suspend(context, 1), _Reduced(reduced), _Suspend(context, -1))


class Values:
    """The second argument of :func:`finish`: the pickle of the tree's values and the
    objects it names (pickled by the outer pickler, this tree's context open)."""

    __slots__ = ("context", "data", "extras", "__weakref__")

    def __init__(self, context: Context, data: bytes, extras: list):
        self.context, self.data, self.extras = context, data, extras

    def __reduce_ex__(self, protocol: int) -> tuple:
        # open until _Close, saved after the extras, is reduced, or (the pickler failed
        # on an extra) until the pickler drops this object unsaved: a context left open
        # would make a later pickle of this tree name a rebuilt tree it does not carry
        self.context.guard = weakref.ref(self, functools.partial(_close_dropped, self.context))
        self.context.owner = _asker()
        _open(self.context)
        return _values_of, (self.data, self.extras, _Close(self.context))

    def __deepcopy__(self, memo: dict) -> tuple:
        context = self.context
        copied = memo.get(id(context.handle))  # (copied first: finish's first argument)
        if copied is not None:
            for key, path in context.paths.items():
                memo.setdefault(key, _node_at(copied, path))
            buffer = context.layout.buffer
            if buffer.storage_offset() == 0:  # other views: views of the copy's one buffer
                memo.setdefault("torch", {})[buffer.untyped_storage()._cdata] = \
                    copied.layout.buffer.untyped_storage()
        context.owner = (memo,)  # (only this deepcopy: one started inside a value has its own memo)
        _open(context)
        try:
            return self.data, copy.deepcopy(self.extras, memo)
        finally:
            _close(context)


class _Suspend:
    """Suspends (``step`` 1) or resumes (-1) ``context`` when the pickler reaches it."""

    __slots__ = ("context", "step")

    def __init__(self, context: Context, step: int):
        self.context, self.step = context, step

    def __reduce_ex__(self, protocol: int) -> tuple:
        self.context.suspended += self.step
        return _none, ()


class _Reduced:
    """A reduction kept to be pickled as it is (inside another one; also
    consolidated_pickle.py's)."""

    __slots__ = ("reduction",)

    def __init__(self, reduction: tuple):
        self.reduction = reduction

    def __reduce_ex__(self, protocol: int) -> tuple:
        # (the pickler allows copyreg.__newobj__ only for an object of the class named)
        function, args, *rest = self.reduction
        if function is copyreg.__newobj__:
            function = _new
        return (function, args, *rest)


def _whole(suspended: None, root: Any, resumed: None) -> Rebuilt:
    """A tree pickled whole where its :class:`Tree` was asked again: as a Rebuilt with
    no builder (its values are in place; :func:`finish` takes it as it is)."""
    return Rebuilt(root, unwrap_tensorclass(root).__dict__["_consolidated"], None)


class _Close:
    __slots__ = ("context",)

    def __init__(self, context: Context):
        self.context = context

    def __reduce_ex__(self, protocol: int) -> tuple:
        _close(self.context)
        return _none, ()


def _none() -> None:
    return None


def _values_of(data: bytes, extras: list, closed: None) -> tuple:
    return data, extras


def _node_at(tree: Any, path: tuple) -> Any:
    """The node or leaf at ``path`` of the rebuilt ``tree`` (a Rebuilt)."""
    obj = tree.root
    for key in path:
        obj = obj._tensordict if key is None else obj.__dict__["_tensordict"][key]
    return obj


class _LayoutOf:
    """The layout of the rebuilt tree (a node outside it, pickled node by node, names it)."""

    __slots__ = ("handle",)

    def __init__(self, handle: Tree):
        self.handle = handle

    def __reduce_ex__(self, protocol: int) -> tuple:
        return _layout_of, (self.handle,)


def _layout_of(tree: Any) -> Any:
    return tree.layout


def _new(cls: type, *args: Any) -> Any:
    return cls.__new__(cls, *args)


def _view_at(tree: Any, entry: tuple) -> torch.Tensor:
    """The view ``(dtype, shape, byte offset)`` of the rebuilt ``tree``'s buffer."""
    return views_of_runs(tree.layout.buffer, [(*entry, 1)])[0]


class Pending:
    """Where a skeleton has a value loaded after the tree (its index in the values)."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index


class Rebuilt:
    """A tree rebuilt but for its values (what :class:`Tree` pickles as): its root,
    layout and builder (consolidated_pickle's, which lists the values' places)."""

    __slots__ = ("root", "layout", "builder")

    def __init__(self, root: Any, layout: Any, builder: Any):
        self.root, self.layout, self.builder = root, layout, builder


def rebuild(payload: Any, runs: list[tuple], tree: bytes, extras: Any, locked_by_parent: bool) -> Rebuilt:
    """consolidated_pickle's ``_unpickle_consolidated`` for a tree whose values come
    after it (:func:`finish`): its skeleton's values are left as :class:`Pending`."""
    from shared_td.containers import consolidated_pickle as pickled

    layout = pickled._arrived_layout(payload, runs)
    skeleton = pickled._TreeUnpickler(io.BytesIO(tree), layout, extras).load()
    builder = pickled._Builder(layout, keep_locks=locked_by_parent or not pickled._root_locked(skeleton))
    return Rebuilt(builder.build(skeleton), layout, builder)


def finish(rebuilt: Rebuilt, values: tuple) -> Any:
    """The tree of ``rebuilt`` with its ``values`` (their pickle, the objects it names),
    each put in its place and locked or unlocked as the builder does those it meets."""
    from shared_td.containers.consolidated_pickle import _TreeUnpickler

    builder = rebuilt.builder
    if builder is None:
        # the tree pickled whole (:func:`_whole`: its Tree's reduction was taken before,
        # by a reducer_override that only looked at it): its values are in place already
        return rebuilt.root
    data, extras = values
    loaded = _TreeUnpickler(io.BytesIO(data), rebuilt.layout, extras).load()
    for entries, key, index, locked_node in builder.pending:
        entries[key] = value = loaded[index]
        collection = unwrap_tensorclass(value)
        if not isinstance(collection, LockingOps):
            continue
        if not builder.keep_locks and collection._is_locked:
            collection.unlock_()
        if locked_node is not None:
            if not collection._is_locked:
                collection.lock_()
            collection._lock_parents[id(locked_node)] = weakref.ref(locked_node)
    return rebuilt.root
