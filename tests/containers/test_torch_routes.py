"""torch.load with torch's defaults, copy.deepcopy and torch.save of consolidated trees,
side by side with tensordict 0.15.3 (findings 1, 2 and 4 of the session-20 audit of the
routes a tensordict is sent by).

1. ``torch.load(f)`` (``weights_only=True`` since torch 2.6) loads our containers, as
   tensordict's: they are allowlisted, and nothing that opens a file or another
   process's descriptor is (memory-mapped tensors, shared non-tensor values).
2. ``copy.deepcopy`` is ``clone()``, as tensordict's: new private leaves, unlocked, not
   shared, not memory-mapped, nothing tied to the original (a shared non-tensor value,
   a SharedCounter), with the memo kept (an object met twice is copied once).
4. ``torch.save`` of a consolidated tree writes its buffer as one storage record:
   ``torch.load(mmap=True)`` maps it and the file is its size.
"""
from __future__ import annotations

import copy
import io
import pickle
import zipfile

import pytest
import torch

import shared_td


def _library(name: str):
    return shared_td if name == "shared_td" else pytest.importorskip(name)


LIBS = ["shared_td", "tensordict"]


def _saved(obj) -> io.BytesIO:
    file = io.BytesIO()
    torch.save(obj, file)
    file.seek(0)
    return file


# ------------------------------------------------------------------ 1. torch.load defaults
def _case(m, name: str):
    T = m.TensorDict
    if name == "plain":
        return T(a=torch.arange(2.0), batch_size=[2])
    if name == "locked nested named":
        return T(a=torch.arange(2.0), n=T(b=torch.ones(2), batch_size=[2]), batch_size=[2], names=["t"]).lock_()
    if name == "non-tensor":
        return T(a=torch.arange(2.0), s=m.NonTensorData("x", batch_size=[2]),
                 l=m.NonTensorData([1, 2.0, "a"], batch_size=[2]), batch_size=[2])
    if name == "non-tensor stack":
        return T(s=m.NonTensorStack("a", "b"), batch_size=[2])
    if name == "lazy stack":
        return m.LazyStackedTensorDict.lazy_stack([T(a=torch.zeros(2)), T(a=torch.ones(3))])
    if name == "consolidated":
        return T(a=torch.arange(2.0), n=T(b=torch.ones(2), batch_size=[2]), s="x", batch_size=[2]).consolidate()
    if name == "shared":
        return T(a=torch.arange(2.0), batch_size=[2]).share_memory_()
    raise AssertionError(name)


def _assert_same(loaded, obj) -> None:
    if hasattr(obj, "tensordicts"):  # a lazy stack: member by member
        assert len(loaded.tensordicts) == len(obj.tensordicts)
        for member, original in zip(loaded.tensordicts, obj.tensordicts):
            _assert_same(member, original)
        return
    assert set(loaded.keys(True, True)) == set(obj.keys(True, True))
    for key in obj.keys(True, True):
        value, original = loaded[key], obj[key]
        assert (value == original).all() if isinstance(original, torch.Tensor) else value == original


# (as tensordict 0.15.3 loads them: a tree locked on its own comes back locked, a
# consolidated one unlocked)
_LOCKED = {"locked nested named": True, "shared": True}


@pytest.mark.parametrize("name", ["plain", "locked nested named", "non-tensor", "non-tensor stack",
                                  "lazy stack", "shared"])
@pytest.mark.parametrize("lib", LIBS)
def test_torch_load_with_its_defaults_loads_a_container(lib, name):
    # before: UnpicklingError "Unsupported global: GLOBAL shared_td.containers...."
    m = _library(lib)
    obj = _case(m, name)
    loaded = torch.load(_saved(obj))
    assert type(loaded).__name__ == type(obj).__name__
    assert loaded.batch_size == obj.batch_size and loaded.is_locked == _LOCKED.get(name, False)
    _assert_same(loaded, obj)
    if name == "locked nested named":
        assert loaded.names == ["t"]


