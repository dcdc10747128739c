"""The owner's half of :meth:`Cluster.sync <shared_td.coordinator.cluster.Cluster.sync>`:
the current contents of a name -> every node that holds a replica of it, as a new
version, each over its pair (one replica from the calling thread, more from the
cluster's sender threads at once); a replica node that is lost, fails or does not answer
within the timeout is dropped and reported (:class:`SyncReport`), never waited for
longer. A sync under way when its node is shut down raises the RuntimeError of every call
after ``shutdown()`` (it returned a report that dropped the replica nodes for a transfer
that the shutdown ended).

Which nodes hold a replica: each writes a signed record ``has/<name>/<node>`` when it
attaches (:func:`~shared_td.coordinator.cluster_replica.record_replica`), of the generation it attached and of the process that
holds it (the token of its claim of the node number, ``claim/<node>``). A sync sends to
the nodes whose record is of the name's current generation and whose process still
holds the number (:func:`has_replica`); a record of a process that no longer does (it
crashed, was restarted under the same number, or left) is taken back. Before, a record
stayed for good: every sync sent the whole payload to a node restarted without a
replica, which received it into scratch memory of its size and refused it."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from shared_td.coordinator import cluster_replica as replica
# the state of a name's deliveries, defined there (the pulls served, below cluster_serve) and re-exported
from shared_td.coordinator.cluster_deliveries import NameSyncs, name_syncs
from shared_td.coordinator.cluster_liveness import HEARTBEAT_S, LOST_AFTER_S, supersedes
from shared_td.coordinator.cluster_push import send_answered
from shared_td.coordinator.cluster_store import ClusterAuthError
from shared_td.coordinator.cluster_transfer import TransferFailed, stripe_count

__all__ = ["NameSyncs", "SyncReport", "has_replica", "name_syncs", "sync"]


@dataclass
class SyncReport:
    """What :meth:`Cluster.sync` did: the ``version`` sent, the nodes that have it, and
    the nodes dropped (node -> why)."""

    version: int
    delivered: list[int] = field(default_factory=list)
    dropped: dict[int, str] = field(default_factory=dict)


def has_replica(cluster, store, name: str, peer: int, generation: int | None = None, digest: str = "") -> bool:
    """Whether node ``peer`` holds a replica of ``name`` (of ``generation``; of any one
    when None: a re-publish tells every holder) by its ``has/<name>/<peer>`` record, read
    signed: a record with a wrong signature is counted in ``cluster.refused`` and
    ignored (only its existence was checked before: a forged one made the owner send a
    sync, or a renew notice, to a node without a replica). A record written by a process
    that no longer holds the node's number (``claim/<peer>`` holds a later process's
    token of the cluster's key and run, or the released token of its clean shutdown, see
    :func:`~shared_td.coordinator.cluster_liveness.supersedes`) is ignored and taken back:
    emptied by a compare-and-set against the bytes read, so that a record written
    meanwhile by the node's new process stays; a forged claim is counted in ``refused``
    and changes nothing. The record's ``(generation, digest)`` must be the name's. A record without a claim (an older writer) counts as its node's current
    process's; the sync it misleads is refused by that node without its payload being
    received (see ``cluster_serve``), which then takes the record back itself."""
    key = f"has/{name}/{peer}"
    if not store.has(key):  # (the usual answer for a node without a replica: one look)
        return False
    try:
        record, blob = store.get_signed(key)
    except ClusterAuthError:
        cluster.refused += 1
        return False
    if not isinstance(record, dict):
        return False  # taken back (emptied, or deleted since the look), or signed but not a record
    claim = record.get("claim")
    held = None if claim is None else store.get_unchecked(f"claim/{peer}")
    if claim is not None and held != str(claim).encode():
        if not supersedes(store, peer, cluster._run, held, str(claim)):
            cluster.refused += 1  # forged (or emptied, or an older token written back): ignored
        else:
            store.compare_set(key, blob, b"")  # the holder's process is gone
            return False
    return generation is None or (record.get("generation"), record.get("digest", "")) == (generation, digest)


def sync(cluster, name: str, timeout: float | None) -> SyncReport:
    """On the owner: send the current contents of ``name`` to every node holding a
    replica, as a new version; returns when all have it (or were dropped: a node
    that fails or does not answer within ``timeout`` seconds)."""
    store = cluster._as_node(f"sync({name!r})")  # may give up names taken over while this process was stopped
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
    syncs = name_syncs(cluster, name)
    syncs.lock.refuse_reentry(f"sync({name!r})")
    try:
        if not syncs.lock.acquire(timeout=timeout):
            raise TimeoutError(f"Another sync of {name!r} on this node did not end within {timeout:g} s: nothing was "
                               "sent (retry, or give the sync a longer timeout).")
        report = _sync_ordered(cluster, store, name, owned, syncs, deadline)
    except Exception as err:
        if cluster._closed:  # this node's shutdown ended it (a cancelled sender, its pairs closed)
            raise cluster._shut_down(f" during the sync of {name!r}") from err
        raise
    finally:
        try:
            syncs.lock.release()
        except RuntimeError:
            pass  # not taken: timed out, or interrupted before acquire returned (platform.ThreadLock)
    if cluster._closed and report.dropped:  # dropped for a transfer the shutdown ended
        raise cluster._shut_down(f" during the sync of {name!r} (it reached {report.delivered or 'no node'})")
    return report


def _replica_nodes(cluster, store, name: str, owned, syncs: NameSyncs) -> list[int]:
    """The nodes holding a replica of ``name`` (see ``NameSyncs.holders``)."""
    if syncs.generation != (owned.generation, owned.digest):
        syncs.generation, syncs.holders = (owned.generation, owned.digest), set()
    found = [n for n in range(cluster.nodes) if n != cluster.node and (
        n in syncs.holders or has_replica(cluster, store, name, n, owned.generation, owned.digest))]
    syncs.holders.update(found)
    return found


def _sync_ordered(cluster, store, name: str, owned, syncs: NameSyncs, deadline: float) -> SyncReport:
    """:func:`sync`, with the name's sync lock held: the version it takes is its own."""
    owned.version += 1
    version = owned.version
    report = SyncReport(version)
    recorded = []

    def record_version() -> None:
        """The ``version/<name>`` record, once (nothing waits for it: it is written
        while the replica node's lane wakes up for the request, not in front of it)."""
        if not recorded:
            store.set_json(f"version/{name}", {"version": version, "generation": owned.generation})
            recorded.append(version)

    targets = _replica_nodes(cluster, store, name, owned, syncs)
    # lost: dropped after one more look at its heartbeat (a node that was only
    # stopped beats again within HEARTBEAT_S), not waited for until the timeout
    quiet = [n for n in targets if not cluster._alive(n)]
    # a node whose heartbeat (just read) says its process left cleanly: its record is read
    # again, and taken back (see NameSyncs): before, this sync sent it the request and
    # waited LOST_AFTER_S for it to be lost, and reported it so
    for node in [n for n in targets if cluster._liveness.left(n)]:
        if not has_replica(cluster, store, name, node, owned.generation, owned.digest):
            targets.remove(node)
            syncs.holders.discard(node)
            quiet = [n for n in quiet if n != node]
    for node in cluster._liveness.still_lost(quiet, min(2 * HEARTBEAT_S, max(0.0, deadline - time.monotonic()))):
        targets.remove(node)
        report.dropped[node] = f"lost: its heartbeat stood still for {LOST_AFTER_S:g} s"
    if not targets:
        record_version()
        syncs.holders.difference_update(report.dropped)
        return report
    payload = replica.segment_bytes(owned.segment, owned.layout["nbytes"])
    # one replica: this thread; more: the sender threads, which keep their store
    # connections from one sync to the next
    if len(targets) == 1:
        reasons = {targets[0]: _sync_one(cluster, targets[0], name, owned, version, payload, deadline,
                                         record_version)}
    else:
        futures = {node: cluster._senders.submit(_sync_one, cluster, node, name, owned, version, payload, deadline)
                   for node in targets}
        record_version()
        reasons = {node: future.result() for node, future in futures.items()}
    record_version()  # (when the request could not be sent: the store gone raises here)
    for node, reason in reasons.items():
        if reason is None:
            report.delivered.append(node)
        else:
            report.dropped[node] = reason
            _mark_if_lost(cluster, node)
    syncs.holders.difference_update(report.dropped)  # looked up again by the next sync
    return report


