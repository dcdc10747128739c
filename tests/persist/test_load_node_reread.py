"""review53: the node re-read of persist/loader.py._load (c6fc339)."""
from __future__ import annotations

import os
import sys
import traceback

import pytest
import torch

import shared_td
from shared_td import TensorDict

CALLS: list = []


def _rebuild(path):
    CALLS.append(path)
    with open(path) as f:  # the file the value needs is gone: FileNotFoundError
        return f.read()


class _Config:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (_rebuild, (self.path,))


def test_a_file_not_found_of_the_unpickled_object_is_raised_at_once(tmp_path):
    prefix = str(tmp_path / "save")
    td = TensorDict({"x": torch.zeros(3)}, [])
    td.set_non_tensor("cfg", _Config(str(tmp_path / "no-such-config.txt")))
    td.memmap(prefix)
    CALLS.clear()
    with pytest.raises(FileNotFoundError, match="no-such-config"):
        shared_td.load_memmap(prefix, allow_pickle=True)
    assert len(CALLS) == 1  # the pickle's own code ran once (it ran 101 times: re-read as a gone side file)


def test_a_missing_side_file_deep_in_a_save_is_a_file_not_found_error(tmp_path):
    depth = 300
    td = inner = TensorDict({}, [])
    for _ in range(depth):
        inner["a"] = TensorDict({}, [])
        inner = inner["a"]
    inner.set_non_tensor("v", {1, 2})  # not JSON: other.pickle
    prefix = str(tmp_path / "save")
    old = sys.getrecursionlimit()
    try:
        sys.setrecursionlimit(10000)
        td.memmap(prefix)
        # a limit the load of the whole save fits in, with room for fewer than 100 more frames
        sys.setrecursionlimit(len(traceback.extract_stack()) + depth + 60)
        assert shared_td.load_memmap(prefix, allow_pickle=True)[("a",) * depth + ("v",)] == {1, 2}
        os.unlink(os.path.join(prefix, *("a",) * depth, "v", "other.pickle"))
        with pytest.raises(FileNotFoundError, match="other.pickle"):  # (was: FormatError 'nested too deep')
            shared_td.load_memmap(prefix, allow_pickle=True)
    finally:
        sys.setrecursionlimit(old)
