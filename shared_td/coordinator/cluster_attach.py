"""Attaching a name of another node: the replica that :meth:`Cluster.attach
<shared_td.coordinator.cluster.Cluster.attach>` makes, fills and hands out, kept apart
from the rest of the node's calls (:mod:`~shared_td.coordinator.cluster`) so that each
reads on its own.

An attach reads the name's signed record, builds an empty replica of its layout in a
new anonymous segment (:mod:`~shared_td.coordinator.cluster_layout`), fills it with one
pull (``Cluster._fill``) *aside*, and registers it only once it is filled and published
on the node's Coordinator: a push or a sync meanwhile sees the old replica, or none. An
attach that a new publish of the name overtakes is made again for the new generation,
:data:`ATTACH_TRIES` times in all. A replica made on the owner's renew notice (a thread
of the node, not the user) keeps the user's pushes refused until the user attaches the
new generation (``Replica.renewed_from``).

Example (the mixin's one constant)::

    >>> ATTACH_TRIES
    3
"""
from __future__ import annotations

import threading
import time

from shared_td.coordinator import cluster_generations as generations
from shared_td.coordinator import cluster_layout, cluster_push
from shared_td.coordinator import cluster_replica as replica
from shared_td.coordinator import staleness
from shared_td.coordinator.cluster_replica import Replica
from shared_td.coordinator.cluster_store import ClusterAuthError

__all__ = ["ATTACH_TRIES", "ClusterAttach"]

#: Times an attach is made in all while its owner publishes the name again (each time,
#: the generation it began with is gone; the newer one is what the caller wants).
ATTACH_TRIES = 3


