"""The cluster audit of session 20 (concurrent use), each finding as a bounded test of
two nodes in one process (see test_cluster_store.py):

1. versions identify contents: every delivery into a replica (sync, pull, first
   attach, renew) carries a version of its own, so a reader that compares
   ``shared_td.version(view)`` before and after a read never sees the contents change
   under one number (a pull labelled the owner's current contents with its last sync's
   number);
2. a clean ``shutdown()`` racing transfers is no crash: its "left" heartbeat and
   released claim are written before its pairs close, and a peer whose transfer fails
   or waits takes the node as gone at once, "left (shutdown)" (before: ~3.5 s, then
   "lost");
3. a push or pull refused during a re-publish says the name was published again, by
   the generation the owner's signed refusal names (before, a quarter of them said only
   "node 0 has no generation N", while the store still named the old generation).

And the audit of that fix (33f6eb6):

4. a lane never waits for a name's delivery lock: a pull that finds a sync of its name
   under way waits off the lane, so the puller's other requests go on, and is not
   served once its requester gave up (its send waited for nobody, holding the lock:
   the next sync waited the owner's whole timeout);
5. two owners each syncing its own name and pulling the other's make progress (each
   lane served a pull waiting for a lock whose sync waited for the other node's lane:
   every op waited out the timeout);
6. an attach that meets one re-publish waits for the store to name the new generation
   before it tries again (its three tries were spent within milliseconds on the old
   one: "published again 3 times").
"""
from __future__ import annotations

import threading
import time

import pytest
import torch

torch_dist = pytest.importorskip("torch.distributed")

import shared_td  # noqa: E402
from shared_td.coordinator import cluster_generations, cluster_serve, cluster_sync  # noqa: E402
from shared_td.coordinator.cluster_liveness import LOST_AFTER_S, claim_free  # noqa: E402
from shared_td.coordinator.cluster_transfer import TransferFailed  # noqa: E402
from tests.cluster.test_cluster_store import _members, pair, store  # noqa: E402,F401 - fixtures

WAIT = 10.0


def _td(value: float, rows: int = 4) -> shared_td.TensorDict:
    return shared_td.TensorDict(x=torch.full((rows,), value), batch_size=[rows])


# ---------------------------------------------------------------- finding 1
def test_each_pull_is_a_delivery_with_a_version_of_its_own(pair):
    """The owner writes between two pulls and never syncs (the learner between syncs):
    each pull changed the replica's contents under the same version (the last sync's),
    so the before/after check the README advises could not see it."""
    owner, other = pair
    td = owner.publish("p", _td(0.0))
    view = other.attach("p")
    seen = [(shared_td.version(view), view["x"].tolist())]
    for value in (1.0, 2.0, 3.0):
        td["x"].fill_(value)
        returned = other.pull("p")
        seen.append((shared_td.version(view), view["x"].tolist()))
        assert returned == seen[-1][0] == owner.version("p")
    versions = [version for version, _contents in seen]
    assert versions == sorted(set(versions)), seen  # (before: [1, 1, 1, 1] over four contents)
    assert [contents[0] for _version, contents in seen] == [0.0, 1.0, 2.0, 3.0]
    td["x"].fill_(4.0)  # a sync takes the next number after the pulls'
    report = owner.sync("p", timeout=WAIT)
    assert report.delivered == [1] and report.version == versions[-1] + 1 == shared_td.version(view)


def test_a_renewed_replica_starts_at_a_version_of_its_delivery(pair):
    """A renew after a re-publish is a pull of the new generation: its version labels
    the contents it delivered (the owner's, written after the publish), not the
    publish's version 1, which the owner's data no longer matched."""
    owner, other = pair
    owner.publish("p", _td(0.0))
    view = other.attach("p")
    new = owner.publish("p", _td(1.0))
    new["x"].fill_(5.0)  # written after the publish, never synced
    fresh = shared_td.refresh(view)
    assert fresh["x"].tolist() == [5.0] * 4
    assert shared_td.version(fresh) == owner.version("p") > 1


