"""Tensorclass and non-tensor data beside tensordict 0.15.3 (fourth pass over tensordict's
own tensorclass and non-tensor tests): each difference that pass found and fixed, the same
code run on both libraries."""
from __future__ import annotations

import re
from typing import Any

import pytest
import torch

import shared_td
from tests.reference import LIBS, tensordict

# ------------------------------------ a tensor written in place into a non-tensor entry
def _write_tensor(lib, how, entry):
    log = lib.TensorDict(phase=entry, batch_size=[3])
    value = torch.ones(3) if how != "tensordict" else lib.TensorDict(a=torch.ones(3), batch_size=[3])
    if how == "set_":
        log.set_("phase", value)
    elif how in ("set-inplace", "tensordict"):
        log.set("phase", value, inplace=True)
    elif how == "update_":
        log.update_({"phase": value})
    else:
        log.update({"phase": value}, inplace=True)
    return log


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("how", ["set_", "set-inplace", "update_", "update-inplace", "tensordict"])
def test_a_tensor_written_in_place_into_a_text_entry_is_refused(lib, how):
    # (it became the entry's Python value, silently: a write meant for a tensor entry
    # was lost in a text one)
    with pytest.raises((TypeError, ValueError, RuntimeError)):
        _write_tensor(lib, how, "warmup")


@pytest.mark.parametrize("lib", LIBS)
def test_a_tensor_written_in_place_into_a_stack_is_refused_and_changes_nothing(lib):
    # (a stack took one row of the tensor per element)
    log = lib.TensorDict(phase=lib.NonTensorStack("a", "b", "c"), batch_size=[3])
    with pytest.raises((TypeError, ValueError, RuntimeError)):
        log.set_("phase", torch.ones(3))
    assert log["phase"] == ["a", "b", "c"]


@pytest.mark.parametrize("lib", LIBS)
def test_a_tensor_wrapped_as_non_tensor_data_is_written_in_place(lib):
    log = lib.TensorDict(phase="warmup", batch_size=[3])
    log.set_("phase", lib.NonTensorData(torch.ones(3), batch_size=[3]))
    assert log.get("phase").data.tolist() == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("lib", LIBS)
def test_a_tensorclass_text_field_refuses_a_tensor_written_in_place(lib):
    @lib.tensorclass
    class Step:
        obs: torch.Tensor
        label: str

    step = Step(obs=torch.zeros(3, 2), label="walk", batch_size=[3])
    with pytest.raises((TypeError, ValueError, RuntimeError)):
        step.set("label", torch.ones(3, 2), inplace=True)
    assert step.label == "walk"


# -------------------------------------------------------------- load_memmap(out=...)
@pytest.mark.parametrize("lib", LIBS)
def test_load_memmap_into_a_tensordict_with_a_text_entry(lib, tmp_path):
    # (the loader walked into the old text entry as into a nested tensordict: an
    # AttributeError)
    lib.TensorDict(obs=torch.ones(3), phase="train", batch_size=[3]).memmap(tmp_path)
    out = lib.TensorDict(obs=torch.zeros(3), phase="warmup", batch_size=[3])
    assert lib.TensorDict.load_memmap(tmp_path, out=out) is out
    assert out["obs"].tolist() == [1.0, 1.0, 1.0]
    assert out["phase"] == "train"


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("loader", ["tensorclass", "TensorDict", "module"])
def test_load_memmap_into_a_tensorclass_instance(lib, loader, tmp_path):
    # (out= took a TensorDict only: a TypeError)
    @lib.tensorclass
    class Step:
        obs: torch.Tensor
        label: str
        note: Any = None

    Step(obs=torch.ones(3), label="new", batch_size=[3]).memmap(tmp_path)
    out = Step(obs=torch.zeros(3), label="old", note="stale", batch_size=[3])
    load = {"tensorclass": Step.load_memmap, "TensorDict": lib.TensorDict.load_memmap,
            "module": lib.load_memmap}[loader]
    assert load(tmp_path, out=out) is out
    assert out.obs.tolist() == [1.0, 1.0, 1.0]
    assert (out.label, out.note) == ("new", None)


