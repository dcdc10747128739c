"""Waking blocking store pops: those of a node's serving threads without a message
(:func:`wake_pops`), for a process whose node number was taken over: its shutdown must
leave its queues to its successor (kept apart from
:mod:`~shared_td.coordinator.cluster_serve`, whose threads it wakes); and a thread's
wait for a peer's answer, with a signed notice, once that peer is found lost or the
node shuts down (:class:`AnswerWaits`).
"""
from __future__ import annotations

import contextlib
import threading
import time

from shared_td.coordinator import cluster_liveness
from shared_td.coordinator.cluster_liveness import HEARTBEAT_S

__all__ = ["BACKSTOP_SLACK_S", "WAKE_EVERY_S", "WAKE_KEY", "WATCH_S", "AnswerWaits", "pop_bound", "wake_pops"]

#: What :func:`wake_pops` compares a queue's key with: the queue's name holds no plain
#: value, so the compare never matches and nothing is ever set.
_WAKE = "\0shared_td-wake"
#: The longest pause between two wake-ups of :func:`wake_pops`.
WAKE_EVERY_S = 0.2
#: Seconds between two looks at the heartbeats of the peers that threads of this node
#: wait for (``cluster_serve.watch_pairs``): what a wait's slice was before
#: (:class:`AnswerWaits`).
WATCH_S = HEARTBEAT_S / 2
#: Seconds past the liveness deadline (LOST_AFTER_S) that one pop of a wait for a peer's
#: answer still waits for the watch thread's notice (:func:`pop_bound`): the notice may
#: rest on a heartbeat seen after the pop began (one HEARTBEAT_S later), comes at the
#: watch thread's next look, and its push takes a moment, more on a loaded machine
#: (a WATCH_S of margin); with less, a wait cut short by a SIGKILL could time out first,
#: and torch logs that (tests/cluster/test_quiet_waits.py).
BACKSTOP_SLACK_S = HEARTBEAT_S + 4 * WATCH_S


def pop_bound(left: float) -> float:
    """How long one blocking pop of a wait for a peer's answer may wait, of the ``left``
    seconds of its call: the liveness deadline (LOST_AFTER_S) plus BACKSTOP_SLACK_S;
    the waiting thread then looks at the peer's heartbeat itself, and pops again while
    the peer lives.

    The backstop of :class:`AnswerWaits`: the watch thread's notice ends the pop about
    LOST_AFTER_S + WATCH_S after the peer's last beat, before this bound. When the
    notice is held up (a store stall: the watch thread's reads and its push wait behind
    every call in flight; OwnerLostError came 7.5-7.8 s after an owner's SIGKILL), the
    thread looks by itself after this bound (4.5 s) and finds the peer lost, as the
    watch thread saw its heartbeat stand still; when nothing looked at the heartbeat
    meanwhile, after one more bound. Before, such a pop waited out the call's whole
    timeout (30 s by default). The price: a wait for a live peer that answers later
    than the bound logs torch's two timeout lines each time.

    Example:
        >>> pop_bound(30.0) == cluster_liveness.LOST_AFTER_S + BACKSTOP_SLACK_S == 4.5, pop_bound(1.0)
        (True, 1.0)
    """
    return max(0.0, min(left, cluster_liveness.LOST_AFTER_S + BACKSTOP_SLACK_S))


def wake_pops(cluster, queues: list[str], threads: list, bound: float) -> None:
    """Wake the blocking pops of ``queues`` until ``threads`` ended (at most ``bound``
    s), putting nothing in the queues: for a process whose number was taken over, whose
    shutdown must leave the queues to its successor (a stop notice pushed there would
    be the successor's to pop, and a push wakes only the first waiter of a queue,
    maybe the successor's pop). A ``compare_set`` of a queue's name that never matches
    is the wake-up: the store's host (torch 2.13, libuv) wakes every wait on a key it
    is asked to compare, and a queue's key holds no plain value, so nothing is written
    (a host that stopped waking there would leave the shutdown as slow as before, not
    wrong). Each pop
    woken finds the queue empty (``QueueEmptyError``), sees the stop (``ended``) and
    ends; one that finds a value puts it back for the successor, as it does at any
    pop after the takeover (see ``cluster_inbox.signed_requests``). The successor's own pops
    are woken with it and wait again (a wake-up in vain is "nothing yet"). Repeated,
    so that a thread entering its pop as the first wake-up goes is woken too (a thread
    busy past ``bound``, in a transfer, sees the stop before its next pop). Before,
    nothing woke them: the shutdown waited POP_S (60 s) for the service thread, and
    the lanes were left inside torch at the interpreter's exit.

    Example:
        >>> import datetime, threading
        >>> from types import SimpleNamespace
        >>> from torch.distributed import TCPStore
        >>> from shared_td.coordinator.cluster_store import SignedStore
        >>> raw = TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=5), wait_for_workers=False)
        >>> store = SignedStore(raw, b"k" * 32, timeout=5.0)
        >>> stop = threading.Event()
        >>> popper = threading.Thread(target=store.pop_json, args=("queue/1", 30.0, stop.is_set))
        >>> popper.start(); stop.set()
        >>> wake_pops(SimpleNamespace(_store=store), ["queue/1"], [popper], 5.0)
        >>> popper.is_alive(), raw.queue_len("shared_td/queue/1"), raw.check(["shared_td/queue/1"])
        (False, 0, False)
    """
    deadline, pause = time.monotonic() + bound, 0.01
    while any(thread.is_alive() for thread in threads) and time.monotonic() < deadline:
        try:
            for queue in queues:
                cluster._store.compare_set(queue, _WAKE, _WAKE)
        except (RuntimeError, OSError):
            return  # the store is gone: the pops fail by themselves
        alive = [thread for thread in threads if thread.is_alive()]
        if alive:
            alive[0].join(max(0.0, min(pause, deadline - time.monotonic())))
        pause = min(2 * pause, WAKE_EVERY_S)


