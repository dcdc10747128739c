"""append_memmap must not drop a nested level that os.fwalk cannot open (it skipped it,
and the emptied level was swapped in: review52), nor hold one descriptor per nested node."""
import os
import resource

import pytest
import torch

import shared_td
from shared_td import NonTensorData, TensorDict
from shared_td.persist import append


def _make(n, nodes=1):
    return TensorDict({f"n{i}": TensorDict(tag=NonTensorData("v", batch_size=[n]), batch_size=[n])
                       for i in range(nodes)} | {"x": torch.zeros(n, 2)}, batch_size=[n])


def test_level_fwalk_cannot_open_fails_the_append(tmp_path, monkeypatch):
    path = str(tmp_path / "save")
    _make(3).memmap(path)
    real_open, real_mirror = os.open, append._mirror

    def failing_open(name, flags, *args, dir_fd=None, **kwargs):
        if name == "n0" and dir_fd is not None:
            raise PermissionError(13, "Permission denied", name)
        return real_open(name, flags, *args, dir_fd=dir_fd, **kwargs)

    def mirror(*args):  # (a level made unreadable after the load)
        monkeypatch.setattr(os, "open", failing_open)
        try:
            return real_mirror(*args)
        finally:
            monkeypatch.setattr(os, "open", real_open)

    monkeypatch.setattr(append, "_mirror", mirror)
    with pytest.raises(PermissionError, match="n0"):
        shared_td.append_memmap(path, _make(1))
    loaded = shared_td.load_memmap(path)
    assert loaded.batch_size == torch.Size([3]) and loaded["n0", "tag"] == "v"


def test_many_nested_nodes_under_a_low_descriptor_limit(tmp_path):
    path = str(tmp_path / "save")
    _make(3, nodes=300).memmap(path)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 200, hard))
    try:
        shared_td.append_memmap(path, _make(1, nodes=300))
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert shared_td.load_memmap(path).batch_size == torch.Size([4])
