"""Session-17 audit: non-tensor writes that went around the checks.

* ``set_at_`` of a non-tensor entry is checked as ``td[idx] = ...`` checks it: a
  memory-mapped NonTensorData (one value for the batch) refuses per-element values
  (before, it became a NonTensorStack in memory that its files never saw, and
  ``is_memmap()`` still said True); a value a memory-mapped or shared entry cannot store
  is a TypeError naming the key, with nothing written.
* A value that cannot be pickled where it must be (``memmap_``, ``save``, ``set_``,
  ``set(..., inplace=True)`` into a shared or memory-mapped entry) is one error: a
  TypeError naming the full key, pickle's own error chained as its ``__cause__``
  (before: pickle's AttributeError or PicklingError for a lambda, without the key for a
  single-entry write).
* ``set_(key, tensordict)`` with a key the nested tensordict lacks names ``set_`` (it
  named ``update_``) and the full key.
"""
from __future__ import annotations

import pickle
import threading

import pytest
import torch

import shared_td as st
from shared_td import NonTensorData, NonTensorStack, TensorDict, tensorclass


def _local_lambda():
    return lambda: 1


module_lambda = lambda: 1  # noqa: E731  (pickle raises PicklingError for it, not AttributeError)

UNPICKLABLE = {
    "local lambda": _local_lambda,
    "module lambda": lambda: module_lambda,
    "lock": threading.Lock,
}


@tensorclass
class _Text:
    a: torch.Tensor
    text: str


def _memmapped(tmp_path, name="td"):
    return TensorDict({"a": torch.zeros(2), "text": NonTensorData("x")}, batch_size=[2]).memmap_(tmp_path / name)


# ------------------------------------------------------------- set_at_ (the brief's item 1)
@pytest.mark.parametrize("value", ["y", "lock"])
def test_set_at_per_element_into_a_memory_mapped_non_tensor_data_is_refused(tmp_path, value):
    value = threading.Lock() if value == "lock" else value
    td = _memmapped(tmp_path)
    with pytest.raises(RuntimeError, match="per-element values into the non-tensor entry 'text'"):
        td.set_at_("text", value, 0)
    # nothing changed: still the memory-mapped NonTensorData of the files
    assert type(td.get("text")) is NonTensorData and td["text"] == "x" and td.is_memmap()
    assert st.load_memmap(tmp_path / "td")["text"] == "x"
    with pytest.raises(RuntimeError, match="per-element"):  # and td[0] = ... still refuses it
        td[0] = TensorDict({"a": torch.ones(()), "text": NonTensorData("z")}, batch_size=[])
    assert td["a"].tolist() == [0.0, 0.0]


def test_set_at_into_memory_mapped_non_tensor_data_side_by_side_with_tensordict(tmp_path):
    tensordict = pytest.importorskip("tensordict")
    theirs = tensordict.TensorDict({"text": tensordict.NonTensorData("x")}, batch_size=[2]).memmap_(tmp_path / "t")
    ours = TensorDict({"text": NonTensorData("x")}, batch_size=[2]).memmap_(tmp_path / "o")
    for td in (theirs, ours):
        with pytest.raises(RuntimeError):
            td.set_at_("text", "y", 0)
        td.set_at_("text", "x", 0)  # the value it holds: fine in both, still one value
        assert td["text"] == "x"


def test_set_at_of_a_nested_key_and_of_a_tensorclass_field_is_refused_too(tmp_path):
    td = TensorDict({"n": TensorDict({"text": NonTensorData("x")}, [2])}, [2]).memmap_(tmp_path / "n")
    with pytest.raises(RuntimeError, match=r"\('n', 'text'\)"):
        td.set_at_(("n", "text"), "y", 0)
    assert type(td.get(("n", "text"))) is NonTensorData and st.load_memmap(tmp_path / "n")["n", "text"] == "x"
    tc = _Text(a=torch.zeros(2), text="x", batch_size=[2]).memmap_(tmp_path / "tc")
    with pytest.raises(RuntimeError, match="per-element"):
        tc.set_at_("text", "y", 0)
    assert tc.text == "x"


def test_set_at_in_a_lazy_stack_of_memory_mapped_members_is_refused(tmp_path):
    members = [_memmapped(tmp_path, f"m{i}") for i in range(2)]
    lazy = st.lazy_stack(members)
    with pytest.raises(RuntimeError, match="per-element"):
        lazy.set_at_("text", "y", (0, 1))
    assert [type(m.get("text")) for m in members] == [NonTensorData, NonTensorData]


def test_set_at_still_turns_a_non_tensor_data_in_memory_into_a_stack():
    td = TensorDict({"text": NonTensorData("x")}, batch_size=[2]).lock_()  # (as tensordict 0.15.3)
    td.set_at_("text", "y", 0)
    assert td["text"] == ["y", "x"]


def test_set_at_into_a_memory_mapped_stack_writes_its_file_and_names_an_unpicklable_value(tmp_path):
    td = TensorDict({"a": torch.zeros(2), "text": NonTensorStack("x", "z")}, batch_size=[2]).memmap_(tmp_path / "s")
    td.set_at_("text", "y", 0)
    assert td["text"] == ["y", "z"] and st.load_memmap(tmp_path / "s")["text"] == ["y", "z"]
    with pytest.raises(TypeError, match="Cannot write a lock into the non-tensor entry 'text'") as info:
        td.set_at_("text", threading.Lock(), 1)
    assert td["text"] == ["y", "z"] and st.load_memmap(tmp_path / "s")["text"] == ["y", "z"]
    assert info.value.__cause__ is not None


