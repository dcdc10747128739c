"""Interop records the fuzzer left (seeds 20653, 21159, 30555): an empty NonTensorStack
under a wider batch, load_memmap_ of a save that does not fit self's batch size, and a
lazy stack's mask index across its stack dim (a copy, so that it saves anywhere)."""
from __future__ import annotations

import json
import os

import pytest
import torch

tensordict = pytest.importorskip("tensordict", reason="tensordict==0.15.3 is not installed")
if tensordict.__version__ != "0.15.3":
    pytest.skip("these tests compare against tensordict 0.15.3 exactly", allow_module_level=True)

import shared_td  # noqa: E402

LIBS = {"tensordict": tensordict, "shared_td": shared_td}


def _empty_stack_tree(L):
    """A [0, 1] tensordict holding a NonTensorStack (saved as ``"data": []``)."""
    stack = L.NonTensorStack(L.NonTensorData("x"), L.NonTensorData("y"))
    return L.TensorDict(done=torch.zeros(2), c=stack, batch_size=[2])[:0].unsqueeze(1)


@pytest.mark.parametrize("stack_dim", [0, 1], ids=["as-shared_td-writes", "as-tensordict-writes"])
def test_empty_non_tensor_stack_under_a_wider_batch_loads(tmp_path, stack_dim):
    # nested lists record no dim after a 0: the stack takes its parent's batch size
    # (tensordict writes stack_dim 1 for this tree, shared_td 0; neither is read for data)
    _empty_stack_tree(shared_td).memmap(tmp_path / "s")
    meta_path = tmp_path / "s" / "c" / "meta.json"
    meta = json.loads(meta_path.read_text())
    assert meta["data"] == []
    meta["stack_dim"] = stack_dim
    meta_path.write_text(json.dumps(meta))
    loaded = shared_td.load_memmap(tmp_path / "s")
    assert loaded.batch_size == torch.Size([0, 1])
    assert isinstance(loaded.get("c"), shared_td.NonTensorStack)
    assert loaded.get("c").batch_size == torch.Size([0, 1])
    assert loaded.get("c").tolist() == []
    # (tensordict 0.15.3 cannot load this save, its own included: a RuntimeError)
    with pytest.raises(RuntimeError):
        tensordict.load_memmap(tmp_path / "s")


@pytest.mark.parametrize("writer", ["tensordict", "shared_td"])
def test_load_memmap_inplace_of_a_save_that_does_not_fit_the_batch(tmp_path, writer):
    W = LIBS[writer]
    W.TensorDict(a=torch.arange(6).reshape(3, 2), batch_size=[3, 2]).memmap(tmp_path / "s")
    td = shared_td.TensorDict(a=torch.ones(3, 2), batch_size=[3, 2]).reshape(1, 6)
    with pytest.raises(shared_td.BatchSizeMismatchError, match="does not fit"):
        td.load_memmap_(tmp_path / "s")
    assert td.batch_size == torch.Size([1, 6]) and td["a"].shape == torch.Size([1, 6])
    assert (td["a"] == 1).all()  # nothing changed
    # tensordict 0.15.3 loads it, keeping a batch size its entries do not fit
    ref = tensordict.TensorDict(a=torch.ones(3, 2), batch_size=[3, 2]).reshape(1, 6)
    ref.load_memmap_(tmp_path / "s")
    assert ref.batch_size == torch.Size([1, 6]) and ref["a"].shape == torch.Size([3, 2])
    # a save whose entries start with self's batch size loads as in tensordict
    for L in LIBS.values():
        fits = L.TensorDict(a=torch.ones(3, 2), batch_size=[3])
        fits.load_memmap_(tmp_path / "s")
        assert fits.batch_size == torch.Size([3]) and fits["a"].tolist() == [[0, 1], [2, 3], [4, 5]]


@pytest.mark.parametrize("name", ["tensordict", "shared_td"])
def test_lazy_stack_mask_across_the_stack_dim_copies(tmp_path, name):
    L = LIBS[name]
    members = [L.TensorDict(a=torch.arange(3.0).reshape(3, 1) + plus, batch_size=[3, 1]) for plus in (0, 10)]
    stack = L.LazyStackedTensorDict.lazy_stack(members, dim=1)
    stack = stack.memmap(tmp_path / "m")
    mask = torch.tensor([[[False], [True]], [[False], [True]], [[True], [True]]])
    picked = stack[mask]
    assert picked.batch_size == torch.Size([4])
    assert picked["a"].tolist() == [10.0, 11.0, 2.0, 12.0]
    sources = {m["a"].untyped_storage().data_ptr() for m in stack.tensordicts}
    for element in picked.tensordicts:
        assert element["a"].untyped_storage().data_ptr() not in sources  # a copy, as torch's
    # so it saves to a new prefix without copy_existing (the 30555 record raised here)
    picked.memmap(tmp_path / "out", copy_existing=False)
    assert L.load_memmap(tmp_path / "out")["a"].tolist() == [10.0, 11.0, 2.0, 12.0]
    two = stack[torch.tensor([0, 2]), torch.tensor([1, 0])]  # two index tensors
    assert two["a"].tolist() == [[10.0], [2.0]]
    assert all(m["a"].untyped_storage().data_ptr() not in sources for m in two.tensordicts)
