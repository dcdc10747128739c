"""One owner node per published name: ``owner/<name>``, claimed by a signed token.

A publish claims ``owner/<name>`` (:func:`claim_name`) by a compare-and-set, so that a
second node's publish of a name is refused while its owner lives (it made two owners
before), and the name of a lost owner is taken over. The key is a plain
compare-and-set target (no signature can ride on it), so what it holds carries its
own: the owner's node number and its HMAC with the cluster authkey, bound to the key
and to the cluster's run (:func:`owner_token`; the run: see
:func:`~shared_td.coordinator.cluster_runs.run_id`). Anything else found there (bytes written by something reaching
the store) is counted in ``refused`` and ignored: a publish of the name then goes by
the owner its signed record ``name/<name>`` names, and an owner that looks at its
names after a pause (:func:`names_taken_over`) writes its own token back. Before, the
key held a bare node number: junk there let another node take a live owner's name
(two owners), and a forged ``"1"`` made the owner give its name up at its next pause
(audit 18).

What it does not stop: a replay within one run. The token of a node for a name is the
same at every claim of this run (no nonce): a token of node 1 for ``p`` recorded
earlier in the run and written back later reads as node 1's claim of ``p`` (the owner
then gives ``p`` up at its next pause; another node's publish of ``p`` is refused while
node 1 lives). A token of an earlier run verifies in no other.

Example:
    >>> import datetime
    >>> from torch.distributed import TCPStore
    >>> from shared_td.coordinator.cluster_store import SignedStore
    >>> raw = TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=5), wait_for_workers=False)
    >>> store = SignedStore(raw, b"k" * 32, timeout=5.0)
    >>> token = owner_token(store, "p", 1)
    >>> owner_of(store, "p", token.encode()), owner_of(store, "q", token.encode()), owner_of(store, "p", b"1")
    (1, None, None)
"""
from __future__ import annotations

from typing import Callable

from shared_td.coordinator.cluster_claims import signed_token, token_body
from shared_td.coordinator.cluster_liveness import Liveness, heartbeat_moves

__all__ = ["claim_name", "keep_owner_key", "names_taken_over", "owner_keys_there", "owner_of", "owner_token"]


def owner_token(store, name: str, node: int, run: str = "") -> str:
    """What ``owner/<name>`` holds while node ``node`` owns ``name``: ``<node>.<mac>``,
    the HMAC (16 bytes, as hex) of the node number with the cluster authkey, bound to
    the key ``owner/<name>`` and to the cluster's ``run``."""
    return signed_token(store, f"owner/{name}", run, str(node))


def owner_of(store, name: str, held: bytes | None, run: str = "") -> int | None:
    """The node whose token (:func:`owner_token`) ``held`` is, None when it is none
    (missing, or not signed with this cluster's key and ``run``: a forgery)."""
    number = token_body(store, f"owner/{name}", run, held)
    return int(number) if number is not None and number.isdigit() else None


def claim_name(store, liveness: Liveness, node: int, nodes: int, name: str,
               recorded_owner: Callable[[], int | None], refuse: Callable[[], None], run: str = "") -> None:
    """Make node ``node`` (of ``nodes``) the one owner of the published ``name``:
    ``owner/<name>`` set atomically to its token. A name another node owns is refused
    (ValueError) while that node's heartbeat moves; the name of a lost owner is taken
    over (its new generation makes the replicas renew themselves). A forged claim is
    counted (``refuse()``) and the owner the name's signed record names
    (``recorded_owner()``, None when none) decides instead. ``run``: the cluster's."""
    key, mine = f"owner/{name}", owner_token(store, name, node, run)
    if not store.get_unchecked(key):  # looked at before this node's token is there (see below)
        _unless_owned_elsewhere(store, liveness, node, nodes, name, recorded_owner, refuse, run)
    raw = store.compare_set(key, "", mine)  # compared as bytes: the key is unsigned, maybe not UTF-8
    if raw == mine.encode():
        return
    owner = owner_of(store, name, raw, run)
    if owner is None:
        refuse()
        owner = recorded_owner()
    if owner is not None and not (isinstance(owner, int) and 0 <= owner < nodes):
        owner = None  # not a node of this cluster
    if owner is None or owner == node or liveness.known_lost(owner) or not heartbeat_moves(store, owner):
        if store.compare_set(key, raw, mine) == mine.encode():
            return  # its owner is lost (or there is none): this node takes the name over
        raise ValueError(f"{name!r} could not be claimed: owner/{name} changed while this node took it over "
                         "(another node claimed it at the same time). Publish it again, or under another name.")
    raise ValueError(f"{name!r} is owned by node {owner}: a name has one owner node (the others hold "
                     f"replicas and push rows to it). Publish it again on node {owner}, or under another name.")


