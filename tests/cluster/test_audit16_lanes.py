"""What the sixteenth audit of the cluster found in its serving threads and its replica
records: a lane ended in silence on a store error (a wake-up torch's store sends a
connection for a queue it popped before), two nodes that re-published at once waited
out the timeout for each other's lanes, an old ``has/`` record made every sync send the
whole payload to a node restarted without a replica, and a sync under way at shutdown
blamed the replica node. Nodes of a cluster in this process, on a loopback store;
every wait bounded."""
from __future__ import annotations

import threading
import time

import pytest
import torch

torch_dist = pytest.importorskip("torch.distributed")

import shared_td  # noqa: E402
from shared_td.coordinator import cluster_serve  # noqa: E402
from shared_td.coordinator.cluster import Cluster  # noqa: E402
from shared_td.coordinator.cluster_store import SignedStore  # noqa: E402
from tests.cluster.test_cluster_store import KEY, _pair, pair, store  # noqa: E402,F401 - fixtures

#: float32 rows of a name whose payload (2 MiB) is over UNHELD_SCRATCH_BYTES
BIG_ROWS = 1 << 19


def _url(store) -> str:
    return f"tcp://127.0.0.1:{store.port}?host=0"


def _until(check, bound: float) -> bool:
    deadline = time.monotonic() + bound
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_a_pop_is_not_woken_by_the_next_value_of_a_queue_the_thread_popped_before(store):
    """A TCPStore connection whose blocking pop of ``lane`` was answered stays a waiter
    of ``lane`` on the store's host: the next value pushed there woke its next blocking
    pop of ``reply``, which failed at once with QueueEmptyError (what a lane that
    renewed a replica met when the peer sent its next request meanwhile: the lane ended)."""
    signed, peer = SignedStore(store, KEY, timeout=5.0), SignedStore(store, KEY, timeout=5.0)
    got = []

    def lane():
        try:
            got.append(signed.pop_json("lane", 5.0))  # answered by the push below
            threading.Timer(0.05, peer.push_json, args=("lane", {"n": 2})).start()
            began = time.monotonic()
            got.append(signed.pop_json("reply", 0.5))  # no answer comes
            got.append(time.monotonic() - began)
            got.append(signed.pop_json("lane", 1.0))
        except BaseException as err:  # noqa: BLE001 - checked below
            got.append(err)

    thread = threading.Thread(target=lane)
    thread.start()
    time.sleep(0.2)  # the pop waits
    peer.push_json("lane", {"n": 1})
    thread.join(10)
    assert len(got) == 4, got
    assert got[0] == {"n": 1} and got[1] is None and got[2] >= 0.45 and got[3] == {"n": 2}, got


def test_a_pop_woken_for_nothing_waits_again_within_its_timeout(store, monkeypatch):
    """A wake-up that finds the queue empty (QueueEmptyError) is "nothing yet": it
    escaped pop_json, and a lane took any such error for the store gone."""
    signed = SignedStore(store, KEY, timeout=5.0)
    real_pop = torch_dist.PrefixStore.queue_pop
    strays = []

    def pop(self, key, *args):
        if key == "q" and not strays:  # the first pop: woken for another queue's value
            strays.append(key)
            raise torch_dist.QueueEmptyError("queue is empty")
        return real_pop(self, key, *args)

    monkeypatch.setattr(torch_dist.PrefixStore, "queue_pop", pop)
    threading.Timer(0.2, signed.push_json, args=("q", {"n": 1})).start()
    assert signed.pop_json("q", 5.0) == {"n": 1} and strays == ["q"]
    strays.clear()
    began = time.monotonic()
    assert signed.pop_json("q", 0.3) is None  # woken in vain, then nothing within the timeout
    assert 0.25 <= time.monotonic() - began < 2.0


def test_a_lane_serves_on_after_an_error_of_the_store_and_counts_it(pair, monkeypatch):
    """Any error of a lane's pop (a QueueEmptyError, a DistStoreError) ended the lane as if
    the store were gone, while its node kept beating: the peer's later requests waited
    in vain (a sync was dropped, a pull timed out)."""
    owner, other = pair
    owner.publish("p", shared_td.TensorDict(x=torch.zeros(4), batch_size=[4]))
    replica = other.attach("p")
    real_pop = other._store.pop_json
    failed = []

    def pop(queue, *args):
        if queue == "lane/1/0" and not failed:
            failed.append(queue)
            raise torch_dist.DistStoreError("the store answered something unexpected")
        return real_pop(queue, *args)

    monkeypatch.setattr(other._store, "pop_json", pop)
    owner._store.push_json("lane/1/0", {"op": "stop", "from": 0})  # the lane's pop under way returns
    assert _until(lambda: failed, 5.0)
    report = owner.sync("p", timeout=3.0)
    assert report.delivered == [1] and report.dropped == {}, report
    assert replica["x"].tolist() == [0.0] * 4 and other.version("p") == 3  # (the attach's pull was 2)
    assert other.serve_errors == 1
    assert any(t.name == "shared_td-cluster-lane-0" and t.is_alive() for t in other._threads)


