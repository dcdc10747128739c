"""Cluster-wide non-tensor values: the ``share_non_tensor=True`` entries of a replicated name.

On one node, a ``NonTensorData`` memory-mapped with ``share_non_tensor=True`` keeps its
value in a shared cell (:class:`~shared_td.storage.shared_value.SharedValue`): a write by
any process is seen by every other, and an unchanged value reads with one 8-byte load.
Across nodes, each node keeps its own cell per value, and this module keeps the cells of
all nodes equal:

* **Versions.** Every value ``i`` of generation ``g`` of a name has a signed record
  ``value/<name>/<g>/<i>`` in the store, its latest value and version: a node that
  publishes a value writes the record's version + 1 by a compare-and-set against the
  bytes it read (two round trips), so versions are totally ordered across the cluster.
  Every node applies a value only if its version is above the last one it applied:
  **the highest version wins** (the last writer in store order), and every node converges
  to it whatever the order in which notices arrive. (An unsigned ``add`` counter took the
  versions before: set back by anything reaching the store, every later write was
  dropped by the other nodes as old.) Records and notices carry the publish's digest
  (:mod:`~shared_td.coordinator.cluster_generations`): those of another publish under a
  reused number are never applied, read or overwritten by a replica.
* **Local writes.** One thread per node (started with the first value it tracks) looks at
  each cell's version word every :data:`POLL_S` (one 8-byte load per value: the same read
  as an unchanged ``get``). A changed word means a process of this node wrote the value:
  the thread stores the value as the latest under the next version (above) and pushes
  a notice carrying the value to every other node's request queue.
* **Remote writes.** The node's service thread pops a notice, and :meth:`ClusterValues.receive`
  writes the value into the local cell if its version is the highest seen. Readers of the
  node then see it at their next read; a value that did not change is never fetched
  again: reads stay local.
* **Security.** Values are pickles, so they are only unpickled after the HMAC of the
  notice (or of the stored latest value) was checked with the cluster authkey
  (:class:`~shared_td.coordinator.cluster_store.SignedStore`); a wrong signature is
  refused with :class:`~shared_td.errors.ClusterAuthError` before any byte is parsed.
  A signed value can be replayed, but never with a version above the current one's
  effect: an old notice is ignored (its version is not the highest).

A remote value is written into the cell only if no process of the node wrote it since
the poller last looked (a compare-and-set under the cell's write lock,
:meth:`~shared_td.storage.shared_value.SharedValue.set_if_version`): a local write is
never lost; it is published with a higher version instead, and wins everywhere.

**Old generations.** A publish of a new generation deletes the records of the one it
replaces (``value/`` of each value): before, every re-publish left its keys in the
store for good. Nothing still needs them: the owner tracks only
the new generation from then on (its poller writes no old value after the switch), a
pull of the old generation is refused by the owner, and every replica renews to the
new one. What may still touch them, and what it does now:

* an attach that read the name just before the publish reads the old records after
  they were deleted: a read here never waits for a missing record (a blocking ``get``
  waited the whole store timeout, holding the replica node's lane, and with it the
  renewal to the new generation queued behind it): :meth:`ClusterValues.latest` raises
  at once (the attach fails as its pull would, and is made again for the new
  generation); the catch-up after a pull that was served skips them (the replica is
  already stale, and renewed);
* a replica that has not renewed yet writes one of its values: that write creates the
  record again. After it, the replica reads the name's signed record; once it moved
  past its generation, it deletes what it wrote. (Store operations are
  ordered: either the replica sees the new generation, or the owner's deletion comes
  after the write.) The write reaches only the nodes still at the old generation, as
  before.
"""
from __future__ import annotations

import base64
import json
import pickle
import threading
from dataclasses import dataclass, field
from typing import Callable

from shared_td.coordinator.cluster_generations import read_identity
from shared_td.errors import ClusterAuthError

__all__ = ["ClusterValues", "POLL_S"]

#: Seconds between two looks of the poller at the version words of this node's cells.
POLL_S = 0.001
# Compare-and-set tries of one value's new version (each lost to another writer's)
_CAS_TRIES = 1000


@dataclass
class _Value:
    cell: object  # the node's SharedValue
    seen: int  # the cell's version word when this node last published or applied
    applied: int  # the highest cluster version this node published or applied


@dataclass
class _Tracked:
    generation: int
    values: list[_Value] = field(default_factory=list)
    owned: bool = False  # published by this node (else a replica's)
    digest: str = ""  # the publish's identity with the generation (cluster_generations)


