"""What an audit of the cluster found: forged or malformed store records and requests
that killed a node's threads or wedged its state, calls after shutdown, names too long
for a message. Nodes of a cluster in this process, on a loopback store; every wait
bounded."""
from __future__ import annotations

import time

import pytest
import torch

pytest.importorskip("torch.distributed")

import shared_td  # noqa: E402
from tests.cluster.test_cluster_store import KEY, _pair, pair, store  # noqa: E402,F401 - fixtures
from tests.processes import wait_until  # noqa: E402


def _threads(prefix: str) -> list[str]:
    import threading

    return [t.name for t in threading.enumerate() if t.name.startswith(prefix)]


def test_a_forged_stored_value_is_refused_and_values_keep_propagating(store, pair):
    """Raw bytes written at value/<name>/<gen>/<i> made the next writer's poller read a
    ClusterAuthError (an OSError) as a lost store and end: that node's non-tensor values
    stopped propagating for good, and nothing was counted."""
    owner, other = pair
    owner.publish("cfg", shared_td.TensorDict(w=torch.zeros(4), task="walk", batch_size=[4]),
                  share_non_tensor=True)
    replica, local = other.attach("cfg"), owner.attach("cfg")
    local.set_("task", "run")
    assert wait_until(lambda: replica["task"] == "run", 10)
    forged = f"shared_td/value/cfg/{owner.generation('cfg')}/0"
    store.set(forged, b"not signed at all")
    store.get(forged)  # (a TCPStore set is not answered: stored before the nodes look)
    local.set_("task", "jump")
    assert wait_until(lambda: replica["task"] == "jump", 10), replica["task"]
    assert owner.refused == 1  # counted once: the forged record was replaced by a signed one
    local.set_("task", "fly")
    assert wait_until(lambda: replica["task"] == "fly", 10)
    replica.set_("task", "swim")
    assert wait_until(lambda: local["task"] == "swim", 10)
    assert len(_threads("shared_td-cluster-values")) >= 2  # both pollers still run


def test_a_signed_but_malformed_request_is_counted_and_the_lane_keeps_serving(store, pair):
    """A request signed with the cluster key but not an object, or missing its fields,
    ended the lane thread (AttributeError, KeyError) while the node kept beating: every
    later pull from that peer timed out."""
    from shared_td.coordinator.cluster_store import SignedStore

    owner, other = pair
    other.publish("p", shared_td.TensorDict(w=torch.arange(6.0), batch_size=[6]))  # node 1 owns p
    owner.attach("p")
    signed = SignedStore(store, KEY, timeout=10.0)
    malformed = ([1, 2], {"from": 0}, "x", {"from": 0, "op": "pull", "name": "p"})
    for bad in malformed:
        signed.push_json("lane/1/0", bad)
    signed.push_json("queue/1", "x")  # and one to the service thread
    assert wait_until(lambda: other.refused == len(malformed) + 1, 10), other.refused
    assert len(_threads("shared_td-cluster-lane-")) == 2
    began = time.monotonic()
    assert owner.pull("p") == 3  # served at once, not after the node's timeout (the attach's pull was 2)
    assert time.monotonic() - began < 5


def test_calls_after_shutdown_are_refused_at_once_with_a_clear_error(store, pair):
    """A node's calls after its shutdown() were accepted for ~2.5 s (a publish even
    claimed a name), then failed with a NodeTakenOverError naming the node's own pid."""
    owner, other = pair
    owner.publish("p", shared_td.TensorDict(w=torch.arange(6.0), batch_size=[6]))
    other.attach("p")
    other.shutdown()
    new = shared_td.TensorDict(w=torch.arange(6.0), batch_size=[6])
    calls = [lambda: other.pull("p"), lambda: other.push("p", [0]), lambda: other.publish("r", new),
             lambda: other.counter("c"), lambda: other.generation("p")]
    for call in calls:
        with pytest.raises(RuntimeError, match="Cluster node 1 was shut down"):
            call()
    assert not owner.knows("r")  # nothing of the refused publish reached the store
    time.sleep(3.0)  # past LOST_AFTER_S: its own stopped heartbeat is no takeover
    with pytest.raises(RuntimeError, match="Cluster node 1 was shut down"):
        other.pull("p")


