"""The fast lane of ``td[index] = other``: a write of the same structure, leaf by leaf.

A replay buffer is written millions of times with tensordicts of one structure (a step,
a batch). The general write (``TensorDict._plan_index_writes``, index_writes.py)
checks every entry's kind, the lock and the shape, and plans one closure per leaf; here
the destination's leaves are found once, for the source's list of leaf paths, and kept in a
:class:`RowWritePlan` on the destination. A later write whose source has the same list
of paths checks only what can change between writes (that each planned leaf is still the
entry at its place, with the same shape, and that each source leaf broadcasts to its
indexed rows) and then writes leaf by leaf.

Correctness of the cache: the plan is never trusted, it is *checked* at each write, by
identity, against the destination as it is now (the leaves in the same pass as the
shapes of the source): the way to each leaf is walked through the destination's dicts as
they are now, every nested tensordict on it is still the planned one, and every planned
leaf is still the same tensor object with the same shape, dtype and storage. So any
structural change, made by any code path (set of a new key, del, rename, replacing a
nested tensordict or a leaf, memmap_ swapping the leaves, resize_ of a leaf), and any
change of a leaf's memory, dtype or strides in place (``share_memory_``, a put on a
multiprocessing queue, which moves the storage to shared memory, ``set_``,
``leaf.data = ...``, ``as_strided_``) makes the check fail and the plan is rebuilt. The plan holds its
nodes and leaves by weak reference only: a leaf that was deleted, replaced or swapped by
memmap_ is freed (its memory, its mapping) at once, not at the next write. Lock state
does not matter: the fast lane writes existing tensors in place, which a locked
tensordict allows. A source leaf of another dtype is cast to the leaf's (torch casts
for a slice, but its ``index_put_`` refuses another dtype, which would fail the write
halfway). Anything the fast lane does not cover (a new key, a non-tensor, another
container class, a shape that does not broadcast, a source leaf in the memory of its
destination leaf, an expanded leaf, a leaf autograd refuses to write: one that requires
grad, an inference tensor) goes to the general write, which raises the same errors,
naming the key and the shapes, before any byte is written. An index tensor in a leaf's
memory (``env[env["done"]] = reset``) is copied before the first write, so every leaf is
written at the rows it selected before the write.

:func:`fit_source` (also used by the general write, index_writes.py) is that cast and
the check, before writing, of what torch would refuse halfway for memory overlap.
"""
from __future__ import annotations

import bisect
import weakref
from typing import Any

import torch

from shared_td.containers import batch as batch_ops
from shared_td.memmap_tensor import MemoryMappedTensor, refuse_read_only

# Tensor classes that override nothing of torch's: torch still looks up
# ``__torch_function__`` on a subclass (MemoryMappedTensor disables it) at every
# ``leaf.shape`` and ``leaf[index] = value``, ~0.5k instructions each, unless told not to
_NO_OVERRIDES = frozenset({torch.Tensor, MemoryMappedTensor})
_NO_SUBCLASS_DISPATCH = torch._C.DisableTorchFunctionSubclass
_MISSING = object()  # what a dict gives for a planned key it no longer has (never a leaf)
_grad_enabled = torch.is_grad_enabled
# whether any of the tensors given requires grad: torch's own, in one call (~half the cost
# of reading each flag in Python); the plain reading where a torch lacks it
_any_requires_grad = getattr(torch._C, "_any_requires_grad", None) or (
    lambda *tensors: any(tensor.requires_grad for tensor in tensors))


