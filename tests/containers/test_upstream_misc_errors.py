"""Error types of key lookups, self-nesting and loading a file that is no save, side by
side with tensordict 0.15.3 (differences found by running tensordict's own error tests
against shared_td): code written for tensordict catches what it caught there."""
from __future__ import annotations

import pytest
import torch

import shared_td
from tests.reference import LIBS

def with_leaves(lib):
    return lib.TensorDict(obs=torch.zeros(2), task="walk", nested={"x": torch.ones(2)}, batch_size=[2])


# ------------------------------------------------------------ a key through a leaf
def lazy_with_leaves(lib):
    return lib.lazy_stack([with_leaves(lib), with_leaves(lib)])


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("make", [with_leaves, lazy_with_leaves], ids=["td", "lazy"])
@pytest.mark.parametrize("read", ["getitem", "get", "pop", "del_"])
def test_key_through_a_tensor_is_a_value_error(lib, make, read):
    # tensordict raises ValueError when a nested key runs through a tensor; shared_td's
    # KeyThroughLeafError is that ValueError and also a KeyError
    td = make(lib)
    call = {
        "getitem": lambda: td["obs", "deeper"],
        "get": lambda: td.get(("obs", "deeper")),
        "pop": lambda: td.pop(("obs", "deeper")),
        "del_": lambda: td.del_(("obs", "deeper")),
    }[read]
    with pytest.raises(ValueError, match="'obs' is a Tensor, not a tensordict, so it has no entry 'deeper'"):
        call()
    assert set(td.keys()) == {"obs", "task", "nested"}


@pytest.mark.parametrize("lib", LIBS)
def test_key_through_a_leaf_with_a_default_returns_it(lib):
    td = with_leaves(lib)
    assert td.get(("obs", "deeper"), None) is None
    assert ("obs", "deeper") not in td
    assert td.get(("nested", "x", "y"), "fallback") == "fallback"


def test_key_through_a_leaf_is_also_a_key_error_naming_the_path():
    td = with_leaves(shared_td)
    with pytest.raises(KeyError) as caught:
        td["nested", "x", "y", "z"]
    assert isinstance(caught.value, shared_td.KeyThroughLeafError)
    assert str(caught.value) == (
        "Key ('nested', 'x', 'y', 'z') not found in TensorDict: 'x' is a Tensor, not a "
        "tensordict, so it has no entry ('y', 'z'). Read ('nested', 'x') itself, or set another key."
    )
    with pytest.raises(shared_td.KeyThroughLeafError, match="'task' is a NonTensorData"):
        td["task", "deeper"]


def test_key_through_a_ragged_leaf_of_a_lazy_stack():
    # the leaf is not stacked to say so (tensordict 0.15.3 raises its "Failed to stack"
    # RuntimeError here, even for get() with a default)
    members = [shared_td.TensorDict(obs=torch.zeros(2, k + 1), batch_size=[2]) for k in range(2)]
    stack = shared_td.lazy_stack(members)
    with pytest.raises(shared_td.KeyThroughLeafError, match="'obs' is a tensor, not a tensordict"):
        stack["obs", "deeper"]
    assert stack.get(("obs", "deeper"), None) is None


def test_a_key_missing_elsewhere_stays_a_plain_key_error():
    td = with_leaves(shared_td)
    with pytest.raises(KeyError) as caught:
        td["nested", "missing", "y"]
    assert not isinstance(caught.value, ValueError)


# ------------------------------------------------------------ a tensordict inside itself
def lazy(lib):
    td = lib.TensorDict({"a": torch.zeros(3, 2)}, [3, 2])
    return lib.LazyStackedTensorDict(*td.unbind(0), stack_dim=0)


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("make", [with_leaves, lazy], ids=["td", "lazy"])
@pytest.mark.parametrize("how", ["setitem", "set", "nested set", "update"])
def test_setting_a_tensordict_inside_itself_is_refused(lib, make, how):
    # a tensordict holding itself is a cycle: repr, clone and memmap_ would never end
    td = make(lib)
    keys = set(td.keys())
    call = {
        "setitem": lambda: td.__setitem__("self", td),
        "set": lambda: td.set("self", td),
        "nested set": lambda: td.set(("new", "self"), td),
        "update": lambda: td.update({"self": td}),
    }[how]
    with pytest.raises(ValueError, match="Cannot set a tensordict inside itself"):
        call()
    assert set(td.keys()) == keys  # nothing added, not even the missing parent "new"


def test_setting_a_nested_tensordict_inside_itself_names_the_key():
    td = with_leaves(shared_td)
    with pytest.raises(ValueError, match=r"\(key 'loop'\).*Set a copy \(td.clone\(\)\)"):
        td["nested"].set("loop", td["nested"])
    assert set(td["nested"].keys()) == {"x"}
    td["nested"].set("copy", td["nested"].clone())  # a copy is fine
    assert (td["nested", "copy", "x"] == 1).all()


# ------------------------------------------------------------ loading a file that is no save
@pytest.mark.parametrize("lib", LIBS)
def test_loading_a_plain_file_is_a_value_error(lib, tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("not a tensordict")
    with pytest.raises(ValueError):
        lib.TensorDict.load_memmap(path)


@pytest.mark.parametrize("load", [shared_td.load_memmap, shared_td.TensorDict.load_memmap, shared_td.load])
def test_loading_a_plain_file_is_also_not_a_directory(load, tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("not a tensordict")
    with pytest.raises(NotADirectoryError, match="is a file, not a saved tensordict directory") as caught:
        load(path)
    assert isinstance(caught.value, shared_td.NotASaveError)
    assert str(path) in str(caught.value)
