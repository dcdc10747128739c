"""Locking, share_memory_() and pickling."""
from __future__ import annotations

import pickle

import pytest
import torch

from shared_td import LockedTensorDictError, NonTensorData, TensorDict


def make_td() -> TensorDict:
    td = TensorDict(
        {"obs": torch.arange(6.0).reshape(3, 2), "nested": {"x": torch.arange(3), "deeper": {"y": torch.zeros(3)}}},
        batch_size=[3],
    )
    td["task"] = "walk"
    return td


def test_lock_unlock_flags():
    td = make_td()
    assert not td.is_locked
    assert td.lock_() is td and td.is_locked
    assert td["nested"].is_locked and td["nested", "deeper"].is_locked
    assert td.unlock_() is td and not td.is_locked and not td["nested", "deeper"].is_locked
    td.is_locked = True
    assert td.is_locked and td["nested"].is_locked
    td.is_locked = False
    assert not td["nested"].is_locked
    assert TensorDict(a=torch.zeros(()), lock=True).is_locked


def test_nested_cannot_unlock_while_parent_locked():
    td = make_td().lock_()
    with pytest.raises(RuntimeError, match="parent"):
        td["nested"].unlock_()
    assert td["nested"].is_locked
    td["nested"].lock_()  # locking again is fine
    td.unlock_()
    td["nested"].lock_().unlock_()


def test_unlock_context_relocks():
    td = make_td().lock_()
    with td.unlock_():
        assert not td.is_locked and not td["nested"].is_locked
        td["new"] = torch.zeros(3)
        td["nested", "new"] = torch.zeros(3)
    assert td.is_locked and td["nested"].is_locked and td["nested", "new"] is not None
    with pytest.raises(ZeroDivisionError):
        with td.unlock_():
            1 / 0
    assert td.is_locked  # re-locked although the block raised


def test_lock_context_unlocks():
    td = make_td()
    with td.lock_():
        assert td.is_locked
    assert not td.is_locked and not td["nested"].is_locked


def test_entries_added_later_get_locked():
    td = make_td()
    td["other"] = TensorDict(z=torch.zeros(3), batch_size=[3])
    td.lock_()
    assert td["other"].is_locked