class RowWritePlan:
    """Where the leaves of a source with the leaf paths ``paths`` go in one destination."""

    __slots__ = ("paths", "nodes", "rows", "expected", "expected_for", "no_overrides", "inference",
                 "low", "high", "layout", "starts", "ends")

    def __init__(self, paths: list, nodes: list, places: list, leaves: list):
        self.paths = paths  # the source's leaf paths, in its iteration order
        # the same as a tree of keys, to match a source against without building its paths
        self.layout = _layout(paths)
        # (dict number of the parent, key, weak reference to a nested tensordict) on the
        # way to the leaves, parents first: dict 0 is the destination's own, dict i + 1
        # that of nodes[i] (weak references: the plan keeps nothing alive, see above)
        self.nodes = nodes
        # per leaf, in the order of paths: (dict number, key, weak reference to the leaf,
        # its shape, its dtype, its data pointer, which moves with its storage, and the
        # byte range of its storage: a source leaf starting in it may overlap what is
        # written, which the general write checks, or an index tensor starting in it,
        # copied before the first write; and its strides, which as_strided_ changes in
        # place: the plan is then made again, and an expanded leaf refused. None for a
        # contiguous leaf: is_contiguous() says its strides are the same, and costs less)
        self.rows = [(at, key, weakref.ref(leaf), leaf.shape, leaf.dtype, leaf.data_ptr(), *_storage_span(leaf),
                      None if leaf.is_contiguous() else leaf.stride()) for (at, key), leaf in zip(places, leaves)]
        # the lowest and highest address of those storages: an index tensor outside is in
        # none (one test per index tensor); one inside is looked up in their union, as
        # sorted disjoint ranges (the leaves of a plain buffer lie far apart: heap, mmaps)
        self.starts, self.ends = _union(sorted(row[6:8] for row in self.rows))
        self.low = self.starts[0] if self.starts else 0
        self.high = self.ends[-1] if self.ends else 0
        # the leaves are of classes whose torch behaviour is torch's own (see write_rows)
        self.no_overrides = {type(leaf) for leaf in leaves} <= _NO_OVERRIDES
        # an inference tensor is one for its life: written only in inference mode
        self.inference = any(leaf.is_inference() for leaf in leaves)
        self.expected: list = []  # the indexed shape of each leaf ...
        self.expected_for: Any = None  # ... for this (indexed batch size, batch dims)

    def entries(self, dest: Any) -> list | None:
        """The dicts of ``dest`` and of the planned nested tensordicts as they are now,
        in the plan's numbering; None if a nested tensordict is not the planned one."""
        dicts = [dest._tensordict]
        for at, key, ref in self.nodes:
            node = dicts[at].get(key)
            if node is None or node is not ref():
                return None
            dicts.append(node._tensordict)
        return dicts

    def expected_shapes(self, target_batch: torch.Size, batch_dims: int) -> list:
        """The shape of ``leaf[index]`` for each leaf, for an index that leaves the
        batch dims as ``target_batch`` (the feature dims follow)."""
        if self.expected_for != (target_batch, batch_dims):
            self.expected = [target_batch + row[3][batch_dims:] for row in self.rows]
            self.expected_for = (target_batch, batch_dims)
        return self.expected


def _storage_span(leaf: torch.Tensor) -> tuple:
    storage = leaf.untyped_storage()
    start = storage.data_ptr()
    return start, start + storage.nbytes()


def source_leaves(source: Any, kind: type, prefix: tuple, paths: list, leaves: list) -> bool:
    """Append the leaf paths and tensors of ``source`` (a ``kind`` tensordict); False
    if it holds anything but tensors and non-empty nested ``kind`` tensordicts (an
    empty one would add a key to the destination: the general write's business)."""
    for key, value in source._tensordict.items():
        if isinstance(value, torch.Tensor):
            paths.append(prefix + (key,))
            leaves.append(value)
        elif type(value) is not kind or not value._tensordict:
            return False
        elif not source_leaves(value, kind, prefix + (key,), paths, leaves):
            return False
    return True


def make_plan(dest: Any, paths: list) -> RowWritePlan | None:
    """The plan of ``dest`` for a source with leaf ``paths``; None when a path does not
    lead, through tensordicts of ``dest``'s class, to an existing tensor, or leads to an
    expanded one (the general write checks each write into it)."""
    kind = type(dest)
    nodes, places, leaves, numbers = [], [], [], {id(dest): 0}
    for path in paths:
        node = dest
        for part in path[:-1]:
            child = node._tensordict.get(part)
            if type(child) is not kind:
                return None
            if id(child) not in numbers:
                numbers[id(child)] = len(nodes) + 1
                nodes.append((numbers[id(node)], part, weakref.ref(child)))
            node = child
        leaf = node._tensordict.get(path[-1])
        if not isinstance(leaf, torch.Tensor) or is_expanded(leaf):
            return None
        places.append((numbers[id(node)], path[-1]))
        leaves.append(leaf)
    # checked once per plan, not per write: a refused leaf fails before any is written
    refuse_read_only(leaves, "td[index] = value")
    return RowWritePlan(paths, nodes, places, leaves)


