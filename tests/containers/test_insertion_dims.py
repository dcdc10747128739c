"""Ops that insert a batch dim (unsqueeze, torch.stack, lazy_stack) check its position the
same way everywhere (``batch.insertion_dim``): one message naming the op, the dim and the
range, and one error class, BatchDimError, an IndexError (as torch raises) and a
RuntimeError (as tensordict 0.15.3 raises for these ops).

Before, TensorDict.unsqueeze and torch.stack said "dim=2 is out of range: expected -2 <=
dim <= 1 (a batch dim ...)" (a new dim is not a batch dim), lazy stacks said it their own
way, and the non-tensor entries raised torch's bare IndexError, which code written for
tensordict (``except RuntimeError``) did not catch.
"""
from __future__ import annotations

import pytest
import torch

import shared_td
from shared_td.errors import BatchDimError


def _td(lib):
    return lib.TensorDict(a=torch.zeros(3, 4), batch_size=[3])


# op name in the message, what raises for a library (tensordicts of 1 batch dim, or a
# lazy stack of 2), the number of batch dims of the tensordicts the new dim goes into
_OPS = {
    "td.unsqueeze": ("unsqueeze(dim=", lambda lib, d: _td(lib).unsqueeze(d), 1),
    "torch.unsqueeze": ("unsqueeze(dim=", lambda lib, d: torch.unsqueeze(_td(lib), d), 1),
    "lazy.unsqueeze": ("unsqueeze(dim=", lambda lib, d: lib.lazy_stack([_td(lib), _td(lib)]).unsqueeze(d), 2),
    "non_tensor_data.unsqueeze": ("unsqueeze(dim=", lambda lib, d: lib.NonTensorData("x", batch_size=[3]).unsqueeze(d), 1),
    "non_tensor_stack.unsqueeze": ("unsqueeze(dim=", lambda lib, d: lib.NonTensorStack("x", "y").unsqueeze(d), 1),
    "torch.stack": ("torch.stack(dim=", lambda lib, d: torch.stack([_td(lib), _td(lib)], d), 1),
    "torch.stack_non_tensors": ("torch.stack(dim=", lambda lib, d: torch.stack(
        [lib.NonTensorData("x", batch_size=[3]), lib.NonTensorData("y", batch_size=[3])], d), 1),
    "lazy_stack": ("lazy_stack(dim=", lambda lib, d: lib.lazy_stack([_td(lib), _td(lib)], d), 1),
    "LazyStackedTensorDict": ("LazyStackedTensorDict(stack_dim=",
                              lambda lib, d: lib.LazyStackedTensorDict(_td(lib), _td(lib), stack_dim=d), 1),
}


@pytest.mark.parametrize("op", sorted(_OPS))
@pytest.mark.parametrize("side", ["above", "below"])
def test_out_of_range_message(op, side):
    shown, call, batch_dims = _OPS[op]
    dim = batch_dims + 1 if side == "above" else -batch_dims - 2
    with pytest.raises(BatchDimError) as raised:
        call(shared_td, dim)
    what = "stack_dim" if "stack_dim" in shown else "dim"
    expected = (f"{shown}{dim}) is out of range for tensordicts with {batch_dims} batch dim"
                f"{'s' if batch_dims != 1 else ''}: the new dim goes at {-batch_dims - 1} <= {what} <= {batch_dims}")
    assert str(raised.value).startswith(expected)
    assert isinstance(raised.value, IndexError) and isinstance(raised.value, RuntimeError)


@pytest.mark.parametrize("op", sorted(_OPS))
def test_both_ends_of_the_range_accepted(op):
    _, call, batch_dims = _OPS[op]
    for dim in (batch_dims, -batch_dims - 1):
        assert call(shared_td, dim).batch_dims == batch_dims + 1


@pytest.mark.parametrize("op", sorted(_OPS))
@pytest.mark.parametrize("side", ["above", "below"])
def test_error_class_caught_as_tensordict_raises(op, side):
    """Where tensordict 0.15.3 raises for the same call, our error is an instance of
    its class. (Where it does not, e.g. torch.stack(dim=2) of one-dim tensordicts, which
    it stacks along dim 1, ours still raises: the dim is out of torch's range.)"""
    tensordict = pytest.importorskip("tensordict")
    _, call, batch_dims = _OPS[op]
    dim = batch_dims + 1 if side == "above" else -batch_dims - 2
    try:
        call(tensordict, dim)
    except Exception as theirs:  # noqa: BLE001 - the class is what is compared
        expected = type(theirs)
    else:
        pytest.skip("tensordict 0.15.3 accepts this dim")
    with pytest.raises(expected):
        call(shared_td, dim)
