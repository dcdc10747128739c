"""TensorDict: construction, the mapping API, conversions and whole-tensordict ops."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from shared_td import (
    BatchSizeMismatchError,
    KeyTypeError,
    NonTensorData,
    TensorDict,
    default_is_leaf,
    is_leaf_nontensor,
)


def make_td() -> TensorDict:
    return TensorDict(
        {"obs": torch.arange(12.0).reshape(3, 4), "nested": {"x": torch.arange(3)}, "reward": torch.ones(3, 1)},
        batch_size=[3],
    )


# ----------------------------------------------------------------------------- construction
def test_construct_from_source_and_kwargs():
    both = TensorDict({"a": torch.zeros(3)}, batch_size=[3], b=torch.ones(3))
    assert sorted(both.keys()) == ["a", "b"]
    td = make_td()
    assert td.batch_size == torch.Size([3]) and td.shape == td.batch_size
    assert td.ndim == td.batch_dims == td.dim() == 1
    assert td.device is None and td.names is None
    assert isinstance(td["nested"], TensorDict)
    assert td["nested"].batch_size == torch.Size([3])
    assert sorted(td.keys()) == ["nested", "obs", "reward"]
    assert TensorDict().batch_size == torch.Size([]) and TensorDict().is_empty()


@pytest.mark.parametrize("batch_size", [3, [3], (3,), torch.Size([3]), np.int64(3), torch.tensor([3])])
def test_batch_size_forms(batch_size):
    assert TensorDict(a=torch.zeros(3, 2), batch_size=batch_size).batch_size == torch.Size([3])


def test_device_and_names_arguments():
    td = TensorDict(a=torch.zeros(2, 3), batch_size=[2, 3], device="cpu", names=["env", "time"])
    assert td.device == torch.device("cpu") and td["a"].device.type == "cpu"
    assert td.names == ["env", "time"]
    assert td.size() == torch.Size([2, 3]) and td.size(1) == 3 and td.numel() == 6


def test_python_values_become_tensors():
    td = TensorDict(f=1.5, i=3, b=True, lst=[1, 2, 3], arr=np.arange(4.0))
    assert td["f"].dtype == torch.float32 and td["f"].shape == torch.Size([])
    assert td["i"].dtype == torch.int64 and td["b"].dtype == torch.bool
    assert torch.equal(td["lst"], torch.tensor([1, 2, 3]))
    assert td["arr"].dtype == torch.float64 and td["arr"].shape == torch.Size([4])


def test_batch_mismatch_names_key_and_shapes():
    with pytest.raises(ValueError, match=r"'a'.*\[2\].*\[3\]") as info:
        TensorDict(a=torch.zeros(2), batch_size=[3])
    # Both a ValueError (the issue) and a RuntimeError (what tensordict raises).
    assert isinstance(info.value, RuntimeError) and isinstance(info.value, BatchSizeMismatchError)
    with pytest.raises(ValueError, match="'deep'"):
        TensorDict({"outer": {"deep": torch.zeros(2)}}, batch_size=[3])
    with pytest.raises(ValueError, match="'s'"):
        TensorDict(s=1.0, batch_size=[3])  # a scalar has no batch dims


@pytest.mark.parametrize("key", [1, 1.5, None, ("a", 1), b"a"])
def test_non_str_keys_are_refused(key):
    with pytest.raises(TypeError, match="str") as info:
        TensorDict({key: torch.zeros(())})
    assert isinstance(info.value, KeyError) and isinstance(info.value, KeyTypeError)


@pytest.mark.parametrize(
    "batch_size, error", [("abc", TypeError), ([-1], ValueError), ([1.5, "x"], TypeError)]
)
def test_bad_batch_size_argument(batch_size, error):
    with pytest.raises(error, match="batch_size"):
        TensorDict(a=torch.zeros(3), batch_size=batch_size)


def test_bad_names_argument():
    with pytest.raises(ValueError, match="names"):
        TensorDict(a=torch.zeros(3), batch_size=[3], names=["x", "y"])


# ----------------------------------------------------------------------------- get / set
def test_get_nested_and_default():
    td = make_td()
    assert td["nested", "x"] is td["nested"]["x"] is td.get(("nested", "x"))
    assert td.get(("nested", ("x",))) is td["nested", "x"]  # nested tuples flatten
    assert td.get("missing", None) is None and td.get(("nested", "missing"), 7) == 7
    assert td.get(("obs", "deeper"), "default") == "default"  # a tensor has no keys


def test_get_unknown_key_names_it():
    td = make_td()
    with pytest.raises(KeyError, match="'missing'.*obs"):
        td["missing"]
    with pytest.raises(KeyError, match=r"\('nested', 'missing'\)"):
        td["nested", "missing"]
    assert td.get(("nested", "missing")) is None
    with pytest.raises(TypeError, match="3"):
        td.get(3)


def test_set_creates_and_replaces():
    td = make_td()
    assert td.set(("new", "deep", "leaf"), torch.zeros(3, 2)) is td
    assert isinstance(td["new", "deep"], TensorDict) and td["new", "deep"].batch_size == torch.Size([3])
    replacement = torch.full((3, 4), 5.0)
    td["obs"] = replacement
    assert td["obs"] is replacement


def test_set_through_a_leaf_is_refused(unchanged):
    td = make_td()
    td["task"] = "walk"
    for key in [("obs", "x"), ("task", "x")]:
        with unchanged(td), pytest.raises(KeyError, match=repr(key[0])):
            td.set(key, torch.zeros(3))


def test_set_mismatch_leaves_unchanged(unchanged):
    td = make_td()
    with unchanged(td), pytest.raises(ValueError, match="'obs'"):
        td["obs"] = torch.zeros(4, 4)
    with unchanged(td), pytest.raises(ValueError, match="'new'"):
        td.set(("nested", "new"), torch.zeros(2))
    with unchanged(td), pytest.raises(TypeError):
        td.set(("nested", 3), torch.zeros(3))
    with unchanged(td), pytest.raises(ValueError, match="empty tuple"):
        td.set((), torch.zeros(3))


def test_set_in_place_keeps_storage():
    td = make_td()
    obs = td["obs"]
    td.set_("obs", torch.ones(3, 4))
    assert td["obs"] is obs and bool((obs == 1).all())
    td.set("obs", torch.full((3, 4), 2.0), inplace=True)
    assert td["obs"] is obs and bool((obs == 2).all())
    td.set_(("nested", "x"), torch.tensor([7, 8, 9]))
    assert td["nested", "x"].tolist() == [7, 8, 9]
    td.set_("obs", torch.zeros(3, 1))  # feature dims broadcast, as copy_ does
    assert not obs.any()


def test_set_in_place_failures_leave_unchanged(unchanged):
    td = make_td()
    with unchanged(td), pytest.raises(KeyError, match="'missing'.*set\\(\\)"):
        td.set_("missing", torch.zeros(3))
    with unchanged(td), pytest.raises(ValueError, match="'obs'"):
        td.set_("obs", torch.zeros(3, 5))
    with unchanged(td), pytest.raises(TypeError, match="'obs'"):
        td.set_("obs", "text")
    with unchanged(td), pytest.raises(TypeError, match="'nested'"):
        td.set_("nested", torch.zeros(3))


def test_delete_and_pop():
    td = make_td()
    del td["obs"]
    assert "obs" not in td
    x = td["nested", "x"]
    assert td.pop(("nested", "x")) is x and ("nested", "x") not in td
    assert td.pop("missing", 3) == 3
    assert td.del_("reward") is td and "reward" not in td


def test_delete_missing_key(unchanged):
    td = make_td()
    with unchanged(td), pytest.raises(KeyError, match="'missing'"):
        del td["missing"]
    with unchanged(td), pytest.raises(KeyError, match="'missing'"):
        td.pop(("nested", "missing"))


def test_contains():
    td = make_td()
    assert "obs" in td and ("nested", "x") in td and ("nested",) in td
    assert "x" not in td and ("obs", "x") not in td
    with pytest.raises(TypeError, match="keys"):
        _ = 3 in td


# ----------------------------------------------------------------------------- keys / values / items
def test_keys_values_items():
    td = make_td()
    td["task"] = "walk"
    assert set(td.keys()) == {"obs", "nested", "reward", "task"}
    assert set(td.keys(include_nested=True)) == {"obs", "nested", ("nested", "x"), "reward", "task"}
    # as tensordict 0.15.3: leaves are tensors, unless is_leaf says otherwise
    assert set(td.keys(True, True)) == {"obs", ("nested", "x"), "reward"}
    assert set(td.keys(leaves_only=True)) == {"obs", "reward"}
    assert set(td.keys(True, True, is_leaf_nontensor)) == {"obs", ("nested", "x"), "reward", "task"}
    assert len(td.keys(True, True)) == 3
    items = dict(td.items(True, True, is_leaf=is_leaf_nontensor))
    assert items["obs"] is td["obs"] and isinstance(items["task"], NonTensorData)
    assert len(list(td.values())) == 4
    assert [v.shape for v in td.values(True, True, sort=True)] == [(3,), (3, 4), (3, 1)]
    # a custom is_leaf: nested tensordicts listed whole, not walked into
    whole = lambda cls: default_is_leaf(cls) or issubclass(cls, TensorDict)  # noqa: E731
    assert set(td.keys(True, True, whole)) == {"obs", "nested", "reward"}
    assert default_is_leaf(torch.Tensor) and not default_is_leaf(NonTensorData)
    assert not default_is_leaf(TensorDict) and is_leaf_nontensor(NonTensorData)


def test_a_walk_lists_the_entries_as_they_were_when_it_reached_each_node():
    """Entries set or deleted while the keys, values or items are walked do not break
    the walk (each node's entries are read as one copy when the walk reaches it)."""
    td = make_td()
    seen = []
    for key, _value in td.items(True, True):
        seen.append(key)
        td[f"added_{len(seen)}"] = torch.zeros(3)  # a dict iterated directly raises here
        td.pop("reward", None)
    assert seen == ["obs", ("nested", "x"), "reward"]
    assert {"added_1", "added_2", "added_3"} <= set(td.keys()) and "reward" not in td.keys()
    for key in td.keys(True):
        td.pop(key) if isinstance(key, str) else None
    assert list(td.keys()) == []


# ----------------------------------------------------------------------------- update
def test_update_merges_nested():
    td = make_td()
    td.update({"nested": {"y": torch.zeros(3)}, "extra": torch.zeros(3), ("deep", "z"): torch.ones(3)})
    assert set(td.keys(True, True)) >= {("nested", "x"), ("nested", "y"), "extra", ("deep", "z")}
    other = TensorDict(obs=torch.zeros(3, 4), batch_size=[3])
    obs = td["obs"]
    td.update(other, inplace=True)
    assert td["obs"] is obs and not obs.any()
    td.update(TensorDict(obs=torch.ones(3, 4), batch_size=[3]))
    assert td["obs"] is not obs


def test_update_keys_to_update():
    td = make_td()
    td.update(
        {"obs": torch.zeros(3, 4), "nested": {"x": torch.zeros(3, dtype=torch.int64), "y": torch.zeros(3)}},
        keys_to_update=[("nested", "x")],
    )
    assert td["obs"].sum() == 66 and td["nested", "x"].tolist() == [0, 0, 0]
    assert ("nested", "y") not in td


@pytest.mark.parametrize(
    "other, error",
    [
        ({"new": torch.zeros(3), "obs": torch.zeros(2)}, ValueError),
        ({"nested": {"new": torch.zeros(3), "x": torch.zeros(5)}}, ValueError),
        ({"z": torch.zeros(3), ("obs", "sub"): torch.zeros(3)}, KeyError),
        ({"z": torch.zeros(3), 5: torch.zeros(3)}, TypeError),
    ],
)
def test_failing_update_changes_nothing(unchanged, other, error):
    td = make_td()
    with unchanged(td), pytest.raises(error):
        td.update(other)
    with unchanged(td), pytest.raises(error):
        td.update(other, inplace=True)


def test_update_in_place_writes():
    td = make_td()
    obs, x = td["obs"], td["nested", "x"]
    td.update_({"obs": torch.zeros(3, 4), "nested": {"x": torch.tensor([4, 5, 6])}})
    assert td["obs"] is obs and not obs.any() and x.tolist() == [4, 5, 6]
    td.update_(TensorDict(reward=torch.full((3, 1), 2.0), batch_size=[3]))
    assert td["reward"].sum() == 6
    td.copy_(make_td())
    assert obs.sum() == 66 and x.tolist() == [0, 1, 2]


@pytest.mark.parametrize(
    "other, error, match",
    [
        ({"nested": {"x": torch.full((3,), 100)}, "obs": torch.zeros(2)}, ValueError, "'obs'"),
        ({"obs": torch.zeros(3, 4), "nested": {"x": torch.zeros(2)}}, ValueError, "'x'"),
        ({"obs": torch.zeros(3, 4), "nested": {"missing": torch.zeros(3)}}, KeyError, "missing.*update"),
        ({"obs": torch.zeros(3, 4), "missing": torch.zeros(3)}, KeyError, "'missing'"),
        ({"obs": torch.zeros(3, 4), "reward": torch.zeros(3, 7)}, ValueError, "'reward'"),
        ({"obs": torch.zeros(3, 4), "nested": torch.zeros(3)}, TypeError, "'nested'"),
    ],
)
def test_failing_update_in_place_changes_nothing(unchanged, other, error, match):
    td = make_td()
    with unchanged(td), pytest.raises(error, match=match):
        td.update_(other)


# ----------------------------------------------------------------------------- select / exclude / rename
def test_select_and_exclude():
    td = make_td()
    selected = td.select("obs", ("nested", "x"))
    assert set(selected.keys(True, True)) == {"obs", ("nested", "x")}
    assert selected["obs"] is td["obs"]  # shares the tensors
    with pytest.raises(KeyError, match="'missing'"):
        td.select("obs", "missing")
    assert set(td.select("obs", "missing", strict=False).keys()) == {"obs"}
    excluded = td.exclude("obs", ("nested", "x"), "missing")
    assert set(excluded.keys(True)) == {"nested", "reward"} and "obs" in td
    assert ("nested", "x") in td
    td.exclude("reward", inplace=True)
    assert "reward" not in td
    td.select("obs", inplace=True)
    assert list(td.keys()) == ["obs"]


def test_rename_key():
    td = make_td()
    obs = td["obs"]
    assert td.rename_key_("obs", ("moved", "obs")) is td
    assert td["moved", "obs"] is obs and "obs" not in td
    with pytest.raises(KeyError, match="'missing'"):
        td.rename_key_("missing", "b")
    with unchanged_keys(td), pytest.raises(KeyError, match="'reward'.*safe"):
        td.rename_key_(("moved", "obs"), "reward", safe=True)


class unchanged_keys:
    def __init__(self, td):
        self.td, self.keys = td, set(td.keys(True))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        assert set(self.td.keys(True)) == self.keys


def test_flatten_unflatten_keys():
    td = make_td()
    flat = td.flatten_keys()
    assert set(flat.keys()) == {"obs", "nested.x", "reward"}
    assert flat["nested.x"] is td["nested", "x"]
    back = flat.unflatten_keys()
    assert set(back.keys(True, True)) == set(td.keys(True, True))
    assert set(td.flatten_keys("/").keys()) == {"obs", "nested/x", "reward"}
    clash = TensorDict({"a.b": torch.zeros(()), "a": {"b": torch.zeros(())}})
    with pytest.raises(KeyError, match="a.b"):
        clash.flatten_keys()


# ----------------------------------------------------------------------------- conversions
def test_to_dict_and_from_dict():
    td = make_td()
    td["task"] = "walk"
    d = td.to_dict()
    assert d["obs"] is td["obs"] and d["nested"]["x"] is td["nested", "x"] and d["task"] == "walk"
    back = TensorDict.from_dict(d, batch_size=[3])
    assert (back == td).all()
    auto = TensorDict.from_dict({"a": torch.zeros(3, 4), "b": {"c": torch.zeros(3, 5)}}, auto_batch_size=True)
    assert auto.batch_size == torch.Size([3])
    assert TensorDict.from_dict({"a": torch.zeros(3)}).batch_size == torch.Size([])


def test_empty_and_clone():
    td = make_td()
    assert td.empty().is_empty() and td.empty().batch_size == td.batch_size
    assert set(td.empty(recurse=True).keys(True)) == {"nested"}
    deep = td.clone()
    deep["obs"].zero_()
    deep["nested", "x"].zero_()
    assert td["obs"].sum() == 66 and td["nested", "x"].tolist() == [0, 1, 2]
    shallow = td.clone(recurse=False)
    assert shallow["obs"] is td["obs"] and shallow is not td
    assert torch.clone(td)["obs"] is not td["obs"]


def test_zero_fill():
    td = make_td()
    td.fill_("obs", 2.5)
    assert bool((td["obs"] == 2.5).all())
    td.fill_("nested", 4)
    assert td["nested", "x"].tolist() == [4, 4, 4]
    assert td.zero_() is td and not td.any()
    with pytest.raises(KeyError, match="'missing'"):
        td.fill_("missing", 1)


def test_apply_and_named_apply():
    td = make_td()
    td["task"] = "walk"
    doubled = td.apply(lambda x: x * 2)
    assert doubled["obs"].sum() == 132 and doubled["nested", "x"].tolist() == [0, 2, 4]
    assert doubled["task"] == "walk"
    summed = td.apply(lambda x, y: x + y, td)
    assert summed["obs"].sum() == 132
    seen = []
    td.named_apply(lambda key, x: seen.append(key) or x, nested_keys=True)
    assert sorted(map(str, seen)) == sorted(map(str, ["obs", ("nested", "x"), "reward"]))
    dropped = td.named_apply(lambda key, x: None if key == "obs" else x)
    assert "obs" not in dropped and "reward" in dropped
    firsts = td.apply(lambda x: x[0], batch_size=[])
    assert firsts.batch_size == torch.Size([]) and firsts["obs"].tolist() == [0, 1, 2, 3]
    obs = td["obs"]
    td.apply(lambda x: x + 1, inplace=True)
    assert td["obs"] is obs and obs.sum() == 78


def test_to_cpu_contiguous():
    td = make_td()
    half = td.to(torch.float16)
    assert half["obs"].dtype == torch.float16 and half["nested", "x"].dtype == torch.float16
    assert td["obs"].dtype == torch.float32
    moved = td.to("cpu")
    assert moved.device == torch.device("cpu") and moved["obs"].device.type == "cpu"
    assert td.cpu().device == torch.device("cpu")
    t = td.expand(2, 3).contiguous()
    assert t["obs"].is_contiguous() and t.batch_size == torch.Size([2, 3])


# ----------------------------------------------------------------------------- comparisons
def test_equality_gives_tensordict_of_bools():
    td, other = make_td(), make_td()
    eq = td == other
    assert isinstance(eq, TensorDict) and eq.batch_size == td.batch_size
    assert eq["obs"].dtype == torch.bool and eq.all() and not (td != other).any()
    other["obs"][0, 0] = -1
    assert not (td == other).all() and (td != other).any()
    assert (td == other)["obs"].sum() == 11
    assert (td == 0)["obs"].sum() == 1  # compared with a scalar
    assert (td == td.to_dict()).all()
    with pytest.raises(KeyError, match="obs"):
        _ = td == td.exclude("obs")


def test_truth_value_is_ambiguous():
    with pytest.raises(RuntimeError, match=r"all\(\)"):
        bool(make_td())


def test_is_empty_numel():
    assert TensorDict(batch_size=[3]).is_empty() and TensorDict(a={}).is_empty()
    assert not TensorDict(t="x").is_empty()
    assert TensorDict(a=torch.zeros(2, 5, 1), batch_size=[2, 5]).numel() == 10


# ----------------------------------------------------------------------------- len / iteration
def test_len_and_iteration():
    td = make_td()
    assert len(td) == 3
    rows = list(td)
    assert len(rows) == 3 and rows[1]["obs"].tolist() == [4, 5, 6, 7]
    assert len(TensorDict()) == 0
    with pytest.raises(TypeError, match="0-dim"):
        iter(TensorDict(a=torch.zeros(())))


# ----------------------------------------------------------------------------- batch_size / names
def test_batch_size_setter():
    td = TensorDict(a=torch.zeros(3, 4), n={"b": torch.zeros(3, 4, 5)}, batch_size=[3])
    td.batch_size = [3, 4]
    assert td.batch_size == torch.Size([3, 4]) and td["n"].batch_size == torch.Size([3, 4])
    td.batch_size = []
    assert td.batch_size == torch.Size([]) and td["n"].batch_size == torch.Size([3, 4])


def test_batch_size_setter_failures_change_nothing(unchanged):
    td = TensorDict(a=torch.zeros(3, 4), n={"b": torch.zeros(3)}, batch_size=[3], names=["t"])
    with unchanged(td), pytest.raises(ValueError, match="'a'"):
        td.batch_size = [4]
    with unchanged(td), pytest.raises(ValueError, match="'b'"):
        td.batch_size = [3, 4]  # 'a' fits, the nested 'b' does not
    stacked = torch.stack([TensorDict(t="walk", batch_size=[]), TensorDict(t="run", batch_size=[])])
    stacked["a"] = torch.zeros(2, 2)
    with unchanged(stacked), pytest.raises(ValueError, match="'t'"):
        stacked.batch_size = [2, 2]  # the stack holds 2 values, not 2x2
    with unchanged(td), pytest.raises(TypeError):
        td.batch_size = "x"


def test_auto_batch_size_as_tensordict():
    td = TensorDict(a=torch.zeros(3, 4, 5), b={"c": torch.zeros(3, 4, 6)}, e="text")
    assert td.auto_batch_size_() is td
    assert td.batch_size == (3, 4) and td["b"].batch_size == (3, 4, 6)
    assert td.get("e").batch_size == (3, 4) and td["e"] == "text"  # non-tensors follow
    assert td.auto_batch_size_(batch_dims=1).batch_size == (3,) and td["b"].batch_size == (3,)
    kept = TensorDict(a=torch.zeros(3, 4), b=TensorDict(c=torch.zeros(3, 4), batch_size=[3, 4]))
    kept.auto_batch_size_(batch_dims=1, keep_compliant_size=True)
    assert kept.batch_size == (3,) and kept["b"].batch_size == (3, 4)
    assert TensorDict(a=torch.zeros(3), b=torch.zeros(2)).auto_batch_size_().batch_size == ()
    assert TensorDict().auto_batch_size_().batch_size == ()


def test_auto_batch_size_of_a_tensorclass_and_bad_input(unchanged):
    from shared_td import tensorclass

    @tensorclass
    class Obs:
        x: torch.Tensor

    obs = Obs(x=torch.zeros(5, 2))
    assert obs.auto_batch_size_().batch_size == (5, 2)
    td = TensorDict(a=torch.zeros(3, 4))
    for bad in (-1, 1.5, True):
        with unchanged(td), pytest.raises(ValueError, match="batch_dims"):
            td.auto_batch_size_(batch_dims=bad)


def test_names():
    td = TensorDict(a=torch.zeros(2, 3), batch_size=[2, 3])
    td.names = ["env", None]
    assert td.names == ["env", None]
    assert td.refine_names("env", "time") is td and td.names == ["env", "time"]
    td.names = None
    assert td.names is None


def test_names_reach_nested_tensordicts_and_tensorclasses():
    from shared_td import tensorclass

    @tensorclass
    class Pair:
        x: torch.Tensor

    td = TensorDict(n={"b": torch.zeros(2, 3, 4)}, batch_size=[2, 3], names=["env", None])
    assert td["n"].names == ["env", None]
    td["m"] = TensorDict(c=torch.zeros(2, 3, 5), batch_size=[2, 3, 5])
    td["p"] = Pair(x=torch.zeros(2, 3), batch_size=[2, 3])
    assert td["m"].names == ["env", None, None]
    assert td["p"].names == ["env", None]
    td.names = ["env", "time"]
    assert td["n"].names == ["env", "time"] and td["m"].names == ["env", "time", None]
    assert td["p"].names == ["env", "time"]
    assert td[0]["n"].names == ["time"]  # views follow
    td.names = None
    assert td["n"].names is None and td["m"].names is None


def test_nested_with_other_names_refused_and_nothing_changes(unchanged):
    td = TensorDict(a=torch.zeros(2, 3), batch_size=[2, 3], names=["env", "time"])
    child = TensorDict(c=torch.zeros(2, 3), batch_size=[2, 3], names=["u", "v"])
    with unchanged(td), pytest.raises(RuntimeError, match="'k'.*\\['u', 'v'\\]"):
        td["k"] = child
    assert child.names == ["u", "v"] and "k" not in td.keys()
    # a name of the child's own dims that repeats one of the parent's is refused too
    clash = TensorDict(batch_size=[2, 3])
    clash["n"] = TensorDict(b=torch.zeros(2, 3, 4), batch_size=[2, 3, 4], names=[None, None, "env"])
    with unchanged(clash), pytest.raises(RuntimeError, match="twice"):
        clash.names = ["env", None]
    assert clash.names is None and clash["n"].names == [None, None, "env"]


@pytest.mark.parametrize(
    "names, error", [(["x"], ValueError), (["x", "x"], ValueError), ([1, 2], TypeError), (["x", "y", "z"], ValueError)]
)
def test_bad_names_change_nothing(unchanged, names, error):
    td = TensorDict(a=torch.zeros(2, 3), batch_size=[2, 3], names=["p", "q"])
    with unchanged(td), pytest.raises(error, match="(?i)name"):
        td.names = names