def test_pulls_racing_syncs_end_and_the_replica_version_only_grows(pair):
    """A pull takes the name's sync lock on the owner: it must neither wait for a sync
    that waits for the replica (the pull asks before it takes the replica's lock) nor
    be overtaken by one (a replica's version never goes back)."""
    owner, other = pair
    td = owner.publish("p", _td(0.0, rows=1 << 14))
    view = other.attach("p")
    rounds, stop, seen, errors = 15, threading.Event(), [], []

    def run(work):
        try:
            for index in range(rounds):
                work(index)
        except BaseException as err:  # noqa: BLE001 - handed to the test
            errors.append(err)

    def watch():
        while not stop.is_set():
            version = shared_td.version(view)
            if version is not None:
                seen.append(version)

    def syncs(index):
        td["x"].fill_(float(index))
        owner.sync("p", timeout=WAIT)

    threads = [threading.Thread(target=run, args=(work,), daemon=True)
               for work in (syncs, lambda _index: other.pull("p"))]
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    began = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT)
    stop.set()
    watcher.join(WAIT)
    assert not any(thread.is_alive() for thread in threads) and not errors, errors
    assert time.monotonic() - began < 5.0
    assert seen == sorted(seen), "a replica's version went back"
    # 2 (the attach) + one per sync and per pull: each delivery its own number
    assert owner.version("p") == 2 + 2 * rounds == shared_td.version(view)
    assert view["x"].tolist() == td["x"].tolist()


# ---------------------------------------------------------------- finding 2
def test_shutdown_says_it_left_before_it_closes_its_pairs(pair, monkeypatch):
    """shutdown() closed the pairs first, then wrote its "left" heartbeat and released
    its claim: a peer whose transfer the close cut saw a heartbeat that had just moved,
    waited ~3.5 s for it to stand still and reported the node lost."""
    owner, other = pair
    owner.publish("p", _td(1.0))
    other.attach("p")
    at_close = []
    real_close = other._groups.close

    def close():
        owner._liveness.alive(1)  # reads node 1's heartbeat as the peer does
        released = claim_free(owner._store, 1, owner._store.get_unchecked("claim/1"), owner._run)
        at_close.append((owner._liveness.left(1), released))
        return real_close()

    monkeypatch.setattr(other._groups, "close", close)
    other.shutdown()
    assert at_close == [(True, True)], at_close  # (before: (False, False))
    assert owner._liveness.departed(1)  # the beat names the claim that was released


def test_a_transfer_cut_by_its_peers_shutdown_ends_at_once_as_left(pair):
    """What a peer whose transfer failed does once the node's shutdown said so: the
    owner is gone at once, OwnerLostError saying it left (before: ~3.5 s of waiting for
    the "left" beat to stand still, then "is lost: its heartbeat stood still"); the
    next pull fails at once too."""
    owner, other = pair
    owner.publish("p", _td(1.0))
    other.attach("p")
    owner.shutdown()
    began = time.monotonic()
    error = other._lost_or(0, "p", TransferFailed("the pair closed"))
    assert isinstance(error, shared_td.OwnerLostError), error
    assert "Node 0, the owner of 'p', left the cluster (shutdown)" in str(error)
    with pytest.raises(shared_td.OwnerLostError, match=r"left the cluster \(shutdown\)"):
        other.pull("p")
    assert time.monotonic() - began < LOST_AFTER_S / 2
    assert other.attach("p")["x"].tolist() == [1.0] * 4  # the replica stays readable


def test_a_pull_waiting_for_an_owner_that_shuts_down_ends_at_once_as_left(pair, monkeypatch):
    """A pull whose answer the owner never sends (its lane waits, held here before it
    answers) while the owner shuts down: OwnerLostError saying the owner left, within a
    look or two (before: ~3.3 s, "is lost")."""
    owner, other = pair
    owner.publish("p", _td(1.0))
    other.attach("p")
    serving, go = threading.Event(), threading.Event()
    real_check = owner._groups.check

    def check(*args):
        serving.set()
        go.wait(WAIT)
        return real_check(*args)

    monkeypatch.setattr(owner._groups, "check", check)
    outcome = []
    puller = threading.Thread(target=lambda: outcome.append(_error_of(lambda: other.pull("p"))), daemon=True)
    try:
        puller.start()
        assert serving.wait(WAIT)  # its request is in the owner's lane, unanswered
        owner.shutdown()  # (joins the lane, which waits: bounded, ~1 s)
        left = time.monotonic()
        puller.join(WAIT)
        assert time.monotonic() - left < 1.0
    finally:
        go.set()
    assert isinstance(outcome[0], shared_td.OwnerLostError), outcome
    assert "left the cluster (shutdown)" in str(outcome[0])


def test_a_sync_cut_by_the_replica_nodes_shutdown_reports_it_left(pair, monkeypatch):
    """The replica node shuts down while the owner's sync to it is under way: the node
    is reported "left (shutdown)" (before: the TransferFailed of a crash), and the next
    sync takes its record back without waiting for it or reporting it."""
    owner, other = pair
    td = owner.publish("p", _td(1.0))
    other.attach("p")
    assert owner.sync("p", timeout=WAIT).delivered == [1]  # node 1 among the name's holders
    real = cluster_sync.send_answered

    def leaving(cluster, peer, *args, **kwargs):
        other.shutdown()  # while the request waits in its lane: the pairs close under the sync
        return real(cluster, peer, *args, **kwargs)

    monkeypatch.setattr(cluster_sync, "send_answered", leaving)
    td["x"].fill_(2.0)
    report = owner.sync("p", timeout=WAIT)
    assert report.delivered == [] and list(report.dropped) == [1], report
    assert report.dropped[1].startswith("left (shutdown)"), report.dropped
    monkeypatch.undo()
    began = time.monotonic()
    report = owner.sync("p", timeout=WAIT)
    assert report.delivered == [] and report.dropped == {}, report
    assert time.monotonic() - began < 1.0


