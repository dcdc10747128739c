"""What a node's serving threads read: the signed requests of its queues.

A lane (one per peer) and the service thread each pop one queue of the store
(``cluster_serve``): :func:`signed_requests` yields the requests that verify, counting a
forged one (or another cluster's) in ``Cluster.refused`` and any other error of the
store in ``Cluster.serve_errors`` (the thread pops again, after :data:`ERROR_PAUSE_S`);
:func:`serving` starts a serving loop again after an error that escaped it, so that a
serving thread never ends in silence while its node beats. A request read off the store
and pushed again is caught by a lane's window of the requests it took (:class:`Served`).

Example (a lane's window of its latest requests)::

    >>> served = Served()
    >>> request = {"op": "sync", "caller": "c", "tag": 7, "pair": 0}
    >>> served.first(request), served.first(dict(request)), served.first({"op": "cancel", "tag": 7})
    (True, False, True)
"""
from __future__ import annotations

import collections

from shared_td.coordinator.cluster_store import ClusterAuthError

__all__ = ["ERROR_PAUSE_S", "POP_S", "SERVED_WINDOW", "Served", "served_on", "serving", "signed_requests"]

# How long a lane or the service thread waits in one queue_pop (a stop request wakes it
# earlier; a process whose number was taken over is woken by wake_pops). One long pop,
# not short ones: torch logs two warning lines at each pop that times out.
POP_S = 60.0

#: Seconds a serving thread pauses after an error it serves on: an error that repeats
#: (a store that refuses every pop) does not become a busy loop.
ERROR_PAUSE_S = 0.05


def signed_requests(cluster, queue: str):
    """The signed requests popped from ``queue`` until the cluster stops or the store's
    host is lost; a forged one (or another cluster's) is counted in ``refused``, never
    yielded, and any other error of the store (a ``QueueEmptyError``, a value that does
    not parse) in ``serve_errors``: the thread pops again. One popped after this process
    lost its node number (it was stopped meanwhile, see ``Liveness.still_mine``) goes
    back to the queue, for the process that runs the node now."""
    def ended() -> bool:  # (woken for nothing: a resumed process looks at its number)
        return cluster._stop.is_set() or not cluster._liveness.still_mine()

    while not cluster._stop.is_set():
        try:
            request = cluster._store.pop_json(queue, POP_S, ended)
            if request is not None and not cluster._liveness.still_mine():
                cluster._store.push_json(queue, request)
                return
        except ClusterAuthError:
            cluster.refused += 1
            continue
        except ConnectionError:  # the store's host is lost (see cluster_store._store_call)
            return
        except Exception:  # noqa: BLE001 - the store is there: counted, served on
            if served_on(cluster):
                continue
            return
        if request is not None and not isinstance(request, dict):
            # signed, but not a request (a list, a string): counted, and the thread keeps
            # serving (an AttributeError here ended it while the node kept beating)
            cluster.refused += 1
            continue
        if request is not None and request.get("op") != "stop":
            yield request


def served_on(cluster) -> bool:
    """Count an error a serving thread met (``Cluster.serve_errors``) and pause; False
    when the thread ends instead: the node stops, or the store's host is lost."""
    cluster.serve_errors = getattr(cluster, "serve_errors", 0) + 1
    return not cluster._stop.wait(ERROR_PAUSE_S) and not cluster._store._host_lost


def serving(cluster, serve) -> None:
    """Run ``serve()`` (a loop over :func:`signed_requests`) until it ends as one ends;
    an error that escapes it is counted and ``serve()`` starts again, so that a serving
    thread never ends in silence while its node beats."""
    while True:
        try:
            serve()
            return
        except Exception:  # noqa: BLE001 - served on (see served_on)
            if not served_on(cluster):
                return



#: How many of its latest requests a lane remembers, to refuse them again (:class:`Served`).
SERVED_WINDOW = 4096


class Served:
    """A lane's latest :data:`SERVED_WINDOW` requests, by caller, op, tag and pair (one
    request each). A signed request read off the store and pushed again replayed a sync
    into a live replica (left "being written") or a pull that failed the pair (audit
    22): a repeat is refused and counted. One older than the window is not caught."""

    def __init__(self):
        self._order, self._seen = collections.deque(), set()

    def first(self, request: dict) -> bool:
        if request.get("op") not in ("pull", "push", "sync", "values"):
            return True  # (a cancel is asked again by design, a renew has no tag: neither moves data)
        key = (request.get("caller"), request.get("op"), request["tag"], request.get("pair"))
        if key in self._seen:  # (unhashable: a malformed request, counted by the caller)
            return False
        self._seen.add(key)
        self._order.append(key)
        if len(self._order) > SERVED_WINDOW:
            self._seen.discard(self._order.popleft())
        return True