def write_rows(dest: Any, index: tuple, target_batch: torch.Size, source: Any) -> bool:
    """``dest[index] = source`` leaf by leaf if the fast lane covers it; False (nothing
    written) otherwise, for the general write to do it or to raise.

    ``index`` is normalized and ``target_batch`` is the batch size it gives
    (``batch_ops.index_and_size``); ``source`` is a tensordict of ``dest``'s class.
    """
    plan = dest._row_write_plan
    sources: list = []
    if plan is not None and plan.no_overrides and _as_planned(source._tensordict, plan.layout, type(dest), sources):
        # the replay buffer's step: plain tensors at the planned keys, in their order
        # (what source_leaves would give, without building the paths)
        paths = plan.paths
        written = _write(plan, dest, index, target_batch, sources, plain=True)
    else:
        paths, sources = [], []
        if not source_leaves(source, type(dest), (), paths, sources):
            return False
        if plan is None or plan.paths != paths:
            plan = _new_plan(dest, paths)
            if plan is None:
                return False
        written = _write(plan, dest, index, target_batch, sources)
    if written is None:  # a planned node or leaf is no longer there or changed: plan again
        plan = _new_plan(dest, paths)
        if plan is None:
            return False
        written = _write(plan, dest, index, target_batch, sources)
    return bool(written)  # False: the general write raises, naming the key and the shapes


def _layout(paths: list) -> tuple:
    """``paths`` (a source's leaf paths, depth first) as a tree: a tuple of ``(key, None)``
    for a leaf and ``(key, subtree)`` for a nested tensordict, in the same order.

    Example:
        >>> _layout([("obs",), ("next", "obs"), ("next", "done")])
        (('obs', None), ('next', (('obs', None), ('done', None))))
    """
    root: list = []
    for path in paths:
        node = root
        for part in path[:-1]:
            if not node or node[-1][0] != part or node[-1][1] is None:
                node.append((part, []))
            node = node[-1][1]
        node.append((path[-1], None))

    def frozen(node: list) -> tuple:
        return tuple((key, None if sub is None else frozen(sub)) for key, sub in node)
    return frozen(root)


def _as_planned(entries: dict, layout: tuple, kind: type, out: list) -> bool:
    """Whether ``entries`` (a source's dict) holds exactly the keys of ``layout``, in its
    order, plain tensors (``_NO_OVERRIDES``) at its leaves and ``kind`` tensordicts at
    its subtrees; their tensors are appended to ``out`` (in the order of the paths)."""
    if len(entries) != len(layout):
        return False
    for (key, value), (planned, sub) in zip(entries.items(), layout):
        if key != planned:
            return False
        if sub is None:
            if type(value) not in _NO_OVERRIDES:
                return False
            out.append(value)
        elif type(value) is not kind or not _as_planned(value._tensordict, sub, kind, out):
            return False
    return True


def _write(plan: RowWritePlan, dest: Any, index: tuple, target_batch: torch.Size, sources: list,
           plain: bool = False) -> bool | None:
    """Check the sources and the plan (``_fits``), then write leaf by leaf; None for a
    stale plan, False for a source that does not fit, with nothing written. ``plain``:
    the sources are known to be of ``_NO_OVERRIDES`` classes."""
    if plan.no_overrides and (plain or _NO_OVERRIDES.issuperset(map(type, sources))):
        # no tensor here overrides torch: the same checks and writes without torch's
        # lookup of __torch_function__ on each (a tensor subclass is left to its own)
        with _NO_SUBCLASS_DISPATCH():
            return _fit_and_write(plan, dest, index, target_batch, sources)
    return _fit_and_write(plan, dest, index, target_batch, sources)


