"""The path of a push (and a sync): once the pair is built, a signed header and the rows
in one gloo message into the receive the owner keeps posted (the first push on a pair: a
request through the store), and the signed answer over the pair's gloo group. Two cluster
members of one process (fast).
"""
from __future__ import annotations

import threading
import time

import pytest
import torch

pytest.importorskip("torch.distributed")

from tests.cluster.stores import loopback_store  # noqa: E402
from tests.cluster.test_cluster_store import KEY, _pair  # noqa: E402
from tests.processes import wait_until  # noqa: E402

import shared_td  # noqa: E402
from shared_td.coordinator import cluster_replica, cluster_serve  # noqa: E402
from shared_td.coordinator.cluster_store import ClusterAuthError, SignedStore  # noqa: E402
from shared_td.coordinator.cluster_serve import HEADER_BYTES  # noqa: E402
from shared_td.coordinator.cluster_transfer import (ANSWER_BYTES, ANSWER_TAG_BIT, PUSH_TAG, PairGroups,  # noqa: E402
                                                    answer_context, decode_signed, encode_signed, push_context)


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


def test_a_push_is_one_message_over_the_pair_and_answered_there(pair, monkeypatch):
    """The floor of a push is one gloo send plus one store round trip. Once the pair is
    built, the owner keeps a receive posted for the next push: the pusher sends its
    signed header and rows in one message and gets the answer over the pair, with no
    store call on either side (before: a request pushed to the store and popped by the
    owner's lane, which only then posted the receive for the rows)."""
    owner, other = pair
    td = owner.publish("p", shared_td.TensorDict(x=torch.zeros(8), batch_size=[8]))
    replica = other.attach("p")
    replica["x"][2] = 5.0
    other.push("p", [2])  # the pair exists since the attach
    pusher = _count_calls(monkeypatch, other._store, ["push_json", "pop_json", "get_json", "add"],
                          threading.get_ident())
    answers = _count_calls(monkeypatch, owner._store, ["push_json"])
    for value in (6.0, 7.0, 8.0):
        replica["x"][[1, 3]] = value
        other.push("p", [1, 3])
        assert td["x"].tolist() == [0.0, value, 5.0, value, 0.0, 0.0, 0.0, 0.0]
    assert pusher == []
    assert answers == []


def test_a_sync_is_answered_over_the_pair(pair, monkeypatch):
    owner, other = pair
    td = owner.publish("p", shared_td.TensorDict(x=torch.zeros(4), batch_size=[4]))
    replica = other.attach("p")
    answers = _count_calls(monkeypatch, other._store, ["push_json"])
    td["x"].fill_(3.0)
    assert owner.sync("p").delivered == [1]
    assert replica["x"].tolist() == [3.0] * 4 and cluster_replica.replica_version(replica) == 3  # (attach: 2)
    assert answers == []


