"""Audit fixes, side by side with tensordict 0.15.3: torch.stack / torch.cat of
tensordicts (errors, batch dim names) and indexed writes (non-tensor entries, error
messages, a tensor written into a nested tensordict).

Each test runs on both libraries where tensordict behaves the same; it is skipped for
tensordict when tensordict 0.15.3 is not installed.
"""
from __future__ import annotations

import pytest
import torch
from torch.utils.data import default_collate

import shared_td
from tests.reference import LIBS

# ---------------------------------------------------------------- torch.stack: leaf shapes
@pytest.mark.parametrize("lib", LIBS)
def test_stack_of_different_leaf_shapes_raises_naming_the_key(lib):
    # Before: a LazyStackedTensorDict came back silently, where tensordict raises.
    a = lib.TensorDict(obs=torch.ones(3), batch_size=[])
    b = lib.TensorDict(obs=torch.ones(4), batch_size=[])
    with pytest.raises(RuntimeError, match="obs"):
        torch.stack([a, b])


@pytest.mark.parametrize("lib", LIBS)
def test_stack_of_different_nested_leaf_shapes_raises_naming_the_key(lib):
    a = lib.TensorDict(sub=lib.TensorDict(x=torch.zeros(2, 3), batch_size=[2]), batch_size=[2])
    b = lib.TensorDict(sub=lib.TensorDict(x=torch.zeros(2, 4), batch_size=[2]), batch_size=[2])
    with pytest.raises(RuntimeError, match="x"):
        torch.stack([a, b])


def test_stack_shape_error_says_what_to_do():
    a = shared_td.TensorDict(obs=torch.ones(3), batch_size=[])
    b = shared_td.TensorDict(obs=torch.ones(4), batch_size=[])
    with pytest.raises(RuntimeError, match=r"'obs'.*\[3\].*\[4\].*lazy_stack"):
        torch.stack([a, b])
    # lazy_stack is the way to keep them as they are
    assert shared_td.lazy_stack([a, b])[1]["obs"].shape == torch.Size([4])


@pytest.mark.parametrize("lib", LIBS)
def test_collate_still_makes_a_lazy_stack_of_different_shapes(lib):
    # default_collate (collate.py) relies on the lazy fallback that torch.stack lost.
    batch = default_collate([lib.TensorDict(obs=torch.ones(3)), lib.TensorDict(obs=torch.ones(4))])
    assert type(batch) is lib.LazyStackedTensorDict and batch[1]["obs"].shape == torch.Size([4])


# ---------------------------------------------------------------- torch.stack / cat: keys
@pytest.mark.parametrize("lib", LIBS)
def test_stack_of_different_keys_is_a_runtime_error(lib):
    # Before: a KeyError (not a RuntimeError, which code ported from tensordict catches).
    with pytest.raises(RuntimeError):
        torch.stack(_of_keys_a_and_b(lib))


def test_stack_keys_error_names_the_keys():
    with pytest.raises(RuntimeError, match=r"lacks \['a'\].*extra keys \['b'\]"):
        torch.stack(_of_keys_a_and_b(shared_td))


@pytest.mark.parametrize("lib", LIBS)
def test_cat_of_different_keys_stays_a_key_error(lib):
    with pytest.raises(KeyError):
        torch.cat(_of_keys_a_and_b(lib))


def _of_keys_a_and_b(lib) -> list:
    return [lib.TensorDict(a=torch.ones(2), batch_size=[2]), lib.TensorDict(b=torch.ones(2), batch_size=[2])]


# ---------------------------------------------------------------- non-tensor indexed writes
@pytest.mark.parametrize("lib", LIBS)
def test_indexed_write_into_non_tensor_data_is_a_value_error(lib):
    # Before: AttributeError '_set_at_index'. One value for the batch cannot change at
    # one index; maybe_to_stack() gives a stack that can.
    data = lib.NonTensorData("walk", batch_size=[4])
    with pytest.raises(ValueError, match="maybe_to_stack"):
        data[1] = "run"
    assert data.data == "walk"
    stack = data.maybe_to_stack()
    assert isinstance(stack, lib.NonTensorStack)
    stack[1] = "run"
    assert stack.tolist() == ["walk", "run", "walk", "walk"]
    again = stack.maybe_to_stack()  # a new stack of the same values
    assert again is not stack and again.tolist() == stack.tolist()
    assert lib.NonTensorData("walk", batch_size=[]).maybe_to_stack().data == "walk"