def _fit_and_write(plan: RowWritePlan, dest: Any, index: tuple, target_batch: torch.Size,
                   sources: list) -> bool | None:
    leaves: list = []
    fits = _fits(plan, dest, target_batch, sources, leaves)
    if not fits:
        return fits
    for part in index:  # (an int or a slice: nothing to copy)
        if isinstance(part, torch.Tensor) and plan.low <= part.data_ptr() < plan.high:
            index = _own_index(plan, index)
            break
    if len(index) == 1 and type(index[0]) in _ONE_PART:
        index = index[0]  # (the same write: torch parses a 1-tuple index at each leaf, ~60 ns;
        # a tensor costs the same either way)
    for leaf, value in zip(leaves, sources):
        leaf[index] = value
    return True


_ONE_PART = frozenset({int, slice})  # (a list part would be read as a tuple of parts by torch)


def _own_index(plan: RowWritePlan, index: tuple) -> tuple:
    """``index`` with each tensor part that starts in a planned leaf's storage (a mask
    that is the buffer's own "done" leaf) replaced by a copy: every leaf is written at the
    rows the index gave before the write (the first leaf written would change what the
    others read), and torch refuses an index in the memory it writes."""
    parts = list(index)
    for at, part in enumerate(parts):
        if isinstance(part, torch.Tensor):
            start = part.data_ptr()
            span = bisect.bisect_right(plan.starts, start) - 1
            if span >= 0 and start < plan.ends[span]:
                parts[at] = part.clone()
    return tuple(parts)


def _union(spans: list) -> tuple[list, list]:
    """The sorted ``(start, end)`` ranges ``spans`` merged into disjoint ones, as a list
    of starts and a list of ends (leaves that share a storage give one range).

    Example:
        >>> _union([(0, 4), (2, 6), (8, 9)])
        ([0, 8], [6, 9])
    """
    starts: list = []
    ends: list = []
    for start, end in spans:
        if ends and start <= ends[-1]:
            ends[-1] = max(ends[-1], end)
        else:
            starts.append(start)
            ends.append(end)
    return starts, ends


def _new_plan(dest: Any, paths: list) -> RowWritePlan | None:
    plan = make_plan(dest, paths)
    dest._row_write_plan = plan  # (None: a stale plan is dropped, and what it referred to)
    return plan


def _fits(plan: RowWritePlan, dest: Any, target_batch: torch.Size, sources: list, leaves: list) -> bool | None:
    """In one pass over the planned leaves (appended to ``leaves``): None if one is no
    longer the entry at its place or changed shape (``resize_``), dtype or storage (in
    place: ``share_memory_``, ``set_``, ``leaf.data = ...``), else whether each
    source leaf broadcasts to its leaf's indexed rows and does not start in its leaf's
    storage, and no leaf is one autograd refuses to write (the general write names it);
    a source leaf of another dtype is replaced in ``sources`` by its cast."""
    dicts = plan.entries(dest) if plan.nodes else (dest._tensordict,)  # (a flat plan: no walk)
    if dicts is None:
        return None
    expected = plan.expected
    if plan.expected_for != (target_batch, len(dest._batch_size)):
        expected = plan.expected_shapes(target_batch, len(dest._batch_size))
    fits, cast, missing, keep = True, False, _MISSING, leaves.append
    # (autograd refuses an in-place write into a leaf that requires grad, and an inference
    # tensor outside inference mode: the modes read once per write, the leaves' flags in
    # one call after the loop; requires_grad_ changes a planned leaf in place)
    grad = _grad_enabled()
    if plan.inference and not torch.is_inference_mode_enabled():
        fits = False
    for (at, key, ref, shape, dtype, ptr, low, high, strides), value, want in zip(plan.rows, sources, expected):
        leaf = dicts[at].get(key, missing)
        # (ref() is None once the leaf is gone.) The dtype, data pointer and strides are the
        # leaf's as they are now: share_memory_, a multiprocessing put, set_, `leaf.data =`
        # or as_strided_ change them in the same object, and a stale cast or overlap range
        # would fail halfway in torch (the pointer moves with the storage; the tensor's is
        # cheaper to read)
        if (leaf is not ref() or leaf.shape != shape or leaf.dtype is not dtype or leaf.data_ptr() != ptr
                or (not leaf.is_contiguous() if strides is None else leaf.stride() != strides)):
            return None
        keep(leaf)
        if value.dtype is not dtype:
            cast = True
        elif low <= value.data_ptr() < high:
            fits = False  # perhaps in the memory written: the general write checks it
        have = value.shape
        if have != want and not batch_ops.broadcasts_to(have, want):
            fits = False  # the other leaves are still checked: a stale plan comes first
    if grad and _any_requires_grad(*leaves):
        fits = False
    if cast and fits:  # (new tensors: they overlap nothing)
        sources[:] = [value if value.dtype is row[4] else value.to(row[4]) for value, row in zip(sources, plan.rows)]
    return fits


