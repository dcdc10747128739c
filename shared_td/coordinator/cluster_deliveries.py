"""The pulls an owner serves, off its lanes: each waits for its name's deliveries in a
thread of the name's own, never in the lane of the peer that asked.

Why: every delivery of a name (a sync, a pull served) takes the name's lock and the
next version (``cluster_sync.NameSyncs``), so that no sync overtakes a pull. A lane that
waited for that lock stalled on whatever held it: a sync waiting for a slow replica
node held up the puller's later requests of any name, and two owners each syncing its
own name and pulling the other's deadlocked until the timeouts (each lane served a pull
waiting for a lock whose sync waited for the other node's lane; audit of 33f6eb6). So a
lane serves a pull itself only when the name's lock is free at once (the usual case: no
thread hand-off in front of a pull); else the pull joins the name's queue, served in
order by the name's delivery thread (made at the name's first queued pull, gone after
IDLE_S without one, or when the node stops), and the lane serves its next request.

A pull carries the requester's ``budget``: the seconds it still waits for the answer.
The owner serves it only until that time after it was popped (later than the requester
gives up: the request waited in the queue before), never after: a pull whose requester
gave up was served anyway, once the lock came, and its send waited for nobody for the
owner's whole timeout, holding the name's lock (the next sync waited as long). The
requester fails the pair when its wait for the answer ends (``ClusterRequests._answer``),
so that a send the owner posted in that moment ends at once too.

Example (a stand-in for an owner: ``serve`` is called with the lock held)::

    >>> import threading, types
    >>> node = types.SimpleNamespace(timeout=5.0, _stop=threading.Event(), _threads=[],
    ...                              _name_syncs={"p": NameSyncs()})
    >>> served, done = [], threading.Event()
    >>> syncs = node._name_syncs["p"]
    >>> with syncs.lock:                  # a sync under way: queued, the lane goes on
    ...     deliver(node, "p", {"budget": 5.0}, lambda until: (served.append(syncs.lock.locked()), done.set()))
    ...     waiting = list(served)
    >>> done.wait(5.0), waiting, served    # served once the sync was done, the lock held
    (True, [], [True])
    >>> thread = syncs.worker
    >>> node._stop.set(); stop(node); thread.join(5.0); thread.is_alive()
    False
"""
from __future__ import annotations

import collections
import threading
import time

__all__ = ["DELIVERER", "IDLE_S", "NameSyncs", "deliver", "name_syncs", "served_until", "stop"]

#: The start of the name of a thread that serves a name's queued pulls.
DELIVERER = "shared_td-cluster-deliver-"
#: Seconds a delivery thread waits for its name's next queued pull before it ends.
IDLE_S = 60.0
#: The longest a delivery thread waits for its name's lock in one go: it looks at the
#: node's stop between (shutdown joins it within a second).
_SLICE_S = 0.05


def name_syncs(cluster, name: str) -> "NameSyncs":
    """The :class:`NameSyncs` of ``name`` (an owned name), made at its first use."""
    syncs = cluster._name_syncs.get(name)
    if syncs is None:  # (setdefault: one object per name, also when two threads sync a new name at once)
        syncs = cluster._name_syncs.setdefault(name, NameSyncs())
    return syncs


class NameSyncs:
    """What the owner keeps of one name from one sync to the next.

    ``lock`` orders the deliveries of the name: each sync, and each pull it serves (a
    replica's ``pull``, first attach or renew: ``cluster_serve``), takes the next version
    and delivers it before the next one takes its own (two syncs at once both took a
    version, then read ``owned.version`` again for their report and requests: both
    reported, and sent, the later one, and a replica could apply the later request first
    and be left at the earlier version; a pull waits for it off the lanes: :func:`deliver`).
    So a version number counts the deliveries of
    the owner's contents, and each labels one delivery: a pull labelled its contents
    with the last sync's number, and a reader that compared a replica's version before
    and after a read missed the pull that rewrote it under the same number (audit 20). ``holders``: the nodes whose signed ``has/<name>/<node>``
    record a sync of ``generation`` read; within a generation only the node's process
    leaving (or losing its number) takes such a record back, so it is read once per
    generation instead of at every sync (two store round trips per
    replica node, in front of the transfer), except for a node whose heartbeat says it
    left cleanly (the last one its process writes, read anyway to tell a lost node:
    ``Liveness.left``), whose record is read again. A node not among them is looked up
    again by each sync: it may attach meanwhile; a node a sync dropped is taken out of
    them and looked up again (its process may have been restarted without a replica:
    its record then no longer counts)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.generation = 0
        self.holders: set[int] = set()
        # the pulls waiting for ``lock``, served by the name's delivery thread (``worker``),
        # never in a lane (see deliver); ``guard`` orders the two
        self.guard = threading.Lock()
        self.wake = threading.Condition(self.guard)  # a pull queued, or the node stops
        self.pulls: collections.deque = collections.deque()
        self.worker: threading.Thread | None = None


def served_until(cluster, request: dict) -> float:
    """The ``time.monotonic()`` after which ``request`` (a pull, just popped) is not
    served: its ``budget`` from now (the requester gave up by then: it waited in the
    queue before), at most the cluster's timeout."""
    budget = request.get("budget")
    if budget is None:
        budget = cluster.timeout  # (a request without one: the owner's timeout, as before)
    elif not isinstance(budget, (int, float)) or isinstance(budget, bool) or not budget >= 0:
        budget = 0.0  # (negative, NaN, not a number: never served)
    return time.monotonic() + min(float(budget), cluster.timeout)


