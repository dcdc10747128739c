"""Is a node of the cluster still there? Heartbeats through the store.

Each node writes a signed heartbeat ``hb/<node>`` (a growing number) every
:data:`HEARTBEAT_S`. Another node counts it as lost once the number it reads has not
changed for :data:`LOST_AFTER_S` of its own clock: no clock is compared between
machines, and a node that is only slow (a heartbeat every few seconds) is never lost.
Whether a heartbeat moves is read on its stored bytes, signed with our key or not, both
by :meth:`Liveness.alive` and when a claimed number may be taken over
(:func:`heartbeat_moves`): a heartbeat with a wrong signature is counted as forged (once
per value seen), never used, and never read as "no heartbeat". Before, ``alive`` read
every such heartbeat as the same None: one written by a process with another key read
as standing still, and that node was lost for this one (its names open to a takeover,
its replicas dropped from syncs) while it kept beating.

One process per node: a node joins by claiming ``claim/<node>`` (:func:`claim_node`), so
that two processes given the same node number are refused instead of both running as
that node (their requests, heartbeats and gloo pairs mixed: seen as a gloo connect
timeout at the first transfer). One owner per name: a publish claims ``owner/<name>``
(:func:`claim_name`). A claim held by a node whose heartbeat stands still is taken over.

A claim's key is a plain compare-and-set target (no signature can ride on it), so its
token carries its own: a nonce and its HMAC with the cluster authkey
(:func:`claim_token`), and a clean shutdown's emptied claim is backed by a signed
``left/<node>`` (:func:`release_node`). Only a token of the key means another process
runs the node: anything else found there (bytes written by something reaching the
store, an emptied key without its ``left/`` record) is counted as forged and ignored --
the process that holds the number writes its own back, and a sync keeps the node's
replica records (before, one raw write cut a node out of every sync in silence, and at
its next pause it stopped itself as "taken over" by its own pid).

A process that was only stopped (SIGSTOP, a debugger, a frozen VM) past LOST_AFTER_S may
find its number taken over when it runs again: every thread that is about to act as the
node asks :meth:`Liveness.still_mine` first, which is free while this node's own
heartbeat was written within LOST_AFTER_S - HEARTBEAT_S (nobody may take the number over
before its heartbeat stood still that long) and otherwise beats once and reads the claim
(and the owners of the names it owns: :func:`name_holder`). Before, such a process went
on serving the requests and pushes meant for its successor, beating under the same
number, and syncing names another node had taken over.
"""
from __future__ import annotations

import hmac
import itertools
import os
import secrets
import threading
import time
from typing import Callable

from shared_td.errors import ClusterAuthError, NodeTakenOverError, OwnerLostError

__all__ = ["HEARTBEAT_S", "LOST_AFTER_S", "Liveness", "claim_name", "claim_node", "heartbeat_moves",
           "claim_token", "claim_verifies", "name_holder", "release_node", "released"]

#: Seconds between two heartbeats of a node.
HEARTBEAT_S = 0.5
#: Seconds without a changed heartbeat after which a node counts as lost.
LOST_AFTER_S = 3.0

_NOT_FOUND = object()  # equal to no heartbeat seen (a missing one, None, included)


