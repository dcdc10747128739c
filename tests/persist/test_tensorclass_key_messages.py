"""A memmap error about a tensorclass's field names the key the user wrote (``('tc', 'obs')``),
not the directory that holds the fields (``('tc', '_tensordict', 'obs')``; fuzzer finding)."""
from __future__ import annotations

import pytest
import torch

import shared_td


@shared_td.tensorclass
class Obs:
    obs: torch.Tensor


def test_a_field_already_mapped_is_named_by_its_key(tmp_path):
    td = shared_td.TensorDict({"tc": Obs(obs=torch.zeros(1), batch_size=[1]), "x": torch.zeros(1)}, [1])
    td.memmap_(prefix=tmp_path / "first")
    with pytest.raises(RuntimeError, match="already has a file associated") as raised:
        td.memmap(prefix=tmp_path / "second")
    assert "key ('tc', 'obs')" in str(raised.value)


def test_a_root_tensorclass_field_is_named_by_its_key(tmp_path):
    tc = Obs(obs=torch.zeros(1), batch_size=[1])
    tc.memmap_(prefix=tmp_path / "first")
    with pytest.raises(RuntimeError, match="already has a file associated") as raised:
        tc.memmap(prefix=tmp_path / "second")
    assert "key ('obs',)" in str(raised.value)
