"""Dim names after an index with bools or several index tensors, as tensordict 0.15.3
gives them (its test_nameddims.py): a bool (``True``, ``False``, a 0-d mask) adds an
unnamed dim and uses none, and a dim of torch's block of advanced-index dims keeps the
name of the dim indexed by the one index that varies along it. shared_td dropped every
name beside a bool, and named an N-D block wrongly."""
from __future__ import annotations

import pytest
import torch

from tests.reference import LIBS

ROWS, COLS = torch.tensor([0, 2]), torch.tensor([1, 3])
CASES = {
    "True": ((True,), [None, "t", "env", "agent", "f"]),
    "True then ints": ((True, 0, 0, 0), [None, "f"]),
    "False after a slice": ((slice(None), False), ["t", None, "env", "agent", "f"]),
    "0-d mask": ((torch.tensor(True),), [None, "t", "env", "agent", "f"]),
    "rows beside True": ((ROWS, True), ["t", "env", "agent", "f"]),
    "True, slice, rows": ((True, slice(None), ROWS), ["env", "t", "agent", "f"]),
    "column and row vectors": ((ROWS[:, None], COLS), ["t", "env", "agent", "f"]),
    "rows with a size-1 list": ((ROWS, slice(None), [1]), ["t", "env", "f"]),
    "rows as a row vector": ((ROWS[None],), [None, "t", "env", "agent", "f"]),
    "a 2-D index": ((torch.tensor([[0, 1], [1, 2]]),), [None, None, "env", "agent", "f"]),
    "rows and cols": ((ROWS, COLS), [None, "agent", "f"]),
    "a size-1 list at the end": ((0, Ellipsis, [-1]), ["env", "agent", "f"]),
    "a 1-D mask with one True": ((torch.tensor([False, True, False]),), ["t", "env", "agent", "f"]),
}


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("case", CASES)
def test_names_after_advanced_index(lib, case):
    index, names = CASES[case]
    td = lib.TensorDict({"x": torch.zeros(3, 4, 5, 6)}, [3, 4, 5, 6], names=["t", "env", "agent", "f"])
    out = td[index]
    assert out.names == names
    assert out.batch_size == torch.zeros(3, 4, 5, 6)[index].shape
