"""Lazy stacks without members: saved, loaded back and verified (docs/format.md §2.2).

A stack without members is a meta.json and no 0/. shared_td also records its batch size
(``"_shared_td_batch_size"``), which tensordict 0.15.3 ignores; a tensordict save has
none, and loads with the smallest batch size that fits the parent's (``[0]`` at the top,
as tensordict gives). Compared with tensordict 0.15.3 side by side, both ways.
"""
from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch

import shared_td
from shared_td.errors import FormatError
from shared_td.persist import format as fmt
from shared_td.persist import nodes
from shared_td.persist.survey import survey
from tests.reference import needs_tensordict, tensordict

# name -> the tree, built with either library; the stack is the root or the key "s"
CASES = {
    "top": lambda lib: lib.LazyStackedTensorDict(stack_dim=0),
    "top, dim 1": lambda lib: lib.LazyStackedTensorDict(stack_dim=1, batch_size=[2]),
    "top, members [2, 3]": lambda lib: lib.LazyStackedTensorDict(stack_dim=0, batch_size=[2, 3]),
    "named": lambda lib: lib.LazyStackedTensorDict(stack_dim=0, stack_dim_name="t"),
    "nested": lambda lib: lib.TensorDict(
        {"x": torch.zeros(0), "s": lib.LazyStackedTensorDict(stack_dim=0)}, batch_size=[0]),
    "nested, dim 1": lambda lib: lib.TensorDict(
        {"x": torch.zeros(2), "s": lib.LazyStackedTensorDict(stack_dim=1, batch_size=[2])}, batch_size=[2]),
}
# What tensordict 0.15.3 gives back for its own save, where shared_td differs.
LOADED_DIFFERENTLY = {
    # tensordict: batch [0] with stack_dim 1 (beyond its one dim); shared_td has no such stack
    "top, dim 1": ["LazyStackedTensorDict", [0], 0, [], None],
    # tensordict: IndexError (the stack's [0] does not fit the parent's [2])
    "nested, dim 1": ["TensorDict", [2], None, ["s", "x"], None,
                      ["LazyStackedTensorDict", [2, 0], 1, [], None]],
}


def describe(obj):
    """Class, batch size, stack dim, keys, names (and those of the nested "s")."""
    names = obj.names
    if names is not None and all(name is None for name in names):
        names = None  # tensordict: one None per dim; shared_td: None
    found = [type(obj).__name__, list(obj.batch_size), getattr(obj, "stack_dim", None),
             sorted(obj.keys()), None if names is None else list(names)]
    if "s" in obj.keys():
        found.append(describe(obj["s"]))
    return found


def stack_meta(path):
    meta = path / "meta.json"
    if not (path / "0").exists() and (path / "s").exists():
        meta = path / "s" / "meta.json"
    return json.loads(meta.read_text())


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tensordict's deprecation warnings
        yield


@pytest.mark.parametrize("case", CASES)
def test_shared_td_save_loads_back_as_it_was(tmp_path, case):
    original = CASES[case](shared_td)
    original.memmap_(tmp_path / "s")
    loaded = shared_td.load_memmap(tmp_path / "s")
    assert describe(loaded) == describe(original)
    stack = original["s"] if "s" in original.keys() else original
    assert stack_meta(tmp_path / "s")["_shared_td_batch_size"] == list(stack.batch_size)
    assert survey(str(tmp_path / "s")).errors == []


@needs_tensordict
@pytest.mark.parametrize("case", CASES)
def test_tensordict_save_loads_in_shared_td(tmp_path, case):
    CASES[case](tensordict).memmap_(tmp_path / "s")
    assert "_shared_td_batch_size" not in stack_meta(tmp_path / "s")
    loaded = shared_td.load_memmap(tmp_path / "s")
    if case in LOADED_DIFFERENTLY:
        assert describe(loaded) == LOADED_DIFFERENTLY[case]
    else:
        assert describe(loaded) == describe(tensordict.TensorDict.load_memmap(tmp_path / "s"))
    assert survey(str(tmp_path / "s")).errors == []