class Liveness:
    """This node's heartbeat, and what it knows of the others'.

    Args:
        store: the node's SignedStore.
        node: this node's number.
        read: ``read(key)`` -> the signed JSON value at ``key`` (the cluster's guarded
            read: a lost store host raises ConnectionError).
        claim: this process's token in ``claim/<node>`` (:func:`claim_node`).
        stop: the cluster's stop event: ends :meth:`beat`, and is set when the number
            was taken over.
        on_confirm: called when :meth:`still_mine` found the number still this
            process's after a gap (the names it owns may have been taken over meanwhile).
        refuse: called for each forged heartbeat value seen (the cluster counts it in
            ``refused``).
    """

    def __init__(self, store, node: int, read: Callable[[str], dict], claim: str | None = None,
                 stop: threading.Event | None = None, on_confirm: Callable[[], None] = lambda: None,
                 refuse: Callable[[], None] = lambda: None):
        self._store, self._node, self._read = store, node, read
        self._claim, self._stop, self._on_confirm = claim, stop or threading.Event(), on_confirm
        self._refuse = refuse
        self._forged: dict[int, bytes] = {}  # peer -> the forged heartbeat last counted
        self._numbers = itertools.count(1)  # this process's heartbeat numbers
        self._confirmed_at = time.monotonic()  # see _confirm (made just after the first heartbeat)
        self._looking = threading.Lock()  # one still_mine look at the store at a time
        #: why this process no longer runs its node (see :meth:`still_mine`), or None
        self.taken_over: str | None = None
        self._beats: dict[int, tuple[object, float]] = {}
        # peer -> the heartbeat it stood still at when it was found lost (still_lost, or
        # a call that failed with it: mark_lost): not waited for again until it moves
        self._found_lost: dict[int, object] = {}
        self._lock = threading.Lock()

    def beat(self) -> None:
        """Write this node's heartbeat until the stop event is set, the store is gone or
        the number was taken over (the target of the cluster's heartbeat thread)."""
        while not self._stop.wait(HEARTBEAT_S):
            began = time.monotonic()
            try:
                if not self.still_mine():
                    return  # beating on would keep the successor's number alive for us both
                self._write_beat()
            except (RuntimeError, OSError):
                return  # the store is gone
            self._confirm(began)

    def _write_beat(self) -> None:
        self._store.set_json(f"hb/{self._node}", {"beat": next(self._numbers), "pid": os.getpid()})

    def _confirm(self, at: float) -> None:
        """This process held its number at ``at`` (its heartbeat was written after, or
        its claim read): nobody takes it over before ``at`` + LOST_AFTER_S. The time
        taken *before* the write: a process stopped during it confirms nothing new."""
        with self._lock:
            self._confirmed_at = max(self._confirmed_at, at)

    def still_mine(self) -> bool:
        """Whether this process still runs its node. Free within LOST_AFTER_S -
        HEARTBEAT_S of the last confirmation (a heartbeat written); after a longer gap
        (the process was stopped, or starved) it reads ``claim/<node>``, writes a
        heartbeat and reads the claim again, and if it is still this process's, runs
        ``on_confirm`` (the cluster checks the names it owns). Once another process
        holds the number, False for good: :attr:`taken_over` says why and the stop
        event is set (the node's threads end; :meth:`check` raises). Callers wait while
        one of them looks. A lost store host raises as any store call."""
        if self.taken_over is None and time.monotonic() - self._confirmed_at < LOST_AFTER_S - HEARTBEAT_S:
            return True
        with self._looking:
            gap = time.monotonic() - self._confirmed_at
            if self.taken_over is not None or self._claim is None or gap < LOST_AFTER_S - HEARTBEAT_S:
                return self.taken_over is None  # another caller looked meanwhile
            began = time.monotonic()
            # the claim, then a heartbeat (a process still watching it to take the number
            # over sees it move and gives up), then the claim again (a takeover that
            # ended in between): no heartbeat under a number taken over already
            if self._holds_claim():
                self._write_beat()
                if self._holds_claim():
                    self._on_confirm()
                    self._confirm(began)
                    return True
            self.taken_over = (f"Node {self._node} was taken over by {self._successor()} while this process "
                               f"(pid {os.getpid()}) was stopped for {gap:.1f} s (its heartbeat stood still past "
                               f"{LOST_AFTER_S:g} s): this process no longer runs node {self._node}, and its "
                               "cluster calls fail. Its replicas stay readable; shut its Coordinator down.")
            self._stop.set()
            return False

    def _holds_claim(self) -> bool:
        """Whether ``claim/<node>`` is still this process's. Only a successor's token
        (:func:`claim_verifies`) means a takeover: anything else there (bytes written
        without the key, an emptied key) is counted as forged and this process's token
        written back (before, such a write stopped the node as "taken over by itself")."""
        key = f"claim/{self._node}"
        held = _holder(self._store, key, self._claim)
        if held == self._claim.encode():
            return True
        if held and claim_verifies(self._store, self._node, held):
            return False  # a successor's
        self._refuse()
        self._store.compare_set(key, held, self._claim)  # (a successor's written meanwhile stays)
        return _holder(self._store, key, self._claim) == self._claim.encode()

    def check(self) -> None:
        """NodeTakenOverError unless :meth:`still_mine`."""
        if not self.still_mine():
            raise NodeTakenOverError(self.taken_over)

    def _successor(self) -> str:
        """Who runs this node now, as its join record says."""
        try:
            record = self._read(f"join/{self._node}")
            return f"process {record['pid']} on {record['host']}"
        except (ClusterAuthError, KeyError, TypeError, RuntimeError, OSError):
            return "another process"

    def _last_beat(self, peer: int) -> bytes | None:
        """``peer``'s heartbeat as stored (None when missing): only compared with itself.
        One with a wrong signature is counted as forged, once per value (see the
        module's opening)."""
        key = f"hb/{peer}"
        blob = self._store.get_unchecked(key)
        if blob is not None:
            try:
                self._store.check(key, blob)
            except ClusterAuthError:
                with self._lock:
                    counted, self._forged[peer] = self._forged.get(peer), blob
                if counted != blob:
                    self._refuse()
        return blob

    def alive(self, peer: int) -> bool:
        """Whether ``peer``'s heartbeat changed within the last LOST_AFTER_S seconds (as
        seen by this process since it first looked), on its stored bytes: one that
        keeps changing with a wrong signature is a process beating there, not a lost
        node."""
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
    key, token = f"claim/{node}", claim_token(store, node)
    # the held claim as bytes: the key is unsigned, and anything that reaches the store
    # may have written bytes that are not UTF-8 (a bare UnicodeDecodeError before); such
    # a claim is another holder's, taken over as one once its heartbeat stands still
    held = store.compare_set(key, "", token)
    if held == token.encode():
        return token
    if heartbeat_moves(store, node):
        if not _signed_here(store, node):  # the fix is the key, not the numbers
            raise ValueError(
                f"Node {node} is running in this cluster with another authkey: its heartbeat hb/{node} moves and is "
                f"not signed with this process's cluster authkey. Its number was not taken over. Give every node "
                "the same authkey= (or SHARED_TD_CLUSTER_KEY), or stop the process that runs as node "
                f"{node} with the other key.")
        raise ValueError(_same_node(node, "is running in this cluster (its heartbeat moves)"))
    if not _signed_here(store, node):  # never take over what this process cannot read
        raise ClusterAuthError(
            f"Node {node}'s claim is held and its heartbeat hb/{node} is not signed with this process's "
            f"cluster authkey: this process (or the one that ran as node {node}) uses another key. Its number "
            "was not taken over. Give every node the same authkey= (or SHARED_TD_CLUSTER_KEY).")
    if store.compare_set(key, held, token) != token.encode():
        raise ValueError(_same_node(node, "is being started by another process at the same time"))
    return token


