"""The cluster audit of session 19: the run id deleted while nodes live (a run split), a
publish interrupted between its two records, and the first sync after a clean leave.

The attacks write the raw keys with a plain TCPStore client, as anything that reaches
the store's port can (or, for a record only a node can sign, a SignedStore of the
cluster's key): each must be refused or harmless.
"""
from __future__ import annotations

import datetime
import time

import pytest
import torch

torch_dist = pytest.importorskip("torch.distributed")

import shared_td  # noqa: E402
from shared_td.coordinator.cluster import Cluster  # noqa: E402
from tests.cluster.test_cluster_store import KEY, _pair, _start_together, pair, store  # noqa: E402,F401 - fixtures


def _attacker(store):
    """A plain TCPStore client of the test's store: no key, raw bytes."""
    return torch_dist.TCPStore("127.0.0.1", store.port, None, False, datetime.timedelta(seconds=5))


def _node(store, node: int, nodes: int = 2) -> Cluster:
    return Cluster(f"tcp://127.0.0.1:{store.port}?host=0", node, nodes, authkey=KEY, timeout=8, hostname="127.0.0.1")


# ---------------------------------------------------------------- finding 2
class _Killed(BaseException):
    """The owner's process ends here (as by a SIGKILL between two store writes)."""


def test_a_publish_cut_after_its_name_record_is_current_for_the_replicas(store, pair):
    """An owner killed between the name/ and gen/ writes of a publish left gen/ one
    generation behind: is_stale said False for the newer publish (and refresh found
    nothing) until the next publish. name/ is the commit point now: gen/ is written
    pending before it and plain after, and a reader that finds it pending goes by name/."""
    owner, other = pair
    owner.publish("p", shared_td.TensorDict(x=torch.zeros(4), batch_size=[4]))
    view = other.attach("p")
    real, written = owner._store.set_json_if_newer, []

    def set_json_if_newer(key, *args, **kwargs):
        if written and key == "gen/p":  # the name record is stored: the process dies here
            raise _Killed
        done = real(key, *args, **kwargs)
        written.extend([key] if key == "name/p" else [])
        return done

    owner._store.set_json_if_newer = set_json_if_newer
    with pytest.raises(_Killed):
        owner.publish("p", shared_td.TensorDict(y=torch.full((3,), 5.0), batch_size=[3]))
    owner._store.set_json_if_newer = real
    assert written == ["name/p"]
    assert other.is_stale("p") and shared_td.is_stale(view)  # (before: False, both)
    fresh = shared_td.refresh(view)
    assert list(fresh.keys()) == ["y"] and fresh["y"].tolist() == [5.0] * 3
    assert not other.is_stale("p") and other.generation("p") == 2
    # the reader wrote gen/ plain for the committed publish: later looks are one small read
    assert owner._store.get_json("gen/p") == {"generation": 2, "digest": owner._owned["p"].digest, "owner": 0}
    assert other.refused == 0 == owner.refused


# ---------------------------------------------------------------- finding 3
def test_the_first_sync_after_a_clean_leave_takes_the_record_back_at_once(store):
    """A replica node that a sync reached in this generation left cleanly: the owner's
    next sync skipped the released-claim check (its holders are read once per
    generation), sent the request, waited ~3 s and reported the node lost; only the sync
    after took the record back. The node's last heartbeat says it left now: the record
    is read again and taken back on the first sync, nothing waited for."""
    owner, other = _pair(store)
    try:
        td = owner.publish("p", shared_td.TensorDict(x=torch.zeros(4), batch_size=[4]))
        other.attach("p")
        assert owner.sync("p", timeout=5).delivered == [1]  # node 1 among the name's holders now
        other.shutdown()
        td["x"].fill_(1.0)
        began = time.monotonic()
        report = owner.sync("p", timeout=5)
        assert time.monotonic() - began < 1.0, time.monotonic() - began  # (before: ~3 s)
        assert report.delivered == [] and report.dropped == {} and owner.refused == 0  # (before: "lost")
        assert store.get("shared_td/has/p/1") == b""  # taken back
    finally:
        for member in (owner, other):
            member.shutdown()


# ---------------------------------------------------------------- finding 1
def _run_record(store) -> bytes:
    from shared_td.coordinator.cluster_liveness import run_key
    from shared_td.coordinator.cluster_store import SignedStore

    return store.get("shared_td/" + run_key(SignedStore(store, KEY, timeout=5)))


