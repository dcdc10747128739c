"""Claim tokens: what a compare-and-set key (``claim/<node>``, ``owner/<name>``) holds.

A claim's key is a plain compare-and-set target (no signature can ride on it), so its
token carries its own: a sequence number, a nonce and their HMAC with the cluster
authkey, bound to the cluster's run (:func:`claim_token`,
:func:`~shared_td.coordinator.cluster_runs.run_id`). Each process of a node takes a
higher sequence number than the last. A clean shutdown leaves a released token there,
signed the same way (:func:`release_node`), which the next
:func:`~shared_td.coordinator.cluster_liveness.claim_node` takes as free. A token of the
key and run of a later process (or the released token of a process itself) means that
process is gone (left, or taken over): it no longer runs the node, and a sync takes its
replica records back (:func:`supersedes`). Anything else found there (bytes written by
something reaching the store, an emptied key, a recorded token of an earlier process or
of an earlier run written back) is counted as forged and ignored -- the process that
holds the number writes its own back, and a sync keeps the node's replica records
(before, one raw write, or one replayed token, cut a node out of every sync in silence,
and at its next pause it stopped itself as "taken over"). The clean shutdown emptied the
claim before, backed by a signed ``left/<node>`` record naming the last leaver only: a
process stopped past LOST_AFTER_S whose successor then left read the emptied claim as a
forgery, wrote its own token back and ran on as the node; and a record of an earlier
process of the node was kept for good (audit 18).

These are the tokens alone (no heartbeat is read here): whether a held claim may be
taken over is :mod:`~shared_td.coordinator.cluster_liveness`'s.

Example:
    >>> import datetime
    >>> from torch.distributed import TCPStore
    >>> from shared_td.coordinator.cluster_store import SignedStore
    >>> raw = TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=5), wait_for_workers=False)
    >>> store = SignedStore(raw, b"k" * 32, timeout=5.0)
    >>> first, second = claim_token(store, 2, "run"), claim_token(store, 2, "run")
    >>> supersedes(store, 2, "run", second.encode(), first), supersedes(store, 2, "run", first.encode(), second)
    (True, False)
    >>> claim_free(store, 2, released_token(store, 2, first, "run").encode(), "run"), claim_free(store, 2, b"junk")
    (True, False)
"""
from __future__ import annotations

import hmac
import secrets
from typing import NamedTuple

__all__ = ["ClaimToken", "claim_free", "claim_token", "held_claim", "parsed_claim", "release_node",
           "released_token", "signed_token", "supersedes", "token_body"]

_LEFT = "left."  # how a released claim token starts (release_node)
_UNHELD = "\0unheld"  # what held_claim's look expects: no token (ASCII, with a dot) is this


def held_claim(store, key: str, mine: str) -> bytes:
    """What ``key`` holds (b"" when missing), read by a compare-and-set that expects what
    no claim holds: one round trip that changes nothing (one of ``mine`` with itself
    read a deleted key as ``mine``, and the claim was never written back)."""
    held = store.compare_set(key, _UNHELD, _UNHELD)
    return b"" if held == _UNHELD.encode() else held


def release_node(store, node: int, token: str, joined: bool = True, run: str = "") -> None:
    """Let node ``node`` go (a clean shutdown): ``claim/<node>`` := the released token of
    ``token`` (:func:`released_token`), so that a process started as that node later
    claims it at once (:func:`claim_node`), without waiting for the heartbeat to stand
    still, and any process or record of ``token`` reads it as gone. A process whose
    start failed before it ``joined`` empties the claim instead: no record names its
    token, and one with another authkey must leave nothing the key's nodes read as
    held."""
    store.compare_set(f"claim/{node}", token, released_token(store, node, token, run) if joined else "")


