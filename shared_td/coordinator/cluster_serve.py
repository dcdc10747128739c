"""The serving half of a :class:`~shared_td.coordinator.cluster.Cluster`: the threads
that answer the other nodes.

Each node has one *lane* per peer node (:func:`serve_lane`): a thread that pops that
peer's requests from their own queue ``lane/<node>/<peer>`` (:func:`lane_queue`) and
serves them one at a time, in the order sent, so that a peer that stops answering holds
up only its own lane. Requests are ``pull`` (send the owner's contents), ``push`` (receive
rows into the owner's tensordict), ``sync`` (receive a new version into this node's
replica), ``renew`` (the owner published the name again: make the new replica),
``values`` (a replica found a value's stored record forged: the owner stores it again) and
``cancel`` (a pull given up: ``cluster_deliveries.cancel``, ``cluster_drain``). One
service thread (:func:`serve_notices`) applies the small notices of ``queue/<node>``:
non-tensor values, new pair generations, stop.

A lane never waits for a peer: a renew (a pull from the owner) is made by the node's
renew thread (:mod:`~shared_td.coordinator.cluster_renewals`). Nor for a lock whose
holder may wait for a lane: a pull that finds a delivery of its name under way (a sync
waits for the replica nodes' lanes) waits for one of the node's few delivery threads
(:mod:`~shared_td.coordinator.cluster_deliveries`), and is not served once its
requester gave up (its ``budget``). How a serving thread reads its queue, and why it
ends only when the node stops, the store's host is lost or its number was taken over:
:mod:`~shared_td.coordinator.cluster_inbox`.

Pushes skip the lanes once a pair is built: for each pair it holds, a node keeps one
receive posted on the pair's stripe 0 for the peer's next push, in a thread of its own
(:func:`serve_pushes`, started by :func:`listen` when the pair is built), and a watch
thread (:func:`watch_pairs`) closes the pairs of a peer whose heartbeat stands still, so
that no kept receive waits on a dead peer. The first push on a pair is a lane request.

Payloads go over the pair's gloo group with the request's tag, each wait bounded by the
cluster's timeout. The answer to a pull (sent before its payload: the version) is a
signed value pushed to the requester's reply queue; the answer to a push or a sync comes
after its payload, over the pair, signed for that request
(:func:`~shared_td.coordinator.cluster_messages.encode_signed`): no store round trip
and no thread of the sender's node in between. A request for what this node does not
hold is answered with a refusal (after receiving any payload into scratch memory, so
that the sender's send ends); a failed transfer marks the pair's group failed, so that
the requester's own wait fails too. Requests that arrive in another sender's lane, or
that repeat one the lane took, are counted in ``Cluster.refused`` and never acted on.

These functions take the Cluster they serve: they are its methods, kept apart from the
calling half (:mod:`~shared_td.coordinator.cluster`) so that each reads on its own.
"""
from __future__ import annotations

import datetime
import itertools
import threading
import time

import torch

from shared_td.coordinator import cluster_replica as replica
from shared_td.coordinator.cluster_deliveries import cancel, deliver
from shared_td.coordinator.cluster_renewals import renew
from shared_td.coordinator.cluster_replica import Owned, Replica
from shared_td.coordinator.cluster_generations import same
from shared_td.coordinator.cluster_inbox import POP_S, Served, serving, signed_requests
from shared_td.coordinator.cluster_store import ClusterAuthError
from shared_td.coordinator.cluster_liveness import HEARTBEAT_S
from shared_td.coordinator.cluster_owner_keys import OwnerKeys
from shared_td.coordinator.cluster_messages import answer_context, decode_signed, encode_signed, push_context
from shared_td.coordinator.cluster_transfer import (DIRECT_MAX_BYTES, StalePair, TransferFailed, answer_tag,
                                                    stripe_ranges)
from shared_td.coordinator.cluster_waits import wait_work
from shared_td.coordinator.cluster_wake import WATCH_S

# (POP_S: cluster_inbox's, named here for the node's shutdown; the rest: used by other modules)
__all__ = ["HEADER_BYTES", "LISTENER", "POP_S", "kept_receive_bytes", "lane_queue", "listen", "refusal",
           "serve_lane", "serve_notices", "serve_pushes", "watch_pairs"]

