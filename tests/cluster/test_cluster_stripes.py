"""One transfer striped over several gloo groups of a pair (``Cluster(stripes=k)``), in
real node process trees on 127.0.0.1: the replica holds the owner's exact bytes after a
striped first attach, sync and pull (stripes of unequal sizes, leaves across the stripes'
boundaries, six dtypes); the node that asks for a transfer chooses its count; a payload
under the threshold and k=1 go over one group, as before; a replica node SIGKILLed in the
middle of striped syncs is dropped within the timeout and every group of its pair is
aborted (nothing stays posted). Payloads stay under 10 MB, every wait is bounded.
"""
from __future__ import annotations

import contextlib
import random
import time

import pytest

torch_dist = pytest.importorskip("torch.distributed")

from shared_td.coordinator.cluster import Cluster  # noqa: E402
from shared_td.coordinator.cluster_transfer import MAX_STRIPES, STRIPE_MIN_BYTES, stripe_ranges  # noqa: E402
from tests.cluster.test_cluster import Nodes, pulls_through_an_owner_kill  # noqa: E402
from tests.cluster.test_cluster_failures import leak_checked_nodes, syncs_through_a_kill  # noqa: E402
from tests.processes import WAIT  # noqa: E402

pytestmark = pytest.mark.timeout(180)

ROWS = 200_011  # a dtypes_td of 6,800,576 bytes: above STRIPE_MIN_BYTES, no multiple of 2, 3 or 4 cache lines


@pytest.mark.parametrize("nbytes", [0, 1, 63, 64, 1000, STRIPE_MIN_BYTES, 6_800_041])
@pytest.mark.parametrize("stripes", [1, 2, 3, 4, 7, MAX_STRIPES])
def test_stripe_ranges_cover_the_payload_in_order(nbytes, stripes):
    ranges = stripe_ranges(nbytes, stripes)
    assert len(ranges) == stripes
    assert ranges[0][0] == 0 and ranges[-1][1] == nbytes
    assert all(end == start for (_s, end), (start, _e) in zip(ranges, ranges[1:]))  # contiguous, in order
    assert all(start <= end for start, end in ranges)
    assert all(start % 64 == 0 or start == nbytes for start, _end in ranges)  # cache lines; empty at the end
    sizes = [end - start for start, end in ranges]
    assert max(sizes) - min(sizes) <= 64 * stripes  # balanced


@pytest.mark.parametrize("stripes", [0, -1, MAX_STRIPES + 1, 2.0, "2"])
def test_a_stripe_count_out_of_range_is_refused_when_the_cluster_is_made(stripes):
    with pytest.raises(ValueError, match="stripes"):
        Cluster("tcp://127.0.0.1:1", 0, 1, authkey=b"k" * 16, stripes=stripes)


def _nodes(store, stripes):
    return Nodes(store, len(stripes), options=[{"stripes": k} for k in stripes])


@pytest.fixture
def stores():
    from tests.cluster.stores import loopback_store

    return loopback_store(20)


@pytest.mark.parametrize("stripes", [(3, 3), (4, 2), (1, 1)], ids=["k3", "owner4-replica2", "k1"])
def test_striped_attach_sync_and_pull_give_the_owner_bytes(stores, stripes):
    owner_k, replica_k = stripes
    nodes = _nodes(stores, stripes)
    try:
        assert all(answer[0] == "ok" for answer in nodes.started), nodes.started
        nbytes, spans = nodes.ok(0, "publish_dtypes", "weights", ROWS, 1)
        assert nbytes >= STRIPE_MIN_BYTES and nbytes < 10_000_000
        for k in {owner_k, replica_k} - {1}:  # the test means what it says: the last stripe is shorter ...
            assert nbytes % (64 * k), (nbytes, k)  # (the layout pads the payload to 64 bytes)
            inner = [cut for _s, cut in stripe_ranges(nbytes, k)[:-1]
                     if any(start < cut < end for start, end in spans)]
            assert inner, ("no stripe boundary falls inside a leaf", spans, k)  # ... and leaves cross boundaries
        owner_digest = nodes.ok(0, "digest", "weights")[0]
        # first attach: one pull, over the replica node's stripes
        nodes.ok(1, "attach_dtypes", "weights")
        digest, version, segment = nodes.ok(1, "digest", "weights")
        assert (digest, version) == (owner_digest, 2)  # (the publish is version 1, the attach's pull 2)
        assert nodes.ok(1, "stripes", 0)[1] == replica_k
        # sync: over the owner's stripes, into the same replica segment (in place)
        nodes.ok(0, "fill_dtypes", "weights", 5)
        assert nodes.ok(0, "sync", "weights") == (3, [1], [])
        owner_digest = nodes.ok(0, "digest", "weights")[0]
        assert nodes.ok(1, "digest", "weights") == (owner_digest, 3, segment)
        assert nodes.ok(0, "stripes", 1)[1] == max(owner_k, replica_k)  # built once, reused
        # pull: the owner's current contents
        nodes.ok(0, "fill_dtypes", "weights", 9)
        assert nodes.ok(1, "pull", "weights") == 4  # a delivery: the next version
        owner_digest = nodes.ok(0, "digest", "weights")[0]
        assert nodes.ok(1, "digest", "weights") == (owner_digest, 4, segment)
        for _ in range(3):  # back to back, both ways, on the same groups
            nodes.ok(0, "fill_dtypes", "weights", random.randrange(250))
            version = nodes.ok(0, "sync", "weights")[0]
            assert nodes.ok(1, "digest", "weights") == (nodes.ok(0, "digest", "weights")[0], version, segment)
            assert nodes.ok(1, "pull", "weights") == version + 1
        generation, built = nodes.ok(1, "stripes", 0)
        assert built == max(owner_k, replica_k) and nodes.ok(0, "stripes", 1) == (generation, built)
    finally:
        nodes.close()


