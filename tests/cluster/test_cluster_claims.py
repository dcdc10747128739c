"""Who runs as what in a cluster: the store it can run on, one process per node number
(claimed at start, released at shutdown, taken over after a crash), one owner node per
published name, and start() and sync() refusing what would leave a node half made.
Nodes of a cluster in this process, on a loopback store; every wait bounded.
"""
from __future__ import annotations

import time

import pytest
import torch

pytest.importorskip("torch.distributed")

import shared_td  # noqa: E402
from shared_td.coordinator.cluster import Cluster  # noqa: E402
from shared_td.coordinator.cluster_liveness import claim_free  # noqa: E402
from shared_td.coordinator.cluster_store import SignedStore  # noqa: E402
from tests.cluster.test_cluster_store import KEY, _pair, pair, store  # noqa: E402,F401 - fixtures


def test_a_second_process_given_a_running_nodes_number_is_refused(store, pair):
    """Two processes given node=1 both ran as node 1 (their requests and heartbeats mixed;
    seen as a gloo connect timeout at the first transfer): the second is refused, and
    the running node keeps serving."""
    owner, other = pair
    td = owner.publish("p", shared_td.TensorDict(x=torch.zeros(2), batch_size=[2]))
    twin = Cluster(f"tcp://127.0.0.1:{store.port}?host=0", 1, 2, authkey=KEY, timeout=10.0, hostname="127.0.0.1")
    began = time.monotonic()
    with pytest.raises(ValueError, match="Node 1 is running in this cluster.*node=1"):
        twin.start()
    # seen moving within ~0.5 s (HEARTBEAT_S), not after the join timeout (10 s); the
    # twin's first store connect can stall 5 s in a reverse DNS lookup on this machine
    assert time.monotonic() - began < 8
    twin.shutdown()  # nothing to stop
    replica = other.attach("p")
    replica["x"][1] = 4.0
    other.push("p", [1])
    assert td["x"].tolist() == [0.0, 4.0]


def test_a_node_restarted_after_a_crash_takes_its_number_over_once_its_heartbeat_stood_still(store):
    """A crashed node did not release its claim: its successor waits until the old
    heartbeat stood still for LOST_AFTER_S, then runs as that node."""
    from shared_td.coordinator.cluster_liveness import HEARTBEAT_S, LOST_AFTER_S

    crashed = SignedStore(store, KEY, timeout=10.0)
    crashed.compare_set("claim/1", "", "the crashed process's token")
    crashed.set_json("hb/1", {"beat": 7, "pid": 1})
    for queue in ("queue/1", "lane/1/0"):  # left for the crashed process: its successor must not act on them
        crashed.push_json(queue, {"op": "not for the new process", "from": 0, "name": "p"})
    began = time.monotonic()
    members = _pair(store)
    try:
        # (+ 6: a first store connect can stall 5 s in a reverse DNS lookup on this machine)
        assert LOST_AFTER_S <= time.monotonic() - began < LOST_AFTER_S + HEARTBEAT_S + 6
        members[0].publish("p", shared_td.TensorDict(x=torch.ones(2), batch_size=[2]))
        assert members[1].attach("p")["x"].tolist() == [1.0, 1.0]
        members[1].publish("q", shared_td.TensorDict(y=torch.ones(2), batch_size=[2]))
        assert members[0].attach("q")["y"].tolist() == [1.0, 1.0]  # node 1's lane serves node 0
        assert members[1].refused == 0  # the crashed process's messages were dropped, not served
    finally:
        for member in members:
            member.shutdown()
        crashed.close()


def test_a_start_that_fails_frees_the_number_and_its_connections(store):
    """A node whose peers never joined kept its store connections (and its claimed
    number: the next try waited for its heartbeat) until someone called shutdown()."""
    lone = Cluster(f"tcp://127.0.0.1:{store.port}?host=0", 0, 2, authkey=KEY, timeout=1.0, hostname="127.0.0.1")
    with pytest.raises(TimeoutError, match="nodes 1 did not join"):
        lone.start()
    assert claim_free(SignedStore(store, KEY, timeout=5), 0, store.get("shared_td/claim/0"), lone._run)  # (audit 18)
    assert lone._store._closed  # its spare connections let go


