"""get() with as_list / as_padded_tensor by a nested key that runs through a lazy stack
held in a lazy stack's members (fuzzer run 21, seed 214440: each member's stacked tensor
came back, and ragged inner leaves raised "Failed to stack tensors"), side by side with
tensordict 0.15.3."""
from __future__ import annotations

import pytest
import torch

from tests.reference import LIBS


def _lazy(lib, members):
    if lib.__name__ == "tensordict":
        return lib.LazyStackedTensorDict(*members, stack_dim=0)
    return lib.LazyStackedTensorDict.lazy_stack(members, 0)


def _nested(lib, sizes):
    """A lazy stack of 2 members, each holding `rg`: a lazy stack of 0-d tds whose `b` has the given sizes."""
    def inner():
        return _lazy(lib, [lib.TensorDict(b=torch.full((n,), j)) for j, n in enumerate(sizes)])

    return _lazy(lib, [lib.TensorDict(rg=inner()) for _ in range(2)])


@pytest.mark.parametrize("lib", LIBS)
def test_as_list_by_a_nested_key_lists_the_inner_lazy_stacks_members_too(lib):
    x = _nested(lib, [2, 2, 2])
    by_key = x.get(("rg", "b"), as_list=True)
    assert [type(row) for row in by_key] == [list, list]  # (not each member's stacked tensor)
    assert [[tuple(t.shape) for t in row] for row in by_key] == [[(2,)] * 3] * 2
    assert [[t.tolist() for t in row] for row in by_key] == [[[0, 0], [1, 1], [2, 2]]] * 2
    # the same as reading the nested stack first
    assert [[t.tolist() for t in row] for row in x["rg"].get("b", as_list=True)] == \
        [[t.tolist() for t in row] for row in by_key]


@pytest.mark.parametrize("lib", LIBS)
def test_a_ragged_leaf_of_an_inner_lazy_stack_is_read_by_a_nested_key(lib):
    x = _nested(lib, [2, 3])
    assert [type(row) for row in x.get(("rg", "b"), as_list=True)] == [list, list]
    assert [[tuple(t.shape) for t in row] for row in x.get(("rg", "b"), as_list=True)] == [[(2,), (3,)]] * 2
    padded = x.get(("rg", "b"), as_padded_tensor=True, padding_value=-1)
    assert padded.tolist() == [[[0, 0, -1], [1, 1, 1]]] * 2


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("values", [(torch.ones(2), "txt"), ("txt", torch.ones(2))], ids=["tensor_first", "text_first"])
@pytest.mark.parametrize("option", ["as_list", "as_padded_tensor"])
def test_a_nested_key_holding_a_tensor_and_a_non_tensor_is_refused_in_any_member_order(lib, values, option):
    # (fuzzer run 22's probe: only the first member's kind was peeked, so [tensor, NonTensorData] came back
    # when the tensor came first)
    x = _lazy(lib, [lib.TensorDict(n=lib.TensorDict(s=v)) for v in values])
    # (tensordict 0.15.3 fails inside its stacking: AttributeError or TypeError)
    with pytest.raises(TypeError if lib.__name__ == "shared_td" else (TypeError, AttributeError)):
        x.get(("n", "s"), **{option: True})
