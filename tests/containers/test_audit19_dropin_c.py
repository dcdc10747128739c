"""Follow-ups of the audit of the drop-in commit (session 19), side by side with
tensordict 0.15.3:

* a write through ``lazy.get(key)`` (a non-tensor key) writes the elements written,
  only, into the members the stack was read from: before, each member touched got its
  whole part again from the values read by ``get`` (an element another process wrote
  since went back), and the members were found by position when writing (after
  ``insert(0, ...)`` the write landed in the new member);
* ``td.to(device)`` of a shared tensordict gives the result its own non-tensor entries
  (a write into it reached ``td`` and every process sharing it);
* ``td.to(device, dtype)`` and ``td.to(device=..., dtype=...)`` cast (the dtype was
  ignored); arguments ``torch.Tensor.to`` refuses raise.
"""
from __future__ import annotations

import multiprocessing

import pytest
import torch

import shared_td
from tests.reference import LIBS

def _stored(td, how, path):
    if how == "share":
        return td.share_memory_()
    if how == "memmap":
        return td.memmap_(path)
    return td


def _two_rows(lib, how="plain", path=None, dim=0):
    """A lazy stack (along ``dim``) of two members of batch size [3], each holding a
    NonTensorStack under "s"."""
    members = [lib.TensorDict(s=["p", "q", "r"], batch_size=[3]), lib.TensorDict(s=["u", "v", "w"], batch_size=[3])]
    return _stored(lib.lazy_stack(members, dim), how, path)


# ---------------------------------------------------------------- 1. lazy.get(key) writes the elements written
@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("how", ["plain", "share", "memmap"])
@pytest.mark.parametrize("dim", [0, 1])
def test_a_write_through_lazy_get_keeps_what_was_written_into_the_member_since(lib, how, dim, tmp_path):
    lazy = _two_rows(lib, how, tmp_path / "lazy", dim)
    view = lazy.get("s")
    lazy.tensordicts[0].set_at_("s", "NEW", 2)  # written after get(), into the member
    view[0, 0] = "Z"  # element 0 of member 0 (the stack dim first or second)
    assert lazy.tensordicts[0].get("s").tolist() == ["Z", "q", "NEW"]
    assert lazy.tensordicts[1].get("s").tolist() == ["u", "v", "w"]
    if how == "memmap":
        loaded = lib.LazyStackedTensorDict.load_memmap(tmp_path / "lazy")
        assert loaded.tensordicts[0].get("s").tolist() == ["Z", "q", "NEW"]


@pytest.mark.parametrize("lib", LIBS)
def test_a_write_through_lazy_get_of_nested_lazy_stacks_writes_one_element(lib):
    inner = [lib.lazy_stack([lib.TensorDict(s=["a", "b"], batch_size=[2]),
                             lib.TensorDict(s=["c", "d"], batch_size=[2])]) for _ in range(2)]
    view = lib.lazy_stack(inner).get("s")
    inner[1].tensordicts[0].set_at_("s", "NEW", 1)
    view[1, 0, 0] = "Z"
    assert inner[1].tensordicts[0].get("s").tolist() == ["Z", "NEW"]
    assert [m.get("s").tolist() for m in inner[0].tensordicts] == [["a", "b"], ["c", "d"]]


@pytest.mark.parametrize("lib", LIBS)
def test_a_write_through_lazy_get_goes_to_the_member_it_was_read_from(lib):
    lazy = lib.lazy_stack([lib.TensorDict(s="a"), lib.TensorDict(s="b")])
    view = lazy.get("s")
    lazy.insert(0, lib.TensorDict(s="new"))
    view[0] = "Z"  # the member that held "a"
    assert [m["s"] for m in lazy.tensordicts] == ["new", "Z", "b"]
    removed = lazy.tensordicts.pop(1)
    view[0] = "Y"  # still that member, removed from the stack: the others are untouched
    assert removed["s"] == "Y" and [m["s"] for m in lazy.tensordicts] == ["new", "b"]


def _write_element_two(lazy, done):
    lazy.tensordicts[0].set_at_("s", "CHILD", 2)
    done.set()