def heartbeat_moves(store, node: int) -> bool:
    """Whether node ``node``'s heartbeat changes within LOST_AFTER_S + HEARTBEAT_S: True
    as soon as it does (a running node beats every HEARTBEAT_S), False once it stood
    still that long (the node is gone, or stopped). Its stored bytes are compared, not
    its signed value: a process with another authkey read a running node's heartbeat as
    none at all, found it "standing still" and took its number over."""
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
    raw = store.compare_set(key, "", mine)  # compared as bytes: the key is unsigned, maybe not UTF-8
    held = raw.decode(errors="replace")
    if held == mine:
        return
    owner = int(held) if held.isdecimal() and held.isascii() and int(held) < nodes else None  # None: not a node's
    if owner is None or liveness.known_lost(owner) or not heartbeat_moves(store, owner):
        if store.compare_set(key, raw, mine) == mine.encode():
            return  # its owner is lost (or was never a node): this node takes the name over
    if owner is None:  # written meanwhile by something that is not a node of this cluster
        raise ValueError(f"{name!r} could not be claimed: owner/{name} holds {held!r}, which is not a node of this "
                         "cluster, and changed while this node took it over. Publish it again, or under another name.")
    raise ValueError(f"{name!r} is owned by node {held}: a name has one owner node (the others hold "
                     f"replicas and push rows to it). Publish it again on node {held}, or under another name.")


