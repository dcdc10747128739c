"""``td[i]`` of a locked tensordict, a replay buffer's row read (a fast path of
``TensorDict._index_rows``): it gives the view the general indexing gives (the same
leaves, nodes, names, flags and lock links), also after any change between two reads,
by any code path."""
from __future__ import annotations

import pickle

import pytest
import torch
from shared_td import MemoryMappedTensor, TensorDict


def buffer(tmp_path, rows: int = 6) -> TensorDict:
    td = TensorDict(
        {"obs": torch.arange(rows * 3.0).reshape(rows, 3), "done": torch.arange(rows) % 2 == 0,
         "next": {"obs": torch.arange(rows * 3.0).reshape(rows, 3) + 100,
                  "deeper": TensorDict(x=torch.arange(rows * 2).reshape(rows, 2), batch_size=[rows, 2])},
         "task": "walk"},
        batch_size=[rows], names=["rows"],
    )
    return td.memmap_(tmp_path / "buf")


def facts(view) -> dict:
    """What a user sees of a view, node by node and leaf by leaf."""
    out = {}
    nodes = [((), view)] + [(key if isinstance(key, tuple) else (key,), view.get(key))
                            for key in view.keys(True) if isinstance(view.get(key), TensorDict)]
    for path, node in nodes:
        out[path] = (type(node).__name__, node.batch_size, node.names, node.device, list(node.keys()),
                     node.is_locked, node.is_memmap(), node.is_shared(), node._memmap_prefix)
    for key in view.keys(True, True):
        leaf = view.get(key)
        if isinstance(leaf, torch.Tensor):
            out[key] = (type(leaf).__name__, leaf.shape, leaf.stride(), leaf.storage_offset(),
                        leaf.untyped_storage().data_ptr(), leaf.tolist(),
                        getattr(leaf, "_backing", None), getattr(leaf, "_parent_shape", None))
        else:
            out[key] = (type(leaf).__name__, leaf.batch_size, leaf.is_locked, view[key])
    return out


def general(td: TensorDict, index):
    """``td[index]`` by the general indexing (unlocked), with the flags of the locked
    read put back: what the plan must give."""
    flags = [(node, node._is_memmap, node._is_shared) for node in _nodes(td)]
    with td.unlock_():
        for node, memmap, shared in flags:
            node._is_memmap, node._is_shared = memmap, shared
        view = td[index]
    view.lock_()
    return view


def _nodes(td):
    yield td
    for value in td._tensordict.values():
        if type(value) is TensorDict:
            yield from _nodes(value)


def test_a_row_is_what_the_general_indexing_gives(tmp_path):
    td = buffer(tmp_path)
    for index in [2, -1, slice(1, 4), (Ellipsis,), None, (slice(None), None)]:
        assert facts(td[index]) == facts(general(td, index)), index


def test_each_node_of_a_row_is_linked_to_its_parent_view(tmp_path):
    td = buffer(tmp_path)
    row = td[1]
    for child in [row["next"], row.get("task")]:
        assert child.is_locked and id(row) in child._lock_parents
        with pytest.raises(RuntimeError, match="locked graph"):
            child.unlock_()
    assert id(row["next"]) in row["next", "deeper"]._lock_parents


@pytest.mark.parametrize(
    "change",
    [
        lambda td: td.set("obs", torch.ones(6, 3)),  # a leaf replaced
        lambda td: td.set("extra", torch.ones(6, 2)),  # a key added
        lambda td: td.del_("done"),  # a key removed
        lambda td: td.rename_key_("obs", "o").rename_key_("done", "obs"),  # keys renamed
        lambda td: td.del_("obs").set("obs", td["next", "obs"]),  # same count, another leaf
        lambda td: td["next"].set("obs", torch.ones(6, 3)),  # a nested leaf replaced
        lambda td: td.set("next", TensorDict(obs=torch.ones(6, 1), batch_size=[6])),  # a node replaced
        lambda td: td.set("task", "run"),  # a non-tensor replaced
        lambda td: setattr(td, "names", ["steps"]),
    ],
)
def test_a_read_after_a_change_while_unlocked_sees_the_change(tmp_path, change):
    td = buffer(tmp_path)
    td[0]
    with td.unlock_():
        change(td)
    assert facts(td[2]) == facts(general(td, 2))


def test_changes_made_while_locked_are_seen(tmp_path):
    td = buffer(tmp_path)
    td[0]
    td._is_shared = True  # as share_memory_/memmap_ do: a flag set in place on a locked node
    assert td[4].is_shared() and facts(td[4]) == facts(general(td, 4))
    leaf = td["obs"]
    leaf.set_(torch.full((6, 2), 7.0).untyped_storage(), 0, (6, 2))  # the leaf changed in place
    assert td[5]["obs"].tolist() == [7.0, 7.0] and facts(td[5]) == facts(general(td, 5))
    plain = TensorDict(a=torch.arange(4), task="walk", batch_size=[4], lock=True)
    assert plain[1]["task"] == "walk"
    plain[1] = TensorDict(task="run", batch_size=[])  # the non-tensor entry replaced while locked
    assert plain[1]["task"] == "run" and plain[0]["task"] == "walk" and plain[1].get("task").is_locked


def test_a_locked_tensordict_of_plain_tensors_reads_over_a_plan(tmp_path):
    td = TensorDict(a=torch.arange(4), b={"c": torch.arange(8).reshape(4, 2)}, batch_size=[4], lock=True)
    row = td[1]
    assert type(row["a"]) is torch.Tensor
    assert row["a"].item() == 1 and row["b", "c"].tolist() == [2, 3] and row.is_locked
    assert row["a"].untyped_storage().data_ptr() == td["a"].untyped_storage().data_ptr()


def test_a_read_after_pickling_reads_the_same_rows(tmp_path):
    td = buffer(tmp_path)
    td[0]
    copy = pickle.loads(pickle.dumps(td))
    assert copy[3]["next", "obs"].tolist() == td[3]["next", "obs"].tolist() == [109.0, 110.0, 111.0]
    consolidated = TensorDict(a=torch.arange(4), batch_size=[4]).consolidate().lock_()
    consolidated[0]
    again = pickle.loads(pickle.dumps(consolidated))
    assert again[1]["a"].item() == 1 and not again[1].is_locked  # unpickled unlocked, as in tensordict
    again.lock_()
    assert again[1]["a"].item() == 1 and again[1].is_locked


def test_a_row_leaf_is_a_memory_mapped_tensor_of_the_file(tmp_path):
    td = buffer(tmp_path)
    leaf = td[2]["next", "obs"]
    assert type(leaf) is MemoryMappedTensor and leaf.filename == td["next", "obs"].filename
    assert leaf.parent_shape == td["next", "obs"].shape
    leaf.fill_(-1.0)
    assert td["next", "obs"][2].tolist() == [-1.0] * 3
