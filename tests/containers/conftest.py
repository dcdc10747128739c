"""Shared helpers of the container tests."""
from __future__ import annotations

import contextlib

import pytest
import torch

from shared_td import is_non_tensor


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    # Bytes compare equal for every dtype (float8 has no ==, NaN != NaN).
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8).clone()


def td_state(td) -> tuple:
    """Everything a failed operation must leave as it was: keys, batch sizes, names,
    lock flags, tensor bytes (with dtype and shape) and non-tensor values."""
    entries = {}
    for key in td.keys(include_nested=True):
        value = td.get(key)
        if isinstance(value, torch.Tensor):
            entries[key] = ("tensor", value.dtype, value.shape, _bits(value))
        elif is_non_tensor(value):
            entries[key] = ("non-tensor", type(value).__name__, value.batch_size, repr(value.tolist()))
        else:
            entries[key] = ("collection", value.batch_size, value.names, value.is_locked)
    return td.batch_size, td.names, td.is_locked, entries


def assert_same_state(before: tuple, after: tuple) -> None:
    assert before[:3] == after[:3]
    assert list(before[3]) == list(after[3]), "the keys changed"
    for key, old in before[3].items():
        new = after[3][key]
        if old[0] == "tensor":
            assert new[0] == "tensor" and old[1:3] == new[1:3], key
            assert torch.equal(old[3], new[3]), f"the values of {key!r} changed"
        else:
            assert old == new, key


@pytest.fixture
def unchanged():
    """``with unchanged(td), pytest.raises(...): ...`` asserts that td is as it was."""

    @contextlib.contextmanager
    def check(td):
        before = td_state(td)
        yield
        assert_same_state(before, td_state(td))

    return check
