"""A 0-d bool tensor in an index (``td[..., torch.tensor(True)]``) uses no batch dim,
as ``True`` does: found by running tensordict's index pool (its test_indexing.py)
against shared_td, which put the new dim before the last batch dim."""
from __future__ import annotations

import pytest
import torch

import shared_td
from tests.reference import LIBS

INDICES = {
    "(..., tensor(True))": (Ellipsis, torch.tensor(True)),
    "(..., tensor(False))": (Ellipsis, torch.tensor(False)),
    "(0, ..., tensor(True))": (0, Ellipsis, torch.tensor(True)),
    "(tensor(True), ...)": (torch.tensor(True), Ellipsis),
    "(:, tensor(True), ...)": (slice(None), torch.tensor(True), Ellipsis),
}


def over_cases(test):
    """Run ``test`` for each library, batch size and index of INDICES."""
    test = pytest.mark.parametrize("name", INDICES)(test)
    test = pytest.mark.parametrize("shape", [(3, 4), (3, 4, 5)], ids=str)(test)
    return pytest.mark.parametrize("lib", LIBS)(test)


def grid(lib, shape):
    values = torch.arange(float(torch.Size(shape).numel())).view(shape)
    return values, lib.TensorDict({"x": values.clone(), "nested": {"y": values.clone()}}, shape)


@over_cases
def test_read_matches_torch(lib, shape, name):
    index = INDICES[name]
    values, td = grid(lib, shape)
    expected = values[index]
    result = td[index]
    assert result.batch_size == expected.shape
    assert torch.equal(result["x"], expected)
    assert torch.equal(result["nested", "y"], expected)


@over_cases
def test_write_matches_torch(lib, shape, name):
    index = INDICES[name]
    values, td = grid(lib, shape)
    expected = values.clone()
    expected[index] = -1
    rows = values[index].shape
    td[index] = lib.TensorDict({"x": -torch.ones(rows), "nested": {"y": -torch.ones(rows)}}, rows)
    assert torch.equal(td["x"], expected)
    assert torch.equal(td["nested", "y"], expected)
    values, td = grid(lib, shape)
    td[index] = -1.0
    assert torch.equal(td["x"], expected)


def test_leaf_with_feature_dims_keeps_them_last():
    # the Ellipsis covers the batch dims only: the new dim goes after them, before the
    # leaf's own dims
    td = shared_td.TensorDict({"obs": torch.zeros(3, 4, 7)}, [3, 4])
    assert td[..., torch.tensor(True)]["obs"].shape == (3, 4, 1, 7)
    assert td[..., torch.tensor(False)]["obs"].shape == (3, 4, 0, 7)
