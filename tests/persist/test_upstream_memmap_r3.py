"""Side by side with tensordict 0.15.3 (found by its upstream tests, round 3).

A tensordict whose leaves already live in files, memory-mapped again into another
prefix without ``copy_existing=True``, is refused with tensordict's own words, so that
code written for tensordict that matches the message still works; the message also
names the key and its file, and nothing is written.
"""
from __future__ import annotations

import os

import pytest
import torch

import shared_td

tensordict = pytest.importorskip("tensordict")

_TENSORDICT_WORDS = "A filename was provided but the tensor already has a file associated"


def _tree(lib):
    return lib.TensorDict(
        {"a": torch.arange(6.0).view(3, 2), "n": {"b": torch.zeros(3)}}, batch_size=[3]
    )


@pytest.mark.parametrize("lib", [shared_td, tensordict], ids=["shared_td", "tensordict"])
@pytest.mark.parametrize("atomic", [False, True])
def test_memmap_into_another_prefix_uses_tensordicts_words(lib, atomic, tmp_path):
    if atomic and lib is tensordict:
        pytest.skip("atomic= is shared_td's keyword")
    td = _tree(lib).memmap_(tmp_path / "first")
    kwargs = {"atomic": True} if atomic else {}
    target = tmp_path / "first" if atomic else tmp_path / "second"
    with pytest.raises(RuntimeError, match=_TENSORDICT_WORDS) as info:
        td.memmap_(target, **kwargs)
    if lib is shared_td:
        # ours also names the key at fault and its file
        assert "('a',)" in str(info.value) and "a.memmap" in str(info.value)
        assert not (tmp_path / "second").exists()
        # no new version was begun (an atomic write's lock file may stay, by design)
        assert [n for n in os.listdir(tmp_path) if not n.endswith(".lock")] == ["first"]
    # copy_existing=True copies it, in both libraries
    copy = td.memmap_(tmp_path / "third", copy_existing=True)
    assert (copy == _tree(lib)).all()
