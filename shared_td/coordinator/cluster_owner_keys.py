"""This node's ``owner/<name>`` keys kept, off the heartbeat thread.

Two looks, each run by a thread that may wait on the store, never the heartbeat's:

* :class:`OwnerKeys`, the watch thread's (``cluster_serve.watch_pairs``): every
  :data:`KEEP_EVERY_S` it asks whether every owned name's key is there, in one round
  trip (:func:`~shared_td.coordinator.cluster_owners.owner_keys_there`), and only when
  one is missing looks name by name, in chunks of :data:`CHUNK` (one round trip each
  again), within :data:`KEEP_BUDGET_S` a round: the rest waits for the next round. A
  deleted key is written back (counted in ``refused``): another node's publish reads a
  missing key as free once the recorded owner is lost (see
  :func:`~shared_td.coordinator.cluster_owners.claim_name`).
* :func:`give_up_names_taken_over`, the ``on_confirm`` of the node's
  :class:`~shared_td.coordinator.cluster_liveness.Liveness`: after a pause past
  LOST_AFTER_S, the names another node took over meanwhile are given up (a round trip
  per name, in the first thread that asks ``still_mine`` after the pause).

Before, both ran in the heartbeat thread, every third beat: with many names on a slow
store the beats stood still past LOST_AFTER_S and another node took the live owner's
names over (audit 22). A name given up is one whose entry is still the one looked at:
a publish of it meanwhile (which claims it again) keeps its new entry (before, the
give-up removed it, and the node served and synced a name it owned no longer knowing
it).

Example (the chunks a round looks at, in turn)::

    >>> list(_chunks(["a", "b", "c"], 2))
    [['a', 'b'], ['c']]
"""
from __future__ import annotations

import time

from shared_td.coordinator.cluster_generations import publish_lock
from shared_td.coordinator.cluster_liveness import HEARTBEAT_S, LOST_AFTER_S
from shared_td.coordinator.cluster_owners import keep_owner_key, names_taken_over, owner_keys_there

__all__ = ["CHUNK", "KEEP_BUDGET_S", "KEEP_EVERY_S", "OwnerKeys", "give_up_names_taken_over"]

#: Seconds between two looks of the watch thread at the owner keys (as the claim's, every
#: third heartbeat: see ``Liveness.beat``).
KEEP_EVERY_S = LOST_AFTER_S / 2
#: The longest a look spends on keys name by name (the watch thread's other work, closing
#: the pairs of lost peers, waits meanwhile): the rest is looked at in the next round.
KEEP_BUDGET_S = HEARTBEAT_S / 4
#: Names whose keys one round trip checks at once while a missing one is looked for.
CHUNK = 64


def _chunks(names: list[str], size: int):
    return (names[i:i + size] for i in range(0, len(names), size))


class OwnerKeys:
    """The watch thread's keeping of ``cluster``'s owner keys (see the module's opening)."""

    def __init__(self, cluster):
        self._cluster = cluster
        self._due = time.monotonic() + KEEP_EVERY_S
        self._left: list[str] = []  # names of a round that found a key missing, not looked at yet

    def keep(self) -> None:
        """One round when it is due (else nothing): a round trip while every key is
        there. Raises what a store call raises (the store is gone)."""
        cluster, now = self._cluster, time.monotonic()
        if now < self._due:
            return
        self._due, until = now + KEEP_EVERY_S, now + KEEP_BUDGET_S
        if not cluster._liveness.still_mine():
            return  # the number was taken over: the keys are the successor's
        if not self._left:
            names = list(cluster._owned)
            if owner_keys_there(cluster._store, names):
                return
            self._left = names  # one is missing: looked for chunk by chunk
        while self._left and time.monotonic() < until:
            chunk, self._left = self._left[:CHUNK], self._left[CHUNK:]
            if owner_keys_there(cluster._store, chunk):
                continue
            for i, name in enumerate(chunk):
                if time.monotonic() >= until:
                    self._left[:0] = chunk[i:]  # the next round goes on from here
                    return
                if name in cluster._owned:  # (not given up meanwhile)
                    keep_owner_key(cluster._store, cluster.node, name, cluster._count_refused, cluster._run)


def give_up_names_taken_over(cluster) -> None:
    """``cluster``'s process was stopped (or starved) past LOST_AFTER_S and still runs
    its node: the names another node took over meanwhile (``claim_name``) are not this
    node's any more: not synced, not served (a sync of one says who owns it). Each is
    given up under its publish lock, and only when its entry is still the one looked at:
    a publish of the name meanwhile claimed it again."""
    looked = dict(cluster._owned)
    for name, holder in names_taken_over(cluster._store, cluster.node, list(looked), cluster._count_refused,
                                          cluster._run).items():
        with publish_lock(cluster, name):
            if cluster._owned.get(name) is looked[name]:
                del cluster._owned[name]
                cluster._taken_names[name] = holder
