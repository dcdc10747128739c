"""What a second audit found in the cluster's records: an answer left in the store for a
node's previous process, a counter key overwritten with what is not an integer, a
forged non-tensor value met by ``attach``, a heartbeat signed with another key, and a
process with another key given a free node number. Nodes of a cluster in this process,
on a loopback store; every wait bounded."""
from __future__ import annotations

import threading
import time

import pytest
import torch

pytest.importorskip("torch.distributed")

import shared_td  # noqa: E402
from shared_td.coordinator.cluster import Cluster, ClusterAuthError  # noqa: E402
from shared_td.coordinator.cluster_store import SignedStore  # noqa: E402
from tests.cluster.stores import beating  # noqa: E402
from tests.cluster.test_cluster_store import KEY, _pair, pair, store  # noqa: E402,F401 - fixtures
from tests.processes import wait_until  # noqa: E402


def _url(store) -> str:
    return f"tcp://127.0.0.1:{store.port}?host=0"


def test_a_restarted_node_never_takes_an_answer_meant_for_its_previous_process(store):
    """Reply queues and tags start again at the same numbers in a new process of the
    same node: the answer to the previous process's first request, left in its queue,
    was taken by the new process's first request (here a refusal, which failed its
    attach)."""
    owner, previous = _pair(store)
    restarted = None
    try:
        owner.publish("p", shared_td.TensorDict(w=torch.arange(6.0), batch_size=[6]))
        # the previous process of node 1 asks, and is gone before the answer comes
        previous._request(0, "pull", "p", 99)  # a generation the owner does not hold: refused
        assert wait_until(lambda: store.queue_len("shared_td/reply/1/0") == 1, 10)
        previous.shutdown()
        restarted = Cluster(_url(store), 1, 2, authkey=KEY, timeout=10.0, hostname="127.0.0.1").start()
        assert restarted.attach("p")["w"].tolist() == list(range(6))
        assert store.queue_len("shared_td/reply/1/0") == 0  # dropped, not left for ever
        # an answer for another process that arrives later, with the tag of this
        # thread's next request, is dropped when popped
        SignedStore(store, KEY, timeout=5.0).push_json("reply/1/0", {"tag": 2 * 1024 + 1, "caller": "previous",
                                                                     "error": "meant for the previous process"})
        assert restarted.pull("p") == 3  # (the attach's pull was 2)
        assert store.queue_len("shared_td/reply/1/0") == 0
    finally:
        for member in (owner, previous, restarted):
            if member is not None:
                member.shutdown()


def test_a_counter_holding_what_is_not_an_integer_is_named_and_the_node_keeps_its_store(store, pair):
    """The store's host closes the connection of an addition to a value it cannot read:
    that read as the host being gone (ConnectionError), and the node tried no
    connection any more, so every later call of it failed."""
    owner, other = pair
    cursor = shared_td.SharedCounter("cursor", cluster=other)
    assert cursor.fetch_add(2) == 0
    store.set("shared_td/counter/cursor", b"not a number")
    store.get("shared_td/counter/cursor")  # (a TCPStore set is not answered: stored before the node adds)
    for call in (lambda: cursor.fetch_add(1), lambda: cursor.value):
        with pytest.raises(ValueError, match=r"'counter/cursor'.*b'not a number'.*not an integer"):
            call()
    owner.publish("p", shared_td.TensorDict(w=torch.arange(4.0), batch_size=[4]))
    assert other.attach("p")["w"].tolist() == [0.0, 1.0, 2.0, 3.0]  # the node goes on
    store.set("shared_td/counter/cursor", b"5")
    assert cursor.fetch_add(1) == 5 and cursor.value == 6


def test_attach_of_a_name_whose_stored_value_is_forged_gets_the_owners_value(store, pair):
    """A stored value with a wrong signature made attach raise ClusterAuthError, where
    the values poller counts such a record and replaces it with the genuine value: the
    owner now stores its value again, signed, and the attach goes on with it."""
    owner, other = pair
    local = owner.publish("cfg", shared_td.TensorDict(w=torch.zeros(4), task="walk", batch_size=[4]),
                          share_non_tensor=True)
    forged = f"shared_td/value/cfg/{owner.generation('cfg')}/0"
    store.set(forged, b"forged record")
    store.get(forged)  # (a TCPStore set is not answered: stored before the node reads it)
    replica = other.attach("cfg")
    assert replica["task"] == "walk"
    assert other.refused == 1 and owner.refused == 1  # seen by the attach, replaced by the owner
    local.set_("task", "run")  # values keep flowing, both ways
    assert wait_until(lambda: replica["task"] == "run", 10)
    replica.set_("task", "swim")
    assert wait_until(lambda: local["task"] == "swim", 10)


