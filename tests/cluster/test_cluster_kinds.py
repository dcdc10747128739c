"""Replicated tensorclasses and lazy stacks (issue 14: what one node publishes, the
cluster replicates), with two members in one process (see test_cluster_store.py).

A replica node rebuilds the owner's tree from the layout in the store (the meta.json
documents of its nodes, see shared_td.coordinator.cluster_layout): the same class, batch
size, stack dim, names and non-tensor values, over one local segment. test_cluster.py
runs the same through real node process trees and a worker attached by address.
"""
from __future__ import annotations

import sys

import pytest
import torch

torch_dist = pytest.importorskip("torch.distributed")

import shared_td  # noqa: E402
from tests.cluster.cluster_children import Step, kinds_td  # noqa: E402
from tests.processes import wait_until  # noqa: E402
from tests.cluster.test_cluster_api import coordinators  # noqa: E402,F401 (fixture)
from tests.cluster.test_cluster_store import pair, store  # noqa: E402,F401 (fixtures)


def _label_seen(step, value, timeout=5.0) -> bool:
    """Whether ``step.label`` reads ``value`` within ``timeout`` seconds."""
    return wait_until(lambda: step.label == value, timeout)


def _segment(td):
    """The one segment of a (replicated) tree's tensor leaves."""
    found = {leaf._backing.key for leaf in _tensors(td) if leaf.numel()}
    assert len(found) == 1, found
    return found.pop()


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, shared_td.LazyStackedTensorDict) and not getattr(obj, "_is_non_tensor", False):
        for member in obj.tensordicts:
            yield from _tensors(member)
    elif shared_td.is_tensorclass(obj):
        yield from _tensors(obj._tensordict)
    elif isinstance(obj, shared_td.TensorDict):
        for value in obj._tensordict.values():
            yield from _tensors(value)


def _same_lazy(a, b):
    assert type(a) is type(b) is shared_td.LazyStackedTensorDict
    assert a.stack_dim == b.stack_dim and a.batch_size == b.batch_size
    assert len(a.tensordicts) == len(b.tensordicts)
    for x, y in zip(a.tensordicts, b.tensordicts):
        assert x.batch_size == y.batch_size and list(x.keys()) == list(y.keys())
        for key in x.keys():
            if isinstance(x[key], torch.Tensor):
                assert torch.equal(x[key], y[key]), key
            else:
                assert x[key] == y[key], key


def test_a_tensorclass_replicates_at_the_top_level_with_its_non_tensor_fields(pair):
    owner, other = pair
    step = owner.publish("step", Step(obs=torch.arange(12.0).reshape(4, 3), reward=torch.zeros(4, 1),
                                      label="walk", batch_size=[4]), share_non_tensor=True)
    view = other.attach("step")
    assert type(view) is Step and view.batch_size == (4,)
    assert view.label == "walk" and torch.equal(view.obs, step.obs) and torch.equal(view.reward, step.reward)
    assert _segment(view) != _segment(step)  # the node's own segment
    step.obs.add_(100)
    assert owner.sync("step").delivered == [1]
    assert view.obs[0].tolist() == [100.0, 101.0, 102.0] and shared_td.version(view) == 3  # (attach: 2)
    step.reward.fill_(3.0)
    assert other.pull("step") == 4 and view.reward[:, 0].tolist() == [3.0] * 4
    # push of rows: rows of the tensorclass's batch, as step[index] selects them
    view.obs[1:3] = -1.0
    other.push("step", [1, 2])
    assert step.obs[:, 0].tolist() == [100.0, -1.0, -1.0, 109.0]
    # the non-tensor field is cluster-wide, both ways
    step.set_("label", "run")
    assert _label_seen(view, "run")
    view.set_("label", "jump")
    assert _label_seen(step, "jump")


def test_a_tensordict_holding_a_tensorclass_and_a_lazy_stack_replicates(pair):
    owner, other = pair
    td = owner.publish("tree", kinds_td(4), share_non_tensor=True)
    view = other.attach("tree")
    assert type(view) is shared_td.TensorDict and view.batch_size == (4,) and view.names == ["time"]
    assert type(view["step"]) is Step and view["step"].label == "walk"
    assert view["step"].batch_size == (4,) and torch.equal(view["step"].obs, td["step"].obs)
    _same_lazy(view["lazy"], td["lazy"])  # heterogeneous shapes, stack_dim=1
    assert view["lazy"].tensordicts[0]["b"].shape == (4, 2) and view["lazy"].tensordicts[1]["b"].shape == (4, 5)
    assert view["sub", "tag"] == "t" and torch.equal(view["sub", "x"], td["sub", "x"])
    assert _segment(view) != _segment(td)
    # sync, then push of rows (rows of dim 0: of every member of a stack along dim 1)
    td["lazy"].tensordicts[1]["b"].fill_(7.0)
    td["step"].obs.fill_(2.0)
    owner.sync("tree")
    _same_lazy(view["lazy"], td["lazy"])
    assert view["step"].obs.unique().tolist() == [2.0]
    for member in view["lazy"].tensordicts:
        member["b"][3] = -5.0
    view["step"].obs[3] = -5.0
    other.push("tree", [3])
    _same_lazy(view["lazy"], td["lazy"])
    assert td["step"].obs[:, 0].tolist() == [2.0, 2.0, 2.0, -5.0]
    assert td["lazy"].tensordicts[1]["b"][:, 0].tolist() == [7.0, 7.0, 7.0, -5.0]
    view["step"].set_("label", "from node 1")
    assert _label_seen(td["step"], "from node 1")