def test_a_name_has_one_owner_and_a_lost_owners_name_is_taken_over(pair):
    """A second node's publish of a name made two owners (each syncing its own copy)."""
    owner, other = pair
    td = owner.publish("x", shared_td.TensorDict(v=torch.zeros(2), batch_size=[2]))
    other.attach("x")
    began = time.monotonic()
    with pytest.raises(ValueError, match="'x' is owned by node 0.*one owner"):
        other.publish("x", shared_td.TensorDict(v=torch.ones(2), batch_size=[2]))
    assert time.monotonic() - began < 2  # node 0's heartbeat moves within 0.5 s
    assert other.owner("x") == 0 and "x" not in other._owned
    td["v"].fill_(5.0)
    assert owner.sync("x").delivered == [1]
    owner.publish("x", td)  # its owner publishes it again: a new generation
    owner.shutdown()  # lost: its heartbeat stands still
    began = time.monotonic()
    other.publish("x", shared_td.TensorDict(v=torch.ones(2), batch_size=[2]))
    assert 2.5 < time.monotonic() - began < 10
    assert other.owner("x") == 1 and "x" in other._owned
    # its replica of the old owner's is gone: it counted its own name as stale before
    assert not other.replicates("x") and not other.is_stale("x")


def test_a_sync_with_no_time_is_refused_before_it_drops_anyone(pair):
    """sync(name, timeout=0) made a new version, failed every replica's transfer (and
    pair) and reported them dropped."""
    owner, other = pair
    td = owner.publish("s", shared_td.TensorDict(v=torch.zeros(2), batch_size=[2]))
    replica = other.attach("s")
    generation = owner._groups.generation(1)
    for timeout in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="timeout"):
            owner.sync("s", timeout=timeout)
    assert owner.version("s") == 2 and owner._groups.generation(1) == generation  # (the attach's pull: 2)
    td["v"].fill_(2.0)
    assert owner.sync("s", timeout=5.0).delivered == [1] and replica["v"].tolist() == [2.0, 2.0]


def test_a_node_shut_down_cleanly_is_started_again_at_once(store, pair, monkeypatch):
    """Its number was released: the next start claims it without watching the old
    heartbeat (3.5 s). Not timed: a first store connect can stall 5 s in DNS here."""
    from shared_td.coordinator import cluster_liveness

    owner, other = pair
    owner.publish("p", shared_td.TensorDict(x=torch.ones(2), batch_size=[2]))
    other.shutdown()
    assert claim_free(owner._store, 1, store.get("shared_td/claim/1"), owner._run)  # a released token (audit 18)

    def no_wait(*args):
        raise AssertionError("a released number was claimed by watching its heartbeat")

    monkeypatch.setattr(cluster_liveness, "heartbeat_moves", no_wait)
    again = Cluster(f"tcp://127.0.0.1:{store.port}?host=0", 1, 2, authkey=KEY, timeout=10.0, hostname="127.0.0.1")
    again.start()
    monkeypatch.undo()
    try:
        assert again.attach("p")["x"].tolist() == [1.0, 1.0]
        mine = again.publish("q", shared_td.TensorDict(y=torch.full((2,), 3.0), batch_size=[2]), share_non_tensor=False)
        assert owner.attach("q")["y"].tolist() == [3.0, 3.0]  # the new node's lane serves
        mine["y"].fill_(4.0)
        assert again.sync("q").delivered == [0] and owner.attach("q")["y"].tolist() == [4.0, 4.0]
        assert owner.sync("p").delivered == [1]
    finally:
        again.shutdown()


def _legacy_tcp_store():
    import datetime

    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=5), use_libuv=False)