# ---------------------------------------------------------------- torch's refusals
def fit_source(leaf: torch.Tensor, index: Any, source: Any, key: Any, *, normalized: bool = True) -> Any:
    """``source`` as ``leaf[index] = source`` writes it: a tensor of another dtype is
    cast to the leaf's, as torch casts one written into a slice (its ``index_put_``, the
    write through an index tensor, list or mask, refuses another dtype). Raises a
    RuntimeError naming ``key`` where torch would refuse the write for memory overlap
    (an expanded leaf written through a slice or an int, a source in the memory written)
    or autograd would refuse it (a leaf that requires grad, an inference tensor).
    Called before the first leaf is written, so that such a write changes nothing rather
    than failing halfway. ``index``: normalized on the leaf's dims
    (``batch.normalize_index``), or as given to ``leaf[index]`` if not ``normalized``.

    Example:
        >>> leaf = torch.zeros(4)
        >>> fit_source(leaf, (torch.tensor([0, 2]),), torch.ones(2, dtype=torch.float64), "r").dtype
        torch.float32
        >>> fit_source(leaf, (slice(0, 2),), leaf[1:3], "r")
        Traceback (most recent call last):
        RuntimeError: Cannot write entry 'r' at (slice(0, 2, None),): the value is in the memory written (a view of the entry); write a copy (value.clone()). Nothing was written.
    """
    # (the common case costs five cheap calls: autograd's flags, another dtype, one
    # storage, contiguous)
    if leaf.requires_grad or leaf.is_inference():
        _refuse_autograd(leaf, index, key)
    if isinstance(source, torch.Tensor):
        if source.dtype is not leaf.dtype:
            source = source.to(leaf.dtype)  # (a new tensor: it overlaps nothing)
        elif _same_storage(leaf, source):
            return _refuse(leaf, index, source, key, normalized)
    if not leaf.is_contiguous() and is_expanded(leaf):
        return _refuse(leaf, index, source, key, normalized)
    return source


def _refuse_autograd(leaf: torch.Tensor, index: Any, key: Any) -> None:
    """Raise, naming ``key``, if autograd refuses to write into ``leaf`` in place: a leaf
    (or a view of one) that requires grad while grad is enabled, an inference tensor
    outside inference mode."""
    if leaf.is_inference():
        problem = None if torch.is_inference_mode_enabled() else (
            "the entry is an inference tensor, which torch writes in place only in inference "
            "mode; write it under torch.inference_mode() (or give the tensordict a clone)")
    else:
        base = leaf if leaf._base is None else leaf._base
        problem = None if not (torch.is_grad_enabled() and base.is_leaf and base.requires_grad) else (
            "the entry is a leaf tensor that requires grad (or a view of one), which autograd "
            "refuses to write in place; write it under torch.no_grad() (or detach it)")
    if problem is not None:
        name = repr(key[0] if isinstance(key, tuple) and len(key) == 1 else key)
        raise RuntimeError(f"Cannot write entry {name} at {index!r}: {problem}. Nothing was written.")


def is_expanded(tensor: torch.Tensor) -> bool:
    """True if elements of ``tensor`` share memory (a dim of stride 0 and size > 1, as
    ``expand`` gives): torch refuses to copy into it."""
    return 0 in tensor.stride() and tensor.numel() > 0 and any(
        stride == 0 and size > 1 for size, stride in zip(tensor.shape, tensor.stride()))


def _refuse(leaf: torch.Tensor, index: Any, source: Any, key: Any, normalized: bool) -> Any:
    if not normalized or not isinstance(index, tuple):
        index = batch_ops.normalize_index(index, leaf.shape)
    problem = _overlap_refused(leaf, index, source)
    if problem is None:
        return source
    name = repr(key[0] if isinstance(key, tuple) and len(key) == 1 else key)
    raise RuntimeError(f"Cannot write entry {name} at {index!r}: {problem}. Nothing was written.")


