"""Who owns the values of ``memmap_(share_non_tensor=True)``: a coordinator, if any.

A shared non-tensor value lives in a cell
(:class:`~shared_td.storage.shared_value.SharedValue`) of a memfd, its slab
(:class:`~shared_td.storage.value_slab.ValueSlab`: one per ``memmap_`` call), that other
processes reach by reopening the descriptor of a process that holds it. When ``memmap_``
makes a slab, it hands it (one round trip per ``memmap_`` call) to *the process's
coordinator*, which opens its own descriptor on it: a pickled cell then names that
coordinator as a fallback holder and stays attachable after its creator exited, while the
coordinator lives. The process's coordinator is, in order:

1. the innermost ``with coord:`` block or ``coord.publish(...)`` call of this process;
2. an embedded coordinator this process already uses: one it started, or its parent's
   (a fork child inherits it; a spawned or exec'd child finds it through the
   ``SHARED_TD_COORDINATOR`` environment variable, set when it starts);
3. else a new embedded coordinator, started once (~0.1 s, measured; see below) and
   stopped when this process exits, or within 0.2 s of its being SIGKILLed;
4. except in a daemonic worker (``multiprocessing``/``multiprocess`` daemon, e.g. a
   DataLoader worker) with no coordinator from 1-2: its slabs stay owned by itself, as
   without a coordinator. Such a worker lives and dies with its parent anyway, so a
   manager process of its own would add a process per worker and change no lifetime.

The embedded coordinator is a plain :class:`~shared_td.Coordinator` started here: its
manager runs ``shared_td/coordinator/server.py`` in a fresh interpreter that imports only
``multiprocess`` (:mod:`shared_td.coordinator.server` says why not a fork): about 0.1 s,
once per process.

Handing over in the background. ``memmap_`` does not wait for the embedded coordinator:
the start and the round trip that hands it the new slabs run in one background thread of
this process (batched: a round trip waits up to 5 ms for the slabs of more calls, and
whoever needs it cuts that short), and ``memmap_`` returns as soon as its cells exist
(the values are already shared with this process's threads and with fork children).
What needs the coordinator waits for it:

* a pickle of a cell being handed over (its ``holders``, see
  :class:`~shared_td.storage.shared_value.SharedValue`), so a pickle names its
  coordinator and stays attachable after its creator exits;
* a fork (a hook before it), so a fork child has the coordinator and the holders too;
* :func:`embedded_coordinator` and :meth:`Coordinator.current`;
* the exit of this process (the thread is joined before the exit hooks stop the
  coordinator).

A failure in the background (the coordinator did not start, stopped answering) is kept
and raised, once, by the next of these or by the next ``memmap_(share_non_tensor=True)``
(with a note saying where it came from); the values it concerned stay owned by this
process, as without a coordinator. A child exec'd during the start (its first ~0.1 s)
does not find the coordinator in its environment yet: it starts its own when it needs
one. A coordinator given with ``with``/``publish`` adopts the slabs in the caller, and
one announced in the environment is connected to in the caller (a failure is raised by
that ``memmap_``); only the hand-over round trips to the embedded one run in the
background.

The engine does not import this module: ``memmap_`` hands its new slabs to the hook that
this module registers in storage at import (see
:func:`shared_td.storage.shared_value.set_slab_adopter`).

Example:
    >>> import shared_td
    >>> td = shared_td.TensorDict(task="walk").memmap_(share_non_tensor=True)
    >>> embedded_coordinator(start=False) is not None   # started on demand
    True
"""
from __future__ import annotations

import functools
import os
import threading
from concurrent import futures

import multiprocess
import multiprocessing

from shared_td.coordinator import client
from shared_td.coordinator.channels import RESOURCE_ERRNOS
from shared_td.coordinator.process import START_TIMEOUT
from shared_td.storage.shared_value import set_slab_adopter

__all__ = ["adopt", "embedded_coordinator", "ENV_VAR"]

#: ``"<socket address>;<authkey hex>"`` of the embedded coordinator, for child processes.
ENV_VAR = "SHARED_TD_COORDINATOR"
#: Seconds each call to the embedded coordinator waits (connecting and answering) before
#: CoordinatorTimeoutError: a stopped or stalled one never hangs ``memmap_`` for ever.
TIMEOUT = client.DEFAULT_TIMEOUT

_EMBEDDED: client.Coordinator | None = None
_LOCK = threading.Lock()


