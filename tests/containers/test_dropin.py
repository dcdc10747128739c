"""shared_td against tensordict 0.15.3, side by side: the behaviours a program ported
from tensordict relies on (sharing, non-tensor entries, comparisons, tensorclasses).

Each test runs on both libraries where tensordict has the behaviour; it is skipped for
tensordict when tensordict 0.15.3 is not installed.
"""
from __future__ import annotations

import dataclasses
import multiprocessing
from typing import Any, Optional
import queue as queue_module

import pytest
import torch

from tests.containers import dropin_children as kids
import shared_td
from tests.processes import WAIT, finish

from tests.reference import LIBS, needs_tensordict, tensordict
def run_child(method: str, target, *args) -> None:
    """Run ``target(*args, done)`` in a child process (bounded waits)."""
    ctx = multiprocessing.get_context(method)
    done = ctx.Queue()
    child = ctx.Process(target=target, args=(*args, done))
    child.start()
    try:
        assert done.get(timeout=WAIT) == "written"
    except queue_module.Empty:
        pytest.fail(f"the {method} child did not write within {WAIT}s")
    finally:
        assert finish(child) == 0


# ------------------------------------------------------------------ 1. share_memory_
@pytest.mark.parametrize("lib,method", [
    pytest.param(shared_td, "spawn", id="shared_td-spawn"),
    pytest.param(shared_td, "fork", id="shared_td-fork"),
    # tensordict shares through a fork-context lock: a spawn child refuses it
    pytest.param(tensordict, "fork", id="tensordict-fork", marks=needs_tensordict),
])
def test_share_memory_shares_non_tensor_values(lib, method):
    td = lib.TensorDict({"val": "old", "x": torch.zeros(2)}, []).share_memory_()
    assert td.get("val").is_shared()
    run_child(method, kids.write_non_tensor, td, "val", "new")
    assert td["val"] == "new"
    assert td.get("val").data == "new"


@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_share_memory_shares_nested_and_stacked_non_tensor_values(method):
    td = shared_td.TensorDict(
        {"sub": {"task": "walk"}, "st": shared_td.NonTensorStack("a", "b", "c"),
         "x": torch.zeros(3)}, [3]).share_memory_()
    run_child(method, kids.write_non_tensor, td, ("sub", "task"), "run")
    run_child(method, kids.write_stack_element, td, 1, "B")
    assert td["sub", "task"] == "run"
    assert td["st"] == ["a", "B", "c"]


def test_share_memory_keeps_non_tensor_type_and_its_own_copies_private():
    td = shared_td.TensorDict({"flag": shared_td.NonTensorData(True)}, []).share_memory_()
    assert td.get("flag").data is True  # bool stays bool
    copy = td.clone()
    copy.set_("flag", False)
    assert td["flag"] is True  # a clone is a private copy


def test_share_memory_of_an_unpicklable_value_names_the_key_and_keeps_it():
    value = lambda: 1  # noqa: E731 (a lambda cannot be pickled)
    td = shared_td.TensorDict({"x": torch.zeros(2), "fn": shared_td.NonTensorData(value)}, [])
    with pytest.raises(TypeError, match="'fn'"):
        td.share_memory_()
    assert td["fn"] is value and not td.is_locked


# ------------------------------------------------------------------ 2. update_ of non-tensors
@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("how", ["update_", "update(inplace=True)", "update", "copy_"])
def test_update_writes_non_tensor_data(lib, how):
    nt = lib.NonTensorData(data="old")
    new = lib.NonTensorData(data="new")
    if how == "update_":
        result = nt.update_(new)
    elif how == "copy_":
        result = nt.copy_(new)
    else:
        result = nt.update(new, inplace=how != "update")
    assert result is nt and nt.data == "new"


@pytest.mark.parametrize("lib", LIBS)
def test_update_writes_non_tensor_stack(lib):
    stack = lib.NonTensorStack("a", "b")
    assert stack.update_(lib.NonTensorStack("c", "d")) is stack
    assert stack.tolist() == ["c", "d"]
    stack.update(lib.NonTensorData("z"))  # one value for every element
    assert stack.tolist() == ["z", "z"]


@pytest.mark.parametrize("lib", LIBS)
def test_update_of_a_locked_non_tensor_raises_update_inplace_writes(lib):
    nt = lib.NonTensorData(data="old").lock_()
    with pytest.raises(RuntimeError, match="locked"):
        nt.update(lib.NonTensorData(data="new"))
    assert nt.data == "old"
    nt.update(lib.NonTensorData(data="new"), inplace=True)
    assert nt.data == "new"
    stack = lib.NonTensorStack("a", "b").lock_()
    with pytest.raises(RuntimeError, match="locked"):
        stack.update(lib.NonTensorStack("c", "d"))
    assert stack.tolist() == ["a", "b"]


@pytest.mark.parametrize("lib", LIBS)
def test_update_of_non_tensor_needs_a_non_tensor_source(lib):
    nt = lib.NonTensorData(data="old")
    for bad in ("plain", {"data": "x"}, torch.zeros(2)):
        with pytest.raises((TypeError, RuntimeError)):
            nt.update_(bad)
    assert nt.data == "old"