def test_a_crafted_consolidated_pickle_cannot_change_a_class_under_weights_only():
    # the skeleton's own unpickler BUILDs: allowlisted, a file loaded with torch's
    # defaults set torch.UntypedStorage.nbytes = None (every later torch.save failed)
    import io
    import pickle

    from shared_td.containers import consolidated_pickle as cp

    module = cp.__name__.encode()
    skeleton = b"".join([b"\x80\x02c" + module + b"\n_extra\nK\x00\x85R", b"N}X\x06\x00\x00\x00nbytesNs\x86b0",
                         b"]X\x01\x00\x00\x00xa."])

    class Crafted:
        def __reduce__(self):
            return cp._unpickle_consolidated, (torch.empty(0, dtype=torch.uint8), [], skeleton,
                                               [torch.storage.UntypedStorage])

    file = io.BytesIO()
    torch.save(Crafted(), file)
    file.seek(0)
    with pytest.raises(pickle.UnpicklingError, match="_unpickle_consolidated"):
        torch.load(file)
    assert "nbytes" not in vars(torch.storage.UntypedStorage)


@pytest.mark.parametrize("lib", LIBS)
def test_a_consolidated_tree_loads_with_weights_only_false(lib):
    # (shared_td: weights_only=True refuses it, see the test above; tensordict loads it)
    m = _library(lib)
    obj = _case(m, "consolidated")
    loaded = torch.load(_saved(obj), weights_only=False)
    assert type(loaded).__name__ == type(obj).__name__ and not loaded.is_locked
    _assert_same(loaded, obj)


def test_the_allowlist_names_nothing_that_opens_files_or_descriptors():
    from shared_td.containers import torch_serialization
    from shared_td.memmap_tensor import MemoryMappedTensor
    from shared_td.storage.anonymous import Segment
    from shared_td.storage.counter import SharedCounter
    from shared_td.storage.shared_value import SharedValue

    allowed = set(torch.serialization.get_safe_globals())
    assert set(torch_serialization.SAFE_GLOBALS) <= allowed
    for refused in (MemoryMappedTensor, Segment, SharedValue, SharedCounter):
        assert refused not in allowed


@pytest.mark.parametrize("how", ["memmap_", "share_non_tensor"])
def test_torch_load_with_its_defaults_refuses_mapped_and_shared_values(how):
    # (tensordict 0.15.3 cannot torch.save either tree: TypeError, RuntimeError)
    td = shared_td.TensorDict(a=torch.zeros(2), s="x", batch_size=[2])
    td = td.memmap_() if how == "memmap_" else td.share_memory_()
    file = _saved(td)
    with pytest.raises(pickle.UnpicklingError, match="Unsupported global"):
        torch.load(file)
    file.seek(0)
    assert torch.load(file, weights_only=False)["s"] == "x"  # (a file of this process: trusted)


_TENSORCLASSES: dict = {}


def _tensorclass(lib: str):
    """A tensorclass of ``lib`` that pickle finds by its module-level name."""
    cls = _TENSORCLASSES.get(lib)
    if cls is None:
        name = f"_Point_{lib}"

        class Point:
            x: torch.Tensor
            label: str

        Point.__name__ = Point.__qualname__ = name
        cls = _TENSORCLASSES[lib] = globals()[name] = _library(lib).tensorclass(Point)
    return cls


@pytest.mark.parametrize("lib", LIBS)
def test_torch_load_of_a_tensorclass_needs_its_class_allowlisted_as_tensordicts(lib):
    Point = _tensorclass(lib)
    file = _saved(Point(x=torch.zeros(2), label="p", batch_size=[2]))
    with pytest.raises(pickle.UnpicklingError, match="Unsupported global"):
        torch.load(file)
    file.seek(0)
    with torch.serialization.safe_globals([Point]):
        loaded = torch.load(file)
    assert type(loaded) is Point and loaded.label == "p" and (loaded.x == 0).all()


# ------------------------------------------------------------------ 2. copy.deepcopy
def _shared_tree(m, how: str):
    td = m.TensorDict(a=torch.zeros(2), n=m.TensorDict(b=torch.ones(2), batch_size=[2]),
                      s=m.NonTensorData("orig", batch_size=[2]), batch_size=[2])
    if how == "share_memory_":
        return td.share_memory_()
    if how == "memmap_":
        return td.memmap_()
    if how == "share_non_tensor":
        return td.memmap_(share_non_tensor=True)
    if how == "lock_":
        return td.lock_()
    if how == "consolidate":
        return td.consolidate()
    if how == "consolidate shared":
        return td.consolidate(share_memory=True)
    if how == "consolidate memmap_":  # (its leaves memory-mapped, no longer in the plain buffer)
        return td.consolidate().memmap_()
    raise AssertionError(how)


@pytest.mark.parametrize("how", ["share_memory_", "memmap_", "share_non_tensor", "lock_", "consolidate",
                                 "consolidate shared", "consolidate memmap_"])
