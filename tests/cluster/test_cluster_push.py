"""The path of a push (and a sync): the request through the store, the payload and the
signed answer over the pair's gloo group. Two cluster members of one process (fast).
"""
from __future__ import annotations

import threading

import pytest
import torch

pytest.importorskip("torch.distributed")

from tests.cluster.stores import loopback_store  # noqa: E402
from tests.cluster.test_cluster_store import KEY, _pair  # noqa: E402

import shared_td  # noqa: E402
from shared_td.coordinator import cluster_replica, cluster_serve  # noqa: E402
from shared_td.coordinator.cluster_store import ClusterAuthError, SignedStore  # noqa: E402
from shared_td.coordinator.cluster_transfer import ANSWER_BYTES, decode_answer, encode_answer  # noqa: E402


@pytest.fixture
def pair():
    store = loopback_store(10)  # hosted while the members use it
    members = _pair(store)
    yield members
    for member in members:
        member.shutdown()
    del store


def _count_calls(monkeypatch, store: SignedStore, names, thread=None) -> list:
    """The calls of ``store``'s methods ``names`` (from ``thread`` only, when given)."""
    calls = []
    for name in names:
        method = getattr(store, name)

        def counted(*args, _method=method, _name=name):
            if thread is None or threading.get_ident() == thread:
                calls.append((_name, args[0]))
            return _method(*args)

        monkeypatch.setattr(store, name, counted)
    return calls


def test_a_push_makes_one_store_call_and_its_answer_comes_over_the_pair(pair, monkeypatch):
    """The floor of a push is one gloo send plus one store round trip: the pusher's
    request is its only store call, and the owner answers over the pair (before: the
    answer was pushed to and popped from a store queue, two more round trips)."""
    owner, other = pair
    td = owner.publish("p", shared_td.TensorDict(x=torch.zeros(8), batch_size=[8]))
    replica = other.attach("p")
    replica["x"][2] = 5.0
    other.push("p", [2])  # the pair is built
    pusher = _count_calls(monkeypatch, other._store, ["push_json", "pop_json", "get_json", "add"],
                          threading.get_ident())
    answers = _count_calls(monkeypatch, owner._store, ["push_json"])
    for value in (6.0, 7.0, 8.0):
        replica["x"][[1, 3]] = value
        other.push("p", [1, 3])
        assert td["x"].tolist() == [0.0, value, 5.0, value, 0.0, 0.0, 0.0, 0.0]
    assert pusher == [("push_json", "lane/0/1")] * 3
    assert answers == []


def test_a_sync_is_answered_over_the_pair(pair, monkeypatch):
    owner, other = pair
    td = owner.publish("p", shared_td.TensorDict(x=torch.zeros(4), batch_size=[4]))
    replica = other.attach("p")
    answers = _count_calls(monkeypatch, other._store, ["push_json"])
    td["x"].fill_(3.0)
    assert owner.sync("p").delivered == [1]
    assert replica["x"].tolist() == [3.0] * 4 and cluster_replica.replica_version(replica) == 2
    assert answers == []


def test_answers_are_signed_for_their_request_and_cut_to_fit():
    raw = loopback_store(5)
    store, forger = SignedStore(raw, KEY, timeout=1), SignedStore(raw, b"another key", timeout=1)
    message = encode_answer(store, 0, 7 * 1024 + 1, {"ok": True})
    buffer = torch.zeros(ANSWER_BYTES, dtype=torch.uint8)
    buffer[: message.numel()] = message
    assert decode_answer(store, 0, 7 * 1024 + 1, buffer) == {"ok": True}
    with pytest.raises(ClusterAuthError):  # the answer to another request (a replay)
        decode_answer(store, 0, 8 * 1024 + 1, buffer)
    with pytest.raises(ClusterAuthError):  # from another node
        decode_answer(store, 2, 7 * 1024 + 1, buffer)
    with pytest.raises(ClusterAuthError):  # another key
        decode_answer(forger, 0, 7 * 1024 + 1, buffer)
    for length in (0, 3, ANSWER_BYTES):  # a length that does not fit: refused, not parsed
        buffer[:4] = torch.tensor([length], dtype=torch.int32).view(torch.uint8)
        with pytest.raises(ClusterAuthError):
            decode_answer(store, 0, 7 * 1024 + 1, buffer)
    long = encode_answer(store, 0, 1, {"error": "x" * (4 * ANSWER_BYTES)})
    # every answer fills its receive exactly: gloo completes a larger receive 10-40x slower
    assert long.numel() == ANSWER_BYTES == message.numel()
    buffer[: long.numel()] = long
    assert decode_answer(store, 0, 1, buffer)["error"].startswith("xxx")


