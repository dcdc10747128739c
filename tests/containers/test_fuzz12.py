"""fuzz round 12: writes into a lazy stack whose members were given as tensorclasses."""
from __future__ import annotations

from typing import Any

import pytest
import torch

from shared_td import LazyStackedTensorDict, TensorDict, tensorclass


@tensorclass
class _TCMember:
    obs: torch.Tensor
    info: Any = None


def _stack():
    return LazyStackedTensorDict(*[_TCMember(obs=torch.zeros(2), info="u", batch_size=[2]) for _ in range(2)],
                                 stack_dim=0)


@pytest.mark.parametrize("index", [Ellipsis, 0, slice(0, 1)])
def test_row_write_into_tensorclass_members_refuses_keys_that_are_no_field(index):
    # (they were added into the members: `lazy[0]` then read as a _TCMember holding 'a', whose
    # clone is a TensorDict and whose save tensordict 0.15.3 cannot load)
    td = TensorDict({"nn": _stack()}, [2])
    val = TensorDict({"nn": TensorDict({"obs": torch.ones(2, 2), "a": torch.ones(2, 2)}, [2, 2])}, [2])
    with pytest.raises(ValueError, match=r"Keys \['a'\] are not fields of _TCMember at key 'nn'"):
        td[index] = val[index]
    for i in range(2):
        member = td["nn"][i]
        assert type(member) is _TCMember and sorted(member.keys()) == ["info", "obs"]
        assert not member.obs.any()  # nothing written
        assert type(member.clone()) is _TCMember


def test_row_write_into_tensorclass_members_directly_refuses_keys_that_are_no_field():
    ls = _stack()
    with pytest.raises(ValueError, match=r"Keys \['a'\] are not fields of _TCMember"):
        ls[0] = TensorDict({"obs": torch.ones(2), "a": torch.ones(2)}, [2])
    assert sorted(ls[0].keys()) == ["info", "obs"] and not ls.get("obs").any()


def test_row_write_into_tensorclass_members_of_fields_or_the_class_still_writes():
    ls = _stack()
    ls[0] = TensorDict({"obs": torch.ones(2)}, [2])
    ls[1] = _TCMember(obs=torch.full((2,), 2.0), info="u", batch_size=[2])
    assert ls.get("obs").tolist() == [[1.0, 1.0], [2.0, 2.0]]
    assert type(ls[0]) is _TCMember and type(ls[1]) is _TCMember


@pytest.mark.parametrize("index", [0, (1, 0)])
def test_update_at_into_tensorclass_members_with_a_missing_key_is_a_key_error(index):
    # (was AttributeError: '_TCMember' object has no attribute or field '_get_path')
    ls = _stack()
    src = TensorDict({"obs": torch.ones(2), "a": torch.ones(2)}, [2])
    if isinstance(index, tuple):
        src = src[0]
    with pytest.raises(KeyError, match="key 'a' does not exist"):
        ls.update_at_(src, index)
    assert not ls.get("obs").any()


def test_update_at_into_tensorclass_members_of_fields_still_writes():
    ls = _stack()
    ls.update_at_(TensorDict({"obs": torch.ones(2)}, [2]), 1)
    assert ls.get("obs").tolist() == [[0.0, 0.0], [1.0, 1.0]]


@pytest.mark.parametrize("args", [([0, 0],), (0, 0)])
def test_permute_of_more_dims_than_batch_dims_says_so(args):
    # (was "permute needs each of the first 2 of the 1 batch dims (the others stay) once, got [[0, 0]]")
    td = TensorDict({"a": torch.zeros(2, 3)}, [2])
    with pytest.raises(ValueError, match=r"permute got 2 dims \[\d, \d\] for a tensordict of 1 batch dims"):
        td.permute(*args)


def test_permute_message_names_the_dims_given_as_a_list():
    td = TensorDict({"a": torch.zeros(2, 3, 4)}, [2, 3])
    with pytest.raises(ValueError, match=r"got \[0, 0\]\.$"):
        td.permute([0, 0])


@pytest.mark.parametrize("write, error", [
    (lambda ls: ls.set("a", torch.ones(2, 2)), AttributeError),
    (lambda ls: ls.__setitem__("a", torch.ones(2, 2)), AttributeError),
    (lambda ls: ls.set_non_tensor("a", 1), AttributeError),
    (lambda ls: ls.update({"a": torch.ones(2, 2)}), ValueError),
    (lambda ls: ls.update(TensorDict({"a": torch.ones(2, 2)}, [2, 2])), ValueError),
], ids=["set", "setitem", "set_non_tensor", "update_dict", "update_td"])
def test_a_new_key_that_is_no_field_of_tensorclass_members_is_refused(write, error):
    # (it was added into every member, as in tensordict 0.15.3: their copies then read as
    # TensorDicts and tensordict could not load their save; each member's own set() and
    # update() refuse it, and so does a stack made by lazy_stack)
    ls = _stack()
    with pytest.raises(error, match="'a'|\\['a'\\]"):
        write(ls)
    assert sorted(ls[0].keys()) == ["info", "obs"] and type(ls[0].clone()) is _TCMember
    ls.update({"obs": torch.ones(2, 2)})  # a field is written
    ls.set("obs", torch.full((2, 2), 2.0))
    assert ls[1].obs.tolist() == [2.0, 2.0]
