"""The versions a ``sync`` delivers, and a replica's lock around a failed sync. Two
cluster members of one process (fast; see tests/cluster/test_cluster_store.py), real
threads, every wait bounded."""
from __future__ import annotations

import threading

import pytest
import torch

pytest.importorskip("torch.distributed")

from tests.cluster.test_cluster_store import pair, store  # noqa: E402,F401 - fixtures: two members of this process

import shared_td  # noqa: E402
from shared_td.coordinator import cluster_replica  # noqa: E402
from shared_td.coordinator.cluster_transfer import TransferFailed  # noqa: E402

WAIT = 30.0


def _in_threads(count: int, work) -> list:
    """``work(i)`` in ``count`` threads started together; their results (or errors), in
    order. Each thread is joined with a bound."""
    start = threading.Barrier(count)
    results: list = [None] * count

    def run(i):
        try:
            start.wait(WAIT)
            results[i] = work(i)
        except BaseException as err:  # noqa: BLE001 - handed to the test
            results[i] = err

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT)
        assert not thread.is_alive(), "a sync thread did not end"
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


def test_concurrent_syncs_of_one_name_report_distinct_increasing_versions(pair):
    """Two threads of the owner syncing one name: the version was bumped (``owned.version
    += 1``) and read again later (for the report, and for each replica's request), so a
    sync could report, and deliver, the version of the other thread's sync: two reports
    of one version, and a replica left at an older version than one reported
    delivered."""
    owner, other = pair
    td = owner.publish("p", shared_td.TensorDict(x=torch.zeros(256 * 1024), batch_size=[256 * 1024]))
    replica = other.attach("p")
    rounds = 15

    def syncs(i):
        reports = []
        for _ in range(rounds):
            td["x"].fill_(float(i))
            reports.append(owner.sync("p", timeout=WAIT))
        return reports

    per_thread = _in_threads(2, syncs)
    reports = [report for each in per_thread for report in each]
    assert all(report.delivered == [1] and not report.dropped for report in reports), reports
    versions = [report.version for report in reports]
    # each once, none skipped (the attach's pull was delivery 2)
    assert sorted(versions) == list(range(3, 3 + 2 * rounds)), versions
    for each in per_thread:  # one thread's syncs come one after the other
        assert [r.version for r in each] == sorted(r.version for r in each)
    # the replica holds the newest version reported delivered, and the owner says so too
    assert cluster_replica.replica_version(replica) == max(versions) == owner.version("p")
    assert owner._store.get_json("version/p")["version"] == max(versions)


def test_a_sync_waits_for_another_sync_of_the_name_within_its_timeout(pair, monkeypatch):
    """The second sync of a name waits for the first one, bounded by its own timeout:
    TimeoutError naming the name, no version taken, nothing sent."""
    from shared_td.coordinator import cluster_sync

    owner, other = pair
    owner.publish("p", shared_td.TensorDict(x=torch.zeros(4), batch_size=[4]))
    other.attach("p")
    inside, leave = threading.Event(), threading.Event()
    real = cluster_sync._sync_one

    def held(*args):
        inside.set()
        assert leave.wait(WAIT)
        return real(*args)

    monkeypatch.setattr(cluster_sync, "_sync_one", held)
    first = threading.Thread(target=lambda: owner.sync("p", timeout=WAIT), daemon=True)
    first.start()
    try:
        assert inside.wait(WAIT)
        with pytest.raises(TimeoutError, match=r"Another sync of 'p'.*0\.3 s"):
            owner.sync("p", timeout=0.3)
        assert owner.version("p") == 3  # the first sync's (the attach's pull was 2)
    finally:
        leave.set()
        first.join(WAIT)
    assert not first.is_alive()
    monkeypatch.undo()
    assert owner.sync("p").version == 4 and other.version("p") == 4


