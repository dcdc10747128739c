"""Generations of a replicated name: how a publish numbers one, and what identifies it.

Every decision about a generation is taken on signed values only. The store's ``add``
counters carry no signature: anything that reaches the store can set one back (a
generation counter set to 0 made the next publish reuse the number a replica held,
with another layout: the replica then received the bytes of the new layout as its
own). So:

* **Numbers.** A publish takes ``max(counter + 1, signed record's + 1, this process's
  + 1)`` (:func:`next_generation`): the counter only ever helps (it knows of a record
  deleted meanwhile), a rewound one never gives a number a signed record already had.
  The record ``name/<name>`` is then written by a compare-and-set that never goes
  backwards (:func:`record_name`); the owner's publishes of one name run one at a time
  (:func:`publish_lock`), so its record and its own state (``Cluster._owned``) agree.
* **Identity.** The signed record carries a *digest*: SHA-256 of the layout's JSON and
  of a random nonce of that publish (:func:`layout_digest`). Replicas, ``has/``
  records, pull/sync/push requests and push headers carry ``(generation, digest)``,
  and both sides compare both (:func:`same`): a replica never receives the bytes of
  another publish, even under a number reused (a deleted record).
* **Cheap looks.** ``name/<name>`` carries the whole layout (a tree of 10,000 leaves:
  about a megabyte). What only asks "which publish is current" (a replica's value
  write, ``is_stale``) reads the small signed ``gen/<name>`` instead
  (:func:`read_identity`), never backwards either (a replica's value write read,
  checked and parsed the whole record: 133 ms for 10,000 leaves, audit 18).
* **One commit point.** ``name/<name>`` is the publish's commit point; ``gen/<name>``
  is written twice around it by :func:`record_name`: marked *pending* before, plain
  after. A reader that finds it pending goes by ``name/<name>`` (and writes the plain
  record for a committed publish). Before, ``gen/`` was written only after the record:
  an owner killed between the two left it one generation behind, and ``is_stale`` said
  False for the newer publish until the next one (audit 19). A publish that raised
  takes its mark back to what ``name/`` holds then, not to the ``gen/`` read before:
  the exception may come after the host applied the name record (audit 19, final round).

Example:
    >>> from types import SimpleNamespace
    >>> a, b = layout_digest({"nbytes": 16}), layout_digest({"nbytes": 16})
    >>> len(a), a != b     # one per publish, even of one layout
    (16, True)
    >>> same(SimpleNamespace(generation=2, digest=a), 2, a), same(SimpleNamespace(generation=2, digest=a), 2, b)
    (True, False)
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import threading
import time
import weakref

from shared_td.coordinator.cluster_liveness import LOST_AFTER_S
from shared_td.coordinator.cluster_store import ClusterAuthError
from shared_td.platform import ThreadLock

__all__ = ["Endpoint", "layout_digest", "next_generation", "overtaken", "publish_lock", "read_identity", "read_name",
           "record_name", "same", "wait_named"]


_DIGEST_HEX = 16  # hex digits of a publish's digest (see layout_digest)


def layout_digest(layout: dict) -> str:
    """The identity of one publish of ``layout``: 16 hex digits of SHA-256 over the
    layout's JSON and a random nonce (a reused number with the same layout still
    differs). 64 bits tell publishes apart (no one chooses the nonce, and the records
    that carry it are signed); each push header carries it, and 32 digits took 16
    bytes more of the name's room there (the longest name went from 313 to 267 bytes)."""
    text = json.dumps(layout, sort_keys=True).encode()
    return hashlib.sha256(secrets.token_bytes(16) + b"\0" + text).hexdigest()[:_DIGEST_HEX]


def same(entry, generation, digest) -> bool:
    """Whether ``entry`` (an Owned, a Replica, or None) is of ``generation`` and ``digest``."""
    return entry is not None and entry.generation == generation and entry.digest == digest


def _new_lock():
    """A :class:`~shared_td.platform.ThreadLock`: its release() checks in C that this
    thread holds it (RuntimeError if not), so a finally may release it without knowing
    whether acquire() returned."""
    return ThreadLock()


@contextlib.contextmanager
def publish_lock(cluster, name: str):
    """The owner's publishes of ``name``, one at a time (claim to record): two at once
    left the record naming a generation the owner no longer held. TimeoutError after
    the cluster's timeout."""
    locks = cluster.__dict__.setdefault("_publish_locks", {})
    lock = locks.get(name) or locks.setdefault(name, _new_lock())
    if lock._is_owned():  # (this thread's own publish of it, re-entered: not reentrant)
        raise TimeoutError(f"publish({name!r}): this thread's own publish of {name!r} has not ended: "
                           "nothing was published.")
    # acquire() inside the try: a Ctrl-C landing as it returned, before a try, left the
    # lock held and every later publish of the name on this node timing out
    try:
        if not lock.acquire(timeout=cluster.timeout):
            raise TimeoutError(f"publish({name!r}): another publish of {name!r} on this node did not end within "
                               f"{cluster.timeout:g} s: nothing was published (retry).")
        yield
    finally:
        try:
            lock.release()
        except RuntimeError:
            pass  # not taken: timed out, or interrupted before acquire returned