def claim_token(store, node: int, run: str = "", floor: int = 0) -> str:
    """A new token for ``claim/<node>``: ``<seq>.<nonce>`` and its HMAC with the cluster
    authkey, bound to the key ``claim/<node>`` and to the cluster's ``run``, as ASCII:
    the claim's key stays a plain compare-and-set target, and who reads it can tell a
    node's token from a forgery. ``seq`` grows with each process of the node (above
    ``floor``, the held claim's, and a store counter): only a token of a higher one is
    a successor's (:func:`supersedes`), so a recorded older token written back is a
    forgery."""
    try:
        counted = store.add(f"claimseq/{node}", 1)
    except ValueError:  # not an integer there: the floor decides
        counted = 0
    return _signed_token(store, node, run, f"{max(counted, floor + 1)}.{secrets.token_hex(12)}")


def released_token(store, node: int, token: str, run: str = "") -> str:
    """The token a clean shutdown of the process of ``token`` leaves in ``claim/<node>``:
    ``left.<its seq>.<its nonce>`` and the HMAC of that, as :func:`claim_token`'s."""
    return _signed_token(store, node, run, f"{_LEFT}{token.rpartition('.')[0]}")


def _signed_token(store, node: int, run: str, body: str) -> str:
    return signed_token(store, f"claim/{node}", run, body)


def signed_token(store, key: str, run: str, body: str) -> str:
    """``<body>.<mac>``: what a compare-and-set key (``claim/<node>``, ``owner/<name>``)
    holds, as ASCII, the HMAC (16 bytes, as hex) of ``body`` with the cluster authkey
    bound to ``key`` and to the cluster's ``run``."""
    return f"{body}.{_token_mac(store, key, run, body.encode())}"


def token_body(store, key: str, run: str, held: bytes | str | None) -> str | None:
    """The body of ``held`` if it is a :func:`signed_token` of ``key`` and ``run``, else
    None (missing, or not signed with this cluster's key and run: a forgery)."""
    held = held.encode() if isinstance(held, str) else held or b""
    body, _dot, mac = held.rpartition(b".")
    if not body or not hmac.compare_digest(mac, _token_mac(store, key, run, body).encode()):
        return None
    return body.decode()


def _token_mac(store, key: str, run: str, body: bytes) -> str:
    return store.sign(key, run.encode() + b"/" + body)[:16].hex()


class ClaimToken(NamedTuple):
    left: bool  # a released token (release_node)
    seq: int
    nonce: str


def parsed_claim(store, node: int, run: str, held: bytes | str | None) -> ClaimToken | None:
    """What the token ``held`` says, None unless it is one of this cluster's key and run."""
    body = token_body(store, f"claim/{node}", run, held)
    if body is None:
        return None
    parts = body.split(".")
    left = parts[0] == _LEFT[:-1]
    try:
        seq, nonce = parts[left:]
        return ClaimToken(left, int(seq), nonce)
    except ValueError:
        return None


def supersedes(store, node: int, run: str, held: bytes | None, token: str) -> bool:
    """Whether ``claim/<node>`` holding ``held`` means that the process of ``token`` no
    longer runs the node: a token of the key and run of a later process (a higher
    seq: a successor's, or its released one), or the released token of ``token``
    itself (a clean shutdown); any token of the key and run, when ``token`` is none
    (a record naming a process by something else). Anything else (bytes without the
    key, an emptied key, an older token written back) is not."""
    other, mine = parsed_claim(store, node, run, held), parsed_claim(store, node, run, token)
    if other is None or mine is None:
        return other is not None
    return other.seq > mine.seq or (other.left and (other.seq, other.nonce) == (mine.seq, mine.nonce))


def claim_free(store, node: int, held: bytes | None, run: str | None = "") -> bool:
    """Whether ``claim/<node>`` holding ``held`` lets a new process claim the number at
    once: missing, emptied (a start that failed early), or released by a clean
    shutdown (verified against ``run``; with None, only its form: a process with
    another key can tell a released claim, never verify it)."""
    if not held:
        return True
    if run is None:
        return held.startswith(_LEFT.encode())
    token = parsed_claim(store, node, run, held)
    return token is not None and token.left
