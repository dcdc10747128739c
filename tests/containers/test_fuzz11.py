"""What fuzz round 11 (differential against tensordict 0.15.3) found: a row write adding
keys that are no fields into a tensorclass below a lazy stack, pad_sequence of samples
holding a nested lazy stack, and torch's expand error from a lazy stack's set_at_."""
from __future__ import annotations

from typing import Any

import pytest
import torch

from shared_td import LazyStackedTensorDict, TensorDict, pad_sequence, tensorclass
from shared_td.errors import BatchSizeMismatchError


@tensorclass
class _TCLazyRow:
    obs: torch.Tensor
    info: Any = None


def _tree():
    def member():
        return TensorDict({"x": _TCLazyRow(obs=torch.zeros(2), info="u", batch_size=[2])}, [])
    return TensorDict({"nn": LazyStackedTensorDict(member(), member(), stack_dim=0)}, [2])


@tensorclass
class _TCLazyRowWider:
    obs: torch.Tensor
    info: Any = None
    a: torch.Tensor = None


@pytest.mark.parametrize("index", [Ellipsis, 0, slice(0, 1)])
def test_row_write_below_lazy_stack_refuses_a_tensorclass_of_more_fields(index):
    # (a tensorclass source with a field the member's class lacks added it as a key,
    # as a dict source did: the member's clone then read as a TensorDict; tensordict
    # 0.15.3 refuses the write)
    td = _tree()
    wider = _TCLazyRowWider(obs=torch.ones(2, 2), a=torch.ones(2, 2), batch_size=[2, 2])
    val = TensorDict({"nn": TensorDict({"x": wider}, [2])}, [2])
    with pytest.raises(ValueError, match=r"Keys \['a'\] are not fields of _TCLazyRow"):
        td[index] = val[index]
    member = td["nn"].tensordicts[0]
    assert sorted(member["x"].keys()) == ["info", "obs"] and type(member.clone()["x"]) is _TCLazyRow
    assert member["x"].obs.tolist() == [0.0, 0.0]


@pytest.mark.parametrize("index", [Ellipsis, 0, slice(0, 1)])
def test_row_write_below_lazy_stack_refuses_keys_that_are_no_field(index):
    # (they were added into each member's tensorclass: tensordict adds them, then fails to read it)
    td = _tree()
    val = TensorDict({"nn": TensorDict({"x": TensorDict({"obs": torch.ones(2, 2), "a": torch.ones(2, 2)},
                                                        [2, 2])}, [2])}, [2])
    with pytest.raises(ValueError, match=r"Keys \['a'\] are not fields of _TCLazyRow"):
        td[index] = val[index]
    for member in td["nn"].tensordicts:  # nothing written, the class kept
        assert type(member["x"]) is _TCLazyRow and sorted(member["x"].keys()) == ["info", "obs"]
        assert not member["x"].obs.any()


def test_row_write_below_lazy_stack_of_the_fields_still_writes():
    td = _tree()
    td[0] = TensorDict({"nn": TensorDict({"x": TensorDict({"obs": torch.ones(2)}, [2])}, [])}, [])
    assert td["nn"].tensordicts[0]["x"].obs.tolist() == [1.0, 1.0]
    assert type(td["nn"].tensordicts[0]["x"]) is _TCLazyRow


def _sample(n):
    inner = LazyStackedTensorDict(*[TensorDict({"a": torch.arange(n * 1.0)}, []) for _ in range(2)], stack_dim=0)
    return TensorDict({"k0": inner, "b": torch.zeros(2, n)}, [2])


def test_pad_sequence_feature_dim_densifies_a_nested_lazy_stack():
    out = pad_sequence([_sample(2), _sample(3)], pad_dim=-1)
    assert type(out["k0"]) is TensorDict  # as tensordict 0.15.3 gives it (was a lazy stack)
    assert out["k0", "a"].shape == (2, 2, 3)
    assert out["k0", "a"][0, 0].tolist() == [0.0, 1.0, 0.0]
    assert out["b"].shape == (2, 2, 3)


def _stack():
    return LazyStackedTensorDict(*[TensorDict({"k1": torch.zeros(2, 1, dtype=torch.bool)}, [])
                                   for _ in range(2)], stack_dim=0)


def test_lazy_update_at_of_a_value_that_does_not_fit_is_a_batch_size_mismatch():
    ls = _stack()
    with pytest.raises(BatchSizeMismatchError, match="Cannot write a value of shape \\[2, 1\\] into entry 'k1'"):
        ls.update_at_(ls[0].clone(), (0, 0))  # as the dense update_at_ (was torch's expand RuntimeError)
    assert not ls.get("k1").any()


def test_lazy_set_at_of_a_value_that_does_not_fit_is_a_batch_size_mismatch():
    ls = _stack()
    with pytest.raises(BatchSizeMismatchError):
        ls.set_at_("k1", torch.ones(3, 1, dtype=torch.bool), 0)
    ls.set_at_("k1", torch.ones(2, 1, dtype=torch.bool), 1)  # a fitting one is still written
    assert ls.get("k1")[1].all() and not ls.get("k1")[0].any()
