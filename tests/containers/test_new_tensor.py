"""td.new_tensor(data), side by side with tensordict 0.15.3 (missing before: found by
tensordict's own test_methods.py)."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from tests.reference import LIBS


def _tree(lib):
    return lib.TensorDict(a=torch.zeros(3), b=torch.zeros(3, dtype=torch.int64), s="text",
                          n={"c": torch.zeros(3, 2, dtype=torch.float64)}, batch_size=[3])


def _leaves(td):
    return {key: (leaf.dtype, tuple(leaf.shape), leaf.flatten().tolist()) for key, leaf in td.items(True, True)}


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("data", [[1, 2], (1, 2), np.array([1, 2]), 3, torch.tensor([1.5, 2.5]), torch.ones(2, 2)],
                         ids=["list", "tuple", "numpy", "number", "tensor", "2d"])
def test_every_leaf_is_a_copy_of_the_data_of_its_own_dtype(lib, data):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (tensordict warns on copying a tensor; shared_td does not)
        out = _tree(lib).new_tensor(data)
    shape = tuple(torch.as_tensor(data).shape)
    assert type(out).__name__ == "TensorDict" and tuple(out.batch_size) == shape
    values = torch.as_tensor(data).flatten().tolist()
    expected = {"a": torch.float32, "b": torch.int64, ("n", "c"): torch.float64}
    assert {key: dtype for key, (dtype, _, _) in _leaves(out).items()} == expected  # the text left out
    for key, (dtype, leaf_shape, leaf_values) in _leaves(out).items():
        assert leaf_shape == shape and leaf_values == torch.tensor(values).to(dtype).tolist(), key


@pytest.mark.parametrize("lib", LIBS)
def test_options_and_copies(lib):
    td = _tree(lib)
    assert {leaf.dtype for leaf in td.new_tensor([1, 2], dtype=torch.float16).values(True, True)} == {torch.float16}
    assert td.new_tensor([1, 2], device="cpu").device == torch.device("cpu")
    assert td.new_tensor([1, 2]).device == torch.device("cpu")  # the data's
    array = np.array([1.0, 2.0])
    out = td.new_tensor(array)
    array[0] = 9.0
    assert out["a"].tolist() == [1.0, 2.0]  # a copy, not a view of the array
    floats = lib.TensorDict(a=torch.zeros(3), batch_size=[3]).new_tensor([1.0, 2.0], requires_grad=True)
    assert floats["a"].requires_grad and floats["a"].is_leaf


@pytest.mark.parametrize("lib", LIBS)
def test_tensordict_data_gives_each_leaf_its_own(lib):
    td = _tree(lib).exclude("s")  # (tensordict 0.15.3 looks for a non-tensor entry's key in data too)
    data = lib.TensorDict(a=torch.ones(2), b=torch.full((2,), 7), n={"c": torch.ones(2)}, batch_size=[2])
    out = td.new_tensor(data)
    with pytest.raises(KeyError, match="s"):  # (a non-tensor entry's key too, as tensordict 0.15.3)
        _tree(lib).new_tensor(data)
    assert out["b"].tolist() == [7, 7] and out["b"].dtype == torch.int64 and out["n", "c"].dtype == torch.float64
    assert out["a"].data_ptr() != data["a"].data_ptr()
    with pytest.raises(KeyError, match="b"):
        td.new_tensor(lib.TensorDict(a=torch.ones(2), batch_size=[2]))


@pytest.mark.parametrize("lib", LIBS)
def test_tensorclass_and_lazy_stack(lib):
    @lib.tensorclass
    class Step:
        x: torch.Tensor
        label: str

    step = Step(x=torch.zeros(3, dtype=torch.int32), label="walk", batch_size=[3])
    out = step.new_tensor([1, 2])
    assert type(out) is Step and out.x.tolist() == [1, 2] and out.x.dtype == torch.int32 and out.label == "walk"
    nested = lib.TensorDict(step=step, batch_size=[3]).new_tensor([5, 6])
    assert type(nested["step"]) is Step and nested["step"].x.tolist() == [5, 6]
    lazy = lib.lazy_stack([lib.TensorDict(a=torch.zeros(2), batch_size=[2])] * 3)
    out = lazy.new_tensor([1, 2])
    assert type(out).__name__ == "TensorDict" and out["a"].tolist() == [1.0, 2.0]


@pytest.mark.parametrize("lib", LIBS)
def test_non_tensor_entries_keep_the_tensordicts_value_for_every_new_row(lib):
    # (they were left out: tensordict 0.15.3 keeps a NonTensorData's value, on the
    # result's device, and makes a NonTensorStack an empty tensordict, as new_empty does)
    td = lib.TensorDict(a=torch.zeros(3), s="text", st=lib.NonTensorStack("x", "y", "z"),
                        n={"t": "inner"}, batch_size=[3])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = td.new_tensor(torch.ones(2, 5))
        data = lib.TensorDict(a=torch.ones(2), s="other", st=torch.zeros(2), n={"t": "x"}, batch_size=[2])
        from_td = td.new_tensor(data)
    assert out.get("s").tolist() == [["text"] * 5] * 2 and out.get("s").device == torch.device("cpu")
    assert out["n", "t"] == "inner" and out.get(("n", "t")).batch_size == torch.Size([2, 5])
    assert type(out.get("st")).__name__ == "TensorDict" and out.get("st").batch_size == torch.Size([2, 5])
    assert list(out.get("st").keys()) == []
    assert from_td["s"] == "text" and from_td.get("s").batch_size == torch.Size([2])  # td's value, not data's
