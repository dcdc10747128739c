"""Is a node of the cluster still there? Heartbeats through the store.

Each node writes a signed heartbeat ``hb/<node>`` (a growing number) every
:data:`HEARTBEAT_S`. Another node counts it as lost once the number it reads has not
changed for :data:`LOST_AFTER_S` of its own clock: no clock is compared between
machines, and a node that is only slow (a heartbeat every few seconds) is never lost.
A heartbeat with a wrong signature reads as no heartbeat (forged or of another cluster).

One process per node: a node joins by claiming ``claim/<node>`` (:func:`claim_node`), so
that two processes given the same node number are refused instead of both running as
that node (their requests, heartbeats and gloo pairs mixed: seen as a gloo connect
timeout at the first transfer). One owner per name: a publish claims ``owner/<name>``
(:func:`claim_name`). A claim held by a node whose heartbeat stands still is taken over.
"""
from __future__ import annotations

import itertools
import os
import secrets
import threading
import time
from typing import Callable

from shared_td.errors import ClusterAuthError, OwnerLostError

__all__ = ["HEARTBEAT_S", "LOST_AFTER_S", "Liveness", "claim_name", "claim_node", "heartbeat_moves",
           "release_node"]

#: Seconds between two heartbeats of a node.
HEARTBEAT_S = 0.5
#: Seconds without a changed heartbeat after which a node counts as lost.
LOST_AFTER_S = 3.0

_NOT_FOUND = object()  # equals no heartbeat, None (a wrong signature) included


class Liveness:
    """This node's heartbeat, and what it knows of the others'.

    Args:
        store: the node's SignedStore.
        node: this node's number.
        read: ``read(key)`` -> the signed JSON value at ``key`` (the cluster's guarded
            read: a lost store host raises ConnectionError).
    """

    def __init__(self, store, node: int, read: Callable[[str], dict]):
        self._store, self._node, self._read = store, node, read
        self._beats: dict[int, tuple[object, float]] = {}
        # peer -> the heartbeat it stood still at when it was found lost (still_lost, or
        # a call that failed with it: mark_lost): not waited for again until it moves
        self._found_lost: dict[int, object] = {}
        self._lock = threading.Lock()

    def beat(self, stop: threading.Event) -> None:
        """Write this node's heartbeat until ``stop`` is set or the store is gone (the
        target of the cluster's heartbeat thread)."""
        for number in itertools.count(1):
            if stop.wait(HEARTBEAT_S):
                return
            try:
                self._store.set_json(f"hb/{self._node}", {"beat": number, "pid": os.getpid()})
            except (RuntimeError, OSError):
                return  # the store is gone

    def _last_beat(self, peer: int):
        """``peer``'s last heartbeat number (None if not signed with our key)."""
        try:
            return self._read(f"hb/{peer}")["beat"]
        except ClusterAuthError:
            return None

    def alive(self, peer: int) -> bool:
        """Whether ``peer``'s heartbeat changed within the last LOST_AFTER_S seconds (as
        seen by this process since it first looked)."""
        beat, now = self._last_beat(peer), time.monotonic()
        with self._lock:
            seen = self._beats.get(peer)
            if seen is None or seen[0] != beat:
                self._beats[peer] = (beat, now)
                return True
            return now - seen[1] < LOST_AFTER_S

    def still_lost(self, peers: list[int], wait: float) -> list[int]:
        """Those of ``peers`` (each not :meth:`alive` a moment ago) whose heartbeat does
        not move within ``wait`` seconds: a node that was only stopped and runs again
        (SIGCONT, a long pause) beats within HEARTBEAT_S and is not counted as lost.
        A peer this method already found lost, whose heartbeat has not moved since, is
        lost at once: a dead replica node costs each later sync one store read, not
        ``wait`` seconds."""
        end = time.monotonic() + wait
        lost = [peer for peer in peers if not self.alive(peer)]
        with self._lock:
            known = [peer for peer in lost if self._found_lost.get(peer, _NOT_FOUND) == self._beats[peer][0]]
        pending = [peer for peer in lost if peer not in known]
        while pending and time.monotonic() < end:
            time.sleep(min(HEARTBEAT_S / 4, max(0.0, end - time.monotonic())))
            pending = [peer for peer in pending if not self.alive(peer)]
        with self._lock:
            self._found_lost.update((peer, self._beats[peer][0]) for peer in pending)
        return sorted(known + pending)

    def mark_lost(self, peer: int) -> None:
        """Record ``peer`` as found lost at the heartbeat last seen of it."""
        with self._lock:
            seen = self._beats.get(peer)
            self._found_lost[peer] = _NOT_FOUND if seen is None else seen[0]

    def known_lost(self, peer: int) -> bool:
        """Whether ``peer`` was found lost and its heartbeat has not moved since: free
        for a peer never found lost, one store read for one that was (a peer whose
        heartbeat moved is forgotten as lost)."""
        with self._lock:
            if peer not in self._found_lost:
                return False
        if not self.alive(peer):
            return True
        with self._lock:
            self._found_lost.pop(peer, None)
        return False

    def lost_or(self, peer: int, name: str, err: BaseException, role: str) -> BaseException:
        """After a failed transfer with ``peer``: OwnerLostError once its heartbeat has
        stood still for LOST_AFTER_S (waited for here), else a ConnectionError (the
        transfer may be retried)."""
        end = time.monotonic() + LOST_AFTER_S + HEARTBEAT_S
        while self.alive(peer):
            if time.monotonic() > end:
                return ConnectionError(f"The transfer of {name!r} with node {peer} failed ({err}); "
                                       "that node is alive: the call may be retried.")
            time.sleep(HEARTBEAT_S / 4)
        return self.lost(peer, name, role)

    @staticmethod
    def lost(peer: int, name: str, role: str) -> OwnerLostError:
        return OwnerLostError(
            f"Node {peer}, {role} of {name!r}, is lost: its heartbeat stood still for "
            f"{LOST_AFTER_S:g} s. This node's copy stays readable with its last contents."
        )


