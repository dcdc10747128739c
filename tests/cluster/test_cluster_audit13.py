"""What the thirteenth audit of the cluster found: a node number held by a process
with another authkey refused with the wrong cause, and a transfer ended by its own
node's shutdown reported as a peer alive after a 3.7 s wait. Nodes of a cluster in this process,
on a loopback store; every wait bounded."""
from __future__ import annotations

import threading
import time

import pytest
import torch

pytest.importorskip("torch.distributed")

import shared_td  # noqa: E402
from shared_td.coordinator.cluster import Cluster  # noqa: E402
from shared_td.coordinator.cluster_store import SignedStore  # noqa: E402
from tests.cluster.stores import beating  # noqa: E402
from tests.cluster.test_cluster_store import KEY, pair, store  # noqa: E402,F401 - fixtures


#: Rows of a float32 leaf: 1 MB, a transfer waited for in a waiter thread (over
#: cluster_transfer.DIRECT_MAX_BYTES), while the caller watches the peer.
ROWS = 1 << 18


def _url(store) -> str:
    return f"tcp://127.0.0.1:{store.port}?host=0"


def test_a_number_run_with_another_key_is_refused_naming_the_key_not_the_numbers(store):
    """A process with another key that keeps beating as node 1 holds the number (it is
    never taken over), but the refusal read "two processes were given node=1" and
    told to renumber the nodes, when the fix is the key."""
    theirs = SignedStore(store, b"their key", timeout=5.0)
    restarted = Cluster(_url(store), 1, 2, authkey=KEY, timeout=5.0, hostname="127.0.0.1")
    try:
        theirs.compare_set("claim/1", "", "their token")
        with beating(theirs, 1, every=0.1):
            began = time.monotonic()
            with pytest.raises(ValueError, match=r"Node 1 is running in this cluster with another authkey: its "
                                                 r"heartbeat hb/1 moves.*same authkey="):
                restarted.start()
            assert time.monotonic() - began < 8  # seen moving, not the join timeout
        assert store.get("shared_td/claim/1") == b"their token"  # never taken over
    finally:
        restarted.shutdown()
        theirs.close()


def test_a_large_pull_under_way_when_its_node_shuts_down_says_so_at_once(pair, monkeypatch):
    """shutdown() ends a large transfer's watched wait at once, but the pull then waited
    LOST_AFTER_S for the owner's heartbeat to stand still (3.7 s) and raised a
    ConnectionError saying the owner is alive and the call may be retried: no retry can
    succeed on a node that was shut down."""
    owner, other = pair
    owner.publish("p", shared_td.TensorDict(x=torch.arange(ROWS, dtype=torch.float32), batch_size=[ROWS]))
    other.attach("p")
    send = owner._groups.send
    sending = threading.Event()

    def late_send(*args, **kwargs):  # the owner starts its send only once the node shut down
        sending.set()
        time.sleep(1.0)
        return send(*args, **kwargs)

    monkeypatch.setattr(owner._groups, "send", late_send)
    wait = other._groups.wait
    waiting = threading.Event()

    def watched_wait(*args, **kwargs):  # the pull's receive is posted: its wait begins
        waiting.set()
        return wait(*args, **kwargs)

    monkeypatch.setattr(other._groups, "wait", watched_wait)
    ended = []

    def pull():
        try:
            other.pull("p")
        except BaseException as err:  # noqa: BLE001 - checked below
            ended.append((err, time.monotonic()))

    puller = threading.Thread(target=pull)
    puller.start()
    try:
        assert sending.wait(10) and waiting.wait(10)  # the pull's receive is posted and watched
        began = time.monotonic()
        other.shutdown()
    finally:
        puller.join(15)
    assert ended, "the pull did not end"
    error, at = ended[0]
    assert isinstance(error, RuntimeError) and not isinstance(error, ConnectionError), error
    assert "Cluster node 1 was shut down during the transfer of 'p' with node 0" in str(error), error
    assert at - began < 2.0


def test_a_request_left_by_a_nodes_previous_process_does_not_hold_its_restart(store, pair):
    """A request the previous process of node 1 left in the owner's lane (it ended just
    after sending it) was served for the new process: its answer was dropped (another
    caller's), but the owner then built the pair generation it named, which the new
    process never joins; the owner's lane waited the cluster's whole timeout, and the
    new process's first attach failed with TimeoutError after 10 s."""
    owner, previous = pair
    owner.publish("p", shared_td.TensorDict(x=torch.arange(8.0), batch_size=[8]))
    generation = owner.generation("p")
    previous.shutdown()
    signed = SignedStore(store, KEY, timeout=5.0)
    restarted = Cluster(_url(store), 1, 2, authkey=KEY, timeout=10.0, hostname="127.0.0.1")
    try:
        signed.push_json("lane/0/1", {"op": "pull", "name": "p", "generation": generation, "from": 1,
                                      "tag": 1024 + 1, "pair": owner._groups.generation(1), "reply": "reply/1/0",
                                      "caller": "the previous process"})
        restarted.start()
        began = time.monotonic()
        assert restarted.attach("p")["x"].tolist() == list(range(8))
        assert time.monotonic() - began < 4.0
        assert owner.refused == 0 and restarted.refused == 0
    finally:
        restarted.shutdown()
        signed.close()



def test_a_node_keeps_no_thread_of_the_pair_generations_it_left(pair):
    """Each pair generation starts a thread that keeps a receive posted for the peer's
    pushes, and it ends with its generation; but the node kept every such Thread in its
    list for good: one more per failed transfer, for the node's whole life."""
    owner, other = pair
    owner.publish("p", shared_td.TensorDict(x=torch.arange(8.0), batch_size=[8]))
    other.attach("p")
    kept = len(other._threads), len(owner._threads)
    for pulls in range(20):  # a failed transfer each: the pair moves to a new generation
        other._groups.fail(0, other._groups.generation(0))
        assert other.pull("p") == 3 + pulls  # (each pull a delivery: the attach's was 2)
    assert len(other._threads) <= kept[0] + 2 and len(owner._threads) <= kept[1] + 2, (kept, other._threads)
