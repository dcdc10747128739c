"""Proposed for tests/containers/: a nested tensor (unsupported, README) is refused with a
NotImplementedError naming the key, not torch's "Internal error ... Please file an issue"."""
import warnings

import pytest
import torch

import shared_td


@pytest.fixture
def nested():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.nested.nested_tensor([torch.zeros(1, 2), torch.zeros(1, 3)])


@pytest.mark.parametrize("how", ["constructor", "set", "setitem", "with_batch", "make_memmap_from_tensor"])
def test_a_nested_tensor_is_refused_naming_the_key(nested, how, tmp_path):
    with pytest.raises(NotImplementedError, match="nested tensor.*'n'|'n'.*nested tensor"):
        if how == "constructor":
            shared_td.TensorDict(n=nested)
        elif how == "set":
            shared_td.TensorDict().set("n", nested)
        elif how == "setitem":
            shared_td.TensorDict()["n"] = nested
        elif how == "with_batch":
            shared_td.TensorDict({"n": nested}, batch_size=[2])
        else:
            td = shared_td.TensorDict()
            td.memmap_(tmp_path)
            td.make_memmap_from_tensor("n", nested)


def test_a_lazy_stack_refuses_a_nested_tensor_naming_the_key(nested):
    stack = shared_td.lazy_stack([shared_td.TensorDict(), shared_td.TensorDict()])
    with pytest.raises(NotImplementedError, match="'n'.*nested tensor"):
        stack.set("n", nested)
    assert "n" not in stack.keys()
