"""Defects found by auditing commit c07d16f (memmap_ rewrites, return_early locks,
stale lazy-stack members), each tested where it was found:

* a rewrite copies first the leaves that read a file it overwrites; it found them by
  this process's cached FileBacking of each overwritten file. A plain tensor viewing
  a mapping (``mmt.view(...)``, ``as_subclass``) outlives that cache entry once the
  MemoryMappedTensor it came from is dropped, and a mapping made by another library
  (``torch.from_file``, ``numpy.memmap``) or through a hard link is in no cache: such
  a leaf above the staging size silently got the other key's new bytes. Now every
  mapping of an overwritten inode is found in /proc/self/maps (read only when a leaf
  holds memory that is not torch's own allocation).
* a synchronous memmap_ left the tree unlocked while it wrote (only return_early
  locked it): an entry another thread set meanwhile was silently dropped.
"""
from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import torch

import shared_td
from shared_td import TensorDict
from shared_td.persist import api

# above the staging size (small leaves are copied out before any write), 2 MiB each
_FLOATS = 1 << 19


def _saved(tmp_path) -> str:
    prefix = str(tmp_path / "saved")
    TensorDict(a=torch.arange(_FLOATS, dtype=torch.float32),
               b=torch.full((_FLOATS,), -1.0)).memmap_(prefix)
    return prefix


def _plain_views(prefix: str) -> tuple[torch.Tensor, torch.Tensor]:
    # the loaded tensordict (and its MemoryMappedTensors) is dropped on return: only the
    # plain views keep the mappings alive
    loaded = shared_td.load_memmap(prefix)
    return loaded["a"].view(-1), loaded["b"].as_subclass(torch.Tensor)


def _from_file(prefix: str) -> tuple[torch.Tensor, torch.Tensor]:
    return tuple(torch.from_file(os.path.join(prefix, f"{key}.memmap"), shared=True,
                                 size=_FLOATS, dtype=torch.float32) for key in "ab")


def _numpy(prefix: str) -> tuple[torch.Tensor, torch.Tensor]:
    return tuple(torch.from_numpy(np.memmap(os.path.join(prefix, f"{key}.memmap"), dtype=np.float32,
                                            mode="r+")) for key in "ab")


def _hard_links(prefix: str) -> tuple[torch.Tensor, torch.Tensor]:
    # the same files under other names: found by inode, not by path
    views = []
    for key in "ab":
        link = f"{prefix}-{key}-link"
        os.link(os.path.join(prefix, f"{key}.memmap"), link)
        views.append(shared_td.MemoryMappedTensor.from_filename(link, dtype=torch.float32,
                                                                shape=(_FLOATS,)).view(-1))
    return tuple(views)


def _swapped(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return b, a


def _strided(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return b[::2], a[1::2]


@pytest.mark.parametrize("views", [_plain_views, _from_file, _numpy, _hard_links])
@pytest.mark.parametrize("threads", [0, 2])
@pytest.mark.parametrize("pick", [_swapped, _strided])
def test_views_of_overwritten_files_keep_their_bytes(tmp_path, views, threads, pick):
    prefix = _saved(tmp_path)
    new_a, new_b = pick(*views(prefix))
    expected_a, expected_b = new_a.clone(), new_b.clone()
    # a gets (a view of) b's bytes and b gets a's: whichever file is written first,
    # the other leaf must have been read before
    TensorDict(a=new_a, b=new_b).memmap_(prefix, copy_existing=True, num_threads=threads)
    del new_a, new_b
    loaded = shared_td.load_memmap(prefix)
    assert torch.equal(loaded["a"], expected_a)
    assert torch.equal(loaded["b"], expected_b)


def test_return_early_swap_of_plain_views(tmp_path):
    prefix = _saved(tmp_path)
    a, b = _plain_views(prefix)
    expected_a, expected_b = b.clone(), a.clone()
    future = TensorDict(a=b, b=a).memmap_(prefix, num_threads=2, return_early=True)
    written = future.result(timeout=30)
    assert torch.equal(written["a"], expected_a)
    assert torch.equal(written["b"], expected_b)


# ---------------------------------------------------------------------------------------
# A synchronous memmap_ left the tree unlocked while it wrote: an entry another thread
# set meanwhile was silently dropped when the written leaves were put in (tensordict
# 0.15.3's memmap_ fails with "dictionary changed size during iteration").

@pytest.mark.parametrize("key", ["late", ("n", "late")])
@pytest.mark.parametrize("kwargs", [{}, {"num_threads": 2}, {"atomic": True}])
def test_entry_set_by_another_thread_during_memmap_is_refused_not_lost(tmp_path, monkeypatch, key, kwargs):
    td = TensorDict(a=torch.ones(3), n=TensorDict(b=torch.zeros(3), batch_size=[3]), batch_size=[3])
    outcome = []

    def set_from_another_thread() -> None:
        try:
            td[key] = torch.full((3,), 7.0)
            outcome.append("set")
        except shared_td.LockedTensorDictError:
            outcome.append("refused")

    real_write_tree = api.write_tree

    def write_tree_while_another_thread_sets(*args, **kw):
        other = threading.Thread(target=set_from_another_thread)
        other.start()
        other.join(timeout=30)
        assert not other.is_alive()
        return real_write_tree(*args, **kw)

    # (the atomic path writes through api.write_tree too)
    monkeypatch.setattr(api, "write_tree", write_tree_while_another_thread_sets)
    td.memmap_(str(tmp_path / "saved"), **kwargs)
    assert outcome in (["set"], ["refused"])
    if outcome == ["set"]:
        assert key in td.keys(include_nested=True), "an entry set during the write was lost"
    assert td.is_locked


def test_failed_synchronous_write_puts_the_locks_back(tmp_path):
    td = TensorDict(a=torch.ones(3), n=TensorDict(b=torch.zeros(3), batch_size=[3]), batch_size=[3])
    td["n"].lock_()  # locked on its own inside an unlocked tree
    prefix = tmp_path / "saved"
    (prefix / "a.memmap").mkdir(parents=True)  # the leaf's file is a directory: the write fails
    with pytest.raises(IsADirectoryError):
        td.memmap_(str(prefix))
    assert not td.is_locked and td["n"].is_locked
    td["c"] = torch.zeros(3)
    with pytest.raises(shared_td.LockedTensorDictError):
        td["n", "c"] = torch.zeros(3)