def _sync_one(cluster, peer: int, name: str, owned, version: int, payload, deadline: float,
              after_request=lambda: None) -> str | None:
    try:
        stripes = stripe_count(owned.layout["nbytes"], cluster.stripes)

        def send():
            tag, generation = cluster._request(peer, "sync", name, owned.generation, version=version,
                                               nbytes=owned.layout["nbytes"], stripes=stripes, digest=owned.digest)
            try:
                after_request()  # while the peer's lane wakes up for the request
            except (RuntimeError, OSError):
                pass  # the store is gone: the transfer goes on, and the caller's own record raises it
            return send_answered(cluster, peer, generation, tag, payload, deadline,
                                 f"sync of {name!r} to node {peer}", stripes)

        cluster._refusal(peer, name, cluster._retried_if_stale(send))
    except (TransferFailed, TimeoutError, ConnectionError, RuntimeError) as err:
        if cluster._closed:  # not the replica node's failure: this node's shutdown ended it
            raise cluster._shut_down(f" during the sync of {name!r} to node {peer}") from err
        if _departed(cluster, peer):  # its shutdown cut the transfer: no crash, nothing waited for
            return f"left (shutdown): node {peer} left the cluster during the sync ({type(err).__name__})"
        return f"{type(err).__name__}: {err}"
    return None


def _mark_if_lost(cluster, peer: int) -> None:
    """A replica node dropped by this sync whose heartbeat stands still is found lost
    (``Cluster._found``, as a request to it that failed so: nothing stays built with
    it): the next sync drops it at once, as later ones do, instead of waiting
    ``2 * HEARTBEAT_S`` for it to beat again."""
    try:
        if not cluster._liveness.alive(peer):
            cluster._found(peer)
    except (RuntimeError, OSError):
        pass  # the store cannot tell: the next sync looks again


def _departed(cluster, peer: int) -> bool:
    """Whether ``peer`` left cleanly (``Liveness.departed``), read now; False when the
    store cannot tell."""
    try:
        cluster._liveness.alive(peer)  # reads its heartbeat now: departed goes by the last one read
        return cluster._liveness.departed(peer)
    except (RuntimeError, OSError):
        return False
