"""Tensorclass and non-tensor data beside tensordict 0.15.3 (third pass over tensordict's
own tensorclass and non-tensor tests): each difference that pass found and fixed, the same
code run on both libraries."""
from __future__ import annotations

import pytest
import torch

import shared_td
from tests.reference import LIBS, needs_tensordict, tensordict

def listed(value):
    """A non-tensor entry as (its class name, its values)."""
    return type(value).__name__, value.tolist()


# ----------------------------------------- a new non-tensor key written at some rows only
@pytest.mark.parametrize("lib", LIBS)
def test_a_value_written_at_one_row_under_a_new_key_fills_every_row(lib):
    # the key is new to the tensordict: the rows not written hold the same value, as
    # a tensor's hold zeros (they held None once), and it stays one NonTensorData
    log = lib.TensorDict({}, [2, 3])
    log[0, 1] = lib.TensorDict({"step": 4, "phase": "warmup"}, [])
    assert listed(log.get("phase")) == ("NonTensorData", [["warmup"] * 3] * 2)
    assert log["step"].tolist() == [[0, 4, 0], [0, 0, 0]]
    log[1, 2] = lib.TensorDict({"step": 5, "phase": "train"}, [])
    assert log.get("phase").tolist() == [["warmup"] * 3, ["warmup", "warmup", "train"]]


@pytest.mark.parametrize("lib", LIBS)
def test_a_stack_written_at_some_rows_under_a_new_key_leaves_none_elsewhere(lib):
    log = lib.TensorDict({}, [4])
    log[1:3] = lib.TensorDict(phase=lib.NonTensorStack("warmup", "train"), batch_size=[2])
    assert listed(log.get("phase")) == ("NonTensorStack", [None, "warmup", "train", None])


# ------------------------------------------------------------------ tensorclass basics
@pytest.mark.parametrize("lib", LIBS)
def test_get_of_the_batch_size_or_device_reads_the_attribute(lib):
    # tensordict's tensorclass get(key) is getattr for a key that is not a field
    @lib.tensorclass
    class Step:
        obs: torch.Tensor

    step = Step(obs=torch.zeros(3, 2), batch_size=[3])
    assert step.get("batch_size") == torch.Size([3])
    assert step.get("device") is None
    assert step.get("nothing", "fallback") == "fallback"


@pytest.mark.parametrize("lib", LIBS)
def test_the_tensorclass_base_cannot_be_instantiated(lib):
    with pytest.raises(NotImplementedError):
        lib.TensorClass()

    class Step(lib.TensorClass):
        obs: torch.Tensor

        def __init__(self, obs):
            super().__init__()  # the generated __init__, no fields given yet
            self.obs = obs * 2

    assert Step(torch.ones(2)).obs.tolist() == [2.0, 2.0]


@pytest.mark.parametrize("lib", LIBS)
def test_an_unknown_bracket_flag_says_only_flags_are_accepted(lib):
    for item in ("autocst", int):
        with pytest.raises(TypeError, match="only accepts the flags"):
            lib.TensorClass[item]


# ------------------------------------------------------------------ non-tensor values
@pytest.mark.parametrize("lib", LIBS)
def test_a_function_held_as_a_non_tensor_is_called_through_it(lib):
    deltas = lib.TensorDict({"a": 1, "b": 1})
    ops = lib.TensorDict({"a": lambda x, y: x - y, "b": lambda x, y: x + y})
    out = lib.TensorDict({"a": 0, "b": 0}).apply(lambda x, y, op: op(x, y), deltas, ops)
    assert (out["a"].item(), out["b"].item()) == (-1, 1)
    assert lib.NonTensorData(len)("four") == 4


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("dims", [None, 1])
def test_from_dict_auto_batch_size_counts_non_tensor_stacks(lib, dims):
    # a list is a NonTensorStack of 4: the batch size cannot go past it (it raised)
    td = lib.TensorDict.from_dict({"query": ["q1", "q2", "q3", "q4"], "x": torch.zeros(4, 3)},
                                  auto_batch_size=True, batch_dims=dims)
    assert td.batch_size == torch.Size([4])
    assert td.get("query").tolist() == ["q1", "q2", "q3", "q4"]