def test_two_nodes_that_republish_at_once_renew_each_others_replica_at_once(store):
    """Each node renewed its replica in the lane that serves the other node, and the
    renew's pull waited for the other node's lane, which renewed too: both waited out
    the timeout (or one lane's wait for its answer was woken by the other's request,
    failed with QueueEmptyError, and the lane ended)."""
    members = _pair(store, timeout=4.0)
    try:
        zero, one = members
        zero.publish("y", shared_td.TensorDict(w=torch.zeros(1 << 15), batch_size=[1 << 15]))
        one.publish("z", shared_td.TensorDict(w=torch.zeros(1 << 15), batch_size=[1 << 15]))
        zero.attach("z"), one.attach("y")
        ready = threading.Barrier(2)

        def republish(member, name):
            ready.wait(5)
            member.publish(name, shared_td.TensorDict(w=torch.ones(1 << 15), batch_size=[1 << 15]))

        threads = [threading.Thread(target=republish, args=(zero, "y")),
                   threading.Thread(target=republish, args=(one, "z"))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
        began = time.monotonic()
        assert _until(lambda: zero._replicas["z"].generation == one._replicas["y"].generation == 2, 3.0), (
            zero.renew_failures, one.renew_failures)
        assert time.monotonic() - began < 2.0
        assert zero.renew_failures == one.renew_failures == 0
        assert zero.attach("z")["w"].tolist() == one.attach("y")["w"].tolist() == [1.0] * (1 << 15)
        assert zero.pull("z") == one.pull("y") == 3  # both lanes serve (the renew's pull was delivery 2)
    finally:
        for member in members:
            member.shutdown()


class _Sizes:
    """``torch`` for cluster_serve, noting the size of each ``torch.empty``."""

    def __init__(self):
        self.sizes = []

    def __getattr__(self, name):
        return getattr(torch, name)

    def empty(self, size, *args, **kwargs):
        self.sizes.append(size)
        return torch.empty(size, *args, **kwargs)


def test_a_node_restarted_without_a_replica_is_not_sent_the_payload_of_every_sync(store, pair, monkeypatch):
    """The record has/<name>/<node> of the node's previous process stayed: every sync
    sent the whole payload to the restarted process, which received it into scratch
    memory of its size (its peak memory doubled with a 256 MB name) and refused it."""
    owner, previous = pair
    owner.publish("big", shared_td.TensorDict(w=torch.ones(BIG_ROWS), batch_size=[BIG_ROWS]))
    previous.attach("big")
    previous.shutdown()
    sizes = _Sizes()
    monkeypatch.setattr(cluster_serve, "torch", sizes)
    restarted = Cluster(_url(store), 1, 2, authkey=KEY, timeout=5.0, hostname="127.0.0.1")
    try:
        restarted.start()
        reports = [owner.sync("big", timeout=3.0) for _ in range(3)]
        assert all(report.delivered == [] for report in reports), reports
        # the first one at most drops the node (a record that names no process), the others do not send
        assert all(report.dropped == {} for report in reports[1:]), reports
        assert not [size for size in sizes.sizes if size >= 4 * BIG_ROWS], sizes.sizes  # no scratch of its size
        key = "shared_td/has/big/1"
        assert not store.check([key]) or store.get(key) == b""  # deleted, or emptied
        restarted.attach("big")  # a replica of its own: synced
        assert owner.sync("big", timeout=3.0).delivered == [1]
    finally:
        restarted.shutdown()


def test_a_record_of_a_process_that_left_the_node_is_ignored_and_taken_back(store, pair):
    """A record names the process that holds the replica (its claim token): one of a
    process that no longer runs as the node is not a sync target, and is emptied."""
    owner, other = pair
    td = owner.publish("p", shared_td.TensorDict(x=torch.zeros(4), batch_size=[4]))
    other.attach("p")
    digest = owner._owned["p"].digest  # (a record names the publish it holds: see audit 18)
    owner._store.set_json("has/p/1", {"generation": 1, "digest": digest, "claim": "a process before this one"})
    report = owner.sync("p")
    assert report.delivered == [] and report.dropped == {}, report
    assert store.get("shared_td/has/p/1") == b""  # taken back
    owner._store.set_json("has/p/1", {"generation": 1, "digest": digest, "claim": other._claim})  # the holder's own
    td["x"].fill_(3.0)
    assert owner.sync("p").delivered == [1]
    assert other.attach("p")["x"].tolist() == [3.0] * 4


def test_a_sync_goes_to_the_replicas_of_the_current_generation_only(pair, monkeypatch):
    """The record's generation was not read: a sync of a re-published name went to a
    node that still held the old generation, which refused it (dropped)."""
    monkeypatch.setattr(cluster_serve, "renew", lambda *args: None)  # node 1 does not renew
    owner, other = pair
    owner.publish("p", shared_td.TensorDict(x=torch.zeros(4), batch_size=[4]))
    other.attach("p")
    owner.publish("p", shared_td.TensorDict(x=torch.ones(4), batch_size=[4]))
    report = owner.sync("p", timeout=3.0)
    assert report.delivered == [] and report.dropped == {}, report
    assert other.attach("p")["x"].tolist() == [1.0] * 4  # renewed: its record names the new generation
    assert owner.sync("p").delivered == [1]


def test_a_sync_under_way_when_its_node_shuts_down_says_so(pair, monkeypatch):
    """It returned a SyncReport that dropped the replica node ("TransferFailed: ...
    pair closure"), where every call after shutdown() is a RuntimeError that says so."""
    owner, other = pair
    owner.publish("p", shared_td.TensorDict(x=torch.zeros(4), batch_size=[4]))
    other.attach("p")
    send = owner._groups.send
    sending = threading.Event()

    def late_send(*args, **kwargs):  # the owner sends the payload once its node shut down
        sending.set()
        time.sleep(0.5)
        return send(*args, **kwargs)

    monkeypatch.setattr(owner._groups, "send", late_send)
    ended = []

    def sync():
        try:
            ended.append(owner.sync("p", timeout=5.0))
        except BaseException as err:  # noqa: BLE001 - checked below
            ended.append(err)

    syncing = threading.Thread(target=sync)
    syncing.start()
    try:
        assert sending.wait(5)
        owner.shutdown()
    finally:
        syncing.join(10)
    assert ended and isinstance(ended[0], RuntimeError), ended
    assert "Cluster node 0 was shut down during the sync of 'p'" in str(ended[0]), ended
