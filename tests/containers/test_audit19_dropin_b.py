"""Drop-in differences from tensordict 0.15.3 found in session 19 (audit findings 2, 3
and 5), side by side with it:

* the list rule (a list as long as the batch, or as the selected rows, is one value per
  element; nested lists a dim each) on every write path: a lazy stack's ``set``, a
  ``nocast`` tensorclass field, ``set_at_``, and ``set_``/``update_`` (into a
  NonTensorData: refused, as tensordict refuses it). Before, the whole list went to
  every member or row, or became one value for the batch;
* ``lazy.get(key)`` of a non-tensor key: writes into it reach the members (their
  shared cells and files too), and it reports the members' shared/memmap/lock state.
"""
from __future__ import annotations

import pickle
import threading

import pytest
import torch

import shared_td
from tests.reference import LIBS

HOW = ["plain", "share", "memmap"]


def _stored(lib, td, how, path):
    """``td`` shared or memory-mapped at ``path`` (``how``), or as it is."""
    if how == "share":
        return td.share_memory_()
    if how == "memmap":
        return td.memmap_(path)
    return td


def _lazy(lib, values, how="plain", path=None):
    """A lazy stack of 0-d members, each holding one value of ``values`` under "info"."""
    members = [lib.TensorDict({"x": torch.zeros(()), "info": v}, []) for v in values]
    return _stored(lib, lib.lazy_stack(members), how, path)


# ---------------------------------------------------------------- 2. a list set into a lazy stack
@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("dim", [0, 1])
def test_a_nested_list_set_into_a_lazy_stack_is_one_value_per_element(lib, dim):
    lazy = lib.lazy_stack([lib.TensorDict({"x": torch.zeros(2)}, [2]) for _ in range(2)], dim=dim)
    lazy["info"] = [["a", "b"], ["c", "d"]]
    assert {ij: lazy[ij]["info"] for ij in [(0, 0), (0, 1), (1, 0), (1, 1)]} == {
        (0, 0): "a", (0, 1): "b", (1, 0): "c", (1, 1): "d"}


@pytest.mark.parametrize("lib", LIBS)
def test_a_list_of_another_length_set_into_a_lazy_stack_is_refused(lib):
    lazy = lib.lazy_stack([lib.TensorDict({"x": torch.zeros(())}, []) for _ in range(2)])
    with pytest.raises(ValueError):
        lazy["info"] = ["a", "b", "c"]
    if lib is shared_td:  # (tensordict 0.15.3 has written the first members when zip() fails)
        assert all("info" not in member.keys() for member in lazy.tensordicts)


def test_a_list_that_is_not_shaped_as_a_lazy_stack_s_batch_names_the_key():
    # (tensordict 0.15.3 gives each member of a [2, 2] stack one value of ["a", "b"];
    # a TensorDict of batch [2, 2] refuses it, in both libraries, and so does ours)
    lazy = shared_td.lazy_stack([shared_td.TensorDict({"x": torch.zeros(2)}, [2]) for _ in range(2)])
    with pytest.raises(shared_td.BatchSizeMismatchError, match="'info'"):
        lazy["info"] = ["a", "b"]
    assert all("info" not in member.keys() for member in lazy.tensordicts)


@pytest.mark.parametrize("how", HOW)
def test_a_list_written_in_place_into_a_lazy_stack_gives_each_member_its_value(how, tmp_path):
    lazy = _lazy(shared_td, ["a", "b"], how, tmp_path / "lazy")
    lazy.set_("info", ["x", "y"])
    assert [member["info"] for member in lazy.tensordicts] == ["x", "y"]
    if how == "memmap":
        assert shared_td.LazyStackedTensorDict.load_memmap(tmp_path / "lazy")["info"] == ["x", "y"]


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("index", [slice(0, 2), [0, 2]], ids=["slice", "list"])
def test_a_list_set_at_rows_of_a_lazy_stack_is_one_value_per_row(lib, index):
    lazy = _lazy(lib, ["a", "b", "c"])
    lazy.set_at_("info", ["x", "y"], index)
    expected = ["x", "y", "c"] if isinstance(index, slice) else ["x", "b", "y"]
    assert [lazy[i]["info"] for i in range(3)] == expected


