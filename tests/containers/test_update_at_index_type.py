"""Fuzzer finding (seed 303999): update_at_ with an index that is no index (a float, a str) raises
IndexTypeError (TypeError and IndexError), as td[idx] and td[idx] = v do (README: "an index
that is not one (a float, a string) raises IndexTypeError"); tensordict 0.15.3 raises
IndexError (TensorDict) or TypeError (lazy stack)."""
import pytest
import torch

import shared_td
from shared_td.errors import IndexTypeError


@pytest.mark.parametrize("lazy", [False, True])
@pytest.mark.parametrize("idx", [0.5, "x"])
def test_update_at_non_index_is_index_type_error(lazy, idx):
    if lazy:
        td = shared_td.lazy_stack([shared_td.TensorDict({"a": torch.zeros(3)}, [3]) for _ in range(2)], 0)
    else:
        td = shared_td.TensorDict({"a": torch.zeros(2, 3)}, [2, 3])
    with pytest.raises(IndexTypeError):
        td.update_at_(shared_td.TensorDict({"a": torch.ones(3)}, [3]), idx)
    assert td["a"].sum() == 0
