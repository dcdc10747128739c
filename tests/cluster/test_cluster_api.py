"""The cluster's user API beyond tensors (issue 14), with two members in one process.

Cluster-wide ``share_non_tensor`` values, ``SharedCounter(cluster=...)``,
``shared_td.version``/``wait_version``, top-level ``is_stale``/``refresh`` of a replica,
and the KeyError of an attach of a name that lives unreplicated on another node
(tensorclasses and lazy stacks: test_cluster_kinds.py). Two
Cluster (or clustered Coordinator) objects of one process are two nodes for the store and
gloo (see test_cluster_store.py); test_cluster_values.py runs real node process trees.
"""
from __future__ import annotations

import base64
import json
import pickle
import threading
import time

import pytest
import torch

torch_dist = pytest.importorskip("torch.distributed")

import shared_td  # noqa: E402
from tests.cluster.test_cluster_store import KEY, _start_together, pair, store  # noqa: E402,F401 (fixtures)
from tests.processes import wait_until  # noqa: E402


def _valued(rows=4, task="walk"):
    return shared_td.TensorDict(
        x=torch.arange(float(rows)), task=task,
        sub=shared_td.TensorDict(cfg=shared_td.NonTensorData({"lr": 0.1}, batch_size=[rows]), batch_size=[rows]),
        batch_size=[rows],
    )


def _seen(td, key, value, timeout=5.0) -> float:
    """Seconds until ``td[key] == value`` (bounded: fails after ``timeout``)."""
    began = time.perf_counter()
    assert wait_until(lambda: td[key] == value, timeout), (key, td[key], value)
    return time.perf_counter() - began


# ---------------------------------------------------------------- non-tensor values
def test_non_tensor_values_replicate_and_a_set_on_either_node_reaches_the_other(pair):
    owner, other = pair
    td = owner.publish("p", _valued(), share_non_tensor=True)
    view = other.attach("p")
    assert view["task"] == "walk" and view["sub", "cfg"] == {"lr": 0.1}
    assert view["x"].tolist() == [0.0, 1.0, 2.0, 3.0]
    # each node has its own cell: the replica's value is in this node's memory
    assert view.get("task")._shared_value.key != td.get("task")._shared_value.key
    td.set_("task", "run")  # on the owner
    assert _seen(view, "task", "run") < 1.0
    view.set_(("sub", "cfg"), {"lr": 0.01})  # on the replica
    assert _seen(td, ("sub", "cfg"), {"lr": 0.01}) < 1.0
    assert view["task"] == "run"  # the other value is untouched


def test_a_non_tensor_stack_replicates_and_a_row_written_on_either_node_reaches_the_other(pair):
    owner, other = pair
    td = owner.publish("p", shared_td.TensorDict(x=torch.zeros(3), labels=shared_td.NonTensorStack("a", [1], "c"),
                                                 batch_size=[3]), share_non_tensor=True)
    view = other.attach("p")
    assert view["labels"] == ["a", [1], "c"] and view[1]["labels"] == [1]  # a list value stays one value
    view[1] = shared_td.TensorDict(x=torch.ones(()), labels="B", batch_size=[])  # one row, on the replica
    assert _seen(td, "labels", ["a", "B", "c"]) < 1.0
    assert td["x"].tolist() == [0.0, 0.0, 0.0]  # tensors travel with sync/pull/push, not by themselves
    td.set_("labels", ["x", "y", "z"])
    assert _seen(view, "labels", ["x", "y", "z"]) < 1.0


def test_an_unchanged_value_is_read_without_the_network(pair):
    owner, other = pair
    owner.publish("p", _valued(), share_non_tensor=True)
    view = other.attach("p")
    entry = view.get("task")
    store = other._store

    def no_network(*_args, **_kwargs):
        raise AssertionError("a read of an unchanged value went to the store")

    saved = store._store
    store._store = no_network
    try:
        began = time.perf_counter()
        for _ in range(1000):
            assert entry.data == "walk"
        per_read = (time.perf_counter() - began) / 1000
    finally:
        store._store = saved
    assert per_read < 1e-3  # a few µs on a busy CI machine; no round trip


