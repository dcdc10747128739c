"""The renews of a node's replicas after their owner published the name again.

A renew is an attach of the new generation (a pull from the owner), so it waits for a
peer; made in the lanes (:mod:`~shared_td.coordinator.cluster_serve`), two nodes that
re-published at once each waited out the timeout for the other's lane, busy renewing too.
So a lane only queues it (:func:`renew`) and one thread per node makes the renews, one
after another (:class:`Renewals`).
"""
from __future__ import annotations

import collections
import threading

#: The name of the thread that renews this node's replicas (see :class:`Renewals`).
RENEWER = "shared_td-cluster-renew"


def renew(cluster, name: str, generation: int) -> None:
    """The owner published ``name`` again: have this node's older replica replaced, by
    the node's renew thread (:class:`Renewals`), not in the lane."""
    cluster._announced[name] = max(generation, cluster._announced.get(name, 0))
    have = held(cluster, name)
    if have is None or have.generation >= generation:
        return
    renewals = cluster.__dict__.get("_renewals")
    if renewals is None:  # (setdefault: one per node, also when two lanes get a notice at once)
        renewals = cluster.__dict__.setdefault("_renewals", Renewals(cluster))
    renewals.add(name, generation)


def renew_failure(cluster, name: str, generation: int) -> BaseException | None:
    """Why this node's last renew of its replica of ``name``, which holds ``generation``,
    failed (the error of the renew's attach), if it did and nothing renewed it since."""
    renewals = cluster.__dict__.get("_renewals")
    failed = renewals.failed.get(name) if renewals is not None else None
    return failed[1] if failed is not None and failed[0] > generation else None


def held(cluster, name: str):
    """The replica of ``name`` this node holds, or the one its first attach is filling
    (a notice that came meanwhile renews it once that attach is done: the renew's attach
    waits for it), else None."""
    return cluster._replicas.get(name) or cluster._filling.get(name)


class Renewals:
    """The renews of a node's replicas, one after another, by a thread (:data:`RENEWER`)
    started when one is queued and ended when none waits. It is one of the node's
    (``Cluster._threads``): shutdown waits for it, and its attach is the node's, not the
    user's. A failed renew leaves the old replica (stale), counted in ``renew_failures``,
    its error kept in ``failed`` for the refusals of a pull or push of the old
    generation (:func:`renew_failure`: they said the replica "is being renewed").

    Example (a stand-in for a node: ``attach`` is what a renew calls)::

        >>> import threading, types
        >>> made = []
        >>> node = types.SimpleNamespace(_replicas={"p": types.SimpleNamespace(generation=1)}, _filling={}, _threads=[],
        ...                              _stop=threading.Event(), _closed=False, renew_failures=0,
        ...                              attach=made.append)
        >>> renewals = Renewals(node)
        >>> renewals.add("p", 2)
        >>> renewals.join(5.0)
        >>> made
        ['p']
    """

    def __init__(self, cluster):
        self._cluster = cluster
        self._waiting: collections.deque = collections.deque()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        #: name -> (generation, error) of its last renew that failed
        self.failed: dict[str, tuple[int, BaseException]] = {}

    def add(self, name: str, generation: int) -> None:
        """Queue the renew of ``name`` to ``generation``; returns at once."""
        cluster = self._cluster
        with self._lock:
            self._waiting.append((name, generation))
            if self._thread is not None:
                return  # the running thread takes it
            # the threads of the renews before (ended) leave the node's list
            for ended in [t for t in list(cluster._threads) if t.name == RENEWER and not t.is_alive()]:
                try:
                    cluster._threads.remove(ended)
                except ValueError:
                    pass
            thread = threading.Thread(target=self._run, name=RENEWER, daemon=True)
            cluster._threads.append(thread)  # before it runs: its attach is the node's
            try:
                thread.start()
            except RuntimeError as error:  # "can't start new thread": the renew waits for the next add
                cluster._threads.remove(thread)  # (never started: shutdown cannot join it)
                cluster.renew_failures += 1
                self.failed[name] = (generation, _kept(error))
                return
            self._thread = thread

    def join(self, timeout: float) -> None:
        """Wait (at most ``timeout`` s) for the renews queued so far to end."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)

    def _run(self) -> None:
        cluster = self._cluster
        while True:
            with self._lock:
                if not self._waiting or cluster._stop.is_set():
                    self._waiting.clear()
                    self._thread = None
                    return
                name, generation = self._waiting.popleft()
            have = held(cluster, name)
            if have is None or have.generation >= generation:
                continue  # renewed meanwhile (by an attach, or a notice before), or let go
            try:
                cluster.attach(name)
            except Exception as error:  # noqa: BLE001 - nobody waits for this answer; counted, kept
                if not cluster._closed:
                    cluster.renew_failures += 1
                    self.failed[name] = (generation, _kept(error))


def _kept(error: BaseException) -> BaseException:
    """``error``, to keep in :attr:`Renewals.failed` (its type and text are all that is
    read): without its traceback and chained errors, whose frames held the failed attach's
    locals (the new generation's segment, its mapping and descriptor, as big as the data)
    for as long as the entry stayed."""
    error.__traceback__ = None
    error.__cause__ = error.__context__ = None
    return error