def test_stores_without_queues_are_refused_before_joining(tmp_path):
    """A FileStore failed the first request with a bare NotImplementedError, and a legacy
    TCPStore (use_libuv=False) dropped the connection, read as "the store's host stopped"."""
    import torch.distributed as dist

    legacy = _legacy_tcp_store()
    cases = [(dist.FileStore(str(tmp_path / "store"), 1), "FileStore"),
             (legacy, "use_libuv=False"), (dist.PrefixStore("p", legacy), "use_libuv=False")]
    for store, said in cases:
        node = Cluster(store, 0, 2, authkey=b"k" * 32, timeout=2.0)
        with pytest.raises(ValueError, match=said):
            node.start()
        assert node._store is None  # nothing joined, nothing to shut down
    assert not legacy.check(["shared_td/join/0"])  # nothing was written to it


def test_a_torch_without_store_queues_is_refused_naming_the_version(monkeypatch):
    import torch.distributed as dist

    monkeypatch.delattr(dist.Store, "queue_push")
    with pytest.raises(RuntimeError, match=r"torch >= 2\.8.*" + torch.__version__.replace("+", r"\+")):
        Cluster(dist.HashStore(), 0, 1, authkey=b"k" * 32, timeout=2.0).start()


def test_a_hash_store_runs_a_one_node_cluster():
    import torch.distributed as dist

    node = Cluster(dist.HashStore(), 0, 1, authkey=b"k" * 32, timeout=5.0).start()
    try:
        assert node.counter("c").fetch_add(2) == 0
    finally:
        node.shutdown()


def test_a_process_stopped_past_the_lost_time_looks_at_its_claim_before_it_acts_again(store):
    """Nothing told a process stopped (SIGSTOP, a debugger) past LOST_AFTER_S that another
    process had taken its node number over meanwhile: it acted as that node again. It now
    looks at its claim first (free while it beats), and stands down if it is gone."""
    import os
    import threading

    from shared_td.coordinator.cluster_liveness import LOST_AFTER_S, Liveness, claim_node, claim_token

    signed = SignedStore(store, KEY, timeout=5.0)
    try:
        token = claim_node(signed, 3)
        signed.set_json("hb/3", {"beat": 0, "pid": os.getpid()})
        looks, confirmed, stop = [], [], threading.Event()
        compare_set = signed.compare_set
        signed.compare_set = lambda *args: looks.append(args[0]) or compare_set(*args)
        liveness = Liveness(signed, 3, signed.get_json, token, stop, on_confirm=lambda: confirmed.append(1))
        assert liveness.still_mine() and looks == []  # beating: no store call
        liveness._confirmed_at -= LOST_AFTER_S  # as after a stop: it looks, beats, looks again
        assert liveness.still_mine() and looks == ["claim/3", "claim/3"] and confirmed == [1]
        assert signed.get_json("hb/3")["beat"] == 1
        assert liveness.still_mine() and len(looks) == 2  # confirmed: free again
        # another process takes the number over while this one is stopped
        compare_set("claim/3", token, claim_token(signed, 3))  # (a token of the cluster's key: see audit 18)
        signed.set_json("join/3", {"node": 3, "nodes": 4, "pid": 4242, "host": "elsewhere"})
        signed.set_json("hb/3", {"beat": 9, "pid": 4242})
        liveness._confirmed_at -= LOST_AFTER_S
        assert not liveness.still_mine() and stop.is_set()
        assert signed.get_json("hb/3") == {"beat": 9, "pid": 4242}  # no heartbeat under a number taken over
        with pytest.raises(shared_td.NodeTakenOverError, match="taken over by process 4242 on elsewhere"):
            liveness.check()
        assert confirmed == [1] and len(looks) == 3  # and it stays down without asking again
        assert not liveness.still_mine() and len(looks) == 3
    finally:
        signed.close()


