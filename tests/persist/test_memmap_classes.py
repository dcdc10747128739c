"""memmap_, memmap, memmap_like and load_memmap on every class other than TensorDict
(the seed page TensorDictBase.memmap_: "every tensordict class and every tensorclass"):
LazyStackedTensorDict (stack_dim 0 and 1, heterogeneous members, nested in a
TensorDict), a tensorclass (tensor, str and nested tensorclass fields), and NonTensorData
and NonTensorStack used on their own. TensorDict itself is tested in test_memmap.py.
"""
from __future__ import annotations

import os

import pytest
import torch

from tests.persist.persist_helpers import bits, dir_state, sample

from shared_td import (
    LazyStackedTensorDict, MemoryMappedTensor, NonTensorData, NonTensorStack, TensorDict,
    is_non_tensor, is_tensorclass, tensorclass,
)
from shared_td.persist.future import TensorDictFuture


@tensorclass
class Inner:
    z: torch.Tensor


@tensorclass
class Sample:
    obs: torch.Tensor
    name: str
    inner: Inner


def make_lazy(stack_dim: int, seed: int = 0) -> LazyStackedTensorDict:
    """Two members with a common key, exclusive keys, a nested one and a str."""
    a = TensorDict(x=sample(torch.float32, (3,), seed), y=sample(torch.float32, (3, 2), seed + 1),
                   note="member a", batch_size=[3])
    b = TensorDict(x=sample(torch.float32, (3,), seed + 2), z=sample(torch.int64, (3,), seed + 3),
                   nested={"w": sample(torch.float64, (3, 4), seed + 4)}, batch_size=[3])
    return LazyStackedTensorDict(a, b, stack_dim=stack_dim)


def make_sample(seed: int = 0) -> Sample:
    return Sample(obs=sample(torch.float32, (3, 2), seed), name="hello",
                  inner=Inner(z=sample(torch.int32, (3,), seed + 1), batch_size=[3]), batch_size=[3])


MAKERS = {
    "lazy0": lambda: make_lazy(0),
    "lazy1": lambda: make_lazy(1),
    "lazy_in_td": lambda: TensorDict(ls=make_lazy(0), top=sample(torch.float32, (2, 4), 9), batch_size=[2]),
    "tensorclass": make_sample,
    "non_tensor_data": lambda: NonTensorData("walk", batch_size=[3]),
    "non_tensor_stack": lambda: NonTensorStack("a", "b", "c"),
}
ALL = list(MAKERS)
WITH_TENSORS = ALL[:4]

# an in-place write into each (one element or row; the str fields keep their value),
# and what it must have changed
WRITES = {
    "lazy0": (lambda o: o.__setitem__(1, {"x": torch.full((3,), 7.0)}),
              lambda o: o.tensordicts[1]["x"].tolist() == [7.0] * 3),
    "lazy1": (lambda o: o.__setitem__(0, {"x": torch.full((2,), 7.0)}),  # row 0 of both members
              lambda o: [m["x"][0].item() for m in o.tensordicts] == [7.0, 7.0]),
    "lazy_in_td": (lambda o: o.__setitem__(1, {"top": torch.full((4,), 7.0), "ls": {"x": torch.full((3,), 8.0)}}),
                   lambda o: o["top"][1].tolist() == [7.0] * 4 and o["ls"].tensordicts[1]["x"].tolist() == [8.0] * 3),
    "tensorclass": (lambda o: o.__setitem__(1, Sample(obs=torch.full((2,), 7.0), name="hello",
                                                      inner=Inner(z=torch.tensor(8, dtype=torch.int32)))),
                    lambda o: o.obs[1].tolist() == [7.0, 7.0] and o.inner.z[1].item() == 8 and o.name == "hello"),
    "non_tensor_stack": (lambda o: o.__setitem__(1, "B"), lambda o: o.tolist() == ["a", "B", "c"]),
}


def walk(obj, path=()):
    """(path, item) of every container and every tensor leaf; a path is also where the
    item is on disk (a member is its index, a tensorclass's entries are in _tensordict)."""
    yield path, obj
    if is_non_tensor(obj):
        return
    if isinstance(obj, LazyStackedTensorDict):
        for i, member in enumerate(obj.tensordicts):
            yield from walk(member, path + (str(i),))
    elif is_tensorclass(obj):
        yield from walk(obj._tensordict, path + ("_tensordict",))
    else:
        for key in obj.keys():
            value = obj.get(key)
            if isinstance(value, torch.Tensor):
                yield path + (key,), value
            else:
                yield from walk(value, path + (key,))


