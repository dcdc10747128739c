"""load_state_dict of non-tensor entries whose values are lists: a NonTensorData holding a list is one value, a NonTensorStack of lists keeps its values (fuzzer seed 306538: ValueError, a list read as one value per element, or a batch-size error before)."""
import pytest
import torch

import shared_td as S


def _stack_of_lists():
    with S.set_list_to_stack(False):
        td = S.TensorDict({"a": torch.zeros(2)}, [2])
        td.set("lk", ["x", "y", "z"])
    return torch.stack([td, td.clone()], 0)


@pytest.mark.parametrize("flatten", [True, False])
def test_stack_of_lists_round_trip(flatten):
    st = _stack_of_lists()
    dst = st.clone()
    dst.load_state_dict(st.state_dict(flatten=flatten))
    assert type(dst.get("lk")).__name__ == "NonTensorStack"
    assert dst.get("lk").tolist() == [[["x", "y", "z"]] * 2] * 2


@pytest.mark.parametrize("flatten", [True, False])
def test_non_tensor_data_list_round_trip(flatten):
    src = S.TensorDict({"a": torch.ones(2)}, [2])
    src.set("nl", S.NonTensorData(["p", "q"], batch_size=[2]))
    dst = S.TensorDict({"a": torch.zeros(2)}, [2])
    dst.set("nl", S.NonTensorData(["r", "s"], batch_size=[2]))
    dst.load_state_dict(src.state_dict(flatten=flatten))
    assert dst.get("nl").data == ["p", "q"]  # as tensordict 0.15.3


@pytest.mark.parametrize("flatten", [True, False])
def test_non_tensor_data_list_added_stays_one_value(flatten):
    src = S.TensorDict({"a": torch.ones(2)}, [2])
    src.set("nl", S.NonTensorData(["p", "q"], batch_size=[2]))
    dst = S.TensorDict({"a": torch.zeros(2)}, [2])
    dst.load_state_dict(src.state_dict(flatten=flatten), strict=False)
    assert type(dst.get("nl")).__name__ == "NonTensorData"
    assert dst.get("nl").data == ["p", "q"]


def test_stack_level_marked_as_stack():
    st = S.TensorDict({}, [2]); st.set("s", ["a", "b"])
    assert st.state_dict()._metadata["s"]["_type"] == "NonTensorStack"