def test_a_node_whose_number_was_taken_over_leaves_the_requests_to_its_successor(store, pair):
    """A request popped from a lane by a process that lost its number goes back to the
    queue, unserved, and that process's calls fail (they ran before)."""
    from shared_td.coordinator.cluster_liveness import LOST_AFTER_S, claim_token

    owner, other = pair
    owner.publish("p", shared_td.TensorDict(x=torch.zeros(2), batch_size=[2]))
    replica = other.attach("p")
    successor = claim_token(other._store, 1, other._run)  # (a later token of the key and run: audit 18)
    store.compare_set("shared_td/claim/1", other._claim, successor)
    other._liveness._confirmed_at -= LOST_AFTER_S  # as if it had been stopped meanwhile
    owner._store.push_json("lane/1/0", {"op": "pull", "from": 0, "name": "p", "generation": 1, "tag": 7,
                                        "reply": "reply/0/none", "pair": 0})
    with pytest.raises(shared_td.NodeTakenOverError, match="Node 1 was taken over"):
        other.pull("p")
    deadline = time.monotonic() + 5
    while any(t.name.endswith("lane-0") and t.is_alive() for t in other._threads) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert store.queue_len("shared_td/lane/1/0") == 1  # left for the successor
    assert not store.check(["shared_td/reply/0/none"]) and other.refused == 0
    assert replica["x"].tolist() == [0.0, 0.0]  # still readable
    with pytest.raises(shared_td.NodeTakenOverError):
        other.push("p", [0])
    other.shutdown()
    assert store.get("shared_td/claim/1") == successor.encode()  # not released by the old process


def test_an_owner_stopped_past_the_lost_time_gives_up_the_names_taken_over(pair):
    """A name another node took over while its owner was stopped was still synced by the
    old owner when it ran again."""
    from shared_td.coordinator.cluster_liveness import LOST_AFTER_S

    owner, other = pair
    owner.publish("n", shared_td.TensorDict(x=torch.zeros(2), batch_size=[2]))
    owner.publish("kept", shared_td.TensorDict(x=torch.zeros(2), batch_size=[2]))
    from shared_td.coordinator.cluster_owners import owner_token

    mine, theirs = (owner_token(owner._store, "n", node, owner._run) for node in (0, 1))  # (signed: audit 18)
    assert owner._store.compare_set("owner/n", mine, theirs) == theirs.encode()  # node 1 took "n" over meanwhile
    owner._liveness._confirmed_at -= LOST_AFTER_S
    with pytest.raises(KeyError, match="does not own 'n': node 1 took it over"):
        owner.sync("n")
    assert owner.sync("kept").version == 2


def test_a_claim_that_is_not_text_reads_as_a_forgery(store):
    """A claim or an owner record that is not UTF-8 (something else writes to the store)
    raised UnicodeDecodeError out of the look, which ended the heartbeat thread. Such a
    claim is no token of the cluster's key: counted as forged, this process's written
    back (audit 18: it was taken for a takeover, and the node stopped)."""
    import threading

    from shared_td.coordinator.cluster_liveness import LOST_AFTER_S, Liveness, claim_node
    from shared_td.coordinator.cluster_owners import names_taken_over, owner_token

    signed = SignedStore(store, KEY, timeout=5.0)
    try:
        token = claim_node(signed, 5)
        signed.set_json("join/5", {"node": 5, "nodes": 6, "pid": 1, "host": "h"})
        refused = []
        liveness = Liveness(signed, 5, signed.get_json, token, threading.Event(), refuse=lambda: refused.append(1))
        # (a TCPStore set is not answered: the get makes sure the store has it before the
        # look, which reads on another connection of the store)
        store.set("shared_td/claim/5", b"\xff\xfe")
        store.get("shared_td/claim/5")
        liveness._confirmed_at -= LOST_AFTER_S
        assert liveness.still_mine() and liveness.taken_over is None and refused == [1]
        assert store.get("shared_td/claim/5") == token.encode()
        store.set("shared_td/owner/n", b"\xff")
        store.get("shared_td/owner/n")
        assert names_taken_over(signed, 5, ["n"], lambda: refused.append(1)) == {}  # a forgery (audit 18)
        assert refused == [1, 1] and store.get("shared_td/owner/n") == owner_token(signed, "n", 5).encode()
    finally:
        signed.close()
