"""``rename``/``rename_`` of batch dim names, and the error of a name used twice once
a parent's names reach a nested tensordict: tensordict's test_nameddims.py uses them
(found by running it against shared_td, where ``rename`` did not exist and the clash
was a RuntimeError only)."""
from __future__ import annotations

import pytest
import torch

import shared_td
from tests.reference import LIBS

def rollout(lib):
    return lib.TensorDict(
        {"obs": torch.zeros(2, 3, 4), "agents": lib.TensorDict({"pos": torch.zeros(2, 3, 5, 2)}, [2, 3, 5])},
        [2, 3], names=["time", "env"],
    )


@pytest.mark.parametrize("lib", LIBS)
def test_rename_in_place_by_map_and_by_list(lib):
    td = rollout(lib)
    assert td.rename_(env="batch") is td
    assert td.names == ["time", "batch"]
    assert td["agents"].names == ["time", "batch", None]
    td.rename_("t", None)
    assert td.names == ["t", None]
    assert td["agents"].names[:2] == ["t", None]


@pytest.mark.parametrize("lib", LIBS)
def test_rename_gives_a_renamed_copy_over_the_same_tensors(lib):
    td = rollout(lib)
    copy = td.rename(time="t")
    assert copy.names == ["t", "env"]
    assert copy["agents"].names[:2] == ["t", "env"]
    assert td.names == ["time", "env"]
    assert td["agents"].names[:2] == ["time", "env"]
    assert copy["obs"].data_ptr() == td["obs"].data_ptr()


@pytest.mark.parametrize("lib", LIBS)
def test_rename_errors_leave_the_names(lib):
    td = rollout(lib)
    with pytest.raises(ValueError):
        td.rename_(time="env")  # "env" would be used twice
    with pytest.raises(ValueError):
        td.rename_("a", "b", env="c")  # a list and a map
    with pytest.raises(ValueError):
        td.rename_()
    assert td.names == ["time", "env"]


@pytest.mark.parametrize("lib", LIBS)
def test_rename_of_a_lazy_stack_and_a_memmap(lib, tmp_path):
    lazy = lib.LazyStackedTensorDict.lazy_stack(
        [lib.TensorDict({"x": torch.zeros(3)}, [3], names=["env"]) for _ in range(2)], 0
    ).refine_names("agent", "env")
    assert lazy.rename(env="e").names == ["agent", "e"]
    assert lazy.names == ["agent", "env"]
    lazy.rename_(agent="a")
    assert lazy.names == ["a", "env"]
    assert lazy[0].names == ["env"]
    saved = rollout(lib).memmap_(tmp_path)
    saved.rename_(env="e")
    assert saved.names == ["time", "e"]
    assert saved.clone().names == ["time", "e"]


@pytest.mark.parametrize("lib", LIBS)
def test_a_parent_name_clashing_with_a_nested_name_is_a_value_error(lib):
    child = lib.TensorDict({"obs": torch.zeros(2, 3, 4)}, [2, 3], names=[None, "batch"])
    td = lib.TensorDict({"agents": child}, [2])
    with pytest.raises(ValueError):
        td.names = ["batch"]
    assert td["agents"].names == [None, "batch"]


def test_the_clash_is_still_a_runtime_error():
    """shared_td raised RuntimeError before: code catching it keeps working."""
    child = shared_td.TensorDict({}, [2, 3], names=[None, "batch"])
    td = shared_td.TensorDict({"agents": child}, [2])
    with pytest.raises(RuntimeError, match="used twice"):
        td.names = ["batch"]


@pytest.mark.parametrize("lib", LIBS)
def test_a_stack_whose_members_name_dims_differently_nests_in_a_0_dim_parent(lib):
    """A parent without batch dims shares no dim with the stack: storing it, and
    unnaming the parent, leave the members' own names (shared_td raised ValueError)."""
    stack = lib.LazyStackedTensorDict(
        lib.TensorDict({}, [3], names=["x"]), lib.TensorDict({}, [3], names=["y"])
    )
    td = lib.TensorDict({"s": stack}, [])
    td.names = None
    td["t"] = stack
    assert [member.names for member in td["s"].tensordicts] == [["x"], ["y"]]


@pytest.mark.parametrize("lib", LIBS)
def test_a_stack_dim_name_used_by_a_nested_dim_is_refused(lib):
    """Naming the stack dim like a dim of the members' nested tensordicts raises, and
    leaves the names (shared_td took it, and reading the nested entry then raised)."""
    td = lib.TensorDict({"agents": lib.TensorDict({}, [3, 4], names=["env", "agent"])}, [3], names=["env"])
    stack = lib.LazyStackedTensorDict.lazy_stack([td, td], -1)
    with pytest.raises(ValueError):
        stack.names = ["env", "agent"]
    assert stack.names == ["env", None]
    assert stack["agents"].names == ["env", None, "agent"]
    stack.names = ["env", "step"]
    assert stack["agents"].names == ["env", "step", "agent"]