#: Bytes of a push header, the start of the receive kept posted per pair for the peer's
#: next push (signed JSON: name, generation, tag, seq, rows, nbytes).
HEADER_BYTES = 512
#: The longest a kept push receive waits (a backstop: shutdown, a failure and a peer
#: found lost close the pair earlier); its end closes the pair, rebuilt by the next
#: transfer.
LISTEN_S = 24 * 3600.0


#: The start of the name of a thread that keeps a receive posted for a peer's pushes.
LISTENER = "shared_td-cluster-pushes-"
#: The largest payload for what this node does not hold that it still receives (into
#: scratch, then refused): a larger one fails the pair, which ends the sender's send (a
#: node restarted without a replica got every sync of a 256 MB name: its memory doubled).
UNHELD_SCRATCH_BYTES = 1 << 20


def kept_receive_bytes(rows_bytes: int) -> int:
    """Bytes of the receive kept posted for a peer's next push, after a push of
    ``rows_bytes`` bytes of rows: its header and rows in one message when that message
    is at most DIRECT_MAX_BYTES, else the header alone (the rows then come as a second
    message, on the header's tag). A kept receive is waited for in the listening
    thread, which cannot watch the peer's heartbeat, and gloo never ends a receive
    whose message was cut by the sender's death (see cluster_waits): a message of at
    most DIRECT_MAX_BYTES is written whole as it is posted, so it is never cut, and
    larger rows are waited for as any transfer, given up once the pusher is found lost
    (an 11 MB push cut by a SIGKILL left the listening thread waiting LISTEN_S, a day)."""
    size = HEADER_BYTES + rows_bytes
    return size if size <= DIRECT_MAX_BYTES else HEADER_BYTES


def lane_queue(node: int, peer: int) -> str:
    """The queue of ``peer``'s requests to ``node``."""
    return f"lane/{node}/{peer}"


def serve_notices(cluster) -> None:
    """The service thread: apply the notices of ``queue/<node>`` until stopped."""
    serving(cluster, lambda: _serve_notices(cluster))


def _serve_notices(cluster) -> None:
    for request in signed_requests(cluster, f"queue/{cluster.node}"):
        try:
            if request.get("op") == "pair":  # the peer moved our pair to a new generation
                cluster._groups.seen(request["from"], request["generation"])
            elif request.get("op") == "value":  # applied here, in order
                cluster._values.receive(request)
            else:
                cluster.refused += 1  # signed, but not a notice
        except Exception:  # noqa: BLE001 - a bad notice must not stop the service
            cluster.refused += 1


def serve_lane(cluster, peer: int) -> None:
    """Serve ``peer``'s requests, one at a time, in the order sent, until stopped."""
    serving(cluster, lambda: _serve_lane(cluster, peer))


def _serve_lane(cluster, peer: int) -> None:
    served = Served()
    for request in signed_requests(cluster, lane_queue(cluster.node, peer)):
        if request.get("from") != peer:
            cluster.refused += 1  # signed, but not in its sender's lane
            continue
        try:
            if not served.first(request):
                cluster.refused += 1  # a replay of a request this lane took
                continue
            _handle(cluster, request)
        except Exception:  # noqa: BLE001 - signed but malformed (a field missing or of another type):
            cluster.refused += 1  # counted; a lane that ended would leave the peer's later requests unserved


def _handle(cluster, request: dict) -> None:
    peer, op, name = request["from"], request["op"], request["name"]
    if op == "renew":
        renew(cluster, name, request["generation"])
        return
    if op == "cancel":  # a pull given up by its requester (see cluster_drain)
        _reply(cluster, request, cancel=cancel(cluster, name, request))
        return
    _answered(cluster, request, lambda: _serve(cluster, peer, op, name, request))


def _serve(cluster, peer: int, op: str, name: str, request: dict) -> None:
    if op == "pull":  # (off the lane while the name's deliveries are busy: see cluster_deliveries)
        if not _refused(cluster, request, cluster._owned.get(name)):
            deliver(cluster, name, request, lambda until: _answered(
                cluster, request, lambda: _serve_pull(cluster, peer, request, until)))
    elif op == "values":  # a replica found a value's stored record forged
        _reply(cluster, request, restored=cluster._values.restore(name, request["generation"]))
    elif op == "push":
        _serve_receive(cluster, peer, request, cluster._owned.get(name), _apply_rows)
    elif op == "sync":  # (the replica an attach is filling, when of that generation)
        _serve_receive(cluster, peer, request, cluster._receiving(name, request["generation"],
                                                                 request.get("digest")), _apply_sync)