@pytest.mark.parametrize("lib", LIBS)
def test_set_at_into_a_non_tensor_data_entry(lib):
    td = lib.TensorDict(obs=torch.zeros(4), batch_size=[4])
    td["task"] = "walk"
    td.set_at_("task", "run", 1)
    assert td.get("task").tolist() == ["walk", "run", "walk", "walk"]


@pytest.mark.parametrize("lib", LIBS)
def test_indexed_write_of_a_value_into_a_non_tensor_entry_through_the_tensordict(lib):
    # The way that works in both: the tensordict replaces its entry with a stack.
    td = lib.TensorDict(obs=torch.zeros(4), batch_size=[4])
    td["task"] = "walk"
    td[1] = lib.TensorDict(obs=torch.ones(()), task="run", batch_size=[])
    assert td.get("task").tolist() == ["walk", "run", "walk", "walk"]


# ---------------------------------------------------------------- td[index] = tensor
def test_a_tensor_that_does_not_fit_names_the_entry():
    # Before: "into entry a leaf".
    td = shared_td.TensorDict(obs=torch.zeros(10, 3), rew=torch.zeros(10), batch_size=[10])
    with pytest.raises(ValueError, match=r"entry 'obs'.*\[2, 3\]") as info:
        td[0:2] = torch.ones(5)
    assert isinstance(info.value, RuntimeError)  # BatchSizeMismatchError, as before
    assert td["obs"].sum() == 0 and td["rew"].sum() == 0  # nothing written


def test_a_tensor_that_does_not_fit_a_nested_leaf_names_its_full_key():
    td = shared_td.TensorDict(nested={"obs": torch.zeros(10, 3)}, rew=torch.zeros(10), batch_size=[10])
    with pytest.raises(ValueError, match=r"\('nested', 'obs'\)"):
        td[0:2] = torch.ones(5)
    with pytest.raises(ValueError, match=r"\('nested', 'obs'\)"):
        td[0:2] = shared_td.TensorDict(nested={"obs": torch.ones(2, 5)}, batch_size=[2])


@pytest.mark.parametrize("lib", LIBS)
def test_a_tensor_fits_every_leaf(lib):
    td = lib.TensorDict(obs=torch.zeros(10, 3), rew=torch.zeros(10), batch_size=[10])
    td[0:2] = torch.ones(())
    assert td["obs"].sum() == 6 and td["rew"].sum() == 2


@pytest.mark.parametrize("lib", LIBS)
def test_a_tensor_written_into_a_nested_tensordict_goes_into_every_leaf(lib):
    # Before: a TypeError refusing the tensor.
    td = lib.TensorDict(
        nested=lib.TensorDict(r=torch.zeros(10), s={"t": torch.zeros(10)}, batch_size=[10]),
        batch_size=[10],
    )
    td[0:2] = lib.TensorDict(nested=torch.ones(2), batch_size=[2])
    assert td["nested", "r"][:3].tolist() == [1.0, 1.0, 0.0]
    assert td["nested", "s", "t"][:3].tolist() == [1.0, 1.0, 0.0]


# ---------------------------------------------------------------- names
def _named(lib):
    return lib.TensorDict(obs=torch.zeros(4, 3), batch_size=[4, 3], names=["time", "env"])


def _names(td):
    names = td.names  # shared_td: None when unnamed; tensordict: a None per dim
    return None if names is None or all(n is None for n in names) else list(names)


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("dim, names", [(0, [None, "time", "env"]), (1, ["time", None, "env"]),
                                        (-1, ["time", "env", None])])
def test_stack_keeps_the_batch_dim_names(lib, dim, names):
    # Before: the names were dropped.
    assert _names(torch.stack([_named(lib), _named(lib)], dim)) == names


@pytest.mark.parametrize("lib", LIBS)
def test_stack_of_differently_named_tensordicts_is_unnamed(lib):
    other = lib.TensorDict(obs=torch.zeros(4, 3), batch_size=[4, 3])
    assert _names(torch.stack([_named(lib), other])) is None


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("dim", [0, 1])
def test_cat_keeps_the_batch_dim_names(lib, dim):
    assert _names(torch.cat([_named(lib), _named(lib)], dim)) == ["time", "env"]


@pytest.mark.parametrize("lib", LIBS)
def test_nested_names_are_kept_by_stack_and_cat(lib):
    td = lib.TensorDict(
        sub=lib.TensorDict(x=torch.zeros(4, 3, 2), batch_size=[4, 3, 2], names=["time", "env", "k"]),
        batch_size=[4, 3], names=["time", "env"],
    )
    assert _names(torch.stack([td, td])["sub"]) == [None, "time", "env", "k"]
    assert _names(torch.cat([td, td])["sub"]) == ["time", "env", "k"]
