"""Drop-in differences from tensordict 0.15.3 found in session 19 (audit findings 1, 4
and 6), side by side with it: non-tensor entries of ``apply``/``detach``/``to(dtype)``
results are new ones; the tensorclass class check of ``td[idx] = src`` at every depth;
``NonTensorData == number``, ``detach_()`` and ``from_handler(index=<tensor>)``."""
from __future__ import annotations

from typing import Any

import pytest
import torch

import shared_td
from tests.reference import LIBS

# ---------------------------------------------------------------- 1. no aliasing of non-tensors

OPS = {
    "apply": lambda td: td.apply(lambda t: t + 1),
    "detach": lambda td: td.detach(),
    "to_float64": lambda td: td.to(torch.float64),
    "float": lambda td: td.apply(lambda t: t.float()),
    "named_apply": lambda td: td.named_apply(lambda key, t: t * 2),
}


def _source(lib, kind: str, tmp_path):
    td = lib.TensorDict({"x": torch.zeros(2), "s": "old", "st": ["a", "b"],
                         "n": {"t": "inner", "y": torch.zeros(2)}}, [2])
    if kind == "shared":
        td.share_memory_()
    elif kind == "memmap":
        td.memmap_(tmp_path / "td")
    return td


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("kind", ["plain", "shared", "memmap"])
@pytest.mark.parametrize("op", list(OPS))
def test_writes_into_the_result_leave_the_source_alone(lib, kind, op, tmp_path):
    # before: the result held the source's very NonTensorData/NonTensorStack objects, so a
    # write into it changed the source (and a memory-mapped source's files)
    src = _source(lib, kind, tmp_path)
    out = OPS[op](src)
    out.set_("s", "new")
    out.set_at_("st", "Z", 0)
    out.set_(("n", "t"), "changed")
    assert out["s"] == "new" and list(out["st"]) == ["Z", "b"] and out["n", "t"] == "changed"
    assert src["s"] == "old" and list(src["st"]) == ["a", "b"] and src["n", "t"] == "inner"
    if kind == "memmap":
        disk = lib.TensorDict.load_memmap(tmp_path / "td")
        assert disk["s"] == "old" and list(disk["st"]) == ["a", "b"] and disk["n", "t"] == "inner"


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("kind", ["shared", "memmap"])
def test_apply_of_a_shared_source_gives_plain_non_tensors(lib, kind, tmp_path):
    out = _source(lib, kind, tmp_path).apply(lambda t: t + 1)
    for key in ("s", "st", ("n", "t")):
        entry = out.get(key)
        assert not entry.is_shared() and not entry.is_memmap(), key


@pytest.mark.parametrize("lib", LIBS)
def test_apply_keeps_the_python_values(lib):
    value = {"k": [1, 2]}
    td = lib.TensorDict({"x": torch.zeros(2), "o": lib.NonTensorData(value, batch_size=[2])}, [2])
    out = td.apply(lambda t: t + 1)
    assert out.get("o") is not td.get("o") and out["o"] is value  # a new entry, the same value


@pytest.mark.parametrize("lib", LIBS)
def test_readme_quickstart_lock_does_not_lock_the_source(lib):
    td = lib.TensorDict({"obs": torch.zeros(4, 3), "task": "walk", "tags": ["a", "b", "c", "d"]}, [4])
    shared = td.apply(lib.MemoryMappedTensor.from_tensor).lock_()
    assert not td.get("task").is_locked and not td.get("tags").is_locked
    td.set_("task", "run")
    td[0] = lib.TensorDict({"obs": torch.ones(3), "task": "run", "tags": "Z"}, [])
    assert shared["task"] == "walk" and list(shared["tags"]) == ["a", "b", "c", "d"]


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("op", ["detach", "apply"])
def test_tensorclass_and_lazy_stack_results_hold_their_own_non_tensors(lib, op):
    @lib.tensorclass
    class Step:
        obs: torch.Tensor
        label: str

    step = Step(obs=torch.zeros(2), label="a", batch_size=[2])
    lazy = lib.lazy_stack([lib.TensorDict(x=torch.zeros(()), s="m0"), lib.TensorDict(x=torch.zeros(()), s="m1")])
    for source in (step, lazy):
        out = source.detach() if op == "detach" else source.apply(lambda t: t + 1)
        key = "label" if source is step else "s"
        before = source[0].get(key) if source is lazy else source.label
        out.set_(key, "new")
        after = source[0].get(key) if source is lazy else source.label
        assert after == before


