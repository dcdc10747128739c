"""A save nested deeper than PATH_MAX (4096 bytes of path): its writer and loader work
through opened directories, and so must every rewrite of it (an append, an atomic
rewrite), which took whole paths and failed with ENAMETOOLONG."""
import os

import pytest
import torch

import shared_td
from shared_td import TensorDict

LEVELS, KEY = 17, "d" * 250  # ~4300 bytes of path below the prefix


def _deep(rows: int, start: float = 0.0) -> TensorDict:
    td = TensorDict(leaf=torch.arange(start, start + rows), batch_size=[rows])
    for _ in range(LEVELS):
        td = TensorDict({KEY: td}, batch_size=[rows])
    return td


def _leaf(td) -> torch.Tensor:
    return td.get((KEY,) * LEVELS + ("leaf",))


def test_the_tree_is_deeper_than_path_max(tmp_path):
    assert len(str(tmp_path)) + LEVELS * (len(KEY) + 1) > os.pathconf("/", "PC_PATH_MAX")


def test_append_to_a_save_nested_past_path_max(tmp_path):
    prefix = str(tmp_path / "save")
    _deep(3).memmap_(prefix)
    shared_td.append_memmap(prefix, _deep(2, start=3.0))
    assert _leaf(shared_td.load_memmap(prefix)).tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]


def test_atomic_rewrite_of_a_save_nested_past_path_max(tmp_path):
    prefix = str(tmp_path / "save")
    _deep(3).memmap_(prefix)
    written = _deep(3, start=10.0).memmap_(prefix, atomic=True, existsok=True)
    assert _leaf(written).tolist() == [10.0, 11.0, 12.0]
    _leaf(written).add_(1)  # the written tensors map the files now in place
    assert _leaf(shared_td.load_memmap(prefix)).tolist() == [11.0, 12.0, 13.0]


def test_in_place_rewrite_of_a_save_nested_past_path_max_is_refused_before_a_byte_changes(tmp_path):
    # review52: its deep levels were planned as new (os.path.lexists is False for
    # ENAMETOOLONG): the write overwrote the leaves above them, then failed
    prefix = str(tmp_path / "save")
    saved = _deep(3)
    saved["top"] = torch.zeros(3)
    saved.memmap_(prefix)
    new = _deep(3, start=10.0)
    new["top"] = torch.ones(3)
    with pytest.raises(OSError, match="past PATH_MAX.*atomic=True"):
        new.memmap_(prefix, existsok=True)
    loaded = shared_td.load_memmap(prefix)
    assert loaded["top"].tolist() == [0.0] * 3 and _leaf(loaded).tolist() == [0.0, 1.0, 2.0]
