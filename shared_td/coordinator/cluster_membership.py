"""A :class:`~shared_td.coordinator.cluster.Cluster` node joining and leaving: the
lifecycle half of the class (``start``, ``shutdown``), kept apart from what a running
node does so that each reads on its own.

Joining (:meth:`ClusterMembership.start`): open the store, claim the node's number
(:func:`~shared_td.coordinator.cluster_liveness.claim_node`: one process per number),
drop what waits in the node's queues for its previous process, write the signed join
record and the first heartbeat, start beating, wait for every other node's join record,
then start the node's threads (the service thread, the pair watch, one lane per peer:
:mod:`~shared_td.coordinator.cluster_serve`).

Another authkey is refused as early as it can be seen. Before the claim, the other
nodes' join records that exist are read: if none verifies with this process's key,
this process (or all of them) uses another key, and it joins nothing (ClusterAuthError).
A held number is then left alone entirely (taking it over would drain the running
node's queues and overwrite its records); a free number is claimed just long enough to
write this process's own join record, signed with its key, so that the nodes waiting in
their own ``start()`` refuse it at once instead of waiting out their timeout for it.
While a node waits for the others, each join record is checked as it appears: a wrong
one fails the start at once, not after every node joined. (Before, the key was looked at
only when the number was held, and only after all nodes joined otherwise.)

The run (audit 19). Claim and owner tokens are bound to the cluster's run, one signed
record read at start (:mod:`~shared_td.coordinator.cluster_runs`). Deleted
while nodes live (by anything that reaches the store), a newcomer set a run of its own,
and the nodes split into two runs that read each other's genuine tokens as forgeries:
records never taken back, a restarted node's start waiting 3.5 s to "take over" its own
released number. Now the heartbeats carry the run and write the record back when it
is missing (:func:`~shared_td.coordinator.cluster_runs.keep_run`), and a newcomer that
set the record itself, with a run other than the one the other nodes' signed heartbeats
carry, follows theirs once they move (:func:`settled_run`); live heartbeats of two runs
are then a genuine split, refused with a ValueError naming the record's key. A record
found at start is the cluster's, whatever heartbeats say (replayed ones of an earlier
run were followed, and overwrote it: audit 19, second round); one of a run no heartbeat
carrying moves (its creator died before it followed the live nodes) is replaced by the
live nodes (``keep_run``), and a starter that found it waits for that.

Leaving (:meth:`ClusterMembership.shutdown`): stop notices in the node's own queues wake
its threads (a process whose number was taken over leaves the queues to its successor
and wakes its pops without a notice: :func:`~shared_td.coordinator.cluster_wake.wake_pops`;
its shutdown waited 60 s), a last heartbeat says so (``"left": true``, naming the claim it
releases), so that an owner's next sync looks at the node's replica records again (and
takes them back) instead of waiting LOST_AFTER_S for the node to be lost, the number is
released for the next process, and then the pairs are closed (the receives kept posted
end, the watched waits and the group builds under way give up, and the build threads
have ended: :meth:`~shared_td.coordinator.cluster_transfer.PairGroups.close`). In that
order: a peer whose transfer the close cuts finds the "left" beat and the released claim
(``Liveness.departed``) and takes the node as gone at once, "left (shutdown)" (closed
first, the peer waited ~3.5 s and reported the node lost, or the owner lost). That
heartbeat replaces only this process's own last one (a compare-and-set: written after
the release, unconditionally, it overwrote the heartbeat of a successor that had taken
the number over).

Leaving at the interpreter's exit: a node still running when its process ends (the
script ended, or an exception escaped it, without ``shutdown()``) is shut down by an
``atexit`` hook, which then waits for the node's threads to end (each of their waits is
bounded by the cluster's timeout; they end within milliseconds of the shutdown as a
rule). The threads are daemons, and a daemon thread that comes back from a torch call
(a ``queue_pop`` of its lane, a gloo wait) into an interpreter that is finalizing is
ended by ``pthread_exit`` inside pybind11's GIL guard, a C++ destructor: the process
aborted ("terminate called without an active exception", SIGABRT) whenever a replica
node's script ended while its owner synced to it. The hook is registered once a node's
first thread runs and dropped by ``shutdown()``; a fork child's copy of a node is not
its node (its threads and connections are the parent's), so the child's exit, and its
``shutdown()``, leave the parent's node alone.
"""
from __future__ import annotations