def _refused(cluster) -> None:
    cluster.refused += 1


def read_name(cluster, store, name: str) -> dict | None:
    """The signed record ``name/<name>``; None when missing or forged (counted in ``refused``)."""
    try:
        record, _blob = store.get_signed(f"name/{name}")
    except ClusterAuthError:
        _refused(cluster)
        return None
    return record if isinstance(record, dict) else None


def next_generation(cluster, store, name: str) -> int:
    """The generation of a new publish of ``name`` (see the module's opening)."""
    try:
        counted = store.add(f"generation/{name}", 1)
    except ValueError:  # overwritten with what is not an integer: nothing to learn from it
        _refused(cluster)
        counted = 0
    record = read_name(cluster, store, name)
    owned = cluster._owned.get(name)
    return max(counted, 1 + (record["generation"] if record else 0), 1 + (owned.generation if owned else 0))


def record_name(cluster, store, name: str, record: dict) -> bool:
    """Write the signed ``name/<name>`` unless it holds a newer generation (a
    compare-and-set: never backwards); a forged one there is counted and replaced.
    Around it ``gen/<name>`` (its generation, digest and owner: see
    :func:`read_identity`), the same way, except that one of the same generation is
    replaced (a number reused after the record was deleted: the digest is this
    publish's): before it marked pending (with the owner's claim token), after it
    plain, so that the name record is the one commit point (see the module's opening).
    False, nothing more written, when a newer record was found (this publish was
    overtaken: its caller says so). When the name record is not written (overtaken, or
    an exception: a store timeout, CAS tries run out), the pending mark is taken back:
    the plain record of whatever ``name/`` holds then (:func:`_take_back`), by a
    compare-and-set against the mark's own bytes (left pending, every look read and
    parsed the whole name record again until the name was published again, audit 19,
    second round; a mark of a process killed there is taken back by the readers:
    :func:`read_identity`)."""
    small = {key: record[key] for key in ("generation", "digest", "owner")}
    refuse, key = lambda: _refused(cluster), f"gen/{name}"  # noqa: E731
    pending = {**small, "pending": True, "claim": getattr(cluster, "_claim", None)}
    store.set_json_if_newer(key, pending, "generation", refuse, True)
    written = False
    try:
        written = store.set_json_if_newer(f"name/{name}", record, "generation", refuse)
    finally:
        if not written:  # (an exception may come after the host applied the write: name/ says)
            _take_back(cluster, store, name, store.sign(key, json.dumps(pending).encode()))
    if written:
        store.set_json_if_newer(key, small, "generation", refuse, True)  # (ties: the pending one replaced)
    return written


def _take_back(cluster, store, name: str, mark: bytes) -> None:
    """``gen/<name>`` := the plain record of what ``name/<name>`` holds now (emptied when
    nothing), if it still holds ``mark`` (a compare-and-set), as a reader does. Not the
    ``gen/`` read before the publish: an exception does not say the name record was not
    written (a reply after the store timeout, a Ctrl-C after the host applied it), and
    the record of the publish before, left plain above the newer name record, was
    trusted by every reader for good (audit 19, final round). The store gone: nothing
    (a reader takes the mark back otherwise)."""
    key = f"gen/{name}"
    try:
        record = read_name(cluster, store, name)
        plain = {field: record.get(field) for field in ("generation", "digest", "owner")} if record else None
        store.compare_set(key, mark, store.sign(key, json.dumps(plain).encode()) if plain else b"")
    except (RuntimeError, OSError, ValueError):
        pass


def overtaken(cluster, store, name: str) -> ValueError:
    """A newer publish of ``name`` reached its record while ``cluster`` published it
    (this process was stopped past LOST_AFTER_S inside, and another node took the name
    over): the name is not this node's any more; the error to raise. Before, the
    publish returned as if it had succeeded, the node holding a generation no record
    named."""
    record = read_name(cluster, store, name) or {}
    taken = record.get("owner", "another node")
    cluster._owned.pop(name, None)
    cluster._values.forget(name)  # its values are of a generation no record names
    cluster._taken_names[name] = str(taken)
    return ValueError(f"publish({name!r}) was taken over by node {taken} while it ran (this node's heartbeat "
                      f"stood still): {name!r} is owned by node {taken} now (generation "
                      f"{record.get('generation', '?')}). Publish it again on node {taken}, or under another name.")


