"""``torch.zeros_like(td)`` and the other ``*_like`` constructors, side by side with
tensordict 0.15.3 (found by running tensordict's test_misc.py against shared_td, where
they raised "Multiple dispatch failed"): the usual way to make a buffer of the same
layout as a sample."""
from __future__ import annotations

import pytest
import torch

import shared_td
from tests.reference import LIBS

def sample(lib):
    return lib.TensorDict(
        obs=torch.randn(3, 4),
        nested=lib.TensorDict(action=torch.randint(10, (3, 4, 5)), batch_size=(3, 4)),
        task="walk",
        batch_size=(3,),
    )


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("name,fill", [("zeros_like", 0), ("ones_like", 1)])
def test_constant_like_keeps_the_layout(lib, name, fill):
    td = sample(lib)
    made = getattr(torch, name)(td)
    assert type(made) is type(td) and made is not td
    assert made.batch_size == td.batch_size and made["nested"].batch_size == (3, 4)
    assert (made["obs"] == fill).all() and (made["nested", "action"] == fill).all()
    assert made["nested", "action"].dtype == torch.int64 and made["obs"].shape == (3, 4)
    assert made["task"] == "walk"  # non-tensor entries are kept
    assert (td["obs"] != fill).any()  # the source is untouched


@pytest.mark.parametrize("lib", LIBS)
def test_full_and_empty_like_take_torch_arguments(lib):
    td = sample(lib)
    full = torch.full_like(td, 2, dtype=torch.float64)
    assert (full["obs"] == 2).all() and full["nested", "action"].dtype == torch.float64
    empty = torch.empty_like(td, device="cpu")
    assert empty.device == torch.device("cpu") and empty["obs"].shape == (3, 4)
    assert empty["nested"].device == torch.device("cpu")  # a str device is parsed, nested too
    applied = td.apply(lambda leaf: leaf + 1, device="cpu")
    assert applied.device == torch.device("cpu") and applied["nested"].device == torch.device("cpu")
    assert torch.zeros_like(td).device is None


@pytest.mark.parametrize("lib", LIBS)
def test_random_like_of_float_leaves(lib):
    td = lib.TensorDict(obs=torch.zeros(50, 4), batch_size=[50])
    uniform = torch.rand_like(td)
    assert ((uniform["obs"] >= 0) & (uniform["obs"] <= 1)).all() and (uniform["obs"] != 0).any()
    assert torch.randn_like(td, dtype=torch.float64)["obs"].dtype == torch.float64


@pytest.mark.parametrize("lib", LIBS)
def test_like_of_a_lazy_stack_and_a_shared_tensordict(lib):
    members = [lib.TensorDict(obs=torch.ones(2, k + 1), batch_size=[2]) for k in range(2)]
    stack = lib.lazy_stack(members)
    zeros = torch.zeros_like(stack)
    assert isinstance(zeros, lib.LazyStackedTensorDict)
    assert [t["obs"].shape for t in zeros.tensordicts] == [(2, 1), (2, 2)]
    assert all((t["obs"] == 0).all() for t in zeros.tensordicts)
    shared = sample(lib).share_memory_()
    made = torch.ones_like(shared)
    made["obs"].add_(1)  # a new tensordict over new memory: the shared one is untouched
    assert not (shared["obs"] == 2).all()


def test_like_of_a_tensorclass_gives_the_class():
    @shared_td.tensorclass
    class Step:
        obs: torch.Tensor
        label: str

    step = Step(obs=torch.ones(3, 2), label="a", batch_size=[3])
    zeros = torch.zeros_like(step)
    assert type(zeros) is Step and zeros.label == "a" and (zeros.obs == 0).all()