import atexit
import json
import os
import socket
import threading
import time

from shared_td.coordinator.cluster_deliveries import stop as stop_deliveries
from shared_td.coordinator.cluster_launch import check_store, open_store
from shared_td.coordinator.cluster_liveness import (HEARTBEAT_S, LOST_AFTER_S, Liveness, claim_free, claim_node,
                                                    release_node)
from shared_td.coordinator.cluster_runs import open_run, run_key
from shared_td.coordinator.cluster_owner_keys import give_up_names_taken_over
from shared_td.coordinator.cluster_names import LocalNames
from shared_td.coordinator.cluster_serve import (LISTENER, POP_S, lane_queue, listen, serve_lane, serve_notices,
                                                 watch_pairs)
from shared_td.coordinator.cluster_store import ClusterAuthError, SignedStore
from shared_td.coordinator.cluster_transfer import PairGroups
from shared_td.coordinator.cluster_wake import wake_pops
from shared_td.coordinator.cluster_values import ClusterValues
from shared_td.platform import ThreadLock

__all__ = ["ClusterMembership", "settled_run"]

# The nodes this process started and did not shut down yet: shut down at exit (see the
# module's opening). A fork child runs none of them: it starts with none.
_RUNNING: set = set()


def _after_fork_in_child() -> None:
    # a fork child may still attach a replica its node holds (handed out, no transfer):
    # a parent thread inside an attach at the fork (a user's, a lane's renewal) left the
    # child's copy of the node's attach lock held by a thread it does not have, and every
    # attach and refresh of the child waited the node's timeout, then raised TimeoutError
    for node in _RUNNING:
        node._attaching = ThreadLock()
    _RUNNING.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
# The longest timeout of the nodes this process started: the bound on the wait for
# their threads at exit (every wait of theirs ends within it).
_EXIT_WAIT_S = [0.0]
# The threads of a node (its lanes, service, heartbeat, pair watch, push listeners,
# values poller, gloo waiters and builds) are named so: see _start_thread.
_THREAD_PREFIX = "shared_td-cluster-"