def _answered(cluster, request: dict, serve) -> None:
    """``serve()``, its failure answered as the requester expects it (a pull, in the
    store; a transfer over a pair, by failing the pair)."""
    peer, op = request["from"], request["op"]
    try:
        serve()
    except StalePair as err:  # nothing transferred: a pull may retry at once
        if op == "pull":  # (a push or sync sender waits over the pair: its bounded wait ends it)
            try:
                _reply(cluster, request, error=str(err), stale_pair=cluster._groups.generation(peer))
            except (RuntimeError, OSError):
                pass  # the store is gone
    except TransferFailed:
        cluster._groups.fail(peer, request["pair"])  # the requester's own wait fails too
    except Exception as err:  # answered, so that the requester does not wait in vain
        if op not in _ANSWERED_IN_THE_STORE:  # not answered over the pair (a malformed request): end its transfer
            if isinstance(request.get("pair"), int):
                cluster._groups.fail(peer, request["pair"])
            return
        try:
            _reply(cluster, request, error=f"{type(err).__name__}: {err}")
        except (RuntimeError, OSError):
            pass  # the store is gone


#: The requests answered in the requester's reply queue (the others over their pair).
_ANSWERED_IN_THE_STORE = ("pull", "values")


def _reply(cluster, request: dict, **answer) -> None:
    """Answer ``request`` in its reply queue, for the process that asked (its
    ``caller``): a node restarted under the same number reuses the queue and the tags,
    and must not take an answer meant for its previous process."""
    cluster._store.push_json(request["reply"], {"tag": request["tag"], "caller": request.get("caller"), **answer})


def _serve_pull(cluster, peer: int, request: dict, until: float) -> None:
    """Send the owner's contents for a pull (a replica's ``pull``, first attach or renew)
    as a delivery of their own: with the name's delivery lock held (taken by
    :func:`~shared_td.coordinator.cluster_deliveries.deliver`, in the lane only when it
    was free at once) and the next version (see ``cluster_sync.NameSyncs``), so that no
    sync overtakes it and each version a replica holds labels one delivery. It starts
    only before ``until``, when its requester gives up; once answered, its send is
    bounded as any transfer's (``wait_bound``): a requester that gave up meanwhile
    still receives it, into scratch (``cluster_drain``; before, the send waited for
    nobody until ``until``, then gloo closed the pair: every transfer between the two
    nodes failed). The requester waits for
    the answer without its replica's lock, so a sync under way to it ends meanwhile
    (holding that lock, it waited for the sync, which waited for it)."""
    owned = cluster._owned.get(request["name"])  # (published again while this waited: refused)
    if _refused(cluster, request, owned):
        return
    group_pair = request["pair"]
    cluster._groups.check(peer, group_pair)  # before the answer: the requester's receive follows it
    stripes = _stripes(request)  # before the answer: a bad count is refused, nothing posted
    owned.version += 1
    _reply(cluster, request, version=owned.version)
    payload = replica.segment_bytes(owned.segment, owned.layout["nbytes"])
    bound = time.monotonic() + cluster.timeout  # (and WAIT_SLACK_S + its bytes at MIN_RATE: wait_bound)
    works = cluster._groups.send(peer, group_pair, payload, request["tag"], bound, stripes)
    cluster._groups.wait(peer, works, bound, "pull", owned.layout["nbytes"], generation=group_pair)


def _refused(cluster, request: dict, owned) -> bool:
    """Refuse a pull of what this node does not hold (answered; True), naming the
    generation it holds now (see :func:`refusal`)."""
    if same(owned, request["generation"], request.get("digest")):  # (a digest: of this publish's layout)
        return False
    _reply(cluster, request, **refusal(cluster, request))
    return True


def refusal(cluster, request: dict) -> dict:
    """The answer refusing ``request`` for a generation of its name this node does not
    hold: the error, and the generation it owns now (``current``, signed with the
    answer), by which the requester tells a re-publish (the rows or the pull were of the
    old one: "published again, refresh the views") from other refusals. The owner
    holds a new generation before the store names it (the name record is its commit
    point), so the requester's look at the store alone found no newer one in between
    and raised the bare refusal (audit 20)."""
    owned = cluster._owned.get(request["name"])
    return {"error": f"node {cluster.node} has no generation {request['generation']} of {request['name']!r}",
            "current": owned.generation if owned is not None else None}


