"""Issue 13 (attach <= 2x its floor): a process parses each published version once.

The first attach of a version in a process rebuilds its leaves from the published
layout; later attaches of the same version, while a tensordict attached from it lives,
make new leaf objects over the same memory without parsing it again. Everything else
stays as it was: each attach still asks the manager (so republishing, unpublishing, a
dead or stopped manager are seen exactly as before), file-backed leaves are mapped anew
by path, and nothing outlives the attached tensordicts (no mapping, no descriptor).
"""
from __future__ import annotations

import gc
import multiprocessing
import os
import pickle
import threading

import pytest
import torch

from tests.coordinator import coord_children as kids
from tests.coordinator.test_coordinator import open_descriptors, opened_since, run
from tests.coordinator.test_leaks import holders_of
from tests.processes import WAIT, finish

import shared_td
from shared_td import MemoryMappedTensor


def wide(n=100):
    return shared_td.TensorDict({**{f"k{i}": torch.zeros(4) for i in range(n)},
                                 "nested": {"r": torch.arange(6.0).reshape(2, 3)}})


@pytest.fixture
def leaf_builds(monkeypatch):
    """A list that grows by one per leaf parsed: per leaf of a published version that
    ``MemoryMappedTensor._leaf_specs`` checks, and per leaf unpickled on its own
    (``_from_backing``'s ``_checked_view``)."""
    built = []
    specs, checked_view = MemoryMappedTensor._leaf_specs, MemoryMappedTensor._checked_view

    def counting_specs(references):
        built.extend(reference[1:3] for reference in references)
        return specs(references)

    def counting_view(*args, **kwargs):
        built.append(args[1:3])
        return checked_view(*args, **kwargs)

    monkeypatch.setattr(MemoryMappedTensor, "_leaf_specs", staticmethod(counting_specs))
    monkeypatch.setattr(MemoryMappedTensor, "_checked_view", staticmethod(counting_view))
    return built


@pytest.mark.timeout(60)
def test_a_second_attach_of_an_unchanged_version_parses_no_leaf_again(leaf_builds):
    with shared_td.Coordinator() as coord:
        coord.publish("wide", wide())
        first = coord.attach("wide")
        parsed = len(leaf_builds)
        assert parsed >= 101
        second = coord.attach("wide")
        assert len(leaf_builds) == parsed  # nothing parsed or checked again
        # a new tree of new leaf objects over the same memory, as unpickling gave
        assert second is not first and second.is_locked and not shared_td.is_stale(second)
        assert list(second.keys(True, True)) == list(first.keys(True, True))
        for key in first.keys(True, True):
            old, new = first[key], second[key]
            assert new is not old and type(new) is type(old) and new._backing is old._backing
            assert (new.data_ptr(), new.shape, new.stride()) == (old.data_ptr(), old.shape, old.stride())
            assert new.parent_shape == old.parent_shape
        second["nested", "r"][1, 2] = -1.0
        assert first["nested", "r"][1, 2] == -1.0  # the same memory
        first["k1"].unsqueeze_(0)  # a leaf object's metadata is its own
        assert first["k1"].shape == (1, 4) and coord.attach("wide")["k1"].shape == (4,)
        again = pickle.loads(pickle.dumps(second["k2"]))  # still pickles by reference
        again[0] = 9.0
        assert first["k2"][0] == 9.0


@pytest.mark.timeout(60)
def test_the_parsed_version_is_dropped_with_the_last_tensordict_attached_from_it(leaf_builds):
    with shared_td.Coordinator() as coord:
        coord.publish("wide", wide(3))
        view = coord.attach("wide")
        inode = view["k0"]._backing.key[1]
        parsed = len(leaf_builds)
        del view
        gc.collect()
        # nothing of it stays mapped here (the manager still holds it)
        assert holders_of(inode, [os.getpid()]) == []
        coord.attach("wide")
        assert len(leaf_builds) == 2 * parsed  # parsed anew


@pytest.mark.timeout(60)
def test_each_attach_still_sees_republish_and_unpublish(leaf_builds):
    with shared_td.Coordinator() as coord:
        td = coord.publish("w", wide(3))
        old = coord.attach("w")
        coord.publish("w", td)  # the same memory, a new version
        same_memory = coord.attach("w")
        assert shared_td.is_stale(old) and not shared_td.is_stale(same_memory)
        assert same_memory["k0"].data_ptr() == old["k0"].data_ptr()
        coord.publish("w", shared_td.TensorDict(k0=torch.ones(2), extra=torch.ones(1)))
        fresh = coord.attach("w")
        assert sorted(fresh.keys()) == ["extra", "k0"] and fresh["k0"].tolist() == [1.0, 1.0]
        assert shared_td.is_stale(same_memory) and old["k0"].tolist() == [0.0] * 4
        assert shared_td.refresh(old)["k0"].tolist() == [1.0, 1.0]
        coord.unpublish("w")
        assert shared_td.is_stale(fresh)
        with pytest.raises(KeyError, match="'w'"):
            coord.attach("w")