#: What a wake-up notice holds (:meth:`AnswerWaits.wake`): its key tells it from an
#: answer, which a waiting thread would otherwise pop only at its deadline.
WAKE_KEY = "wake"


class _Wait:
    """One thread's wait for ``peer``'s answer in its reply ``queue``; ``woken``: a
    notice was pushed for it and not popped yet (one is enough)."""

    __slots__ = ("queue", "peer", "woken")

    def __init__(self, queue: str, peer: int):
        self.queue, self.peer, self.woken = queue, peer, False


class AnswerWaits:
    """The reply queues in which this node's threads wait for a peer's answer, and their
    wake-up when that peer is found lost or the node shuts down.

    Why: a thread that waited for an answer popped its queue in 0.25 s slices, to look
    at the peer's heartbeat between two; each slice that found nothing was a
    ``queue_pop`` that timed out, which torch (2.13) logs at WARNING on stderr, two
    lines each time (``[c10d] waitForInput: poll ... returned 0, likely a timeout``):
    26 lines for one pull whose owner was SIGKILLed (audit 21). Now the thread pops once
    for its whole deadline inside :meth:`waiting`, and the node's watch thread, which
    looks at the heartbeats of the peers waited for every :data:`WATCH_S`
    (``cluster_serve.watch_pairs``), pushes a signed notice ``{"wake": peer}`` into its
    queue once that peer is not alive: the thread pops it, looks at the heartbeat itself
    and raises OwnerLostError (or waits on, for a peer that beats again). Shutdown
    wakes every wait (:meth:`wake_all`). A notice that comes after the answer it was
    meant to cut short stays in the queue: the thread's next wait pops it as any
    notice, and a look at its peer's heartbeat later waits on. No single pop outlives
    the liveness deadline by more than :data:`BACKSTOP_SLACK_S` (:func:`pop_bound`):
    a notice held up (the watch thread in a stalled store) no longer holds the wait
    to its end.

    Example:
        >>> import datetime, threading
        >>> from torch.distributed import TCPStore
        >>> from shared_td.coordinator.cluster_store import SignedStore
        >>> raw = TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=5), wait_for_workers=False)
        >>> store, waits, got = SignedStore(raw, b"k" * 32, timeout=5.0), AnswerWaits(), []
        >>> def wait():
        ...     with waits.waiting("reply/0/0", peer=1):
        ...         got.append(store.pop_json("reply/0/0", 30.0))
        >>> waiter = threading.Thread(target=wait); waiter.start()
        >>> while not waits.peers(): time.sleep(0.01)
        >>> waits.peers(), waits.wake(store, 1), waits.wake(store, 1)  # one notice per wait
        ({1}, 1, 0)
        >>> waiter.join(5); got
        [{'wake': 1}]
    """

    def __init__(self):
        self._waits: set[_Wait] = set()
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def waiting(self, queue: str, peer: int):
        """The calling thread waits in ``queue`` for ``peer``'s answer during the block;
        yields its :class:`_Wait` (set ``woken`` back to False on popping a notice)."""
        wait = _Wait(queue, peer)
        with self._lock:
            self._waits.add(wait)
        try:
            yield wait
        finally:
            with self._lock:
                self._waits.discard(wait)

    def peers(self) -> set[int]:
        """The peers some thread waits for."""
        with self._lock:
            return {wait.peer for wait in self._waits}

    def wake(self, store, peer: int | None) -> int:
        """Push a wake-up notice into the queue of each wait for ``peer`` (for every
        peer: None) that has none pending; returns how many were pushed. A store error
        is the caller's (the pops fail with it too)."""
        with self._lock:
            woken = [wait for wait in self._waits if not wait.woken and peer in (None, wait.peer)]
            for wait in woken:
                wait.woken = True
        for wait in woken:
            store.push_json(wait.queue, {WAKE_KEY: wait.peer})
        return len(woken)

    def wake_all(self, store, notice: bool = True) -> None:
        """Wake every wait (shutdown: each thread then sees the node closed), with a
        notice, or, when the queues are a successor's (``notice=False``: this
        process's number was taken over), by the compare of :func:`wake_pops`, which
        puts nothing there (the pops then end by their ``ended``)."""
        try:
            if notice:
                self.wake(store, None)
                return
            with self._lock:
                queues = sorted({wait.queue for wait in self._waits})
            for queue in queues:
                store.compare_set(queue, _WAKE, _WAKE)
        except (RuntimeError, OSError):
            pass  # the store is gone: the pops fail by themselves
