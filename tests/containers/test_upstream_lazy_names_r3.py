"""Lazy stacks and dim names, side by side with tensordict 0.15.3 (found by running
tensordict's test_lazy.py and test_nameddims.py against shared_td, third pass):
``to_tensordict(retain_none=...)`` of a lazy stack, ``member in lazy``, and
``all(dim)``/``any(dim)`` of a stack whose members name a dim differently."""
from __future__ import annotations

import pytest
import torch

import shared_td
from tests.reference import LIBS

def nested_stack(lib):
    row = lib.TensorDict({"obs": torch.ones(2, 3)}, [2])
    inner = lib.LazyStackedTensorDict.lazy_stack([row, row.clone()], 0)
    return lib.LazyStackedTensorDict.lazy_stack([inner, inner.clone(), inner.clone()], 0)


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("retain_none", [True, False])
def test_lazy_to_tensordict_takes_retain_none(lib, retain_none):
    lazy = nested_stack(lib)
    dense = lazy.to_tensordict(retain_none=retain_none)
    assert type(dense) is lib.TensorDict
    assert dense.batch_size == (3, 2, 2)
    assert (dense["obs"] == 1).all()
    index = (torch.tensor([0, 2]), None, slice(1, 2))
    assert lazy[index].batch_size == dense[index].batch_size == torch.zeros(3, 2, 2)[index].shape


@pytest.mark.parametrize("lib", LIBS)
def test_a_member_is_in_the_stack_by_identity(lib):
    member = lib.TensorDict({"a": lib.TensorDict({"b": torch.zeros(1, 2)}, [1, 2])}, [1])
    lazy = lib.LazyStackedTensorDict.lazy_stack([member, member.clone()])
    assert member in lazy
    assert lazy.tensordicts[1] in lazy
    assert member.clone() not in lazy  # equal values, another object
    assert lib.TensorDict({}, [1]) not in lazy
    assert "a" in lazy and ("a", "b") in lazy and "c" not in lazy


@pytest.mark.parametrize("lib", LIBS)
def test_reduce_a_stack_whose_members_name_a_dim_differently(lib):
    lazy = lib.LazyStackedTensorDict(
        lib.TensorDict({"v": torch.ones(3, 2)}, [3], names=["x"]),
        lib.TensorDict({"v": torch.zeros(3, 2)}, [3], names=["y"]),
        stack_dim=1,
    )
    with pytest.raises(ValueError, match="Not all dim names match"):
        lazy.names
    reduced = lazy.all(0)
    assert reduced.batch_size == (2,)
    assert reduced["v"].tolist() == [[True, True], [False, False]]
    assert reduced.names in ([None], None)  # (shared_td: None for no named dim)
    reduced = lazy.any(1)
    assert reduced.batch_size == (3,)
    assert reduced["v"].all()
    assert reduced.names in ([None], None)


def test_reduce_keeps_the_names_the_members_agree_on():
    # (tensordict 0.15.3 drops every name of a lazy all(dim)/any(dim): README)
    lazy = shared_td.LazyStackedTensorDict(
        shared_td.TensorDict({}, [3, 2, 4], names=["x", "p", "z"]),
        shared_td.TensorDict({}, [3, 2, 4], names=["x", "q", "z"]),
        stack_dim=1, stack_dim_name="s",
    )
    assert lazy.all(2).names == ["x", "s", "z"]  # (the dim named differently is gone)
    assert lazy.all(3).names == ["x", "s", None]
    assert lazy.any(0).names == ["s", None, "z"]


def hetero_stack(lib):
    return lib.LazyStackedTensorDict(
        lib.TensorDict({"shared": torch.zeros(2), "only0": torch.zeros(1)}, []),
        lib.TensorDict({"shared": torch.zeros(3), "only1": torch.zeros(2, 2)}, []),
    )


@pytest.mark.parametrize("lib", LIBS)
def test_update_in_place_of_a_heterogeneous_stack_member_by_member(lib):
    lazy = hetero_stack(lib)
    source = lazy.clone()
    for member in source.tensordicts:
        for key in list(member.keys()):
            member.set_(key, member.get(key) + 1)
    ptrs = [v.data_ptr() for m in lazy.tensordicts for v in m.values()]
    assert lazy.update_(source) is lazy
    assert [v.data_ptr() for m in lazy.tensordicts for v in m.values()] == ptrs
    assert all((v == 1).all() for m in lazy.tensordicts for v in m.values())
    # torch.cat(..., out=) of such a stack writes so too
    out = torch.cat([hetero_stack(lib)], 0, out=lazy)
    assert out is lazy
    assert all((v == 0).all() for m in lazy.tensordicts for v in m.values())


def test_update_in_place_of_a_key_a_member_lacks_raises_before_writing():
    # (as update_ of a TensorDict here; tensordict 0.15.3 silently skips such a key)
    lazy = hetero_stack(shared_td)
    source = lazy.clone()
    source.tensordicts[1]["only0"] = torch.ones(1)  # member 1 of lazy has no "only0"
    source.tensordicts[0]["shared"] += 1
    with pytest.raises(KeyError, match="only0"):
        lazy.update_(source)
    assert (lazy.tensordicts[0]["shared"] == 0).all()


@pytest.mark.parametrize("lib", LIBS)
def test_lazy_stack_compared_with_a_value_of_another_type(lib):
    lazy = lib.LazyStackedTensorDict(*[lib.TensorDict(a=torch.zeros(2), batch_size=[2])] * 2)
    assert (lazy == "z") is False and (lazy != "z") is True
    assert (lazy == None) is False  # noqa: E711
    assert (lazy == 0).all() and not (lazy != lazy.clone()).any()
