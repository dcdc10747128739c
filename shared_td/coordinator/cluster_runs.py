"""The cluster's run: one signed record that claim and owner tokens are bound to.

The first process that starts sets ``run/<key id>`` (a random id, signed) by a
compare-and-set; every later one reads it (:func:`run_id`). A token recorded in an
earlier run of the same authkey verifies in no other run. The running nodes' heartbeats
write the record back when it is deleted (:func:`keep_run`), and a process starting in
the window before they do follows the run their heartbeats carry
(``cluster_membership.settled_run``).

Who may follow another run is decided here (:func:`open_run`): only the process that set
the record itself (it was missing: the newcomer of the window). A record found there is
the cluster's, whatever heartbeats say: recorded heartbeats of an earlier run, written
back by anything that reaches the store, made a starting node follow that run and
overwrite the live record with it, and the nodes split into two runs that read each
other's genuine tokens as forgeries (audit 19, second round). The live nodes replace a
record of another run once no heartbeat carrying it moved for LOST_AFTER_S +
HEARTBEAT_S (:func:`keep_run`): a newcomer that set it and died before it followed
theirs left it for good, and every later starter took it, the split (audit 19, final
round). Only a node's own run is written so: a replayed one never.

Example:
    >>> import datetime
    >>> from torch.distributed import TCPStore
    >>> from shared_td.coordinator.cluster_store import SignedStore
    >>> raw = TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=5), wait_for_workers=False)
    >>> store = SignedStore(raw, b"k" * 32, timeout=5.0)
    >>> run, mine = open_run(store)   # the first process: it sets the record
    >>> mine is not None, open_run(store) == (run, None), run_id(store) == run
    (True, True, True)
"""
from __future__ import annotations

import json
import secrets
import time

from shared_td.errors import ClusterAuthError

__all__ = ["RunWatch", "keep_run", "open_run", "run_id", "run_key"]


def run_key(store) -> str:
    """The key of the cluster's run record (see :func:`run_id`)."""
    return f"run/{store.sign('run', b'')[:8].hex()}"


class RunWatch:
    """What a live node's :func:`keep_run` saw of a record of another run: ``nodes``
    heartbeats to look at, and after how long (``after`` seconds, LOST_AFTER_S +
    HEARTBEAT_S) with none of them carrying that run moving the record is replaced."""

    def __init__(self, nodes: int, after: float):
        self.nodes, self.after = nodes, after
        #: (the record's bytes, the heartbeats carrying its run as stored, since when), or None
        self.seen: tuple[bytes, tuple, float] | None = None


def keep_run(store, run: str, watch: RunWatch | None = None) -> bool:
    """Write the signed record of ``run`` back if its key is missing or emptied (a
    compare-and-set that changes nothing otherwise): the heartbeats do, so that a
    deleted record is back within a few heartbeats, before a newcomer sets a run of its
    own (which split the nodes into two runs that read each other's tokens as
    forgeries, audit 19). Another run found there (with ``watch``) is replaced by a
    compare-and-set once no heartbeat carrying it moved for ``watch.after`` seconds:
    the newcomer that set it died before it followed the live nodes' run
    (``cluster_membership.settled_run``), and every later starter took it, the split
    (audit 19, final round). A run whose heartbeats move (its nodes live: a genuine
    split) is left alone, and only this node's own run is ever written (a replayed
    one never). True while such a record is watched (the heartbeats call again at
    their next beat)."""
    key = run_key(store)
    mine = store.sign(key, run.encode())
    held = store.compare_set(key, "", mine)
    if watch is None or held == mine:
        if watch is not None:
            watch.seen = None
        return False
    beats, now = _carrying(store, _run_of(store, key, held), watch.nodes), time.monotonic()
    if watch.seen is None or watch.seen[:2] != (held, beats):
        watch.seen = (held, beats, now)  # (new, or one of its heartbeats moved: watched again from now)
        return True
    if now - watch.seen[2] < watch.after:
        return True
    store.compare_set(key, held, mine)  # (changed meanwhile: nothing; seen again at the next call)
    watch.seen = None
    return False


def _run_of(store, key: str, held: bytes) -> str | None:
    """The run a stored record names; None when not signed with this process's key."""
    try:
        return store.check(key, held).decode()
    except (ClusterAuthError, UnicodeDecodeError):
        return None


def _carrying(store, run: str | None, nodes: int) -> tuple:
    """The heartbeats of nodes ``0 .. nodes - 1`` that carry ``run``, as stored (signed
    with this process's key): compared with themselves, to tell whether one moves."""
    found = []
    for peer in range(nodes) if run else ():
        blob = store.get_unchecked(f"hb/{peer}")
        try:
            beat = json.loads(store.check(f"hb/{peer}", blob)) if blob else None
        except (ClusterAuthError, ValueError):
            continue
        if isinstance(beat, dict) and beat.get("run") == run:
            found.append((peer, blob))
    return tuple(found)


def open_run(store) -> tuple[str, bytes | None]:
    """``(run, mine)``: the cluster's run (:func:`run_id`) and, when this call set the
    record (it was missing or emptied), the bytes it wrote (None when it found one).
    Only the process that set the record may replace it, by a compare-and-set against
    exactly those bytes (see the module's opening)."""
    key = run_key(store)
    blob = store.sign(key, secrets.token_hex(8).encode())
    held = store.compare_set(key, "", blob)
    return store.check(key, held).decode(), (held if held == blob else None)


def run_id(store) -> str:
    """The run of the cluster that ``store`` serves: a random id set once, signed, by the
    first process that starts (a compare-and-set of ``run/<key id>``), read by every
    later one. Claim tokens are bound to it: a token recorded in an earlier run with
    the same authkey verifies in no other. The key's name is derived from the authkey
    (an HMAC of a fixed text): a process started with another key by mistake sets its
    own, and the nodes with the right key go on (one key for all made such a process,
    started first, shut the store to them for good). ClusterAuthError when the key
    holds what is not signed with this process's key (something else wrote it). A
    record deleted while nodes run is written back by their heartbeats
    (:func:`keep_run`), and a process that sets it meanwhile follows the run of their
    heartbeats (``cluster_membership.settled_run``)."""
    return open_run(store)[0]