def test_update_of_a_wrong_sized_stack_raises_and_keeps_the_values():
    stack = shared_td.NonTensorStack("a", "b")
    with pytest.raises(ValueError, match="2"):
        stack.update_(shared_td.NonTensorStack("a", "b", "c"))
    with pytest.raises(ValueError, match="NonTensorStack"):
        shared_td.NonTensorData("x", batch_size=[2]).update_(shared_td.NonTensorStack("c", "d"))
    assert stack.tolist() == ["a", "b"]


@pytest.mark.parametrize("lib", LIBS)
def test_update_of_memory_mapped_non_tensors_rewrites_the_files(lib, tmp_path):
    td = lib.TensorDict({"s": "old", "st": lib.NonTensorStack("a", "b")}, [2]).memmap_(tmp_path / "td")
    td.get("s").update_(lib.NonTensorData("new", batch_size=[2]))
    td.get("st").update_(lib.NonTensorStack("c", "d"))
    assert td["s"] == "new" and list(td["st"]) == ["c", "d"]
    loaded = lib.load_memmap(tmp_path / "td")
    assert loaded["s"] == "new" and list(loaded["st"]) == ["c", "d"]


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_update_of_a_shared_non_tensor_reaches_other_processes(method):
    td = shared_td.TensorDict({"s": "old", "st": shared_td.NonTensorStack("a", "b")}, [2]).share_memory_()
    run_child(method, kids.update_entries, td)
    assert td["s"] == "new" and td["st"] == ["c", "d"]


# ------------------------------------------------------------------ 4. a[:2] = b[:2] between classes
def _classes(lib):
    @lib.tensorclass
    class Single:
        x: torch.Tensor

    @lib.tensorclass
    class Pair:
        x: torch.Tensor
        y: torch.Tensor

    @lib.tensorclass
    class Twin:  # the same members as Single
        x: torch.Tensor

    return Single, Pair, Twin


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("index", [slice(0, 2), 0, slice(None)])
def test_indexed_write_of_another_tensorclass_raises_naming_both(lib, index):
    Single, Pair, _ = _classes(lib)
    a = Single(x=torch.zeros(3), batch_size=[3])
    b = Pair(x=torch.ones(3), y=torch.ones(3), batch_size=[3])
    with pytest.raises(ValueError) as raised:
        a[index] = b[index]
    if lib is shared_td:
        assert "Single" in str(raised.value) and "Pair" in str(raised.value)
    assert (a.x == 0).all() and set(a._tensordict.keys()) == {"x"}
    with pytest.raises(ValueError):
        b[index] = a[index]
    assert (b.x == 1).all()


@pytest.mark.parametrize("lib", LIBS)
def test_indexed_write_of_a_class_with_the_same_members_or_a_tensordict_works(lib):
    Single, _, Twin = _classes(lib)
    a = Single(x=torch.zeros(3), batch_size=[3])
    a[:2] = Twin(x=torch.full((3,), 7.0), batch_size=[3])[:2]
    assert a.x.tolist() == [7.0, 7.0, 0.0]
    a[2:] = lib.TensorDict(x=torch.ones(1), batch_size=[1])
    assert a.x.tolist() == [7.0, 7.0, 1.0]


# ------------------------------------------------------------------ 5. comparisons
def _mixed(lib):
    return lib.TensorDict({"x": torch.zeros(3), "s": "txt", "n": {"y": torch.zeros(3), "t": "u"},
                           "st": lib.NonTensorStack("a", "b", "c")}, [3])


@pytest.mark.parametrize("lib", LIBS)
def test_comparison_with_a_scalar_ignores_non_tensor_entries(lib):
    td = _mixed(lib)
    assert (td == 0).all() and not (td != 0).any()
    assert not (td == 1).any() and (td != 1).all()
    assert (td < 1).all() and (td <= 0).all() and not (td > 0).any() and (td >= 0).all()
    assert (td == torch.zeros(3)).all()
    assert set((td == 0).keys()) == {"x", "s", "n", "st"}


@pytest.mark.parametrize("lib", LIBS)
def test_memmap_like_of_a_tensordict_with_strings_compares_equal_to_zero(lib, tmp_path):
    td = lib.TensorDict({"x": torch.ones(3), "s": "txt"}, [3])
    assert (td.memmap_like(tmp_path / "td") == 0).all()


@pytest.mark.parametrize("lib", LIBS)
def test_comparison_between_tensordicts_compares_non_tensor_values(lib):
    td, other = _mixed(lib), _mixed(lib)
    assert (td == other).all() and not (td != other).any()
    other.set_(("n", "t"), "changed")
    assert not (td == other).all() and (td != other).any()
    assert (td == other)["n", "t"].tolist() == [False, False, False]
    assert (td <= td.clone()).all() and not (td < td.clone()).any()  # non-tensors ignored


def test_ordered_comparison_of_tensorclasses_and_lazy_stacks():
    @shared_td.tensorclass
    class Obs:
        x: torch.Tensor
        task: str

    obs = Obs(x=torch.arange(3.0), task="walk", batch_size=[3])
    assert (obs < 3).all() and (obs >= 1).x.tolist() == [False, True, True]
    lazy = shared_td.lazy_stack([_mixed(shared_td), _mixed(shared_td)])
    assert (lazy == 0).all() and (lazy < 1).all() and not (lazy > 0).any()
    with pytest.raises(TypeError):
        shared_td.NonTensorData("a") < 1


