"""consolidate(filename=...) of a tensordict without a device, side by side with
tensordict 0.15.3 (a difference found by running tensordict's own consolidate tests
against shared_td)."""
from __future__ import annotations

import pytest
import torch

import shared_td
from tests.reference import LIBS

def deviceless(lib):
    return lib.TensorDict({"a": torch.zeros(2), "b": {"c": torch.ones(2)}, "d": "text"}, batch_size=[2])


@pytest.mark.parametrize("lib", LIBS)
def test_consolidated_into_a_file_is_on_the_cpu(lib, tmp_path):
    td = deviceless(lib)
    assert td.device is None
    consolidated = td.consolidate(filename=tmp_path / "td.bin")
    # the file's mapping is CPU memory: the tree says so, down to its nested nodes
    assert consolidated.device == torch.device("cpu")
    assert consolidated["b"].device == torch.device("cpu")
    assert (consolidated == td).all()
    assert td.device is None  # the source keeps its own


@pytest.mark.parametrize("lib", LIBS)
def test_consolidated_in_memory_keeps_no_device(lib):
    consolidated = deviceless(lib).consolidate()
    assert consolidated.device is None
    assert consolidated["b"].device is None


def test_consolidated_file_of_a_lazy_stack_is_on_the_cpu(tmp_path):
    stack = shared_td.LazyStackedTensorDict.lazy_stack([deviceless(shared_td), deviceless(shared_td)], 0)
    consolidated = stack.consolidate(filename=tmp_path / "stack.bin")
    assert consolidated.device == torch.device("cpu")
    assert all(member.device == torch.device("cpu") for member in consolidated.tensordicts)


# ------------------------------------------------ the bytes no leaf covers
def storage_bytes(consolidated, key):
    return torch.empty(0, dtype=torch.uint8).set_(consolidated[key].untyped_storage()).clone()


def padded_tree(lib):
    # small leaves of odd sizes, then big ones (> 64 KiB) that start at aligned offsets:
    # the buffer has gaps between them and a tail
    dtypes = [torch.float32, torch.float16, torch.uint8, torch.float64]
    td = lib.TensorDict({f"key{i}": torch.full((i % 7 + 1,), i, dtype=dtypes[i % 4]) for i in range(50)}, [])
    td["big1"] = torch.ones(16385, dtype=torch.float32)
    td["big2"] = torch.full((70001,), 7, dtype=torch.uint8)
    return td


@pytest.mark.parametrize("lib", LIBS)
def test_consolidated_buffers_of_one_tree_are_equal(lib):
    td = padded_tree(lib)
    buffers = []
    for num_threads in (0, 4, 0):
        junk = torch.full((1 << 20,), 0xAB, dtype=torch.uint8)  # memory the buffer may reuse
        del junk
        buffers.append(storage_bytes(td.consolidate(num_threads=num_threads), "key0"))
    assert all(torch.equal(buffers[0], other) for other in buffers[1:])


def test_uncovered_bytes_are_zero():
    td = padded_tree(shared_td)
    for _ in range(3):
        junk = torch.full((1 << 20,), 0xAB, dtype=torch.uint8)
        del junk
        consolidated = td.consolidate()
        data = storage_bytes(consolidated, "key0")
        covered = torch.zeros(data.numel(), dtype=torch.bool)
        for value in consolidated.values(True, True):
            if isinstance(value, torch.Tensor):
                start = value.storage_offset() * value.element_size()
                covered[start:start + value.numel() * value.element_size()] = True
        assert not covered.all()  # the tree has gaps
        assert (data[~covered] == 0).all()
