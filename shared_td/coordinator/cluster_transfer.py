"""Tensor payloads between two nodes: one gloo process group per pair of nodes.

Why pairs, made lazily, with a *generation*: a gloo operation that times out closes its
pair's connection for good ("Application timeout caused pair closure"), and a receive
whose peer was SIGKILLed is never completed by gloo at all (measured with torch 2.13:
still pending 5 s later). A group of all nodes would therefore have to be rebuilt by all
nodes together after any failure. Instead nodes ``a < b`` share a two-rank
``ProcessGroupGloo`` made on first use, rendezvous ``pair/a-b/<generation>`` in the
store. A failed or timed-out transfer ends what it still has posted (:func:`end_works`:
gloo closes the pair of a wait that times out; ``ProcessGroupGloo.abort()`` alone does
not cancel a posted receive, measured with torch 2.13: one took the peer's later send),
aborts the group and increments the pair's generation counter in the store; the next
transfer between the two nodes builds generation + 1 on both sides (each request names
the generation it uses, see :mod:`shared_td.coordinator.cluster`). Other pairs are not
disturbed.

Each node caches the generation of each pair (a request costs no store round trip for
it): the cache moves on in :meth:`PairGroups.fail` (to what the store holds), when a
request names a newer generation (:meth:`PairGroups.seen`), and when the peer's notice
of its own ``fail`` arrives (``fail`` queues one to the peer). A request sent on an older
generation in the moment before the notice arrives is refused by the peer without any
transfer (:class:`StalePair`): a receiving requester (a pull) retries at once; a sending
one (push, sync) fails at its bounded wait, as on any failed transfer.

Waiting: gloo completes a send or receive only inside ``work.wait()`` (``is_completed()``
stays False until then, measured), and ``ProcessGroupGloo.abort()`` does not interrupt a
waiting thread. So each transfer waits once, at most until the call's deadline and
at most ``WAIT_SLACK_S`` plus its bytes at ``MIN_RATE`` (``wait_bound``): a peer
process that dies usually makes gloo fail the wait at once ("Connection closed by
peer"), but never the operation whose message was under way at that moment; a peer
that is stopped (SIGSTOP), unreachable or gone silently makes it fail at that bound,
which closes the pair, and the group is then aborted and replaced. A receive is
therefore never left posted beyond the deadline of its call, and a caller stops waiting
as soon as the peer is found lost: :meth:`PairGroups.wait` runs the wait in a waiter
thread while the caller watches the peer's heartbeat (see
:mod:`~shared_td.coordinator.cluster_waits`).

Payloads are contiguous CPU tensors; gloo reads and writes their memory directly, so a
replica segment is received in place.

Stripes: a pair may hold several groups of the same generation, *stripes* ``0..k-1``
(stripe 0 is the group above; stripe ``i`` rendezvous under ``pair/a-b/<generation>/
stripe<i>/``), each its own gloo device, TCP connection and I/O thread. A payload of at
least :data:`STRIPE_MIN_BYTES` may go as ``k`` contiguous byte ranges
(:func:`stripe_ranges`), one per stripe, all posted at once (:meth:`PairGroups.send`,
:meth:`PairGroups.recv`): views of the same memory, so a striped receive still lands in
place. The requester names ``k`` in its request; both sides build the missing stripes in
order, so their rendezvous meet. The stripes are one transfer: they share one bounded
wait (``wait_work``), a failure of any fails the transfer and ends the operations of
every stripe (so no receive stays posted on any of them), and :meth:`PairGroups.fail`
aborts every stripe of the generation and moves the whole pair to the next one.

Answers: the node that received a payload (a push on the owner, a sync on a replica)
answers over the same pair, with its request's tag + :data:`ANSWER_TAG_BIT`, into a
buffer of ``ANSWER_BYTES`` that the sender posted beside its send, signed for that
request of that node only (:mod:`~shared_td.coordinator.cluster_messages`). The
sender's wait for it is bounded as any transfer's. Every message fills its receive
exactly (an answer is padded to ANSWER_BYTES): gloo completes a receive larger than its
message, but 10-40x slower (measured with torch 2.13 on loopback: a 64 KiB message into
a posted 1 MiB receive took 2-8 ms, into a 64 KiB one 0.15-0.2 ms).

Kept receives: each node keeps one receive posted on stripe 0 of each pair it holds, on
:data:`PUSH_TAG`, for the peer's next push (a header signed for that pair generation,
``push_context``; see :mod:`~shared_td.coordinator.cluster_push`). Its thread waits
in gloo, which ``abort()`` does not wake: so a pair is *closed* (:meth:`PairGroups._close`:
a receive on :data:`CLOSE_TAG`, where nothing is sent, waited for a millisecond, which
makes gloo close the pair on both nodes) before it is aborted, on a failure
(:meth:`PairGroups.fail`), when the peer is found lost (:meth:`PairGroups.forget`), on
shutdown (:meth:`PairGroups.close`) and when a newer generation replaces it; the kept
receive's own wait is bounded by a day
(:data:`~shared_td.coordinator.cluster_serve.LISTEN_S`), the backstop.
"""
from __future__ import annotations