# ------------------------------------------------------------------ 6. non-tensor field values
@pytest.mark.parametrize("lib", LIBS)
def test_a_complex_number_stays_a_python_value(lib):
    @lib.tensorclass
    class Holder:
        a: Any
        c: complex

    h = Holder(a=1 + 2j, c=3j)
    assert h.a == 1 + 2j and type(h.a) is complex and type(h.c) is complex
    h.a = 2 - 1j
    assert type(h.a) is complex
    td = lib.TensorDict(c=1 + 2j)
    assert td["c"] == 1 + 2j and type(td["c"]) is complex


@pytest.mark.parametrize("lib", LIBS)
def test_scalar_fields_of_a_batched_tensorclass_keep_the_python_value(lib):
    @lib.tensorclass
    class Step:
        count: int
        rate: float
        done: Optional[bool]
        anything: Any
        obs: torch.Tensor

    step = Step(count=3, rate=1, done=True, anything="z", obs=torch.zeros(4), batch_size=[4])
    assert (step.count, step.rate, step.done) == (3, 1, True)
    assert type(step.count) is int and type(step.done) is bool
    assert step[1:].count == 3
    step.count = 5
    assert step.count == 5 and type(step.count) is int
    with pytest.raises(RuntimeError):  # Any: a number is a 0-d tensor, as tensordict
        step.anything = 2
    flat = Step(count=3, rate=1.5, done=False, anything=2, obs=torch.zeros(()))
    assert isinstance(flat.count, torch.Tensor) and isinstance(flat.anything, torch.Tensor)


# ------------------------------------------------------------------ 7. the non-tensor API
@pytest.mark.parametrize("lib", LIBS)
def test_set_non_tensor_keeps_even_a_tensor_as_a_python_value(lib):
    td = lib.TensorDict({"x": torch.zeros(3), "n": {"y": torch.zeros(3)}}, [3])
    assert td.set_non_tensor("a", torch.zeros(2)) is td
    assert isinstance(td.get("a"), lib.NonTensorData) and td.get("a").batch_size == (3,)
    assert torch.equal(td.get_non_tensor("a"), torch.zeros(2))
    td.set_non_tensor(("n", "q"), 3)
    assert td.get_non_tensor(("n", "q")) == 3 and td[0]["n", "q"] == 3
    assert td.get_non_tensor("missing", default="dflt") == "dflt"
    with pytest.raises(KeyError, match="missing"):
        td.get_non_tensor("missing")
    td.lock_()
    with pytest.raises(RuntimeError, match="locked"):
        td.set_non_tensor("b", 5)


@pytest.mark.parametrize("lib", LIBS)
def test_non_tensor_items_and_filter_non_tensor_data(lib):
    td = lib.TensorDict({"x": torch.zeros(3), "n": {"s": "t", "y": torch.zeros(3)}, "a": "b",
                         "st": lib.NonTensorStack("p", "q", "r")}, [3])
    assert sorted(k for k, _ in td.non_tensor_items()) == ["a", "st"]
    items = dict(td.non_tensor_items(include_nested=True))
    assert set(items) == {"a", "st", ("n", "s")}
    assert isinstance(items[("n", "s")], lib.NonTensorData) and isinstance(items["st"], lib.NonTensorStack)
    filtered = td.filter_non_tensor_data()
    assert filtered is not td and set(filtered.keys(True, True)) == {"x", ("n", "y")}
    assert set(filtered.keys(True)) == {"x", "n", ("n", "y")}
    assert filtered["x"] is td["x"] and filtered["n", "y"] is td["n", "y"]  # shared, not copied
    assert "a" in td.keys()  # self unchanged


def test_filter_non_tensor_data_of_a_lazy_stack():
    lazy = shared_td.lazy_stack([shared_td.TensorDict(x=torch.zeros(2), s="a", batch_size=[2]),
                                 shared_td.TensorDict(x=torch.ones(2), s="b", batch_size=[2])])
    assert list(lazy.filter_non_tensor_data().keys()) == ["x"]
    assert [k for k, _ in lazy.non_tensor_items()] == ["s"]


@pytest.mark.parametrize("lib", LIBS)
def test_non_tensor_data_base(lib):
    assert isinstance(lib.NonTensorData("a"), lib.NonTensorDataBase)
    # as tensordict 0.15.3: a stack is not a NonTensorDataBase (is_non_tensor covers both)
    assert not isinstance(lib.NonTensorStack("a", "b"), lib.NonTensorDataBase)
    assert lib.is_non_tensor(lib.NonTensorStack("a", "b"))


@pytest.mark.parametrize("lib", LIBS)
def test_non_blocking_is_accepted(lib):
    td = lib.TensorDict({"x": torch.zeros(3)}, [3])
    td.set("z", torch.ones(3), non_blocking=True)
    td.set_("z", torch.full((3,), 2.0), non_blocking=True)
    td.update({"x": torch.ones(3)}, non_blocking=True)
    td.update_({"z": torch.full((3,), 3.0)}, non_blocking=True)
    moved = td.to("cpu", non_blocking=True)
    assert moved["x"].tolist() == [1.0] * 3 and moved["z"].tolist() == [3.0] * 3
    lazy = lib.lazy_stack([td.clone(), td.clone()])
    lazy.update({"x": torch.zeros(2, 3)}, non_blocking=True)
    lazy.update_({"x": torch.ones(2, 3)}, non_blocking=True)
    assert (lazy["x"] == 1).all()

    @lib.tensorclass
    class Obs:
        x: torch.Tensor

    obs = Obs(x=torch.zeros(3), batch_size=[3])
    obs.set("x", torch.ones(3), non_blocking=True)
    obs.update({"x": torch.full((3,), 2.0)}, non_blocking=True)
    assert obs.x.tolist() == [2.0] * 3