def test_answers_are_signed_for_their_request_and_cut_to_fit():
    raw = loopback_store(5)
    store, forger = SignedStore(raw, KEY, timeout=1), SignedStore(raw, b"another key", timeout=1)
    message = encode_signed(store, answer_context(0, 1, 3, 7 * 1024 + 1), {"ok": True})
    buffer = torch.zeros(ANSWER_BYTES, dtype=torch.uint8)
    buffer[: message.numel()] = message
    assert decode_signed(store, answer_context(0, 1, 3, 7 * 1024 + 1), buffer) == {"ok": True}
    with pytest.raises(ClusterAuthError):  # the answer to another request (a replay)
        decode_signed(store, answer_context(0, 1, 3, 8 * 1024 + 1), buffer)
    with pytest.raises(ClusterAuthError):  # from another node
        decode_signed(store, answer_context(2, 1, 3, 7 * 1024 + 1), buffer)
    with pytest.raises(ClusterAuthError):  # to another node
        decode_signed(store, answer_context(0, 2, 3, 7 * 1024 + 1), buffer)
    with pytest.raises(ClusterAuthError):  # over another pair generation: a restarted node's same tag
        decode_signed(store, answer_context(0, 1, 4, 7 * 1024 + 1), buffer)
    with pytest.raises(ClusterAuthError):  # another key
        decode_signed(forger, answer_context(0, 1, 3, 7 * 1024 + 1), buffer)
    with pytest.raises(ClusterAuthError):  # a push header is not an answer
        decode_signed(store, push_context(0, 1, 1), buffer)
    for length in (0, 3, ANSWER_BYTES):  # a length that does not fit: refused, not parsed
        buffer[:4] = torch.tensor([length], dtype=torch.int32).view(torch.uint8)
        with pytest.raises(ClusterAuthError):
            decode_signed(store, answer_context(0, 1, 3, 7 * 1024 + 1), buffer)
    long = encode_signed(store, answer_context(0, 1, 3, 1), {"error": "x" * (4 * ANSWER_BYTES)})
    # every answer fills its receive exactly: gloo completes a larger receive 10-40x slower
    assert long.numel() == ANSWER_BYTES == message.numel()
    buffer[: long.numel()] = long
    assert decode_signed(store, answer_context(0, 1, 3, 1), buffer)["error"].startswith("xxx")
    with pytest.raises(ValueError, match="does not fit"):  # only an error text is cut
        encode_signed(store, push_context(0, 1, 1), {"name": "n" * HEADER_BYTES}, HEADER_BYTES)


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
    from shared_td.coordinator.cluster_liveness import HEARTBEAT_S, LOST_AFTER_S

    store = loopback_store(30)
    # 10 s: above the bound below, and the build given up still waits in gloo's rendezvous
    # until then (it cannot be interrupted): with 20 s it ended during this process's
    # exit, 20 s later, once the later tests of this file took that long, and the
    # interpreter aborted there ("terminate called without an active exception")
    owner, other = _pair(store, timeout=10.0)
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
        assert took < LOST_AFTER_S + 4 * HEARTBEAT_S + 1.0, took  # was the timeout (10 s)
    finally:
        other.shutdown()
        owner.shutdown()


def _listeners(member) -> list:
    """``member``'s threads that keep a receive posted for a peer's pushes."""
    return [t for t in member._threads if t.name.startswith("shared_td-cluster-pushes-") and t.is_alive()]


def _sent_on_push_tag(monkeypatch) -> list:
    """The tensors this process sends on PUSH_TAG from now on (copies)."""
    sent = []
    real = PairGroups.send

    def recorded(self, peer, generation, tensor, tag, deadline=None, stripes=1):
        if tag == PUSH_TAG:
            sent.append(tensor.clone())
        return real(self, peer, generation, tensor, tag, deadline, stripes)

    monkeypatch.setattr(PairGroups, "send", recorded)
    return sent


def test_pushes_of_different_sizes_back_to_back_each_write_their_rows_once(pair, monkeypatch):
    """The owner posts its receive with the size of the last push: a push of that size
    goes inline with its header, another as the header alone then the rows."""
    owner, other = pair
    td = owner.publish("p", shared_td.TensorDict(x=torch.zeros(64, 3), y=torch.zeros(64, dtype=torch.int16),
                                                batch_size=[64]))
    replica = other.attach("p")
    generation = other._groups.generation(0)
    sent = _sent_on_push_tag(monkeypatch)
    expected = torch.zeros(64, 3)
    for n, rows in enumerate([[5], list(range(64)), [7, 9, 11], [7, 9, 11], [], [63], list(range(0, 64, 2)), [-1]]):
        replica["x"][rows] = float(n + 1)
        replica["y"][rows] = n + 1
        other.push("p", rows)
        expected[rows] = float(n + 1)
        assert torch.equal(td["x"], expected), (n, rows)
        assert torch.equal(td["y"], expected[:, 0].to(torch.int16)), (n, rows)
    # a header of HEADER_BYTES went first, alone or with its rows, once per push
    assert len(sent) == 8
    assert [m.numel() == HEADER_BYTES + 8 * 3 + 3 * 14 for m in sent].count(True) >= 1  # [7, 9, 11] again: inline
    assert other._groups.generation(0) == generation and len(_listeners(owner)) == 1  # nothing failed


