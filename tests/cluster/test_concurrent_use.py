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
"""
from __future__ import annotations

import threading
import time

import pytest
import torch

torch_dist = pytest.importorskip("torch.distributed")

import shared_td  # noqa: E402
from shared_td.coordinator import cluster_generations, cluster_sync  # noqa: E402
from shared_td.coordinator.cluster_liveness import LOST_AFTER_S, claim_free  # noqa: E402
from shared_td.coordinator.cluster_transfer import TransferFailed  # noqa: E402
from tests.cluster.test_cluster_store import pair, store  # noqa: E402,F401 - fixtures

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
