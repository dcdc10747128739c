"""td.to(other_td) takes other_td's dtype when all its leaves are tensors of one dtype, as tensordict
0.15.3's to(other=...) (and torch's Tensor.to(other)) does; mixed dtypes keep each
leaf's (upstream tests round 3: the dtype was ignored)."""
import pytest
import torch

import shared_td


def _src():
    return shared_td.TensorDict({"a": torch.zeros(2, 3), "n": {"b": torch.zeros(2, dtype=torch.int64)}}, [2])


@pytest.mark.parametrize("how", ["positional", "keyword"])
@pytest.mark.parametrize("kind", ["td", "lazy"])
def test_to_other_single_dtype_casts(how, kind):
    src = _src() if kind == "td" else shared_td.lazy_stack([_src(), _src()], 1)
    other = shared_td.TensorDict({"x": torch.ones(1, dtype=torch.half), "y": {"z": torch.ones(1, dtype=torch.half)}}, [])
    out = src.to(other) if how == "positional" else src.to(other=other)
    assert {v.dtype for v in out.values(True, True)} == {torch.half}
    assert out.device == other.device


def test_to_other_mixed_dtypes_keeps_dtypes():
    other = shared_td.TensorDict({"x": torch.ones(1, dtype=torch.half), "y": torch.ones(1, dtype=torch.int32)}, [])
    out = _src().to(other)
    assert out["a"].dtype == torch.float32 and out["n", "b"].dtype == torch.int64


def test_to_other_with_non_tensor_leaf():
    src = _src()
    src.set_non_tensor("s", "text")
    other = shared_td.TensorDict({"x": torch.ones(1, dtype=torch.float64)}, [])
    other.set_non_tensor("t", "meta")
    # a non-tensor leaf in other does not count: its tensors' one dtype is taken (as
    # tensordict 0.15.3, whose values(True, True) skips non-tensor entries)
    out = src.to(other)
    assert out["a"].dtype == torch.float64 and out["n", "b"].dtype == torch.float64
    assert out["s"] == "text"
    # a non-tensor leaf in the source is carried over by a cast
    out = src.to(shared_td.TensorDict({"x": torch.ones(1, dtype=torch.float64)}, []))
    assert out["a"].dtype == torch.float64 and out["s"] == "text"


def test_to_other_tensor_keyword_casts_and_moves():
    out = _src().to(other=torch.ones(1, dtype=torch.float64))
    assert {v.dtype for v in out.values(True, True)} == {torch.float64}




def test_to_other_ignores_non_tensor_leaves_of_other():
    # tensordict 0.15.3's to(other=...) takes other.values(True, True), which skips
    # non-tensor entries: a tree of float64 tensors plus a string casts to float64
    src = shared_td.TensorDict({"a": torch.zeros(2), "n": {"b": torch.arange(2)}}, [2])
    src.set_non_tensor("s", "text")
    other = shared_td.TensorDict({"x": torch.ones(1, dtype=torch.float64)}, [])
    other.set_non_tensor("t", "meta")
    assert other.dtype == torch.float64
    for out in (src.to(other=other), src.to(other)):
        assert out["a"].dtype == torch.float64 and out["n", "b"].dtype == torch.float64
        assert out["s"] == "text"


def test_to_other_only_non_tensor_changes_no_dtype():
    src = shared_td.TensorDict({"a": torch.zeros(2)}, [2])
    other = shared_td.TensorDict({}, [])
    other.set_non_tensor("t", "meta")
    assert src.to(other=other)["a"].dtype == torch.float32