REFUSED = {
    "add": (lambda td: td.set("new", torch.zeros(3)), "'new'"),
    "add via setitem": (lambda td: td.__setitem__("new", torch.zeros(3)), "'new'"),
    "replace": (lambda td: td.set("obs", torch.zeros(3, 2)), "'obs'"),
    "replace non-tensor": (lambda td: td.set("task", "run"), "'task'"),
    "add nested": (lambda td: td.set(("nested", "new"), torch.zeros(3)), "'new'"),
    "add new branch": (lambda td: td.set(("branch", "leaf"), torch.zeros(3)), "'branch'"),
    "add to child": (lambda td: td["nested"].set("new", torch.zeros(3)), "'new'"),
    "delete": (lambda td: td.__delitem__("obs"), "'obs'"),
    "delete nested": (lambda td: td.del_(("nested", "x")), "x"),
    "pop": (lambda td: td.pop("obs"), "'obs'"),
    "update": (lambda td: td.update({"obs": torch.zeros(3, 2)}), "'obs'"),
    "update adds": (lambda td: td.update({"obs": torch.zeros(3, 2), "new": torch.zeros(3)}, inplace=True), "'new'"),
    "rename": (lambda td: td.rename_key_("obs", "moved"), "'obs'"),
    "select inplace": (lambda td: td.select("obs", inplace=True), "remove"),
    "exclude inplace": (lambda td: td.exclude("obs", inplace=True), "'obs'"),
    "flatten inplace": (lambda td: td.flatten_keys(inplace=True), "flatten"),
    "index write adds": (lambda td: td.__setitem__(0, TensorDict(new=torch.zeros(()))), "'new'"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_locked_refuses_structural_changes(unchanged, name):
    op, match = REFUSED[name]
    td = make_td().lock_()
    with unchanged(td), pytest.raises(RuntimeError, match=match) as info:
        op(td)
    assert isinstance(info.value, LockedTensorDictError)
    assert "set_()" in str(info.value) and "locked" in str(info.value)


def test_locked_allows_in_place_writes():
    td = make_td().lock_()
    obs = td["obs"]
    td.set_("obs", torch.ones(3, 2))
    td.set("obs", torch.full((3, 2), 2.0), inplace=True)
    td.update_({"nested": {"x": torch.tensor([5, 6, 7])}})
    td.update({"nested": {"deeper": {"y": torch.ones(3)}}}, inplace=True)
    td[0] = TensorDict({"obs": torch.full((2,), 9.0)}, batch_size=[])
    td["nested"][1] = {"x": torch.tensor(0)}
    td.set_("task", "run")
    td.apply(lambda x: x * 1, inplace=True)
    assert td["obs"] is obs and obs.tolist() == [[9, 9], [2, 2], [2, 2]]
    assert td["nested", "x"].tolist() == [5, 0, 7] and td["nested", "deeper", "y"].sum() == 3
    assert td["task"] == "run"
    td.zero_()
    td.fill_("obs", 1.0)
    td.copy_(make_td())
    assert obs.sum() == 15 and td.is_locked


def test_views_and_copies_of_locked():
    td = make_td().lock_()
    assert not td.clone().is_locked and not td.clone()["nested"].is_locked
    assert not td[[0, 1]].is_locked  # an advanced index gives a copy
    assert td.to(torch.float64).is_locked  # a copy of a locked tree, locked as in tensordict 0.15.3
    copy = td.clone()
    copy["new"] = torch.zeros(3)  # a copy is free


# ----------------------------------------------------------------------------- shared memory
def test_share_memory():
    td = make_td()
    obs = td["obs"].clone()
    assert not td.is_shared()
    assert td.share_memory_() is td
    assert td.is_shared() and td.is_locked and td["nested"].is_locked
    assert td["obs"].is_shared() and td["nested", "x"].is_shared() and td["nested", "deeper", "y"].is_shared()
    assert td["nested"].is_shared()
    assert torch.equal(td["obs"], obs) and td["task"] == "walk"
    with pytest.raises(RuntimeError, match="'new'"):
        td["new"] = torch.zeros(3)
    td.set_("obs", torch.zeros(3, 2))  # in place: stays in shared memory
    assert td["obs"].is_shared() and not td["obs"].any()
    td.unlock_()
    assert not td.is_shared()


def test_share_memory_visible_to_views():
    td = make_td().share_memory_()
    row = td[1]
    row["obs"].fill_(-1)
    assert td["obs"][1].tolist() == [-1.0, -1.0]
    assert row["obs"].is_shared()


# ----------------------------------------------------------------------------- pickling
@pytest.mark.parametrize("locked", [False, True])
def test_pickle_round_trip(locked):
    td = make_td()
    td["nested", "note"] = NonTensorData({"k": 1}, batch_size=[3])
    td.names = ["time"]
    if locked:
        td.lock_()
    back = pickle.loads(pickle.dumps(td))
    assert back.is_locked == locked and back["nested", "deeper"].is_locked == locked
    assert back.batch_size == td.batch_size and back.names == ["time"]
    assert set(back.keys(True)) == set(td.keys(True))
    assert (back == td).all()
    assert back["task"] == "walk" and back["nested", "note"] == {"k": 1}
    assert back["obs"] is not td["obs"]
    if locked:
        with pytest.raises(RuntimeError, match="'new'"):
            back["new"] = torch.zeros(3)
        with pytest.raises(RuntimeError, match="parent"):
            back["nested"].unlock_()
        back.unlock_()
    back["new"] = torch.zeros(3)
    with back.lock_():
        pass


def test_pickle_shared_and_stacked():
    td = make_td().share_memory_()
    back = pickle.loads(pickle.dumps(td))
    assert back.is_locked and torch.equal(back["obs"], td["obs"])
    stacked = torch.stack([make_td(), make_td()]).lock_()
    back = pickle.loads(pickle.dumps(stacked))
    assert back.batch_size == torch.Size([2, 3]) and back[1, 2]["task"] == "walk" and back.is_locked