def tensors(obj) -> dict:
    return {path: item for path, item in walk(obj) if isinstance(item, torch.Tensor)}


def snapshot(obj) -> dict:
    """path -> class and batch size of a container, dtype/shape/bytes of a tensor, value
    of non-tensor data."""
    out = {}
    for path, item in walk(obj):
        if isinstance(item, torch.Tensor):
            out[path] = (item.dtype, tuple(item.shape), bits(item))
        else:
            value = item.tolist() if is_non_tensor(item) else None
            stack_dim = getattr(item, "stack_dim", None) if isinstance(item, LazyStackedTensorDict) else None
            out[path] = (type(item).__name__, tuple(item.batch_size), stack_dim, value)
    return out


def read(path) -> bytes:
    with open(path, "rb") as handle:
        return handle.read()


def has_file(tensor) -> bool:
    try:
        return tensor.filename is not None
    except RuntimeError:  # "has no file associated"
        return False


def assert_memmap_at(obj, prefix) -> None:
    """Every leaf an MMT (whose file, when prefix is given, is its path under prefix and
    holds its bytes), every container memory-mapped and locked, tensor ones on the CPU."""
    for path, item in walk(obj):
        if isinstance(item, torch.Tensor):
            assert isinstance(item, MemoryMappedTensor), path
            if prefix is None:
                assert not has_file(item), path
            elif item.numel():
                filename = os.path.join(prefix, *path[:-1], path[-1] + ".memmap")
                assert item.filename == filename and read(filename) == bits(item), path
        else:
            assert item.is_memmap() and item.is_locked, path
            if not is_non_tensor(item):
                assert item.device == torch.device("cpu"), path


@pytest.fixture(params=ALL)
def case(request):
    return request.param


# ----------------------------------------------------------------------- memmap_
def test_memmap_in_place(case, tmp_path):
    obj = MAKERS[case]()
    before = snapshot(obj)
    pointers = {p: t.data_ptr() for p, t in tensors(obj).items()}
    assert obj.memmap_(tmp_path) is obj
    assert_memmap_at(obj, str(tmp_path))
    assert snapshot(obj) == before
    for path, tensor in tensors(obj).items():
        assert tensor.data_ptr() != pointers[path], path
    # a tensorclass's is its tensordict's directory, as in tensordict 0.15.3
    own = tmp_path / "_tensordict" if case == "tensorclass" else tmp_path
    assert obj.saved_path == own and (tmp_path / "meta.json").is_file()
    assert not obj.is_shared()
    # prefix=None on a memory-mapped instance: its own directory again, not anonymous
    assert obj.memmap_() is obj and obj.saved_path == own
    assert_memmap_at(obj, str(tmp_path))
    obj.unlock_()
    assert not obj.is_memmap() and not obj.is_locked
    with pytest.raises(AttributeError):
        obj.saved_path


@pytest.mark.parametrize("name", list(WRITES))
def test_in_place_writes_reach_the_files(name, tmp_path):
    obj = MAKERS[name]().memmap_(tmp_path)
    write, check = WRITES[name]
    write(obj)
    assert check(obj)
    after = snapshot(obj)
    assert_memmap_at(obj, str(tmp_path))  # every leaf file holds the leaf's new bytes
    assert snapshot(TensorDict.load_memmap(tmp_path)) == after
    if name != "non_tensor_stack":  # locked: an entry cannot be replaced
        key = {"lazy_in_td": "top", "tensorclass": "obs"}.get(name, "x")
        with pytest.raises(RuntimeError, match="locked"):
            obj.set(key, torch.zeros(obj.get(key).shape))
        assert snapshot(obj) == after


def test_saved_paths_of_nested_instances(tmp_path):
    x = make_sample().memmap_(tmp_path / "tc")
    assert isinstance(x.obs, MemoryMappedTensor) and isinstance(x.inner.z, MemoryMappedTensor)
    # a tensorclass's is its _tensordict/ child, as in tensordict 0.15.3
    assert x.saved_path == tmp_path / "tc" / "_tensordict"
    assert x.inner.saved_path == tmp_path / "tc" / "_tensordict" / "inner" / "_tensordict"
    td = MAKERS["lazy_in_td"]().memmap_(tmp_path / "td")
    assert td.get("ls").saved_path == tmp_path / "td" / "ls"
    assert [m.saved_path for m in td.get("ls").tensordicts] == [tmp_path / "td" / "ls" / "0", tmp_path / "td" / "ls" / "1"]
    assert td.get("ls").tensordicts[1].get("nested").saved_path == tmp_path / "td" / "ls" / "1" / "nested"