def name_holder(store, name: str, node: int) -> str:
    """Who holds ``owner/<name>`` (a node number as text): one round trip that changes
    nothing, for a name node ``node`` claimed (:func:`claim_name`)."""
    return _holder(store, f"owner/{name}", str(node)).decode(errors="replace")


def _holder(store, key: str, mine: str) -> bytes:
    """What ``key`` holds, read by a compare-and-set of ``mine`` with itself: one round
    trip that changes nothing (a claim's key exists from the claim on; for a missing
    key the store answers ``mine``)."""
    return store.compare_set(key, mine, mine)


def release_node(store, node: int, token: str) -> None:
    """Let node ``node`` go (a clean shutdown): a process started as that node later
    claims it at once, without waiting for the heartbeat to stand still. The emptied
    claim is backed by the signed ``left/<node>`` (naming ``token``): an empty claim
    without it is a forgery (:func:`released`)."""
    store.set_json(f"left/{node}", {"claim": token})
    store.compare_set(f"claim/{node}", token, "")


def claim_token(store, node: int) -> str:
    """A new token for ``claim/<node>``: a random nonce and its HMAC with the cluster
    authkey (bound to the key ``claim/<node>``), as ASCII: the claim's key stays a plain
    compare-and-set target, and who reads it can tell a node's token from a forgery."""
    nonce = secrets.token_hex(16)
    return f"{nonce}.{store.sign(f'claim/{node}', nonce.encode())[:16].hex()}"


def claim_verifies(store, node: int, held: bytes) -> bool:
    """Whether ``held`` (the bytes of ``claim/<node>``) is a token of :func:`claim_token`
    made with this cluster's authkey."""
    nonce, _dot, mac = held.partition(b".")
    return bool(mac) and hmac.compare_digest(mac, store.sign(f"claim/{node}", nonce)[:16].hex().encode())


def released(store, node: int, held: bytes | None, token: str) -> bool:
    """Whether ``claim/<node>`` holding ``held`` means the process of ``token`` let the
    number go (:func:`release_node`): emptied, and ``left/<node>`` signed, naming it.
    One round trip, only for an emptied claim."""
    if held:
        return False
    try:
        left, _blob = store.get_signed(f"left/{node}")
    except ClusterAuthError:
        return False
    return isinstance(left, dict) and left.get("claim") == token


def _signed_here(store, node: int) -> bool:
    """Whether node ``node``'s stored heartbeat verifies with ``store``'s key (True when
    there is none): a moving heartbeat of another key is a process with another key,
    which the error must name, not two processes given one number."""
    blob = _heartbeat(store, node)
    if blob is None:
        return True
    try:
        store.check(f"hb/{node}", blob)
    except ClusterAuthError:
        return False
    return True


def _heartbeat(store, node: int) -> bytes | None:
    """Node ``node``'s heartbeat as stored (None when missing), signed with our key or
    not: only compared with itself, to tell whether it moves."""
    return store.get_unchecked(f"hb/{node}")


def _same_node(node: int, what: str) -> str:
    return (f"Node {node} {what}: two processes were given node={node}. Give each node of the "
            "cluster its own number; under torchrun, the process of local rank 0 of each node "
            "makes the Coordinator (or run --nproc-per-node 1).")
