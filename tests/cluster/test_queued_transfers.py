"""A transfer queued behind a long one to the same node: the peer serves this node's
requests one at a time (its lane), so the wait of the one queued allows for the bytes
posted before it. Its bound counted its own bytes only: a 1 KB sync queued behind a
sync taking longer than the 5 s slack timed out, and its failure closed the pair, which
dropped the long sync as well (the replica node alive all along).

Scaled down: the slack is 1 s and the slowest rate allowed 2 MB/s, so that a 10 MB sync
handled 2 s late by the replica is within its own bound (1 s + 5 s) and a 1 KB sync
posted behind it is not within its old one (1 s).
"""
from __future__ import annotations

import threading
import time

import torch

import shared_td
from shared_td.coordinator import cluster_serve, cluster_waits
from tests.cluster.test_cluster_store import pair, store  # noqa: F401 - fixtures: two members of this process
from tests.processes import WAIT

LATE_S = 2.0


def test_a_small_sync_queued_behind_a_long_one_waits_for_it(pair, monkeypatch):
    owner, other = pair
    big = owner.publish("big", shared_td.TensorDict(w=torch.ones(10 << 18), batch_size=[10 << 18]))  # 10 MB
    small = owner.publish("small", shared_td.TensorDict(w=torch.ones(256), batch_size=[256]))  # 1 KB
    replicas = other.attach("big"), other.attach("small")
    monkeypatch.setattr(cluster_waits, "WAIT_SLACK_S", 1.0)
    monkeypatch.setattr(cluster_waits, "MIN_RATE", 2e6)
    real = cluster_serve._apply_sync

    def late(cluster, peer, rep, request):  # the replica's lane takes the big one's bytes slowly
        if request["name"] == "big":
            time.sleep(LATE_S)
        return real(cluster, peer, rep, request)

    monkeypatch.setattr(cluster_serve, "_apply_sync", late)
    big["w"].fill_(2.0)
    small["w"].fill_(3.0)
    reports = {}
    first = threading.Thread(target=lambda: reports.setdefault("big", owner.sync("big", timeout=WAIT)))
    first.start()
    time.sleep(0.3)  # the big one's request is in the replica's lane
    reports["small"] = owner.sync("small", timeout=WAIT)
    first.join(WAIT)
    assert not first.is_alive()
    assert {name: (report.delivered, report.dropped) for name, report in reports.items()} == {
        "big": ([1], {}), "small": ([1], {})}
    assert (replicas[0]["w"] == 2.0).all() and (replicas[1]["w"] == 3.0).all()