# ------------------------------------------------------------------ 14. conveniences
@pytest.mark.parametrize("lib", LIBS)
def test_detach(lib):
    td = lib.TensorDict({"x": torch.zeros(3, requires_grad=True), "n": {"y": torch.ones(3, requires_grad=True)},
                         "s": "a"}, [3], names=["b"])
    out = td.detach()
    assert not out["x"].requires_grad and not out["n", "y"].requires_grad
    assert out.names == ["b"] and out["s"] == "a" and out is not td
    out["x"][0] = 5.0  # detach shares the storage, as torch's
    assert td["x"][0].item() == 5.0
    assert td.lock_().detach().is_locked


@pytest.mark.parametrize("lib", LIBS)
def test_update_at_(lib):
    td = lib.TensorDict({"x": torch.zeros(3), "n": {"y": torch.zeros(3)}}, [3])
    assert td.update_at_({"x": torch.tensor(5.0)}, 1) is td
    assert td["x"].tolist() == [0.0, 5.0, 0.0]
    td.update_at_(lib.TensorDict({"x": torch.tensor([7.0, 8.0])}, [2]), slice(0, 2))
    assert td["x"].tolist() == [7.0, 8.0, 0.0]
    td.update_at_({"x": torch.tensor(1.0), "n": {"y": torch.tensor(2.0)}}, 2, keys_to_update=["x"])
    assert td["x"][2] == 1.0 and td["n", "y"][2] == 0.0
    td.lock_().update_at_({"n": {"y": torch.tensor(4.0)}}, 0)  # in place: allowed when locked
    assert td["n", "y"][0] == 4.0
    with pytest.raises(KeyError, match="z"):
        td.update_at_({"z": torch.tensor(1.0)}, 0)
    before = td["x"].clone()
    with pytest.raises(RuntimeError):
        td.update_at_({"x": torch.ones(5)}, 0)
    assert torch.equal(td["x"], before)


@pytest.mark.parametrize("lib", LIBS)
def test_lazy_stack_classmethod(lib):
    a = lib.TensorDict({"x": torch.zeros(3)}, [3])
    lazy = lib.TensorDict.lazy_stack([a, a.clone()])
    assert isinstance(lazy, lib.LazyStackedTensorDict) and lazy.batch_size == (2, 3)
    assert lib.TensorDict.lazy_stack([a, a.clone()], dim=1).batch_size == (3, 2)


@pytest.mark.parametrize("lib", LIBS)
def test_the_new_names_on_a_tensorclass(lib):
    @lib.tensorclass
    class Obs:
        x: torch.Tensor
        task: Any = None

    obs = Obs(x=torch.zeros(3, requires_grad=True), batch_size=[3])
    obs.set_non_tensor("task", "walk")
    assert obs.task == "walk" and [k for k, _ in obs.non_tensor_items()] == ["task"]
    assert obs.get_non_tensor("task") == "walk"
    assert isinstance(obs.filter_non_tensor_data(), Obs) and obs.filter_non_tensor_data().task is None
    detached = obs.detach()
    assert isinstance(detached, Obs) and not detached.x.requires_grad
    plain = Obs(x=torch.zeros(3), batch_size=[3])
    assert plain.update_at_({"x": torch.tensor(2.0)}, 1) is plain
    assert plain.x.tolist() == [0.0, 2.0, 0.0]


# ------------------------------------------------------------------ 8. TensorClass, from_dataclass
@pytest.mark.parametrize("lib", LIBS)
def test_tensorclass_class_form(lib):
    class Step(lib.TensorClass):
        obs: torch.Tensor
        task: str = "walk"

        def double(self):
            return self.obs * 2

    step = Step(obs=torch.ones(3, 2), batch_size=[3])
    assert lib.is_tensorclass(Step) and isinstance(step, lib.TensorClass)
    assert step[1:].batch_size == (2,) and step[0].task == "walk"
    assert step.double().sum() == 12
    assert isinstance(torch.stack([step, step]), Step)


@pytest.mark.parametrize("lib", LIBS)
def test_tensorclass_class_form_options(lib, tmp_path):
    class Frozen(lib.TensorClass, frozen=True):
        x: torch.Tensor

    frozen = Frozen(x=torch.zeros(2))
    with pytest.raises(dataclasses.FrozenInstanceError):
        frozen.x = torch.ones(2)

    class Plain(lib.TensorClass["nocast"]):
        n: int
        v: Any

    plain = Plain(n=1, v=2.5)
    assert type(plain.n) is int and type(plain.v) is float

    class Both(lib.TensorClass["nocast", "frozen"]):
        n: int

    assert type(Both(n=1).n) is int and Both(n=1).is_locked

    class Child(Plain):  # a subclass keeps the options and adds fields
        extra: torch.Tensor = None

    child = Child(n=2, v="x", extra=torch.zeros(1))
    assert type(child.n) is int and child.extra.shape == (1,)
    assert isinstance(child, Plain) and lib.is_tensorclass(Child)
    child.memmap(tmp_path / "c")
    loaded = lib.load_memmap(tmp_path / "c")
    assert type(loaded) is Child and loaded.n == 2


