"""What the second half of tensordict's own test_methods.py found missing, side by side
with tensordict 0.15.3: ``view(dtype, batch_size=)`` (a TypeError pointing at ``to(dtype)``,
a conversion, before). ``new_tensor``: test_new_tensor.py; ``rename_key_`` on a locked lazy
stack: test_rename_locked_lazy_stack.py."""
from __future__ import annotations

import pytest
import torch

from tests.reference import LIBS


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("kind", ["td", "lazy", "tensorclass"])
def test_view_dtype_reads_the_same_bytes_as_another_type(lib, kind):
    @lib.tensorclass
    class Step:
        a: torch.Tensor

    def make():
        return {"td": lambda: lib.TensorDict(a=torch.arange(12.0).reshape(3, 4), batch_size=[3]),
                "lazy": lambda: lib.lazy_stack([lib.TensorDict(a=torch.arange(4.0), batch_size=[])] * 3),
                "tensorclass": lambda: Step(a=torch.arange(12.0).reshape(3, 4), batch_size=[3])}[kind]()

    td = make()
    ints = td.view(torch.int32)
    assert type(ints).__name__ == type(td).__name__ and ints.batch_size == td.batch_size
    assert ints.get("a").dtype == torch.int32 and torch.equal(ints.get("a"), td.get("a").view(torch.int32))
    halves = td.view(torch.float16)
    assert halves.get("a").shape == torch.Size([3, 8])
    if kind == "td":
        assert ints["a"].data_ptr() == td["a"].data_ptr()  # a view: the same storage
        assert td.view(torch.float16, batch_size=[3, 8]).batch_size == torch.Size([3, 8])


@pytest.mark.parametrize("lib", LIBS)
def test_view_dtype_keeps_non_tensor_entries_and_refuses_a_batch_dim_that_changes(lib):
    td = lib.TensorDict(a=torch.zeros(3, 4), s="x", batch_size=[3])
    assert td.view(torch.int16)["s"] == "x"
    with pytest.raises(RuntimeError, match="'a'"):  # its last dim is a batch dim: 3 float32 are 6 float16
        lib.TensorDict(a=torch.zeros(3), batch_size=[3]).view(torch.float16)


def test_a_view_dtype_block_writes_through_the_views_and_keeps_the_dtype():
    """tensordict 0.15.3 replaces td's float leaf by the int32 view on exit."""
    import shared_td

    td = shared_td.TensorDict(a=torch.zeros(3, 4), batch_size=[3])
    with td.view(torch.int32) as bits:
        bits["a"] += 1
    assert td["a"].dtype == torch.float32
    assert td["a"][0, 0].item() == torch.tensor(1, dtype=torch.int32).view(torch.float32).item()
