"""review53: load_memmap(out=tc) through shared_td.load_memmap and TC.load_memmap refuses a save
holding keys that are no fields of the tensorclass (e8ceecf refused it for TensorDict.load_memmap only)."""
from __future__ import annotations

import pytest
import torch

import shared_td
from shared_td import TensorDict, tensorclass


@tensorclass
class _Obs:
    obs: torch.Tensor


@pytest.mark.parametrize("how", ["function", "class"])
def test_load_memmap_out_tensorclass_refuses_keys_that_are_no_fields(tmp_path, how):
    TensorDict(obs=torch.ones(2), other=torch.ones(2), batch_size=[2]).memmap(tmp_path / "s")
    target = _Obs(obs=torch.zeros(2), batch_size=[2])
    load = shared_td.load_memmap if how == "function" else _Obs.load_memmap
    with pytest.raises(ValueError, match=r"\['other'\], which are no fields of _Obs"):
        load(tmp_path / "s", out=target)
    assert target.obs.tolist() == [0.0, 0.0] and set(target._tensordict.keys()) == {"obs"}
    TensorDict(obs=torch.full((2,), 3.0), batch_size=[2]).memmap(tmp_path / "f")
    assert load(tmp_path / "f", out=target) is target and target.obs.tolist() == [3.0, 3.0]