def read_identity(store, name: str, refuse) -> tuple[int, str] | None:
    """``(generation, digest)`` of the current publish of ``name``, from the small signed
    ``gen/<name>`` (one short round trip); from ``name/<name>``, the commit point, when
    that is missing, forged (``refuse()`` called for each forged one) or pending (a
    publish under way, or one whose owner died before it wrote ``gen/`` again: then
    the plain record of the committed publish is written here, by a compare-and-set
    against the pending bytes). A pending mark above the name record whose owner's
    process is gone (its claim is not the token the mark names, or its heartbeat stood
    still for LOST_AFTER_S as seen here) is taken back the same way: a publish killed
    between its two writes left every look reading the whole name record for good.
    None when nothing is published."""
    try:
        small, blob = store.get_signed(f"gen/{name}")
    except ClusterAuthError:
        refuse()
        small = blob = None
    if isinstance(small, dict) and not small.get("pending"):
        return small["generation"], small.get("digest", "")
    try:
        record, _blob = store.get_signed(f"name/{name}")
    except ClusterAuthError:
        refuse()
        return None
    if not isinstance(record, dict):
        return None
    # committed (no more name reads), or a mark never to be committed
    # gen/ emptied or missing (a first publish taken back): written plain once, not
    # every look parsing the whole name record for good
    if not isinstance(small, dict) or record["generation"] >= small["generation"] or _owner_gone(store, small, blob):
        plain = {key: record.get(key) for key in ("generation", "digest", "owner")}
        store.compare_set(f"gen/{name}", blob or b"", store.sign(f"gen/{name}", json.dumps(plain).encode()))
        with _LOCK:
            _MARKS.pop(blob, None)
    return record["generation"], record.get("digest", "")


def wait_named(cluster, name: str, generation, bound: float = LOST_AFTER_S) -> bool:
    """Wait until the store names ``generation`` of ``name`` or a later one (short looks
    at :func:`read_identity`, at most ``bound`` s and the cluster's timeout); whether it
    does (False at once for a ``generation`` that is not a number). An owner's refusal
    names the generation it holds before its name record, the commit point, does
    (:func:`~shared_td.coordinator.cluster_serve.refusal`): an attach refused for that
    reason tried again at once, read the old generation, was refused again, and said
    the name was "published again 3 times" after one re-publish (audit of 33f6eb6);
    so does the deletion of the old generation's value records (``ClusterValues.latest``).

    Example (a stand-in for a node whose store names generation 3)::

        >>> import types
        >>> gen = types.SimpleNamespace(get_signed=lambda key: ({"generation": 3, "digest": "d"}, b""))
        >>> node = types.SimpleNamespace(timeout=1.0, _checked=lambda: gen, _count_refused=lambda: None)
        >>> wait_named(node, "p", 3), wait_named(node, "p", 4, bound=0.01), wait_named(node, "p", None)
        (True, False, False)
    """
    if not isinstance(generation, int):
        return False
    deadline, pause = time.monotonic() + min(bound, cluster.timeout), 0.002
    while True:
        try:
            current = read_identity(cluster._checked(), name, cluster._count_refused)
        except (RuntimeError, OSError, ValueError):  # the store is gone, or this node: the next try says so
            return False
        if current is not None and current[0] >= generation:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(pause)
        pause = min(2 * pause, 0.05)


_LOCK = threading.Lock()
# a pending gen/ mark above its name record, as stored -> (its owner's heartbeat as first
# seen with it, when): a mark whose owner's heartbeat stands still is taken back
_MARKS: dict[bytes, tuple[bytes | None, float]] = {}


def _new_lock_in_child() -> None:
    # a fork child reads names too (is_stale, refresh, attach of a replica its node
    # holds): a parent thread that held _LOCK at the fork left the child's copy held for
    # ever, and the child's next look at a pending or missing gen/ record hung
    global _LOCK
    _LOCK = threading.Lock()


os.register_at_fork(after_in_child=_new_lock_in_child)


def _owner_gone(store, small: dict, blob: bytes) -> bool:
    """Whether the process that wrote the pending mark ``small`` (stored as ``blob``) no
    longer runs its node: its claim holds another token now (it left, or a successor
    runs), or its heartbeat has not moved for LOST_AFTER_S since this process first saw
    the mark. Only ever a reason to read the committed name record as current (the mark
    was never committed): a slow owner still writes its record, and ``gen/`` after it."""
    owner, claim = small.get("owner"), small.get("claim")
    if isinstance(claim, str) and store.get_unchecked(f"claim/{owner}") != claim.encode():
        return True
    beat, now = store.get_unchecked(f"hb/{owner}"), time.monotonic()
    with _LOCK:
        seen = _MARKS.get(blob)
        if seen is None or seen[0] != beat:
            if len(_MARKS) > 256:  # (marks of names never looked at again)
                _MARKS.clear()
            _MARKS[blob] = (beat, now)
            return False
        return now - seen[1] >= LOST_AFTER_S


class Endpoint:
    """Where a replica came from, for :func:`shared_td.is_stale` and
    :func:`shared_td.refresh`: its version is the name's (generation, digest) in the
    store. It holds its Cluster weakly: staleness keeps endpoints for as long as their
    tensordicts live, and a strong one kept a shut down node, its replicas and store
    connections, for good (so that the tensordicts' own entries never went either)."""

    def __init__(self, cluster):
        self._cluster = weakref.ref(cluster)

    def _live(self):
        cluster = self._cluster()
        if cluster is None:
            raise RuntimeError("The Cluster node this replica was attached from is gone (shut down and freed): "
                               "start a new Cluster to attach it again.")
        return cluster

    def attach(self, name: str):
        return self._live().attach(name)

    def version(self, name: str) -> tuple[int, str | None]:
        return self._live()._identity(name)