import datetime
import threading
import time

import torch
import torch.distributed as dist

# the signed messages of a pair, re-exported: they were defined here before
from shared_td.coordinator.cluster_messages import (ANSWER_BYTES, answer_context, decode_signed,  # noqa: F401
                                                    encode_signed, push_context)
# the bounded gloo waits, re-exported: they were defined here before
from shared_td.coordinator.cluster_waits import (MIN_RATE, WAIT_SLACK_S, WATCH_S, RendezvousStore,  # noqa: F401
                                                 WorkWaiters, end_works, wait_bound, wait_work)
from shared_td.errors import StalePair, TransferFailed
from shared_td.platform import ThreadLock

__all__ = ["ANSWER_BYTES", "ANSWER_TAG_BIT", "CLOSE_TAG", "DIRECT_MAX_BYTES", "MAX_STRIPES", "MIN_RATE", "PUSH_TAG",
           "STRIPE_MIN_BYTES", "TAG_WRAP", "WAIT_SLACK_S", "PairGroups", "StalePair", "TransferFailed",
           "answer_context", "answer_tag", "decode_signed", "encode_signed", "end_works", "push_context",
           "stripe_count", "stripe_ranges", "wait_bound", "wait_work"]


# How long shutdown waits for a build it gave up to end: one look of its rendezvous
# (RendezvousStore looks every 50 ms at most) or a connect that was under way.
_BUILD_END_S = 1.0
#: Transfers of at most this many bytes are waited for in the calling thread, not
#: watched (:meth:`PairGroups.wait`): a send that small is written whole into the socket
#: as it is posted (gloo sizes the socket's buffer to the message; Linux allows 208 KiB
#: by default), so gloo ends it even if the peer dies, and a receive that small is under
#: way for a moment only; if a peer ever dies in that moment, the wait still ends at its
#: bound (WAIT_SLACK_S), within the 10 s the README promises. Handing the wait to a
#: waiter thread cost a push of 64 rows of 1 KiB 33 us of 490 (~7%, measured A/B).
DIRECT_MAX_BYTES = 192 << 10


#: Payloads smaller than this go over one group whatever the stripes asked for: below it
#: the cost of posting and waiting k operations outweighs what k connections could give.
STRIPE_MIN_BYTES = 4 << 20
#: The most stripes a transfer may use (each is a TCP connection and an I/O thread on both
#: nodes); a request naming more is refused.
MAX_STRIPES = 16


def stripe_count(nbytes: int, stripes: int) -> int:
    """How many stripes a payload of ``nbytes`` goes over when ``stripes`` are allowed: 1
    below :data:`STRIPE_MIN_BYTES`."""
    return stripes if nbytes >= STRIPE_MIN_BYTES else 1