class ClusterAttach:
    """Mixin of Cluster: :meth:`attach` and the making of a replica (it relies on
    ``node``, ``timeout``, ``_owned``, ``_replicas``, ``_filling``, ``_attaching``,
    ``_values``, ``_store``, ``_threads``, ``_checked``, ``_as_node``, ``_info``, ``_fill``,
    ``_memmap_here`` and ``_request``/``_answer`` of
    :class:`~shared_td.coordinator.cluster_requests.ClusterRequests`)."""

    def attach(self, name: str):
        """The tensordict of ``name`` on this node: the owner's own, or this node's
        replica (made on first attach and filled with one transfer).

        A replica is remembered for :func:`shared_td.is_stale` and
        :func:`shared_td.refresh`: it is stale once the owner published ``name`` again,
        and ``refresh`` attaches the new generation (one full transfer). When the owner
        publishes again, a node that holds a replica makes the new one by itself (on the
        owner's notice, in a thread of its own) and publishes it on its
        Coordinator, so that the views of the node's other processes turn stale and their
        ``refresh`` finds the new generation. An attach that the owner's new publish
        overtakes (the generation it began with is gone) is made again for the new one,
        :data:`ATTACH_TRIES` times in all. A name this node owned in a previous process
        (it ended, and nothing published it again) is a KeyError saying so, at once."""
        if name in self._owned:
            return self._owned[name].td
        cluster_push.check_name(name)  # a replica of it could never push
        self._attaching.refuse_reentry(f"attach({name!r})")
        try:
            if not self._attaching.acquire(timeout=self.timeout):
                raise TimeoutError(f"Another attach on this node did not end within {self.timeout:g} s.")
            for tries_left in reversed(range(ATTACH_TRIES)):
                td = self._attach(name, last_try=not tries_left)
                if td is not None:
                    return td
        finally:
            try:
                self._attaching.release()
            except RuntimeError:
                pass  # not taken: timed out, or interrupted before acquire returned (platform.ThreadLock)

    def _attach(self, name: str, last_try: bool):
        """``attach``'s work, once; None when the owner published ``name`` again
        meanwhile (unless ``last_try``): its pull of this generation was refused, or the
        generation's value records were deleted."""
        have = self._replicas.get(name)
        try:
            info = self._info(name)
        except ConnectionError:
            if have is None:
                raise
            # the store host is lost: this node's replica stays readable (and no newer
            # generation can be published without the store)
            return self._handed(have)
        if generations.same(have, info["generation"], info.get("digest")):
            return self._handed(have)
        if info["owner"] == self.node:  # (a name this process owns was returned by attach)
            # its request would wait in this node's own lane, which no thread serves, for
            # the whole timeout, and leave it there with a has/ record
            raise KeyError(f"{name!r} is owned by this node (node {self.node}), but by its previous process, "
                           "which ended: this process holds no data of it. Publish it again on this node "
                           "(its replicas on the other nodes then renew).")
        try:
            return self._attach_generation(name, info, have)
        except RuntimeError as err:
            if not self._published_since(name, info["generation"], err):
                raise
            if not last_try:  # overtaken: the caller attaches the new generation, once the store names it
                generations.wait_named(self, name, getattr(err, "current", None))
                return None
            raise RuntimeError(f"attach({name!r}): {name!r} was published again {ATTACH_TRIES} times while this "
                               f"node attached it ({err}). Attach it again.") from err

    def _published_since(self, name: str, generation: int, err: BaseException | None = None) -> bool:
        if (getattr(err, "current", None) or 0) > generation:  # the owner's refusal said so (cluster_serve.refusal)
            return True
        try:
            return self._info(name)["generation"] > generation
        except Exception:  # noqa: BLE001 - cannot tell: the attach's own error is raised
            return False

    def _attach_generation(self, name: str, info: dict, have: Replica | None):
        self._as_node(f"attach({name!r})")  # (a replica this node holds already is handed out in a fork child too)
        layout, generation = info["layout"], info["generation"]
        latest = self._values.latest(name, generation, len(layout.get("values", ())), info.get("digest", ""))
        if None in latest:  # a value's stored record is forged (counted): its owner stores it again
            latest = self._restored_values(info["owner"], name, generation, len(latest))
        segment = replica.new_segment(layout["nbytes"])
        td = cluster_layout.rebuild(name, layout, [value for _version, value in latest], segment)
        # made on the owner's renew notice (a thread of the node), not by the user: the user's
        # rows are in views of the old generation (see Replica.renewed_from), or of an
        # older one still if the user attached none of those renewed since
        renewed_from = (have.renewed_from or have.generation) if have is not None and self._serving() else 0
        rep = Replica(td, segment, layout, info["owner"], generation, renewed_from=renewed_from,
                      digest=info.get("digest", ""))
        replica.record_replica(self, self._checked(), name, generation, rep.digest)  # (with this process's claim)
        # filled aside and registered only once filled and published: registered first, a
        # push during the transfer read its zeros (state 0) and the owner, whose
        # generation they matched, wrote them into its new data. Until then pushes,
        # pulls and version() see the old replica (its pushes refused as stale) or none.
        self._filling[name] = rep
        try:
            self._fill(name, rep)  # a failure leaves the old replica (if any) as it was
            rep.td = td = self._memmap_here(name, td, bool(latest))
            self._replicas[name] = rep
        except BaseException:
            # the record names the generation this attach did not get: it would draw every
            # sync of it (refused here, each one failing the pair): back to what is held
            try:
                if have is None:
                    replica.forget_replica(self, self._store, name)
                else:
                    replica.record_replica(self, self._store, name, have.generation, have.digest)
            except (RuntimeError, OSError):
                pass  # the store is gone: no sync to draw
            raise
        finally:
            if self._filling.get(name) is rep:
                del self._filling[name]
        self._values.attach(name, generation, cluster_layout.value_cells(td, layout), [v for v, _value in latest],
                            rep.digest)
        staleness.remember(td, name, (generation, rep.digest), {"table": None, "slot": None},
                           generations.Endpoint(self))
        return td

    def _handed(self, rep: Replica):
        """``rep.td``, returned by attach: a call of the user's has now been given the
        renewed generation, so its pushes go again (see Replica.renewed_from)."""
        if rep.renewed_from and not self._serving():
            rep.renewed_from = 0
        return rep.td

    def _serving(self) -> bool:
        """Whether this thread is one of this node's own (``_threads``: the one that
        renews a replica on its owner's notice), not a call of the user."""
        return threading.current_thread() in self._threads

    def _receiving(self, name: str, generation: int, digest: str | None) -> Replica | None:
        """The replica a sync of ``name`` at ``generation`` is received into: the one an
        attach is filling when it is of that generation (the sync then waits for its
        lock, as it did when the replica was registered before its fill), else the one
        registered."""
        filling = self._filling.get(name)
        if generations.same(filling, generation, digest):
            return filling
        return self._replicas.get(name)

    def _role(self, peer: int, name: str) -> str:
        # an owner lost during the first attach's fill is "the owner" (not yet registered)
        filling = self._filling.get(name)
        if filling is not None and filling.owner == peer:
            return "the owner"
        return super()._role(peer, name)

    def _restored_values(self, owner: int, name: str, generation: int, count: int) -> list:
        """The ``count`` values of ``name`` once its owner stored again, signed, those
        whose record has a wrong signature (``ClusterValues.restore``, asked in the
        owner's lane): a forged record carries nothing usable, and the values of a
        replica can only come from the store, so the owner's current value replaces it,
        as the next write of any node would. ClusterAuthError naming the records still
        forged after that (something keeps writing them); OwnerLostError if the owner is
        lost."""
        tag, _pair = self._request(owner, "values", name, generation)
        self._answer(owner, tag, time.monotonic() + self.timeout, name)
        latest = self._values.latest(name, generation, count)
        forged = [f"value/{name}/{generation}/{index}" for index, value in enumerate(latest) if value is None]
        if forged:
            raise ClusterAuthError(
                f"attach({name!r}): the stored records {', '.join(forged)} have a wrong signature again after "
                f"their owner, node {owner}, stored them anew: something other than a node of this cluster keeps "
                "writing them. Nothing of them was used (counted in refused). Run the cluster on a private network.")
        return latest