def test_set_at_into_a_shared_stack_names_an_unpicklable_value():
    td = TensorDict({"text": NonTensorStack("x", "z")}, batch_size=[2]).share_memory_()
    with pytest.raises(TypeError, match="non-tensor entry 'text'"):
        td.set_at_("text", _local_lambda(), 0)
    assert td["text"] == ["x", "z"]


# -------------------------------------------------- one rule for unpicklable values (item 2)
@pytest.mark.parametrize("kind", sorted(UNPICKLABLE))
@pytest.mark.parametrize("call", ["memmap_", "memmap", "save"])
def test_an_unpicklable_value_is_a_type_error_naming_the_full_key(tmp_path, kind, call):
    value = UNPICKLABLE[kind]()
    td = TensorDict({"a": torch.zeros(2), "nested": TensorDict(batch_size=[2])}, batch_size=[2])
    td["nested", "s"] = NonTensorData(value)
    with pytest.raises(TypeError, match=r"\('nested', 's'\)") as info:
        getattr(td, call)(tmp_path / "out")
    try:
        pickle.dumps(value)
    except Exception as error:
        assert type(info.value.__cause__) is type(error)  # pickle's own error, chained
    assert not td.is_locked and not td.is_memmap()


def test_an_unpicklable_value_side_by_side_with_tensordict(tmp_path):
    tensordict = pytest.importorskip("tensordict")
    theirs = tensordict.TensorDict({"s": tensordict.NonTensorData(_local_lambda())}, batch_size=[])
    with pytest.raises(Exception) as info:  # pickle's error as it is (AttributeError, here)
        theirs.memmap_(tmp_path / "t")
    ours = TensorDict({"s": NonTensorData(_local_lambda())}, batch_size=[])
    with pytest.raises(TypeError, match="'s'") as mine:
        ours.memmap_(tmp_path / "o")
    assert type(mine.value.__cause__) is type(info.value)


@pytest.mark.parametrize("kind", sorted(UNPICKLABLE))
@pytest.mark.parametrize("op", ["set_", "set(inplace=True)"])
@pytest.mark.parametrize("where", ["memmap", "shared"])
def test_an_unpicklable_value_written_in_place_is_a_type_error_naming_the_key(tmp_path, kind, op, where):
    value = UNPICKLABLE[kind]()
    td = TensorDict({"a": torch.zeros(2), "n": {"text": NonTensorData("x")}}, batch_size=[2])
    td = td.memmap_(tmp_path / "td") if where == "memmap" else td.share_memory_()
    with pytest.raises(TypeError, match=r"non-tensor entry \('n', 'text'\)") as info:
        if op == "set_":
            td.set_(("n", "text"), value)
        else:
            td.set(("n", "text"), value, inplace=True)
    assert info.value.__cause__ is not None
    assert td["n", "text"] == "x"
    if where == "memmap":
        assert st.load_memmap(tmp_path / "td")["n", "text"] == "x"


def test_an_unpicklable_value_written_in_place_into_a_stack_a_lazy_stack_or_a_tensorclass(tmp_path):
    td = TensorDict({"s": NonTensorStack("a", "b")}, batch_size=[2]).memmap_(tmp_path / "s")
    with pytest.raises(TypeError, match="non-tensor entry 's'"):
        td.set_("s", ["c", threading.Lock()])
    assert td["s"] == ["a", "b"] and st.load_memmap(tmp_path / "s")["s"] == ["a", "b"]
    members = [_memmapped(tmp_path, f"m{i}") for i in range(2)]
    lazy = st.lazy_stack(members)
    for write in (lambda: lazy.set_("text", _local_lambda()),
                  lambda: lazy.set("text", _local_lambda(), inplace=True)):
        with pytest.raises(TypeError, match="non-tensor entry 'text'"):
            write()
    assert [member["text"] for member in members] == ["x", "x"]
    tc = _Text(a=torch.zeros(2), text="x", batch_size=[2]).memmap_(tmp_path / "tc")
    with pytest.raises(TypeError, match="non-tensor entry 'text'"):
        tc.set_("text", _local_lambda())
    assert tc.text == "x"


def test_a_picklable_value_is_still_written_in_place(tmp_path):
    td = _memmapped(tmp_path)
    td.set_("text", "y")
    td.set("text", "z", inplace=True)
    assert td["text"] == "z" and st.load_memmap(tmp_path / "td")["text"] == "z"


# ------------------------------------------------------------------- set_'s KeyError (item 3)
def test_set_with_a_key_the_nested_tensordict_lacks_names_set_and_the_full_key():
    td = TensorDict(next=TensorDict(a=torch.zeros(2), batch_size=[2]), batch_size=[2])
    for value in (TensorDict(a=torch.ones(2), b=torch.ones(2), batch_size=[2]),
                  {"a": torch.ones(2), "b": torch.ones(2)}):
        with pytest.raises(KeyError, match=r"set_\(\) writes in place, but key \('next', 'b'\)"):
            td.set_("next", value)
        assert td["next", "a"].tolist() == [0.0, 0.0] and "b" not in td["next"].keys()
    with pytest.raises(KeyError, match=r"update_\(\)"):  # update_ still names itself
        td["next"].update_({"a": torch.ones(2), "b": torch.ones(2)})
