"""The pushing half of a :class:`~shared_td.coordinator.cluster.Cluster`: rows of this
node's replica -> the same rows of the owner's tree, in place (:func:`push`).

Why a push skips the store: a request in the store costs a round trip to the store host
and wakes the owner's lane thread, which only then posts its receive for the rows: the
rows wait for two hops between threads and processes before a byte moves (measured on
main before this module: 0.84-1.1 ms per push of 64 rows of 1 KiB, 4.5-5x a raw gloo
send of the same bytes plus one store round trip). So each node keeps one receive posted
on stripe 0 of each pair it holds, for the peer's next push
(:func:`~shared_td.coordinator.cluster_serve.serve_pushes`), of the size of that peer's
last push plus a header while that is at most DIRECT_MAX_BYTES
(:func:`~shared_td.coordinator.cluster_serve.kept_receive_bytes`): a push is one gloo
message (a header signed with the cluster key for that pair generation and numbered,
then the rows) and the owner's signed answer over the same pair. A push of another size
than the posted receive holds sends the header alone, padded to the posted size, then
the rows on the header's tag. A push with no pair built (the
first one, or the first after a failure moved the pair to a new generation) is a
request in the store, as a pull's, which builds the pair.

Only one push per owner travels at a time from this node (the owner keeps one receive
posted per pair, and the headers of a pair generation are numbered in order); the rows
are packed before that lock is taken, under the replica's own lock: a sync or pull that
writes the replica is waited for (within the timeout), so a push never sends rows a
transfer is half-way through.

A push is of the generation of the replica it reads, and the owner writes only rows of
its current one. Once the owner published the name again, the rows the user wrote are
in views of the old generation: while this node renews its replica, the old replica's
push is refused by the owner, and once the new one replaced it (on the owner's notice),
a push of it is refused here, before anything is sent: it would send the owner's own
new values in place of the user's rows (before, it did, and succeeded). Either way a
RuntimeError says that the name was published again and to refresh the views; a call
of ``attach`` in this process that returns the new generation (``shared_td.refresh``
of its view) lets pushes go again.
"""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field

import torch

from shared_td.coordinator import cluster_replica as replica
from shared_td.coordinator.cluster_renewals import renew_failure
from shared_td.coordinator.cluster_serve import HEADER_BYTES, kept_receive_bytes
from shared_td.coordinator.cluster_store import ClusterAuthError
from shared_td.coordinator.cluster_messages import (ANSWER_BYTES, LENGTH_BYTES, answer_context, decode_signed,
                                                    encode_signed, push_context)
from shared_td.coordinator.cluster_transfer import PUSH_TAG, TransferFailed, answer_tag
from shared_td.errors import IndexTypeError
from shared_td.platform import ThreadLock

__all__ = ["MAX_NAME_BYTES", "PushLine", "check_name", "push", "raise_if_republished", "send_answered"]


@dataclass
class PushLine:
    """This node's pushes to one owner: one at a time (``lock``), and what the owner's
    kept receive on pair ``generation`` expects next: ``posted`` bytes, header ``seq``."""

    lock: ThreadLock = field(default_factory=ThreadLock)
    generation: int = -1
    posted: int = HEADER_BYTES
    seq: int = 0


# The fields of a push header besides the name, each at its largest (an int64): what
# check_name leaves room for.
_WORST_HEADER = {"name": "", "generation": 2**63 - 1, "rows": 2**63 - 1, "nbytes": 2**63 - 1,
                 "tag": 2**63 - 1, "seq": 2**63 - 1, "digest": "0" * 16}  # (cluster_generations.layout_digest)
#: The most bytes a name takes as JSON (an ASCII character: one; others: 6 or 12) so that
#: a push of it fits its signed header of HEADER_BYTES (see :func:`check_name`).
MAX_NAME_BYTES = (HEADER_BYTES - LENGTH_BYTES - hashlib.sha256().digest_size
                  - len(json.dumps(_WORST_HEADER).encode()))


def check_name(name: str) -> None:
    """ValueError naming ``name`` when it is too long for a push's header (checked at
    publish, attach and push: a push of it could never be sent)."""
    if len(name) <= MAX_NAME_BYTES // 12:
        return  # fits whatever its characters (each at most 12 bytes as JSON): no encoding per push
    size = len(json.dumps(name).encode()) - 2  # without its quotes
    if size > MAX_NAME_BYTES:
        raise ValueError(f"The name {name[:40]!r}... is too long for a cluster: {size} bytes as JSON, at most "
                         f"{MAX_NAME_BYTES} (an ASCII character is one byte, others 6 or 12), since each push "
                         f"carries it in a signed header of {HEADER_BYTES} bytes. Use a shorter name.")