#: seconds a pull's requester must still wait for the owner to start serving it: a send
#: started with less is all but sure to time out, and a failed send fails the whole pair
#: (every transfer between the two nodes), so such a pull is dropped instead
SERVE_FLOOR_S = 0.25


def deliver(cluster, name: str, request: dict, serve) -> None:
    """Have ``serve(until)`` called with ``name``'s delivery lock held, ``until`` the
    request's :func:`served_until`: in this thread when the lock is free now and no pull
    of the name waits before it, else by the name's delivery thread, in order; never once
    ``until`` passed (the lock still held elsewhere: not served, not answered)."""
    until = served_until(cluster, request)
    if until - time.monotonic() < SERVE_FLOOR_S:  # its requester gives up before a send could end
        return
    syncs = name_syncs(cluster, name)
    with syncs.guard:
        now = not syncs.pulls and syncs.lock.acquire(blocking=False)
        if not now:
            syncs.pulls.append((until, serve))
            if syncs.worker is None:
                syncs.worker = _start(cluster, name, syncs)
            else:
                syncs.wake.notify()
    if now:
        try:
            serve(until)
        finally:
            syncs.lock.release()


def stop(cluster) -> None:
    """Wake every delivery thread of ``cluster``, which stops (shutdown: its ``_stop`` is set)."""
    for syncs in list(cluster._name_syncs.values()):
        with syncs.guard:
            syncs.wake.notify_all()


def _start(cluster, name: str, syncs: NameSyncs) -> threading.Thread:
    # the delivery threads of the names before, ended, leave the node's list (shutdown
    # joins the others)
    for ended in [t for t in list(cluster._threads) if t.name.startswith(DELIVERER) and not t.is_alive()]:
        try:
            cluster._threads.remove(ended)
        except ValueError:
            pass  # another name's start removed it meanwhile
    thread = threading.Thread(target=_serve_queued, args=(cluster, syncs), daemon=True,
                              name=f"{DELIVERER}{name[:40]}/pulls")  # (a name may end as a lane's)
    cluster._threads.append(thread)
    thread.start()
    return thread


def _serve_queued(cluster, syncs: NameSyncs) -> None:
    """The name's delivery thread: its queued pulls, in order, each once the name's lock
    is free and while its requester may still wait. It stays for the name's next pulls
    until IDLE_S pass without one: a thread's first store call takes a store connection
    (a new one can stall seconds in a reverse DNS lookup), and a thread per busy spell
    used up the spares (a 1 s stall in every crossing loop, measured)."""
    store = getattr(cluster, "_store", None)
    if store is not None:
        try:
            store.connect(spare_only=True)  # (see cluster_serve._connect)
        except (RuntimeError, OSError):
            pass  # the store is gone: the answers fail, as every thread's calls
    while True:
        with syncs.guard:
            idle_until = time.monotonic() + IDLE_S
            while not syncs.pulls and not cluster._stop.is_set() and time.monotonic() < idle_until:
                syncs.wake.wait(max(0.0, idle_until - time.monotonic()))
            if not syncs.pulls or cluster._stop.is_set():
                syncs.pulls.clear()
                syncs.worker = None
                return
            until, serve = syncs.pulls[0]
        locked = _acquire(cluster, syncs.lock, until)
        with syncs.guard:
            syncs.pulls.popleft()
        if not locked:
            continue  # its requester gave up: not served (its send would wait for nobody)
        try:
            serve(until)
        except Exception:  # noqa: BLE001 - serve answers what it can; the next pull is served
            cluster.serve_errors = getattr(cluster, "serve_errors", 0) + 1
        finally:
            syncs.lock.release()


def _acquire(cluster, lock: threading.Lock, until: float) -> bool:
    """``lock``, waited for until SERVE_FLOOR_S before ``until`` (False then, or once the
    node stops)."""
    while not cluster._stop.is_set():
        left = until - SERVE_FLOOR_S - time.monotonic()
        if left <= 0:
            return False
        if lock.acquire(timeout=min(left, _SLICE_S)):
            return True
    return False