@pytest.mark.parametrize("lib", LIBS)
def test_from_dict_batch_dims_alone_sets_the_batch_size_of_nested_ones_too(lib):
    td = lib.TensorDict.from_dict({"x": torch.zeros(4, 3, 2), "n": {"y": torch.zeros(4, 3, 5)}}, batch_dims=1)
    assert (td.batch_size, td["n"].batch_size) == (torch.Size([4]), torch.Size([4]))
    td = lib.TensorDict.from_dict({"x": torch.zeros(4, 3, 2), "n": {"y": torch.zeros(4, 3, 5)}}, auto_batch_size=True)
    assert (td.batch_size, td["n"].batch_size) == (torch.Size([4, 3]), torch.Size([4, 3, 5]))


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("extra, batch, expected", [
    (lambda lib: "tag", [4], [4]),  # a NonTensorData of the tensordict's batch size [4]
    (lambda lib: lib.NonTensorStack("a", "b", "c", "d"), [], [4]),
    (lambda lib: torch.stack([lib.NonTensorStack("a", "b", "c")] * 4), [], [4, 3]),
    (lambda lib: lib.NonTensorData("tag"), [], [4, 3, 2]),  # 0-d: follows the tensors
])
def test_auto_batch_size_stops_at_a_non_tensor_with_batch_dims(lib, extra, batch, expected):
    td = lib.TensorDict({"x": torch.zeros(4, 3, 2), "tag": extra(lib)}, batch_size=batch).auto_batch_size_()
    assert td.batch_size == torch.Size(expected)
    assert td.get("tag").batch_size == torch.Size(expected)


# --------------------------------- in-place writes through a row of a NonTensorStack
@pytest.mark.parametrize("lib", LIBS)
def test_set_through_a_row_reaches_the_stack_of_the_tensordict(lib):
    # the row held a copy of the value: the write was lost without a word
    td = lib.TensorDict(phase=lib.NonTensorStack("warmup", "train", "eval"), batch_size=[3])
    td[1].set_("phase", "test")
    td[0:2][0].update_(lib.TensorDict(phase="idle"))
    assert td.get("phase").tolist() == ["idle", "test", "eval"]


@pytest.mark.parametrize("lib", LIBS)
def test_update_of_an_element_of_a_stack_reaches_the_stack(lib):
    stack = lib.NonTensorStack("a", "b", "c")
    stack[0].update_(lib.NonTensorData("z"))
    stack[1:][1].update_(lib.NonTensorData("y"))
    assert stack.tolist() == ["z", "b", "y"]
    stack[0][True] = lib.NonTensorStack("x")  # one value for a 0-d element
    assert stack.tolist() == ["x", "b", "y"]


@pytest.mark.parametrize("lib", LIBS)
def test_a_clone_of_a_row_stays_apart_from_the_stack(lib):
    stack = lib.NonTensorStack("a", "b")
    row = stack[0].clone()
    row.update_(lib.NonTensorData("z"))
    assert stack.tolist() == ["a", "b"]
    with pytest.raises(ValueError):  # two values into a NonTensorData: refused
        lib.NonTensorData("x", batch_size=[2])[:] = lib.NonTensorStack("y", "z")


def test_a_pickled_row_does_not_carry_the_whole_stack():
    import pickle

    stack = shared_td.NonTensorStack(*[f"sentence {i}" for i in range(2000)])
    td = shared_td.TensorDict(text=stack, batch_size=[2000])
    assert len(pickle.dumps(td[3])) < len(pickle.dumps(td)) / 20
    row = pickle.loads(pickle.dumps(td[3]))
    row.set_("text", "changed")  # the copy's write reaches no stack
    assert (row["text"], td[3]["text"]) == ("changed", "sentence 3")


