"""The owner's half of :meth:`Cluster.sync <shared_td.coordinator.cluster.Cluster.sync>`:
the current contents of a name -> every node that holds a replica of it, as a new
version, each over its pair (one replica from the calling thread, more from the
cluster's sender threads at once); a replica node that is lost, fails or does not answer
within the timeout is dropped and reported (:class:`SyncReport`), never waited for
longer."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from shared_td.coordinator import cluster_replica as replica
from shared_td.coordinator.cluster_liveness import HEARTBEAT_S, LOST_AFTER_S
from shared_td.coordinator.cluster_push import send_answered
from shared_td.coordinator.cluster_store import ClusterAuthError
from shared_td.coordinator.cluster_transfer import TransferFailed, stripe_count

__all__ = ["SyncReport", "has_replica", "sync"]


@dataclass
class SyncReport:
    """What :meth:`Cluster.sync` did: the ``version`` sent, the nodes that have it, and
    the nodes dropped (node -> why)."""

    version: int
    delivered: list[int] = field(default_factory=list)
    dropped: dict[int, str] = field(default_factory=dict)


def has_replica(cluster, store, name: str, peer: int) -> bool:
    """Whether node ``peer`` recorded a replica of ``name`` (``has/<name>/<peer>``, read
    signed): a record with a wrong signature is counted in ``cluster.refused`` and
    ignored (only its existence was checked before: a forged one made the owner send
    a sync, or a renew notice, to a node without a replica)."""
    if not store.has(f"has/{name}/{peer}"):
        return False
    try:
        store.get_json(f"has/{name}/{peer}")
    except ClusterAuthError:
        cluster.refused += 1
        return False
    return True


def sync(cluster, name: str, timeout: float | None) -> SyncReport:
    """On the owner: send the current contents of ``name`` to every node holding a
    replica, as a new version; returns when all have it (or were dropped: a node
    that fails or does not answer within ``timeout`` seconds)."""
    store = cluster._checked()  # may give up names taken over while this process was stopped
    owned = cluster._owned.get(name)
    if owned is None:
        taken = cluster._taken_names.get(name)
        why = (f"node {taken} took it over while this node's heartbeat stood still" if taken
               else "only its owner syncs it")
        raise KeyError(f"This node (node {cluster.node}) does not own {name!r}: {why}.")
    timeout = cluster.timeout if timeout is None else timeout
    if not timeout > 0:  # a zero wait failed every replica's transfer, and so its pair
        raise ValueError(f"sync({name!r}, timeout={timeout!r}): the timeout is a number of seconds above 0.")
    deadline = time.monotonic() + timeout
    owned.version += 1
    store.set_json(f"version/{name}", {"version": owned.version, "generation": owned.generation})
    report = SyncReport(owned.version)
    targets = [n for n in range(cluster.nodes) if n != cluster.node and has_replica(cluster, store, name, n)]
    # lost: dropped after one more look at its heartbeat (a node that was only
    # stopped beats again within HEARTBEAT_S), not waited for until the timeout
    quiet = [n for n in targets if not cluster._alive(n)]
    for node in cluster._liveness.still_lost(quiet, min(2 * HEARTBEAT_S, max(0.0, deadline - time.monotonic()))):
        targets.remove(node)
        report.dropped[node] = f"lost: its heartbeat stood still for {LOST_AFTER_S:g} s"
    if not targets:
        return report
    payload = replica.segment_bytes(owned.segment, owned.layout["nbytes"])
    # one replica: this thread; more: the sender threads, which keep their store
    # connections from one sync to the next
    if len(targets) == 1:
        reasons = {targets[0]: _sync_one(cluster, targets[0], name, owned, payload, deadline)}
    else:
        futures = {node: cluster._senders.submit(_sync_one, cluster, node, name, owned, payload, deadline)
                   for node in targets}
        reasons = {node: future.result() for node, future in futures.items()}
    for node, reason in reasons.items():
        if reason is None:
            report.delivered.append(node)
        else:
            report.dropped[node] = reason
    return report

def _sync_one(cluster, peer: int, name: str, owned, payload, deadline: float) -> str | None:
    try:
        stripes = stripe_count(owned.layout["nbytes"], cluster.stripes)

        def send():
            tag, generation = cluster._request(peer, "sync", name, owned.generation, version=owned.version,
                                            nbytes=owned.layout["nbytes"], stripes=stripes)
            return send_answered(cluster, peer, generation, tag, payload, deadline,
                                 f"sync of {name!r} to node {peer}", stripes)

        cluster._refusal(peer, name, cluster._retried_if_stale(send))
    except (TransferFailed, TimeoutError, ConnectionError, RuntimeError) as err:
        return f"{type(err).__name__}: {err}"
    return None
