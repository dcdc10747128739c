"""The cluster's waits on gloo: each bounded (:func:`wait_work`, at most
:data:`WAIT_SLACK_S` plus the bytes at :data:`MIN_RATE`, never past the call's
deadline), and ended as soon as the peer is found lost: a transfer's operations
(:class:`WorkWaiters`) and a group's rendezvous (:class:`RendezvousStore`).

Why a transfer is not waited for in the calling thread: gloo completes an operation only
inside ``work.wait()``, and a peer that dies in the middle of a message leaves that
operation unfinished for good. gloo fails the operations queued on a pair whose
connection breaks, but not the one whose bytes are moving at that moment: the message
being read (``Pair::rx_``) and an unbound send partly written (``tx_``) are in no list
that ``Pair::signalException`` walks (gloo's ``tcp/pair.cc``; measured with torch 2.13:
a 200 MB receive whose sender was SIGKILLed 10 ms in waited out its whole timeout).
Nothing wakes such a wait -- not ``ProcessGroupGloo.abort()`` or ``shutdown()``, not
closing the pair (its receive on CLOSE_TAG cannot even be posted once the pair is
closed) -- so a pull of 4 MB whose owner was SIGKILLed raised OwnerLostError only after
its whole bound (5.35 s, then the heartbeat's look: 8.4 s seen; 15-18 s for the large
payloads of the audit). So the wait runs in a waiter thread, and the caller waits on the
waiter, looking at the peer's heartbeat every WATCH_S: a peer found lost ends the call
at once (:class:`~shared_td.errors.TransferFailed`, which the cluster turns into
OwnerLostError). The waiter's own wait is still bounded as before (WAIT_SLACK_S + the
bytes at MIN_RATE, not past the call's deadline): its receive is never posted for ever,
and the waiter goes back to the pool when it ends. A transfer of at most
``cluster_transfer.DIRECT_MAX_BYTES`` is still waited for in the calling thread: gloo
ends such a send even when the peer dies (it is written whole as it is posted), and the
hop to a waiter would cost a push ~7% (33 us of 490 us for 64 rows of 1 KiB, measured
in one process, direct and watched taking turns).

Why a rendezvous is waited for through a Store of ours: building a group waits in the
store for the peer's address, bounded by the cluster's timeout, and torch's TCPStore
``wait`` cannot be interrupted. A build given up (the peer was found lost) kept its
thread past ``shutdown()``, and in a process that hosts the store the interpreter's exit
then aborted (rc 134: the store's server closed at exit, the build's wait failed, and
the thread came back into a finalizing interpreter). :class:`RendezvousStore` waits by
looking (``check``, 1 ms to 50 ms apart) and gives up as soon as it is told to, so the
build's thread ends with it.
"""
from __future__ import annotations

import _thread
import datetime
import threading
import time
from typing import Callable

import torch.distributed as dist

from shared_td.errors import TransferFailed

__all__ = ["MIN_RATE", "WAIT_SLACK_S", "WATCH_S", "RendezvousStore", "WorkWaiters", "end_works", "wait_bound",
           "wait_work"]

#: The slowest transfer rate (bytes/s) a wait allows for before it gives up: a gloo wait
#: cannot be interrupted, so this bounds how long a peer that vanished without closing its
#: connection can hold a caller (measured: a SIGKILLed owner is usually reported at once
#: by gloo, but not always).
MIN_RATE = 20e6
#: Seconds every wait allows on top of the bytes at MIN_RATE.
WAIT_SLACK_S = 5.0

#: Seconds between two looks at a peer's heartbeat while a transfer or a build with it
#: waits.
WATCH_S = 0.25
# How long a caller waits for a waiter past its wait's own bound before it stops
# waiting for it (the waiter's gloo wait ends by its bound: this is slack, not a wait).
_LATE_S = 1.0


def wait_bound(deadline: float, nbytes: int = 0) -> float:
    """When a wait for ``nbytes`` started now ends at the latest (``time.monotonic()``):
    ``WAIT_SLACK_S + nbytes / MIN_RATE`` from now, and not past ``deadline``."""
    return min(deadline, time.monotonic() + WAIT_SLACK_S + nbytes / MIN_RATE)


def wait_work(works, deadline: float, what: str = "transfer", nbytes: int = 0) -> None:
    """Wait until every gloo ``works`` (one transfer: its stripes, an answer's receive)
    completed; TransferFailed when one failed, or when they did not all end by
    :func:`wait_bound`, after which gloo has closed the pair. One bound for all: k
    stripes waited one after the other never take k times it. In the calling thread:
    a wait that must end when the peer is found lost is
    ``PairGroups.wait`` (:mod:`~shared_td.coordinator.cluster_transfer`)."""
    until = wait_bound(deadline, nbytes)
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


class _Job:
    """One wait handed to a waiter: ``wait()`` (which raises TransferFailed or returns),
    and ``done``, a lock held until the wait ended."""

    __slots__ = ("wait", "done", "error")

    def __init__(self, wait: Callable[[], None]):
        self.wait = wait
        self.done = _thread.allocate_lock()
        self.done.acquire()
        self.error: BaseException | None = None


