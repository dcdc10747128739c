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
other's genuine tokens as forgeries (audit 19, second round).

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

import secrets

__all__ = ["keep_run", "open_run", "run_id", "run_key"]


def run_key(store) -> str:
    """The key of the cluster's run record (see :func:`run_id`)."""
    return f"run/{store.sign('run', b'')[:8].hex()}"


def keep_run(store, run: str) -> None:
    """Write the signed record of ``run`` back if its key is missing or emptied (a
    compare-and-set that changes nothing otherwise): the heartbeats do, so that a
    deleted record is back within a few heartbeats, before a newcomer sets a run of its
    own (which split the nodes into two runs that read each other's tokens as
    forgeries, audit 19). Another run found there is left alone: the newcomer that set
    it follows the live nodes' (``cluster_membership.settled_run``)."""
    key = run_key(store)
    store.compare_set(key, "", store.sign(key, run.encode()))


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
