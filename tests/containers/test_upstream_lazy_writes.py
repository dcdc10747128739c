"""Writes and reads of a LazyStackedTensorDict that tensordict's test_lazy.py checks:
found by running its tests against shared_td.

* ``lazy.set_at_(key, value, index)`` wrote into a stacked copy of the entry and
  dropped it: nothing reached the members, silently.
* An index that keeps no member (an all-False mask, ``lazy[2:2]``) gave a lazy stack
  without any key, so ``result["obs"]`` raised a KeyError.
* A 0-d bool tensor inside a tuple (``lazy[(torch.tensor(True),)]``) selected nothing,
  or moved the batch dims.
"""
from __future__ import annotations

import pytest
import torch

from tests.reference import LIBS

def episode_stack(lib, stack_dim):
    """Three rows of [4, 2] observations, stacked lazily along ``stack_dim``."""
    dense = lib.TensorDict(
        {"obs": torch.arange(24.0).view(3, 4, 2), "reward": torch.arange(12).view(3, 4)}, [3, 4]
    )
    return dense, lib.LazyStackedTensorDict.lazy_stack(dense.clone().unbind(stack_dim), stack_dim)


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("stack_dim", [0, 1])
@pytest.mark.parametrize("index", [
    (slice(None), 1),
    (torch.tensor([0, 2]), 3),
    (Ellipsis, 0),  # read on the entry, as torch does: the last dim of "obs"
    torch.tensor([True, False, True]),
], ids=["column", "rows-and-column", "ellipsis", "mask"])
def test_set_at_reaches_the_members(lib, stack_dim, index):
    dense, lazy = episode_stack(lib, stack_dim)
    value = -1 - dense["obs"][index]
    lazy.set_at_("obs", value, index)
    dense.set_at_("obs", value, index)
    assert torch.equal(lazy["obs"], dense["obs"])
    assert torch.equal(lazy["reward"], dense["reward"])


@pytest.mark.parametrize("lib", LIBS)
def test_set_at_writes_only_the_selected_elements(lib):
    """Another writer's change to an element outside the index is kept (the write does
    not copy the whole entry back)."""
    _, lazy = episode_stack(lib, 0)
    member = lazy.tensordicts[2]
    lazy.set_at_("reward", torch.tensor([-1, -2]), (slice(0, 2), 0))
    member["reward"][3] = 100  # as if written by another process meanwhile
    lazy.set_at_("reward", -5, (0, 1))
    assert lazy.tensordicts[0]["reward"].tolist() == [-1, -5, 2, 3]
    assert lazy.tensordicts[1]["reward"].tolist() == [-2, 5, 6, 7]
    assert member["reward"].tolist() == [8, 9, 10, 100]


@pytest.mark.parametrize("lib", LIBS)
def test_set_at_of_ragged_and_non_tensor_entries(lib):
    lazy = lib.LazyStackedTensorDict(
        lib.TensorDict({"obs": torch.zeros(2, 3), "task": "walk"}, [2]),
        lib.TensorDict({"obs": torch.zeros(2, 5), "task": "walk"}, [2]),
    )
    lazy.set_at_("obs", 1.0, (1, 0))
    lazy.set_at_("task", "run", 0)
    assert lazy.tensordicts[0]["obs"].sum() == 0
    assert lazy.tensordicts[1]["obs"][0].tolist() == [1.0] * 5
    assert lazy.tensordicts[1]["obs"][1].sum() == 0
    assert lazy.get("task").tolist() == [["run", "run"], ["walk", "walk"]]


@pytest.mark.parametrize("lib", LIBS)
def test_set_at_errors_leave_the_members_unchanged(lib):
    _, lazy = episode_stack(lib, 0)
    before = lazy["obs"].clone()
    with pytest.raises(RuntimeError):
        lazy.set_at_("obs", torch.zeros(7), (slice(None), 0))
    assert torch.equal(lazy["obs"], before)
    with pytest.raises(KeyError):
        lazy.set_at_("missing", 0.0, 0)


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("stack_dim", [0, 1])
@pytest.mark.parametrize("selection", ["mask", "slice", "empty list"])
def test_selecting_no_member_keeps_the_keys(lib, stack_dim, selection):
    """``lazy[done]`` where nothing is done: an empty TensorDict with the keys and names
    of the dense copy, not a stack without keys."""
    lazy = lib.LazyStackedTensorDict(
        *[lib.TensorDict({"obs": torch.zeros(4, 2), "next": {"r": torch.zeros(4)}}, [4], names=["t"])
          for _ in range(3)],
        stack_dim=stack_dim, stack_dim_name="env",
    )
    along_stack = {"mask": torch.zeros(3, dtype=torch.bool), "slice": slice(2, 2), "empty list": []}[selection]
    index = (slice(None),) * stack_dim + (along_stack,)
    expected = lazy.to_tensordict()[index]
    result = lazy[index]
    assert type(result) is lib.TensorDict
    assert result.batch_size == expected.batch_size
    assert result.names == expected.names
    assert result["obs"].shape == expected["obs"].shape
    assert result["next", "r"].shape == expected["next", "r"].shape


@pytest.mark.parametrize("lib", LIBS)
def test_selecting_no_member_of_a_heterogeneous_stack(lib):
    lazy = lib.LazyStackedTensorDict(
        lib.TensorDict({"obs": torch.zeros(4, 1), "only0": torch.zeros(4)}, [4]),
        lib.TensorDict({"obs": torch.zeros(4, 2), "only1": torch.zeros(4)}, [4]),
    )
    empty = lazy[torch.zeros(2, dtype=torch.bool)]
    assert set(empty.keys()) == {"obs"}  # the shared keys, shaped as the first member's
    assert empty["obs"].shape == (0, 4, 1)


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("stack_dim", [0, 1])
def test_zero_dim_bool_tensor_in_a_tuple(lib, stack_dim):
    dense, lazy = episode_stack(lib, stack_dim)
    for index in [(torch.tensor(True),), (torch.tensor(True), 0), (slice(None), torch.tensor(True))]:
        result, expected = lazy[index], dense[index]
        assert result.batch_size == expected.batch_size, index
        assert torch.equal(result["obs"], expected["obs"]), index
    assert lazy[(torch.tensor(False),)].batch_size == dense[(torch.tensor(False),)].batch_size
