"""Drop-in fixes of the 2026-12-06 (fourteenth) round, side by side with tensordict 0.15.3
where it is installed: found by the differential fuzzer (run 12, seeds 130000-136699)."""
from __future__ import annotations

import pytest
import torch

from tests.reference import LIBS


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("source", ["share_memory_", "memmap share_non_tensor", "memmap"])
@pytest.mark.parametrize("index", ["list", "tensor", "mask"])
def test_a_row_copy_of_a_shared_or_mapped_value_never_writes_into_its_source(lib, source, index, tmp_path):
    """``y = td[[0]]`` (an index list, tensor or mask) is a copy, its non-tensor values
    too: a write into it stays there (before, a shared or memory-mapped NonTensorData's
    copy kept its cell or its files, and ``y.set("c", None, inplace=True)`` replaced the
    source's value, on disk too; fuzzer seed 132994)."""
    td = lib.TensorDict({}, [1, 3])
    td.set_non_tensor("c", "run")
    if source == "share_memory_":
        td.share_memory_()
    else:
        td = td.memmap(tmp_path / "save", share_non_tensor=source.endswith("non_tensor"))
    rows = {"list": [0], "tensor": torch.tensor([0]), "mask": torch.tensor([True])}[index]
    copy = td[rows]
    copy.set("c", None, inplace=True)
    if lib.__name__ == "shared_td":  # (tensordict 0.15.3 makes it a stack of None per row)
        assert copy.get_non_tensor("c") is None
    assert td.get_non_tensor("c") == "run"
    if source != "share_memory_":
        assert lib.TensorDict.load_memmap(tmp_path / "save").get_non_tensor("c") == "run"


def test_a_row_view_of_a_shared_value_still_writes_into_it():
    """A slice or an int index is a view: its write reaches the shared value (README:
    the views that write through), unlike the copies above."""
    import shared_td

    td = shared_td.TensorDict({}, [1, 3])
    td.set_non_tensor("c", "run")
    td.share_memory_()
    td[0:1].set("c", "walk", inplace=True)
    assert td.get_non_tensor("c") == "walk"


@pytest.mark.parametrize("lib", LIBS)
def test_an_index_write_of_a_value_holding_a_ragged_lazy_stack(lib):
    """``lazy[[0]] = row``, where ``row`` holds a nested lazy stack whose members' leaves
    have different shapes, writes it member by member (before: 'Failed to stack tensors
    ... under the key r', from reading the value's ragged leaf stacked; fuzzer seed
    135568)."""
    def row(k):
        inner = lib.lazy_stack([lib.TensorDict({"r": torch.arange(n) + k}, []) for n in (4, 1, 1)], 0)
        return lib.TensorDict({"next": inner, "b": torch.tensor(k)}, [])

    stack = lib.lazy_stack([row(0), row(10)], 0)
    stack[[0]] = stack[1].clone()
    first = stack.tensordicts[0]
    assert [member["r"].tolist() for member in first["next"].tensordicts] == [[10, 11, 12, 13], [10], [10]]
    assert first["b"].item() == 10
    assert [member["r"].tolist() for member in stack.tensordicts[1]["next"].tensordicts] == [[10, 11, 12, 13], [10], [10]]