def _tensordict_load(path):
    try:
        return describe(tensordict.TensorDict.load_memmap(path))
    except Exception as error:  # noqa: BLE001 - compared: the same failure for both saves
        return type(error).__name__


@needs_tensordict
@pytest.mark.parametrize("case", CASES)
def test_tensordict_loads_shared_td_save_as_its_own(tmp_path, case):
    CASES[case](shared_td).memmap_(tmp_path / "ours")
    CASES[case](tensordict).memmap_(tmp_path / "theirs")
    assert _tensordict_load(tmp_path / "ours") == _tensordict_load(tmp_path / "theirs")


def test_inspect_shows_the_recorded_batch_size(tmp_path):
    CASES["nested, dim 1"](shared_td).memmap_(tmp_path / "s")
    found = survey(str(tmp_path / "s"))
    (stack,) = [entry for entry in found.root.children if entry.key == "s"]
    assert stack.batch_size == [2, 0] and found.problems == []


@pytest.mark.parametrize("recorded", [[2, 1], [2], "x", [2, -1]])
def test_a_wrong_recorded_batch_size_is_refused(tmp_path, recorded):
    shared_td.LazyStackedTensorDict(stack_dim=1, batch_size=[2]).memmap_(tmp_path / "s")
    meta = stack_meta(tmp_path / "s")
    meta["_shared_td_batch_size"] = recorded
    (tmp_path / "s" / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(FormatError, match="_shared_td_batch_size"):
        shared_td.load_memmap(tmp_path / "s")
    assert survey(str(tmp_path / "s")).errors  # shared-td verify reports it too


def test_copies_of_an_empty_stack_keep_its_shape(tmp_path):
    # memmap()/memmap_like() build a new stack: its members' batch size is all there is
    empty = shared_td.LazyStackedTensorDict(stack_dim=1, batch_size=[2], stack_dim_name="t")
    for copy in (empty.memmap(tmp_path / "m"), empty.memmap_like(tmp_path / "l"), empty.memmap()):
        assert (list(copy.batch_size), copy.stack_dim, copy.names) == ([2, 0], 1, [None, "t"])
    assert list(shared_td.load_memmap(tmp_path / "l").batch_size) == [2, 0]


def test_an_empty_stack_replaces_a_longer_save(tmp_path):
    full = shared_td.LazyStackedTensorDict(shared_td.TensorDict(a=torch.zeros(2), batch_size=[2]), stack_dim=1)
    full.memmap_(tmp_path / "s")
    shared_td.LazyStackedTensorDict(stack_dim=1, batch_size=[2]).memmap_(tmp_path / "s")
    assert not (tmp_path / "s" / "0").exists()
    loaded = shared_td.load_memmap(tmp_path / "s")
    assert (list(loaded.batch_size), list(loaded.keys())) == ([2, 0], [])


def test_members_gone_with_a_swapped_out_version_load_the_new_one(tmp_path, monkeypatch):
    # an atomic writer swaps the prefix while a load reads the old version and then
    # deletes that one: finding no 0/ there is no stack without members, the load restarts
    prefix = tmp_path / "s"
    def stack(length):
        return shared_td.LazyStackedTensorDict(*[shared_td.TensorDict(a=torch.zeros(2), batch_size=[2]) for _ in range(length)])

    stack(2).memmap_(prefix)
    kind = nodes.kind_for_type_string(fmt.LAZY_STACK_TYPE)
    child_names = kind.child_names

    def swapped_first(meta, is_directory):
        if not (tmp_path / "old").exists():
            prefix.rename(tmp_path / "old")  # (the loader holds the old one open)
            stack(3).memmap_(prefix)
            for name in ("0", "1"):
                shutil.rmtree(tmp_path / "old" / name)
        return child_names(meta, is_directory)

    monkeypatch.setattr(kind, "child_names", swapped_first)
    assert list(shared_td.load_memmap(prefix).batch_size) == [3, 2]