def test_concurrent_sets_on_two_nodes_converge_on_the_highest_version(pair):
    owner, other = pair
    td = owner.publish("p", _valued(), share_non_tensor=True)
    view = other.attach("p")

    def writes(target, node):
        for i in range(40):
            target.set_("task", f"{node}-{i}")

    threads = [threading.Thread(target=writes, args=(td, 0)), threading.Thread(target=writes, args=(view, 1))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    generation = owner.generation("p")

    def settled():
        latest = owner._store.get_json(f"value/p/{generation}/0")
        value = pickle.loads(base64.b64decode(latest["payload"]))  # signature checked by get_json
        return td["task"] == view["task"] == value

    assert wait_until(settled, 10), (td["task"], view["task"])
    assert td["task"] in ("0-39", "1-39")  # the last write of one of the two nodes


def test_a_forged_value_is_refused_before_it_is_unpickled(pair, store, tmp_path):
    owner, other = pair
    owner.publish("p", _valued(), share_non_tensor=True)
    view = other.attach("p")
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return exec, (f"open({str(marker)!r}, 'w').close()",)

    payload = base64.b64encode(pickle.dumps(Evil())).decode()
    notice = {"op": "value", "from": 0, "name": "p", "generation": owner.generation("p"), "index": 0,
              "version": 10**6, "payload": payload}
    # unsigned, and signed with another key: both refused by the service thread
    store.queue_push("shared_td/queue/1", b"0" * 32 + json.dumps(notice).encode())
    from shared_td.coordinator.cluster_store import SignedStore

    SignedStore(store, b"another key", timeout=5).push_json("queue/1", notice)
    assert wait_until(lambda: other.refused >= 2, 5), other.refused
    assert not marker.exists()
    assert view["task"] == "walk"
    # a forged latest value: a new attach never unpickles it, counts it, and gets the
    # owner's value (stored again by the owner: see test_cluster_records)
    store.set(f"shared_td/value/p/{owner.generation('p')}/0", b"1" * 32 + json.dumps(
        {"version": 10**6, "payload": payload}).encode())
    owner.publish("q", _valued(task="run"), share_non_tensor=True)
    store.set(f"shared_td/value/q/{owner.generation('q')}/0", b"1" * 32 + json.dumps(
        {"version": 10**6, "payload": payload}).encode())
    store.get(f"shared_td/value/q/{owner.generation('q')}/0")  # (a TCPStore set is not answered)
    refused = other.refused
    assert other.attach("q")["task"] == "run"
    assert other.refused == refused + 1
    assert not marker.exists()


# ---------------------------------------------------------------- versions, staleness
def test_version_and_wait_version_are_public(pair):
    owner, other = pair
    td = owner.publish("p", shared_td.TensorDict(x=torch.zeros(3), batch_size=[3]))
    view = other.attach("p")  # its pull: delivery 2 (the publish is version 1)
    assert shared_td.version(view) == 2 == shared_td.wait_version(view, 1, timeout=1)
    with pytest.raises(TimeoutError, match="version 3"):
        shared_td.wait_version(view, 3, timeout=0.2)
    td["x"].fill_(4.0)
    owner.sync("p")
    assert shared_td.wait_version(view, 3, timeout=5) == 3 == shared_td.version(view)
    assert view["x"].tolist() == [4.0] * 3
    with pytest.raises(ValueError, match="not a replica.*written in place"):
        shared_td.version(td)


def test_top_level_is_stale_and_refresh_of_a_replica(pair):
    owner, other = pair
    owner.publish("p", shared_td.TensorDict(x=torch.zeros(3), batch_size=[3]))
    view = other.attach("p")
    assert not shared_td.is_stale(view)
    assert shared_td.refresh(view) is view
    owner.publish("p", shared_td.TensorDict(x=torch.ones(5), y=torch.ones(5, 2), batch_size=[5]))
    assert shared_td.is_stale(view)
    fresh = shared_td.refresh(view)
    assert fresh is not view and not shared_td.is_stale(fresh)
    assert fresh["x"].tolist() == [1.0] * 5 and fresh["y"].shape == (5, 2)
    assert view["x"].tolist() == [0.0] * 3  # the old replica keeps its memory


# ---------------------------------------------------------------- coordinators
@pytest.fixture
def coordinators(store):
    url = f"tcp://127.0.0.1:{store.port}?host=0"
    coords = [shared_td.Coordinator(cluster=url, node=n, nodes=2, authkey=KEY, timeout=10.0) for n in range(2)]
    errors = _start_together(coords)
    try:
        assert not errors, errors
        yield coords
    finally:
        for coord in coords:
            coord.shutdown()


def test_attach_of_a_name_that_lives_unreplicated_on_another_node_says_where(coordinators):
    first, second = coordinators
    second.publish("local", shared_td.TensorDict(x=torch.zeros(2), batch_size=[2]))
    with pytest.raises(KeyError, match=r"'local' is published on node 1 without replicate=True.*"
                                       r"replicate=True.*attach it on node 1"):
        first.attach("local")
    with pytest.raises(KeyError, match="Nor is it published on another node"):
        first.attach("nowhere")
    second.unpublish("local")
    with pytest.raises(KeyError, match="Nor is it published on another node"):
        first.attach("local")


def test_shared_counter_of_a_cluster(coordinators):
    first, second = coordinators
    a = shared_td.SharedCounter("cursor", cluster=first)
    b = shared_td.SharedCounter("cursor", cluster=second)
    assert [a.fetch_add(3), b.fetch_add(2), a.fetch_add()] == [0, 3, 5]
    assert b.value == 6
    default = shared_td.SharedCounter(cluster=second)
    assert shared_td.SharedCounter(cluster=first).fetch_add(7) == 0 and default.value == 7
    with pytest.raises(ValueError, match="starts at 0"):
        shared_td.SharedCounter(5, cluster=first)
    with pytest.raises(TypeError, match="counter\\(name\\)"):
        shared_td.SharedCounter(cluster=object())
    assert shared_td.SharedCounter(2).fetch_add(1) == 2  # one machine, as before


def test_a_republish_turns_the_views_of_a_replica_node_stale_and_refresh_renews_them(coordinators):
    owner, other = coordinators
    owner.publish("p", shared_td.TensorDict(x=torch.zeros(3), batch_size=[3]), replicate=True)
    other.attach("p")  # the node's replica
    # what a worker of that node gets: an attach by address to the node's Coordinator
    local = shared_td.attach("p", address=other.address, authkey=other.authkey)
    assert local["x"].tolist() == [0.0] * 3 and not shared_td.is_stale(local)
    owner.publish("p", shared_td.TensorDict(x=torch.ones(4), batch_size=[4]), replicate=True)
    assert wait_until(lambda: shared_td.is_stale(local), 10)
    fresh = shared_td.refresh(local)
    assert fresh["x"].tolist() == [1.0] * 4 and not shared_td.is_stale(fresh)
    assert shared_td.version(fresh) == 2  # the renew's pull (the new publish is version 1)
    assert other.cluster.renew_failures == 0


def test_a_failed_first_attach_leaves_no_half_made_replica(pair, monkeypatch):
    from shared_td.coordinator import cluster_liveness

    monkeypatch.setattr(cluster_liveness, "LOST_AFTER_S", 0.6)  # keeps the test short
    owner, other = pair
    owner.publish("p", shared_td.TensorDict(x=torch.arange(3.0), batch_size=[3]))
    owner.shutdown()  # its heartbeat and service stop: the first transfer cannot happen
    for _ in range(2):  # the second attach tries again; it never returns an unfilled replica
        # (a clean shutdown: its "left" heartbeat and released claim say so, not a stood-still beat)
        with pytest.raises(shared_td.OwnerLostError, match=r"Node 0, the owner of .p., left the cluster \(shutdown\)"):
            other.attach("p")
    assert "p" not in other._replicas and not other._filling


def test_coordinator_publish_replicate_with_share_non_tensor(coordinators):
    owner, other = coordinators
    td = owner.publish("cfg", _valued(), replicate=True, share_non_tensor=True)
    assert other.attach("cfg")["task"] == "walk"
    # a process of node 1 attached by address (as a worker is) writes; node 0 sees it
    local = shared_td.attach("cfg", address=other.address, authkey=other.authkey)
    local.set_("task", "from a worker of node 1")
    assert _seen(td, "task", "from a worker of node 1") < 1.0
    with pytest.raises(ValueError, match="only share_non_tensor"):
        owner.publish("bad", _valued(), replicate=True, copy_existing=True)
