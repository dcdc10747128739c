"""Small container differences from tensordict 0.15.3 found in session 19, side by side
with it: ``entry_class`` of a key that is not there."""
from __future__ import annotations

import pytest
import torch

import shared_td
from tests.reference import LIBS

def _containers(lib):
    @lib.tensorclass
    class Step:
        x: torch.Tensor

    td = lib.TensorDict(a=torch.zeros(2), b=lib.TensorDict(c=torch.zeros(2), batch_size=[2]), batch_size=[2])
    return {"dense": td, "lazy": lib.LazyStackedTensorDict.lazy_stack([td, td.clone()]),
            "row": td[0], "slice": td[:1], "tensorclass": Step(x=torch.zeros(2), batch_size=[2])}


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("kind", ["dense", "lazy", "row", "slice", "tensorclass"])
@pytest.mark.parametrize("key", ["missing", ("b", "missing"), ("missing", "x")], ids=["flat", "nested", "parent"])
def test_entry_class_of_a_missing_key_is_nonetype(lib, kind, key):
    # before: shared_td raised KeyError (its get(key) does); tensordict's get(key)
    # returns None, so its entry_class gives NoneType
    assert _containers(lib)[kind].entry_class(key) is type(None)


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("kind", ["dense", "lazy", "row"])
def test_entry_class_of_a_key_through_a_leaf_still_raises(lib, kind):
    with pytest.raises(ValueError, match="'a' is a Tensor"):
        _containers(lib)[kind].entry_class(("a", "x"))


@pytest.mark.parametrize("lib", LIBS)
def test_entry_class_of_a_key_only_some_stack_members_hold(lib):
    first = lib.TensorDict(a=torch.zeros(2), batch_size=[2])
    second = lib.TensorDict(a=torch.zeros(2), c=torch.zeros(2, 3), batch_size=[2])
    lazy = lib.LazyStackedTensorDict.lazy_stack([first, second])
    # type(lazy.get("c")) in both libraries (the key is not in every member)
    assert lazy.entry_class("c") is type(None) and lazy.entry_class("a") is torch.Tensor


def test_entry_class_of_a_key_that_is_not_one_still_raises():
    with pytest.raises(TypeError):
        shared_td.TensorDict(a=torch.zeros(2), batch_size=[2]).entry_class(1)
