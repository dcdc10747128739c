"""``td[index] = other`` over the cached plan (containers/row_writes.py): every structural
change between two writes still sends the next write to the right tensors, and the
errors after a cached write still name the key and the shapes, with nothing written."""
from __future__ import annotations

import pytest
import torch
from shared_td import BatchSizeMismatchError, LockedTensorDictError, TensorDict


def buffer(rows: int = 6) -> TensorDict:
    return TensorDict(
        {"obs": torch.zeros(rows, 3), "done": torch.zeros(rows, 1, dtype=torch.bool),
         "next": {"obs": torch.zeros(rows, 3)}},
        batch_size=[rows],
    )


def step(value: float) -> TensorDict:
    return TensorDict(
        {"obs": torch.full((3,), value), "done": torch.ones(1, dtype=torch.bool),
         "next": {"obs": torch.full((3,), value + 0.5)}},
        batch_size=[],
    )


def warm(td: TensorDict) -> None:
    """Two writes of the same structure: the plan is made, then used."""
    td[0] = step(1.0)
    td[1] = step(2.0)
    assert td._row_write_plan is not None
    assert td["obs"][1].tolist() == [2.0] * 3 and td["next", "obs"][1].tolist() == [2.5] * 3


def test_the_plan_is_used_for_ints_slices_and_index_tensors():
    td = buffer()
    warm(td)
    plan = td._row_write_plan
    td[2:4] = TensorDict(
        {"obs": torch.full((2, 3), 3.0), "done": torch.ones(2, 1, dtype=torch.bool),
         "next": {"obs": torch.full((2, 3), 3.5)}}, batch_size=[2])
    td[torch.tensor([5, 4])] = TensorDict(
        {"obs": torch.tensor([[5.0] * 3, [4.0] * 3]), "done": torch.ones(2, 1, dtype=torch.bool),
         "next": {"obs": torch.full((2, 3), 9.0)}}, batch_size=[2])
    assert td._row_write_plan is plan  # same structure: no new plan
    assert td["obs"][:, 0].tolist() == [1.0, 2.0, 3.0, 3.0, 4.0, 5.0]
    assert td["next", "obs"][:, 0].tolist() == [1.5, 2.5, 3.5, 3.5, 9.0, 9.0]


@pytest.mark.parametrize(
    "change",
    [
        lambda td: td.set("obs", torch.zeros(6, 3)),  # a leaf replaced
        lambda td: td.set("next", TensorDict({"obs": torch.zeros(6, 3)}, batch_size=[6])),  # a node replaced
        lambda td: td["next"].set("obs", torch.zeros(6, 3)),  # a nested leaf replaced through the node
        lambda td: td.rename_key_("obs", "o").rename_key_("o", "obs"),
        lambda td: td.del_("obs").set("obs", torch.zeros(6, 3)),
        lambda td: td.select("obs", "done", "next", inplace=True),  # a new dict for the root
        lambda td: td.lock_().unlock_(),
        lambda td: td.memmap_(),  # leaves swapped for memory-mapped ones, locked
        lambda td: td.share_memory_(),
    ],
    ids=["replace leaf", "replace node", "replace nested leaf", "rename", "del and add", "select inplace",
         "lock unlock", "memmap_", "share_memory_"],
)
def test_a_write_after_a_structural_change_lands_in_the_current_leaves(change):
    td = buffer()
    warm(td)
    old_obs, old_next = td["obs"], td["next", "obs"]
    change(td)
    td[3] = step(7.0)
    assert td["obs"][3].tolist() == [7.0] * 3 and td["next", "obs"][3].tolist() == [7.5] * 3
    assert td["done"][3].item() is True
    if td["obs"] is not old_obs:
        assert old_obs[3].tolist() == [0.0] * 3  # nothing went to a tensor no longer there
    if td["next", "obs"] is not old_next:
        assert old_next[3].tolist() == [0.0] * 3


def test_a_write_after_memmap_reaches_the_files(tmp_path):
    td = buffer()
    warm(td)
    td.memmap_(tmp_path / "buf")
    td[4] = step(8.0)
    again = TensorDict.load_memmap(tmp_path / "buf")
    assert again["obs"][4].tolist() == [8.0] * 3 and again["next", "obs"][4].tolist() == [8.5] * 3