def _stripes(request: dict) -> int:
    """The stripes a request's payload goes over (1 when it names none: a push);
    ValueError for a count this node refuses (see ``stripe_ranges``)."""
    stripes = request.get("stripes", 1)
    stripe_ranges(request.get("nbytes", 0), stripes)  # checks the count
    return stripes


def _serve_receive(cluster, peer: int, request: dict, entry, apply) -> None:
    """Receive a push (on the owner) or a sync (on a replica), and answer over the pair.
    A request for what this node does not hold is refused: its payload, when at most
    UNHELD_SCRATCH_BYTES, is received into scratch memory, so that the sender's send
    ends, and answered with the refusal; a larger one raises TransferFailed (the pair
    is failed: the sender's send ends, nothing of its size is made here). An error
    after the payload came is answered too. A failed transfer raises TransferFailed."""
    tag = request["tag"]
    stripes = _stripes(request)  # a count refused here fails the pair (see _handle): the sender's wait ends
    try:
        if not same(entry, request["generation"], request.get("digest")):
            if request["op"] == "sync":
                _correct_record(cluster, request["name"])
            answer = refusal(cluster, request) if request["op"] == "push" else {
                "error": f"node {cluster.node} has no generation {request['generation']} of {request['name']!r}"}
            if request["nbytes"] > UNHELD_SCRATCH_BYTES:
                raise TransferFailed(f"{answer['error']}: its {request['nbytes']} bytes were not received")
            scratch = torch.empty(request["nbytes"], dtype=torch.uint8)
            deadline = time.monotonic() + cluster.timeout
            works = cluster._groups.recv(peer, request["pair"], scratch, tag, deadline, stripes)
            cluster._groups.wait(peer, works, deadline, request["op"], request["nbytes"], generation=request["pair"])
        else:
            apply(cluster, peer, entry, request)
            answer = {"ok": True}
    except TransferFailed:
        raise
    except Exception as err:  # noqa: BLE001 - answered: the sender raises it
        answer = {"error": f"{type(err).__name__}: {err}"}
    works = _answer_over_pair(cluster, peer, request["pair"], tag, answer)
    # waited for here: a send of ANSWER_BYTES is written whole into the socket at once,
    # so gloo ends it even when the peer dies (only a message under way is left hanging)
    wait_work(works, time.monotonic() + cluster.timeout, f"answer to node {peer}")


def _correct_record(cluster, name: str) -> None:
    """A sync came for a generation of ``name`` that this node does not hold: the record
    that sent it here (``has/<name>/<node>``: a previous process's, or of an attach that
    failed) is corrected, so the owner's next sync does not come: deleted when no
    replica is held, else naming the generation held. Only while no attach runs (each
    holds the attach lock and writes the record)."""
    if not cluster._attaching.acquire(blocking=False):
        return
    try:
        held = cluster._replicas.get(name)
        if held is None:
            cluster._store.delete(f"has/{name}/{cluster.node}")
        else:
            replica.record_replica(cluster, cluster._store, name, held.generation, held.digest)
    except (RuntimeError, OSError):
        pass  # the store is gone: no sync comes any more
    finally:
        cluster._attaching.release()


def _answer_over_pair(cluster, peer: int, generation: int, tag: int, answer: dict) -> list:
    """Post the send of ``answer`` to ``peer``'s request ``tag``, signed for it, into the
    receive the requester posted beside its send; returns its works (the message lives
    as long as they are held)."""
    message = encode_signed(cluster._store, answer_context(cluster.node, peer, generation, tag), answer)
    return cluster._groups.send(peer, generation, message, answer_tag(tag))


def listen(cluster, peer: int, generation: int) -> None:
    """Stripe 0 of the pair with ``peer`` was built at ``generation``: start the thread
    that keeps a receive posted on it for that peer's pushes (:func:`serve_pushes`)."""
    if cluster._stop.is_set():
        return
    # the listeners of the generations closed since: each failure makes a new one, and
    # the list kept every Thread a long-running node ever made (one per pair generation)
    for ended in [t for t in list(cluster._threads) if t.name.startswith(LISTENER) and not t.is_alive()]:
        try:
            cluster._threads.remove(ended)
        except ValueError:
            pass  # another pair's listen() removed it meanwhile
    thread = threading.Thread(target=serve_pushes, args=(cluster, peer, generation), daemon=True,
                              name=f"{LISTENER}{peer}-{generation}")
    thread.start()
    cluster._threads.append(thread)