def _unless_owned_elsewhere(store, liveness: Liveness, node: int, nodes: int, name: str,
                            recorded_owner: Callable[[], int | None], refuse: Callable[[], None], run: str) -> None:
    """``owner/<name>`` is missing (or emptied): a first publish, or the key deleted
    under a live owner (two owners, audit 22). The owner the signed record
    ``name/<name>`` names decides, as for a forged key: while its heartbeat moves its
    token is written back (counted as refused) and the publish is a ValueError naming
    it. Looked at before this node's token is written: for the heartbeat's look, the
    live owner would have read that token as a takeover and given its name up."""
    owner = recorded_owner()
    if not isinstance(owner, int) or not 0 <= owner < nodes or owner == node:
        return  # none, or this node's own
    if liveness.known_lost(owner) or not heartbeat_moves(store, owner):
        return  # its owner is lost: taken over (its new generation renews the replicas)
    refuse()
    store.compare_set(f"owner/{name}", "", owner_token(store, name, owner, run))
    raise ValueError(f"{name!r} is owned by node {owner}: a name has one owner node (the others hold "
                     f"replicas and push rows to it). Publish it again on node {owner}, or under another name.")


def names_taken_over(store, node: int, names: list[str], refuse: Callable[[], None], run: str = "") -> dict[str, str]:
    """Of ``names`` (node ``node`` claimed each), those another node holds now, each
    with that node's number as text: one round trip a name that changes nothing, unless
    a forged claim is found: counted (``refuse()``) and this node's token written back
    (by a compare-and-set against the forged bytes: a real takeover meanwhile stays).
    A deleted or emptied key is one too (a compare-and-set of ``mine`` with itself read
    a missing key as ``mine``: it was never written back, and another node's publish
    then took the name of its live owner)."""
    taken = {}
    for name in names:
        key, mine = f"owner/{name}", owner_token(store, name, node, run)
        held = store.get_unchecked(key)  # one round trip; None when missing
        if held == mine.encode():
            continue
        owner = owner_of(store, name, held, run)
        if owner is None:
            refuse()
            store.compare_set(key, held or "", mine)
        else:
            taken[name] = str(owner)
    return taken


def owner_keys_there(store, names: list[str]) -> bool:
    """Whether ``owner/<name>`` exists for each of ``names``: one round trip (the store's
    ``check`` of all their keys, on the calling thread's connection), whatever their
    number. What a key holds is not read (:func:`names_taken_over` does that)."""
    return not names or store.has_all([f"owner/{name}" for name in names])


def keep_owner_key(store, node: int, name: str, refuse: Callable[[], None], run: str = "") -> bool:
    """Write node ``node``'s token back into ``owner/<name>`` when the key is missing or
    emptied (counted as forged: ``refuse()``), by a compare-and-set against the empty
    key, so that a claim written meanwhile stays; True when it was written back. One
    round trip when the key is there."""
    key = f"owner/{name}"
    if store.get_unchecked(key):
        return False
    refuse()
    mine = owner_token(store, name, node, run)
    return store.compare_set(key, "", mine) == mine.encode()