# ---------------------------------------------------------------- 4. class check at every depth

def _classes(lib):
    class A(lib.TensorClass):
        x: torch.Tensor

    class B(lib.TensorClass):
        x: torch.Tensor
        y: torch.Tensor

    class C(lib.TensorClass):  # the same fields as A
        x: torch.Tensor

    class Outer(lib.TensorClass):
        inner: Any

    return A, B, C, Outer


WRITES = {
    "slice": lambda td, src: td.__setitem__(slice(0, 2), src[:2]),
    "row": lambda td, src: td.__setitem__(0, src[0]),
    "index_tensor": lambda td, src: td.__setitem__(torch.tensor([0, 2]), src[torch.tensor([0, 1])]),
    "update_at_": lambda td, src: td.update_at_(src[0], 1),  # (before: a KeyError for ('a', 'y'))
}


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("write", list(WRITES))
def test_nested_tensorclass_of_another_class_is_refused(lib, write):
    # before: no error, and B's field y was added into the A instance
    A, B, _, _ = _classes(lib)
    td = lib.TensorDict({"a": A(x=torch.zeros(3), batch_size=[3])}, [3])
    src = lib.TensorDict({"a": B(x=torch.ones(3), y=torch.full((3,), 7.0), batch_size=[3])}, [3])
    with pytest.raises(ValueError, match="same-class or compatible class"):
        WRITES[write](td, src)
    assert sorted(td.get("a")._tensordict.keys()) == ["x"] and td["a"].x.tolist() == [0.0] * 3


@pytest.mark.parametrize("lib", LIBS)
def test_outer_tensorclass_whose_field_holds_another_class_is_refused(lib):
    A, B, _, Outer = _classes(lib)
    o1 = Outer(inner=A(x=torch.zeros(3), batch_size=[3]), batch_size=[3])
    o2 = Outer(inner=B(x=torch.ones(3), y=torch.ones(3), batch_size=[3]), batch_size=[3])
    with pytest.raises(ValueError, match="same-class or compatible class"):
        o1[:2] = o2[:2]
    assert type(o1.inner) is A and sorted(o1.inner._tensordict.keys()) == ["x"]


@pytest.mark.parametrize("lib", LIBS)
def test_deeper_nesting_is_refused_too(lib):
    A, B, _, _ = _classes(lib)
    td = lib.TensorDict({"n": {"a": A(x=torch.zeros(3), batch_size=[3])}}, [3])
    src = lib.TensorDict({"n": {"a": B(x=torch.ones(3), y=torch.ones(3), batch_size=[3])}}, [3])
    with pytest.raises(ValueError, match="same-class or compatible class"):
        td[1:] = src[1:]
    assert td["n", "a"].x.tolist() == [0.0] * 3


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # (tensordict's, for the lazy stack's write)
@pytest.mark.parametrize("lib", LIBS)
def test_compatible_class_tensordict_and_lazy_parent_are_accepted(lib):
    A, B, C, _ = _classes(lib)
    td = lib.TensorDict({"a": A(x=torch.zeros(3), batch_size=[3])}, [3])
    td[:2] = lib.TensorDict({"a": C(x=torch.ones(3), batch_size=[3])}, [3])[:2]  # same fields
    td[2] = lib.TensorDict({"a": lib.TensorDict(x=torch.full((3,), 2.0), batch_size=[3])}, [3])[0]
    assert td["a"].x.tolist() == [1.0, 1.0, 2.0]
    lazy = lib.lazy_stack([lib.TensorDict({"a": A(x=torch.zeros(()), batch_size=[])}, []) for _ in range(3)])
    src = lib.TensorDict({"a": B(x=torch.ones(3), y=torch.ones(3), batch_size=[3])}, [3])
    if lib.__name__ == "shared_td":
        # B's field y is no field of A: refused, as a dict source is (it was added into the
        # members' A, whose copies then read as TensorDicts)
        with pytest.raises(ValueError, match=r"Keys \['y'\] are not fields of A"):
            lazy[:2] = src[:2]
        assert lazy[0]["a", "x"].item() == 0.0 and sorted(lazy.tensordicts[0]["a"].keys()) == ["x"]
        lazy[:2] = lib.TensorDict({"a": C(x=torch.ones(3), batch_size=[3])}, [3])[:2]  # same fields: written
    else:
        lazy[:2] = src[:2]  # tensordict 0.15.3 adds y into the members' A, whose clone then raises
        with pytest.raises(ValueError, match="must correspond to the class attributes"):
            lazy.tensordicts[0].clone()
    assert lazy[0]["a", "x"].item() == 1.0