def test_tensorclass_class_form_refuses_unknown_or_unsupported_options():
    with pytest.raises(TypeError, match="flags"):
        shared_td.TensorClass["nocats"]
    with pytest.raises(TypeError, match="autocast"):
        class Cast(shared_td.TensorClass, autocast=True):
            x: torch.Tensor
    with pytest.raises(TypeError, match="exclusive"):
        class Both(shared_td.TensorClass, nocast=True, tensor_only=True):
            x: torch.Tensor


@dataclasses.dataclass
class Record:
    a: int
    b: torch.Tensor
    c: str = "z"


@pytest.mark.parametrize("lib", LIBS)
def test_from_dataclass_of_an_instance(lib):
    record = Record(0, torch.zeros(3, 2))
    tc = lib.from_dataclass(record)
    assert type(tc).__name__ == "Record_tc" and lib.is_tensorclass(tc)
    assert tc.c == "z" and tc.b.shape == (3, 2) and tc.batch_size == ()
    assert lib.from_dataclass(record, batch_size=[3]).a == 0
    assert lib.from_dataclass(record, batch_size=[3]).batch_size == (3,)
    with pytest.raises(TypeError):
        lib.from_dataclass(record, auto_batch_size=True, batch_size=[3])
    with pytest.raises(TypeError):
        lib.from_dataclass(3)

    @lib.tensorclass
    class Dest:
        a: torch.Tensor
        b: torch.Tensor
        c: str

    assert type(lib.from_dataclass(record, dest_cls=Dest)) is Dest


def test_from_dataclass_auto_batch_size():
    @dataclasses.dataclass
    class Pair:
        x: torch.Tensor
        y: torch.Tensor

    tc = shared_td.from_dataclass(Pair(torch.zeros(3, 2), torch.ones(3, 2, 4)), auto_batch_size=True)
    assert tc.batch_size == (3, 2)


@pytest.mark.parametrize("lib", LIBS)
def test_from_dataclass_of_a_type(lib):
    cls = lib.from_dataclass(Record)
    assert cls.__name__ == "Record_tc" and lib.is_tensorclass(cls) and not lib.is_tensorclass(Record)
    made = cls(a=1, b=torch.zeros(2))
    assert made.c == "z" and made.b.shape == (2,)
    assert lib.from_dataclass(cls) is cls

    @dataclasses.dataclass
    class Local:
        x: torch.Tensor
        tag: str = "t"

    same = lib.from_dataclass(Local, inplace=True)
    assert same is Local and lib.is_tensorclass(Local)
    local = Local(x=torch.zeros(2, 3), batch_size=[2])
    assert local[0].tag == "t" and local[1:].batch_size == (1,)
    assert "Local(" in repr(local) and "batch_size" in repr(local)


@pytest.mark.parametrize("lib", LIBS)
def test_update_of_a_batched_tensorclass_keeps_numbers_of_scalar_fields(lib):
    @lib.tensorclass
    class Counter:
        n: int
        x: torch.Tensor

    counter = Counter(n=1, x=torch.zeros(3), batch_size=[3])
    counter.update({"n": 4, "x": torch.ones(3)})
    assert type(counter.n) is int and counter.n == 4 and counter.x.tolist() == [1.0] * 3
    counter.update({"n": 5}, keys_to_update=["x"])
    assert counter.n == 4
# ------------------------------------------------------------------ 3. lists of the batch size
@pytest.mark.parametrize("lib", LIBS)
def test_a_list_of_the_batch_size_is_one_value_per_element(lib):
    td = lib.TensorDict({"info": ["a", "b", "c"]}, [3])
    assert isinstance(td.get("info"), lib.NonTensorStack)
    assert td[1]["info"] == "b"
    assert td[1:]["info"] == ["b", "c"]
    td["more"] = ["x", None, 3]  # mixed values, set after construction
    assert td[2]["more"] == 3 and td[1]["more"] is None
    td.set("other", ["p", "q", "r"])
    assert td[0]["other"] == "p"


@pytest.mark.parametrize("lib", LIBS)
def test_a_nested_list_of_the_batch_shape_is_one_value_per_element(lib):
    td = lib.TensorDict({"info": [["a", "b"], ["c", "d"]]}, [2, 2])
    assert td.get("info").batch_size == torch.Size([2, 2])
    assert td[1, 0]["info"] == "c"


@pytest.mark.parametrize("lib", LIBS)
def test_a_list_of_another_length_is_a_batch_size_error_naming_the_key(lib):
    with pytest.raises(RuntimeError, match="'info'"):
        lib.TensorDict({"info": ["a", "b"]}, [3])
    td = lib.TensorDict({}, [3])
    with pytest.raises(RuntimeError, match="'info'"):
        td["info"] = ["a", "b"]
    assert "info" not in td.keys()


@pytest.mark.parametrize("lib", LIBS)
def test_lists_of_numbers_stay_tensors(lib):
    td = lib.TensorDict({"n": [1, 2, 3], "f": [[0.5], [1.5], [2.5]]}, [3])
    assert isinstance(td.get("n"), torch.Tensor) and td.get("f").shape == (3, 1)