def adopt(slabs: list) -> None:
    """Hand the new ``slabs`` to the process's coordinator (see the module doc).

    A coordinator given with ``with``/``publish`` adopts them here: ConnectionError if it
    is gone. Else they go to the embedded coordinator in the background (started there
    if needed; one that is gone, e.g. a dead parent's, is replaced). Raises what went
    wrong in an earlier background hand-over, and
    :class:`~shared_td.coordinator.client.CoordinatorTimeoutError` if the coordinator
    announced in the environment does not answer within its timeout (stopped or
    stalled, not gone: never replaced), ``CoordinatorAuthenticationError`` if it
    refuses the authkey announced with it (there, not gone: never replaced either).
    """
    if not slabs:
        return
    given = client.innermost()
    if given is not None:
        given.adopt_slabs(slabs)
        return
    _HANDOVER.raise_failure()
    if _known_embedded() is None and _is_daemonic():
        return  # a daemonic worker: the slabs stay its own
    _HANDOVER.submit(slabs)


def embedded_coordinator(start: bool) -> client.Coordinator | None:
    """The embedded coordinator this process uses; started here if ``start`` and none
    is known (None in a daemonic worker, or if ``start`` is False and none is known).

    Waits for a start or hand-over under way in the background, and raises what went
    wrong there. Raises CoordinatorTimeoutError if the one announced in the environment
    does not answer within its timeout (it is stopped or stalled: not replaced).
    """
    _HANDOVER.wait_idle()
    if _known_embedded() is None and start and not _is_daemonic():
        return _started_embedded()
    return _EMBEDDED


def _known_embedded() -> client.Coordinator | None:
    """The embedded coordinator known to this process (one it started or inherited, or
    one announced in its environment, connected to here); never starts one."""
    global _EMBEDDED
    if _EMBEDDED is None:
        # A round trip: made with no lock held (see client: no process-wide lock during
        # network I/O); two threads may both make one, the first one stored is used.
        announced = _from_environment()
        with _LOCK:
            if _EMBEDDED is None:
                _EMBEDDED = announced
    return _EMBEDDED


def _started_embedded() -> client.Coordinator:
    """The embedded coordinator, started here if none is known (announced in the
    environment for the children)."""
    global _EMBEDDED
    with _LOCK:
        if _EMBEDDED is None:
            _EMBEDDED = _start_embedded()
            os.environ[ENV_VAR] = f"{_EMBEDDED.address};{_EMBEDDED.authkey.hex()}"
        return _EMBEDDED


def _hand_over(slabs: list) -> None:
    """Give ``slabs`` to the embedded coordinator (started if none is known); one that
    is gone is replaced once. Runs in the background thread."""
    coord = _known_embedded() or _started_embedded()
    try:
        coord.adopt_slabs(slabs)
    except ConnectionError as err:
        # only a coordinator that is gone is replaced (a stalled one is not: a new one
        # would split the ownership; one that refuses our authkey is there too, and its
        # CoordinatorAuthenticationError names its address and says the key differs)
        if isinstance(err, (TimeoutError, client.CoordinatorAuthenticationError)):
            raise
        _forget_embedded(coord)
        (_known_embedded() or _started_embedded()).adopt_slabs(slabs)