# ---------------------------------------------------------------- 3. the list rule elsewhere
def _nocast_classes(lib):
    class ByOption(lib.TensorClass["nocast"]):
        l: list

    @lib.tensorclass(nocast=True)
    class ByDecorator:
        l: list

    return [ByOption, ByDecorator]


@pytest.mark.parametrize("lib", LIBS)
def test_a_list_in_a_nocast_tensorclass_is_one_value_per_element(lib):
    for cls in _nocast_classes(lib):
        obj = cls(l=["a", "b"], batch_size=[2])
        assert obj[1].l == "b" and obj[0].l == "a"
        with pytest.raises(RuntimeError, match="'l'"):
            cls(l=["a", "b", "c"], batch_size=[2])
        with pytest.raises(RuntimeError, match="'l'"):
            obj.l = ["a", "b", "c"]
        assert obj[1].l == "b"


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("index", [slice(0, 2), torch.tensor([0, 2]), [0, 2]], ids=["slice", "tensor", "list"])
def test_a_list_set_at_rows_of_a_stack_is_one_value_per_row(lib, how, index, tmp_path):
    td = _stored(lib, lib.TensorDict({"x": torch.zeros(3), "st": ["a", "b", "c"]}, [3]), how, tmp_path / "td")
    td.set_at_("st", ["x", "y"], index)
    expected = ["x", "y", "c"] if isinstance(index, slice) else ["x", "b", "y"]
    assert list(td["st"]) == expected
    if how == "memmap":
        assert list(lib.TensorDict.load_memmap(tmp_path / "td")["st"]) == expected


@pytest.mark.parametrize("lib", LIBS)
def test_a_list_set_at_rows_of_a_non_tensor_data_is_one_value_per_row(lib):
    td = lib.TensorDict({"x": torch.zeros(3), "s": "old"}, [3])
    td.set_at_("s", ["x", "y"], [0, 2])
    assert list(td["s"]) == ["x", "old", "y"]


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("value", [["x", "y", "z"], ["x"]], ids=["longer", "shorter"])
def test_a_list_of_another_length_than_the_rows_is_refused_by_set_at_(lib, value):
    td = lib.TensorDict({"x": torch.zeros(3), "st": ["a", "b", "c"]}, [3])
    with pytest.raises(RuntimeError):
        td.set_at_("st", value, 0)  # one row: a list of one value per row does not fit it
    assert list(td["st"]) == ["a", "b", "c"]


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("write", ["set_", "update_", "set inplace"])
def test_a_list_written_in_place_into_a_non_tensor_data_is_refused(lib, how, write, tmp_path):
    td = _stored(lib, lib.TensorDict({"x": torch.zeros(3), "s": "old"}, [3]), how, tmp_path / "td")
    # a list is one value per element, which a NonTensorData (one value) cannot take
    with pytest.raises((ValueError, RuntimeError)):
        if write == "set_":
            td.set_("s", ["x", "y", "z"])
        elif write == "update_":
            td.update_({"s": ["x", "y", "z"]})
        else:
            td.set("s", ["x", "y", "z"], inplace=True)
    assert td["s"] == "old" and td[0]["s"] == "old"
    if how == "memmap":
        assert lib.TensorDict.load_memmap(tmp_path / "td")["s"] == "old"


def test_a_list_kept_as_one_value_is_written_wrapped_in_non_tensor_data():
    td = shared_td.TensorDict({"x": torch.zeros(3), "s": "old"}, [3]).share_memory_()
    td.set_("s", shared_td.NonTensorData(["x", "y", "z"]))
    assert td[0]["s"] == ["x", "y", "z"]


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("value", [["x", "y"], ["x"]], ids=["longer", "shorter"])
def test_a_list_of_another_length_than_the_batch_written_into_a_stack_is_refused(lib, value):
    td = lib.TensorDict({"x": torch.zeros(3), "st": ["a", "b", "c"]}, [3])
    with pytest.raises(RuntimeError, match="'st'"):
        td.set_("st", value)
    assert list(td["st"]) == ["a", "b", "c"]