@pytest.mark.parametrize("lib", LIBS)
def test_a_list_in_a_0_dim_tensordict_is_a_stack_of_its_length(lib):
    td = lib.TensorDict({"info": ["a", "b"]}, [])
    assert isinstance(td.get("info"), lib.NonTensorStack)
    assert td.get("info").batch_size == torch.Size([2])
    assert list(td["info"]) == ["a", "b"]


def test_a_list_written_into_a_stack_entry_writes_each_element():
    td = shared_td.TensorDict({"info": ["a", "b", "c"]}, [3])
    stack = td.get("info")
    td.set_("info", ["x", "y", "z"])
    assert td.get("info") is stack and stack.tolist() == ["x", "y", "z"]
    with pytest.raises(ValueError, match="'info'"):
        td.update_({"info": ["only", "two"]})
    assert stack.tolist() == ["x", "y", "z"]


@pytest.mark.parametrize("lib", LIBS)
def test_cat_of_equal_non_tensor_values_is_one_value(lib):
    def make(task):
        td = lib.TensorDict(obs=torch.zeros(2), batch_size=[2])
        td["task"] = task
        return td

    both = torch.cat([make("walk"), make("walk")])
    assert isinstance(both.get("task"), lib.NonTensorData) and both["task"] == "walk"
    assert both.get("task").batch_size == torch.Size([4])
    mixed = torch.cat([make("walk"), make("run")])
    assert isinstance(mixed.get("task"), lib.NonTensorStack) and mixed["task"] == ["walk"] * 2 + ["run"] * 2
    arrays = torch.cat([lib.NonTensorData(torch.ones(3), batch_size=[1]), lib.NonTensorData(torch.ones(3), batch_size=[1])])
    assert isinstance(arrays, lib.NonTensorData) and arrays.batch_size == torch.Size([2])
    other = torch.cat([lib.NonTensorData(torch.ones(3), batch_size=[1]), lib.NonTensorData(torch.zeros(3), batch_size=[1])])
    assert isinstance(other, lib.NonTensorStack)


@pytest.mark.parametrize("lib", LIBS)
def test_empty_recurse_keeps_non_tensor_entries(lib):
    td = lib.TensorDict(obs=torch.zeros(2), nested={"x": torch.zeros(2)}, batch_size=[2])
    td["task"] = "walk"
    td["steps"] = lib.NonTensorStack("a", "b")
    empty = td.empty(recurse=True)
    assert list(empty.keys(True)) == ["nested", "task", "steps"]
    assert empty["task"] == "walk" and empty["steps"] == ["a", "b"]
    assert list(td.empty().keys()) == []
    assert empty.get("task") is td.get("task")  # shared, as tensordict's
    lazy = lib.LazyStackedTensorDict(td, td).empty(recurse=True)
    assert set(lazy.keys()) == {"nested", "task", "steps"}


def test_empty_recurse_with_another_batch_size_rebatches_a_value_and_leaves_a_stack_out():
    td = shared_td.TensorDict(obs=torch.zeros(2), batch_size=[2])
    td["task"] = "walk"
    td["steps"] = shared_td.NonTensorStack("a", "b")
    same_prefix = td.empty(recurse=True, batch_size=[])
    assert same_prefix.get("task") is td.get("task") and same_prefix.get("steps") is td.get("steps")
    other = td.empty(recurse=True, batch_size=[3])
    assert list(other.keys()) == ["task"] and other.get("task").batch_size == torch.Size([3]) and other["task"] == "walk"


def _tree_of_every_kind(lib):
    @lib.tensorclass
    class Pair:
        a: torch.Tensor

    inner = lib.LazyStackedTensorDict(lib.TensorDict(q=torch.zeros(())), lib.TensorDict(q=torch.ones(())))
    td = lib.TensorDict({"pair": Pair(a=torch.zeros(2), batch_size=[2]), "lazy": inner, "n": {"x": torch.ones(2)}}, [2])
    td["t"] = "text"
    return td.lock_()


@pytest.mark.parametrize("lib", LIBS)
def test_to_tensordict_is_a_plain_unlocked_copy(lib, tmp_path):
    td = _tree_of_every_kind(lib)
    plain = td.to_tensordict()
    assert {key: type(value).__name__ for key, value in plain.items()} == {
        "pair": "TensorDict", "lazy": "TensorDict", "n": "TensorDict", "t": "NonTensorData"}
    assert not plain.is_locked and not plain["n"].is_locked and plain["t"] == "text"
    assert plain["n", "x"].data_ptr() != td["n", "x"].data_ptr()
    mapped = lib.TensorDict(a=torch.arange(3.), batch_size=[3]).memmap_(tmp_path)
    copied = mapped.to_tensordict()
    assert type(copied["a"]) is torch.Tensor and copied["a"].tolist() == [0.0, 1.0, 2.0]
    copied["a"] += 1
    assert mapped["a"].tolist() == [0.0, 1.0, 2.0]
    assert type(td["pair"].to_tensordict()).__name__ == "TensorDict"


@pytest.mark.parametrize("lib", LIBS)
def test_clone_without_recursion_copies_the_structure_and_shares_the_tensors(lib):
    td = _tree_of_every_kind(lib)
    for shallow in (td.clone(recurse=False), td.copy()):
        assert not shallow.is_locked
        assert shallow["n"] is not td["n"] and shallow["n", "x"] is td["n", "x"]
        assert shallow["pair"] is not td["pair"] and shallow["lazy"] is not td["lazy"]
        shallow["n", "added"] = torch.zeros(2)  # the source's nested tensordict is not changed
        assert "added" not in td["n"].keys()