def test_a_lazy_stack_along_dim_0_replicates_and_a_pushed_row_is_a_whole_member(pair):
    owner, other = pair
    members = [shared_td.TensorDict(obs=torch.full((n, 2), float(n)), name=f"m{n}", batch_size=[]) for n in (1, 2, 3)]
    lazy = owner.publish("episodes", shared_td.LazyStackedTensorDict(*members, stack_dim=0), share_non_tensor=True)
    view = other.attach("episodes")
    _same_lazy(view, lazy)
    assert view.batch_size == (3,) and view[2]["obs"].shape == (3, 2)
    assert [member["name"] for member in view.tensordicts] == ["m1", "m2", "m3"]
    view.tensordicts[1].set_("name", "renamed")  # a member's value is cluster-wide too
    assert wait_until(lambda: lazy.tensordicts[1]["name"] == "renamed", 5)
    view.tensordicts[1]["obs"].fill_(-1.0)
    view.tensordicts[2]["obs"].fill_(-2.0)
    other.push("episodes", [-1])  # the last member only, as lazy[-1] selects it
    assert lazy.tensordicts[2]["obs"].unique().tolist() == [-2.0]
    assert lazy.tensordicts[1]["obs"].unique().tolist() == [2.0]  # not pushed
    with pytest.raises(IndexError, match="out of range for 3 rows"):
        other.push("episodes", [3])
    lazy.tensordicts[0]["obs"].fill_(9.0)
    owner.sync("episodes")
    assert view.tensordicts[0]["obs"].tolist() == [[9.0, 9.0]]


def test_coordinators_replicate_a_lazy_stack_and_a_local_attach_by_address_sees_the_replica(coordinators):
    owner, other = coordinators
    members = [shared_td.TensorDict(v=torch.full((2, w), float(w)), batch_size=[2]) for w in (1, 3)]
    lazy = owner.publish("lazy", shared_td.LazyStackedTensorDict(*members, stack_dim=1), replicate=True)
    replica = other.attach("lazy")
    # what a worker of node 1 gets: an attach by address to its node's Coordinator
    local = shared_td.attach("lazy", address=other.address, authkey=other.authkey)
    assert type(local) is shared_td.LazyStackedTensorDict and local.stack_dim == 1
    _same_lazy(local, lazy)
    assert _segment(local) == _segment(replica) != _segment(lazy)  # the node's one replica
    lazy.tensordicts[1]["v"].fill_(6.0)
    owner.sync("lazy")
    assert shared_td.wait_version(local, 3, timeout=5) == 3  # (the attach's pull was 2)
    assert local.tensordicts[1]["v"].unique().tolist() == [6.0]


def test_a_republished_tensorclass_makes_the_replica_stale_and_refresh_renews_it(pair):
    owner, other = pair
    owner.publish("step", Step(obs=torch.zeros(2, 3), reward=torch.zeros(2, 1), label="a", batch_size=[2]),
                  share_non_tensor=True)
    view = other.attach("step")
    owner.publish("step", Step(obs=torch.ones(5, 3), reward=torch.ones(5, 1), label="b", batch_size=[5]),
                  share_non_tensor=True)
    assert shared_td.is_stale(view)
    fresh = shared_td.refresh(view)
    assert type(fresh) is Step and fresh.batch_size == (5,) and fresh.label == "b"
    assert fresh.obs.unique().tolist() == [1.0] and view.obs.unique().tolist() == [0.0]


def test_a_tensorclass_unknown_on_the_replica_node_is_never_imported(pair, monkeypatch):
    """The layout names a tensorclass by ``<class 'module.Name'>``; a replica node finds it
    among the tensorclasses defined there (as a load does), never by importing it."""
    from shared_td.containers import tensorclass as tensorclass_module

    owner, other = pair
    owner.publish("step", Step(obs=torch.zeros(2, 3), reward=torch.zeros(2, 1), label="a", batch_size=[2]),
                  share_non_tensor=True)
    monkeypatch.delitem(tensorclass_module._REGISTRY, str(Step))  # as on a node that never imported it
    with pytest.raises(RuntimeError, match=r"tests\.cluster\.cluster_children\.Step.*import the module"):
        other.attach("step")
    monkeypatch.undo()
    # a layout (signed by a member) naming a class of a module nobody imported
    owner.publish("forged", Step(obs=torch.zeros(2, 3), reward=torch.zeros(2, 1), label="a", batch_size=[2]),
                  share_non_tensor=True)
    info = owner._store.get_json("name/forged")
    root = next(node for node in info["layout"]["nodes"] if node["path"] == [])
    root["meta"]["_type"] = "<class 'antigravity.Step'>"
    owner._store.set_json("name/forged", info)
    assert "antigravity" not in sys.modules
    with pytest.raises(RuntimeError, match="antigravity.Step.*import the module"):
        other.attach("forged")
    assert "antigravity" not in sys.modules
    assert type(other.attach("step")) is Step  # a later attach, with the class defined, works


