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
at most ``WAIT_SLACK_S`` plus its bytes at ``MIN_RATE``: a peer process that dies usually
makes gloo fail the wait at once ("Connection closed by peer"; but a receive posted just
as the peer died was seen to wait on); a peer that is stopped (SIGSTOP), unreachable or
gone silently makes it fail at that bound, which closes the pair, and the group is then
aborted and replaced.
A receive is therefore never left posted beyond the deadline of its call.

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
wait (:func:`wait_work`), a failure of any fails the transfer and ends the operations of
every stripe (so no receive stays posted on any of them), and :meth:`PairGroups.fail`
aborts every stripe of the generation and moves the whole pair to the next one.

Answers: the node that received a payload (a push on the owner, a sync on a replica)
answers over the same pair, with its request's tag + :data:`ANSWER_TAG_BIT`, into a
buffer of :data:`ANSWER_BYTES` that the sender posted beside its send. gloo is
unauthenticated, so an answer is signed like a store value (:func:`encode_signed`), for
that request of that node only (its tag and node are in the signed text: an answer
recorded earlier does not pass for another), and checked before a byte of it is parsed
(:func:`decode_signed`). The sender's wait for it is bounded as any transfer's. Every
message fills its receive exactly (an answer is padded to ANSWER_BYTES): gloo completes
a receive larger than its message, but 10-40x slower (measured with torch 2.13 on
loopback: a 64 KiB message into a posted 1 MiB receive took 2-8 ms, into a 64 KiB one
0.15-0.2 ms).

Kept receives: each node keeps one receive posted on stripe 0 of each pair it holds, on
:data:`PUSH_TAG`, for the peer's next push (a header signed for that pair generation,
:func:`push_context`; see :mod:`~shared_td.coordinator.cluster_push`). Its thread waits
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
import hashlib
import json
import threading
import time

import torch
import torch.distributed as dist

from shared_td.errors import ClusterAuthError, StalePair, TransferFailed

__all__ = ["ANSWER_BYTES", "ANSWER_TAG_BIT", "CLOSE_TAG", "MAX_STRIPES", "PUSH_TAG", "STRIPE_MIN_BYTES", "TAG_WRAP",
           "PairGroups", "StalePair", "TransferFailed", "answer_context", "answer_tag", "decode_signed",
           "encode_signed", "end_works", "push_context", "stripe_count", "stripe_ranges", "wait_work"]


#: The slowest transfer rate (bytes/s) a wait allows for before it gives up: a gloo wait
#: cannot be interrupted, so this bounds how long a peer that vanished without closing its
#: connection can hold a caller (measured: a SIGKILLed owner is usually reported at once
#: by gloo, but not always).
MIN_RATE = 20e6
#: Seconds every wait allows on top of the bytes at MIN_RATE.
WAIT_SLACK_S = 5.0
#: Seconds between two looks at a peer's heartbeat while a group is built with it.
WATCH_S = 0.25


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


#: Bytes of the buffer an answer is received into: a 4-byte length, then the signed answer
#: (an error text too long for it is cut).
ANSWER_BYTES = 1024
#: Set in the gloo tag of an answer: its request's tag with this bit. gloo takes a 32-bit
#: signed tag, so a request's tag (count % TAG_WRAP * 1024 + node) stays below it, and
#: below the two tags of its top: :data:`PUSH_TAG` and :data:`CLOSE_TAG`.
ANSWER_TAG_BIT = 1 << 30
TAG_WRAP = ANSWER_TAG_BIT // 1024 - 1
#: The tag of the receive each node keeps posted on stripe 0 of a pair for the peer's
#: next push (:func:`~shared_td.coordinator.cluster_serve.serve_pushes`), and the tag
#: nothing is ever sent on, whose receive closes a pair (:meth:`PairGroups._close`).
PUSH_TAG, CLOSE_TAG = ANSWER_TAG_BIT - 1, ANSWER_TAG_BIT - 2
_LENGTH = 4


def answer_tag(tag: int) -> int:
    """The gloo tag of the answer to request ``tag``."""
    return tag | ANSWER_TAG_BIT


def answer_context(node: int, tag: int) -> str:
    """What an answer is signed for: node ``node``'s answer to request ``tag``."""
    return f"answer/{node}/{tag}"


def push_context(sender: int, receiver: int, generation: int) -> str:
    """What a push header is signed for: from ``sender`` to ``receiver`` on that pair
    generation (its ``seq`` orders the pushes of that generation: no replay passes)."""
    return f"push/{sender}/{receiver}/{generation}"


