"""A pull given up by its requester, received anyway: the owner's send always finds its
receive, so that no gloo wait of the pair times out.

Why: a gloo send whose receive never comes waits out its bound, and gloo then closes the
pair: the owner failed it, and every other transfer between the two nodes (a sync of
another name, other threads' pulls) failed with it. A requester gives up a pull in two
places, each handled here:

- waiting for the owner's answer (``ClusterRequests._answer``: its timeout passed while
  the pull waited on the owner, in its lane or for the name's delivery): the owner may
  still answer it and send. :func:`abandoned` hands the thread's reply queue to a drain
  thread (the thread takes a new one; the drain hands the old one back when it ends,
  for reuse: the store's host keeps every queue it met) and asks the owner to ``cancel`` the pull, in the
  same lane, so after it: the owner's answer to the cancel says whether the pull was
  dropped, is served, or was answered before (``cluster_deliveries.cancel``). The drain
  pops the old queue until that answer, bounded: an announce (a version) met on the
  way is received into scratch at once (:func:`into_scratch`);
- after the answer, waiting for its replica's lock (another transfer of the name on this
  node): the payload is received into scratch, then TimeoutError. A pull that got its
  answer receives into its replica within the transfer's own bound (:func:`receive_bound`)
  rather than its caller's deadline: the owner's send is bounded the same way.

Every wait is bounded: the drain by the owner's answer to the cancel (its lane may be
busy with earlier requests: it waits for them, asking again after each node timeout, up
to UNANSWERED_ASKS timeouts in a row: then the pair is failed, as before the drain,
unless the pull's payload was received already), each receive
by ``wait_bound``; both end when the owner is found lost (the pair is failed then, as
for any wait on a lost peer) or this node shuts down. A drain that cannot start (the
thread limit) fails the pair instead, as before the drain, and the pull's TimeoutError
goes on.

Example (the bound of an announced pull's receive, for a stand-in node)::

    >>> import types
    >>> 0 < receive_bound(types.SimpleNamespace(timeout=2.0)) - time.monotonic() <= 2.0
    True
"""
from __future__ import annotations

import threading
import time

import torch

from shared_td.coordinator.cluster_serve import lane_queue
from shared_td.coordinator.cluster_store import ClusterAuthError
from shared_td.coordinator.cluster_wake import WAKE_KEY, pop_bound
from shared_td.errors import StalePair, TransferFailed

__all__ = ["DRAINER", "abandoned", "answer", "into_scratch", "receive_bound"]

#: The name of a thread that drains a pull given up.
DRAINER = "shared_td-cluster-drain"


def receive_bound(cluster) -> float:
    """The deadline of an announced pull's receive (and the owner's send): the node's
    timeout from now, within which ``wait_bound`` allows WAIT_SLACK_S plus the bytes at
    MIN_RATE."""
    return time.monotonic() + cluster.timeout


def into_scratch(cluster, owner: int, pair: int, tag: int, nbytes: int, stripes: int, what: str) -> bool:
    """Receive the payload that ``owner`` announced for request ``tag`` into scratch
    memory (nobody wants it: the owner's send ends); True once received. A failure fails
    the pair (gloo closed it, the owner's send failed with it)."""
    deadline = receive_bound(cluster)
    try:
        works = cluster._groups.recv(owner, pair, torch.empty(nbytes, dtype=torch.uint8), tag, deadline, stripes)
        cluster._groups.wait(owner, works, deadline, what, nbytes, generation=pair)
        return True
    except StalePair:
        return False  # the pair moved on: the owner's send failed with the old one
    except TransferFailed:
        cluster._groups.fail(owner, pair)
        return False


def answer(cluster, owner: int, name: str, asked: list, deadline: float, nbytes: int, stripes: int) -> dict:
    """``cluster._answer`` to the pull ``asked`` (its tag and pair generation) of
    ``name`` from ``owner``; when it times out, the pull is :func:`abandoned` first."""
    try:
        return cluster._answer(owner, asked[0], deadline, name)
    except TimeoutError:
        abandoned(cluster, owner, name, *asked, nbytes, stripes)
        raise


def abandoned(cluster, owner: int, name: str, tag: int, pair: int, nbytes: int, stripes: int) -> None:
    """The calling thread gave up waiting for the answer to pull ``tag`` of ``name``
    from ``owner`` (on pair generation ``pair``): drain it (see the module's opening)."""
    queue = getattr(cluster._local, "replies", None)
    if queue is None or cluster._closed:
        return
    cluster._local.replies = None  # the thread's next requests are answered in a new queue
    try:
        _ask_cancel(cluster, owner, name, tag, pair, queue)
    except (RuntimeError, OSError):
        return  # the store is gone: no answer can come either
    for ended in [t for t in list(cluster._threads) if t.name == DRAINER and not t.is_alive()]:
        try:
            cluster._threads.remove(ended)
        except ValueError:
            pass  # another drain removed it meanwhile
    thread = threading.Thread(target=_drain, args=(cluster, owner, name, tag, pair, nbytes, stripes, queue),
                              name=DRAINER, daemon=True)
    try:  # started first, then registered: shutdown never joins a thread that did not start
        thread.start()
    except RuntimeError:  # "can't start new thread": as before the drain, the pair is failed (the
        cluster._groups.fail(owner, pair)  # owner's send ends at once), and the caller's TimeoutError goes on
        cluster._free_replies.append(queue)
        return
    cluster._threads.append(thread)  # (shutdown joins it: its pop is woken then, see AnswerWaits.wake_all)


