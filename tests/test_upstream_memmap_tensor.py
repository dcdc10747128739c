"""MemoryMappedTensor beside tensordict 0.15.3: what a run of tensordict's own
test_memmap.py against shared_td found different (the rest matched, or differs on
purpose: see the README's list of differences)."""
from __future__ import annotations

import pickle

import pytest
import torch

import shared_td
from tests.reference import LIBS

@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("with_file", [False, True], ids=["anonymous", "file"])
def test_reduce_called_directly_rebuilds_a_view_of_the_same_memory(lib, with_file, tmp_path):
    # object.__reduce__ fails for a tensor subclass; tensordict's answers as pickle does
    filename = tmp_path / "rows.memmap" if with_file else None
    tensor = lib.MemoryMappedTensor.from_tensor(torch.arange(6.0).view(2, 3), filename=filename)
    rebuild, args = tensor[1].__reduce__()
    row = rebuild(*args)
    assert isinstance(row, lib.MemoryMappedTensor)
    assert row.tolist() == [3.0, 4.0, 5.0]
    row.fill_(-1.0)  # the same memory, as what a pickle of it gives
    assert tensor.tolist() == [[0.0, 1.0, 2.0], [-1.0, -1.0, -1.0]]


def test_reduce_agrees_with_what_pickle_sends(tmp_path):
    tensor = shared_td.MemoryMappedTensor.from_tensor(torch.arange(4), filename=tmp_path / "t.memmap")
    assert tensor.__reduce__() == tensor.__reduce_ex__(2)
    assert pickle.loads(pickle.dumps(tensor[2:])).tolist() == [2, 3]