def test_what_does_not_replicate_is_a_clear_error(pair):
    owner, _other = pair
    with pytest.raises(TypeError, match=r"the leaf \('step', 'label'\) is a non-tensor value.*share_non_tensor=True"):
        owner.publish("p", kinds_td(2))
    with pytest.raises(TypeError, match="a replicated name is a TensorDict, a tensorclass or a lazy stack"):
        owner.publish("value", shared_td.NonTensorData("x"), share_non_tensor=True)
    with pytest.raises(TypeError, match="'plain': a replicated name is .* not a dict"):
        owner.publish("plain", {"x": torch.zeros(2)})
    refused = kinds_td(2)
    with pytest.raises(TypeError):
        owner.publish("refused", refused)
    assert not refused.is_memmap() and not owner.holds("refused")  # refused before any change



def test_rows_of_a_push_are_what_indexing_selects_for_every_kind_and_dtype():
    """pack_rows/unpack_rows over a layout (no network): a lazy stack along dim 0 (rows
    are whole members, of mixed dtypes: unaligned after a bool) beside one along dim 1."""
    from shared_td.coordinator import cluster_layout, cluster_replica

    def tree(fill):
        along0 = shared_td.LazyStackedTensorDict(*[
            shared_td.TensorDict(flag=torch.full((m + 1,), bool(fill)), big=torch.full((m + 2, 3), fill, dtype=torch.float64),
                                 batch_size=[]) for m in range(3)], stack_dim=0)
        along1 = shared_td.LazyStackedTensorDict(*[
            shared_td.TensorDict(v=torch.full((3, w), fill), batch_size=[3]) for w in (1, 4)], stack_dim=1)
        return shared_td.TensorDict(a=along0, b=along1, batch_size=[3]).memmap_()

    source, target = tree(1.0), tree(0.0)
    layout, segment, _cells = cluster_layout.describe(source, "t")
    target_layout, target_segment, _ = cluster_layout.describe(target, "t")
    assert [leaf.get("row") for leaf in layout["leaves"]] == [0, 0, 1, 1, 2, 2, None, None]
    index = torch.tensor([2, 0, 2])  # a duplicate is written once more, with the same rows
    message = cluster_replica.pack_rows(cluster_replica.leaf_views(segment, layout), index)
    cluster_replica.unpack_rows(cluster_replica.leaf_views(target_segment, target_layout), message, 3)
    expected = tree(0.0)
    for row in (0, 2):  # what expected[row] = source[row] writes
        expected["a"].tensordicts[row].update_(source["a"].tensordicts[row])
        for member, origin in zip(expected["b"].tensordicts, source["b"].tensordicts):
            member["v"][row] = origin["v"][row]
    for got, want in zip(cluster_layout.tensor_leaves(target), cluster_layout.tensor_leaves(expected)):
        assert torch.equal(got, want)
    assert target["a"].tensordicts[1]["big"].unique().tolist() == [0.0]  # not pushed


@pytest.mark.parametrize("lost", [("1",), ("1", "2")])
def test_a_layout_whose_lazy_stack_lost_members_is_refused_however_far_the_gap(lost):
    """A layout without the member count (tensordict's saves have none) whose lazy stack
    lacks member 1, or members 1 and 2: an error naming member 1 (with 1 and 2 lost, the
    check looked one index ahead only and rebuilt a stack of one member, silently)."""
    from shared_td.coordinator import cluster_layout
    from shared_td.errors import FormatError

    stack = shared_td.lazy_stack([shared_td.TensorDict(a=torch.full((2,), float(i)), batch_size=[2])
                                  for i in range(4)]).memmap_()
    layout, segment, cells = cluster_layout.describe(stack, "t")
    layout["nodes"][0]["meta"].pop("_shared_td_members")
    layout["nodes"] = [node for node in layout["nodes"] if tuple(node["path"][:1]) not in {(m,) for m in lost}]
    layout["leaves"] = [leaf for leaf in layout["leaves"] if leaf["key"][0] not in lost]
    with pytest.raises(FormatError, match=r"member 1\b|1/"):
        cluster_layout.rebuild("t", layout, cells, segment)
