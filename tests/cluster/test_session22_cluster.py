"""Session 22's cluster fixes, two members of one process on a loopback store (see
test_cluster_store.py; every wait bounded; no tensordict counterpart: tensordict has no
cluster):

- a reply queue handed to a drain (a pull given up) is taken again by the node's next
  thread that needs one, not left behind: the store's host keeps every queue it met
  for good (torch 2.13's libuv host: ``delete_key`` erases no queue, ``num_keys``
  counts none), so each pull given up grew it by one queue;
- a wait for a peer's answer finds the peer lost by itself when the watch thread's
  wake-up notice is held up (a stalled store): no single pop outlives the peer's
  liveness deadline (``cluster_wake.pop_bound``).
"""
from __future__ import annotations

import threading
import time

import pytest
import torch

torch_dist = pytest.importorskip("torch.distributed")

import shared_td  # noqa: E402
from shared_td.coordinator import cluster_drain, cluster_liveness, cluster_serve, cluster_wake  # noqa: E402
from shared_td.coordinator.cluster import Cluster  # noqa: E402
from shared_td.coordinator.cluster_attach import ATTACH_TRIES, ClusterAttach  # noqa: E402
from shared_td.coordinator.cluster_wake import WAKE_KEY  # noqa: E402
from tests.cluster.stores import loopback_store  # noqa: E402
from tests.cluster.test_cluster_store import _members  # noqa: E402


#: Node 1 gives a pull up after this; node 0's lane reaches it after LATE.
GIVE_UP = 0.4
LATE = 0.6


@pytest.fixture
def store():
    return loopback_store(10)


def _drains() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == cluster_drain.DRAINER]


def test_the_attach_half_of_the_cluster_is_its_own_module():
    # (the split of cluster.py: the same class, the same names where callers find them)
    from shared_td.coordinator import cluster

    assert issubclass(Cluster, ClusterAttach) and Cluster.attach is ClusterAttach.attach
    assert cluster.ATTACH_TRIES == ATTACH_TRIES == 3


def test_a_reply_queue_given_up_is_taken_again_not_left_in_the_store(store, monkeypatch):
    owner, other = _members(store, (5.0, GIVE_UP))
    try:
        owner.publish("p", shared_td.TensorDict(x=torch.zeros(4), batch_size=[4]))
        other.attach("p")
        replies, real_serve = [], cluster_serve._serve

        def late_serve(cluster, peer, op, name, request):
            if cluster is owner and op == "pull":
                replies.append(request["reply"])
                time.sleep(LATE)  # node 1 gave the pull up meanwhile: its queue goes to a drain
            return real_serve(cluster, peer, op, name, request)

        monkeypatch.setattr(cluster_serve, "_serve", late_serve)
        for _ in range(2):
            with pytest.raises(TimeoutError):
                other.pull("p")
            deadline = time.monotonic() + 10.0
            while _drains() and time.monotonic() < deadline:  # it ends on the owner's answer to the cancel
                time.sleep(0.02)
            assert not _drains()
        monkeypatch.setattr(cluster_serve, "_serve", lambda *args: (replies.append(args[4]["reply"]),
                                                                   real_serve(*args))[1])
        assert other.pull("p") >= 1  # (the drains received what was sent: the pair is intact)
        # before: a new queue per pull given up (reply/1/0, reply/1/1, then reply/1/2), each kept
        # by the store's host for good; now the drained one is taken again
        assert len(replies) == 3 and len(set(replies)) == 1, replies
        assert store.queue_len(f"shared_td/{replies[0]}") == 0  # nothing left in it either
    finally:
        for member in (other, owner):
            member.shutdown()


def test_a_wait_finds_its_lost_peer_when_the_wake_up_notice_is_held_up(store, monkeypatch):
    monkeypatch.setattr(cluster_liveness, "LOST_AFTER_S", 0.6)  # keeps the test short
    monkeypatch.setattr(cluster_wake, "BACKSTOP_SLACK_S", 0.25)  # (scaled down as LOST_AFTER_S)
    owner, other = _members(store, (5.0, 8.0))
    stalled = threading.Event()  # set: the store answers again
    try:
        owner.publish("p", shared_td.TensorDict(x=torch.zeros(4), batch_size=[4]))
        other.attach("p")
        real_push = other._store.push_json

        def stalled_push(queue, value):
            # a store stall: the watch thread's wake-up notice waits behind every call in
            # flight (7.5-7.8 s after an owner's SIGKILL, under load)
            if isinstance(value, dict) and WAKE_KEY in value:
                stalled.wait(10.0)
            return real_push(queue, value)

        monkeypatch.setattr(other._store, "push_json", stalled_push)
        handle = cluster_serve._handle
        monkeypatch.setattr(cluster_serve, "_handle", lambda cluster, request: None if cluster is owner
                            else handle(cluster, request))
        owner._stop.set()  # node 0 beats and serves no more (a SIGKILL, as seen from node 1)
        began = time.monotonic()
        with pytest.raises(shared_td.OwnerLostError):
            other.pull("p")
        took = time.monotonic() - began
        # at most two pops to the liveness deadline (when no look saw the last beat
        # before the first ended); before: until the notice came (the whole stall), or
        # the call's timeout (8 s)
        assert took < 2 * (0.6 + 0.25) + 1.0, took
    finally:
        stalled.set()
        for member in (other, owner):
            member.shutdown()
