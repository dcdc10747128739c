"""The pulls an owner serves, off its lanes: each waits for its name's deliveries in one
of a few delivery threads of the node, never in the lane of the peer that asked.

Why: every delivery of a name (a sync, a pull served) takes the name's lock and the
next version (``cluster_sync.NameSyncs``), so that no sync overtakes a pull. A lane that
waited for that lock stalled on whatever held it: a sync waiting for a slow replica
node held up the puller's later requests of any name, and two owners each syncing its
own name and pulling the other's deadlocked until the timeouts (each lane served a pull
waiting for a lock whose sync waited for the other node's lane; audit of 33f6eb6). So a
lane serves a pull itself only when the name's lock is free at once (the usual case: no
thread hand-off in front of a pull); else the pull joins the name's queue, and the name
joins the node's queue of names with pulls waiting, taken by at most MAX_DELIVERERS
waiting threads shared by all names (made when a name is queued and none is idle, gone
after IDLE_S without work, or when the node stops; a thread that serves a pull, its
send, leaves that count meanwhile: see _Deliverers). A name is served by one thread at a time,
its pulls in order, one by one; a thread waits for a name's lock in slices and, while
other names wait, passes to the next between slices (a name whose sync is slow does not
hold up the pulls of other names). Before, each contended name had a thread of its own,
kept 60 s: a node serving pulls of 150 names, each during a sync of it, held 26 threads.

A pull carries the requester's ``budget``: the seconds it still waits for the answer.
The owner serves it only until that time after it was popped (later than the requester
gives up: the request waited in the queue before), never after: a pull whose requester
gave up was served anyway, once the lock came, and its send waited for nobody for the
owner's whole timeout, holding the name's lock (the next sync waited as long). A
requester that gives up asks the owner to :func:`cancel` the pull and receives what the
owner announced before (``cluster_drain``): a gloo send never waits out its bound, which
closes the pair (every transfer between the two nodes failed).

Example (a stand-in for an owner: ``serve`` is called with the lock held)::

    >>> import threading, types
    >>> node = types.SimpleNamespace(timeout=5.0, _stop=threading.Event(), _threads=[],
    ...                              _name_syncs={"p": NameSyncs()})
    >>> served, done = [], threading.Event()
    >>> syncs = node._name_syncs["p"]
    >>> held, ended = threading.Event(), threading.Event()
    >>> def a_sync():                     # a sync under way (on its caller's thread)
    ...     with syncs.lock:
    ...         held.set(); ended.wait(5.0)
    >>> sync = threading.Thread(target=a_sync); sync.start(); _ = held.wait(5.0)
    >>> deliver(node, "p", {"budget": 5.0}, lambda until: (served.append(syncs.lock.locked()), done.set()))
    >>> waiting = list(served); ended.set()  # queued, the lane went on; the sync ends
    >>> done.wait(5.0), waiting, served    # served once the sync was done, the lock held
    (True, [], [True])
    >>> threads = list(node._threads)
    >>> node._stop.set(); stop(node); [t.join(5.0) for t in threads] and any(t.is_alive() for t in threads)
    False
"""
from __future__ import annotations

import collections
import threading
import time

from shared_td.platform import ThreadLock

__all__ = ["DELIVERER", "IDLE_S", "MAX_DELIVERERS", "NameSyncs", "cancel", "deliver", "name_syncs", "served_until",
           "stop"]