def _ask_cancel(cluster, owner: int, name: str, tag: int, pair: int, queue: str) -> None:
    """Ask ``owner`` to cancel pull ``tag``, in the lane the pull went by (after it), with
    the answer in ``queue``. Asking again is harmless: a pull already answered or dropped
    is answered "none"."""
    cluster._store.push_json(lane_queue(owner, cluster.node),
                             {"op": "cancel", "name": name, "generation": 0, "from": cluster.node, "tag": tag,
                              "pair": pair, "reply": queue, "caller": cluster._caller})


#: How many node timeouts in a row a drain waits for a live owner's answer to its cancel,
#: asking again after each: an owner that never answers (one that predates the cancel, a
#: store error on its answer) would otherwise hold the drain for as long as it lives.
UNANSWERED_ASKS = 3


def _drain(cluster, owner: int, name: str, tag: int, pair: int, nbytes: int, stripes: int, queue: str) -> None:
    store = cluster._store
    try:
        store.connect(spare_only=True)  # (see cluster_serve._connect)
        with cluster._waits.waiting(queue, owner) as wait:
            _drained(cluster, owner, name, tag, pair, nbytes, stripes, queue, wait)
    except (RuntimeError, OSError):
        return  # the store is gone: the owner's send ends at its bound
    finally:
        # back for the node's next thread that needs a reply queue (ClusterRequests._reply_queue):
        # the store's host never forgets a queue, so each drain's own new one stayed there for good
        cluster._free_replies.append(queue)


def _drained(cluster, owner: int, name: str, tag: int, pair: int, nbytes: int, stripes: int, queue: str,
             wait) -> None:
    """Pop ``queue`` until the pull's cancel is answered (see :func:`_drain`), each wait
    for the node's timeout, woken by a notice once ``owner`` is found lost or the node
    shuts down (``cluster_wake.AnswerWaits``: no 0.25 s slices, each logged by torch as
    it timed out; no pop far past the liveness deadline, after which it looks
    at the owner's heartbeat itself: ``cluster_wake.pop_bound``). No clock ends it: the cancel's answer comes after the owner's lane
    handled the pull (one lane, in order), however late (a lane busy with earlier
    requests); a drain that ended at twice the timeout left a pull served after it to
    a send for nobody, and the pair failed (audit of b7822d2). An owner found lost
    ends it as any wait for that owner: the pair is failed (``_found``), so a send it
    makes on resuming fails at once."""
    store = cluster._store
    answered = serving = False  # the pull's own answer came; the owner said it serves it
    unanswered = 0  # node timeouts in a row without any answer from a live owner
    timeout_at = time.monotonic() + cluster.timeout  # the end of this node timeout's wait
    while not cluster._closed:
        left = max(0.0, timeout_at - time.monotonic())
        bound = pop_bound(left)  # (as ClusterRequests._answer's: a notice may be late)
        last = bound >= left  # this pop ends the node timeout's wait
        try:
            answer = store.pop_json(queue, bound, lambda: cluster._closed)
        except ClusterAuthError:
            cluster.refused += 1  # forged: never acted on
            continue
        if answer is None or WAKE_KEY in answer:
            if answer is not None:
                wait.woken = False
            if not cluster._alive(owner):
                cluster._found(owner)  # nothing comes from a lost owner: the lost-peer path
                return
            if answer is not None:
                timeout_at = time.monotonic() + cluster.timeout  # (a fresh wait, as after any pop that ended early)
            elif last:
                timeout_at = time.monotonic() + cluster.timeout
                unanswered += 1
                if unanswered >= UNANSWERED_ASKS:
                    # bounded after all (audit 21): a send the owner still makes for this
                    # pull fails at once on a failed pair, as before the drain
                    if not answered:
                        cluster._groups.fail(owner, pair)
                    return
                _ask_cancel(cluster, owner, name, tag, pair, queue)
            continue
        unanswered, timeout_at = 0, time.monotonic() + cluster.timeout
        if answer.get("tag") != tag or answer.get("caller") != cluster._caller:
            continue  # (an answer to an earlier request of the thread)
        if "cancel" in answer:
            serving = answer["cancel"] == "serving"
            if answered or not serving:
                return  # dropped, or its answer came before this one
        else:
            answered = True
            if "version" in answer:  # announced: the owner sends now
                into_scratch(cluster, owner, pair, tag, nbytes, stripes, f"drain of the pull of {name!r}")
            if serving:
                return  # (else the cancel's answer follows: popped, the queue left empty)