def serve_pushes(cluster, peer: int, generation: int) -> None:
    """Keep one receive posted on stripe 0 of the pair with ``peer`` (at ``generation``)
    for that peer's next push, and serve each that comes: a signed header of
    HEADER_BYTES and, in the same message, the rows when the receive posted for it
    holds them (:func:`kept_receive_bytes` of the last push: the pusher knows it too);
    other rows come as a second message, on the header's tag. A header
    that does not verify for this pair generation, or that repeats or skips a push of it
    (its ``seq``), is counted in ``Cluster.refused`` and never acted on. Ends when the
    pair is closed, which ends the posted receive: a failed transfer, shutdown, the peer
    found lost (:func:`watch_pairs`), or LISTEN_S without a push (the backstop: gloo
    closes the pair of a wait that times out)."""
    context = push_context(peer, cluster.node, generation)
    buffer = torch.empty(HEADER_BYTES, dtype=torch.uint8)
    served = 0
    try:
        work = cluster._groups.listen(peer, generation, buffer)
        _connect(cluster)
        while not cluster._stop.is_set():
            try:
                work.wait(datetime.timedelta(seconds=LISTEN_S))
            except RuntimeError as err:
                raise TransferFailed(f"the pair with node {peer} closed: {str(err).splitlines()[0][:300]}") from err
            try:
                header = decode_signed(cluster._store, context, buffer[:HEADER_BYTES])
            except ClusterAuthError:
                header = None  # forged, or another cluster's
            if header is None or header.get("seq") != served + 1:  # forged or replayed: never acted on
                cluster.refused += 1
                work = cluster._groups.listen(peer, generation, buffer)
                continue
            if not cluster._liveness.still_mine():  # the push was meant for this node's successor:
                cluster._groups.fail(peer, generation)  # unanswered, the pusher retries over a new pair
                return
            served += 1
            answer = _apply_push(cluster, peer, generation, header, buffer[HEADER_BYTES:])
            answering = _answer_over_pair(cluster, peer, generation, header["tag"], answer)
            # the rows are written, the buffer is free: the next receive is posted after
            # the answer, while the pusher reads it (before it, it held the answer up by
            # the cost of a post, ~25 us of a ~500 us push); the pusher's next send waits
            # for it in gloo (a send goes once its receive is posted), never in vain
            size = kept_receive_bytes(header["nbytes"])
            if buffer.numel() != size:
                buffer = torch.empty(size, dtype=torch.uint8)
            work = cluster._groups.listen(peer, generation, buffer)
            # the answer's send, waited for here, while the pusher reads it: see _serve_receive
            wait_work(answering, time.monotonic() + cluster.timeout, f"answer to node {peer}")
    except Exception:  # noqa: BLE001 - a transfer failed (or a node with our key sent a malformed header)
        if not cluster._stop.is_set() and cluster._groups.built(peer, generation):
            cluster._groups.fail(peer, generation)  # ends the pusher's wait; the next transfer builds a new pair


def _connect(cluster) -> None:
    """Give this thread a spare store connection now, while the store host is there
    (a spare is nearly always ready: each taken is replaced in the background): a
    thread's first store call connects, and a connect to a lost host is retried for the
    cluster's timeout, in which a node that stops meanwhile exits with this daemon
    thread inside torch's connect (the process aborts there). Not a connect of its own
    now: that can stall 5 s in a reverse DNS lookup, which held up shutdown's join."""
    try:
        cluster._store.connect(spare_only=True)
    except (RuntimeError, OSError):
        pass  # the store is gone already: the thread's store calls fail, as the others'