def test_a_name_too_long_for_a_push_header_is_refused_at_publish_attach_and_push(pair):
    """A 420-character name was published and attached, then every push of it raised a
    bare 'a signed message of 499 bytes does not fit in 512'."""
    from shared_td.coordinator.cluster_push import MAX_NAME_BYTES

    owner, other = pair
    long = "n" * (MAX_NAME_BYTES + 1)
    td = shared_td.TensorDict(w=torch.arange(6.0), batch_size=[6])
    for call in (lambda: owner.publish(long, td), lambda: other.attach(long), lambda: other.push(long, [0])):
        with pytest.raises(ValueError, match=f"'n{{40}}'.*too long.*at most {MAX_NAME_BYTES}"):
            call()
    assert not owner.knows(long)  # refused before anything was claimed or stored
    fits = "n" * MAX_NAME_BYTES  # the longest name still pushes
    owner.publish(fits, td)
    replica = other.attach(fits)
    replica["w"][:] = 7.0
    for _ in range(2):  # the first push builds the pair (a store request), the second goes over it
        other.push(fits, [0, 5])
    assert td["w"].tolist() == [7.0, 1.0, 2.0, 3.0, 4.0, 7.0]
    with pytest.raises(ValueError, match="too long"):  # non-ASCII characters take 6 bytes as JSON
        owner.publish("é" * (MAX_NAME_BYTES // 6 + 1), td)


def test_a_push_header_that_does_not_fit_leaves_the_push_line_as_it_was(pair, monkeypatch):
    """The header was encoded after the push line's seq and posted size moved on: its
    ValueError left them ahead of the owner's kept receive, and every later push to that
    owner failed."""
    from shared_td.coordinator import cluster_push

    monkeypatch.setattr(cluster_push, "check_name", lambda name: None, raising=False)  # as a name let through
    owner, other = pair
    long = "n" * 420
    for name in ("p", long):
        owner.publish(name, shared_td.TensorDict(w=torch.arange(6.0), batch_size=[6]))
    replica = other.attach("p")
    other.attach(long)
    other.push("p", [0])  # builds the pair: the next pushes go over it
    other.push("p", [0])
    with pytest.raises(ValueError, match="does not fit"):
        other.push(long, [0])
    replica["w"][1] = 9.0
    other.push("p", [1])  # in order with the owner's kept receive
    assert owner.attach("p")["w"].tolist()[1] == 9.0
    assert owner.refused == 0


def test_a_process_with_another_key_cannot_seize_a_running_nodes_number(store, pair):
    """A process given node=1 with a wrong authkey read node 1's heartbeat (signed with
    the cluster's key) as no heartbeat, found it "standing still", took claim/1 over,
    drained node 1's queues and overwrote its join record; a second process with the
    right key then started as node 1 beside the running one."""
    from shared_td.coordinator.cluster import Cluster, ClusterAuthError
    from shared_td.coordinator.cluster_store import SignedStore

    owner, other = pair
    owner.publish("p", shared_td.TensorDict(w=torch.arange(6.0), batch_size=[6]))
    other.attach("p")
    claim = store.get("shared_td/claim/1")
    url = f"tcp://127.0.0.1:{store.port}?host=0"
    wrong = Cluster(url, 1, 2, authkey=b"another key of 16 bytes", timeout=5.0, hostname="127.0.0.1")
    began = time.monotonic()
    with pytest.raises(ClusterAuthError, match="join/0.*wrong signature.*nothing was taken over"):
        wrong.start()
    assert time.monotonic() - began < 8  # refused before any wait for heartbeats
    assert store.get("shared_td/claim/1") == claim  # nothing claimed, nothing overwritten
    assert SignedStore(store, KEY, timeout=5.0).get_json("join/1")["pid"] == other._started_in
    twin = Cluster(url, 1, 2, authkey=KEY, timeout=5.0, hostname="127.0.0.1")
    with pytest.raises(ValueError, match="Node 1 is running"):
        twin.start()
    assert other.pull("p") == 3  # (the attach's pull was 2)


def test_a_heartbeat_signed_with_another_key_is_never_taken_over(store):
    """claim_node read a heartbeat it could not verify as none: one written with another
    key that kept changing (a running node) looked like a crashed one."""
    from shared_td.coordinator.cluster_liveness import claim_node
    from shared_td.coordinator.cluster_store import ClusterAuthError, SignedStore
    from tests.cluster.stores import beating

    mine, theirs = SignedStore(store, KEY, timeout=5.0), SignedStore(store, b"their key", timeout=5.0)
    try:
        theirs.compare_set("claim/5", "", "their token")
        with beating(theirs, 5, every=0.2):
            with pytest.raises(ValueError, match="Node 5 is running"):
                claim_node(mine, 5)
        assert store.get("shared_td/claim/5") == b"their token"
        # standing still, but still unreadable with this key: refused, not taken over
        with pytest.raises(ClusterAuthError, match="hb/5 is not signed"):
            claim_node(mine, 5)
        assert store.get("shared_td/claim/5") == b"their token"
    finally:
        mine.close()
        theirs.close()


def test_claims_that_are_not_utf8_are_another_holders_not_a_decode_error(store):
    """claim/<node> and owner/<name> are unsigned: bytes that are not UTF-8 there made
    start() and publish() fail with a bare UnicodeDecodeError."""
    from shared_td.coordinator.cluster_liveness import LOST_AFTER_S

    store.set("shared_td/claim/1", b"\xff\xfe")  # no heartbeat: a holder that stands still
    store.set("shared_td/owner/p", b"\xff")  # not a node's: taken over
    store.get("shared_td/owner/p")  # (a TCPStore set is not answered: stored before the nodes look)
    began = time.monotonic()
    members = _pair(store)
    try:
        assert time.monotonic() - began >= LOST_AFTER_S  # taken over once it stood still, as a crashed node's
        td = members[0].publish("p", shared_td.TensorDict(w=torch.arange(6.0), batch_size=[6]))
        from shared_td.coordinator.cluster_owners import owner_of

        assert owner_of(members[0]._store, "p", store.get("shared_td/owner/p"), members[0]._run) == 0
        assert members[0].refused == 1  # the junk: a forged claim (audit 18)
        assert members[1].attach("p")["w"].tolist() == td["w"].tolist()
    finally:
        for member in members:
            member.shutdown()


def test_a_forged_replica_record_is_ignored_and_counted(store, pair):
    """Only the existence of has/<name>/<node> was checked: a forged one made sync send
    to a node without a replica (reported as dropped) and a re-publish notify it."""
    owner, other = pair
    owner.publish("q", shared_td.TensorDict(w=torch.zeros(10), batch_size=[10]))
    store.set("shared_td/has/q/1", b"forged")
    store.get("shared_td/has/q/1")  # (a TCPStore set is not answered: stored before the owner looks)
    report = owner.sync("q")
    assert report.delivered == [] and report.dropped == {}, report
    assert owner.refused == 1
    owner.publish("q", shared_td.TensorDict(w=torch.ones(10), batch_size=[10]))  # no renew notice for it
    assert owner.refused == 2
    assert store.queue_len("shared_td/lane/1/0") == 0
    other.attach("q")  # a real replica record: synced
    assert owner.sync("q").delivered == [1]


def test_a_push_index_of_another_type_is_an_index_type_error_naming_the_name(pair):
    """push(name, "a") raised torch's TypeError and push(name, None) its RuntimeError,
    neither naming the name; the docstring promises IndexTypeError."""
    owner, other = pair
    owner.publish("p", shared_td.TensorDict(w=torch.arange(6.0), batch_size=[6]))
    other.attach("p")
    for index in ("a", None, [0, "a"], object(), b"x"):
        with pytest.raises(shared_td.IndexTypeError, match=r"push\('p'\): rows are ints"):
            other.push("p", index)
    other.push("p", [0])  # nothing was left half done