def test_a_write_through_lazy_get_keeps_another_process_s_write_into_a_shared_member():
    lazy = _two_rows(shared_td, "share")
    view = lazy.get("s")
    context = multiprocessing.get_context("fork")
    done = context.Event()
    child = context.Process(target=_write_element_two, args=(lazy, done))
    child.start()
    child.join(30)
    assert child.exitcode == 0 and done.is_set()
    assert lazy.tensordicts[0].get("s").tolist() == ["p", "q", "CHILD"]
    view[0, 0] = "PARENT"
    assert lazy.tensordicts[0].get("s").tolist() == ["PARENT", "q", "CHILD"]


def test_a_part_write_through_lazy_get_into_a_shared_non_tensor_data_member_changes_nothing():
    # one value for the batch, shared: per-element values are refused (as set_at_
    # refuses them), every member checked before the first is written
    members = [shared_td.TensorDict(s=["u", "v", "w"], batch_size=[3]),
               shared_td.TensorDict(s=shared_td.NonTensorData("a", batch_size=[3]), batch_size=[3]).share_memory_()]
    lazy = shared_td.lazy_stack(members)
    view = lazy.get("s")
    with pytest.raises(RuntimeError, match="per-element"):
        view[:, 0] = "Z"
    assert [m.get("s").tolist() for m in members] == [["u", "v", "w"], ["a", "a", "a"]]
    assert view.tolist() == [["u", "v", "w"], ["a", "a", "a"]]
    view[1] = "Z"  # the whole member: one value, written in its shared cell
    assert members[1].get("s").tolist() == ["Z", "Z", "Z"] and members[1].get("s").is_shared()


# ---------------------------------------------------------------- 2. to(device) of a shared tensordict
@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("args", [("cpu",), ("cpu", torch.float64)], ids=["device", "device-dtype"])
def test_to_device_of_a_shared_tensordict_gives_the_result_its_own_non_tensor_entries(lib, args):
    td = lib.TensorDict(x=torch.zeros(2), s="old", batch_size=[2]).share_memory_()
    out = td.to(*args)
    assert out is not td
    out.set_("s", "Z")
    assert td["s"] == "old" and out["s"] == "Z"


# ---------------------------------------------------------------- 3. to(device, dtype)
TO_ARGS = [
    pytest.param(("cpu", torch.float64), {}, id="positional"),
    pytest.param((), {"device": "cpu", "dtype": torch.float64}, id="keywords"),
    pytest.param(("cpu",), {"dtype": torch.float64}, id="mixed"),
    pytest.param((torch.zeros(1, dtype=torch.float64),), {}, id="tensor"),
]


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("args, kwargs", TO_ARGS)
def test_to_device_and_dtype_moves_and_casts(lib, args, kwargs):
    td = lib.TensorDict(x=torch.zeros(2), n=lib.TensorDict(y=torch.ones(2, dtype=torch.int32), batch_size=[2]),
                        s="a", batch_size=[2])
    lazy = lib.lazy_stack([td[0], td[1]])
    for out in (td.to(*args, **kwargs), lazy.to(*args, **kwargs)):
        assert out["x"].dtype == torch.float64 and out["n", "y"].dtype == torch.float64
        assert out.device == torch.device("cpu") and out[0]["s"] == "a"
    entry = lib.NonTensorData("a", batch_size=[2]).to(*args, **kwargs)
    assert entry.device == torch.device("cpu") and entry.data == "a"


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("args, kwargs", [(("cpu",), {"flavour": 1}), (("nowhere",), {})], ids=["keyword", "device"])
def test_to_with_arguments_torch_refuses_raises(lib, args, kwargs):
    td = lib.TensorDict(x=torch.zeros(2), batch_size=[2])
    with pytest.raises((TypeError, RuntimeError)):
        td.to(*args, **kwargs)


