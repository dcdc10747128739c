"""Every CPU dtype of torch, through the main TensorDict operations.

Each operation is first run by torch on a plain tensor: where torch itself cannot do it
for a dtype (no ``==`` or no pickling for some, no ``copy_`` for the sub-byte ones,
nothing at all for the quantized ones), that operation only is skipped, with torch's
error as the reason. Where torch can, the tensordict operation must give the same bytes.
"""
from __future__ import annotations

import pickle

import pytest
import torch

from shared_td import TensorDict

ALL_DTYPES = sorted(
    {value for value in vars(torch).values() if isinstance(value, torch.dtype)}, key=str
)
# The ones the issue names: they must run every operation below.
REQUIRED = {
    torch.bool, torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.complex64,
    torch.complex128, torch.uint8, torch.uint16, torch.uint32, torch.uint64, torch.int8,
    torch.int16, torch.int32, torch.int64, torch.float8_e4m3fn, torch.float8_e5m2,
}


def make_value(dtype: torch.dtype) -> torch.Tensor:
    """A [3, 2] tensor with distinct rows where torch can cast to the dtype."""
    try:
        return torch.arange(6).reshape(3, 2).to(dtype)
    except (RuntimeError, TypeError):
        pass
    try:
        return torch.zeros(3, 2, dtype=dtype)
    except (RuntimeError, TypeError) as error:
        pytest.skip(f"torch cannot create a CPU tensor of {dtype}: {error}")


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    flat = lambda t: bytes(t.contiguous().untyped_storage())[: t.numel() * t.element_size()]
    return flat(a) == flat(b)


def reference(op, *args):
    """torch's own result, or a skip naming what torch lacks for this dtype."""
    try:
        return op(*args)
    except (RuntimeError, TypeError, AttributeError, KeyError, NotImplementedError) as error:
        dtype = next(a.dtype for a in args if isinstance(a, torch.Tensor))
        if dtype in REQUIRED and op.__name__ not in ("eq", "pickled"):
            raise
        pytest.skip(f"torch itself cannot {op.__name__} a {dtype} tensor: {str(error)[:120]}")


def index(t):
    return t[1]


def slice_(t):
    return t[1:]


def take(t):
    return t[torch.tensor([2, 0])]


def mask(t):
    return t[torch.tensor([True, False, True])]


def write_row(t):
    out = t.clone()
    out[1] = t[0]
    return out


def stack(t):
    return torch.stack([t, t], 1)


def cat(t):
    return torch.cat([t, t])


def eq(t):
    return t == t.clone()


def zero(t):
    return t.clone().zero_()


def share(t):
    return t.clone().share_memory_()


def pickled(t):
    return pickle.loads(pickle.dumps(t))


# name: (torch's op on the tensor, the same op through a TensorDict holding it as "x")
OPS = {
    "clone": (torch.clone, lambda td: td.clone()["x"]),
    "index": (index, lambda td: td[1]["x"]),
    "slice": (slice_, lambda td: td[1:]["x"]),
    "take": (take, lambda td: td[torch.tensor([2, 0])]["x"]),
    "mask": (mask, lambda td: td[torch.tensor([True, False, True])]["x"]),
    "write_row": (write_row, lambda td: _write_row(td)),
    "stack": (stack, lambda td: torch.stack([td, td], 1)["x"]),
    "cat": (cat, lambda td: torch.cat([td, td])["x"]),
    "eq": (eq, lambda td: (td == td.clone())["x"]),
    "zero": (zero, lambda td: td.clone().zero_()["x"]),
    "share": (share, lambda td: td.clone().share_memory_()["x"]),
    "pickle": (pickled, lambda td: pickle.loads(pickle.dumps(td))["x"]),
}


def _write_row(td):
    out = td.clone()
    out[1] = td[0]
    return out["x"]


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_set_get_and_repr(dtype):
    value = make_value(dtype)
    td = TensorDict(batch_size=[3])
    td["x"] = value
    td.set(("nested", "y"), value)
    assert td["x"] is value and td["nested", "y"] is value and td.get("x").dtype == dtype
    assert "[2]" in repr(td) and "x: " in repr(td)


@pytest.mark.parametrize("name", list(OPS))
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_operation(dtype, name):
    torch_op, td_op = OPS[name]
    value = make_value(dtype)
    expected = reference(torch_op, value)
    got = td_op(TensorDict(x=value, batch_size=[3]))
    assert same_bytes(got, expected), (got, expected)


def test_required_dtypes_exist():
    assert REQUIRED <= set(ALL_DTYPES)