@pytest.mark.parametrize("lib", LIBS)
def test_deepcopy_is_a_private_unlocked_clone(lib, how):
    # before (shared_td): the copy of a shared or memory-mapped tree was locked and said
    # is_shared()/is_memmap() over leaves that were not (memory-mapped ones for memmap_),
    # and its shared non-tensor value was the original's cell: a write reached it
    m = _library(lib)
    td = _shared_tree(m, how)
    out = copy.deepcopy(td)
    assert not out.is_locked and not out["n"].is_locked
    assert not out.is_shared() and not out.is_memmap()
    assert type(out["a"]) is torch.Tensor and not out["a"].is_shared()
    out["new"] = torch.zeros(2)  # unlocked: a key may be added
    out.set_("s", "changed-in-copy")
    out["a"].fill_(7.0)
    assert td["s"] == "orig" and (td["a"] == 0).all()
    assert out["s"] == "changed-in-copy"
    if how != "consolidate":  # (a consolidated copy: consolidated too, see the README)
        assert not out.is_consolidated()


@pytest.mark.parametrize("lib", LIBS)
def test_deepcopy_of_a_sub_tree_of_a_locked_consolidated_tree_is_unlocked(lib):
    m = _library(lib)
    td = m.TensorDict(a=torch.zeros(2), n=m.TensorDict(b=torch.ones(2), batch_size=[2]), batch_size=[2]).consolidate()
    out = copy.deepcopy(td["n"])
    assert not out.is_locked and (out["b"] == 1).all()
    out["c"] = torch.zeros(2)


@pytest.mark.parametrize("lib", LIBS)
def test_deepcopy_of_shared_non_tensors_lazy_stacks_and_tensorclasses(lib):
    m = _library(lib)
    value = m.NonTensorData("orig", batch_size=[2]).share_memory_()
    copied = copy.deepcopy(value)
    assert not copied.is_locked and not copied.is_shared()
    copied.update_(m.NonTensorData("new"))
    assert value.data == "orig"
    stack = m.LazyStackedTensorDict.lazy_stack([m.TensorDict(a=torch.zeros(2)), m.TensorDict(a=torch.zeros(3))])
    stack = stack.share_memory_()
    out = copy.deepcopy(stack)
    assert not out.is_locked and not out.tensordicts[0].is_locked and not out.is_shared()
    assert not out.tensordicts[1]["a"].is_shared()
    out.tensordicts[1]["b"] = torch.zeros(3)  # (unlocked members)
    Point = _tensorclass(lib)
    point = Point(x=torch.zeros(2), label="p", batch_size=[2]).share_memory_()
    out = copy.deepcopy(point)
    assert type(out) is Point and not out.is_locked and not out.x.is_shared() and out.label == "p"
    out.x.fill_(1.0)
    assert (point.x == 0).all()


@pytest.mark.parametrize("lib", LIBS)
def test_deepcopy_keeps_autograd_history_as_clone(lib):
    # before (shared_td): RuntimeError "Only Tensors created explicitly by the user ...
    # support the deepcopy protocol" (torch's deepcopy of a leaf; clone() keeps the graph)
    m = _library(lib)
    x = torch.ones(2, requires_grad=True)
    out = copy.deepcopy(m.TensorDict(y=x * 2, batch_size=[2]))
    out["y"].sum().backward()
    assert (x.grad == 2).all()


@pytest.mark.parametrize("lib", LIBS)
def test_copy_copy_is_a_new_structure_over_the_same_leaves(lib):
    m = _library(lib)
    td = m.TensorDict(a=torch.zeros(2), n=m.TensorDict(b=torch.ones(2), batch_size=[2]), batch_size=[2])
    td = td.share_memory_()
    out = copy.copy(td)
    assert not out.is_locked and not out.is_shared() and out["a"] is td["a"]
    out["new"] = torch.zeros(2)
    assert "new" not in td.keys()


def test_deepcopy_copies_an_object_met_twice_once():
    # (shared_td: the memo is kept; tensordict 0.15.3's deepcopy is clone(), which copies
    # a leaf held at two keys twice and ignores the memo)
    T = shared_td.TensorDict
    leaf = torch.zeros(2)
    td = T(a=leaf, b=leaf, n=T(c=torch.ones(2), batch_size=[2]), batch_size=[2])
    td["m"] = td["n"]
    out, out_leaf = copy.deepcopy((td, leaf))
    assert out["a"] is out["b"] is out_leaf and out["a"] is not leaf
    assert out["n"] is out["m"] and out["n"] is not td["n"]