def test_anonymous_memmap(case):
    obj = MAKERS[case]()
    before = snapshot(obj)
    assert obj.memmap_() is obj
    assert_memmap_at(obj, None)
    assert obj.saved_path is None and snapshot(obj) == before
    if case in WRITES:  # in-place writes still work
        write, check = WRITES[case]
        write(obj)
        assert check(obj)


# ------------------------------------------------------------ memmap, memmap_like, load
def test_memmap_copy_leaves_the_source_alone(case, tmp_path):
    obj = MAKERS[case]()
    before = snapshot(obj)
    copy = obj.memmap(tmp_path)
    assert copy is not obj and type(copy) is type(obj)
    assert_memmap_at(copy, str(tmp_path))
    assert snapshot(copy) == before == snapshot(obj)
    assert not obj.is_memmap() and not obj.is_locked
    assert not any(isinstance(t, MemoryMappedTensor) for t in tensors(obj).values())
    if case in WRITES:
        WRITES[case][0](copy)
        assert WRITES[case][1](copy) and snapshot(obj) == before


def test_memmap_like(case, tmp_path):
    obj = MAKERS[case]()
    before = snapshot(obj)
    like = obj.memmap_like(tmp_path)
    assert type(like) is type(obj) and like is not obj
    assert_memmap_at(like, str(tmp_path))
    assert snapshot(obj) == before
    got = snapshot(like)
    assert list(got) == list(before)
    for path, tensor in tensors(like).items():
        assert not tensor.any() and (tensor.dtype, tuple(tensor.shape)) == before[path][:2], path
    for path, item in walk(like):
        if not isinstance(item, torch.Tensor):
            assert got[path] == before[path], path  # same classes, batch sizes, non-tensor data


def test_load_memmap_round_trip(case, tmp_path):
    obj = MAKERS[case]()
    obj.memmap(tmp_path)
    for loaded in (TensorDict.load_memmap(tmp_path), type(obj).load_memmap(tmp_path)):
        assert type(loaded) is type(obj)
        if case == "non_tensor_data":  # no batch size on disk: [] (as tensordict 0.15.3)
            assert loaded.data == "walk" and loaded.batch_size == torch.Size([])
            continue
        assert snapshot(loaded) == snapshot(obj)
        assert all(isinstance(t, MemoryMappedTensor) for t in tensors(loaded).values())


# ----------------------------------------------------------------------------- errors
@pytest.mark.parametrize("name", WITH_TENSORS)
def test_copy_existing(name, tmp_path):
    obj = MAKERS[name]().memmap_(tmp_path / "a")
    before, files = snapshot(obj), dir_state(tmp_path / "a")
    for call in (obj.memmap, obj.memmap_):
        with pytest.raises(RuntimeError, match="already memory-mapped"):
            call(tmp_path / "b")
        assert not os.path.exists(tmp_path / "b" / "meta.json")
        assert snapshot(obj) == before and dir_state(tmp_path / "a") == files
        assert_memmap_at(obj, str(tmp_path / "a"))
    copy = obj.memmap(tmp_path / "b", copy_existing=True)
    assert_memmap_at(copy, str(tmp_path / "b"))
    assert snapshot(copy) == before
    assert obj.memmap_(tmp_path / "c", copy_existing=True) is obj
    assert_memmap_at(obj, str(tmp_path / "c"))


@pytest.mark.parametrize("name", ["non_tensor_data", "non_tensor_stack"])
def test_non_tensor_data_has_no_leaf_file_to_copy_or_refuse(name, tmp_path):
    # as tensordict 0.15.3: copy_existing and existsok concern leaf files only
    obj = MAKERS[name]().memmap_(tmp_path / "a")
    assert obj.memmap(tmp_path / "b").tolist() == obj.tolist()
    other = MAKERS[name]()
    assert other.memmap_(tmp_path / "a", existsok=False) is other