def encode_signed(store, context: str, value: dict, limit: int = ANSWER_BYTES) -> torch.Tensor:
    """``value`` as JSON signed for ``context`` with ``store``'s authkey (a
    :class:`~shared_td.coordinator.cluster_store.SignedStore`): a 4-byte length, then the
    signed bytes, zeros up to ``limit`` bytes (a long ``error`` text is cut; ValueError
    for anything else that does not fit)."""
    room = limit - _LENGTH - hashlib.sha256().digest_size
    payload = json.dumps(value).encode()
    if len(payload) > room and "error" in value:  # cut (json takes <= 6 bytes a character)
        payload = json.dumps(dict(value, error=value["error"][: max(0, room - 64) // 6])).encode()
    if len(payload) > room:
        raise ValueError(f"a signed message of {len(payload)} bytes does not fit in {limit}")
    blob = store.sign(context, payload)
    message = bytearray(limit)  # always ``limit`` bytes: see the module's opening
    message[: _LENGTH + len(blob)] = len(blob).to_bytes(_LENGTH, "little") + blob
    return torch.frombuffer(message, dtype=torch.uint8)


def decode_signed(store, context: str, buffer: torch.Tensor) -> dict:
    """The value :func:`encode_signed` wrote at the start of ``buffer`` for ``context``;
    ClusterAuthError if it is not signed with ``store``'s authkey for ``context`` (its
    length and its signature are checked before any byte is parsed)."""
    data = memoryview(buffer.numpy())
    length = int.from_bytes(data[:_LENGTH], "little")
    if not 0 < length <= len(data) - _LENGTH:
        raise ClusterAuthError(f"A message for {context!r} has an impossible length ({length}): something else "
                               "writes to the cluster's gloo connections. Nothing of it was used.")
    return json.loads(store.check(context, bytes(data[_LENGTH: _LENGTH + length])))


def wait_work(works, deadline: float, what: str = "transfer", nbytes: int = 0) -> None:
    """Wait until every gloo ``works`` (one transfer: its stripes, an answer's receive)
    completed; TransferFailed when one failed, or when they did not all end within
    ``WAIT_SLACK_S + nbytes / MIN_RATE`` seconds together or before ``deadline``
    (``time.monotonic()``), after which gloo has closed the pair. One bound for all: k
    stripes waited one after the other never take k times it."""
    until = min(deadline, time.monotonic() + WAIT_SLACK_S + nbytes / MIN_RATE)
    for n, work in enumerate(works):
        left = until - time.monotonic()
        try:
            if left <= 0:
                raise TimeoutError("no time left")
            work.wait(datetime.timedelta(seconds=left))
        except (RuntimeError, TimeoutError) as err:
            end_works(works[n:])  # the other stripes' operations too
            raise TransferFailed(f"the {what} failed: {str(err).splitlines()[0][:300]}") from err


def end_works(works) -> None:
    """Make sure no operation of ``works`` stays posted: each that has not ended is
    waited for a millisecond, and gloo closes the pair of a wait that times out, which
    cancels what is posted on it. (``ProcessGroupGloo.abort()`` does not: measured with
    torch 2.13, a receive still posted on an aborted group took the peer's later send.)"""
    for work in works:
        try:
            work.wait(datetime.timedelta(milliseconds=1))
        except RuntimeError:
            pass  # timed out (its pair now closed) or failed already


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
        self._locks: dict[int, threading.Lock] = {}
        self._guard = threading.Lock()

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
            lock = self._locks.setdefault(peer, threading.Lock())
        if not lock.acquire(timeout=self._left(deadline)):
            raise TransferFailed(f"the group with node {peer} is being rebuilt for too long")
        try:
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
            lock.release()

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

    def _build(self, peer: int, generation: int, stripe: int, timeout: float):
        options = dist.ProcessGroupGloo._Options()
        options._timeout = datetime.timedelta(seconds=timeout)  # the rendezvous's bound
        if self._hostname:  # a device each: its own connection and I/O thread
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=self._hostname)]
        else:  # GLOO_SOCKET_IFNAME, else the interface of this host's name
            options._devices = [dist.ProcessGroupGloo.create_default_device()]
        where = f"pair/{self._pair(peer)}/{generation}/" + (f"stripe{stripe}/" if stripe else "")
        prefix = dist.PrefixStore(where, self._rendezvous_store(peer))
        rank = 0 if self.node < peer else 1
        try:
            return dist.ProcessGroupGloo(prefix, rank, 2, options)
        except RuntimeError as err:
            raise TransferFailed(f"no gloo connection with node {peer} ({err})") from err

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
        up ends by itself at its timeout, and a group it still makes is aborted, never
        used: the caller fails the pair (next generation), so no later build meets its
        rendezvous keys."""
        if self._alive is None:
            return self._build(peer, generation, stripe, timeout)
        outcome: dict = {}
        done = threading.Event()

        def build() -> None:
            try:
                made = self._build(peer, generation, stripe, timeout)
            except TransferFailed as err:
                made = err
            with self._guard:
                given_up = outcome.setdefault("made", made) is not made
            if given_up and not isinstance(made, TransferFailed):
                made.abort()
            done.set()

        threading.Thread(target=build, name=f"shared_td-cluster-build-{peer}", daemon=True).start()
        while not done.wait(WATCH_S):
            try:
                lost = not self._alive(peer)
            except (RuntimeError, OSError):  # the store is gone: the build ends at its timeout
                lost = False
            if lost:
                with self._guard:
                    outcome.setdefault("made", TransferFailed(
                        f"node {peer} is lost: it never joined the group of generation {generation}"))
                    self._rendezvous.pop(peer, None)  # the given-up build still waits on it
                break
        made = outcome["made"]
        if isinstance(made, TransferFailed):
            raise made
        return made

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
        """Close every pair (on shutdown): the receives kept posted end."""
        with self._guard:
            pairs, self._groups = list(self._groups.items()), {}
            self._rendezvous.clear()
        for peer, (_generation, groups) in pairs:
            self._close(peer, groups)

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
