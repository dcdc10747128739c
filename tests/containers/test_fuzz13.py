"""fuzz round 13: torch.stack / torch.cat of lazy stacks whose members were given as tensorclasses."""
from __future__ import annotations

from typing import Any

import pytest
import torch

from shared_td import LazyStackedTensorDict, TensorDict, tensorclass


@tensorclass
class _TC13:
    obs: torch.Tensor
    info: Any = None


def _stack():
    return LazyStackedTensorDict(*[_TC13(obs=torch.full((2,), float(i)), batch_size=[2]) for i in range(2)],
                                 stack_dim=0)


def _join(fn, dim):
    ls = _stack()
    return torch.stack([ls, ls.clone()], dim) if fn == "stack" else torch.cat([ls, ls.clone()], dim)


@pytest.mark.parametrize("fn,dim", [("stack", 0), ("stack", 1), ("cat", 0), ("cat", 1)])
def test_stack_and_cat_of_tensorclass_member_stacks_keep_the_class(fn, dim, tmp_path):
    # (the members read as TensorDicts: a key that is no field was then accepted, and the save
    # held TensorDicts, where tensordict 0.15.3 keeps the members' tensorclass)
    out = _join(fn, dim)
    assert isinstance(out, LazyStackedTensorDict)
    rows = out.unbind(out.stack_dim)
    assert all(type(row) is _TC13 for row in rows)
    assert type(out.clone().unbind(out.stack_dim)[0]) is _TC13
    out.memmap(tmp_path / "s")
    back = TensorDict.load_memmap(tmp_path / "s")
    assert [type(row) for row in back.unbind(back.stack_dim)] == [_TC13] * len(rows)
    with pytest.raises(AttributeError, match="no such field"):
        out.set("a", torch.ones(out.batch_size))


def test_stack_of_a_tensorclass_member_stack_and_a_plain_one_keeps_tensordicts():
    # (a control: a member given as a tensordict in one input stays a TensorDict)
    ls = _stack()
    plain = LazyStackedTensorDict(*[TensorDict({"obs": torch.zeros(2)}, [2]) for _ in range(2)], stack_dim=0)
    out = torch.stack([ls, plain], 0)
    assert [type(row).__name__ for row in out.unbind(out.stack_dim)] == ["TensorDict", "TensorDict"]
    out.set("a", torch.ones(out.batch_size))
    assert (out.get("obs")[0] == ls.get("obs")).all()


@pytest.mark.parametrize("index", [slice(2, None), slice(0, 0), torch.tensor([], dtype=torch.long),
                                   torch.tensor([False, False])], ids=["past-end", "empty-slice", "empty-index", "false-mask"])
def test_an_index_that_selects_no_tensorclass_member_gives_the_class(index):
    # (an empty TensorDict: tensordict 0.15.3 gives the class, as for an index that selects some)
    out = _stack()[index]
    assert type(out) is _TC13
    assert list(out.batch_size) == [0, 2]
    assert out.obs.shape == (0, 2)
    with pytest.raises(AttributeError, match="no such field"):
        out.set("a", torch.ones(0, 2))


def test_an_index_that_selects_no_member_of_a_plain_stack_stays_a_tensordict():
    ls = LazyStackedTensorDict(*[TensorDict({"obs": torch.zeros(2)}, [2]) for _ in range(2)], stack_dim=0)
    assert type(ls[2:]) is TensorDict