def test_a_forged_push_header_is_refused_counted_and_never_applied(pair):
    owner, other = pair
    td = owner.publish("p", shared_td.TensorDict(x=torch.zeros(4), batch_size=[4]))
    replica = other.attach("p")
    generation = other._groups.generation(0)
    forger = SignedStore(other._store.raw, b"another key", timeout=5)
    rows = torch.zeros(8 + 4, dtype=torch.uint8)  # index 0, then 1.0: what the forger wants written
    rows[8:].view(torch.float32)[0] = 1.0
    forged = encode_signed(forger, push_context(1, 0, generation),
                           {"name": "p", "generation": 1, "tag": 7, "seq": 1, "rows": 1, "nbytes": 12}, HEADER_BYTES)
    group = other._groups.groups(0, generation)[0]
    # straight on the pair, as anyone who reaches the gloo port could: the header, then the rows
    group.send([forged], 0, PUSH_TAG).wait()
    assert wait_until(lambda: owner.refused == 1, 5)
    assert td["x"].tolist() == [0.0] * 4
    replica["x"][0] = 2.0
    other.push("p", [0])  # the owner kept listening: the next real push is written
    assert td["x"].tolist() == [2.0, 0.0, 0.0, 0.0]
    assert owner.refused == 1


def test_a_replayed_push_is_refused_and_its_rows_are_not_written_again(pair, monkeypatch):
    """A push header is signed for its pair generation and numbered: a recording of a
    real push (header and rows, all signed) sent again is refused, not written twice."""
    owner, other = pair
    td = owner.publish("p", shared_td.TensorDict(x=torch.zeros(4), batch_size=[4]))
    replica = other.attach("p")
    replica["x"][1] = 1.0
    other.push("p", [1])  # the owner now posts a receive of this push's size
    sent = _sent_on_push_tag(monkeypatch)
    replica["x"][1] = 5.0
    other.push("p", [1])
    assert td["x"][1] == 5.0 and len(sent) == 1
    td["x"][1] = 0.0  # the owner's learner moved on
    group = other._groups.groups(0, other._groups.generation(0))[0]
    group.send([sent[0]], 0, PUSH_TAG).wait()  # the recorded push, replayed
    assert wait_until(lambda: owner.refused == 1, 5)
    assert td["x"][1] == 0.0
    replica["x"][2] = 6.0
    other.push("p", [2])
    assert td["x"].tolist() == [0.0, 0.0, 6.0, 0.0]


def test_a_push_right_after_a_failed_transfer_goes_on_the_next_pair_generation(pair):
    owner, other = pair
    td = owner.publish("p", shared_td.TensorDict(x=torch.zeros(4), batch_size=[4]))
    replica = other.attach("p")
    replica["x"][0] = 1.0
    other.push("p", [0])
    generation = other._groups.generation(0)
    first = _listeners(owner) + _listeners(other)
    assert len(first) == 2
    other._groups.fail(0, generation)  # as after a failed transfer: the pair is closed on both nodes
    assert wait_until(lambda: not any(t.is_alive() for t in first), 5)  # the kept receives ended
    for value, row in ((2.0, 1), (3.0, 2), (4.0, 3)):  # through the store once, then over the new pair
        replica["x"][row] = value
        other.push("p", [row])
    assert td["x"].tolist() == [1.0, 2.0, 3.0, 4.0]
    assert other._groups.generation(0) == generation + 1
    assert wait_until(lambda: len(_listeners(owner)) == 1, 5)


