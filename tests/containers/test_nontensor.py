"""Non-tensor entries: NonTensorData (one value) and NonTensorStack (one value per element)."""
from __future__ import annotations

import pytest
import torch

from shared_td import NonTensorData, NonTensorStack, TensorDict, is_non_tensor, is_tensor_collection


def make_td(task: str = "walk") -> TensorDict:
    td = TensorDict(obs=torch.zeros(3, 2), batch_size=[3])
    td["task"] = task
    return td


def test_set_and_get_plain_value():
    td = make_td()
    stored = td.get("task")
    assert isinstance(stored, NonTensorData) and stored.data == "walk"
    assert stored.batch_size == torch.Size([3])
    assert is_non_tensor(stored) and is_tensor_collection(stored)
    assert td["task"] == "walk" and td.get_non_tensor("task") == "walk"
    assert td[0]["task"] == "walk" and td[1:]["task"] == "walk"
    assert td[1:].get("task").batch_size == torch.Size([2])


# (a dict is not among them: it becomes a nested TensorDict; nor is a list as long as
# the batch, which becomes a NonTensorStack of one value per element, as in tensordict:
# test_dropin.py; a tuple stays one value)
@pytest.mark.parametrize("value", ["text", None, {1, 2}, object, ("a", 1), range(3)])
def test_any_python_value(value):
    td = TensorDict(batch_size=[2])
    td["v"] = value
    assert td["v"] == value and td[1]["v"] == value


def test_non_tensor_in_nested_and_to_dict():
    td = TensorDict({"info": {"name": "cheetah"}, "obs": torch.zeros(2)}, batch_size=[2])
    assert td["info", "name"] == "cheetah"
    assert td.to_dict()["info"]["name"] == "cheetah"
    assert td.exclude("obs").to_dict() == {"info": {"name": "cheetah"}}
    assert td.flatten_keys()["info.name"] == "cheetah"


def test_stacked_members_only_through_indexing():
    # tensordict keeps a stack of NonTensorData members; cat, reshape and writes do not
    a, b = make_td("walk"), make_td("run")
    stacked = torch.stack([a, b])
    assert stacked.unsqueeze(0)[0, 1]["task"] == "run"
    assert torch.stack([stacked, stacked])[0, 1]["task"] == "run"
    assert torch.cat([a, b])[0:3]["task"] == ["walk"] * 3
    assert stacked.reshape(6)[0:3]["task"] == ["walk"] * 3
    stacked[1, 0] = {"task": "jump"}  # a write: element values from now on
    assert stacked[1]["task"] == ["jump", "run", "run"]
    copy = torch.stack([a, b]).clone()
    assert copy[0]["task"] == "walk"


def test_stack_gives_one_value_per_element():
    stacked = torch.stack([make_td("walk"), make_td("run")])
    assert isinstance(stacked.get("task"), NonTensorStack)
    assert stacked.get("task").batch_size == torch.Size([2, 3])
    assert stacked["task"] == [["walk"] * 3, ["run"] * 3]
    assert stacked[1, 0]["task"] == "run" and stacked[0, 2]["task"] == "walk"
    # as tensordict 0.15.3: an element of the stack dim is the stacked NonTensorData
    assert stacked[1]["task"] == "run" and stacked.get("task")[1].batch_size == (3,)
    assert stacked[1, 1:]["task"] == "run" and stacked[0:1]["task"] == [["walk"] * 3]
    assert stacked[:, 0]["task"] == ["walk", "run"]
    assert stacked[torch.tensor([False, True])]["task"] == [["run"] * 3]
    assert stacked[[1, 0, 1], 2]["task"] == ["run", "walk", "run"]
    assert [row[0]["task"] for row in stacked] == ["walk", "run"]
    assert [row[2]["task"] for row in stacked.unbind(0)] == ["walk", "run"]


def test_stack_of_scalars_and_equal_values():
    stacked = torch.stack([TensorDict(task="a"), TensorDict(task="b"), TensorDict(task="a")])
    assert stacked["task"] == ["a", "b", "a"] and stacked[1]["task"] == "b"
    same = torch.stack([TensorDict(task="a"), TensorDict(task="a")])
    assert isinstance(same.get("task"), NonTensorStack) and same["task"] == ["a", "a"]