def claim_node(store, node: int) -> str:
    """Make this process the one that runs node ``node``: ``claim/<node>`` set atomically
    to a new token, which is returned. A claim another process holds is taken over once
    that node's heartbeat has stood still for LOST_AFTER_S (the node crashed and is
    started again: its claim was not released); while that heartbeat moves, ValueError:
    two processes were given the same node. ``store`` is the node's SignedStore."""
    key, token = f"claim/{node}", secrets.token_hex(16)
    held = store.compare_set(key, "", token).decode()
    if held == token:
        return token
    if heartbeat_moves(store, node):
        raise ValueError(_same_node(node, "is running in this cluster (its heartbeat moves)"))
    if store.compare_set(key, held, token).decode() != token:
        raise ValueError(_same_node(node, "is being started by another process at the same time"))
    return token


def heartbeat_moves(store, node: int) -> bool:
    """Whether node ``node``'s heartbeat changes within LOST_AFTER_S + HEARTBEAT_S: True
    as soon as it does (a running node beats every HEARTBEAT_S), False once it stood
    still that long (the node is gone, or stopped)."""
    first, end = _heartbeat(store, node), time.monotonic() + LOST_AFTER_S + HEARTBEAT_S
    while time.monotonic() < end:
        time.sleep(HEARTBEAT_S / 4)
        if _heartbeat(store, node) != first:
            return True
    return False


def claim_name(store, liveness: Liveness, node: int, nodes: int, name: str) -> None:
    """Make node ``node`` (of ``nodes``) the one owner of the published ``name``:
    ``owner/<name>`` set atomically. A name another node owns is refused (ValueError)
    while that node's heartbeat moves; the name of a lost owner is taken over (its new
    generation makes the replicas renew themselves). Before, a second node's publish
    made two owners."""
    key, mine = f"owner/{name}", str(node)
    held = store.compare_set(key, "", mine).decode()
    if held == mine:
        return
    owner = int(held) if held.isdigit() and int(held) < nodes else None  # None: not a node's
    if owner is None or liveness.known_lost(owner) or not heartbeat_moves(store, owner):
        if store.compare_set(key, held, mine).decode() == mine:
            return  # its owner is lost: this node takes the name over
    raise ValueError(f"{name!r} is owned by node {held}: a name has one owner node (the others hold "
                     f"replicas and push rows to it). Publish it again on node {held}, or under another name.")


def release_node(store, node: int, token: str) -> None:
    """Let node ``node`` go (a clean shutdown): a process started as that node later
    claims it at once, without waiting for the heartbeat to stand still."""
    store.compare_set(f"claim/{node}", token, "")


def _heartbeat(store, node: int):
    """Node ``node``'s heartbeat record; None when missing or not signed with our key."""
    try:
        return store.get_json(f"hb/{node}") if store.has(f"hb/{node}") else None
    except ClusterAuthError:
        return None


def _same_node(node: int, what: str) -> str:
    return (f"Node {node} {what}: two processes were given node={node}. Give each node of the "
            "cluster its own number; under torchrun, the process of local rank 0 of each node "
            "makes the Coordinator (or run --nproc-per-node 1).")
