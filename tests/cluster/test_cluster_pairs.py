"""A pair's generations (``PairGroups``): a generation a node has left is never built
again, so that a request that waited in a lane while its pair failed (a node stopped and
resumed, a peer that moved on before its notice came) ends at once in StalePair instead
of a rendezvous the peer never joins (it held the lane, and so the next transfer, for the
whole timeout: seen as a resumed replica node dropped by the owner's next sync).
Two nodes' PairGroups in this process, on a loopback store; every wait bounded.
"""
from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("torch.distributed")

from shared_td.coordinator.cluster_store import SignedStore  # noqa: E402
from shared_td.coordinator.cluster_transfer import PairGroups, StalePair  # noqa: E402
from tests.cluster.stores import loopback_store  # noqa: E402
from tests.cluster.test_cluster_stripes import _pair_of_nodes  # noqa: E402

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def store():
    return loopback_store(20)


def test_a_thread_that_finds_the_groups_failed_does_not_build_their_generation_again(store):
    """One thread fails the pair (its groups are gone, the store not told yet: held
    here); another, serving a request that names the old generation, gets StalePair at
    once instead of building it again."""
    sides = _pair_of_nodes(store, 1)
    told = threading.Event()
    compare_set = sides[1]._store.compare_set

    def held_compare_set(*args):
        told.wait(10)
        return compare_set(*args)

    sides[1]._store.compare_set = held_compare_set
    failing = threading.Thread(target=sides[1].fail, args=(0, 0))
    try:
        failing.start()
        until = time.monotonic() + 5
        while sides[1].stripes(0) is not None and time.monotonic() < until:
            time.sleep(0.001)
        assert sides[1].stripes(0) is None  # the groups are gone, the store not told
        began = time.monotonic()
        with pytest.raises(StalePair):
            sides[1].groups(0, 0, deadline=time.monotonic() + 3)
        assert time.monotonic() - began < 1.0
    finally:
        told.set()
        failing.join(10)
        for side in sides:
            side.close()
    assert sides[1].generation(0) == 1


def test_a_generation_the_store_moved_past_is_not_built_before_its_notice_comes(store):
    """Node 0 failed the pair (the store says generation 1); node 1 holds no group with
    it and has not read the notice yet: a request naming generation 0 gets StalePair at
    once (one store read), not a rendezvous that waits out the timeout."""
    sides = _pair_of_nodes(store, 1)
    fresh = PairGroups(SignedStore(store, b"k", timeout=10.0), 1, timeout=10.0, hostname="127.0.0.1")
    try:
        sides[0].fail(1, 0)
        began = time.monotonic()
        with pytest.raises(StalePair):
            fresh.groups(0, 0, deadline=time.monotonic() + 3)
        assert time.monotonic() - began < 1.0
        assert fresh.generation(0) == 1
    finally:
        for side in (*sides, fresh):
            side.close()


def test_a_wait_is_given_up_once_the_peer_moved_the_pair_past_its_generation(store):
    """A node stopped while a transfer was under way, found lost by its peer (which failed
    the pair), then resumed: gloo never ends its posted receive (or send), and its lane
    waited out the transfer's whole bound (11-16 s seen), holding up every request of that
    peer. The wait now looks at the store's pair too and ends once it moved past."""
    from shared_td.coordinator.cluster_transfer import TransferFailed
    import torch

    sides = _pair_of_nodes(store, 1)
    sides[1]._alive = lambda peer: True  # (a Cluster's liveness: the peer beats)
    try:
        nbytes = 1 << 20  # (past DIRECT_MAX_BYTES: waited for in a waiter, watched)
        works = sides[1].recv(0, 0, torch.empty(nbytes, dtype=torch.uint8), 7, time.monotonic() + 20)
        # the peer moved the store's pair to generation 1 and its connection stays open (as
        # seen with real nodes: gloo ended neither side's operation), so the receive stays
        sides[0].move_on(1)
        began = time.monotonic()
        with pytest.raises(TransferFailed, match="moved to generation 1"):
            sides[1].wait(0, works, time.monotonic() + 15, "pull", nbytes, generation=0)
        assert time.monotonic() - began < 3.0
    finally:
        for side in sides:
            side.close()
