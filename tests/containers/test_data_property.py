"""``td.data`` as tensordict 0.15.3's, side by side (a property of TensorDict and lazy
stacks; a tensorclass field and NonTensorData's value may still be named ``data``)."""
import pytest
import torch

import shared_td

tensordict = pytest.importorskip("tensordict")


def _tree(lib):
    return lib.TensorDict({"x": torch.ones(3, requires_grad=True), "s": "a",
                           "n": {"y": torch.zeros(3, 2)}}, [3])


@pytest.mark.parametrize("lib", [shared_td, tensordict], ids=["shared_td", "tensordict"])
def test_data_is_each_tensors_data(lib):
    td = _tree(lib)
    data = td.data
    assert type(data) is type(td) and data.batch_size == td.batch_size
    assert not data["x"].requires_grad and data["x"].data_ptr() == td["x"].data_ptr()
    assert data["n", "y"].data_ptr() == td["n", "y"].data_ptr()
    assert data["s"] == "a" and not data.is_locked
    assert td.lock_().data.is_locked


@pytest.mark.parametrize("lib", [shared_td, tensordict], ids=["shared_td", "tensordict"])
def test_data_of_a_memory_mapped_tree_and_of_a_lazy_stack(lib):
    mapped = _tree(lib).detach().memmap_()
    data = mapped.data
    assert type(data["x"]) is torch.Tensor and data["x"].data_ptr() == mapped["x"].data_ptr()
    lazy = lib.LazyStackedTensorDict(*[lib.TensorDict({"x": torch.zeros(2)}, [2]) for _ in range(2)], stack_dim=0)
    assert isinstance(lazy.data, lib.LazyStackedTensorDict) and lazy.data.batch_size == (2, 2)


@pytest.mark.parametrize("lib", [shared_td, tensordict], ids=["shared_td", "tensordict"])
def test_a_field_or_a_value_named_data_is_kept(lib):
    @lib.tensorclass
    class Holder:
        data: torch.Tensor

    assert type(Holder(data=torch.zeros(2), batch_size=[2]).data) is torch.Tensor
    assert lib.NonTensorData(data="v").data == "v"