class ClusterMembership:
    """Mixin of Cluster: its lifecycle (it relies on the attributes that
    ``Cluster.__init__`` sets)."""

    def start(self):
        """Join the cluster: claim this node's number (ValueError while another process
        runs as that node; a number whose holder crashed is taken over once its
        heartbeat stood still for LOST_AFTER_S, see
        :func:`~shared_td.coordinator.cluster_liveness.claim_node`), wait (at most
        ``timeout``) for every node's signed join record, refuse with ClusterAuthError
        one signed with another authkey (as soon as it is seen: see the module's
        opening), then start the heartbeat and the service thread. Returns self."""
        if self._store is not None:
            raise RuntimeError("This Cluster is already started.")
        self._started_in = os.getpid()  # a fork child's copy is not this node: see shutdown()
        if isinstance(self._spec, str):
            base, node, nodes = open_store(self._spec, self.node, self.timeout)
            self.node = self.node if self.node is not None else node
            self.nodes = self.nodes if self.nodes is not None else nodes
        else:
            base = self._spec
        check_store(base)
        if self.node is None or self.nodes is None or not 0 <= self.node < self.nodes:
            raise ValueError(f"A cluster needs node= in [0, nodes) and nodes=, got node={self.node}, nodes={self.nodes}.")
        # spares: the first connections of this node's threads (heartbeat, service, pair
        # watch, a lane per peer, the values poller, the sync senders) are made ahead, in the
        # background (a connect can stall 5 s in a reverse DNS lookup, see cluster_store)
        self._store = SignedStore(base, self._authkey, timeout=self.timeout,
                                  spares=4 + (self.nodes - 1) + min(self.nodes - 1, 6))
        try:
            refused = self._records_of_another_key()  # before the claim: see the module's opening
            try:
                self._run = settled_run(self._store, self.node, self.nodes)  # claim tokens are bound to it
            except ClusterAuthError:
                if not refused:
                    raise
                # (another key's run: this process does not join, below)
            self._claim = claim_node(self._store, self.node, self._run)
            if refused:  # the number was free: say so to the nodes that wait, with our own record
                self._store.set_json(f"join/{self.node}", self._join_record())
                raise ClusterAuthError(
                    f"Cluster node {self.node}: the join records of the cluster ({', '.join(refused)}) have a wrong "
                    "signature for this process's cluster authkey, so it uses another key than the nodes that "
                    "joined before it. It did not join. Give every node the same authkey= (or SHARED_TD_CLUSTER_KEY).")
        except BaseException:  # nothing of this node runs yet: no stop request may reach the other
            self._stop.set()
            self._closed = self._left = True
            if self._claim is not None:
                self._release(joined=False)
            self._store.close()
            raise
        try:
            self._join()
        except BaseException:  # refused, or a node did not join: nothing of this node is left running
            self.shutdown()
            raise
        return self

    def _records_of_another_key(self) -> list[str]:
        """The other nodes' join records that exist, when none of them verifies with
        this process's key (they are then another key's, or this process's key is
        another than theirs); [] when one verifies (the others are stale or forged:
        the join checks them) or none exists. ClusterAuthError at once when this node's
        number is held: taking it over would drain the running node's queues and
        overwrite its records."""
        refused = []
        for key in (f"join/{n}" for n in range(self.nodes) if n != self.node):
            if not self._store.has(key):
                continue
            try:
                self._store.get_json(key)
                return []  # one node with our key
            except ClusterAuthError:
                refused.append(key)
        if refused and not claim_free(self._store, self.node, self._store.get_unchecked(f"claim/{self.node}"), None):
            raise ClusterAuthError(
                f"Cluster node {self.node}: the join records of the cluster ({', '.join(refused)}) have a wrong "
                "signature for this process's cluster authkey, so it uses another key than the running nodes. Node "
                f"{self.node}'s number is held: nothing was taken over. Give every node the same authkey= "
                "(or SHARED_TD_CLUSTER_KEY).")
        return refused

    def _join_record(self) -> dict:
        return {"node": self.node, "nodes": self.nodes, "pid": os.getpid(), "host": socket.gethostname()}

    def _join(self) -> None:
        """What :meth:`start` does once this process holds the node's number: join the
        others, then start this node's threads."""
        # a bounded drain (one deadline for all: a queue flooded by anyone reaching the store
        # kept the join here for good, its heartbeat not yet written); what it leaves is
        # read by the lanes as any request (checked: signature, pair generation, replays)
        drained_by = time.monotonic() + self.timeout / 4
        for queue in self._own_queues():  # what waits there was sent to this node's last process
            self._store.drain(queue, drained_by)
        restarted = self._store.has(f"join/{self.node}")  # this node ran before: see PairGroups.move_on
        self._store.set_json(f"join/{self.node}", self._join_record())
        _leave_at_exit_too(self)  # its threads start now: see the module's opening
        # beating from now on: a join that waits long for the others must not look like
        # a crashed node whose number another process may take over
        self._liveness = Liveness(self._store, self.node, self._store.get_json, self._claim, self._stop,
                                  on_confirm=self._give_up_names_taken_over, refuse=self._count_refused, run=self._run,
                                  nodes=self.nodes)
        self._liveness._write_beat(0)  # number 0 (its bytes: what the last one, say_left, expects there)
        self._start_thread(self._liveness.beat, (), "beat")
        self._wait_for_the_others()
        self._groups = PairGroups(self._store, self.node, timeout=self.timeout, hostname=self._hostname,
                                  alive=lambda peer: self._alive(peer),
                                  on_built=lambda peer, generation: listen(self, peer, generation))
        for peer in range(self.nodes) if restarted else ():  # before this process's first request
            if peer != self.node:
                self._groups.move_on(peer)
        self._values = ClusterValues(self._store, self.node, self.nodes, self._stop, self._liveness.still_mine,
                                     self._count_refused)
        #: this node's records of its unreplicated names (see cluster_names)
        self.local_names = LocalNames(self._store, self.node, self.nodes)
        lanes = [(serve_lane, (self, peer), f"lane-{peer}") for peer in range(self.nodes) if peer != self.node]
        for target, args, name in [(serve_notices, (self,), "serve"), (watch_pairs, (self,), "watch"), *lanes]:
            self._start_thread(target, args, name)

    def _wait_for_the_others(self) -> None:
        """Wait (at most ``timeout``) for every other node's join record, checking each
        as it appears: ClusterAuthError for one signed with another authkey, at once,
        and ValueError for one of another cluster size."""
        waiting = {n: f"join/{n}" for n in range(self.nodes) if n != self.node}
        deadline, pause = time.monotonic() + self.timeout, 0.001
        while waiting:
            # read before looking: the look that ends the wait comes after the deadline
            # (a node stopped past it, SIGSTOP, looks once more on resuming: fuzz17)
            late = time.monotonic() > deadline
            for n, key in list(waiting.items()):
                if self._store.has(key):
                    record = self._store.get_json(key)  # ClusterAuthError: another authkey
                    if record["nodes"] != self.nodes:
                        raise ValueError(f"Node {record['node']} joined with nodes={record['nodes']}, "
                                         f"this node has {self.nodes}.")
                    del waiting[n]
            if waiting and late:
                raise TimeoutError(f"Cluster node {self.node}: nodes {', '.join(map(str, waiting))} did not join "
                                   f"within {self.timeout:g} s.")
            if waiting:
                time.sleep(pause)
                pause = min(2 * pause, 0.05)

    def _count_refused(self) -> None:
        """One more forged record or request, never acted on (see ``refused``)."""
        self.refused += 1

    def _start_thread(self, target, args: tuple, name: str) -> None:
        thread = threading.Thread(target=target, args=args, name=f"{_THREAD_PREFIX}{name}", daemon=True)
        thread.start()
        self._threads.append(thread)

    def shutdown(self) -> None:
        """Leave the cluster: stop the threads, abort the gloo groups. Idempotent.
        Replicas already attached stay readable. Node 0 usually hosts the store: the
        others lose it when it leaves. In a fork child of the process that started it,
        only this copy is marked shut down: the node, its threads, its connections and
        its number stay the parent's. A shutdown interrupted (a Ctrl-C) is finished by the
        next call: each step may run again."""
        if self._store is None or self._left:
            return
        self._closed = True
        if os.getpid() != self._started_in:
            self._left = True
            return  # a fork child: a stop notice or a closed pair would end the parent's node
        self._stop.set()
        try:
            # its threads' pops end once the stop notices come: at once from a host that
            # answers; from one that stopped answering, this bounds the close
            self._store.hurry(self.timeout)
            self._leave()
        except BaseException:
            # interrupted (a Ctrl-C): the bound goes (the next call sets its own). Left
            # armed, the pops still in flight (their stop notices never sent) were found
            # overdue one timeout later: the host taken as lost, and every socket of the
            # process to it cut, another node's of this process and the user's included
            self._store.hurry(None)
            raise
        self._left = True
        _RUNNING.discard(self)  # (only now: a close interrupted in its joins is finished at exit)

    def _leave(self) -> None:
        """:meth:`shutdown`'s steps once its store calls are bounded (each may run again)."""
        stop_deliveries(self)  # (their idle waits)
        # a process whose number was taken over leaves the queues and the claim to its successor
        mine = self._liveness is None or self._liveness.taken_over is None
        self._waits.wake_all(self._store, notice=mine)  # the threads waiting for an answer: see AnswerWaits
        try:
            for queue in self._own_queues() if mine else ():
                self._store.push_json(queue, {"op": "stop", "from": self.node})
        except (RuntimeError, OSError):
            pass  # the store is gone; the pops fail by themselves
        listeners = [t for t in self._threads if t.name.startswith(LISTENER)]
        if not mine:  # no stop notice reaches its pops: woken without one (the service's was waited POP_S for)
            wake_pops(self, self._own_queues(), [t for t in self._threads if t not in listeners], 2 * HEARTBEAT_S)
        for thread in self._threads:  # a lane in a transfer ends at its bounded wait (daemon)
            if thread not in listeners and thread.ident is not None:  # (never started: nothing to join)
                thread.join(POP_S if thread.name.endswith("serve") else 2 * HEARTBEAT_S)
        if self._values is not None:
            self._values.join(2 * HEARTBEAT_S)
        self._senders.shutdown(wait=False, cancel_futures=True)
        if mine:  # before the pairs close: a peer whose transfer that cuts finds them at once
            # (Liveness.departed; after the close, it waited 3 s for the "left" beat to
            # stand still, then reported this node lost)
            self._say_left()
            self._release()
        if self._groups is not None:  # None: start() failed before the groups
            self._groups.close()  # closes the pairs: the kept push receives end, the builds too
        for thread in listeners:
            thread.join(2 * HEARTBEAT_S)
        # what the node held goes with it (the users' tensordicts keep their own memory): a
        # Cluster kept alive by anything (a staleness entry did) kept every replica mapped
        self._replicas.clear()
        self._filling.clear()
        self._owned.clear()
        self._store.close()

    def _release(self, joined: bool = True) -> None:
        try:
            release_node(self._store, self.node, self._claim, joined, self._run)
        except (RuntimeError, OSError):
            pass  # the store is gone: nobody joins it again

    def _say_left(self) -> None:
        """The last heartbeat, before the claim is released: this process leaves cleanly
        (see the module's opening; ``Liveness.say_left``: unless a successor's is there)."""
        try:
            if self._liveness is not None:  # (None: start() failed before it beat)
                self._liveness.say_left()
        except (RuntimeError, OSError):
            pass  # the store is gone

    def _give_up_names_taken_over(self) -> None:
        """This process was stopped (or starved) past LOST_AFTER_S and still runs its node:
        the names another node took over meanwhile (``claim_name``) are not this node's
        any more: not synced, not served (a sync of one says who owns it); see
        :func:`~shared_td.coordinator.cluster_owner_keys.give_up_names_taken_over`."""
        give_up_names_taken_over(self)

    def _own_queues(self) -> list[str]:
        """The store queues this node's threads pop: its service queue, a lane per peer."""
        return [f"queue/{self.node}", *(lane_queue(self.node, peer) for peer in range(self.nodes) if peer != self.node)]

    def __enter__(self):
        return self if self._store is not None else self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown()


