"""What fuzz round 10 (differential against tensordict 0.15.3) found: a row write into a
tensorclass of keys that are no fields, a lazy stack's state dict with a 0-sized batch and
non-tensor entries, update_at_ of a key one member holds, pad_sequence of lazy samples."""
from __future__ import annotations

import pytest
import torch

from shared_td import NonTensorData, TensorClass, TensorDict, lazy_stack, pad_sequence


@pytest.mark.parametrize("n0", [0, 1])
@pytest.mark.parametrize("stack_dim", [0, 2])
def test_lazy_state_dict_round_trip_keeps_nontensor(n0, stack_dim):
    members = [TensorDict({"k0": torch.zeros(n0, 1), "k1": NonTensorData(3, batch_size=[n0, 1])}, [n0, 1])
               for _ in range(2)]
    ls = lazy_stack(members, stack_dim)
    dest = ls.clone()
    dest.load_state_dict(ls.state_dict())  # a 0-sized batch raised ValueError
    for m in dest.tensordicts:
        assert isinstance(m.get("k1"), NonTensorData) and m.get("k1").data == 3



def test_pad_sequence_of_lazy_samples_along_feature_dim_is_dense():
    tds = [lazy_stack([TensorDict({"x": torch.arange(n).float()}, [])], 0) for n in (2, 3)]
    out = pad_sequence(tds, pad_dim=1)
    assert type(out) is TensorDict  # as tensordict 0.15.3 (was a lazy stack of lazy stacks)
    assert out.batch_size == torch.Size([2, 1])
    assert out["x"].tolist() == [[[0.0, 1.0, 0.0]], [[0.0, 1.0, 2.0]]]
    assert type(tds[0]).__name__ == "LazyStackedTensorDict"  # inputs left as they are


class Step(TensorClass):
    obs: torch.Tensor
    info: str = None


def _tc():
    return Step(obs=torch.ones(2, 3), info="w", batch_size=[2, 3])


def test_tc_row_write_of_non_field_key_refused():
    tc = _tc()
    with pytest.raises(ValueError, match=r"\['a'\] are not fields of Step"):
        tc[0] = TensorDict({"a": torch.full((3,), 7.0)}, [3])
    assert sorted(tc._tensordict.keys()) == ["info", "obs"]  # nothing written


def test_nested_tc_row_write_of_non_field_key_refused_and_type_kept():
    td = TensorDict({"k": torch.zeros(2), "newn": _tc()}, [2])
    val = TensorDict({"k": torch.ones(()), "newn": TensorDict({"a": torch.full((3,), 7.0)}, [3])}, [])
    with pytest.raises(ValueError, match="'newn'"):
        td[0] = val
    assert td["k"].tolist() == [0.0, 0.0]  # nothing written
    assert type(td.clone()["newn"]) is Step  # was silently a TensorDict after the write
    assert type(td[:1]["newn"]) is Step


def test_tc_row_write_of_fields_still_allowed():
    td = TensorDict({"newn": _tc()}, [2])
    td[0] = TensorDict({"newn": TensorDict({"obs": torch.full((3,), 7.0)}, [3])}, [])
    assert td["newn"].obs[0].tolist() == [7.0] * 3 and type(td.clone()["newn"]) is Step


def _stack(dim=0):
    a = TensorDict({"a": torch.zeros(2), "x": torch.zeros(2)}, [2])
    b = TensorDict({"a": torch.zeros(2)}, [2])
    return lazy_stack([a, b], dim)


@pytest.mark.parametrize("idx", [0, (0,)])
def test_update_at_row_of_member_holding_extra_key(idx):
    ls = _stack()
    src = TensorDict({"a": torch.ones(2), "x": torch.full((2,), 5.0)}, [2])
    ls.update_at_(src, idx)  # as ls[0].update_(src) and tensordict 0.15.3
    assert ls.tensordicts[0]["x"].tolist() == [5.0, 5.0]
    assert ls.tensordicts[0]["a"].tolist() == [1.0, 1.0]
    assert ls.tensordicts[1]["a"].tolist() == [0.0, 0.0]


def test_update_at_row_of_member_lacking_key_still_refused():
    ls = _stack()
    src = TensorDict({"a": torch.ones(2), "x": torch.full((2,), 5.0)}, [2])
    with pytest.raises(KeyError, match="'x'"):
        ls.update_at_(src, 1)
    assert ls.tensordicts[1]["a"].tolist() == [0.0, 0.0]


def test_update_at_across_members_refuses_key_of_one():
    ls = _stack(1)  # batch [2, 2], stack dim 1: row 0 spans both members
    with pytest.raises(KeyError, match="'x'"):
        ls.update_at_(TensorDict({"a": torch.ones(2), "x": torch.ones(2)}, [2]), 0)
