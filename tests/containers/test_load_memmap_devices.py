"""Devices after a load: ``load_memmap_`` keeps the tree's device at every depth (a tree
that is not memory-mapped keeps its own, None included, as tensordict 0.15.3; a
memory-mapped one takes the CPU), and ``load_memmap`` gives a non-tensor entry saved
without a device its node's, as ``set`` would and as tensordict 0.15.3 loads it."""
from __future__ import annotations

import pytest
import torch

from tests.reference import LIBS


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("root", ["tensordict", "lazy_stack"])
def test_load_memmap_into_a_tree_without_a_device_keeps_none_throughout(lib, root, tmp_path):
    td = lib.TensorDict(a=torch.zeros(2), n=lib.TensorDict(b=torch.ones(2), m=lib.TensorDict(batch_size=[2]),
                                                          batch_size=[2]), batch_size=[2])
    if root == "lazy_stack":
        td = lib.lazy_stack([td[0].clone(), td[1].clone()])
    td.clone().memmap(tmp_path)
    td.load_memmap_(tmp_path)
    assert [td.device, td.get("n").device, td.get(("n", "m")).device] == [None, None, None]
    assert td.state_dict()._metadata["n"]["device"] is None
    assert not td.is_memmap()


@pytest.mark.parametrize("lib", LIBS)
def test_load_memmap_into_a_memory_mapped_tree_gives_the_cpu_throughout(lib, tmp_path):
    td = lib.TensorDict(a=torch.zeros(2), n=lib.TensorDict(b=torch.ones(2), batch_size=[2]), batch_size=[2])
    td.memmap_(tmp_path)
    td.load_memmap_(tmp_path)
    assert [td.device, td.get("n").device] == [torch.device("cpu")] * 2


@pytest.mark.parametrize("saver", LIBS)
@pytest.mark.parametrize("loader", LIBS)
def test_a_non_tensor_entry_loaded_takes_its_nodes_device(saver, loader, tmp_path):
    td = saver.TensorDict(a=torch.zeros(2), batch_size=[2])
    td.set_non_tensor("s", "run")
    td["stack"] = saver.NonTensorStack("x", "y")
    td["n"] = saver.TensorDict(t=saver.NonTensorData("q", batch_size=[2]), batch_size=[2])
    td.memmap_(tmp_path)
    loaded = loader.TensorDict.load_memmap(tmp_path)
    devices = [loaded.get(key).device for key in ("s", "stack", "n", ("n", "t"))]
    assert devices == [torch.device("cpu")] * 4
    assert loaded["s"] == "run" and loaded["n", "t"] == "q"


def _non_tensor_tree(lib, device):
    td = lib.TensorDict(a=torch.zeros(2), n=lib.TensorDict(batch_size=[2]), batch_size=[2], device=device)
    td.set_non_tensor("c", True)
    td.set_non_tensor(("n", "s"), "x")
    td["stack"] = lib.NonTensorStack("p", "q")
    return td


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("device", [None, "cpu"])
@pytest.mark.parametrize("root", ["tensordict", "lazy_stack"])
def test_load_memmap_into_a_tree_in_memory_gives_its_non_tensor_entries_the_trees_device(lib, device, root,
                                                                                         tmp_path):
    td = _non_tensor_tree(lib, device)
    if root == "lazy_stack":
        td = lib.lazy_stack([td[0].clone(), td[1].clone()])
    td.clone().memmap(tmp_path)
    td.load_memmap_(tmp_path)
    expected = None if device is None else torch.device(device)
    assert [td.get(key).device for key in ("c", ("n", "s"), "stack")] == [expected] * 3
    assert td.state_dict()._metadata["c"]["device"] == expected


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("device", [None, "cpu"])
def test_load_memmap_into_a_memory_mapped_tree_keeps_a_non_tensor_datas_device(lib, device, tmp_path):
    td = _non_tensor_tree(lib, device)
    td.memmap_(tmp_path / "here")
    td.clone().memmap(tmp_path / "there")
    td.load_memmap_(tmp_path / "there")
    expected = None if device is None else torch.device(device)
    assert [td.get("c").device, td.get(("n", "s")).device] == [expected] * 2
    assert td.get("stack").device == torch.device("cpu")  # (a stack is taken as loaded)
    assert td["c"] is True and td["n", "s"] == "x"