@pytest.mark.parametrize("lib", LIBS)
def test_load_memmap_refuses_a_locked_tensorclass_instance(lib, tmp_path):
    @lib.tensorclass
    class Step:
        obs: torch.Tensor

    Step(obs=torch.ones(3), batch_size=[3]).memmap(tmp_path)
    out = Step(obs=torch.zeros(3), batch_size=[3]).lock_()
    with pytest.raises(RuntimeError):
        Step.load_memmap(tmp_path, out=out)
    assert out.obs.tolist() == [0.0, 0.0, 0.0]


# ------------------------------ error messages that code written for tensordict matches
@pytest.mark.parametrize("lib", LIBS)
def test_a_list_field_of_another_length_is_a_batch_dimension_mismatch(lib):
    @lib.tensorclass
    class Step:
        obs: torch.Tensor
        labels: list

    with pytest.raises(RuntimeError, match="batch dimension mismatch"):
        Step(obs=torch.zeros(3, 4), labels=["a", "b", "c"], batch_size=[3, 4])


@pytest.mark.parametrize("lib", LIBS)
def test_a_field_named_like_a_member_names_the_attribute(lib):
    with pytest.raises(AttributeError, match="Attribute name reshape can't be used with @tensorclass"):
        @lib.tensorclass
        class Step:
            obs: torch.Tensor
            reshape: torch.Tensor


@pytest.mark.parametrize("lib", LIBS)
def test_writing_rows_of_a_class_with_other_fields_is_refused(lib):
    @lib.tensorclass
    class Step:
        obs: torch.Tensor

    @lib.tensorclass
    class Other:
        reward: torch.Tensor

    step = Step(obs=torch.zeros(3), batch_size=[3])
    with pytest.raises(ValueError, match="__setitem__ is only allowed for same-class or compatible class"):
        step[:2] = Other(reward=torch.ones(2), batch_size=[2])


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("function", ["stack", "cat"])
def test_stacking_two_tensorclasses_of_different_classes_is_refused(lib, function):
    @lib.tensorclass
    class Step:
        obs: torch.Tensor

    @lib.tensorclass
    class Other:
        obs: torch.Tensor
        reward: torch.Tensor

    items = [Step(obs=torch.zeros(3), batch_size=[3]),
             Other(obs=torch.zeros(3), reward=torch.zeros(3), batch_size=[3])]
    with pytest.raises(TypeError, match="Multiple dispatch failed|no implementation found"):
        getattr(torch, function)(items, 0)


@pytest.mark.parametrize("lib", LIBS)
def test_a_nested_tensordict_that_cannot_take_the_batch_size_names_the_leaf(lib):
    @lib.tensorclass
    class Step:
        obs: torch.Tensor
        extra: shared_td.TensorDict if lib is shared_td else tensordict.TensorDict

    step = Step(obs=torch.zeros(3, 4), extra=lib.TensorDict(batch_size=[3, 4]), batch_size=[3, 4])
    with pytest.raises(RuntimeError, match=re.escape("the Tensor smth has shape torch.Size([1]) which")):
        step.extra = lib.TensorDict({"smth": torch.zeros(1)}, [])


@pytest.mark.parametrize("lib", LIBS)
def test_writing_rows_from_a_source_of_another_batch_size_names_the_destination(lib):
    log = lib.TensorDict(obs=torch.zeros(3, 4), batch_size=[3, 4])
    with pytest.raises(RuntimeError, match="indexed destination TensorDict batch size is"):
        log[:, [1, 2]] = log.clone()


# ------------------------------------------------------------------------- printing
@pytest.mark.parametrize("lib", LIBS)
def test_a_stack_prints_one_part_a_line(lib):
    # (it printed on one line: NonTensorStack(['a', 'b'], batch_size=...))
    assert repr(lib.NonTensorStack("a", "b")) == (
        "NonTensorStack(\n    ['a', 'b'],\n    batch_size=torch.Size([2]),\n    device=None)"
    )


