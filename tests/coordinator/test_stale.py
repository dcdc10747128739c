"""Layout changes (issue 5, point 5): re-publishing raises the version, an attached
tensordict sees that with ``shared_td.is_stale`` (no round trip) and gets the new layout
with ``shared_td.refresh``; writes into a stale layout never reach the new one.
"""
from __future__ import annotations

import multiprocessing
import time

import pytest
import torch

from tests.coordinator import nt_children as kids

import shared_td

WAIT = 30


def tree(fill=0.0):
    return shared_td.TensorDict(a=torch.full((4,), fill), batch_size=[4])


def test_anonymous_republish_stale_writes_stay_in_the_old_memory():
    with shared_td.Coordinator() as coord:
        published = coord.publish("w", tree(0.0))
        view = coord.attach("w")
        assert not shared_td.is_stale(view) and not shared_td.is_stale(published)
        assert shared_td.refresh(view) is view  # nothing newer

        coord.publish("w", shared_td.TensorDict(a=torch.ones(4), b=torch.ones(4, 2), batch_size=[4]))
        assert shared_td.is_stale(view) and shared_td.is_stale(published)
        view["a"].fill_(-1.0)  # into the stale layout
        fresh = shared_td.refresh(view)
        assert not shared_td.is_stale(fresh) and sorted(fresh.keys()) == ["a", "b"]
        assert fresh["a"].tolist() == [1.0] * 4 and coord.attach("w")["a"].tolist() == [1.0] * 4
        assert published["a"].tolist() == [-1.0] * 4  # the old memory, still shared
        assert shared_td.is_stale(view)  # the old object stays what it was


def test_atomic_rewrite_of_the_prefix_then_publish(tmp_path):
    prefix = tmp_path / "w"
    with shared_td.Coordinator() as coord:
        coord.publish("w", tree(0.0), prefix=prefix)
        view = coord.attach("w")
        rewritten = shared_td.TensorDict(a=torch.full((4,), 2.0), c=torch.zeros(4, 3), batch_size=[4])
        rewritten.memmap_(prefix, atomic=True)
        assert not shared_td.is_stale(view)  # nothing published yet: same version
        coord.publish("w", rewritten, prefix=prefix)
        assert shared_td.is_stale(view)
        view["a"].fill_(-1.0)  # the swapped-out files: never the new ones
        assert shared_td.load_memmap(prefix)["a"].tolist() == [2.0] * 4
        fresh = shared_td.refresh(view)
        assert sorted(fresh.keys()) == ["a", "c"] and fresh["a"].tolist() == [2.0] * 4
        fresh["a"][0] = 5.0
        assert rewritten["a"][0] == 5.0 and view["a"].tolist() == [-1.0] * 4


def test_make_memmap_adds_a_key_then_publish(tmp_path):
    prefix = tmp_path / "w"
    with shared_td.Coordinator() as coord:
        td = coord.publish("w", tree(0.0), prefix=prefix)
        view = coord.attach("w")
        td.make_memmap("extra", (4,))
        td["extra"].fill_(7.0)
        coord.publish("w", td, prefix=prefix)
        assert shared_td.is_stale(view) and "extra" not in view.keys()
        view["a"].fill_(3.0)  # the same file as the new layout's "a": a real write
        fresh = shared_td.refresh(view)
        assert fresh["a"].tolist() == [3.0] * 4
        assert fresh["extra"].tolist() == [7.0] * 4  # untouched by the stale writer


def test_unpublish_makes_stale_and_refresh_raises():
    with shared_td.Coordinator() as coord:
        coord.publish("w", tree())
        view = coord.attach("w")
        coord.unpublish("w")
        assert shared_td.is_stale(view)
        with pytest.raises(KeyError, match="'w'"):
            shared_td.refresh(view)
        coord.publish("w", tree(4.0))
        assert shared_td.is_stale(view)
        assert shared_td.refresh(view)["a"].tolist() == [4.0] * 4


def test_is_stale_needs_an_attached_tensordict_and_is_cheap():
    with pytest.raises(ValueError, match="not returned by attach"):
        shared_td.is_stale(tree())
    with shared_td.Coordinator() as coord:
        coord.publish("w", tree())
        view = coord.attach("w")
        rounds = 20_000
        begin = time.perf_counter()
        for _ in range(rounds):
            shared_td.is_stale(view)
        per_check = (time.perf_counter() - begin) / rounds
    assert per_check < 20e-6, per_check  # ~1 us measured: no round trip (~100 us)
    # the coordinator is gone: the mapped table still answers (nothing newer was
    # published); refresh, which needs the manager, says it is gone
    assert not shared_td.is_stale(view)
    coord_gone = shared_td.TensorDict(a=torch.zeros(1))
    with shared_td.Coordinator() as other:
        coord_gone = other.publish("g", coord_gone)
        other.publish("g", shared_td.TensorDict(a=torch.ones(1)))
    assert shared_td.is_stale(coord_gone)
    with pytest.raises(ConnectionError, match="is gone"):
        shared_td.refresh(coord_gone)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_worker_sees_the_new_layout(method):
    ctx = multiprocessing.get_context(method)
    with shared_td.Coordinator() as coord:
        coord.publish("w", tree(0.0))
        go, queue = ctx.Event(), ctx.Queue()
        worker = ctx.Process(target=kids.watch_for_new_layout,
                             args=(coord.address, coord.authkey, "w", go, queue))
        worker.start()
        assert queue.get(timeout=WAIT) == ("attached", ["a"], False)
        new = coord.publish("w", shared_td.TensorDict(a=torch.ones(4), b=torch.ones(4), batch_size=[4]))
        go.set()
        status, stale, keys, fresh_stale, values = queue.get(timeout=WAIT)
        worker.join(WAIT)
        assert worker.exitcode == 0
        assert (status, stale, keys, fresh_stale) == ("refreshed", True, ["a", "b"], False)
        assert values == [1.0] * 4 and new["a"].tolist() == [1.0] * 4  # -1 went to the old one