def settled_run(store, node: int, nodes: int) -> str:
    """The cluster's run for a process starting as node ``node`` of ``nodes``: the run
    record's (:func:`~shared_td.coordinator.cluster_runs.open_run`, set when missing).
    When this process set it (the record was deleted, and no heartbeat wrote it back
    yet) and the other nodes' heartbeats, signed with this process's key, carry another
    run and move (within LOST_AFTER_S + HEARTBEAT_S): theirs, written over the record
    this process set; moving ones of two runs are a genuine split: ValueError naming the
    record's key (and the record this process set emptied again). A record found there
    is the cluster's, never written: recorded heartbeats of an earlier run written back
    by anything that reaches the store made a starting node follow that run and
    overwrite the live record (audit 19, second round). A process that found one of
    another run than the live heartbeats' reads it again until the process that set it
    follows them, or the live nodes replace it (it died first: ``keep_run``, within
    LOST_AFTER_S / 2 + 2 * HEARTBEAT_S more). Heartbeats that stand still (an earlier
    run's), or whose slot shows two runs while watched (a live node's beats and replayed
    ones), are not followed. Free when every heartbeat carries the record's run (the
    usual start).

    Example:
        >>> import datetime
        >>> from torch.distributed import TCPStore
        >>> from shared_td.coordinator.cluster_runs import run_id
        >>> from shared_td.coordinator.cluster_store import SignedStore
        >>> raw = TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=5), wait_for_workers=False)
        >>> store = SignedStore(raw, b"k" * 32, timeout=5.0)
        >>> store.set_json("hb/0", {"beat": 3, "pid": 1, "run": run_id(store)})  # node 0 runs
        >>> settled_run(store, 1, 2) == run_id(store)  # no other run: at once
        True
    """
    (run, mine), key = open_run(store), run_key(store)
    beats = {peer: _beat_run(store, peer) for peer in range(nodes) if peer != node}
    beats = {peer: seen for peer, seen in beats.items() if seen is not None}  # (signed, with a run)
    if all(seen[0] == run for seen in beats.values()):
        return run
    seen_runs = {peer: {seen[0]} for peer, seen in beats.items()}
    live, end = {}, time.monotonic() + LOST_AFTER_S + HEARTBEAT_S
    while len(live) < len(beats) and time.monotonic() < end:  # which of them move (a live node's does)
        time.sleep(HEARTBEAT_S / 4)
        for peer, (_run, blob) in beats.items():
            now = _beat_run(store, peer)
            seen_runs[peer].update([now[0]] if now is not None else [])
            if peer not in live and now is not None and now[1] != blob:
                live[peer] = now[0]
    # a slot showing two runs: a live node's own beats and replayed ones (one process beats one run)
    runs = {seen for peer, seen in live.items() if len(seen_runs[peer]) == 1}
    # (it began first; or it died, and the live nodes replace the record: keep_run, within
    # LOST_AFTER_S + HEARTBEAT_S after their next look, every LOST_AFTER_S / 2)
    while mine is None and runs and run not in runs and time.monotonic() < end + LOST_AFTER_S / 2 + 2 * HEARTBEAT_S:
        time.sleep(HEARTBEAT_S / 4)  # found, never replaced: the process that set it follows the live nodes
        run, mine = open_run(store)
    if mine is None or not runs:  # the record found (replays beside it); or standing still: an earlier run's
        return run
    if len(runs) > 1:
        store.compare_set(key, mine, "")  # (not left as the cluster's: the live nodes write theirs back)
        raise ValueError(
            f"Cluster node {node}: the running nodes belong to two runs ({', '.join(sorted(runs))}: " +
            ", ".join(f"node {peer} {live[peer]}" for peer in sorted(live)) + f"): the run record {key} was "
            "deleted while nodes ran, and a node set a new run meanwhile. This process "
            "did not join. Restart the nodes of one of the runs.")
    return store.check(key, store.compare_set(key, mine, store.sign(key, runs.pop().encode()))).decode()


