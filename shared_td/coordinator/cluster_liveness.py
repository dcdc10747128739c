"""Is a node of the cluster still there? Heartbeats through the store.

Each node writes a signed heartbeat ``hb/<node>`` (a growing number) every
:data:`HEARTBEAT_S`. Another node counts it as lost once the number it reads has not
changed for :data:`LOST_AFTER_S` of its own clock: no clock is compared between
machines, and a node that is only slow (a heartbeat every few seconds) is never lost.
A heartbeat also carries the cluster's run (every third writes its record back if deleted:
:func:`keep_run`); the last one of a clean shutdown says ``"left"`` (:meth:`Liveness.say_left`).
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
(:mod:`~shared_td.coordinator.cluster_owners`). A claim held by a node whose heartbeat
stands still is taken over.

The tokens a claim holds, their signature and what a held one means (a successor's, a
released one, a forgery): :mod:`~shared_td.coordinator.cluster_claims`.

A process that was only stopped (SIGSTOP, a debugger, a frozen VM) past LOST_AFTER_S may
find its number taken over when it runs again: every thread that is about to act as the
node asks :meth:`Liveness.still_mine` first, which is free while this node's own
heartbeat was written within LOST_AFTER_S - HEARTBEAT_S (nobody may take the number over
before its heartbeat stood still that long) and otherwise beats once and reads the claim
(and the owners of the names it owns:
:func:`~shared_td.coordinator.cluster_owners.names_taken_over`). Before, such a process went
on serving the requests and pushes meant for its successor, beating under the same
number, and syncing names another node had taken over.

Nothing the heartbeat thread does grows with the names a node owns: a beat is one
write, and every :data:`_KEEP_RUN_EVERY` th also reads the claim back (one round trip).
The names' owner keys are looked at elsewhere: the names taken over during a pause by
the first other thread that asks :meth:`Liveness.still_mine` after it (the beat only
marks them due), and deleted owner keys by the watch thread
(:mod:`~shared_td.coordinator.cluster_owner_keys`). Before, every third beat looked at
each owned name's key (a round trip each) before the next beat: 400 names on a store
10 ms away spaced the beats 4.3 s apart, past LOST_AFTER_S, and the live node's names
were taken over by another node's publish (audit 22).
"""
from __future__ import annotations

import itertools
import json
import os
import threading
import time
from typing import Callable

from shared_td.coordinator.cluster_claims import (claim_free, claim_token, held_claim, parsed_claim, release_node,
                                                  released_token, supersedes)
from shared_td.coordinator.cluster_runs import RunWatch, keep_run
from shared_td.errors import ClusterAuthError, NodeTakenOverError, OwnerLostError

# (claim_free .. supersedes: cluster_claims's, named here too for the modules that import them from here)
__all__ = ["HEARTBEAT_S", "LOST_AFTER_S", "Liveness", "claim_node", "heartbeat_moves",
           "claim_free", "claim_token", "release_node", "released_token", "supersedes"]

#: Seconds between two heartbeats of a node.
HEARTBEAT_S = 0.5
#: Seconds without a changed heartbeat after which a node counts as lost.
LOST_AFTER_S = 3.0