@pytest.mark.parametrize("lib", LIBS)
def test_get_at_set_at_setdefault_sorted_keys(lib):
    td = lib.TensorDict({"b": torch.zeros(2, 3), "a": {"x": torch.arange(2.)}}, [2]).lock_()
    assert td.get_at(("a", "x"), 1).item() == 1.0 and td.get_at("missing", 0, "default") == "default"
    assert td.set_at_("b", torch.ones(3), 1) is td  # in place: allowed when locked
    assert td["b"].tolist() == [[0.0] * 3, [1.0] * 3]
    assert td.sorted_keys == ["a", "b"]
    td.unlock_()
    assert td.setdefault("c", torch.ones(2)).tolist() == [1.0, 1.0]
    assert td.setdefault("c", torch.zeros(2)).tolist() == [1.0, 1.0]  # already there: kept


def test_set_at_of_a_missing_key_names_it():
    td = shared_td.TensorDict(b=torch.zeros(2), batch_size=[2])
    assert td.get_at("missing", 0) is None  # (as get: None, as tensordict 0.15.3's)
    with pytest.raises(KeyError, match="'missing'"):
        td.set_at_("missing", 1.0, 0)
    with pytest.raises(RuntimeError, match=r"set_at_\('b'"):
        td.set_at_("b", torch.zeros(3), 0)


@pytest.mark.parametrize("lib", LIBS)
def test_an_indexed_write_into_a_0_dim_non_tensor_keeps_one_value(lib):
    td = lib.TensorDict(a=torch.zeros(()), batch_size=[])
    td["s"] = "u"
    td[()] = lib.TensorDict(a=torch.zeros(()), s="w")
    assert type(td.get("s")) is lib.NonTensorData and td["s"] == "w"
    stack = lib.LazyStackedTensorDict(lib.TensorDict(a=torch.zeros(2), s="u"), lib.TensorDict(a=torch.ones(2), s="v"))
    stack[0] = lib.TensorDict(a=torch.full((2,), 5.0), s="w")
    assert type(stack.tensordicts[0].get("s")) is lib.NonTensorData and stack["s"] == ["w", "v"]


def test_an_indexed_write_into_a_shared_0_dim_non_tensor_is_in_place():
    td = shared_td.TensorDict(a=torch.zeros(()), s="u", batch_size=[]).share_memory_()
    entry = td.get("s")
    td[()] = shared_td.TensorDict(a=torch.zeros(()), s="w")  # before: refused as a per-element write
    assert td.get("s") is entry and entry.is_shared() and td["s"] == "w"


@pytest.mark.parametrize("lib", LIBS)
def test_an_indexed_write_of_an_equal_tensor_value_makes_a_stack_as_tensordict(lib):
    # tensordict's cat keeps equal tensor values one value, its indexed write does not
    td = lib.TensorDict(x=torch.zeros(2), batch_size=[2])
    td.set_non_tensor("v", torch.ones(3))
    td[0] = lib.TensorDict(x=torch.zeros(()), v=lib.NonTensorData(torch.ones(3)))
    assert isinstance(td.get("v"), lib.NonTensorStack)


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("consolidated", [False, True])
def test_copy_copy_is_a_new_structure_over_the_same_leaves(lib, consolidated):
    # through pickling's state, the copy shared the original's entry dicts: an entry set
    # or deleted in the copy changed the original, locked or not
    import copy

    td = lib.TensorDict(a=torch.zeros(3), s=lib.TensorDict(b=torch.ones(3), batch_size=[3]), batch_size=[3])
    if consolidated:
        td = td.consolidate()
    shallow = copy.copy(td)
    assert shallow["a"] is td["a"] and shallow["s", "b"] is td["s", "b"]
    shallow.unlock_()
    shallow["new"] = torch.zeros(3)
    shallow["s", "w"] = torch.zeros(3)
    del shallow["a"]
    assert set(td.keys(True, True)) == {"a", ("s", "b")}
    assert td.is_locked == td["s"].is_locked == consolidated
    stack = lib.LazyStackedTensorDict(lib.TensorDict(k=torch.zeros(2)), lib.TensorDict(k=torch.ones(2)))
    copy.copy(stack).tensordicts[0]["new"] = torch.zeros(2)
    assert "new" not in stack.tensordicts[0].keys()


@pytest.mark.parametrize("lib", LIBS)
def test_copy_copy_of_a_tensorclass_sets_its_own_fields(lib):
    import copy

    item = _CopiedItem(x=torch.zeros(2), y="a", batch_size=[2]) if lib is shared_td else \
        _their_copied_item()(x=torch.zeros(2), y="a", batch_size=[2])
    other = copy.copy(item)
    other.x, other.y = torch.ones(2), "b"
    assert item.x.tolist() == [0.0, 0.0] and item.y == "a"
    assert other.x.tolist() == [1.0, 1.0] and other.y == "b"


@shared_td.tensorclass
class _CopiedItem:
    x: torch.Tensor
    y: str


def _their_copied_item():
    @tensordict.tensorclass
    class Item:
        x: torch.Tensor
        y: str

    return Item


