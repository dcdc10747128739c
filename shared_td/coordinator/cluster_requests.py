"""The requests of a :class:`~shared_td.coordinator.cluster.Cluster` through the store,
and what their failures mean: a request is pushed to the peer's lane queue
``lane/<peer>/<node>`` with a tag unique among this node's requests in flight, and a
pull's answer comes back signed to the requesting thread's own queue
``reply/<node>/<slot>`` (one blocking pop gets one: no poll; an answer that comes after
its request gave up is skipped by its tag), popped on a store connection that pops
nothing else (see :mod:`~shared_td.coordinator.cluster_store`). The serving half is
:mod:`~shared_td.coordinator.cluster_serve`.

Answers are bound to the process that asked: a node restarted under the same number
reuses the reply queues and its tags start again at the same count, so an answer left
in a queue for the previous process (it died before reading it) matched the new
process's first request of that tag (a refusal meant for the old process failed the
new one's attach). Each request carries the asking process's ``caller`` token, its
answer echoes it, and an answer for another caller is dropped when it is popped; a
thread's queue is emptied before its first request.
"""
from __future__ import annotations

import time

from shared_td.coordinator.cluster_serve import lane_queue
from shared_td.coordinator.cluster_store import ClusterAuthError
from shared_td.coordinator.cluster_transfer import TAG_WRAP, StalePair
from shared_td.coordinator.cluster_wake import WAKE_KEY, pop_bound
from shared_td.errors import OwnerLostError, TransferRefused

__all__ = ["ClusterRequests"]