# ---------------------------------------------------------------- 4. low: nesting, update_(to_dict())
def test_lazy_get_of_nested_lazy_stacks_stacks_the_members_once(monkeypatch):
    # the members' flags are read from their own entries: each level's get() asked the
    # members' get(), which stacked (and linked) their whole entry again, level by level
    def tree(depth):
        if depth == 0:
            return shared_td.TensorDict(s="v")
        return shared_td.lazy_stack([tree(depth - 1) for _ in range(2)])

    lazy, calls = tree(3), []
    get = shared_td.LazyStackedTensorDict.get
    monkeypatch.setattr(shared_td.LazyStackedTensorDict, "get",
                        lambda self, *args, **kwargs: calls.append(1) or get(self, *args, **kwargs))
    view = lazy.get("s")
    assert len(calls) == 1 and view.tolist() == [[["v"] * 2] * 2] * 2


@pytest.mark.parametrize("lib", LIBS)
def test_a_lazy_stack_s_non_tensor_entry_got_through_its_parent_writes_into_the_members(lib):
    td = lib.TensorDict(lazy=lib.lazy_stack([lib.TensorDict(s="a"), lib.TensorDict(s="b")]))
    view = td.get(("lazy", "s"))
    view[1] = "B"
    assert [m["s"] for m in td["lazy"].tensordicts] == ["a", "B"]


@pytest.mark.parametrize("lib", LIBS)
def test_update_from_to_dict_takes_a_list_held_as_one_value(lib):
    td = lib.TensorDict(x=torch.zeros(2), cfg=lib.NonTensorData([1, 2, 3]), s=["a", "b"], batch_size=[2])
    td.update_(td.to_dict())
    assert td.get("cfg").tolist() == [[1, 2, 3], [1, 2, 3]] and td.get("s").tolist() == ["a", "b"]


def test_a_list_of_another_length_written_into_a_non_tensor_data_says_how_to_keep_it_whole():
    td = shared_td.TensorDict(cfg=shared_td.NonTensorData([1, 2, 3]), batch_size=[2])
    with pytest.raises(RuntimeError, match=r"NonTensorData\(the_list\)"):
        td.update_({"cfg": [7, 8, 9]})
    assert td.get("cfg").tolist() == [[1, 2, 3], [1, 2, 3]]


# ------------------------------------------------ final audit of b566bfb: to()'s keywords


@pytest.mark.parametrize("kwargs", [{"non_blocking_pin": False}, {"num_threads": 2}],
                         ids=["non_blocking_pin", "num_threads"])
def test_to_accepts_tensordicts_own_keywords_that_change_nothing(kwargs):
    # before: torch's parser refused them ("invalid combination of arguments")
    td = shared_td.TensorDict(a=torch.zeros(2), s="x", batch_size=[2], device="cpu")
    assert td.to("cpu", **kwargs) is td
    assert td.to(torch.float64, **kwargs)["a"].dtype == torch.float64


def test_to_another_tensordict_takes_its_device():
    td = shared_td.TensorDict(a=torch.zeros(2), batch_size=[2])
    other = shared_td.TensorDict(b=torch.zeros(2), batch_size=[2], device="cpu")
    for moved in (td.to(other), td.to(other=other)):
        assert moved.device == torch.device("cpu") and moved["a"].dtype == torch.float32


def test_to_batch_size_is_checked_not_ignored():
    td = shared_td.TensorDict(a=torch.zeros(2), batch_size=[2], device="cpu")
    assert td.to(batch_size=[2]) is td
    with pytest.raises(ValueError, match=r"batch_size=\[\]"):
        td.to(batch_size=[])
    lazy = shared_td.lazy_stack([td, td])
    assert lazy.to(batch_size=[2, 2]) is lazy
    assert shared_td.NonTensorData("a", batch_size=[2]).to(batch_size=[2]).batch_size == (2,)


def test_a_default_returned_through_a_lazy_stack_is_left_as_it_is():
    # before: the caller's default was linked to the stack's members (flags overwritten)
    default = shared_td.NonTensorStack.from_list(["q", "v"]).share_memory_()
    td = shared_td.TensorDict(l=shared_td.lazy_stack([shared_td.TensorDict(s="a"), shared_td.TensorDict(s="b")]))
    assert td.get(("l", "missing"), default) is default
    assert default.is_shared()
    default[0] = "z"
    assert default.tolist() == ["z", "v"]