@pytest.mark.parametrize("lib", LIBS)
def test_a_long_stack_or_value_is_cut_when_printed(lib):
    assert str(lib.NonTensorStack(*[str(i) for i in range(30)])).splitlines()[1] == (
        "    ['0', '1', '2', '3', '4', '5', '6', '7', '8', '9',...,"
    )
    assert repr(lib.NonTensorData("x" * 300)) == (
        f"NonTensorData(data={'x' * 20}  ...  {'x' * 20}, batch_size=torch.Size([]), device=None)"
    )


@pytest.mark.parametrize("lib", LIBS)
def test_a_lazy_stack_of_tensorclasses_prints_as_the_tensorclass(lib):
    # (its stack_dim was shown, as for a LazyStackedTensorDict)
    @lib.tensorclass
    class Step:
        obs: torch.Tensor
        label: str

    walk = Step(obs=torch.zeros(3, 2), label="walk", batch_size=[3])
    run = Step(obs=torch.zeros(3, 2), label="run", batch_size=[3])
    assert repr(lib.lazy_stack([walk, run])) == "Step(batch_size=[2,3], fields={label: str, obs: f32[2]})"


# ------------------------------------------------------- batch_size of a non-tensor
@pytest.mark.parametrize("lib", LIBS)
def test_the_batch_size_of_a_value_can_be_set(lib):
    # (a NonTensorData's batch_size had no setter: an AttributeError)
    value = lib.NonTensorData("walk", batch_size=[3]).lock_()
    value.batch_size = [2, 5]
    assert value.batch_size == torch.Size([2, 5]) and value.data == "walk"
    stack = lib.NonTensorStack("a", "b")
    stack.batch_size = torch.Size([2])
    with pytest.raises(RuntimeError):
        stack.batch_size = [3]
    assert stack.tolist() == ["a", "b"] and stack.batch_size == torch.Size([2])


# ------------------------------------------------ to_tensordict(retain_none=True)
@pytest.mark.parametrize("lib", LIBS)
def test_to_tensordict_can_keep_the_empty_fields_as_none(lib):
    # (retain_none was ignored: empty fields were always left out)
    @lib.tensorclass
    class Step:
        obs: torch.Tensor
        note: Any = None

    @lib.tensorclass
    class Outer:
        inner: Step
        tag: Any = None

    outer = Outer(inner=Step(obs=torch.zeros(3), batch_size=[3]), batch_size=[3])
    kept = outer.to_tensordict(retain_none=True)
    assert set(kept.keys(True)) == {"inner", ("inner", "note"), ("inner", "obs"), "tag"}
    assert kept.get("tag").data is None and kept.get("tag").batch_size == torch.Size([3])
    assert kept.get(("inner", "note")).data is None
    assert set(outer.to_tensordict().keys(True)) == {"inner", ("inner", "obs")}
    assert set(outer.to_tensordict(retain_none=False).keys(True)) == {"inner", ("inner", "obs")}


# ------------------------------------------------------- numpy arrays of text or dates
@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("array", [["walk", "run"], [b"walk", b"run"], ["2020-01-01", "2020-01-02"]],
                         ids=["str", "bytes", "datetime"])
def test_a_numpy_array_torch_cannot_hold_is_stored_as_data(lib, array):
    # (it was handed to torch.as_tensor: a TypeError)
    import numpy as np

    value = np.array(array, dtype="datetime64[D]" if array[0] == "2020-01-01" else None)
    log = lib.TensorDict(labels=value, batch_size=[2])
    assert type(log.get("labels")).__name__ == "NonTensorData"
    assert log["labels"] is value
    assert isinstance(lib.TensorDict(counts=np.arange(2), batch_size=[2])["counts"], torch.Tensor)


# ----------------------------------------- comparing values whose == is element-wise
@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("kind", ["tensor", "array"])
def test_comparing_tensordicts_holding_tensors_or_arrays_as_values(lib, kind):
    # (bool() of the element-wise == raised: "truth value ... is ambiguous")
    import numpy as np

    make = torch.tensor if kind == "tensor" else np.array

    def log(value):
        return lib.TensorDict(v=lib.NonTensorData(make(value)), o=torch.zeros(2), batch_size=[2])

    assert (log([1, 2]) == log([1, 2])).all()
    assert not (log([1, 2]) == log([3, 4])).all()
    assert (log([1, 2]) != log([3, 4])).any()
