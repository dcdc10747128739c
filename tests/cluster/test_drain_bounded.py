"""A drain (a pull given up by its requester, received anyway: cluster_drain) ends even when
its live owner never answers the cancel -- an owner that predates the cancel op, or whose
answer was lost to a store error: it asks again after each node timeout and ends after
UNANSWERED_ASKS of them (audit 21: it waited for as long as the owner lived, holding a
thread and store connections, and logging torch's timeout lines)."""
from __future__ import annotations

import threading
import time

import pytest
import torch

torch_dist = pytest.importorskip("torch.distributed")

import shared_td  # noqa: E402
from shared_td.coordinator import cluster_drain, cluster_serve  # noqa: E402
from tests.cluster.test_cluster_store import _members, store  # noqa: E402,F401 - fixtures


def _drains() -> int:
    return sum(thread.name == cluster_drain.DRAINER for thread in threading.enumerate())


def test_a_drain_ends_when_its_live_owner_never_answers_the_cancel(store, monkeypatch):
    owner, requester = _members(store, (5.0, 0.5))
    try:
        owner.publish("p", shared_td.TensorDict(x=torch.zeros(1 << 12), batch_size=[1 << 12]))
        requester.attach("p")
        handle, serve = cluster_serve._handle, cluster_serve._serve
        cancels = []

        def deaf_to_cancels(cluster, request):
            if cluster is owner and request.get("op") == "cancel":
                cancels.append(request["tag"])
                return None  # never answered
            return handle(cluster, request)

        def late(cluster, peer, op, name, request):
            if cluster is owner and op == "pull":
                time.sleep(1.0)  # after the requester gave up
            return serve(cluster, peer, op, name, request)

        monkeypatch.setattr(cluster_serve, "_handle", deaf_to_cancels)
        monkeypatch.setattr(cluster_serve, "_serve", late)
        with pytest.raises(TimeoutError):
            requester.pull("p")
        deadline = time.monotonic() + 0.5 * cluster_drain.UNANSWERED_ASKS + 4.0
        while _drains() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _drains() == 0
        # asked again after each timeout without an answer (the pull's own answer, when it
        # comes in between, starts the count again: at most one more round)
        assert cluster_drain.UNANSWERED_ASKS <= len(cancels) <= 2 * cluster_drain.UNANSWERED_ASKS - 1
        monkeypatch.setattr(cluster_serve, "_handle", handle)
        monkeypatch.setattr(cluster_serve, "_serve", serve)
        assert requester.pull("p") >= 1  # the payload was drained: the pair is intact
    finally:
        for member in (requester, owner):
            member.shutdown()