@pytest.mark.parametrize("lib", LIBS)
def test_select_as_tensordict_is_accepted_by_tensordicts_and_lazy_stacks(lib):
    td = lib.TensorDict({"a": torch.zeros(3), "b": torch.ones(3)}, [3])
    assert type(td.select("a", as_tensordict=True)) is lib.TensorDict
    stack = lib.lazy_stack([td, td.clone()])
    assert type(stack.select("b", as_tensordict=True)) is lib.LazyStackedTensorDict
    assert list(stack.select("b", as_tensordict=True).keys()) == ["b"]


# ------------------------------------------------------------ repeat of non-tensor entries
@pytest.mark.parametrize("lib", LIBS)
def test_repeat_and_repeat_interleave_of_a_non_tensor_stack(lib):
    grid = lib.NonTensorStack(lib.NonTensorData("a", batch_size=(3,)), lib.NonTensorData("b", batch_size=(3,)), stack_dim=1)
    tiled = grid.repeat(1, 2)
    assert listed(tiled)[0] == "NonTensorStack" and tiled.shape == (3, 4)
    assert tiled[0].tolist() == ["a", "b", "a", "b"]
    assert grid.repeat_interleave(3, dim=1)[0].tolist() == ["a", "a", "a", "b", "b", "b"]
    assert lib.NonTensorStack("a", "b").repeat_interleave(torch.tensor([1, 2])).tolist() == ["a", "b", "b"]
    one = lib.NonTensorData("x", batch_size=[2]).repeat(3)
    assert listed(one) == ("NonTensorData", ["x"] * 6)


def test_a_repeated_stack_is_a_copy():
    stack = shared_td.NonTensorStack("a", "b")
    tiled = stack.repeat(2)
    tiled[0] = "z"
    tiled[1].update_(shared_td.NonTensorData("y"))
    assert (stack.tolist(), tiled.tolist()) == (["a", "b"], ["z", "y", "a", "b"])


@pytest.mark.parametrize("lib", [pytest.param(shared_td, id="shared_td"),
                                 pytest.param(tensordict, id="tensordict", marks=needs_tensordict)])
def test_a_write_through_a_view_changes_only_the_rows_it_writes(lib):
    # a view's one-row write forwarded every row of the view, old values included: a
    # write made through the tensordict since was silently undone
    td = lib.TensorDict(text=lib.NonTensorStack("a", "b", "c"), batch_size=[3])
    first_two = td[:2]
    td[1] = lib.TensorDict(text="Z", batch_size=[])
    first_two.set_at_("text", "X", 0)
    assert td.get("text").tolist() == ["X", "Z", "c"]


@pytest.mark.parametrize("lib", [pytest.param(shared_td, id="shared_td"),
                                 pytest.param(tensordict, id="tensordict", marks=needs_tensordict)])
@pytest.mark.parametrize("index", [[0, 2], torch.tensor([True, False, True])], ids=["list", "mask"])
def test_a_sample_by_index_list_or_mask_is_a_copy_for_its_non_tensor_entries_too(lib, index):
    # a replay sample edited in place must not write into the buffer (its tensors do not)
    td = lib.TensorDict(text=lib.NonTensorStack("a", "b", "c"), x=torch.zeros(3), batch_size=[3])
    sample = td[index]
    sample.update_({"x": torch.ones(2), "text": lib.NonTensorStack("P", "Q")})
    assert td.get("text").tolist() == ["a", "b", "c"] and td["x"].tolist() == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("lib", [pytest.param(shared_td, id="shared_td"),
                                 pytest.param(tensordict, id="tensordict", marks=needs_tensordict)])
def test_setting_the_data_of_an_element_of_a_stack_reaches_the_stack(lib):
    td = lib.TensorDict(text=lib.NonTensorStack("a", "b", "c"), batch_size=[3])
    td.get("text")[0].data = "Z"
    assert td.get("text").tolist() == ["Z", "b", "c"]