def _apply_push(cluster, peer: int, generation: int, header: dict, inline: torch.Tensor) -> dict:
    """Write the rows a push ``header`` announced (``inline`` when they came with it,
    else received now: TransferFailed if they do not come); returns the answer."""
    nbytes = header["nbytes"]
    if inline.numel() == nbytes or not nbytes:  # came with the header, or no rows at all
        rows = inline[:nbytes]
    else:  # a second message, on the header's tag
        rows = torch.empty(nbytes, dtype=torch.uint8)
        deadline = time.monotonic() + cluster.timeout
        works = cluster._groups.recv(peer, generation, rows, header["tag"], deadline)
        cluster._groups.wait(peer, works, deadline, "push", nbytes, generation=generation)
    owned = cluster._owned.get(header["name"])
    try:
        if not same(owned, header["generation"], header.get("digest")):
            return refusal(cluster, header)
        _write_rows(owned, rows, header["rows"])
        return {"ok": True}
    except Exception as err:  # noqa: BLE001 - answered: the pusher raises it
        return {"error": f"{type(err).__name__}: {err}"}


def watch_pairs(cluster) -> None:
    """Close the pairs with peers whose heartbeat stands still, so that the receives
    kept posted for their pushes end (gloo does not always end a receive whose peer
    died), and wake the threads that wait for such a peer's answer
    (:class:`~shared_td.coordinator.cluster_wake.AnswerWaits`), until stopped: a
    paired peer every HEARTBEAT_S, one waited for every WATCH_S (as its waiting
    thread looked before). The peer is not marked lost for the calls: a node that was
    only stopped gets its second look there (``Liveness.still_lost``), and its next
    transfer builds a new pair. It keeps the node's owner keys too (off the heartbeat
    thread: :class:`~shared_td.coordinator.cluster_owner_keys.OwnerKeys`)."""
    _connect(cluster)
    every = max(1, round(HEARTBEAT_S / WATCH_S))
    keys = OwnerKeys(cluster)
    for tick in itertools.count():
        if cluster._stop.wait(WATCH_S):
            return
        try:
            keys.keep()
        except ConnectionError:
            return  # the store is gone
        except Exception:  # noqa: BLE001 - (a publish lock held past the timeout): looked at next round
            cluster.serve_errors += 1
        waited = cluster._waits.peers()
        for peer in range(cluster.nodes):
            paired = tick % every == 0 and peer != cluster.node and cluster._groups.stripes(peer) is not None
            if not paired and peer not in waited:
                continue
            try:
                if cluster._alive(peer):
                    continue
                if paired:
                    cluster._groups.forget(peer)
                cluster._waits.wake(cluster._store, peer)
            except (RuntimeError, OSError):
                return  # the store is gone: shutdown closes the pairs, the waits' pops fail


def _apply_rows(cluster, peer: int, owned: Owned, request: dict) -> None:
    buffer = torch.empty(request["nbytes"], dtype=torch.uint8)
    works = cluster._groups.recv(peer, request["pair"], buffer, request["tag"])
    cluster._groups.wait(peer, works, time.monotonic() + cluster.timeout, "push", request["nbytes"],
                         generation=request["pair"])
    _write_rows(owned, buffer, request["rows"])


def _write_rows(owned: Owned, message: torch.Tensor, rows: int) -> None:
    if not owned.leaves:
        owned.leaves = replica.leaf_views(owned.segment, owned.layout)
    replica.unpack_rows(owned.leaves, message, rows)


def _apply_sync(cluster, peer: int, rep: Replica, request: dict) -> None:
    if not rep.lock.acquire(timeout=cluster.timeout):
        raise TransferFailed("a pull of the same replica did not end")
    try:
        stripes = _stripes(request)
        deadline = time.monotonic() + cluster.timeout
        replica.set_state(rep.segment, replica.state(rep.segment) | 1)
        works = cluster._groups.recv(peer, request["pair"], replica.segment_bytes(rep.segment, rep.layout["nbytes"]),
                                     request["tag"], deadline, stripes)
        # every stripe, before the version; given up once the owner is found lost, so
        # that this replica's lock does not hold a pull up for the wait's whole bound
        cluster._groups.wait(peer, works, deadline, "sync", request["nbytes"], generation=request["pair"])
        replica.set_state(rep.segment, 2 * request["version"])
    except TransferFailed:
        # the pair is failed before the lock goes (_handle's fail then finds it moved
        # on and only repeats the notice): a pull that waited for the lock sent its
        # request for the pair about to be closed and failed with a ConnectionError, the
        # owner alive. (No half-written replica is marked complete: the state stays odd.)
        cluster._groups.fail(peer, request["pair"])
        raise
    finally:
        rep.lock.release()