def test_a_refusal_and_an_error_on_the_owner_are_answered_and_the_pair_stays(pair, monkeypatch):
    owner, other = pair
    td = owner.publish("p", shared_td.TensorDict(x=torch.zeros(4), batch_size=[4]))
    replica = other.attach("p")
    generation = other._groups.generation(0)
    held = owner._owned.pop("p")  # as for a name the owner no longer holds
    with pytest.raises(RuntimeError, match="refused.*'p'.*no generation"):
        other.push("p", [0])
    owner._owned["p"] = held

    def broken(*args):
        raise ValueError("the rows could not be written")

    monkeypatch.setattr(cluster_serve.replica, "unpack_rows", broken)
    with pytest.raises(RuntimeError, match="refused.*ValueError: the rows could not be written"):
        other.push("p", [0])
    monkeypatch.undo()
    replica["x"][0] = 4.0
    other.push("p", [0])
    assert td["x"].tolist() == [4.0, 0.0, 0.0, 0.0]
    assert other._groups.generation(0) == generation  # answered: no transfer failed


def test_tags_stay_in_gloo_range_after_millions_of_requests(pair):
    """gloo takes a 32-bit tag; a request's tag grew by 1024 per request, so a node's
    2,097,152nd request (about half an hour of pushes at 1 kHz) raised a TypeError."""
    import itertools

    owner, other = pair
    td = owner.publish("p", shared_td.TensorDict(x=torch.zeros(4), batch_size=[4]))
    replica = other.attach("p")
    other._tags = itertools.count(2**21 - 2)  # as after two million requests of node 1
    for value in (1.0, 2.0, 3.0, 4.0):
        replica["x"][1] = value
        other.push("p", [1])
        assert td["x"][1] == value
    td["x"][0] = 9.0
    other.pull("p")
    assert replica["x"][0] == 9.0


def test_a_push_that_must_build_a_new_pair_with_a_lost_owner_raises_owner_lost_in_time():
    """A push whose pair with the owner must be built again (a failed transfer moved it to
    the next generation) waits for the owner to join that group, and a lost owner never
    joins: OwnerLostError came only when gloo's rendezvous timed out (the cluster's
    timeout), and must come once the owner's heartbeat stands still."""
    import time

    from shared_td.coordinator.cluster_liveness import HEARTBEAT_S, LOST_AFTER_S

    store = loopback_store(30)
    owner, other = _pair(store, timeout=20.0)
    try:
        owner.publish("p", shared_td.TensorDict(x=torch.zeros(4), batch_size=[4]))
        other.attach("p")
        other.push("p", [1])  # the pair is built and used
        generation = other._groups.generation(0)
        owner.shutdown()  # as lost as an in-process node gets: no heartbeat, no lane, no pair
        other._groups.fail(0, generation)  # the next push builds generation + 1
        began = time.monotonic()
        with pytest.raises(shared_td.OwnerLostError):
            other.push("p", [2])
        took = time.monotonic() - began
        assert took < LOST_AFTER_S + 4 * HEARTBEAT_S + 1.0, took  # was the timeout (20 s)
    finally:
        other.shutdown()
        owner.shutdown()