# ---------------------------------------------------------------- 6. minor


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("other", [0, 1.5, True, torch.zeros(2)], ids=["int", "float", "bool", "tensor"])
@pytest.mark.parametrize("stack", [False, True], ids=["data", "stack"])
def test_non_tensor_compared_with_a_number_is_an_empty_tensordict(lib, other, stack):
    # before: a bool tensor (False, False), so (nt == 0).all() was False
    nt = lib.NonTensorStack.from_list(["a", "b"]) if stack else lib.NonTensorData("a", batch_size=[2])
    for result in (nt == other, nt != other):
        assert lib.is_tensor_collection(result) and result.batch_size == torch.Size([2])
        assert list(result.keys()) == [] and bool(result.all())


@pytest.mark.parametrize("lib", LIBS)
def test_non_tensors_still_compare_with_non_tensors(lib):
    nt = lib.NonTensorData("a", batch_size=[2])
    assert (nt == lib.NonTensorData("a", batch_size=[2])).tolist() == [True, True]
    assert (nt != lib.NonTensorData("b", batch_size=[2])).tolist() == [True, True]


def _graph(lib, kind: str):
    leaf = torch.zeros(2, requires_grad=True)

    @lib.tensorclass
    class Step:
        x: torch.Tensor
        label: str

    if kind == "dense":
        return lib.TensorDict({"x": leaf * 2, "n": {"y": leaf * 3}, "s": "a"}, [2])
    if kind == "locked":
        return lib.TensorDict({"x": leaf * 2, "n": {"y": leaf * 3}}, [2]).lock_()
    if kind == "lazy":
        return lib.lazy_stack([lib.TensorDict(x=leaf[0] * 2), lib.TensorDict(x=leaf[1] * 2)])
    return Step(x=leaf * 2, label="a", batch_size=[2])


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("kind", ["dense", "locked", "lazy", "tensorclass"])
def test_detach_in_place(lib, kind):
    # before: AttributeError (no detach_)
    td = _graph(lib, kind)
    assert td.detach_() is td
    tensors = [td.x] if kind == "tensorclass" else [
        m.get(k) for m in (td.tensordicts if kind == "lazy" else [td]) for k in m.keys(True, True)
        if isinstance(m.get(k), torch.Tensor)]
    assert tensors and not any(t.requires_grad for t in tensors)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # tensordict deprecates from_handler, parent_shape
@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("index", [torch.tensor([0, 2]), [0, 2], torch.tensor([True, False, True])],
                         ids=["tensor", "list", "mask"])
def test_from_handler_with_an_advanced_index_is_a_memory_mapped_tensor(lib, index):
    # before: a plain Tensor
    t = lib.MemoryMappedTensor.from_tensor(torch.arange(6.0))
    out = lib.MemoryMappedTensor.from_handler(t._handler, torch.float32, torch.Size([3, 2]), index=index)
    assert type(out) is lib.MemoryMappedTensor and out.parent_shape == torch.Size([3, 2])
    assert out.tolist() == [[0.0, 1.0], [4.0, 5.0]]
    out[0, 0] = 100.0  # a copy (advanced indexing copies, as in torch): t is not written
    assert t.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]


def test_from_handler_copy_pickles_by_reference():
    # (tensordict 0.15.3's cannot be pickled: "cannot pickle 'mmap.mmap' object")
    import pickle

    t = shared_td.MemoryMappedTensor.from_tensor(torch.arange(6.0))
    out = shared_td.MemoryMappedTensor.from_handler(t._handler, torch.float32, torch.Size([3, 2]),
                                                    index=torch.tensor([2]))
    back = pickle.loads(pickle.dumps(out))
    assert type(back) is shared_td.MemoryMappedTensor and back.tolist() == [[4.0, 5.0]]
    assert back.parent_shape == torch.Size([3, 2])