# ---------------------------------------------------------------- 5. lazy.get(key) writes through
def _on_disk(lib, how, path):
    return list(lib.LazyStackedTensorDict.load_memmap(path)["info"]) if how == "memmap" else None


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("how", HOW)
def test_writes_into_a_lazy_stack_s_non_tensor_entry_reach_the_members(lib, how, tmp_path):
    lazy = _lazy(lib, ["a", "b"], how, tmp_path / "lazy")
    view = lazy.get("info")
    view.update_(lib.NonTensorStack(lib.NonTensorData("X"), lib.NonTensorData("Y")))
    assert list(lazy["info"]) == ["X", "Y"] and list(view.tolist()) == ["X", "Y"]
    assert _on_disk(lib, how, tmp_path / "lazy") in (None, ["X", "Y"])
    view[0] = lib.NonTensorData("Z")
    assert list(lazy["info"]) == ["Z", "Y"] and [m["info"] for m in lazy.tensordicts] == ["Z", "Y"]
    assert _on_disk(lib, how, tmp_path / "lazy") in (None, ["Z", "Y"])


@pytest.mark.parametrize("lib", LIBS)
def test_a_row_of_a_lazy_stack_s_non_tensor_entry_writes_into_the_member(lib):
    lazy = _lazy(lib, ["a", "b"])
    lazy.get("info")[1].update_(lib.NonTensorData("B"))
    assert lazy.tensordicts[1]["info"] == "B" and lazy.tensordicts[0]["info"] == "a"


@pytest.mark.parametrize("lib", LIBS)
def test_a_lazy_stack_s_non_tensor_entry_reports_the_members_state(lib, tmp_path):
    view = _lazy(lib, ["a", "b"], "share").get("info")
    assert view.is_shared() and not view.is_memmap()
    view = _lazy(lib, ["a", "b"], "memmap", tmp_path / "lazy").get("info")
    assert view.is_memmap() and view.is_locked
    view = _lazy(lib, ["a", "b"]).get("info")
    assert not view.is_shared() and not view.is_memmap() and not view.is_locked


@pytest.mark.parametrize("how", ["share", "memmap"])
def test_a_write_through_a_lazy_stack_s_non_tensor_entry_that_fails_changes_nothing(how, tmp_path):
    lazy = _lazy(shared_td, ["a", "b"], how, tmp_path / "lazy")
    view = lazy.get("info")
    with pytest.raises(TypeError, match="'info'"):
        view.update_(shared_td.NonTensorStack("X", threading.Lock()))
    assert view.tolist() == ["a", "b"] and [m["info"] for m in lazy.tensordicts] == ["a", "b"]
    assert _on_disk(shared_td, how, tmp_path / "lazy") in (None, ["a", "b"])
    with pytest.raises(RuntimeError, match="through the stack"):  # a row of it holds copies, as documented
        view[1].update_(shared_td.NonTensorData("B"))


def test_a_write_into_a_stack_of_lazy_stacks_non_tensor_entry_reaches_the_inner_members():
    inner = [_lazy(shared_td, ["a", "b"]), _lazy(shared_td, ["c", "d"])]
    outer = shared_td.lazy_stack(inner)
    outer.get("info")[1, 0] = "C"
    assert [m["info"] for m in inner[1].tensordicts] == ["C", "d"]
    assert [m["info"] for m in inner[0].tensordicts] == ["a", "b"]


def test_a_pickled_or_cloned_non_tensor_entry_of_a_lazy_stack_is_a_copy():
    lazy = _lazy(shared_td, ["a", "b"]).share_memory_()
    for copy in (pickle.loads(pickle.dumps(lazy.get("info"))), lazy.get("info").clone()):
        copy[0] = "Z"
        assert [m["info"] for m in lazy.tensordicts] == ["a", "b"] and copy.tolist() == ["Z", "b"]