#: Every how many heartbeats the run record is written back if deleted (``Liveness.beat``):
#: within LOST_AFTER_S / 2 (a newcomer of the window follows the live nodes' run anyway).
_KEEP_RUN_EVERY = max(1, round(LOST_AFTER_S / 2 / HEARTBEAT_S))
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
            process's after a gap (the names it owns may have been taken over meanwhile),
            in a caller of still_mine other than the heartbeat thread.
        refuse: called for each forged heartbeat value seen (the cluster counts it in
            ``refused``).
        run: the cluster's run (:func:`~shared_td.coordinator.cluster_runs.run_id`), which claim tokens are bound to.
    """

    def __init__(self, store, node: int, read: Callable[[str], dict], claim: str | None = None,
                 stop: threading.Event | None = None, on_confirm: Callable[[], None] = lambda: None,
                 refuse: Callable[[], None] = lambda: None, run: str = "", nodes: int = 0):
        self._store, self._node, self._read, self._run = store, node, read, run
        self._run_watch = RunWatch(nodes, LOST_AFTER_S + HEARTBEAT_S)  # a record of another run (keep_run)
        self._claim, self._stop, self._on_confirm = claim, stop or threading.Event(), on_confirm
        self._refuse = refuse
        self._forged: dict[int, bytes] = {}  # peer -> the forged heartbeat last counted
        # peer -> the claim token its heartbeat last read names, when that heartbeat is a
        # clean shutdown's (see left, departed; "" for one of an older writer, naming none)
        self._left: dict[int, str] = {}
        self._numbers = itertools.count(1)  # this process's heartbeat numbers
        self._written: bytes | None = None  # the heartbeat this process stored last (see say_left)
        self._confirmed_at = time.monotonic()  # see _confirm (made just after the first heartbeat)
        self._looking = threading.Lock()  # one still_mine look at the store at a time
        # the looks after a gap that found the number still this process's, and how many
        # of them on_confirm ran after (by a thread other than the heartbeat's: see still_mine)
        self._gaps, self._names_looked = 0, 0
        self._naming = threading.Lock()  # one on_confirm at a time
        #: why this process no longer runs its node (see :meth:`still_mine`), or None
        self.taken_over: str | None = None
        self._beats: dict[int, tuple[object, float]] = {}
        # peer -> the heartbeat it stood still at when it was found lost (still_lost, or
        # a call that failed with it: mark_lost): not waited for again until it moves
        self._found_lost: dict[int, object] = {}
        self._lock = threading.Lock()

    def beat(self) -> None:
        """Write this node's heartbeat until the stop event is set, the store is gone or
        the number was taken over (the target of the cluster's heartbeat thread). One
        beat every HEARTBEAT_S from the start of the last (the wait shortened by the
        time the writes took), and the run record's :func:`keep_run` on every
        :data:`_KEEP_RUN_EVERY` th only: on every beat, with the wait after both, a store
        of ~1 s a round trip spaced the beats past LOST_AFTER_S - HEARTBEAT_S (then
        still_mine's three more round trips) and live nodes were declared lost (audit
        19, second round)."""
        began = time.monotonic()
        for number in itertools.count(1):
            if self._stop.wait(max(0.0, began + HEARTBEAT_S - time.monotonic())):
                return
            began = time.monotonic()
            try:
                if not self._holds_number():  # (on_confirm after a gap: left to the other threads)
                    return  # beating on would keep the successor's number alive for us both
                self._write_beat()
                self._confirm(began)
                # deleted: back before a newcomer sets its own; another run watched: every beat
                if self._run and (number % _KEEP_RUN_EVERY == 0 or self._run_watch.seen is not None):
                    keep_run(self._store, self._run, self._run_watch)
                if number % _KEEP_RUN_EVERY == 0 and self._claim is not None:
                    self._keep_keys()
            except (RuntimeError, OSError):
                return  # the store is gone

    def _write_beat(self, number: int | None = None) -> None:
        """One heartbeat, the next number unless ``number`` (the node's join writes 0)."""
        # the run: a newcomer that finds the run record gone follows the live nodes' (cluster_membership)
        beat = {"beat": next(self._numbers) if number is None else number, "pid": os.getpid(), "run": self._run}
        self._store.set_json(f"hb/{self._node}", beat)
        with self._lock:  # (the bytes set_json stored: what say_left expects there)
            self._written = self._store.sign(f"hb/{self._node}", json.dumps(beat).encode())

    def say_left(self) -> None:
        """Write the heartbeat of a clean shutdown (``"left": true``, see :meth:`left`),
        before the claim is released, by a compare-and-set against this process's own
        last heartbeat: written unconditionally after the release, it overwrote the
        heartbeat of a successor that had taken the number over (or of a process
        started at once after the leave), which its owner read as left (audit 19,
        second round)."""
        key = f"hb/{self._node}"
        with self._lock:
            written = self._written
        if written is not None:
            # the claim it releases next: a peer whose transfer with this node fails tells a
            # clean leave from a crash by both (departed), not by this beat alone
            left = {"left": True, "pid": os.getpid(), "run": self._run, "claim": self._claim}
            self._store.compare_set(key, written, self._store.sign(key, json.dumps(left).encode()))

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
        ``on_confirm`` (the cluster checks the names it owns) before it returns. Once
        another process holds the number, False for good: :attr:`taken_over` says why
        and the stop event is set (the node's threads end; :meth:`check` raises).
        Callers wait while one of them looks. A lost store host raises as any store
        call. The heartbeat thread's own look leaves ``on_confirm`` (a round trip per
        owned name) to the next caller here: the beats go on meanwhile."""
        if not self._holds_number():
            return False
        if self._names_looked != self._gaps:  # a gap confirmed: the names, before acting as the node
            with self._naming:
                gaps = self._gaps
                if self._names_looked != gaps:  # (not looked at by another caller meanwhile)
                    self._on_confirm()
                    self._names_looked = gaps
        return True

    def _holds_number(self) -> bool:
        """:meth:`still_mine` without ``on_confirm``: a gap confirmed is counted in
        ``_gaps``, for a caller of still_mine to look at the names."""
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
                    self._gaps += 1  # (before the confirmation: no caller acts unlooked-at)
                    self._confirm(began)
                    return True
            self.taken_over = (f"Node {self._node} was taken over by {self._successor()} while this process "
                               f"(pid {os.getpid()}) was stopped for {gap:.1f} s (its heartbeat stood still past "
                               f"{LOST_AFTER_S:g} s): this process no longer runs node {self._node}, and its "
                               "cluster calls fail. Its replicas stay readable; shut its Coordinator down.")
            self._stop.set()
            return False

    def _holds_claim(self) -> bool:
        """Whether ``claim/<node>`` is still this process's. A later process's token of
        the key and run (:func:`supersedes`: a successor's, or the released token a
        successor left at its clean shutdown) means a takeover: anything else there
        (bytes written without the key, an emptied key, an older token written back)
        is counted as forged and this process's token written back (before, such a
        write stopped the node as "taken over by itself")."""
        key = f"claim/{self._node}"
        held = held_claim(self._store, key, self._claim)
        if held == self._claim.encode():
            return True
        if supersedes(self._store, self._node, self._run, held, self._claim):
            return False  # a successor's (or its released one)
        self._refuse()
        self._store.compare_set(key, held, self._claim)  # (a successor's written meanwhile stays)
        return held_claim(self._store, key, self._claim) == self._claim.encode()

    def _keep_keys(self) -> None:
        """Every few beats (as the run record): this process's ``claim/<node>`` written
        back when something deleted or emptied it, counted as forged (a newcomer read
        such a claim as free: two processes ran node 1, audit 22). One round trip: the
        owner keys of its names are the watch thread's
        (:mod:`~shared_td.coordinator.cluster_owner_keys`; see the module's opening)."""
        key = f"claim/{self._node}"
        if not self._store.get_unchecked(key):
            self._refuse()
            self._store.compare_set(key, "", self._claim)  # (a newcomer's written meanwhile stays)

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
        left = None
        if blob is not None:
            try:
                left = _says_left(self._store.check(key, blob))
            except ClusterAuthError:
                with self._lock:
                    counted, self._forged[peer] = self._forged.get(peer), blob
                if counted != blob:
                    self._refuse()
        with self._lock:
            if left is None:
                self._left.pop(peer, None)
            else:
                self._left[peer] = left
        return blob

    def left(self, peer: int) -> bool:
        """Whether ``peer``'s heartbeat, as :meth:`alive` last read it, is the one its
        process writes as it leaves cleanly (see ``ClusterMembership.shutdown``): the
        owner then looks at the node's replica records again (a clean leave seen on the
        first sync after it, not waited for as a lost node). Only a reason to look: a
        recorded one written back decides nothing."""
        with self._lock:
            return peer in self._left

    def departed(self, peer: int) -> bool:
        """Whether ``peer``'s process left cleanly, by the heartbeat :meth:`alive` last
        read: a "left" one (signed) naming a claim token, and ``claim/<peer>`` holding
        the released token of exactly that claim (:func:`release_node`, signed, bound to
        the run). One store read, only once the heartbeat says "left". A transfer or a
        wait with such a node ends at once (``ClusterRequests._alive``): its shutdown
        writes both before it closes its pairs, so a transfer that its shutdown cut finds
        them (before, the peer waited LOST_AFTER_S for the "left" beat to stand still
        and reported the node lost). A recorded pair of them written back while the
        node's process runs makes only a transfer that fails meanwhile end at once:
        the process beats again within HEARTBEAT_S (see README, Security)."""
        with self._lock:
            claim = self._left.get(peer)
        if not claim:
            return False
        try:
            held = self._store.get_unchecked(f"claim/{peer}")
            return held == released_token(self._store, peer, claim, self._run).encode()
        except (ValueError, TypeError):
            return False  # a claim that is not a token (signed, but not one of ours)

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
        if not self.alive(peer) or self.departed(peer):
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
            if self.departed(peer):  # it shut down (its shutdown cut the transfer): not waited for
                return self.lost(peer, name, role, departed=True)
            if time.monotonic() > end:
                return ConnectionError(f"The transfer of {name!r} with node {peer} failed ({err}); "
                                       "that node is alive: the call may be retried.")
            time.sleep(HEARTBEAT_S / 4)
        return self.lost(peer, name, role)

    @staticmethod
    def lost(peer: int, name: str, role: str, departed: bool = False) -> OwnerLostError:
        """The error of a call whose ``peer`` is gone: lost, or ``departed`` (left by its
        shutdown, see :meth:`departed`)."""
        why = ("left the cluster (shutdown): its last heartbeat says so and its node number is released"
               if departed else f"is lost: its heartbeat stood still for {LOST_AFTER_S:g} s")
        return OwnerLostError(f"Node {peer}, {role} of {name!r}, {why}. This node's copy stays readable with "
                              "its last contents.")


def claim_node(store, node: int, run: str = "") -> str:
    """Make this process the one that runs node ``node``: ``claim/<node>`` set atomically
    to a new token, which is returned. A claim another process holds is taken over once
    that node's heartbeat has stood still for LOST_AFTER_S (the node crashed and is
    started again: its claim was not released); while that heartbeat moves, ValueError:
    two processes were given the same node. ``store`` is the node's SignedStore, ``run``
    the cluster's (:func:`~shared_td.coordinator.cluster_runs.run_id`)."""
    # the held claim as bytes: the key is unsigned, and anything that reaches the store
    # may have written bytes that are not UTF-8 (a bare UnicodeDecodeError before); such
    # a claim is another holder's, taken over as one once its heartbeat stands still
    key, held = f"claim/{node}", store.get_unchecked(f"claim/{node}")
    before = parsed_claim(store, node, run, held)
    token = claim_token(store, node, run, floor=before.seq if before else 0)
    # none, or a clean shutdown's released token; a claim deleted or emptied under a
    # running node is not (its live heartbeat says so: a second process ran as it)
    if claim_free(store, node, held, run) and (held or not _beats_unclaimed(store, node)):
        if store.compare_set(key, held or "", token) == token.encode():
            return token
        raise ValueError(_same_node(node, "is being started by another process at the same time"))
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
    if store.compare_set(key, held or "", token) != token.encode():
        raise ValueError(_same_node(node, "is being started by another process at the same time"))
    return token


def _beats_unclaimed(store, node: int) -> bool:
    """Whether node ``node``, its claim missing or emptied, still has a heartbeat that
    moves: none there (a new cluster) and a signed clean shutdown's are not waited for."""
    blob = _heartbeat(store, node)
    if blob is None:
        return False
    try:
        if _says_left(store.check(f"hb/{node}", blob)) is not None:
            return False
    except ClusterAuthError:
        pass  # another key's, or junk: whether it moves decides
    return heartbeat_moves(store, node)


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


def _says_left(payload: bytes) -> str | None:
    """The claim token a signed heartbeat's payload names when it is a clean shutdown's
    (``"left": true``; "" when it names none: an older writer's), else None."""
    try:
        beat = json.loads(payload)
        if beat.get("left") is not True:
            return None
        claim = beat.get("claim")
        return claim if isinstance(claim, str) else ""
    except (ValueError, AttributeError):
        return None


def _heartbeat(store, node: int) -> bytes | None:
    """Node ``node``'s heartbeat as stored (None when missing), signed with our key or
    not: only compared with itself, to tell whether it moves."""
    return store.get_unchecked(f"hb/{node}")


def _same_node(node: int, what: str) -> str:
    return (f"Node {node} {what}: two processes were given node={node}. Give each node of the "
            "cluster its own number; under torchrun, the process of local rank 0 of each node "
            "makes the Coordinator (or run --nproc-per-node 1).")
