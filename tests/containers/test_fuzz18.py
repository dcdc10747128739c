"""fuzz18: consolidate() of a lazy stack whose members were given as tensorclasses keeps
their class (as tensordict 0.15.3 does), also through pickle, clone and a save; rename_key_
to a key that is no field of a tensorclass (or of a member given as one) is refused as set is,
and so is a load into a tensorclass of a save holding keys that are no fields."""
import pickle
from typing import Any

import pytest
import torch

import shared_td
from shared_td import LazyStackedTensorDict, TensorDict, lazy_stack, tensorclass


@tensorclass
class TC18:
    obs: torch.Tensor
    info: Any = None


def _stack():
    return LazyStackedTensorDict(TC18(obs=torch.zeros(2), info="u", batch_size=[2]),
                                 TC18(obs=torch.ones(2), info="v", batch_size=[2]), stack_dim=0)


def test_consolidate_of_a_tensorclass_member_stack_keeps_the_class(tmp_path):
    c = _stack().consolidate()
    assert c.is_consolidated()
    assert [type(m) for m in c.unbind(0)] == [TC18, TC18]
    assert [m.info for m in c.unbind(0)] == ["u", "v"]
    for x in (pickle.loads(pickle.dumps(c)), c.clone()):
        assert [type(m) for m in x.unbind(0)] == [TC18, TC18]
    c.memmap(tmp_path / "s")
    loaded = shared_td.load_memmap(tmp_path / "s")
    assert [type(m) for m in loaded.unbind(0)] == [TC18, TC18]


def test_consolidate_of_a_plain_member_stack_keeps_tensordicts():
    ls = shared_td.lazy_stack([shared_td.TensorDict(obs=torch.zeros(2), batch_size=[2]),
                               shared_td.TensorDict(obs=torch.ones(2), batch_size=[2])], dim=0)
    c = ls.consolidate()
    assert [type(m).__name__ for m in c.unbind(0)] == ["TensorDict", "TensorDict"]


@pytest.mark.parametrize("make", ["tc", "lazy_stack", "constructor", "nested"])
def test_rename_key_to_a_key_that_is_no_field_is_refused(make, tmp_path):
    def tc(i):
        return TC18(obs=torch.full((2,), float(i)), info="u", batch_size=[2])
    if make == "tc":
        x = tc(0)
    elif make == "lazy_stack":
        x = lazy_stack([tc(0), tc(1)], 0)
    elif make == "constructor":
        x = LazyStackedTensorDict(tc(0), tc(1), stack_dim=0)
    else:
        x = TensorDict({"m": LazyStackedTensorDict(tc(0), tc(1), stack_dim=0)}, [2])
    old, new = (("m", "obs"), ("m", "renamed")) if make == "nested" else ("obs", "renamed")
    with pytest.raises(AttributeError, match="no such field"):
        x.rename_key_(old, new)
    assert x.get(old).tolist() == [[0.0, 0.0], [1.0, 1.0]] if make != "tc" else x.obs.tolist() == [0.0, 0.0]
    # a field renamed to another field is still renamed (a field renamed reads None after)
    x.rename_key_(old, ("m", "info") if make == "nested" else "info")
    x.memmap(tmp_path / "s")
    shared_td.load_memmap(tmp_path / "s")


def test_rename_key_in_a_plain_lazy_stack_takes_any_key():
    ls = lazy_stack([TensorDict(obs=torch.zeros(2), batch_size=[2]), TensorDict(obs=torch.ones(2), batch_size=[2])], 0)
    ls.rename_key_("obs", "renamed")
    assert list(ls.keys()) == ["renamed"]


@pytest.mark.parametrize("how", ["out", "load_memmap_"])
def test_a_load_into_a_tensorclass_of_a_save_with_keys_that_are_no_fields_is_refused(tmp_path, how):
    shared_td.TensorDict(a=torch.zeros(2), batch_size=[2]).memmap(tmp_path / "other")
    target = TC18(obs=torch.ones(2), info="kept", batch_size=[2])
    with pytest.raises(ValueError, match=r"holds the keys \['a'\], which are no fields of TC18; nothing changed"):
        if how == "out":
            shared_td.TensorDict.load_memmap(tmp_path / "other", out=target)
        else:
            target.load_memmap_(tmp_path / "other")
    assert target.obs.tolist() == [1.0, 1.0] and target.info == "kept" and "a" not in target._tensordict.keys()
    shared_td.TensorDict(obs=torch.full((2,), 3.0), batch_size=[2]).memmap(tmp_path / "fields")
    assert shared_td.TensorDict.load_memmap(tmp_path / "fields", out=target).obs.tolist() == [3.0, 3.0]