def push(cluster, name: str, index) -> None:
    """:meth:`Cluster.push <shared_td.coordinator.cluster.Cluster.push>`."""
    check_name(name)
    if name in cluster._owned:
        return  # the owner's replica is its own buffer: the rows are already there
    # free, unless this process was stopped for seconds (its number may be taken over)
    cluster._as_node(f"push({name!r})")
    rep = cluster._replica(name)
    if rep.renewed_from:  # renewed on the owner's notice: the user's rows are in the old views
        raise _republished(name, rep.generation, rep.renewed_from, renewed=True)
    index = _checked_index(name, rep, index)
    deadline = time.monotonic() + cluster.timeout
    message = _packed(cluster, name, rep, index, deadline)
    payload = message[HEADER_BYTES:]
    request = {"name": name, "generation": rep.generation, "digest": rep.digest, "rows": int(index.numel()),
               "nbytes": int(payload.numel())}
    try:
        generation = cluster._groups.generation(rep.owner)  # cached: no round trip
        if cluster._groups.built(rep.owner, generation):
            answer = _over_pair(cluster, rep.owner, generation, request, message, deadline)
        else:  # no pair yet (it is built meanwhile): a request in the store
            def send():
                tag, generation = cluster._request(rep.owner, "push", **request)
                return send_answered(cluster, rep.owner, generation, tag, payload, deadline, f"push of {name!r}")

            answer = cluster._retried_if_stale(send)
    except TransferFailed as err:
        raise cluster._lost_or(rep.owner, name, err) from err
    try:
        cluster._refusal(rep.owner, name, answer)
    except RuntimeError as refusal:
        raise_if_republished(cluster, name, rep, refusal, "push")
        raise


def raise_if_republished(cluster, name: str, rep, refusal: RuntimeError, op: str) -> None:
    """After the owner refused a ``op`` ("push", "pull") of ``rep`` (``refusal``): raise
    the error saying ``name`` was published again when it was (else the caller raises
    ``refusal``). The owner's signed refusal names the generation it owns (``current``,
    see ``cluster_serve.refusal``): it holds a new one before the store names it (the
    name record is a publish's commit point), so a look at the store alone found none
    newer in that window and the bare refusal was raised (audit 20: a quarter of the
    refusals of a push racing re-publishes). The store is looked at (a round trip, on a
    refusal only) when the answer names none."""
    current = getattr(refusal, "current", None)
    if current is None or current <= rep.generation:
        current = _current_generation(cluster, name)
    if current is not None and current > rep.generation:
        failure = renew_failure(cluster, name, rep.generation)
        raise _republished(name, current, rep.generation, renewed=False, op=op, failure=failure) from refusal


def _packed(cluster, name: str, rep, index: torch.Tensor, deadline: float) -> torch.Tensor:
    """The push message of rows ``index`` of ``rep`` (HEADER_BYTES left free in front),
    read once no transfer writes the replica: TimeoutError if one does not end by
    ``deadline``; RuntimeError for a replica no transfer ever filled (the Cluster
    registers none: its zeros, pushed, were written into the owner's data)."""
    rep.lock.refuse_reentry(f"push({name!r})")
    try:
        if not rep.lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise TimeoutError(f"push({name!r}): a transfer into this node's replica of {name!r} did not end within "
                               f"{cluster.timeout:g} s: nothing was sent (retry).")
        if not replica.state(rep.segment):  # (0: no transfer ever wrote it)
            raise RuntimeError(f"push({name!r}): this node's replica of {name!r} was never filled by a transfer, so "
                               f"none of its rows were written here: nothing was sent. Attach {name!r} again, write "
                               "the rows into it, then push.")
        if not rep.leaves:
            rep.leaves = replica.leaf_views(rep.segment, rep.layout)
        return replica.pack_rows(rep.leaves, index, reserve=HEADER_BYTES)
    finally:
        try:
            rep.lock.release()
        except RuntimeError:
            pass  # not taken: timed out, or interrupted before acquire returned (platform.ThreadLock)