def test_a_pull_waiting_for_a_failed_sync_starts_on_the_next_pair(pair, monkeypatch):
    """A sync that fails on the replica (its wait given up: a timeout here) released the
    replica's lock before its pair was failed: a pull waiting for the lock could send its
    request for the pair generation about to be closed, and then fail with a
    ConnectionError (the owner alive). The window (microseconds) is widened here: the
    replica's failing of that pair waits until a pull asked over it, as a thread switch
    at that moment would have it. Now the pair is failed before the lock is released, so
    the pull names the next generation and succeeds. (A pull now asks before it takes
    the replica's lock, and the owner answers it once its sync ended: a request named
    the closed pair is refused as stale and made again, on the next pair.)"""
    owner, other = pair
    td = owner.publish("p", shared_td.TensorDict(x=torch.zeros(16), batch_size=[16]))
    replica = other.attach("p")
    doomed = other._groups.generation(0)
    pulled_on: list[int] = []
    pull_sent = threading.Event()
    real_request, real_wait, real_fail = other._request, other._groups.wait, other._groups.fail

    def request(peer, op, *args, **kwargs):
        tag, generation = real_request(peer, op, *args, **kwargs)
        if op == "pull":
            pulled_on.append(generation)
            pull_sent.set()
        return tag, generation

    syncing_inside = threading.Event()

    def wait(peer, works, deadline, what="transfer", nbytes=0, generation=None):
        if what == "sync":  # the sync's wait gives up once the pull waits for the lock
            syncing_inside.set()
            assert pull_sent.wait(WAIT)  # the pull asked while the sync held the replica's lock
            raise TransferFailed("the sync's wait timed out (made to, by the test)")
        return real_wait(peer, works, deadline, what, nbytes, generation=generation)

    failing = []

    def fail(peer, generation):
        if peer == 0 and generation == doomed and not failing:
            failing.append(generation)
            pull_sent.wait(1.5)  # a pull that could start now does so first
        return real_fail(peer, generation)

    monkeypatch.setattr(other, "_request", request)
    monkeypatch.setattr(other._groups, "wait", wait)
    monkeypatch.setattr(other._groups, "fail", fail)
    syncing = threading.Thread(target=lambda: owner.sync("p", timeout=WAIT), daemon=True)
    td["x"].fill_(4.0)
    syncing.start()
    outcome: list = []

    def pull():
        try:
            outcome.append(other.pull("p"))
        except BaseException as err:  # noqa: BLE001 - handed to the test
            outcome.append(err)

    puller = threading.Thread(target=pull, daemon=True)
    assert syncing_inside.wait(WAIT)  # the sync holds the replica's lock
    puller.start()
    puller.join(WAIT)
    syncing.join(WAIT)
    assert not puller.is_alive() and not syncing.is_alive()
    assert outcome and not isinstance(outcome[0], BaseException), outcome
    assert pulled_on and pulled_on[-1] > doomed, (pulled_on, doomed)
    assert replica["x"].tolist() == [4.0] * 16
    assert cluster_replica.replica_version(replica) == outcome[0]


def test_a_sync_reads_each_replica_record_once_per_generation_and_finds_a_later_attach(pair, monkeypatch):
    """The owner read each node's signed ``has/<name>/<node>`` record at every sync (two
    store round trips per node, in front of the transfer); it now keeps the nodes found,
    per generation, and still looks for the others at each sync."""
    owner, other = pair
    td = owner.publish("p", shared_td.TensorDict(x=torch.zeros(4), batch_size=[4]))
    assert owner.sync("p").delivered == []  # nobody holds a replica yet
    replica = other.attach("p")
    looked = []
    real_has = owner._store.has
    monkeypatch.setattr(owner._store, "has", lambda key: looked.append(key) or real_has(key))
    for value in (1.0, 2.0, 3.0):
        td["x"].fill_(value)
        assert owner.sync("p").delivered == [1]
    assert looked == ["has/p/1"]  # found at the first sync after the attach, then kept
    assert replica["x"].tolist() == [3.0] * 4
    owner.publish("p", td)  # a new generation (its replicas renew themselves): found again
    del looked[:]
    # (2, or 3 once the renew's pull, a delivery too, came first)
    assert owner.sync("p").version in (2, 3) and looked == ["has/p/1"]