def _error_of(call):
    try:
        call()
    except BaseException as err:  # noqa: BLE001 - handed to the test
        return err
    return None


# ---------------------------------------------------------------- finding 3
@pytest.mark.parametrize("op", ["push", "pull"])
def test_a_transfer_refused_inside_a_republish_says_it_was_published_again(pair, monkeypatch, op):
    """The owner holds the new generation before its name record (the commit point)
    names it: a push or pull of the old one refused in that window found the store's
    generation unchanged and raised the bare refusal ("node 0 has no generation 1"),
    and the user had no fix to follow. The window is held open here."""
    owner, other = pair
    owner.publish("p", _td(1.0))
    other.attach("p")
    inside, go = threading.Event(), threading.Event()
    real = cluster_generations.record_name

    def held(*args, **kwargs):
        inside.set()
        assert go.wait(WAIT)
        return real(*args, **kwargs)

    monkeypatch.setattr(cluster_generations, "record_name", held)
    publisher = threading.Thread(target=lambda: owner.publish("p", _td(2.0)), daemon=True)
    publisher.start()
    try:
        assert inside.wait(WAIT)
        assert other.generation("p") == 1  # the store still names the old generation
        with pytest.raises(RuntimeError, match=rf"{op}\('p'\): 'p' was published again \(generation 2\).*"
                                               r"Refresh the views"):
            other.push("p", [0]) if op == "push" else other.pull("p")
    finally:
        go.set()
        publisher.join(WAIT)
    assert not publisher.is_alive()


# ---------------------------------------------------------------- audit of 33f6eb6
@pytest.fixture
def trio(store):
    """Three nodes; node 1 gives up a call after 1 s (d7_slow_replica.py's node 1)."""
    members = _members(store, (5.0, 1.0, 5.0))
    yield members
    for member in members:
        member.shutdown()


def test_a_sync_waiting_for_a_slow_replica_holds_up_neither_the_lane_nor_the_next_sync(trio, monkeypatch):
    """Node 0 syncs "p" to nodes 1 and 2; node 2 is slow to receive (held here). Node 1's
    pull of "p" waits for that sync (fair: it times out after node 1's 1 s), but it
    waited in node 0's lane for node 1: node 1's pull of another name, queued behind it,
    timed out too; and node 0 served the abandoned pull once the sync ended, its send
    waiting for nobody the owner's 5 s while it held "p": the next sync took 5 s."""
    owner, other, slow = trio
    td = owner.publish("p", _td(1.0))
    owner.publish("q", _td(2.0))
    other.attach("p")
    other.attach("q")
    slow.attach("p")
    inside, go = threading.Event(), threading.Event()
    real = cluster_serve._apply_sync

    def held(cluster, *args):
        if cluster is slow:
            inside.set()
            go.wait(WAIT)
        return real(cluster, *args)

    monkeypatch.setattr(cluster_serve, "_apply_sync", held)
    syncing = threading.Thread(target=lambda: owner.sync("p", timeout=WAIT), daemon=True)
    outcome = []
    puller = threading.Thread(target=lambda: outcome.append(_error_of(lambda: other.pull("p"))), daemon=True)
    try:
        syncing.start()
        assert inside.wait(WAIT)  # the sync holds "p" while node 2 receives nothing
        groups_before = other._groups.generation(0)
        puller.start()
        time.sleep(0.2)  # its request reached node 0
        began = time.monotonic()
        assert other.pull("q") == owner.version("q")  # (before: TimeoutError, behind the pull of "p")
        assert time.monotonic() - began < 0.5
        puller.join(WAIT)
        assert isinstance(outcome[0], TimeoutError), outcome  # it waited for the sync: fair
        # the pull that gave up failed no pair: the transfers of other names between the
        # two nodes go on (audit of 702e2e2: every gloo group of the pair was closed)
        assert other.pull("q") == owner.version("q")
        report_q = owner.sync("q", timeout=WAIT)
        assert report_q.delivered == [1] and not report_q.dropped, report_q
        assert other._groups.generation(0) == groups_before
        time.sleep(0.2)
    finally:
        go.set()
        syncing.join(WAIT)
    assert not syncing.is_alive()
    td["x"].fill_(3.0)
    began = time.monotonic()
    report = owner.sync("p", timeout=WAIT)
    assert time.monotonic() - began < 1.0  # (before: ~5 s, the owner's timeout)
    assert sorted(report.delivered) == [1, 2], report
    # 1 the publish, 2 and 3 the attaches, 4 the slow sync: the abandoned pull took none
    assert report.version == 5
    assert other.pull("p") == 6 == shared_td.version(other.attach("p"))