def test_a_leaf_resized_in_place_is_checked_again():
    td = buffer()
    warm(td)
    td["obs"].resize_(6, 5)  # same tensor object, new shape
    with pytest.raises(BatchSizeMismatchError, match=r"shape \[3\] into entry 'obs'.*expected shape \[5\]"):
        td[3] = step(1.0)


def test_a_batch_size_change_is_seen():
    td = TensorDict({"obs": torch.zeros(4, 2, 3)}, batch_size=[4, 2])
    td[0] = TensorDict({"obs": torch.ones(2, 3)}, batch_size=[2])
    td.batch_size = [4]
    td[1] = TensorDict({"obs": torch.full((2, 3), 2.0)}, batch_size=[])
    assert td["obs"][:2, :, 0].tolist() == [[1.0, 1.0], [2.0, 2.0]]


def test_after_a_cached_write_a_mismatched_shape_names_key_and_shapes_and_writes_nothing(unchanged):
    td = buffer().memmap_()
    warm(td)
    bad = step(1.0)
    bad["next"] = TensorDict({"obs": torch.ones(4)}, batch_size=[])  # the last leaf is wrong
    # obs and done of row 2 are not written either
    with unchanged(td), pytest.raises(BatchSizeMismatchError) as info:
        td[2] = bad
    message = str(info.value)
    assert "'obs'" in message and "[4]" in message and "[3]" in message


def test_after_a_cached_write_a_new_key_on_a_locked_buffer_names_the_key(unchanged):
    td = buffer().memmap_()
    warm(td)
    extra = step(1.0)
    extra["reward"] = torch.ones(1)
    with unchanged(td), pytest.raises(LockedTensorDictError, match="reward"):
        td[2] = extra


def test_after_a_cached_write_a_new_key_on_an_unlocked_buffer_is_added():
    td = buffer()
    warm(td)
    extra = step(1.0)
    extra["reward"] = torch.ones(1)
    td[2] = extra
    assert td["reward"][:, 0].tolist() == [0.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    td[3] = step(4.0)  # the old structure again: a plan for it
    assert td["obs"][3].tolist() == [4.0] * 3 and td["reward"][3].item() == 0.0


def test_a_source_broadcast_or_with_non_tensors_still_writes():
    td = buffer()
    warm(td)
    wide = TensorDict({"obs": torch.ones(1, 3), "next": {"obs": torch.full((3,), 6.0)}}, batch_size=[])
    with pytest.raises(BatchSizeMismatchError, match=r"batch size \[2\]"):
        td[2:4] = wide  # a source's batch dims never broadcast (as tensordict)
    td[2:4] = TensorDict({"obs": torch.ones(2, 3), "next": {"obs": torch.full((2, 3), 6.0)}},
                         batch_size=[2])  # done is not written
    assert td["obs"][2:4].tolist() == [[1.0] * 3] * 2 and td["done"][2:4].sum() == 0
    with_text = step(5.0)
    with_text["task"] = "walk"
    td[5] = with_text  # a non-tensor: the general write
    assert td["obs"][5].tolist() == [5.0] * 3 and td[5]["task"] == "walk"


def test_the_plan_is_not_pickled():
    import pickle

    td = buffer()
    warm(td)
    clone = pickle.loads(pickle.dumps(td))
    assert clone._row_write_plan is None
    clone[4] = step(3.0)
    assert clone["obs"][4].tolist() == [3.0] * 3 and td["obs"][4].tolist() == [0.0] * 3


class _Recorded(torch.Tensor):
    """A tensor subclass that overrides torch: every torch call on it is recorded."""

    calls: list = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.calls.append(getattr(func, "__name__", str(func)))
        return super().__torch_function__(func, types, args, kwargs or {})


@pytest.mark.parametrize("where", ["source", "destination"])
def test_a_tensor_subclass_keeps_its_torch_function_on_cached_writes(where):
    # the fast lane skips torch's __torch_function__ lookup only where no tensor overrides it
    td = buffer()
    if where == "destination":
        td.set("obs", torch.zeros(6, 3).as_subclass(_Recorded))
    warm(td)
    source = step(5.0)
    if where == "source":
        source.set("obs", torch.full((3,), 5.0).as_subclass(_Recorded))
    _Recorded.calls.clear()
    td[4] = source
    td[5] = source
    assert _Recorded.calls.count("__setitem__") == 2, _Recorded.calls
    assert td["obs"][4:].tolist() == [[5.0] * 3] * 2
