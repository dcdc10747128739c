"""A Ctrl-C landing right as one of the cluster's locks is taken (acquire() has returned,
its KeyboardInterrupt raised at the next check for signals) must not leave it held: the
lock was taken before the ``try`` that gives it back, so every later pull, push, sync or
attach of the name on the node, or every transfer with the peer, timed out ("Another
transfer ... did not end"). Two members of one process are the two nodes (see
test_cluster_store.py); each lock is wrapped so that its first acquire takes it, then
raises KeyboardInterrupt, as a SIGINT handled right after acquire() returned does."""
from __future__ import annotations

import time

import pytest
import torch

pytest.importorskip("torch.distributed")

import shared_td  # noqa: E402
from shared_td.coordinator import cluster_push, cluster_transfer  # noqa: E402
from shared_td.platform import ThreadLock  # noqa: E402
from shared_td.coordinator.cluster_deliveries import name_syncs  # noqa: E402
from tests.cluster.test_cluster_store import pair, store  # noqa: E402,F401 (fixtures)
from tests.storage.test_ctrl_c_lock_before_try import _free_in_another_thread, _InterruptedOnce  # noqa: E402


def _published(pair, attach: bool = True):
    owner, other = pair
    td = owner.publish("p", shared_td.TensorDict(x=torch.arange(4.0), batch_size=[4]))
    return td, (other.attach("p") if attach else None)


def _interrupted_once(holder, attribute: str) -> _InterruptedOnce:
    wrapped = _InterruptedOnce(getattr(holder, attribute))
    setattr(holder, attribute, wrapped)
    return wrapped


def test_pull(pair):
    owner, other = pair
    td, view = _published(pair)
    lock = _interrupted_once(other._replicas["p"], "lock")
    td["x"].add_(1)
    with pytest.raises(KeyboardInterrupt):
        other.pull("p")
    assert _free_in_another_thread(lock.lock)
    other.pull("p")  # the next pull of the name goes on
    assert view["x"].tolist() == [1.0, 2.0, 3.0, 4.0]


@pytest.mark.parametrize("holder", ["replica", "push line"])
def test_push(pair, holder):
    """The lock of the replica (read for the rows) or of the push line to the owner."""
    owner, other = pair
    td, view = _published(pair)
    if holder == "replica":
        lock = _interrupted_once(other._replicas["p"], "lock")
    else:
        lock = _interrupted_once(other._push_lines.setdefault(owner.node, cluster_push.PushLine()), "lock")
    view["x"][1] = 7.0
    with pytest.raises(KeyboardInterrupt):
        other.push("p", 1)
    assert _free_in_another_thread(lock.lock)
    other.push("p", 1)
    assert td["x"].tolist() == [0.0, 7.0, 2.0, 3.0]


def test_sync(pair):
    owner, other = pair
    td, view = _published(pair)
    lock = _interrupted_once(name_syncs(owner, "p"), "lock")
    td["x"].add_(2)
    with pytest.raises(KeyboardInterrupt):
        owner.sync("p")
    assert _free_in_another_thread(lock.lock)
    assert owner.sync("p").delivered == [other.node]
    assert view["x"].tolist() == [2.0, 3.0, 4.0, 5.0]


def test_attach(pair):
    owner, other = pair
    _published(pair, attach=False)
    lock = _interrupted_once(other, "_attaching")
    with pytest.raises(KeyboardInterrupt):
        other.attach("p")
    assert _free_in_another_thread(lock.lock)
    assert other.attach("p")["x"].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_the_lock_of_a_pair_being_built():
    groups = cluster_transfer.PairGroups(None, 0, timeout=1.0)
    groups._locks[1] = lock = _InterruptedOnce(ThreadLock())  # (the kind groups() makes)
    with pytest.raises(KeyboardInterrupt):
        groups.groups(1, 1)
    assert _free_in_another_thread(lock.lock)


def test_a_pull_its_own_thread_would_wait_for_is_refused_before_anything_is_asked(pair):
    """A pull run while its own thread holds the replica's lock (a signal handler that
    pulls while the pull it interrupted holds it) waited out its whole timeout, then
    left the owner's send to drain; now a RuntimeError at once, nothing asked."""
    owner, other = pair
    td, view = _published(pair)
    lock = other._replicas["p"].lock
    served = owner.version("p")
    with lock:
        started = time.monotonic()
        with pytest.raises(RuntimeError, match=r"pull\('p'\): this thread holds the lock already"):
            other.pull("p")
        assert time.monotonic() - started < 1.0
    assert owner.version("p") == served  # (each pull the owner serves takes the next version)
    td["x"].add_(1)
    other.pull("p")
    assert view["x"].tolist() == [1.0, 2.0, 3.0, 4.0]