# A value record found missing: its generation was replaced (see the module's opening)
_GONE = object()


def _key(name: str, generation: int, index: int) -> str:
    return f"{name}/{generation}/{index}"


def encode(value) -> str:
    """``value`` pickled, as text for a signed JSON record."""
    return base64.b64encode(pickle.dumps(value)).decode("ascii")


def decode(text: str):
    """The value of :func:`encode` (only ever called on a record whose signature was
    checked)."""
    return pickle.loads(base64.b64decode(text))


class ClusterValues:
    """The shared non-tensor values that this node keeps equal with the others.

    Args:
        store: the node's :class:`~shared_td.coordinator.cluster_store.SignedStore`.
        node, nodes: this node's number and the number of nodes.
        stop: the cluster's stop event (ends the poller).
        acting: ``acting()`` -> whether this process still runs the node (checked before
            each look of the poller: a process whose number was taken over publishes
            nothing more); default always.
        refuse: ``refuse()`` is called for each stored value found with a wrong
            signature (the Cluster counts it in ``refused``); default nothing.
    """

    def __init__(self, store, node: int, nodes: int, stop: threading.Event,
                 acting: Callable[[], bool] = lambda: True, refuse: Callable[[], None] = lambda: None):
        self._store, self._node, self._nodes, self._stop = store, node, nodes, stop
        self._acting = acting
        self._refuse = refuse
        self._tracked: dict[str, _Tracked] = {}
        # one at a time: the poller's publications and the service thread's applications
        self._lock = threading.Lock()
        self._poller: threading.Thread | None = None
        self.published = 0  # values this node sent (tests and benchmarks count them)

    # ------------------------------------------------------------------ names
    def publish(self, name: str, generation: int, cells: list, digest: str = "") -> None:
        """Owner: store the current values of ``cells`` as version 1.. of a new
        generation of ``name`` and keep them equal with the replicas from now on; then
        delete the records of the generation it replaces (the one this node tracked, and
        the one the name's record announces: after a takeover, the lost owner's). Called
        before the name's record names the new generation (attachers read the values
        first)."""
        tracked = _Tracked(generation, owned=True, digest=digest)
        for index, cell in enumerate(cells):
            seen = cell.version
            version = self._store_next(_key(name, generation, index), encode(cell.get()), 0, digest, True)
            tracked.values.append(_Value(cell, seen, version))
        replaced = self._track(name, tracked)  # the poller writes none of the old ones after this
        old = {} if replaced is None else {replaced.generation: len(replaced.values)}
        try:
            announced = self._read(f"name/{name}")
        except ClusterAuthError:
            announced = None  # forged: counted where the name is read; nothing to learn from it
        if announced is not None:
            old.setdefault(announced["generation"], len(announced["layout"].get("values", ())))
        for older, count in old.items():
            if older < generation:
                for index in range(count):
                    self._delete(_key(name, older, index))

    def latest(self, name: str, generation: int, count: int,
               digest: str | None = None) -> list[tuple[int, object] | None]:
        """``(version, value)`` of the ``count`` values of ``name`` as last stored
        (signature checked before anything is unpickled); None for a record with a
        wrong signature, counted with ``refuse``: forged, it carries nothing usable (the
        owner stores a signed one again: :meth:`restore`). RuntimeError at once when a
        record is missing: a newer publish of ``name`` replaced ``generation`` and
        deleted its records (see the module's opening)."""
        found = self._latest(name, generation, count, digest)
        if _GONE in found:
            key = f"value/{_key(name, generation, found.index(_GONE))}"
            error = RuntimeError(
                f"Generation {generation} of {name!r} was replaced by a newer publish of its owner while this "
                f"node read it ({key!r} is deleted with it): attach {name!r} again for the new generation.")
            # a newer one at least: the owner deletes these records before its name record
            # names it, and an attach waits for that before it tries again (Cluster._attach)
            error.current = generation + 1
            raise error
        return found

    def _latest(self, name: str, generation: int, count: int, digest: str | None = None) -> list:
        """:meth:`latest`, with _GONE for a missing record, or one of another publish
        than ``digest`` (when given: a number reused, see cluster_generations)."""
        found = []
        for index in range(count):
            try:
                record = self._read(f"value/{_key(name, generation, index)}")
            except ClusterAuthError:
                self._refuse()
                found.append(None)
                continue
            if record is None or (digest is not None and record.get("digest", "") != digest):
                found.append(_GONE)  # (never unpickled)
            else:
                found.append((record["version"], decode(record["payload"])))
        return found

    def _read(self, key: str):
        """The signed JSON record at ``key``, None when it is missing, in one round trip
        that never waits (a ``get`` waits the store's timeout for a missing key).
        ClusterAuthError for a wrong signature."""
        return self._store.get_signed(key)[0]

    def _delete(self, key: str) -> None:
        """Delete the record of value ``key`` (``name/generation/index``)."""
        self._store.delete(f"value/{key}")

    def restore(self, name: str, generation: int) -> int:
        """Owner: store again, signed, each value of ``name`` whose stored record has a
        wrong signature, or none (its current value under a new version, sent to every
        node as any write: the forged record is counted and replaced, see
        :meth:`_store_next`); returns how many. KeyError if this node does not track
        that generation."""
        with self._lock:
            tracked = self._tracked.get(name)
            if tracked is None or tracked.generation != generation:
                raise KeyError(f"node {self._node} holds no generation {generation} of {name!r}")
        # read without the lock and without waiting (a blocking get of a record deleted
        # meanwhile held the lock, and every write of this node's values, for the store's
        # whole timeout); a deleted record is stored again too: it is this node's value
        bad = []
        for index in range(len(tracked.values)):
            try:
                if self._read(f"value/{_key(name, generation, index)}") is None:
                    bad.append(index)
            except ClusterAuthError:
                bad.append(index)
        with self._lock:
            if self._tracked.get(name) is not tracked:
                return 0  # replaced meanwhile: the new generation's records are its own
            for index in bad:
                self._publish_local(name, tracked, index)
        return len(bad)

    def attach(self, name: str, generation: int, cells: list, versions: list[int], digest: str = "") -> None:
        """Replica: track ``cells``, filled with ``versions`` of the values; then catch
        up with any value stored meanwhile (a notice sent before this node tracked the
        name was ignored, but its value is in the store)."""
        self._track(name, _Tracked(generation, [_Value(cell, cell.version, version)
                                                for cell, version in zip(cells, versions)], digest=digest))
        for index, latest in enumerate(self._latest(name, generation, len(cells), digest)):
            # None: forged meanwhile, the owner's next write replaces it; _GONE: the
            # generation was replaced meanwhile, this replica is stale (and renewed)
            if latest is not None and latest is not _GONE:
                self._apply(name, generation, index, *latest, digest)

    def forget(self, name: str) -> None:
        """Stop keeping the values of ``name`` (a new generation replaces them)."""
        with self._lock:
            self._tracked.pop(name, None)

    def _track(self, name: str, tracked: _Tracked) -> _Tracked | None:
        """Track ``tracked`` for ``name``; returns what it replaces."""
        with self._lock:
            replaced, self._tracked[name] = self._tracked.get(name), tracked
        if tracked.values and self._poller is None:
            self._poller = threading.Thread(target=self._poll, name="shared_td-cluster-values", daemon=True)
            self._poller.start()
        return replaced

    def join(self, timeout: float) -> None:
        if self._poller is not None:
            self._poller.join(timeout)

    # ------------------------------------------------------------------ remote writes
    def receive(self, notice: dict) -> None:
        """A value published by another node (a signed notice from the request queue);
        its payload is unpickled only for a value this node holds (name, generation,
        digest, index) at a newer version: nothing else of a notice is ever decoded."""
        name, generation, index = notice["name"], notice["generation"], notice["index"]
        version, digest = notice["version"], notice.get("digest", "")
        with self._lock:
            if self._entry(name, generation, index, version, digest) is None:
                return
        self._apply(name, generation, index, version, decode(notice["payload"]), digest)

    def _entry(self, name: str, generation: int, index: int, version: int, digest: str):
        """The tracked value that a write of ``version`` would replace, or None when it
        would not (called holding the lock)."""
        tracked = self._tracked.get(name)
        if (tracked is None or (tracked.generation, tracked.digest) != (generation, digest)
                or not isinstance(index, int) or not 0 <= index < len(tracked.values)):
            return None  # a name this node does not hold (or another generation of it)
        entry = tracked.values[index]
        return None if version <= entry.applied else entry  # older: a higher version is here

    def _apply(self, name: str, generation: int, index: int, version: int, value, digest: str) -> None:
        with self._lock:
            entry = self._entry(name, generation, index, version, digest)
            if entry is None:
                return  # another generation, or an older write
            tracked = self._tracked[name]
            # unless a process of this node wrote the cell since we last looked (checked
            # under the cell's write lock): that write is published next, with a higher
            # version, and wins
            if entry.cell.set_if_version(value, entry.seen):
                entry.seen += 1
                entry.applied = version
            else:
                self._publish_local(name, tracked, index)

    # ------------------------------------------------------------------ local writes
    def _poll(self) -> None:
        try:  # this thread's store connection now, not at the first write it must send
            self._store.connect()
        except (RuntimeError, OSError):
            return
        while not self._stop.wait(POLL_S):
            try:
                if not self._acting():
                    return
                with self._lock:
                    for name, tracked in list(self._tracked.items()):
                        for index, entry in enumerate(tracked.values):
                            if entry.cell.version != entry.seen:
                                self._publish_changed(name, tracked, index)
            except ClusterAuthError:
                # an OSError too, but not a lost store: something forged a record this
                # thread read. It was not used; counted, and the poller keeps going (ending
                # here would stop every later value of this node from propagating)
                self._refuse()
            except (RuntimeError, OSError):
                return  # the store is gone: values stay as they are on this node

    def _publish_changed(self, name: str, tracked: _Tracked, index: int) -> None:
        """:meth:`_publish_local`, by the poller: a value that cannot be published (a
        ValueError) is counted as refused and not tried again (each try closed a store
        connection, every POLL_S), and the poller goes on."""
        try:
            self._publish_local(name, tracked, index)
        except ValueError:
            tracked.values[index].seen = tracked.values[index].cell.version
            self._refuse()

    def _publish_local(self, name: str, tracked: _Tracked, index: int) -> None:
        """The cell ``index`` changed on this node: give its value the next version,
        store it as the latest and tell every other node (called holding the lock)."""
        entry = tracked.values[index]
        seen = entry.cell.version
        payload = encode(entry.cell.get())  # the value at ``seen`` or a later one
        key = _key(name, tracked.generation, index)
        version = self._store_next(key, payload, entry.applied, tracked.digest)
        if version is None:  # the record is another publish's (the number reused): this one is replaced
            entry.seen = seen
            return
        entry.seen, entry.applied = seen, version
        notice = {"op": "value", "from": self._node, "name": name, "generation": tracked.generation,
                  "digest": tracked.digest, "index": index, "version": version, "payload": payload}
        for peer in range(self._nodes):
            if peer != self._node:
                self._store.push_json(f"queue/{peer}", notice)
        self.published += 1
        if not tracked.owned:  # after the notices: the check costs the other nodes nothing
            self._unless_replaced(name, tracked.generation, key)

    def _unless_replaced(self, name: str, generation: int, key: str) -> None:
        """A replica wrote the records of ``key``: delete them if a newer publish of
        ``name`` replaced ``generation`` (its owner may have deleted that generation's
        records before this write made them again: see the module's opening)."""
        # signed (an unsigned counter could be set back), and small: the record gen/<name>,
        # not name/<name> with the whole layout (cluster_generations.read_identity)
        current = read_identity(self._store, name, self._refuse)
        if current is not None and current[0] > generation:
            self._delete(key)

    def _store_next(self, key: str, payload: str, floor: int, digest: str, publishing: bool = False) -> int | None:
        """Store ``payload`` as the latest value of ``key`` (of the publish ``digest``)
        under the next version, and return it: the stored record's version (or ``floor``,
        this node's highest seen, when higher: a replayed older record) + 1, written by a
        compare-and-set against the bytes read, again until no other writer came in
        between. Taken from the signed record itself: the unsigned counter used before
        could be set back by anything reaching the store, and every node then dropped the
        writes as old. A forged record is counted and replaced (it carries nothing a node
        could use). None, nothing written, when the record is of another publish (unless
        ``publishing``: the owner's new one replaces it)."""
        full = f"value/{key}"
        for _ in range(_CAS_TRIES):
            held = self._store.get_unchecked(full)
            version = floor
            if held:
                try:
                    record = json.loads(self._store.check(full, held))
                    if record.get("digest", "") != digest and not publishing:
                        return None
                    version = max(version, record["version"])
                except ClusterAuthError:
                    self._refuse()
            signed = self._store.sign(full, json.dumps({"version": version + 1, "payload": payload,
                                                        "digest": digest}).encode())
            if self._store.compare_set(full, held or b"", signed) == signed:
                return version + 1
        raise ClusterAuthError(f"The value record {full!r} changed at each of {_CAS_TRIES} tries to store a new "
                               "version of it: something keeps writing it. Run the cluster on a private network.")