@pytest.mark.timeout(60)
def test_file_backed_leaves_are_mapped_anew_by_every_attach(tmp_path):
    prefix = tmp_path / "w"
    with shared_td.Coordinator() as coord:
        coord.publish("w", shared_td.TensorDict(a=torch.zeros(4), b={"c": torch.zeros(2)}),
                      prefix=prefix)
        view = coord.attach("w")  # keeps its version's parsed layout alive
        # the files replaced (an atomic rewrite), not published: the same version...
        shared_td.TensorDict(a=torch.full((4,), 2.0), b={"c": torch.ones(2)}).memmap_(
            prefix, atomic=True)
        again = coord.attach("w")
        assert not shared_td.is_stale(again)
        # ...whose paths name the new files, as an attach always mapped them
        assert again["a"].tolist() == [2.0] * 4 and again["b", "c"].tolist() == [1.0, 1.0]
        assert view["a"].tolist() == [0.0] * 4


@pytest.mark.timeout(90)
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_attach_twice_after_the_publisher_exited_here_and_in_a_worker(method):
    with shared_td.Coordinator() as coord:
        ctx = multiprocessing.get_context("fork")
        publisher, queue = run(ctx, kids.publish_mixed_and_exit, coord.address, coord.authkey, "m")
        assert queue.get(timeout=WAIT)[0] == "ok" and finish(publisher) == 0
        first = coord.attach("m")
        second = coord.attach("m")  # from the parsed version; the cell through the manager
        assert second["task"] == "walk" and second["inner", "y"].tolist() == [0.0, 1.0, 2.0]
        second.set_("task", "run")
        assert first["task"] == "run"
        worker, queue = run(multiprocessing.get_context(method), kids.attach_twice_and_write,
                            coord.address, coord.authkey, "m")
        status, seen, distinct, stale = queue.get(timeout=WAIT)
        assert (status, seen, distinct, stale) == ("ok", [-5.0, 7.0, 7.0], True, False), seen
        assert finish(worker) == 0
        assert first["x"].tolist() == [-5.0, 7.0, 7.0]


@pytest.mark.timeout(60)
def test_writing_one_leaf_in_place_leaves_autograd_of_another_alone():
    # Autograd refuses a backward whose saved tensor was written in place since: it
    # compares the tensor's version counter. Each attached leaf must have its own, as a
    # leaf mapped alone has: a write to "b" is no write to "a", even though both leaves
    # live in one segment and the version was parsed once.
    with shared_td.Coordinator() as coord:
        coord.publish("w", shared_td.TensorDict(a=torch.ones(3), b=torch.ones(3), c=torch.ones(2, 2)))
        for _attempt in range(2):  # parsed, then built from the parsed version
            view = coord.attach("w")
            weight = torch.full((3,), 2.0, requires_grad=True)
            loss = (weight * view["a"]).sum()  # saves view["a"] for the backward
            view["b"].add_(1.0)
            view["c"][0, 1] = 5.0
            loss.backward()
            assert weight.grad.tolist() == [1.0, 1.0, 1.0]
            # and a write to the saved leaf itself is still seen
            loss = (weight * view["a"]).sum()
            view["a"].mul_(1.0)
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                loss.backward()


@pytest.mark.timeout(60)
def test_an_attach_in_inference_mode_gives_normal_tensors_to_it_and_to_later_attaches():
    # An actor attaches under torch.inference_mode(); the version it parsed first must
    # not make the leaves of every later attach in the process inference tensors (which
    # refuse in-place writes and autograd outside inference mode). Leaves of shared
    # memory are normal tensors, written from inside and outside inference mode.
    with shared_td.Coordinator() as coord:
        coord.publish("w", shared_td.TensorDict(a=torch.ones(3), b=torch.zeros(2)))
        with torch.inference_mode():
            actor = coord.attach("w")
            actor["b"].add_(1.0)
        learner = coord.attach("w")
        for view in (actor, learner):
            assert not view["a"].is_inference() and not view["b"].is_inference()
        actor["b"].add_(1.0)  # outside inference mode
        assert learner["b"].tolist() == [2.0, 2.0]
        weight = torch.ones(3, requires_grad=True)
        (weight * learner["a"]).sum().backward()
        assert weight.grad.tolist() == [1.0, 1.0, 1.0]


@pytest.mark.timeout(60)
def test_threads_attaching_at_once_each_get_their_own_tree():
    with shared_td.Coordinator() as coord:
        coord.publish("wide", wide(20))
        results, errors = [], []

        def attach_many():
            try:
                results.extend(coord.attach("wide") for _ in range(20))
            except BaseException as err:
                errors.append(err)

        threads = [threading.Thread(target=attach_many) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(WAIT)
        assert not any(t.is_alive() for t in threads) and errors == []
        assert len(results) == 80
        leaves = [td["k3"] for td in results]
        assert len({id(leaf) for leaf in leaves}) == 80
        assert len({leaf.data_ptr() for leaf in leaves}) == 1


@pytest.mark.timeout(60)
def test_repeated_attaches_leave_no_descriptor_or_mapping():
    with shared_td.Coordinator() as coord:
        coord.publish("wide", wide(10))
        coord.publish("other", wide(2))
        # the connection (one descriptor, kept) is made, and the version table is mapped
        # with a pidfd of the manager, kept while an attached tensordict holds the table
        other = coord.attach("other")
        before = open_descriptors()
        views = [coord.attach("wide")]
        held = open_descriptors()  # the segment's own descriptor, while it is mapped
        assert len(opened_since(before)) == 1, opened_since(before)
        views += [coord.attach("wide") for _ in range(49)]
        inode = views[0]["k0"]._backing.key[1]
        assert opened_since(held) == {}  # no more for 49 more attaches
        del views
        gc.collect()
        assert opened_since(before) == {}  # the segment's descriptor went with the views
        assert holders_of(inode, [os.getpid()]) == []
        assert other.is_locked  # (held until here: its table with it)