def _beat_run(store, peer: int) -> tuple[str, bytes] | None:
    """(the run, the stored bytes) of node ``peer``'s heartbeat; None when missing, not
    signed with this process's key, or without a run."""
    blob = store.get_unchecked(f"hb/{peer}")
    try:
        beat = json.loads(store.check(f"hb/{peer}", blob)) if blob else None
    except (ClusterAuthError, ValueError):
        return None
    run = beat.get("run") if isinstance(beat, dict) else None
    return (run, blob) if isinstance(run, str) and run else None


def _leave_at_exit_too(node: ClusterMembership) -> None:
    """Shut ``node`` down at the interpreter's exit unless ``shutdown()`` ran before.
    The hook is moved to the end of the ``atexit`` list at each node's start, so it
    runs before the hooks registered earlier (the Coordinator's, which stops the
    manager that the node's replicas are published on) and after the user's
    registered later (which may still use the node)."""
    _RUNNING.add(node)
    _EXIT_WAIT_S[0] = max(_EXIT_WAIT_S[0], node.timeout)
    atexit.unregister(_leave_at_exit)
    atexit.register(_leave_at_exit)


def _leave_at_exit() -> None:
    """The ``atexit`` hook: shut down the nodes this process still runs, then wait for
    every thread of a node of this process to end (bounded by the longest cluster
    timeout: each of their waits ends within it), also those of a node that another
    hook shut down just before (a Coordinator's). A thread still inside a torch call
    when the interpreter finalizes aborts the process as it comes back (see the
    module's opening)."""
    for node in list(_RUNNING):
        try:
            node.shutdown()
        except Exception:  # noqa: BLE001 - the other nodes are shut down all the same
            _RUNNING.discard(node)
    deadline = time.monotonic() + _EXIT_WAIT_S[0] + 1.0
    me = threading.current_thread()
    for thread in threading.enumerate():
        if thread is not me and thread.daemon and thread.name.startswith(_THREAD_PREFIX):
            thread.join(max(0.0, deadline - time.monotonic()))