@pytest.mark.parametrize("name", WITH_TENSORS)
def test_existsok_false(name, tmp_path):
    MAKERS[name]().memmap(tmp_path)
    fresh = MAKERS[name]()
    for tensor in tensors(fresh).values():
        tensor.add_(1)
    before, files = snapshot(fresh), dir_state(tmp_path)
    with pytest.raises(RuntimeError, match="already exists"):
        fresh.memmap_(tmp_path, existsok=False)
    assert snapshot(fresh) == before and dir_state(tmp_path) == files
    assert not fresh.is_memmap() and not fresh.is_locked
    fresh.memmap_(tmp_path)  # existsok=True: overwritten
    assert snapshot(TensorDict.load_memmap(tmp_path)) == before


def test_return_early_future(case, tmp_path):
    obj = MAKERS[case]()
    before = snapshot(obj)
    future = obj.memmap_(tmp_path / "a", num_threads=2, return_early=True)
    assert isinstance(future, TensorDictFuture)
    assert future.result() is obj
    assert_memmap_at(obj, str(tmp_path / "a"))
    copy = MAKERS[case]().memmap(tmp_path / "b", num_threads=2, return_early=True).result()
    assert type(copy) is type(obj) and snapshot(copy) == before == snapshot(obj)


def test_robust_key_in_a_lazy_member(tmp_path):
    obj = make_lazy(1)
    obj.tensordicts[1]["a/b"] = torch.arange(3.0)
    obj.memmap_(tmp_path / "robust")
    assert read(tmp_path / "robust" / "1" / "a%2Fb.memmap") == bits(torch.arange(3.0))
    assert TensorDict.load_memmap(tmp_path / "robust").tensordicts[1]["a/b"].tolist() == [0.0, 1.0, 2.0]
    fresh = make_lazy(1)
    fresh.tensordicts[1]["a/b"] = torch.arange(3.0)
    with pytest.raises(ValueError, match="not one file name"):
        fresh.memmap_(tmp_path / "legacy", robust_key=False)
    assert not fresh.is_memmap() and dir_state(tmp_path / "legacy") == {}


@pytest.mark.parametrize("name", ["lazy1", "tensorclass", "non_tensor_stack"])
def test_robust_key_false_with_plain_names_is_the_same_layout(name, tmp_path):
    MAKERS[name]().memmap(tmp_path / "robust", robust_key=True)
    MAKERS[name]().memmap(tmp_path / "legacy", robust_key=False)
    assert dir_state(tmp_path / "robust") == dir_state(tmp_path / "legacy")
    assert snapshot(TensorDict.load_memmap(tmp_path / "legacy", robust_key=False)) == snapshot(MAKERS[name]())


def test_shared_memory_instance_is_refused(case, tmp_path):
    if case.startswith("non_tensor"):  # accepted (as nested, as tensordict): test_final21_persist
        pytest.skip("a shared non-tensor value is memory-mapped and stays shared")
    obj = MAKERS[case]().share_memory_()
    before = snapshot(obj)
    with pytest.raises(RuntimeError, match="shared memory"):
        obj.memmap_(tmp_path / "a")
    assert not os.path.exists(tmp_path / "a" / "meta.json")
    assert obj.is_shared() and not obj.is_memmap() and snapshot(obj) == before
    copy = obj.memmap(tmp_path / "b")  # a memory-mapped copy is fine
    assert copy.is_memmap() and snapshot(copy) == before


# ---------------------------------------------------------------- tensordict 0.15.3
def test_tensorclass_layout_equals_tensordict(tmp_path):
    td_lib = pytest.importorskip("tensordict")
    import json

    @td_lib.tensorclass
    class TdInner:
        z: torch.Tensor

    @td_lib.tensorclass
    class TdSample:
        obs: torch.Tensor
        name: str
        inner: TdInner

    ours = make_sample()
    theirs = TdSample(obs=ours.obs.clone(), name="hello", inner=TdInner(z=ours.inner.z.clone(), batch_size=[3]),
                      batch_size=[3])
    ours.memmap_(tmp_path / "ours")
    theirs.memmap_(tmp_path / "theirs")
    a, b = dir_state(tmp_path / "ours"), dir_state(tmp_path / "theirs")
    assert sorted(a) == sorted(b)
    for rel in a:
        if rel.endswith("meta.json"):
            da, db = json.loads(a[rel]), json.loads(b[rel])
            da.pop("_type", None), db.pop("_type", None)
            for doc in (da, db):  # the child's type names the class
                if doc.get("inner", {}).get("type"):
                    doc["inner"]["type"] = "Inner"
            assert da == db, rel
        elif a[rel] != "<dir>":
            assert a[rel] == b[rel], rel