def test_a_push_of_a_name_the_owner_does_not_hold_in_that_generation_is_refused(pair):
    owner, other = pair
    owner.publish("p", shared_td.TensorDict(x=torch.zeros(4), batch_size=[4]))
    other.attach("p")
    other._replicas["p"].generation = 99  # as a replica of a generation the owner never made
    with pytest.raises(RuntimeError, match=r"Node 0 refused the transfer of 'p': node 0 has no generation 99"):
        other.push("p", [0])


def test_shutdown_ends_the_kept_push_receives():
    store = loopback_store(10)
    owner, other = _pair(store)
    try:
        owner.publish("p", shared_td.TensorDict(x=torch.zeros(4), batch_size=[4]))
        other.attach("p")
        listening = _listeners(owner) + _listeners(other)
        assert len(listening) == 2
    finally:
        began = time.monotonic()
        other.shutdown()
        owner.shutdown()
    # the receives were posted for LISTEN_S (a day): shutdown ends them, it does not wait
    # for them (bound: the joins of a shutdown, 1 s each, and a store connect that can
    # stall 5 s in a reverse DNS lookup, see cluster_store)
    assert time.monotonic() - began < 10
    assert not any(t.is_alive() for t in listening)


def test_a_peer_found_lost_ends_the_kept_receives_and_the_next_push_builds_a_new_pair(pair, monkeypatch):
    """gloo does not always end a receive whose peer died: a node closes its pairs with a
    peer whose heartbeat stands still, which ends its own kept receive and the peer's."""
    owner, other = pair
    td = owner.publish("p", shared_td.TensorDict(x=torch.zeros(4), batch_size=[4]))
    replica = other.attach("p")
    generation = owner._groups.generation(1)
    first = _listeners(owner) + _listeners(other)
    assert len(first) == 2
    monkeypatch.setattr(owner, "_alive", lambda peer: False)  # node 1 looks lost to node 0
    assert wait_until(lambda: not any(t.is_alive() for t in first), 5)
    monkeypatch.undo()
    assert wait_until(lambda: other._groups.generation(0) > generation, 5)  # the notice came
    replica["x"][2] = 3.0
    other.push("p", [2])  # a request through the store builds the next pair
    assert td["x"].tolist() == [0.0, 0.0, 3.0, 0.0]
    assert wait_until(lambda: len(_listeners(owner)) == 1, 5)
    replica["x"][3] = 4.0
    other.push("p", [3])  # over the new pair
    assert td["x"].tolist() == [0.0, 0.0, 3.0, 4.0]


@pytest.mark.parametrize("sizes", [(4, 4), (4, 2)])  # the rows inline; a header alone, then the rows
def test_the_answer_receive_is_posted_before_the_push_is_sent(pair, monkeypatch, sizes):
    """The owner can answer only into a receive the pusher posted. Posted after the send,
    it waited for the pusher's thread to run again after its write: on a loaded machine
    (measured at load 6-7) that thread lost its core for ~3 ms right after the write, while
    the owner had the rows written 0.6 ms after the push began and waited to answer."""
    owner, other = pair
    td = owner.publish("p", shared_td.TensorDict(x=torch.zeros(4), batch_size=[4]))
    replica = other.attach("p")
    other.push("p", list(range(sizes[0])))  # the owner now posts for this size
    posted = []
    for op in ("send", "recv"):
        real = getattr(PairGroups, op)

        def recorded(self, peer, generation, tensor, tag, deadline=None, stripes=1, _op=op, _real=real):
            if threading.get_ident() == pusher:
                posted.append("answer" if _op == "recv" and tag & ANSWER_TAG_BIT else _op)
            return _real(self, peer, generation, tensor, tag, deadline, stripes)

        monkeypatch.setattr(PairGroups, op, recorded)
    pusher = threading.get_ident()
    replica["x"][: sizes[1]] = 7.0
    other.push("p", list(range(sizes[1])))
    assert td["x"][: sizes[1]].tolist() == [7.0] * sizes[1]
    assert posted[0] == "answer" and posted.count("send") == (1 if sizes[0] == sizes[1] else 2), posted
