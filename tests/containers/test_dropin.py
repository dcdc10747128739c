"""shared_td against tensordict 0.15.3, side by side: the behaviours a program ported
from tensordict relies on (sharing, non-tensor entries, comparisons, tensorclasses).

Each test runs on both libraries where tensordict has the behaviour; it is skipped for
tensordict when tensordict 0.15.3 is not installed.
"""
from __future__ import annotations

import multiprocessing
import queue as queue_module

import pytest
import torch

import dropin_children as kids
import shared_td
from processes import WAIT, finish

try:
    import tensordict
except ImportError:  # the shared_td half still runs
    tensordict = None

needs_tensordict = pytest.mark.skipif(
    tensordict is None or tensordict.__version__ != "0.15.3",
    reason="tensordict==0.15.3 is not installed: pip install '.[test]' to compare with it",
)
LIBS = [
    pytest.param(shared_td, id="shared_td"),
    pytest.param(tensordict, id="tensordict", marks=needs_tensordict),
]


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
