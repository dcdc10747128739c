"""The pickle of a consolidated tree: one buffer, the runs of its leaves and a skeleton
of plain tuples (consolidated_pickle.py), rebuilt without re-validation."""
from __future__ import annotations

import gc
import multiprocessing
import pickle

import pytest
import torch

from tests.containers.consolidate_children import unpickle_and_sum, write_rows_and_report
from tests.processes import WAIT, finish
from shared_td import LazyStackedTensorDict, NonTensorStack, TensorDict
from shared_td.containers import consolidated_pickle
from shared_td.containers.locking import LockingOps
from shared_td.containers.tensorclass import tensorclass


@tensorclass
class Obs:
    pixels: torch.Tensor
    label: str


class TaggedDict(TensorDict):
    """A subclass with state of its own: its nodes are pickled as themselves."""


def _wide_tree(nodes: int) -> TensorDict:
    return TensorDict(
        {f"node{i}": {"obs": torch.full((4,), float(i)), "reward": torch.arange(4.0) + i} for i in range(nodes)},
        batch_size=[4], names=["time"],
    )


def _storages(td) -> set:
    return {leaf.untyped_storage().data_ptr() for leaf in td.values(True, True) if leaf.numel()}


def _assert_unlocked_tree(td) -> None:
    """``td`` and every nested tensordict are unlocked (a consolidated tree locked as a
    whole unpickles so, as in tensordict 0.15.3)."""
    assert not td.is_locked
    for key, child in td.items(True):
        if isinstance(child, TensorDict):
            assert not child.is_locked, key


def test_wide_tree_round_trip_keeps_everything():
    source = _wide_tree(300)
    out = source.consolidate()
    again = pickle.loads(pickle.dumps(out))
    assert (again == source).all() and again.is_consolidated() and out.is_locked
    assert again.names == ["time"] and again["node7"].names == ["time"]
    assert again["node7"].batch_size == torch.Size([4]) and again.device is None
    assert len(_storages(again)) == 1
    _assert_unlocked_tree(again)  # as tensordict 0.15.3: a receiver may add keys at once
    again["node3", "new"] = torch.zeros(4)
    del again["node3", "new"]
    twice = pickle.loads(pickle.dumps(again, protocol=5))  # a loaded tree sends on as one run
    assert (twice == source).all() and twice.is_consolidated() and len(pickle.dumps(twice)) == len(pickle.dumps(out))
    # the buffer is writable and its own
    again["node3", "obs"][0] = -1.0
    assert out["node3", "obs"][0] == 3.0
    # a leaf keeps the loaded buffer alive without its tree
    leaf = again["node299", "reward"]
    del again
    gc.collect()
    assert (leaf == torch.arange(4.0) + 299).all()


def test_pickle_calls_back_into_python_a_constant_number_of_times(monkeypatch):
    # The pickle of a consolidated tree is a skeleton of tuples: the pickler calls
    # reducer_override only for the classes and devices it names, not per node or leaf;
    # loading builds the nodes locked, without one lock_() per node. (The tree pickler
    # called reducer_override 4 times per node, and lock_() once per node.)
    calls = {"reduce": 0, "lock": 0}
    reducer = consolidated_pickle._TreePickler.reducer_override
    lock = LockingOps.lock_

    def counted_reducer(self, obj):
        calls["reduce"] += 1
        return reducer(self, obj)

    def counted_lock(self):
        calls["lock"] += 1
        return lock(self)

    monkeypatch.setattr(consolidated_pickle._TreePickler, "reducer_override", counted_reducer)
    monkeypatch.setattr(LockingOps, "lock_", counted_lock)
    out = _wide_tree(200).consolidate()
    data = pickle.dumps(out)
    assert calls["reduce"] <= 5, calls
    again = pickle.loads(data)
    assert calls["lock"] == 0, calls
    assert not again.is_locked and not again["node199"].is_locked and (again["node199", "obs"] == 199).all()
    # and the skeleton is small: well under tensordict's metadata per node
    payload = out["node0", "obs"].untyped_storage().nbytes()
    assert len(data) - payload < 200 * 60


def test_sub_tree_and_leaves_out_of_order():
    out = _wide_tree(20).consolidate()
    sub = pickle.loads(pickle.dumps(out["node5"]))  # a slice of the runs: not from the start
    assert sub.is_consolidated() and (sub["reward"] == torch.arange(4.0) + 5).all()
    out.unlock_()
    out["node1"]["obs"], out["node1"]["reward"] = out["node1"]["reward"], out["node1"]["obs"]
    out["node2", "obs"] = out["node9", "reward"].flip(0)  # a new tensor, not in the buffer
    again = pickle.loads(pickle.dumps(out))
    assert (again == out).all() and not again.is_consolidated()
    assert (again["node1", "obs"] == torch.arange(4.0) + 1).all()