def test_cat_and_shape_ops_keep_values_per_element():
    td = torch.stack([make_td("walk"), make_td("run")])  # [2, 3]
    assert torch.cat([make_td("a"), make_td("b")])["task"] == ["a"] * 3 + ["b"] * 3
    assert td.reshape(-1)["task"] == ["walk"] * 3 + ["run"] * 3
    assert td.permute(1, 0)["task"] == [["walk", "run"]] * 3
    assert td.unsqueeze(1)["task"] == [[["walk"] * 3], [["run"] * 3]]
    assert td.unsqueeze(1).squeeze(1)["task"] == td["task"]
    assert td.expand(4, 2, 3)[3, 1, 0]["task"] == "run"
    assert make_td().expand(2, 3)[1, 2]["task"] == "walk"
    assert td.clone()["task"] == td["task"]
    assert td.apply(lambda x: x + 1)["task"] == td["task"]


def test_comparisons():
    a, b = make_td("walk"), make_td("run")
    assert (a == a.clone()).all()
    eq = a == b
    assert eq["task"].tolist() == [False, False, False] and eq["obs"].all()
    assert (a != b)["task"].all()
    stacked = torch.stack([a, b])
    assert (stacked == stacked.clone())["task"].all()
    data = NonTensorData("x", batch_size=[2])
    assert (data == NonTensorData("x", batch_size=[2])).tolist() == [True, True]
    assert (data != "y").tolist() == [True, True]
    assert (NonTensorStack("a", "b") == "a").tolist() == [True, False]


def test_in_place_writes():
    td = make_td()
    td.set_("task", "run")
    assert td["task"] == "run"
    td.update_({"task": "jump"})
    assert td["task"] == "jump"
    stacked = torch.stack([make_td("walk"), make_td("run")])
    stacked.set_("task", "all")  # one value fills every element
    assert stacked["task"] == [["all"] * 3] * 2
    stacked.set_("task", [["a", "b", "c"], ["d", "e", "f"]])
    assert stacked[1, 2]["task"] == "f"


def test_in_place_write_failures_change_nothing(unchanged):
    td = make_td()
    with unchanged(td), pytest.raises(ValueError, match="NonTensorStack"):
        td.set_("task", NonTensorStack("a", "b", "c"))
    stacked = torch.stack([make_td("walk"), make_td("run")])
    with unchanged(stacked), pytest.raises(ValueError, match="(?i)non-tensor"):
        stacked.set_("task", NonTensorStack("a", "b", "c", "d"))
    with unchanged(stacked), pytest.raises(ValueError, match="(?i)non-tensor"):
        stacked.update_({"obs": torch.ones(2, 3, 2), "task": NonTensorStack("a", "b", "c", "d")})


def test_index_write_of_non_tensors():
    td = make_td()
    td[0] = TensorDict(task="run")
    assert td["task"] == ["run", "walk", "walk"] and td[0]["task"] == "run"
    td[1:] = {"task": "jump"}
    assert td["task"] == ["run", "jump", "jump"]
    stacked = torch.stack([make_td("walk"), make_td("run")])
    stacked[:, 1] = TensorDict(task=NonTensorStack("x", "y"), batch_size=[2])
    assert stacked[:, 1]["task"] == ["x", "y"] and stacked[0, 0]["task"] == "walk"


def test_non_tensor_classes_directly():
    data = NonTensorData("a", batch_size=[2, 2])
    assert data.tolist() == [["a", "a"], ["a", "a"]]
    assert data[0].batch_size == torch.Size([2]) and data[0, 1].data == "a"
    assert NonTensorData(NonTensorData(3)).data == 3
    stack = NonTensorStack("a", "b", "c")
    assert stack.batch_size == torch.Size([3]) and stack.tolist() == ["a", "b", "c"]
    assert isinstance(stack[1], NonTensorData) and stack[1].data == "b"
    assert stack[1:].tolist() == ["b", "c"] and stack[[2, 0]].tolist() == ["c", "a"]
    assert NonTensorStack.from_list([["a", "b"], ["c", "d"]]).batch_size == torch.Size([2, 2])
    nested = NonTensorStack(NonTensorData("x", batch_size=[2]), NonTensorData("y", batch_size=[2]))
    assert nested.tolist() == [["x", "x"], ["y", "y"]]
    with pytest.raises(ValueError):
        NonTensorStack("a", "b", batch_size=[3])
    with pytest.raises(IndexError):
        stack[3]
    assert "walk" in repr(NonTensorData("walk")) and "['a', 'b', 'c']" in repr(stack)


def test_batch_size_changes_follow():
    td = make_td()
    td.batch_size = []
    assert td.get("task").batch_size == torch.Size([]) and td["task"] == "walk"
    td.batch_size = [3, 2]
    assert td.get("task").batch_size == torch.Size([3, 2]) and td[2, 1]["task"] == "walk"