class ClusterRequests:
    """Mixin of Cluster (it relies on ``node``, ``timeout``, ``refused``, ``_checked``,
    ``_store``, ``_liveness``, ``_groups``, ``_replicas``, ``_tags``, ``_reply_slots``,
    ``_local``, ``_caller``, ``_waits``, ``_closed`` and ``_shut_down``)."""

    def _request(self, peer: int, op: str, name: str, generation: int, **extra) -> tuple[int, int]:
        """Put a request in ``peer``'s queue; returns (tag, pair generation)."""
        store = self._checked()
        if self._liveness.known_lost(peer):  # its pair was failed: none can be built with a dead node
            raise self._lost(peer, name)
        tag = self._next_tag()
        pair = self._groups.generation(peer)  # cached: no round trip
        store.push_json(lane_queue(peer, self.node),
                        {"op": op, "name": name, "generation": generation, "from": self.node,
                         "tag": tag, "pair": pair, "reply": self._reply_queue(), "caller": self._caller, **extra})
        return tag, pair

    @staticmethod
    def _retried_if_stale(request):
        """``request()``, once more if it raised StalePair: the peer moved the pair to a
        new generation before its notice came here, and nothing was transferred (the
        first try read the new generation: the second names it)."""
        try:
            return request()
        except StalePair:
            return request()

    @staticmethod
    def _refusal(peer: int, name: str, answer: dict) -> dict:
        """``answer``, unless it is a refusal: :class:`~shared_td.errors.TransferRefused` naming the peer and
        the name (its generation: ``cluster_serve.refusal``)."""
        if "error" in answer:
            raise TransferRefused(f"Node {peer} refused the transfer of {name!r}: {answer['error']}", answer.get("current"))
        return answer

    def _next_tag(self) -> int:
        """A request's tag: unique per sender (nodes < 1024) among its requests in flight,
        and below PUSH_TAG (gloo takes a 32-bit tag: the count wraps after TAG_WRAP)."""
        return next(self._tags) % TAG_WRAP * 1024 + self.node

    def _reply_queue(self) -> str:
        """This thread's answer queue: one per thread, so that one pop waits for the
        answers of this thread's requests only (and the store keeps a bounded number).
        A queue that a drain handed back (``_free_replies``: its pull given up, see
        ``cluster_drain``) is taken before a new slot: the store's host keeps every queue
        it met, emptied or not (torch 2.13's libuv host: ``delete_key`` erases no queue),
        so a new slot per pull given up grew the host's queues for good. An answer left
        there for the pull given up is skipped by its tag, as any late answer."""
        queue = getattr(self._local, "replies", None)
        if queue is None:
            try:
                queue = self._free_replies.pop()
            except IndexError:
                queue = f"reply/{self.node}/{next(self._reply_slots)}"
            # what waits there was sent to this node's previous process, or for a pull given up
            self._store.drain(queue)
            self._local.replies = queue
        return queue

    def _answer(self, peer: int, tag: int, deadline: float, name: str) -> dict:
        """The peer's signed answer to request ``tag`` (sent from this thread), waited
        for in one pop that the node's watch thread wakes once the peer is found lost
        (:class:`~shared_td.coordinator.cluster_wake.AnswerWaits`; a pop never waits
        far past the liveness deadline, after which the thread looks itself:
        ``cluster_wake.pop_bound``): OwnerLostError, or
        TimeoutError at ``deadline``; a refusal raises. Answers to this thread's earlier requests that gave
        up before them, and values with a wrong signature, are skipped. RuntimeError
        once this node was shut down meanwhile (no answer can be used any more).
        A pull's owner serves it no later than its ``budget`` allows
        (``cluster_deliveries``); a timed-out wait does not fail the pair, which would
        cut every other transfer between the two nodes (a sync of another name, another
        thread's pull): a pull given up is cancelled, and what its owner announced
        before is received anyway (``cluster_drain``)."""
        store = self._checked()
        queue = self._reply_queue()
        with self._waits.waiting(queue, peer) as wait:  # (registered before _closed is read: see wake_all)
            while True:
                if self._closed:
                    raise self._shut_down(f" while it waited for node {peer}'s answer about {name!r}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"Node {peer} did not answer about {name!r} within {self.timeout:g} s.")
                try:  # one pop for all that is left (see AnswerWaits: no slices, each logged by torch),
                    # not past the peer's liveness deadline: a lost peer is found even when its notice is late
                    answer = store.pop_json(queue, pop_bound(left), lambda: self._closed)
                except ClusterAuthError:
                    self.refused += 1  # forged: never acted on
                    continue
                if answer is None or WAKE_KEY in answer:  # timed out, or woken: the peer found lost?
                    if answer is not None:
                        wait.woken = False  # (a notice still pending after a backstop stays counted)
                    if not self._alive(peer):
                        raise self._lost(peer, name)
                elif answer.get("tag") == tag and answer.get("caller") == self._caller:
                    break  # (an answer to an earlier request, or to another process: dropped)
        if "stale_pair" in answer:  # nothing was transferred
            self._groups.seen(peer, answer["stale_pair"])
            raise StalePair(f"Node {peer} moved the pair to generation {answer['stale_pair']}: {answer['error']}")
        return self._refusal(peer, name, answer)

    # ------------------------------------------------------------------ liveness
    def _alive(self, peer: int) -> bool:
        """Whether ``peer`` may still answer: its heartbeat moves (``Liveness.alive``) and
        its process did not leave cleanly (``Liveness.departed``: a shutdown's "left"
        beat and released claim, one more read only once the beat says "left")."""
        return self._liveness.alive(peer) and not self._liveness.departed(peer)

    def _role(self, peer: int, name: str) -> str:
        have = self._replicas.get(name)
        return "the owner" if have is not None and have.owner == peer else "a replica"

    def _lost_or(self, peer: int, name: str, err: BaseException) -> BaseException:
        """After a failed transfer with ``peer``: OwnerLostError once it is found lost
        (see ``Liveness.lost_or``), else a ConnectionError (the call may be retried);
        RuntimeError at once when this node's own shutdown ended the transfer: no peer
        was lost and no retry can succeed (it waited LOST_AFTER_S for the peer's
        heartbeat, then said "that node is alive: the call may be retried")."""
        if self._closed:
            return self._shut_down(f" during the transfer of {name!r} with node {peer} ({err})")
        error = self._liveness.lost_or(peer, name, err, self._role(peer, name))
        if isinstance(error, OwnerLostError):
            self._found(peer)
        return error

    def _lost(self, peer: int, name: str) -> OwnerLostError:
        self._found(peer)
        return self._liveness.lost(peer, name, self._role(peer, name), departed=self._liveness.departed(peer))

    def _found(self, peer: int) -> None:
        """``peer`` is lost: nothing stays built or posted with it, and requests to it
        fail at once while its heartbeat stands still (see _request)."""
        self._liveness.mark_lost(peer)
        if self._groups is not None:
            self._groups.forget(peer)