@pytest.mark.parametrize("record", ["deleted", "another run"])
def test_a_node_restarted_after_the_run_record_went_joins_the_running_nodes_run(store, record):
    """The run that claim and owner tokens are bound to was one store key, read once at
    start: deleted while nodes ran, a restarted node set a new run and the nodes split:
    its start waited 3.5 s to take over its own released number, and the owner read the
    new process's claim as a forgery (counted) and kept the old process's record for
    good. Now the heartbeats write the record back, and a newcomer whose run differs
    from the live nodes' signed heartbeats follows theirs ("another run": the record
    set again by a newcomer before a heartbeat wrote it back)."""
    from shared_td.coordinator.cluster_liveness import run_key
    from shared_td.coordinator.cluster_store import SignedStore

    owner, first = _pair(store)
    again = None
    try:
        td = owner.publish("p", shared_td.TensorDict(x=torch.zeros(4), batch_size=[4]))
        first.attach("p")
        first.shutdown()
        kept = _run_record(store)
        signed = SignedStore(store, KEY, timeout=5)
        key = run_key(signed)
        if record == "deleted":
            _attacker(store).delete_key(f"shared_td/{key}")
        else:  # only a node of the cluster signs it: a newcomer of the window
            store.set(f"shared_td/{key}", signed.sign(key, b"0123456789abcdef"))
        began = time.monotonic()
        again = _node(store, 1).start()
        assert time.monotonic() - began < 2.0  # (before: 3.5 s, "taking over" its own released number)
        assert again._run == owner._run and _run_record(store) == kept
        td["x"].fill_(2.0)
        report = owner.sync("p", timeout=5)
        assert report.delivered == [] and report.dropped == {}  # first's record: taken back
        assert store.get("shared_td/has/p/1") == b""
        with pytest.raises(ValueError, match="'p' is owned by node 0"):  # one owner
            again.publish("p", shared_td.TensorDict(y=torch.ones(2), batch_size=[2]))
        view = again.attach("p")
        td["x"].fill_(3.0)
        assert owner.sync("p", timeout=5).delivered == [1] and view["x"].tolist() == [3.0] * 4
        assert owner.refused == 0 == again.refused  # (before: the new process's claim, a "forgery")
    finally:
        for member in (owner, first, again):
            if member is not None:
                member.shutdown()


def test_the_heartbeats_write_a_deleted_run_record_back(store, pair):
    """Every heartbeat writes the run record back when it is missing: a newcomer
    then finds the running nodes' run, within HEARTBEAT_S of a delete."""
    from shared_td.coordinator.cluster_liveness import run_key
    from shared_td.coordinator.cluster_store import SignedStore
    from tests.processes import wait_until

    kept, key = _run_record(store), "shared_td/" + run_key(SignedStore(store, KEY, timeout=5))
    _attacker(store).delete_key(key)
    assert wait_until(lambda: store.check([key]), 2)
    assert _run_record(store) == kept


def test_live_nodes_of_two_runs_are_a_split_refused_with_the_key(store, monkeypatch):
    """Heartbeats of two runs that both move: a newcomer cannot follow either (its
    tokens would be forgeries to the other run's nodes): it refuses to start, naming
    the run record's key."""
    import threading

    from shared_td.coordinator.cluster_liveness import run_id, run_key
    from shared_td.coordinator import cluster_membership
    from shared_td.coordinator.cluster_membership import settled_run
    from shared_td.coordinator.cluster_store import SignedStore

    monkeypatch.setattr(cluster_membership, "LOST_AFTER_S", 0.5)  # how long a standing heartbeat is watched
    signed = SignedStore(store, KEY, timeout=5)
    run, stop = run_id(signed), threading.Event()

    def beat(node: int, their_run: str):
        for number in range(1_000_000):
            signed.set_json(f"hb/{node}", {"beat": number, "pid": 1, "run": their_run})
            if stop.wait(0.1):
                return

    beaters = [threading.Thread(target=beat, args=args, daemon=True) for args in ((0, run), (2, "0123456789abcdef"))]
    for beater in beaters:
        beater.start()
    try:
        with pytest.raises(ValueError, match=f"two runs.*run record {run_key(signed)} was deleted"):
            settled_run(signed, 1, 3)
        stop.set()
        for beater in beaters:
            beater.join(5)
        # standing still: an earlier run's heartbeats, not followed
        began = time.monotonic()
        assert settled_run(signed, 1, 3) == run
        assert time.monotonic() - began < 2
    finally:
        stop.set()
        signed.close()