def test_owners_syncing_their_own_and_pulling_each_others_names_make_progress(store):
    """Node 0 owns "a", node 1 owns "b", each replicates the other's; each syncs its own
    and pulls the other's, at once, in a loop (d2_cross.py): each lane served a pull that
    waited for the name's lock, held by a sync waiting for the other node's lane, busy
    the same way: ops waited out the 3 s timeout, syncs dropped the other node."""
    members = _members(store, (3.0, 3.0))
    try:
        owner0, owner1 = members
        owner0.publish("a", _td(0.0, rows=1 << 16))
        owner1.publish("b", _td(0.0, rows=1 << 16))
        owner0.attach("b")
        owner1.attach("a")
        until, errors, worst = time.monotonic() + 1.5, [], []

        def loop(call):
            slowest = 0.0
            try:
                while time.monotonic() < until:
                    began = time.monotonic()
                    report = call()
                    if getattr(report, "dropped", None):
                        errors.append(report.dropped)
                    slowest = max(slowest, time.monotonic() - began)
            except BaseException as err:  # noqa: BLE001 - handed to the test
                errors.append(err)
            worst.append(slowest)

        calls = (lambda: owner0.sync("a", timeout=3.0), lambda: owner0.pull("b"),
                 lambda: owner1.sync("b", timeout=3.0), lambda: owner1.pull("a"))
        threads = [threading.Thread(target=loop, args=(call,), daemon=True) for call in calls]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(WAIT)
        assert not any(thread.is_alive() for thread in threads)
        assert not errors, errors[:3]
        assert max(worst) < 2.0, worst  # (a call blocked in the cycle waited out the 3 s timeout)
    finally:
        for member in members:
            member.shutdown()


@pytest.mark.parametrize("share_non_tensor", [False, True])
def test_an_attach_inside_one_republish_waits_for_the_store_to_name_it(pair, monkeypatch, share_non_tensor):
    """Node 1's first attach while node 0 re-publishes (held between the owner taking
    the new generation and its name record naming it): the pull of the old generation
    is refused naming the new one (or, with non-tensor values, the old generation's
    value records are deleted already); the attach tried again at once, read the old
    generation from the store, and spent its three tries within milliseconds:
    "published again 3 times" after one re-publish (d3_attach_window.py)."""
    owner, other = pair
    td = _td(1.0)
    if share_non_tensor:
        td["mode"] = "train"
    owner.publish("p", td, share_non_tensor=share_non_tensor)
    inside, go, refused = threading.Event(), threading.Event(), threading.Event()
    real_record, real_latest = cluster_generations.record_name, other._values.latest

    def held(*args, **kwargs):
        inside.set()
        assert go.wait(WAIT)
        return real_record(*args, **kwargs)

    def latest(*args, **kwargs):
        try:
            return real_latest(*args, **kwargs)
        except RuntimeError:
            refused.set()
            raise

    real_refusal = cluster_serve.refusal

    def refusal(*args):
        refused.set()
        return real_refusal(*args)

    monkeypatch.setattr(cluster_generations, "record_name", held)
    monkeypatch.setattr(other._values, "latest", latest)
    monkeypatch.setattr(cluster_serve, "refusal", refusal)
    new = _td(2.0)
    if share_non_tensor:
        new["mode"] = "eval"
    publisher = threading.Thread(target=lambda: owner.publish("p", new, share_non_tensor=share_non_tensor),
                                 daemon=True)
    outcome = []
    attacher = threading.Thread(target=lambda: outcome.append(_error_of(lambda: outcome.append(other.attach("p")))),
                                daemon=True)
    publisher.start()
    try:
        assert inside.wait(WAIT)
        attacher.start()
        assert refused.wait(WAIT)  # its first try met the re-publish
        time.sleep(0.05)
    finally:
        go.set()
        publisher.join(WAIT)
        attacher.join(WAIT)
    assert outcome[-1] is None, outcome  # (before: RuntimeError "published again 3 times")
    assert outcome[0]["x"].tolist() == [2.0] * 4
    if share_non_tensor:
        assert outcome[0]["mode"] == "eval"
    assert other.generation("p") == 2