def test_attach_of_a_value_forged_again_after_its_owner_stored_it_is_a_clear_error(store, pair, monkeypatch):
    owner, other = pair
    owner.publish("cfg", shared_td.TensorDict(w=torch.zeros(4), task="walk", batch_size=[4]), share_non_tensor=True)
    generation = owner.generation("cfg")
    restore = owner._values.restore

    def restored_then_forged(name, gen):  # as a writer that forges it again at once
        count = restore(name, gen)
        store.set(f"shared_td/value/cfg/{generation}/0", b"forged again")
        store.get(f"shared_td/value/cfg/{generation}/0")
        return count

    monkeypatch.setattr(owner._values, "restore", restored_then_forged)
    store.set(f"shared_td/value/cfg/{generation}/0", b"forged")
    store.get(f"shared_td/value/cfg/{generation}/0")
    with pytest.raises(ClusterAuthError, match=f"attach\\('cfg'\\).*value/cfg/{generation}/0.*wrong signature again"):
        other.attach("cfg")
    assert not other.replicates("cfg") and other.refused == 2


def test_a_heartbeat_signed_with_another_key_is_a_beating_node_counted_as_forged(store, monkeypatch):
    """Liveness.alive read every heartbeat it could not verify as the same None: one
    that a process with another key kept writing stood still for it, so a node it had
    found lost once stayed lost, and a name that node held could be taken over."""
    from shared_td.coordinator import cluster_liveness
    from shared_td.coordinator.cluster_owners import claim_name, owner_of, owner_token

    monkeypatch.setattr(cluster_liveness, "LOST_AFTER_S", 0.6)  # keeps the test short
    mine, theirs = SignedStore(store, KEY, timeout=5.0), SignedStore(store, b"their key", timeout=5.0)
    refused = []
    liveness = cluster_liveness.Liveness(mine, 0, mine.get_json, refuse=lambda: refused.append(1))
    try:
        with beating(theirs, 5, every=0.1):  # a process with another key runs as node 5
            liveness.mark_lost(5)  # a request to it failed once
            mine.compare_set("owner/q", "", owner_token(mine, "q", 5))  # node 5 holds the name q (signed: audit 18)
            end = time.monotonic() + 1.5
            while time.monotonic() < end:
                assert liveness.alive(5)
                time.sleep(0.1)
            assert not liveness.known_lost(5)
            with pytest.raises(ValueError, match="'q' is owned by node 5"):
                claim_name(mine, liveness, 0, 6, "q", lambda: None, lambda: refused.append(1))
            assert len(refused) >= 5  # each forged value seen, once
        liveness.alive(5)  # its last value, seen
        seen = len(refused)
        time.sleep(0.8)  # it stands still now: lost, as any node whose heartbeat stands still
        assert not liveness.alive(5) and len(refused) == seen
        claim_name(mine, liveness, 0, 6, "q", lambda: None, lambda: refused.append(1))
        assert owner_of(mine, "q", store.get("shared_td/owner/q")) == 0
    finally:
        mine.close()
        theirs.close()


def test_a_process_with_another_key_is_refused_at_once_when_its_number_is_free(store):
    """With its number free, a process with another key claimed it, drained its queues,
    wrote its records and waited for every node to join before it looked at a key:
    TimeoutError after its timeout (here on both sides), never ClusterAuthError."""
    url = _url(store)
    first = Cluster(url, 0, 3, authkey=KEY, timeout=8.0, hostname="127.0.0.1")
    failed = []

    def start_first():
        try:
            first.start()
        except BaseException as err:  # noqa: BLE001 - checked below
            failed.append((err, time.monotonic()))

    starting = threading.Thread(target=start_first)
    starting.start()
    try:
        assert wait_until(lambda: store.check(["shared_td/join/0"]), 10)
        wrong = Cluster(url, 2, 3, authkey=b"another key of 16 bytes", timeout=8.0, hostname="127.0.0.1")
        began = time.monotonic()
        with pytest.raises(ClusterAuthError, match=r"node 2: the join records of the cluster \(join/0\) have a "
                                                   "wrong signature.*did not join"):
            wrong.start()
        assert time.monotonic() - began < 3.0
        assert store.get("shared_td/claim/2") == b""  # let go again
        starting.join(15)
        # the node that waits refuses the other key's record as soon as it appears
        assert failed and isinstance(failed[0][0], ClusterAuthError) and "'join/2'" in str(failed[0][0]), failed
        assert failed[0][1] - began < 3.0
    finally:
        starting.join(15)
        first.shutdown()