def test_deepcopy_of_a_value_holding_its_own_tree_gets_the_copy():
    holder = type("Holder", (), {})()
    td = shared_td.TensorDict(a=torch.zeros(2), batch_size=[2])
    holder.tree, holder.leaf = td, td["a"]
    td["h"] = shared_td.NonTensorData(holder, batch_size=[2])
    out = copy.deepcopy(td)
    assert out["h"].tree is out and out["h"].leaf is out["a"]


def test_deepcopy_of_a_shared_value_and_a_counter_makes_new_ones():
    # before: the copy was the same cell (its pickle, found in this process's cache)
    from shared_td.storage.shared_value import SharedValue

    counter = shared_td.SharedCounter(3)
    copied = copy.deepcopy(counter)
    assert copied.fetch_add(5) == 3 and counter.value == 3 and copied.value == 8
    cell = SharedValue.create(["a"])
    other = copy.deepcopy(cell)
    other.set(["b"])
    assert cell.get() == ["a"] and other.get() == ["b"] and other is not cell


# ------------------------------------------------------------------ 4. torch.save, consolidated
_MIB = 1 << 20


@pytest.mark.parametrize("lib", LIBS)
def test_torch_save_of_a_consolidated_tree_writes_one_storage_record(lib, tmp_path):
    # before (shared_td): the buffer was a protocol-2 string inside data.pkl (the file
    # ~1.5x the buffer, no storage record, nothing for torch.load(mmap=True) to map)
    m = _library(lib)
    td = m.TensorDict(a=torch.arange(_MIB // 4, dtype=torch.float32), n=m.TensorDict(b=torch.ones(4)),
                      batch_size=[]).consolidate()
    path = tmp_path / "tree.pt"
    torch.save(td, path)
    with zipfile.ZipFile(path) as archive:
        infos = archive.infolist()
    records = [info for info in infos if "/data/" in info.filename]
    pickled = [info for info in infos if info.filename.endswith("data.pkl")][0]
    assert len(records) == 1 and records[0].file_size >= _MIB
    assert pickled.file_size < 64 * 1024
    assert path.stat().st_size < _MIB + 128 * 1024
    loaded = torch.load(path, mmap=True, weights_only=False)
    assert (loaded["a"] == td["a"]).all() and (loaded["n", "b"] == 1).all()
    assert loaded.is_consolidated() or lib == "tensordict"


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
@pytest.mark.parametrize("lib", LIBS)
def test_a_consolidated_tree_pickles_with_every_protocol(lib, protocol):
    m = _library(lib)
    td = m.TensorDict(a=torch.arange(4.0), n=m.TensorDict(b=torch.ones(2)), s="x", batch_size=[]).consolidate()
    out = pickle.loads(pickle.dumps(td, protocol=protocol))
    assert (out["a"] == td["a"]).all() and (out["n", "b"] == 1).all() and out["s"] == "x"
    out["a"][0] = 9.0
    assert td["a"][0] == 0


def test_protocol_5_keeps_the_buffer_out_of_band():
    td = shared_td.TensorDict(a=torch.arange(1024.0), batch_size=[]).consolidate()
    buffers: list = []
    data = pickle.dumps(td, protocol=5, buffer_callback=buffers.append)
    assert len(buffers) == 1 and buffers[0].raw().nbytes >= 4096 and len(data) < 4096
    out = pickle.loads(data, buffers=buffers)
    assert (out["a"] == td["a"]).all()


def test_deepcopy_leaves_a_module_copied_later_its_own_parameters():
    # before: the tree's clone of the Parameter stood for it in the memo, so the module
    # copied after it got a plain non-leaf tensor tied to the original's graph
    import copy

    linear = torch.nn.Linear(2, 2)
    for lib in LIBS:
        m = _library(lib)
        td = m.TensorDict(w=linear.weight, batch_size=[])
        out = copy.deepcopy({"params": td, "model": linear})
        weight = out["model"].weight
        assert isinstance(weight, torch.nn.Parameter) and weight.is_leaf, lib
        assert weight.data_ptr() != linear.weight.data_ptr()
    td = shared_td.TensorDict(w=linear.weight, v=linear.weight, batch_size=[])
    out = copy.deepcopy(td)
    assert out["w"] is out["v"] and out["w"].grad_fn is not None  # (clone(), as tensordict's)


def test_deepcopy_of_a_subclass_stays_that_subclass():
    import copy

    class MyTD(shared_td.TensorDict):
        pass

    td = MyTD(a=torch.zeros(2), batch_size=[2])
    assert type(copy.deepcopy(td)) is MyTD