_VIEWS = {"td[1]": lambda td: td[1], "td[:2]": lambda td: td[:2], "unsqueeze": lambda td: td.unsqueeze(0),
          "reshape": lambda td: td.reshape(3), "unbind": lambda td: td.unbind(0)[2],
          "clone(False)": lambda td: td.clone(False), "copy": lambda td: td.copy()}


@pytest.mark.parametrize("view", list(_VIEWS))
@pytest.mark.parametrize("lib, how", [
    pytest.param(shared_td, "share_memory_", id="shared_td-share_memory_"),
    pytest.param(tensordict, "share_memory_", id="tensordict-share_memory_", marks=needs_tensordict),
    # (tensordict 0.15.3 loses some of these writes, or reads a list of lists back)
    pytest.param(shared_td, "memmap_share_non_tensor", id="shared_td-memmap"),
])
def test_a_write_through_a_view_reaches_a_shared_non_tensor_value(lib, view, how, tmp_path):
    # the view held a private copy of the value: the write reached neither the
    # tensordict, nor other processes, nor the files
    if lib is not shared_td and view == "unsqueeze":
        pytest.skip("tensordict 0.15.3 reads an unsqueezed shared value back as nested lists")
    td = lib.TensorDict(s=lib.NonTensorData("a"), x=torch.zeros(3), batch_size=[3])
    if how == "share_memory_":
        td.share_memory_()
    else:
        td.memmap_(tmp_path, share_non_tensor=True)
    derived = _VIEWS[view](td)
    derived.set_("s", "written")
    assert td["s"] == "written"
    td.set_("s", "again")
    assert derived["s"] == "again"
    if how != "share_memory_":
        derived.set_("s", "on disk")
        loaded = lib.load_memmap(tmp_path) if lib is shared_td else lib.TensorDict.load_memmap(tmp_path)
        assert loaded["s"] == "on disk" and loaded.get("s").batch_size == (3,)


@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_a_child_writes_a_shared_non_tensor_value_through_a_row(method):
    td = shared_td.TensorDict(s="a", x=torch.zeros(3), batch_size=[3]).share_memory_()
    run_child(method, kids.write_non_tensor_through_row, td, "s", "from the child")
    assert td["s"] == "from the child"


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("source_batch", [[3], [1], []])
def test_a_source_of_another_batch_size_than_the_rows_is_refused(lib, source_batch):
    # its batch dims were broadcast: a batch of 3 written into 2 rows became a feature
    # dim of every row ([[0, 1, 2], [0, 1, 2]]), a batch of 1 repeated
    buffer = lib.TensorDict(obs=torch.zeros(10, 3), batch_size=[10])
    source = lib.TensorDict(obs=torch.arange(3.0).expand(*source_batch, 3), batch_size=source_batch)
    with pytest.raises(RuntimeError, match="batch size"):
        buffer[torch.tensor([1, 2])] = source
    assert not buffer["obs"].any()


@pytest.mark.parametrize("lib", LIBS)
def test_a_dict_written_at_an_index_has_the_rows_batch_dims(lib):
    buffer = lib.TensorDict(obs=torch.zeros(10, 3), batch_size=[10])
    with pytest.raises(RuntimeError, match="obs"):
        buffer[torch.tensor([1, 5])] = {"obs": torch.tensor([1.0, 2.0, 3.0])}  # was written into both rows
    assert not buffer["obs"].any()
    buffer[torch.tensor([1, 5])] = {"obs": torch.ones(2, 3)}
    buffer[0] = {"obs": torch.full((3,), 2.0)}
    assert buffer["obs"].sum() == 6 + 6
    stack = lib.LazyStackedTensorDict(lib.TensorDict(c=torch.zeros(2), batch_size=[2]),
                                      lib.TensorDict(c=torch.ones(2), batch_size=[2]))
    stack[:, 0] = {"c": torch.tensor([-1.0, -2.0])}  # (a dict into a lazy stack was refused)
    assert stack["c"].tolist() == [[-1.0, 0.0], [-2.0, 1.0]]


@pytest.mark.parametrize("lib", LIBS)
def test_from_dict_makes_a_number_under_a_batch_size_a_non_tensor(lib):
    # (it was a batch-size error: to_dict() of a tree holding NonTensorData(3) did not come back)
    td = lib.TensorDict.from_dict({"n": 3, "c": {"m": 2.5}, "x": torch.zeros(3)}, batch_size=[3])
    assert type(td.get("n")).__name__ == "NonTensorData" and td["n"] == 3 and td["c", "m"] == 2.5
    again = lib.TensorDict.from_dict(td.to_dict(), batch_size=[3])
    assert again["n"] == 3 and again["x"].shape == (3,)
    assert isinstance(lib.TensorDict.from_dict({"n": 3})["n"], torch.Tensor)  # no batch dims: a tensor


@pytest.mark.parametrize("lib", LIBS)
def test_is_tensor_collection_of_a_class_as_keys_is_leaf_passes_them(lib):
    td = lib.TensorDict(a=torch.zeros(2), n=lib.TensorDict(b=torch.zeros(2)))
    assert lib.is_tensor_collection(lib.TensorDict) and not lib.is_tensor_collection(torch.Tensor)
    leaves = list(td.keys(True, True, is_leaf=lambda cls: not lib.is_tensor_collection(cls)))
    assert set(leaves) == {"a", ("n", "b")}