def _current_generation(cluster, name: str) -> int | None:
    """The generation of ``name`` in the store, None if it cannot be read (the refusal
    that asked is raised as it was)."""
    try:
        return cluster.generation(name)
    except (KeyError, ConnectionError, RuntimeError, PermissionError):  # (a forged record: ClusterAuthError)
        return None


def _republished(name: str, current: int, held: int, renewed: bool, op: str = "push",
                 failure: BaseException | None = None) -> RuntimeError:
    """The error of a push of ``name`` whose user's rows are in views of generation
    ``held`` while the owner published generation ``current``: ``renewed``, this node's
    replica was renewed meanwhile (refused here), else the owner refused it (a push or,
    ``op="pull"``, a pull: it sent nothing), while the node renews its replica or after
    that renew failed (``failure``: its error). A RuntimeError, its ``current`` the
    generation."""
    renewing = "it is being renewed" if failure is None else \
        f"its renew failed: {type(failure).__name__}: {failure}; attach({name!r}) renews it"
    if renewed:
        what = (f"this node renewed its replica on the owner's notice, and the rows written into views of generation "
                f"{held} are not in the new one (a push would send the owner's own values in their place): "
                "nothing was sent")
    elif op == "pull":
        what = f"this node's replica is still of generation {held} ({renewing}): the owner sent nothing"
    else:
        what = f"this node's replica is still of generation {held} ({renewing}), and the owner wrote none of its rows"
    then = "write the rows into them, then push" if op == "push" else "then pull"
    error = RuntimeError(f"{op}({name!r}): {name!r} was published again (generation {current}) and {what}. "
                         f"Refresh the views (shared_td.refresh(view); in the {op}ing process, attach({name!r}) "
                         f"again), {then}.")
    error.current = current  # (an attach that met it tries the new generation: Cluster._published_since)
    return error


def _checked_index(name: str, rep, index) -> torch.Tensor:
    """The rows of ``rep``'s first batch dimension that ``td[index]`` selects, as int64:
    an int, a slice or range, ints in a sequence, tensor or array (negative ones counted
    from the end, as ``td[-1]``), or a boolean (or uint8) mask as long as that dimension. IndexError
    naming ``name`` for a row out of range or a mask of another length, ValueError for a
    slice's step below 1 (as torch's); IndexTypeError for any other index (a float one
    was truncated and a mask taken as rows 0 and 1 before)."""
    if not rep.layout["batch_size"]:
        raise IndexError(f"push({name!r}): {name!r} has no batch dimension, so no rows to push "
                         "(pull and sync move it whole).")
    rows = rep.layout["batch_size"][0]
    if type(index) is torch.Tensor and index.dtype is torch.int64 and index.dim() == 1 and index.device.type == "cpu":
        return _in_range(name, index, rows)  # the usual index: no conversion
    if isinstance(index, slice):
        if index.step is not None and index.step <= 0:  # as td[::-1]
            raise ValueError(f"push({name!r}): a slice's step must be greater than zero.")
        return torch.arange(*index.indices(rows))
    if isinstance(index, (str, bytes)):  # a str is a sequence to list(); never rows
        raise IndexTypeError(f"push({name!r}): rows are ints, a slice or a boolean mask, not {index!r}.")
    try:
        index = torch.as_tensor(list(index) if isinstance(index, range) else index, device="cpu")
    except (TypeError, ValueError, RuntimeError) as err:  # None, a str among ints, an object: torch
        # names neither the name nor what a push takes
        raise IndexTypeError(f"push({name!r}): rows are ints, a slice or a boolean mask, not {index!r} "
                             f"({str(err).splitlines()[0][:100]}).") from err
    if not index.numel():
        return index.to(torch.int64).reshape(-1)  # [] is a float tensor to torch: no rows
    if index.dtype in (torch.bool, torch.uint8):  # a uint8 one too, as torch reads it (and shared_td)
        if index.shape != (rows,):
            raise IndexError(f"push({name!r}): a boolean mask selects rows of the first dimension: it needs "
                             f"{rows} values, not shape {tuple(index.shape)}.")
        return index.bool().nonzero().reshape(-1)
    if index.is_floating_point() or index.is_complex():
        raise IndexTypeError(f"push({name!r}): rows are ints, a slice or a boolean mask, not {index.dtype} values.")
    return _in_range(name, index.to(torch.int64).reshape(-1), rows)