class WorkWaiters:
    """Threads that wait on gloo operations for callers that must be able to stop
    waiting (see the module's opening). A waiter whose caller stopped waiting finishes
    its own bounded wait, then serves the next caller; threads are made when none is
    idle, so a stuck wait never holds up another transfer."""

    def __init__(self, name: str = "shared_td-cluster-wait"):
        self._name = name
        self._idle: list[_thread.LockType] = []  # each idle waiter's inbox lock
        self._inboxes: dict[_thread.LockType, list] = {}
        self._guard = threading.Lock()
        self._closed = False

    def wait(self, wait: Callable[[], None], until: float, lost: Callable[[], str | None], what: str) -> None:
        """Run ``wait()`` (a bounded gloo wait that returns by ``until``, a
        ``time.monotonic()``, or raises TransferFailed) in a waiter, and return when it
        returned or raise what it raised; TransferFailed at once when ``lost()`` names
        why this wait is pointless (the peer is lost, the node closes), looked at every
        WATCH_S. ``lost`` raising is taken as "not lost" (the store host gone: the wait
        ends at its bound)."""
        job = _Job(wait)
        self._hand(job)
        while not job.done.acquire(timeout=WATCH_S):
            try:
                reason = lost()
            except (RuntimeError, OSError):
                reason = None
            if reason is None and time.monotonic() > until + _LATE_S:
                reason = "its waiter did not come back"
            if reason is not None and not job.done.acquire(blocking=False):  # (it may have ended meanwhile)
                raise TransferFailed(f"the {what} was given up: {reason}")
            if reason is not None:
                break
        if job.error is not None:
            raise job.error

    def _hand(self, job: _Job) -> None:
        with self._guard:
            if self._closed:
                raise TransferFailed("this cluster node is shut down")
            inbox = self._idle.pop() if self._idle else None
            if inbox is None:
                inbox = _thread.allocate_lock()
                inbox.acquire()
                self._inboxes[inbox] = [job]
                threading.Thread(target=self._serve, args=(inbox,), name=self._name, daemon=True).start()
                return
            self._inboxes[inbox][0] = job
        inbox.release()

    def _serve(self, inbox: _thread.LockType) -> None:
        """A waiter: run each job handed to it (its inbox lock released), then go idle;
        ends when the pool closes. A daemon: it waits only in a bounded gloo wait or on
        its inbox, never inside torch's store calls (see the module's opening)."""
        slot = self._inboxes[inbox]
        while True:
            job, slot[0] = slot[0], None
            if job is None:
                return  # closed
            try:
                job.wait()
            except BaseException as err:  # noqa: BLE001 - handed to the caller
                job.error = err if isinstance(err, TransferFailed) else TransferFailed(f"{type(err).__name__}: {err}")
            job.done.release()
            job = None  # its tensors go with the caller, not with an idle waiter
            with self._guard:
                if self._closed:
                    del self._inboxes[inbox]
                    return
                self._idle.append(inbox)
            inbox.acquire()

    def close(self) -> None:
        """End the idle waiters now and each busy one when its wait ends (bounded)."""
        with self._guard:
            self._closed = True
            idle, self._idle = self._idle, []
            for inbox in idle:
                del self._inboxes[inbox]
        for inbox in idle:
            inbox.release()  # its slot holds None: it returns


class RendezvousStore(dist.Store):
    """The store a gloo group's rendezvous runs on: ``inner`` (a Store under the
    group's prefix), whose ``wait`` looks for the keys instead of blocking in torch, and
    raises TransferFailed as soon as ``given_up()`` is true (the peer was found lost, or
    the node closes): the build's thread then ends, instead of waiting out the
    rendezvous timeout (see the module's opening)."""

    def __init__(self, inner, given_up: Callable[[], bool]):
        super().__init__()
        self._inner, self._given_up = inner, given_up

    def wait(self, keys, timeout=None):
        end = time.monotonic() + (timeout.total_seconds() if timeout is not None else self._inner.timeout.total_seconds())
        pause = 0.001
        while not self._inner.check(keys):
            if self._given_up():
                raise TransferFailed(f"the group's rendezvous was given up while waiting for {keys}")
            if time.monotonic() > end:
                raise TransferFailed(f"the group's rendezvous did not find {keys} in time")
            time.sleep(pause)
            pause = min(2 * pause, 0.05)

    # the rest as the store does it (gloo's rendezvous sets, gets and checks keys)
    def set(self, key, value):
        self._inner.set(key, value)

    def get(self, key):
        return self._inner.get(key)

    def check(self, keys):
        return self._inner.check(keys)

    def add(self, key, value):
        return self._inner.add(key, value)

    def compare_set(self, key, expected, desired):
        return self._inner.compare_set(key, expected, desired)

    def delete_key(self, key):
        return self._inner.delete_key(key)

    def num_keys(self):
        return self._inner.num_keys()

    def set_timeout(self, timeout: datetime.timedelta):
        self._inner.set_timeout(timeout)

    def has_extended_api(self):
        return False  # gloo then uses wait and get, which this store makes interruptible
