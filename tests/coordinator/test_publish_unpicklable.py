"""Coordinator.publish of a tree holding a non-tensor value that cannot be pickled raises a
TypeError naming the entry and saying "nothing was done": that must be true, with and
without a prefix (audit 21: without a prefix, td was already memory-mapped and locked)."""
from __future__ import annotations

import threading

import pytest
import torch

import shared_td


def _state(td):
    return (td.is_memmap(), td.is_locked, type(td["x"]).__name__, td.device, sorted(td.keys()))


def test_a_failed_publish_leaves_the_tensordict_as_it_was(tmp_path):
    with shared_td.Coordinator() as coord:  # (one manager for both cases: starting one is the cost)
        for with_prefix in (False, True):
            _publish_fails_and_changes_nothing(coord, tmp_path, with_prefix)


def _publish_fails_and_changes_nothing(coord, tmp_path, with_prefix):
    prefix = str(tmp_path / f"p{with_prefix}") if with_prefix else None
    name = f"p{with_prefix}"
    td = shared_td.TensorDict(x=torch.zeros(2), n={"y": torch.ones(2)}, batch_size=[2])
    td["n", "s"] = shared_td.NonTensorData(threading.Lock())
    before = _state(td)
    with pytest.raises(TypeError, match=rf"publish\('{name}'\): the non-tensor entry \('n', 's'\).*nothing was done"):
        coord.publish(name, td, prefix=prefix)
    assert _state(td) == before == (False, False, "Tensor", None, ["n", "x"])
    assert type(td["n", "y"]) is torch.Tensor
    td["z"] = torch.zeros(2)  # not locked: keys can still be added
    assert name not in coord.names()
    if with_prefix:
        assert not (tmp_path / name).exists()
    # once the value is replaced, the same tensordict publishes
    td["n", "s"] = "fine"
    assert coord.publish(name, td, prefix=prefix).is_memmap() and name in coord.names()