#: The start of the name of a thread that serves queued pulls.
DELIVERER = "shared_td-cluster-deliver-"
#: The most delivery threads of a node that wait at once (for a name, or a name's lock),
#: whatever the number of names with pulls waiting (those that send a pull do not count:
#: see _Deliverers): each waits for one name's lock, and a handful covers the names whose
#: deliveries overlap in practice (each thread costs a store connection and a stack; a
#: thread per name made 26 for 150 names). More names wait their turn in order: a
#: thread passes to the next name between lock waits of _SLICE_S.
MAX_DELIVERERS = 4
#: Seconds a delivery thread waits for the next queued pull before it ends: long enough
#: to serve a busy spell's pulls in one thread (its first store call takes a store
#: connection, and a thread per spell used up the spares: a 1 s stall in every crossing
#: loop, measured), short enough that a node that served a burst drops its threads soon.
IDLE_S = 2.0
#: The longest a delivery thread waits for a name's lock in one go: it looks at the
#: node's stop and at the other names waiting between (shutdown joins it within a second).
_SLICE_S = 0.05
# makes each node's _Deliverers once (two lanes may queue the first pulls at once)
_MADE = threading.Lock()


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
        self.lock = ThreadLock()
        self.generation = 0
        self.holders: set[int] = set()
        # the pulls waiting for ``lock``, [until, serve, key, cancelled] in order, served by the node's
        # delivery threads, never in a lane (see deliver); ``queued``: the name is in the
        # node's queue or a thread serves it (one at a time). Both under the node's
        # ``_Deliverers.ready`` lock.
        self.pulls: collections.deque = collections.deque()
        self.queued = False


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
    of the name waits before it, else by a delivery thread, in order; never once
    ``until`` passed (the lock still held elsewhere: not served, not answered).
    RuntimeError, nothing queued, when no delivery thread runs and none can be started
    (the lane answers it: a refusal)."""
    until = served_until(cluster, request)
    if until - time.monotonic() < SERVE_FLOOR_S:  # its requester gives up before a send could end
        return
    syncs = name_syncs(cluster, name)
    pool = _deliverers(cluster)
    with pool.ready:
        now = not syncs.pulls and syncs.lock.acquire(blocking=False)
        if not now:
            syncs.pulls.append([until, serve, _key(request), False])  # (False: not cancelled)
            if not syncs.queued:
                syncs.queued = True
                pool.names.append(syncs)
                if not pool.want() and not pool.threads and not pool.serving:
                    # no thread runs to take it (none could be started: the thread limit):
                    # not queued, so that the name's next pulls are not stuck behind it, and
                    # refused in the lane (answered: the requester does not wait in vain)
                    pool.names.remove(syncs)
                    syncs.pulls.clear()
                    syncs.queued = False
                    raise RuntimeError(f"No delivery thread could be started for {name!r} (the thread limit?).")
    if now:
        try:
            serve(until)
        finally:
            syncs.lock.release()


def stop(cluster) -> None:
    """Wake every delivery thread of ``cluster``, which stops (shutdown: its ``_stop`` is set)."""
    pool = getattr(cluster, "_deliverers", None)
    if pool is not None:
        with pool.ready:
            pool.ready.notify_all()


def cancel(cluster, name: str, request: dict) -> str:
    """A requester gave up pull ``request`` (its ``tag``, from its ``caller``; popped in
    its lane after the pull, so the pull was served there, dropped or queued here):
    "dropped" when it waits in ``name``'s queue (never served now), "serving" when a
    delivery thread serves it (its answer comes: the requester's drain receives what it
    announces, see ``cluster_drain``), else "none" (an answer it got came before this one)."""
    pool, syncs = getattr(cluster, "_deliverers", None), cluster._name_syncs.get(name)
    if pool is None or syncs is None:
        return "none"
    key = _key(request)
    with pool.ready:
        if key in pool.serving:
            return "serving"
        for entry in syncs.pulls:
            if entry[2] == key and not entry[3]:
                entry[3] = True  # (left queued: the thread waiting for it takes it out)
                return "dropped"
    return "none"


def _key(request: dict) -> tuple:
    return request.get("from"), request.get("caller"), request.get("tag")


def _deliverers(cluster) -> "_Deliverers":
    pool = getattr(cluster, "_deliverers", None)
    if pool is None:
        with _MADE:
            pool = getattr(cluster, "_deliverers", None)
            if pool is None:
                pool = cluster._deliverers = _Deliverers(cluster)
    return pool


class _Deliverers:
    """A node's delivery threads: ``names``, the names with pulls waiting and no thread
    on them, in the order they came; ``ready`` (a condition) guards them, each name's
    ``pulls`` and ``queued``, and the counts.

    Only the threads that wait (for a name, or for a name's lock) count toward
    MAX_DELIVERERS (``threads``): one that got a name's lock and serves its pull (a
    send, bounded by the owner's timeout plus its bytes) leaves the count while it
    serves, and another thread takes the names still waiting. Before, the cap counted
    the threads that sent too: four slow sends held every thread, and a pull of any
    other name was not served at all although its lock was free (audit of b7822d2).
    A thread is started only while fewer than MAX_DELIVERERS count, when a name is
    queued, or when the last thread counted starts serving while names wait (then
    one: those waiting always have a thread, which passes between them; more are
    started as more names come; starting one at every serve made a thread per pull
    served, each ending when it came back to a full count). So a node runs at most
    MAX_DELIVERERS threads plus one per name whose pull it sends (one delivery of a
    name at a time: as many as the names with a thread each before); a thread done
    serving goes back to the names while fewer than MAX_DELIVERERS count, else it
    ends."""

    def __init__(self, cluster):
        self.cluster = cluster
        self.ready = threading.Condition(threading.Lock())
        self.names: collections.deque = collections.deque()
        self.threads = 0  # alive and not serving a pull (waiting for a name or a name's lock)
        self.idle = 0  # waiting in ``ready`` for a name
        self.made = 0  # (numbers the threads' names)
        self.serving: set[tuple] = set()  # the keys of the pulls a thread serves now (see cancel)

    def want(self) -> bool:
        """A name was queued, or a thread left the count to serve (``ready`` held):
        wake an idle thread, or start one while fewer than MAX_DELIVERERS count and the
        names waiting outnumber the idle ones. False when a start failed ("can't start
        new thread": nothing was counted or registered, the caller decides)."""
        if self.idle:
            self.ready.notify()
        if len(self.names) <= self.idle or self.threads >= MAX_DELIVERERS:
            return True
        cluster = self.cluster
        # the delivery threads ended before leave the node's list (shutdown joins the others)
        for ended in [t for t in list(cluster._threads) if t.name.startswith(DELIVERER) and t.ident is not None
                      and not t.is_alive()]:
            try:
                cluster._threads.remove(ended)
            except ValueError:
                pass  # another start removed it meanwhile
        self.made += 1
        thread = threading.Thread(target=self._run, daemon=True,
                                  name=f"{DELIVERER}{getattr(cluster, 'node', '')}/{self.made}")
        try:  # started first, then counted and registered (it takes ``ready``, held here, before any count)
            thread.start()
        except RuntimeError:  # the thread limit: counted in nothing, never joined by shutdown
            return False
        self.threads += 1
        cluster._threads.append(thread)
        return True

    def _next(self):
        """The next name to serve (taken out of ``names``), None when the thread ends:
        the node stops, or IDLE_S passed without a name."""
        cluster = self.cluster
        with self.ready:
            idle_until = time.monotonic() + IDLE_S
            while not self.names and not cluster._stop.is_set() and time.monotonic() < idle_until:
                self.idle += 1
                try:
                    self.ready.wait(max(0.0, idle_until - time.monotonic()))
                finally:
                    self.idle -= 1
            if cluster._stop.is_set() or not self.names:
                self.threads -= 1
                if cluster._stop.is_set():  # (not served: the node stops)
                    for syncs in self.names:
                        syncs.pulls.clear()
                        syncs.queued = False
                    self.names.clear()
                return None
            return self.names.popleft()

    def _run(self) -> None:
        """A delivery thread: the waiting names in turn, each name's pulls in order, each
        once the name's lock is free and while its requester may still wait."""
        cluster = self.cluster
        store = getattr(cluster, "_store", None)
        if store is not None:
            try:
                store.connect(spare_only=True)  # (see cluster_serve._connect)
            except (RuntimeError, OSError):
                pass  # the store is gone: the answers fail, as every thread's calls
        while True:
            syncs = self._next()
            if syncs is None:
                return
            with self.ready:
                entry = syncs.pulls[0]  # (left queued while waited for: no later pull overtakes it)
            until, serve, key, _ = entry
            locked = False if entry[3] else _acquire(cluster, syncs.lock, until, lambda: bool(self.names))
            if locked is not None:
                with self.ready:
                    syncs.pulls.popleft()  # served now, or its requester gave up (not served)
                    if locked and entry[3]:  # cancelled while the lock came
                        syncs.lock.release()
                        locked = False
                    elif locked:
                        self.serving.add(key)
                        self.threads -= 1  # serving: out of the count
                        if self.names and not self.threads:  # nobody left for the names waiting: one more
                            self.want()  # (a failed start: the names wait for this thread's return)
            back = True
            if locked:
                try:
                    serve(until)
                except Exception:  # noqa: BLE001 - serve answers what it can; the next pull is served
                    cluster.serve_errors = getattr(cluster, "serve_errors", 0) + 1
                finally:
                    syncs.lock.release()
                    with self.ready:
                        self.serving.discard(key)
                        back = self.threads < MAX_DELIVERERS
                        if back:
                            self.threads += 1  # (_next takes it off when the thread ends)
            with self.ready:  # its next pull after the names that waited meanwhile
                if syncs.pulls and not cluster._stop.is_set():
                    self.names.append(syncs)
                    if not back:
                        self.want()  # (the threads counted take it: wakes an idle one)
                else:
                    syncs.pulls.clear()  # (the node stops: not served)
                    syncs.queued = False
            if not back:
                return  # MAX_DELIVERERS others wait already


def _acquire(cluster, lock: ThreadLock, until: float, others) -> bool | None:
    """``lock``, waited for until SERVE_FLOOR_S before ``until`` (False then, or once the
    node stops); None after a slice of _SLICE_S while ``others()`` says that other names
    wait (the caller serves them first, then comes back)."""
    while not cluster._stop.is_set():
        left = until - SERVE_FLOOR_S - time.monotonic()
        if left <= 0:
            return False
        if lock.acquire(timeout=min(left, _SLICE_S)):
            return True
        if others():
            return None
    return False