def stripe_ranges(nbytes: int, stripes: int) -> list[tuple[int, int]]:
    """The ``stripes`` contiguous byte ranges ``(start, end)`` that cover ``nbytes`` in
    order: equal sizes rounded up to 64 bytes (a cache line), the last one shorter.
    ValueError for a count outside ``1..MAX_STRIPES``."""
    if not isinstance(stripes, int) or not 1 <= stripes <= MAX_STRIPES:
        raise ValueError(f"a transfer goes over 1 to {MAX_STRIPES} stripes, not {stripes!r}")
    size = -(-nbytes // stripes)
    size += -size % 64
    bounds = [min(nbytes, i * size) for i in range(stripes + 1)]
    return list(zip(bounds, bounds[1:]))


#: Set in the gloo tag of an answer: its request's tag with this bit. gloo takes a 32-bit
#: signed tag, so a request's tag (count % TAG_WRAP * 1024 + node) stays below it, and
#: below the two tags of its top: :data:`PUSH_TAG` and :data:`CLOSE_TAG`.
ANSWER_TAG_BIT = 1 << 30
TAG_WRAP = ANSWER_TAG_BIT // 1024 - 1
#: The tag of the receive each node keeps posted on stripe 0 of a pair for the peer's
#: next push (:func:`~shared_td.coordinator.cluster_serve.serve_pushes`), and the tag
#: nothing is ever sent on, whose receive closes a pair (:meth:`PairGroups._close`).
PUSH_TAG, CLOSE_TAG = ANSWER_TAG_BIT - 1, ANSWER_TAG_BIT - 2


def answer_tag(tag: int) -> int:
    """The gloo tag of the answer to request ``tag``."""
    return tag | ANSWER_TAG_BIT


class PairGroups:
    """This node's two-rank gloo groups, one per peer (or one per stripe, see the
    module's opening), each pair with its generation.

    ``store`` is a :class:`~shared_td.coordinator.cluster_store.SignedStore` (its raw,
    unsigned side is gloo's rendezvous and the generation counters).
    """

    def __init__(self, store, node: int, *, timeout: float, hostname: str | None = None, alive=None,
                 on_built=None):
        self._store, self.node, self.timeout = store, node, timeout
        self._alive = alive  # alive(peer) -> False once the peer's heartbeat stood still
        self._on_built = on_built  # on_built(peer, generation): stripe 0 of a generation was built
        self._hostname = hostname
        self._groups: dict[int, tuple[int, list]] = {}  # peer -> (generation, its stripes' groups)
        self._rendezvous: dict[int, object] = {}  # peer -> the store connection its builds use
        self._generations: dict[int, int] = {}  # peer -> the newest generation known here
        self._locks: dict[int, ThreadLock] = {}  # (its pattern: see ThreadLock)
        self._guard = threading.Lock()
        self._waiters = WorkWaiters()  # see wait()
        self._closing = False  # close() ran: waits and builds give up
        self._unclosed: dict[int, tuple[int, list]] = {}  # taken by close(), not closed yet (it was interrupted)
        self._builds: set[threading.Thread] = set()  # build threads still running (see _build_watched)
        self._in_flight: dict[int, int] = {}  # peer -> bytes of the transfers waited for now (see wait)

    def _pair(self, peer: int) -> str:
        low, high = sorted((self.node, peer))
        return f"{low}-{high}"

    def generation(self, peer: int) -> int:
        """The pair's current generation: cached (a store round trip the first time)."""
        known = self._generations.get(peer)
        return self._stored_generation(peer) if known is None else known

    def _stored_generation(self, peer: int) -> int:
        """The pair's generation as the store has it (one round trip), noted as seen."""
        return self.seen(peer, self._store.add(f"pairgen/{self._pair(peer)}", 0))

    def seen(self, peer: int, generation: int) -> int:
        """Note that the pair with ``peer`` reached ``generation`` (a request or a notice
        named it); returns the newest generation known."""
        with self._guard:
            newest = self._generations[peer] = max(generation, self._generations.get(peer, 0))
        return newest

    def stripes(self, peer: int) -> tuple[int, int] | None:
        """(generation, number of stripes built) of the pair with ``peer``; None when
        this node holds no group with it (never built, or aborted by :meth:`fail`)."""
        have = self._groups.get(peer)
        return None if have is None else (have[0], len(have[1]))

    def groups(self, peer: int, generation: int, count: int = 1, deadline: float | None = None) -> list:
        """The first ``count`` stripes' groups shared with ``peer`` at ``generation``,
        built (in order) where this node has fewer or an older generation (built with
        the peer: each blocks until it joins, at most ``timeout`` and not past
        ``deadline``, a ``time.monotonic()``: a lost peer never joins). TransferFailed if
        this node already moved past ``generation``."""
        have = self._groups.get(peer)  # built already (every transfer but a pair's first): no lock
        if have is not None and have[0] == generation and len(have[1]) >= count:
            return have[1][:count]
        with self._guard:
            lock = self._locks.setdefault(peer, ThreadLock())
        lock.refuse_reentry(f"the group with node {peer}")
        try:
            if not lock.acquire(timeout=self._left(deadline)):
                raise TransferFailed(f"the group with node {peer} is being rebuilt for too long")
            have = self._groups.get(peer)
            if have is not None and have[0] == generation and len(have[1]) >= count:
                return have[1][:count]
            if have is None or have[0] != generation:
                # a generation's first build: never of one the pair has left (a request
                # that waited in a lane while the peer moved on); the peer would not
                # join it, and this thread would wait out its timeout
                self._stored_generation(peer)
            self.check(peer, generation)
            if have is not None and have[0] != generation:  # older: closed, replaced
                self._close(peer, have[1])
                have = None
            built = [] if have is None else have[1]
            while len(built) < count:  # stored as they come, so that fail() closes them too
                built.append(self._build_watched(peer, generation, len(built), self._left(deadline)))
                self._groups[peer] = (generation, built)
                if len(built) == 1 and self._on_built is not None:
                    self._on_built(peer, generation)
            self.seen(peer, generation)
            return built[:count]
        finally:
            try:
                lock.release()
            except RuntimeError:
                pass  # not taken: timed out, or interrupted before acquire returned (platform.ThreadLock)

    def check(self, peer: int, generation: int) -> None:
        """StalePair if this node already moved the pair with ``peer`` past ``generation``."""
        have = self._groups.get(peer)
        if have is not None and have[0] > generation or self._generations.get(peer, 0) > generation:
            raise StalePair(f"generation {generation} of the pair with node {peer} is gone")

    def _left(self, deadline: float | None) -> float:
        """Seconds a wait may take: ``timeout``, and not past ``deadline``."""
        if deadline is None:
            return self.timeout
        return max(0.001, min(self.timeout, deadline - time.monotonic()))

    def _build(self, peer: int, generation: int, stripe: int, timeout: float, given_up=lambda: False):
        options = dist.ProcessGroupGloo._Options()
        options._timeout = datetime.timedelta(seconds=timeout)  # the rendezvous's bound
        if self._hostname:  # a device each: its own connection and I/O thread
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=self._hostname)]
        else:  # GLOO_SOCKET_IFNAME, else the interface of this host's name
            options._devices = [dist.ProcessGroupGloo.create_default_device()]
        where = f"pair/{self._pair(peer)}/{generation}/" + (f"stripe{stripe}/" if stripe else "")
        # waited on by looking, so that a build given up ends at once (see cluster_waits)
        prefix = RendezvousStore(dist.PrefixStore(where, self._rendezvous_store(peer)), given_up)
        rank = 0 if self.node < peer else 1
        try:
            return dist.ProcessGroupGloo(prefix, rank, 2, options)
        except RuntimeError as err:  # TransferFailed of a rendezvous given up included
            raise TransferFailed(f"no gloo connection with node {peer} ({str(err).splitlines()[0][:300]})") from err

    def _rendezvous_store(self, peer: int):
        """The store connection the builds of the pair with ``peer`` rendezvous on: the
        first build's thread's own (a spare when one is ready), then kept for the next
        ones. Each build runs in a new thread (:meth:`_build_watched`), whose first store
        call took a spare or connected: a connect can stall 5 s in a reverse DNS lookup,
        and a pull that rebuilt a pair while every spare was still connecting took
        5.0 s. Builds with one peer run one at a time (the per-peer lock); a build given
        up keeps its connection, and the next build takes a new one."""
        with self._guard:
            store = self._rendezvous.get(peer)
        if store is None:
            store = self._store.raw  # this build thread's own connection
            with self._guard:
                self._rendezvous[peer] = store
        return store

    def _build_watched(self, peer: int, generation: int, stripe: int, timeout: float):
        """:meth:`_build`, given up (TransferFailed) as soon as ``peer`` is found lost.

        gloo's rendezvous waits for the peer to join, up to ``timeout`` (the cluster's:
        a push that had to build a new pair with a SIGKILLed owner waited that long
        before its OwnerLostError), and it cannot be interrupted: it runs in a helper
        thread while this one looks at the peer's heartbeat every WATCH_S. A build given
        up ends with its rendezvous (:class:`~shared_td.coordinator.cluster_waits.RendezvousStore`
        stops waiting for the peer's keys; a connect already under way ends at its
        timeout), and :meth:`close` waits for it (a build thread left running past
        shutdown, inside torch's store wait, aborted the interpreter's exit). A group it
        still makes is aborted, never used: the caller fails the pair (next
        generation), so no later build meets its rendezvous keys."""
        if self._alive is None:
            return self._build(peer, generation, stripe, timeout, lambda: self._closing)
        outcome: dict = {}
        done = threading.Event()

        def build() -> None:
            try:
                made = self._build(peer, generation, stripe, timeout, lambda: "made" in outcome or self._closing)
            except TransferFailed as err:
                made = err
            with self._guard:
                given_up = outcome.setdefault("made", made) is not made
                self._builds.discard(threading.current_thread())
            if given_up and not isinstance(made, TransferFailed):
                made.abort()
            done.set()

        thread = threading.Thread(target=build, name=f"shared_td-cluster-build-{peer}", daemon=True)
        with self._guard:
            if self._closing:
                raise TransferFailed("this cluster node is shut down")
            self._builds.add(thread)
        thread.start()
        while not done.wait(WATCH_S):
            why = self._why_lost(peer) or self._why_moved(peer, generation)
            if why is not None:
                with self._guard:
                    outcome.setdefault("made", TransferFailed(
                        f"{why}: no group of generation {generation} with it was built"))
                    self._rendezvous.pop(peer, None)  # the given-up build still waits on it
                break
        made = outcome["made"]
        if isinstance(made, TransferFailed):
            raise made
        return made

    def _why_moved(self, peer: int, generation: int) -> str | None:
        """Why a build of ``generation`` with ``peer`` is pointless because the store's
        pair moved past it (a new process of that node moved it at its start,
        :meth:`move_on`: it never joins the generation a request of its previous process
        named, and this build waited for it the cluster's whole timeout), or None."""
        try:
            stored = self._stored_generation(peer)
        except (RuntimeError, OSError, ValueError):
            return None  # the store is gone: the build ends at its own bound
        return f"the pair with node {peer} moved to generation {stored}" if stored > generation else None

    def move_on(self, peer: int) -> None:
        """This process runs a node that ran before (a restart): move the pair with
        ``peer`` to a new generation and tell the peer. A request the previous process
        left in the peer's lane names the old generation: served, it built a group this
        process never joins, which held the peer's lane, and this process's first
        request, the cluster's whole timeout (TimeoutError); it is now refused as stale,
        or its build is given up (:meth:`_why_moved`)."""
        newest = self.seen(peer, self._store.add(f"pairgen/{self._pair(peer)}", 1))
        self._store.push_json(f"queue/{peer}", {"op": "pair", "from": self.node, "generation": newest})

    def _why_lost(self, peer: int) -> str | None:
        """Why a wait with ``peer`` is pointless (it is lost, this node closes), or None.
        A store host lost is no reason: the wait ends at its own bound."""
        if self._closing:
            return "this cluster node is shutting down"
        try:
            lost = self._alive is not None and not self._alive(peer)
        except (RuntimeError, OSError):
            return None
        return f"node {peer} is lost (its heartbeat stood still)" if lost else None

    def wait(self, peer: int, works: list, deadline: float, what: str = "transfer", nbytes: int = 0,
             generation: int | None = None) -> None:
        """:func:`wait_work` of a transfer of ``nbytes`` with ``peer``, given up
        (TransferFailed) as soon as ``peer`` is found lost or this node closes: the wait
        runs in a waiter thread (:class:`~shared_td.coordinator.cluster_waits.WorkWaiters`),
        since gloo never ends an operation whose message was under way when the peer
        died. One of at most DIRECT_MAX_BYTES, with those waited for before it, is
        waited for here (see there). Its bound (:func:`wait_bound`) allows for the bytes
        of the transfers with ``peer`` waited for when it starts. ``generation``: the
        pair generation the transfer went over, when known: the wait is also given up
        once the store's pair moved past it (the peer failed the pair, e.g. it found this
        node lost while it was stopped: gloo never ends the send whose receive the peer
        closed, and a lane that sent a pull waited out the whole bound, holding up every
        request of that peer)."""
        if not works:
            return
        # The peer serves this node's requests one at a time (its lane), so a transfer
        # may wait for those posted before it: its bound allows for their bytes too (a
        # 1 KB sync queued behind a 6 s one timed out at its own 5 s bound and failed
        # the pair, which dropped the long one as well).
        with self._guard:
            queued = self._in_flight.get(peer, 0) + nbytes
            self._in_flight[peer] = queued
        try:
            if self._alive is None or queued <= DIRECT_MAX_BYTES:  # (behind a long one: watched)
                wait_work(works, deadline, what, queued)
                return
            self._waiters.wait(lambda: wait_work(works, deadline, what, queued), wait_bound(deadline, queued),
                               lambda: self._why_lost(peer) or (
                                   None if generation is None else self._why_moved(peer, generation)), what)
        finally:
            with self._guard:
                self._in_flight[peer] -= nbytes

    def fail(self, peer: int, generation: int) -> None:
        """Close every stripe's group with ``peer`` (:meth:`_close`: ends the posted sends
        and receives of both nodes on it, waiting threads included) and move the pair to
        the next generation, unless that already happened; the peer is told (a notice in
        its queue) so that its next request uses the new generation."""
        # past ``generation`` here before its groups go: a thread that finds them gone
        # must not build it again while the store is told
        self.seen(peer, generation + 1)
        with self._guard:
            have = self._groups.get(peer)
            if have is not None and have[0] == generation:
                del self._groups[peer]
                self._close(peer, have[1])
        try:
            now = self._store.compare_set(f"pairgen/{self._pair(peer)}", str(generation), str(generation + 1))
            newest = self.seen(peer, int(now))
            self._store.push_json(f"queue/{peer}", {"op": "pair", "from": self.node, "generation": newest})
        except (RuntimeError, OSError, ValueError):  # OSError: ConnectionError, the store lost
            pass  # the store is gone: there is no next transfer

    def forget(self, peer: int) -> None:
        """``peer`` was found lost: :meth:`fail` the pair this node holds with it, so
        that its groups (their sockets, any operation still posted) go now, not at
        the next transfer, and a peer that comes back builds a new generation."""
        have = self._groups.get(peer)
        if have is not None:
            self.fail(peer, have[0])

    def send(self, peer: int, generation: int, tensor: torch.Tensor, tag: int, deadline: float | None = None,
             stripes: int = 1) -> list:
        """Post the send of ``tensor`` (a contiguous uint8 tensor) over ``stripes`` groups,
        one byte range each (:func:`stripe_ranges`); returns their works."""
        return self._post("send", peer, generation, tensor, tag, deadline, stripes)

    def recv(self, peer: int, generation: int, tensor: torch.Tensor, tag: int, deadline: float | None = None,
             stripes: int = 1) -> list:
        """Post the receive into ``tensor`` (its own memory: in place) over ``stripes``
        groups, as :meth:`send` sends it; returns their works."""
        return self._post("recv", peer, generation, tensor, tag, deadline, stripes)

    def _post(self, op: str, peer: int, generation: int, tensor: torch.Tensor, tag: int, deadline: float | None,
              stripes: int) -> list:
        ranges = stripe_ranges(int(tensor.numel()), stripes) if stripes > 1 else [(0, int(tensor.numel()))]
        groups = self.groups(peer, generation, len(ranges), deadline)
        works = []
        try:  # a pair that a failure already closed refuses at once
            if len(ranges) == 1:
                return [getattr(groups[0], op)([tensor], 1 - self._rank(peer), tag)]
            for group, (start, end) in zip(groups, ranges):
                works.append(getattr(group, op)([tensor[start:end]], 1 - self._rank(peer), tag))
            return works
        except RuntimeError as err:
            end_works(works)  # the stripes already posted
            raise TransferFailed(f"the {op} to node {peer} could not start: {str(err).splitlines()[0][:300]}") from err

    def _rank(self, peer: int) -> int:
        return 0 if self.node < peer else 1

    def built(self, peer: int, generation: int) -> bool:
        """Whether this node holds stripe 0 of ``generation`` with ``peer`` (no wait)."""
        have = self._groups.get(peer)
        return have is not None and have[0] == generation

    def listen(self, peer: int, generation: int, buffer: torch.Tensor):
        """Post a receive of ``buffer`` on stripe 0 of ``generation`` with ``peer``, on
        PUSH_TAG, for that peer's next push; returns its work. Never builds a group:
        TransferFailed once that generation is gone here or its pair is closed."""
        have = self._groups.get(peer)
        if have is None or have[0] != generation:
            raise TransferFailed(f"generation {generation} of the pair with node {peer} is gone")
        try:
            return have[1][0].recv([buffer], 1 - self._rank(peer), PUSH_TAG)
        except RuntimeError as err:
            raise TransferFailed(f"the pair with node {peer} is closed: {str(err).splitlines()[0][:300]}") from err

    def close(self) -> None:
        """Close every pair (on shutdown): the receives kept posted end, the waits of
        :meth:`wait` and the builds under way give up, and the builds' threads have
        ended (bounded) when this returns."""
        with self._guard:
            self._closing = True
            # each kept until closed: a close interrupted (a Ctrl-C) is finished by the next
            self._unclosed.update(self._groups)
            self._groups = {}
            self._rendezvous.clear()
            builds = list(self._builds)
        self._waiters.close()
        for peer in list(self._unclosed):
            self._close(peer, self._unclosed[peer][1])
            del self._unclosed[peer]
        end = time.monotonic() + _BUILD_END_S
        for thread in builds:
            thread.join(max(0.0, end - time.monotonic()))

    def _close(self, peer: int, groups: list) -> None:
        """Close the connections of ``groups`` at once, then abort them. ``abort()``
        alone cancels this node's posted operations but wakes no thread waiting on one
        (measured), such as a receive kept posted for the peer's pushes: a receive on
        CLOSE_TAG, where nothing is sent, waited for a millisecond (:func:`end_works`)
        closes its pair on both nodes and wakes every waiter."""
        for group in groups:
            try:
                end_works([group.recv([torch.empty(1, dtype=torch.uint8)], 1 - self._rank(peer), CLOSE_TAG)])
            except RuntimeError:
                pass  # a pair already closed
            group.abort()