def _in_range(name: str, index: torch.Tensor, rows: int) -> torch.Tensor:
    """``index`` (int64, one dimension) with negative rows counted from the end, as
    ``td[-1]``; IndexError naming ``name`` for a row out of range."""
    if not index.numel():
        return index
    low, high = (int(end) for end in torch.aminmax(index))
    if low < 0:  # -1: the last row, as td[-1]
        index = torch.where(index < 0, index + rows, index)
        low, high = (int(end) for end in torch.aminmax(index))
    if not 0 <= low <= high < rows:
        raise IndexError(f"push({name!r}): an index is out of range for {rows} rows.")
    return index


def _over_pair(cluster, owner: int, generation: int, request: dict, message: torch.Tensor,
               deadline: float) -> dict:
    """Send a push into the receive ``owner`` keeps posted on the pair of ``generation``
    and return its answer. The header and the rows (``message[HEADER_BYTES:]``) go as one
    message when they fill that receive exactly (gloo completes a receive larger than its
    message 10-40x slower, see cluster_transfer), else the header alone, padded to the
    posted size, then the rows."""
    line = cluster._push_lines.setdefault(owner, PushLine())
    line.lock.refuse_reentry(f"push to node {owner}")
    try:
        if not line.lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise TransferFailed(f"another push to node {owner} did not end in time")
        if line.generation != generation:  # a new pair: its receive is posted for a header
            line.generation, line.posted, line.seq = generation, HEADER_BYTES, 0
        tag = cluster._next_tag()
        # encoded before the line moves on: a header that does not fit (ValueError) must
        # leave seq and posted as the owner's kept receive expects them, or every later
        # push to this owner is refused as out of order
        header = encode_signed(cluster._store, push_context(cluster.node, owner, generation),
                               {**request, "tag": tag, "seq": line.seq + 1}, HEADER_BYTES, out=message)
        line.seq += 1
        rows = message[HEADER_BYTES:]
        posted, line.posted = line.posted, kept_receive_bytes(int(rows.numel()))  # what the owner posts next
        what = f"push of {request['name']!r}"
        if message.numel() == posted:
            return send_answered(cluster, owner, generation, tag, message, deadline, what, send_tag=PUSH_TAG)
        padded = torch.zeros(posted, dtype=torch.uint8)
        padded[:HEADER_BYTES] = header
        if not rows.numel():  # no rows: the header alone
            return send_answered(cluster, owner, generation, tag, padded, deadline, what, send_tag=PUSH_TAG)
        return send_answered(cluster, owner, generation, tag, rows, deadline, what, header=padded)
    finally:
        try:
            line.lock.release()
        except RuntimeError:
            pass  # not taken: timed out, or interrupted before acquire returned (platform.ThreadLock)


def send_answered(cluster, peer: int, generation: int, tag: int, payload: torch.Tensor, deadline: float, what: str,
                  stripes: int = 1, header: torch.Tensor | None = None, send_tag: int | None = None) -> dict:
    """Send ``payload`` (a push's rows, a sync's contents) for request ``tag`` over
    ``stripes`` groups (on ``send_tag`` if given; after ``header`` on PUSH_TAG, if given)
    and receive the peer's signed answer over the pair (its receive posted beside the
    send, so that it is there when the peer answers). TransferFailed, every group of the
    pair failed, when any does not end in time or the answer's signature is wrong."""
    buffer = getattr(cluster._local, "answer", None)
    if buffer is None:
        buffer = cluster._local.answer = torch.empty(ANSWER_BYTES, dtype=torch.uint8)
    groups = cluster._groups
    try:
        # the answer's receive first: posted after the send, it waited for this thread
        # to run again after its write (measured at load 6-7: the owner had the rows
        # written at 0.6 ms and its answer waited ~3 ms for the receive)
        works = groups.recv(peer, generation, buffer, answer_tag(tag), deadline)
        if header is not None:
            works += groups.send(peer, generation, header, PUSH_TAG, deadline)
        works += groups.send(peer, generation, payload, tag if send_tag is None else send_tag, deadline, stripes)
        # (ends once the peer is found lost, or moved the pair on)
        groups.wait(peer, works, deadline, what, int(payload.numel()), generation=generation)
        try:
            return decode_signed(cluster._store, answer_context(peer, cluster.node, generation, tag), buffer)
        except ClusterAuthError as err:
            cluster.refused += 1  # forged: never acted on, and the pair is not trusted further
            raise TransferFailed(f"the answer to the {what} is not signed with this cluster's key") from err
    except TransferFailed:
        groups.fail(peer, generation)
        raise