def test_a_payload_under_the_threshold_goes_over_one_group(stores):
    nodes = _nodes(stores, (4, 4))
    try:
        nodes.ok(0, "publish", "small", 1000, 1.0)
        nodes.ok(1, "attach", "small")
        nodes.ok(0, "fill", "small", 3.0)
        assert nodes.ok(0, "sync", "small") == (3, [1], [])  # (the attach's pull was 2)
        assert nodes.ok(1, "read", "small") == nodes.ok(0, "read", "small")
        assert nodes.ok(0, "stripes", 1)[1] == 1 and nodes.ok(1, "stripes", 0)[1] == 1
    finally:
        nodes.close()


def test_replica_node_killed_mid_striped_sync_is_dropped_and_its_groups_aborted():
    timeout = 3.0
    with leak_checked_nodes(3, options=[{"stripes": 4}] * 3) as nodes:
        nodes.ok(0, "publish_dtypes", "weights", ROWS, 1)
        nodes.ok(1, "attach_dtypes", "weights")
        nodes.ok(2, "attach_dtypes", "weights")
        # each stripe's wait shares the sync's bound
        gaps, reports = syncs_through_a_kill(nodes, "weights", timeout, victim=2)
        assert sum(gaps[-10:]) < 3.0, (gaps, reports)  # a lost node is not waited for again
        assert reports[-1][1:] == ([1], [2]), reports
        # every group of the pair with the dead node was aborted (no receive or send stays
        # posted on any stripe); the pair with node 1 keeps its four
        assert nodes.ok(0, "stripes", 2) is None
        assert nodes.ok(0, "stripes", 1)[1] == 4
        version = reports[-1][0]
        assert nodes.ok(1, "digest", "weights")[:2] == (nodes.ok(0, "digest", "weights")[0], version)


def test_owner_killed_during_striped_pulls_raises_owner_lost_not_a_hang(stores):
    nodes = _nodes(stores, (4, 4, 4))
    try:
        nodes.ok(1, "publish_dtypes", "weights", ROWS, 1)  # the owner: node 1 (the store lives on)
        nodes.ok(2, "attach_dtypes", "weights")
        pulls_through_an_owner_kill(nodes, "weights")  # a version over mixed stripes never counts
        assert nodes.ok(2, "stripes", 1) is None  # every stripe of the failed generation aborted
    finally:
        nodes.close()


def _pair_of_nodes(store, stripes: int):
    """Two nodes' PairGroups in this process, their pair built with ``stripes`` stripes
    (each side in its own thread: the rendezvous waits for both)."""
    import threading

    from shared_td.coordinator.cluster_store import SignedStore
    from shared_td.coordinator.cluster_transfer import PairGroups

    sides = [PairGroups(SignedStore(store, b"k", timeout=10.0), node, timeout=10.0, hostname="127.0.0.1")
             for node in (0, 1)]
    assert [side.generation(1 - side.node) for side in sides] == [0, 0]  # as a first request does
    built = {}
    threads = [threading.Thread(target=lambda n=n: built.__setitem__(n, sides[n].groups(1 - n, 0, stripes)))
               for n in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT)
    assert [len(built.get(n, ())) for n in (0, 1)] == [stripes, stripes]
    return sides


def test_a_failed_striped_transfer_leaves_no_receive_posted_on_any_stripe(stores):
    """A striped receive whose sender never comes fails at its bounded wait; afterwards
    no stripe's receive takes a byte any more: the peer's late sends on the old
    generation never reach the buffer (in a pull or a sync: the replica's segment)."""
    import torch

    from shared_td.coordinator.cluster_transfer import TransferFailed, wait_work

    sides = _pair_of_nodes(stores, 3)
    try:
        buffer = torch.zeros(3000, dtype=torch.uint8)
        works = sides[1].recv(0, 0, buffer, 5, stripes=3)  # no sender yet
        assert len(works) == 3
        began = time.monotonic()
        with pytest.raises(TransferFailed):
            wait_work(works, time.monotonic() + 0.5, "striped receive")
        assert time.monotonic() - began < 2.0  # one bound for all stripes, not one each
        sides[1].fail(0, 0)  # as every caller does on TransferFailed
        assert sides[1].stripes(0) is None and sides[1].generation(0) == 1  # the next transfer builds generation 1
        ones = torch.ones(3000, dtype=torch.uint8)  # the peer's late sends, on generation 0, each stripe its own
        for group, (start, end) in zip(sides[0].groups(1, 0, 3), stripe_ranges(3000, 3)):
            with contextlib.suppress(RuntimeError, TransferFailed):  # RuntimeError: that pair is closed
                wait_work([group.send([ones[start:end]], 1, 5)], time.monotonic() + 1.0, "late send")
        time.sleep(0.2)
        assert int(buffer.count_nonzero()) == 0, [int(buffer[s:e].count_nonzero()) for s, e in stripe_ranges(3000, 3)]
    finally:
        for side in sides:
            side.close()
