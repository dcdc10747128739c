"""A Ctrl-C in a cluster node's shutdown (Coordinator.shutdown / close, helper inject47).

Cluster.shutdown marks the node closed first; a Ctrl-C in any later step made the
next call return at once: the pairs' gloo groups, the store's connections and every
replica stayed open and mapped until the process ended (20 descriptors in a 2-node
loopback run)."""
from __future__ import annotations

import pytest
import torch

torch_dist = pytest.importorskip("torch.distributed")

import shared_td  # noqa: E402
from shared_td.coordinator import cluster_membership  # noqa: E402
from shared_td.coordinator.cluster_transfer import PairGroups  # noqa: E402
from tests.cluster.test_cluster_store import _members, pair, store  # noqa: E402,F401 (fixtures)


def test_a_shutdown_interrupted_by_a_ctrl_c_is_finished_by_the_next_call(pair, monkeypatch):
    owner, other = pair
    owner.publish("p", shared_td.TensorDict(x=torch.zeros(4), batch_size=[4]))
    other.attach("p")
    assert other._groups._groups  # the pair with node 0
    real = cluster_membership.stop_deliveries

    def stopped(cluster):
        real(cluster)
        raise KeyboardInterrupt  # as the delivery threads were told to stop

    monkeypatch.setattr(cluster_membership, "stop_deliveries", stopped)
    with pytest.raises(KeyboardInterrupt):
        other.shutdown()
    monkeypatch.setattr(cluster_membership, "stop_deliveries", real)
    other.shutdown()  # (before: returned at once, the node already "closed")
    assert not other._groups._groups and not other._replicas  # the pairs closed, the replicas let go
    other.shutdown()  # idempotent


def test_pairs_left_by_an_interrupted_close_are_closed_by_the_next_call(store, monkeypatch):
    nodes = _members(store, (5.0, 5.0, 5.0))
    try:
        for n in (1, 2):
            nodes[n].publish(f"p{n}", shared_td.TensorDict(x=torch.zeros(4), batch_size=[4]))
            nodes[0].attach(f"p{n}")
        assert sorted(nodes[0]._groups._groups) == [1, 2]
        closed, real = [], PairGroups._close

        def interrupted(self, peer, groups):
            real(self, peer, groups)
            if self is nodes[0]._groups:
                closed.append(peer)
                if len(closed) == 1:
                    raise KeyboardInterrupt  # a Ctrl-C once the first pair is closed

        monkeypatch.setattr(PairGroups, "_close", interrupted)
        with pytest.raises(KeyboardInterrupt):
            nodes[0].shutdown()
        nodes[0].shutdown()
        assert sorted(set(closed)) == [1, 2]  # before: [first peer] only (one interrupted may be closed again)
    finally:
        for node in nodes:
            node.shutdown()