_EXPANDED = ("the entry is an expanded tensor (several of the elements written are one memory "
             "location, which torch refuses to write); give the tensordict a copy of it (entry.clone())")
_IN_DESTINATION = "the value is in the memory written (a view of the entry); write a copy (value.clone())"
_IN_ENTRY = ("the value is a view of the entry, which torch refuses to write into it through an index "
             "tensor, list or mask; write a copy (value.clone())")


def _overlap_refused(leaf: torch.Tensor, index: tuple, source: Any) -> str | None:
    """Why torch refuses ``leaf[index] = source`` for memory overlap, or None: its rules
    (torch/csrc/autograd/python_variable_indexing.cpp, aten's MemoryOverlap), in Python."""
    # (a 0-d integer tensor selects as an int does)
    parts = tuple(int(p) if isinstance(p, torch.Tensor) and not p.ndim and p.dtype != torch.bool else p
                  for p in index)
    if all(not isinstance(p, (torch.Tensor, bool)) for p in parts):  # a view, copied into
        dest = leaf[parts]
        if not isinstance(source, torch.Tensor) or (
                not source.ndim and source.shape != dest.shape and source.device.type == "cpu"):
            return _EXPANDED if is_expanded(dest) else None  # filled with one value
        if source.shape != dest.shape:  # (torch drops the leading 1s, then expands)
            lead = next((i for i, size in enumerate(source.shape) if size != 1), source.ndim)
            source = source[(0,) * lead].expand(dest.shape)
        if _same_data(dest, source):
            return None  # (copy_ returns at once)
        if is_expanded(dest):
            return _EXPANDED
        status = _overlap(dest, source)
        return _IN_DESTINATION if status == "partial" else None
    if not isinstance(source, torch.Tensor):
        return None  # (a number: a new tensor; an expanded leaf only makes torch warn)
    advanced = [p for p in parts if isinstance(p, (torch.Tensor, bool))]
    one_mask = len(advanced) == 1 and isinstance(advanced[0], torch.Tensor) and advanced[0].dtype == torch.bool
    if one_mask and advanced[0].ndim and source.numel() == 1 and source.device.type == "cpu":
        return None  # torch fills the masked elements with the one value (masked_fill_)
    # index_put_ into the view that the basic parts give: any overlap with the value is refused
    basic: list = []
    for part in parts:
        if isinstance(part, bool) or (isinstance(part, torch.Tensor) and not part.ndim):
            basic.append(None)  # (a bool adds a dim, indexed then)
        elif isinstance(part, torch.Tensor):
            basic += [slice(None)] * (part.ndim if part.dtype == torch.bool else 1)
        else:
            basic.append(part)
    return _IN_ENTRY if _overlap(leaf[tuple(basic)], source) else None


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _same_data(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (_same_storage(a, b) and a.storage_offset() == b.storage_offset() and a.stride() == b.stride()
            and a.shape == b.shape and a.dtype == b.dtype and a.is_conj() == b.is_conj()
            and a.is_neg() == b.is_neg())


def _overlap(a: torch.Tensor, b: torch.Tensor) -> str | None:
    """"full", "partial" or None, as aten's get_overlap_status: only two dense tensors
    in one storage are compared (torch checks nothing else)."""
    if not a.numel() or not b.numel() or not _dense(a) or not _dense(b) or not _same_storage(a, b):
        return None
    a_start, b_start = a.data_ptr(), b.data_ptr()
    a_end, b_end = a_start + a.numel() * a.element_size(), b_start + b.numel() * b.element_size()
    if a_start == b_start and a_end == b_end:
        return "full" if a.stride() == b.stride() else "partial"
    return "partial" if a_start < b_end and b_start < a_end else None


def _dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense (its elements fill its memory range), as torch's flag."""
    if t.ndim == 1:
        return t.shape[0] < 2 or t.stride(0) == 1
    expected = 1
    for stride, size in sorted((stride, size) for size, stride in zip(t.shape, t.stride()) if size != 1):
        if stride != expected:
            return False
        expected *= size
    return True
