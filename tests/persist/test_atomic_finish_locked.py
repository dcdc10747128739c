"""memmap_(atomic=True) records which directory its non-tensor values live in while it
still holds the prefix's writer lock: another writer's atomic swap of the same prefix
waits for it, so a stale write is checked against this writer's own directory (audit 21:
_finish ran after the lock was released, took the other save's directory for its own, and
a set_ through the swapped-out tree rewrote the other save's files)."""
import threading

import pytest
import torch

from shared_td import NonTensorData, SaveChangedError, TensorDict, load_memmap
from shared_td.persist import api


def test_another_atomic_writer_waits_for_the_finish(tmp_path, monkeypatch):
    prefix = tmp_path / "p"
    TensorDict(a=torch.zeros(2), s=NonTensorData("v0"), batch_size=[]).memmap_(prefix)
    other_done = threading.Event()

    def other_writer():
        TensorDict(a=torch.full((2,), 2.0), s=NonTensorData("other"), batch_size=[]).memmap_(prefix, atomic=True)
        other_done.set()

    finishing = api._finish
    seen = {}

    def racing_finish(root, options):
        thread = threading.Thread(target=other_writer)
        thread.start()
        seen["other finished during ours"] = other_done.wait(0.5)  # it waits for our lock
        seen["thread"] = thread
        return finishing(root, options)

    monkeypatch.setattr(api, "_finish", racing_finish)
    mine = TensorDict(a=torch.ones(2), s=NonTensorData("mine"), batch_size=[]).memmap_(prefix, atomic=True)
    monkeypatch.setattr(api, "_finish", finishing)
    seen["thread"].join(30)
    assert seen["other finished during ours"] is False and other_done.is_set()
    with pytest.raises(SaveChangedError):
        mine.set_("s", "mine, rewritten")  # mine was swapped out by the other save
    assert load_memmap(prefix)["s"] == "other"
