"""Audit 21: an in-place write through a stale view of a memory-mapped non-tensor value
never rewrites the files of a newer save at the same prefix.

Before, after an atomic re-publish (or ``memmap_(atomic=True)``) at the same prefix, a
``set_`` of a non-tensor entry through a view of the old save rewrote the NEW save's
meta.json/pickle for that key (its memory held the new value, its files the stale
writer's: a later ``load_memmap`` got the wrong value), though the README says a stale
view's writes never go into the new layout. Now the node directory's identity is
recorded when the value is mapped or loaded and checked under the node's flock before
the rewrite: a replaced directory raises SaveChangedError, nothing written.

tensordict 0.15.3 rewrites whatever files are at the path (it has no atomic swap: the
promise is ours); a fresh view's write behaves as it does there.
"""
from __future__ import annotations

import pytest
import torch

import shared_td
from shared_td import NonTensorData, TensorDict
from shared_td.errors import SaveChangedError

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("value", ["v2", {"not": "json", "x": object.__name__}, b"bytes: a pickle"])
def test_a_stale_views_write_never_reaches_the_new_saves_files(tmp_path, value):
    prefix = str(tmp_path / "p")
    old = TensorDict(a=torch.zeros(2), s=NonTensorData("v1"), batch_size=[]).memmap_(prefix)
    new = TensorDict(a=torch.ones(2), s=NonTensorData(value), batch_size=[]).memmap_(prefix, atomic=True)
    with pytest.raises(SaveChangedError, match="stale view.*Refresh the view"):
        old.set_("s", "written through the stale view")
    assert old["s"] == "v1"  # nothing changed, in memory either
    assert TensorDict.load_memmap(prefix, allow_pickle=True)["s"] == value and new["s"] == value


def test_a_stale_published_views_write_never_reaches_the_new_saves_files(tmp_path):
    prefix = str(tmp_path / "p")
    with shared_td.Coordinator(timeout=10) as coord:
        coord.publish("x", TensorDict(a=torch.zeros(2), s=NonTensorData("v1")), prefix, share_non_tensor=True)
        old = coord.attach("x")
        coord.publish("x", TensorDict(a=torch.ones(2), s=NonTensorData("v2")), prefix,
                      share_non_tensor=True, atomic=True)
        assert shared_td.is_stale(old)
        with pytest.raises(SaveChangedError, match="stale view"):
            old.set_("s", "written through the STALE view")
        assert coord.attach("x")["s"] == "v2"
        assert TensorDict.load_memmap(prefix)["s"] == "v2"


@pytest.mark.parametrize("lib", ["shared_td", "tensordict"])
def test_a_fresh_views_write_still_rewrites_the_files_as_tensordict_does(tmp_path, lib):
    mod = shared_td if lib == "shared_td" else pytest.importorskip("tensordict")
    prefix = str(tmp_path / "p")
    mod.TensorDict(a=torch.zeros(2), s=mod.NonTensorData("v1"), batch_size=[]).memmap_(prefix)
    fresh = mod.TensorDict(a=torch.ones(2), s=mod.NonTensorData("v2"), batch_size=[]).memmap_(
        prefix, **({"atomic": True} if lib == "shared_td" else {"existsok": True}))
    fresh.set_("s", "v3")
    assert mod.TensorDict.load_memmap(prefix)["s"] == "v3"