def test_aliased_nodes_and_leaves_stay_one_object():
    out = _wide_tree(3).consolidate().unlock_()
    out["again"] = out["node1"]
    out["node2", "copy"] = out["node0", "obs"]
    again = pickle.loads(pickle.dumps(out))
    assert again["again"] is again["node1"]
    assert again["node2", "copy"] is again["node0", "obs"]
    assert len(_storages(again)) == 1


def test_tensorclasses_non_tensors_and_lazy_stacks_inside_the_tree():
    source = TensorDict(
        obs=Obs(pixels=torch.arange(6.0).reshape(3, 2), label="cat", batch_size=[3]),
        text="hello",
        words=NonTensorStack("a", "b", "c"),
        stack=LazyStackedTensorDict(TensorDict(x=torch.ones(2)), TensorDict(x=torch.zeros(2), y=torch.ones(1)),
                                    stack_dim=0),
        plain={"z": torch.arange(3)},
        batch_size=[],
    )
    out = source.consolidate()
    for again in (pickle.loads(pickle.dumps(out)), pickle.loads(pickle.dumps(out, protocol=4))):
        assert type(again["obs"]) is Obs and again["obs"].label == "cat"
        assert (again["obs"].pixels == source["obs"].pixels).all()
        assert again["text"] == "hello" and again["words"] == ["a", "b", "c"]
        assert (again["stack"].tensordicts[1]["y"] == 1).all()
        # (values() of a lazy stack stacks its members: a new tensor; look at each member)
        parts = [again["obs"]._tensordict, again["plain"], *again["stack"].tensordicts]
        assert again.is_consolidated() and len(set().union(*map(_storages, parts))) == 1
        for nested in (again, again["obs"]._tensordict, again["stack"], again["stack"].tensordicts[0],
                       again["plain"]):
            assert not nested.is_locked  # a tree locked as a whole comes back unlocked, as in tensordict


def test_nodes_of_their_own_class_and_partial_locks():
    source = TensorDict(a=torch.zeros(2), n={"b": torch.ones(2), "m": {"c": torch.arange(2)}},
                        tagged=TaggedDict(t=torch.ones(1), u={"v": torch.arange(3)}))
    out = source.consolidate()
    out["tagged"].tag = "mine"  # a node with state of its own: pickled as itself
    out.unlock_()
    out["n"].lock_()  # a locked node in an unlocked tree
    again = pickle.loads(pickle.dumps(out))
    assert not again.is_locked and again["n"].is_locked and again["n", "m"].is_locked
    with pytest.raises(RuntimeError, match="locked graph"):
        again["n", "m"].unlock_()
    assert type(again["tagged"]) is TaggedDict and again["tagged"].tag == "mine"
    assert (again["n", "m", "c"] == torch.arange(2)).all() and (again["tagged", "u", "v"] == torch.arange(3)).all()
    assert again.is_consolidated() and len(_storages(again)) == 1
    # locked as a whole, the tree comes back unlocked, the node pickled as itself too
    again = pickle.loads(pickle.dumps(out.lock_()))
    _assert_unlocked_tree(again)
    assert again["tagged"].tag == "mine" and not again["tagged"].is_locked


def test_wide_tree_to_a_spawned_child():
    source = _wide_tree(100)
    ctx = multiprocessing.get_context("spawn")
    parent_end, child_end = ctx.Pipe()
    child = ctx.Process(target=unpickle_and_sum, args=(child_end,))
    child.start()
    try:
        parent_end.send_bytes(pickle.dumps(source.consolidate(), protocol=5))
        assert parent_end.poll(WAIT)
        consolidated, total = parent_end.recv()
    finally:
        assert finish(child) == 0
    assert consolidated
    assert total == pytest.approx(sum(float(v.sum()) for v in source.values(True, True)))


# (a forked child's arguments are not pickled: it writes into its copy of memory that
# is not shared, consolidated or not)
@pytest.mark.parametrize("method, shared_first", [("spawn", False), ("spawn", True), ("fork", True)])
def test_a_process_argument_shares_the_buffer_as_a_plain_tree_does(method, shared_first):
    # multiprocessing sends tensors as handles to shared memory: a child's writes into an
    # unconsolidated tree reach the parent, and into a consolidated one they did not
    # (its buffer went by value), not even after share_memory_() said is_shared()
    consolidated = _wide_tree(3).consolidate()
    if shared_first:
        consolidated.share_memory_()
    ctx = multiprocessing.get_context(method)
    answers = ctx.Queue()
    child = ctx.Process(target=write_rows_and_report, args=(consolidated, answers))
    child.start()
    try:
        assert answers.get(timeout=WAIT) is True  # consolidated there too
    finally:
        assert finish(child) == 0
    assert all(bool((leaf == 7).all()) for leaf in consolidated.values(True, True))
    assert consolidated.is_consolidated()


def test_plain_pickle_still_copies_the_buffer():
    consolidated = _wide_tree(2).consolidate()
    again = pickle.loads(pickle.dumps(consolidated, protocol=5))
    again["node0", "obs"].fill_(-1)
    assert bool((consolidated["node0", "obs"] == 0).all()) and again.is_consolidated()