class _Handover:
    """The background thread that hands new slabs to the embedded coordinator, and what
    it left to raise (see the module doc). One per process: a fork child makes its own.
    """

    #: Seconds a caller waits for the background work: each of its steps is bounded by
    #: its own timeout (a start, a connection to an announced coordinator, two calls)
    #: and it may replace a gone coordinator once.
    WAIT = 2 * START_TIMEOUT + 3 * TIMEOUT
    #: Seconds a round trip waits for more slabs to take with it (see _run).
    GATHER = 0.005

    def __init__(self):
        self._owner = os.getpid()
        self._lock = threading.Lock()
        self._executor: futures.ThreadPoolExecutor | None = None
        self._thread_id: int | None = None
        self._slabs: list = []  # to hand over, taken by the next round trip
        self._queued: futures.Future | None = None  # the round trip not started yet
        self._latest: futures.Future | None = None
        self._failure: BaseException | None = None
        self._kick = threading.Event()  # set: hand over now, someone waits for it

    def submit(self, slabs: list) -> None:
        """Hand ``slabs`` over in the background; each slab waits for it when its
        holders are asked for (a pickle)."""
        with self._lock:
            self._slabs.extend(slabs)
            if self._executor is None:
                self._executor = futures.ThreadPoolExecutor(
                    1, thread_name_prefix="shared_td-handover", initializer=self._in_thread)
            # one round trip queued at a time: it takes every slab added until it starts
            # (and the thread is woken once for them all)
            if self._queued is None:
                try:
                    self._queued = self._latest = self._executor.submit(self._run)
                except RuntimeError:  # the interpreter is exiting: no new work in a thread
                    pass
            future = self._queued
        if future is None:
            self._run()
            self.raise_failure()
            return
        wait = functools.partial(self._wait, future)
        for slab in slabs:
            slab.handing_over(wait)

    def _run(self) -> None:
        # gather the slabs of the calls made meanwhile into this round trip (a loop of
        # memmap_ calls makes one round trip per GATHER seconds, not one per call);
        # whoever needs the hand-over cuts the wait short (kick)
        self._kick.wait(self.GATHER)
        self._kick.clear()
        with self._lock:
            slabs, self._slabs, self._queued = self._slabs, [], None
        if not slabs:
            return
        try:
            _hand_over(slabs)
        except BaseException as err:  # kept for the next operation that needs it
            err.add_note(f"(raised in the background while handing {len(slabs)} slab(s) of values of "
                         "memmap_(share_non_tensor=True) to the embedded coordinator: they "
                         "stay owned by this process only)")
            with self._lock:
                self._failure = self._failure or err

    def _in_thread(self) -> None:
        self._thread_id = threading.get_ident()

    def _wait(self, future: futures.Future) -> None:
        if os.getpid() != self._owner or threading.get_ident() == self._thread_id:
            return  # a fork child (the thread is its parent's), or the thread itself
        self._kick.set()
        if not futures.wait([future], timeout=self.WAIT).done:
            raise client.CoordinatorTimeoutError(
                f"The embedded shared_td coordinator was not started or did not answer "
                f"within {self.WAIT:g} s.")
        self.raise_failure()

    def wait_idle(self) -> None:
        """Wait for the work submitted so far; raise what went wrong, once."""
        latest = self._latest
        if latest is not None:
            self._wait(latest)
        else:
            self.raise_failure()

    def wait_quietly(self) -> None:
        """Wait for the work submitted so far, raising nothing (before a fork: what went
        wrong stays for the next operation that needs it)."""
        latest = self._latest
        if latest is not None and threading.get_ident() != self._thread_id:
            self._kick.set()
            futures.wait([latest], timeout=self.WAIT)

    def raise_failure(self) -> None:
        with self._lock:
            failure, self._failure = self._failure, None
        if failure is not None:
            raise failure


_HANDOVER = _Handover()


def _before_fork() -> None:
    _HANDOVER.wait_quietly()


def _after_fork_in_child() -> None:
    global _LOCK, _HANDOVER
    _LOCK = threading.Lock()
    _HANDOVER = _Handover()


os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)


def _forget_embedded(coord: client.Coordinator) -> None:
    global _EMBEDDED
    with _LOCK:
        if _EMBEDDED is coord:
            _EMBEDDED = None
            if os.environ.get(ENV_VAR, "").startswith(f"{coord.address};"):
                del os.environ[ENV_VAR]


def _from_environment() -> client.Coordinator | None:
    announced = os.environ.get(ENV_VAR)
    if not announced:
        return None
    address, _, key = announced.partition(";")
    try:
        return client.Coordinator.connect(address, bytes.fromhex(key), timeout=TIMEOUT)
    except client.CoordinatorTimeoutError:
        raise  # alive but not answering: a new coordinator would split the ownership
    except client.CoordinatorAuthenticationError as err:
        # alive, with another key: a mistake to say (not a dead ancestor's to replace)
        err.add_note(f"(the coordinator announced in {ENV_VAR}, which this process inherited "
                     "or was given: set it to that coordinator's address;authkey-hex, or "
                     "unset it to start an embedded coordinator of this process)")
        raise
    except (ConnectionError, ValueError, OSError, multiprocess.AuthenticationError) as err:
        if isinstance(err, OSError) and err.errno in RESOURCE_ERRNOS:
            raise  # this process is out of descriptors or memory: the coordinator may live
        if os.environ.get(ENV_VAR) == announced:  # not one another thread started since
            del os.environ[ENV_VAR]  # a dead ancestor's: do not hand it to our children
        return None


def _is_daemonic() -> bool:
    return bool(multiprocessing.current_process().daemon or multiprocess.current_process().daemon)


def _start_embedded() -> client.Coordinator:
    """A started coordinator; it stops when this process exits (see Coordinator.start)."""
    return client.Coordinator(timeout=TIMEOUT).start()


set_slab_adopter(adopt)
