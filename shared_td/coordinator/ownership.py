"""Who owns the values of ``memmap_(share_non_tensor=True)``: a coordinator, if any.

A shared non-tensor value lives in a memfd cell
(:class:`~shared_td.storage.shared_value.SharedValue`) that other processes reach by
reopening the descriptor of a process that holds it. When ``memmap_`` makes cells, it
hands them (one round trip per ``memmap_`` call) to *the process's coordinator*, which
opens its own descriptor on each: a pickled cell then names that coordinator as a
fallback holder and stays attachable after its creator exited, while the coordinator
lives. The process's coordinator is, in order:

1. the innermost ``with coord:`` block or ``coord.publish(...)`` call of this process;
2. an embedded coordinator this process already uses: one it started, or its parent's
   (a fork child inherits it; a spawned or exec'd child finds it through the
   ``SHARED_TD_COORDINATOR`` environment variable, set when it starts);
3. else a new embedded coordinator, started here once (~0.1 s, measured; see below) and
   stopped when this process exits, or within 0.2 s of its being SIGKILLed;
4. except in a daemonic worker (``multiprocessing``/``multiprocess`` daemon, e.g. a
   DataLoader worker) with no coordinator from 1-2: its cells stay owned by itself, as
   without a coordinator. Such a worker lives and dies with its parent anyway, so a
   manager process of its own would add a process per worker and change no lifetime.

The embedded coordinator is a plain :class:`~shared_td.Coordinator` started here: its
manager runs ``shared_td/coordinator/server.py`` in a fresh interpreter that imports only
``multiprocess`` (:mod:`shared_td.coordinator.server` says why not a fork): about 0.1 s,
paid once per process, on its first ``memmap_(share_non_tensor=True)``, never on a read
or a write.

The engine does not import this module: ``memmap_`` hands its new cells to the hook that
this module registers in storage at import (see
:func:`shared_td.storage.shared_value.set_cell_adopter`).

Example:
    >>> import shared_td
    >>> td = shared_td.TensorDict(task="walk").memmap_(share_non_tensor=True)
    >>> embedded_coordinator(start=False) is not None   # started on demand
    True
"""
from __future__ import annotations

import os
import threading

import multiprocess
import multiprocessing

from shared_td.coordinator import client
from shared_td.storage.shared_value import set_cell_adopter

__all__ = ["adopt", "embedded_coordinator", "ENV_VAR"]

#: ``"<socket address>;<authkey hex>"`` of the embedded coordinator, for child processes.
ENV_VAR = "SHARED_TD_COORDINATOR"
#: Seconds each call to the embedded coordinator waits (connecting and answering) before
#: CoordinatorTimeoutError: a stopped or stalled one never hangs ``memmap_`` for ever.
TIMEOUT = client.DEFAULT_TIMEOUT

_EMBEDDED: client.Coordinator | None = None
_LOCK = threading.Lock()


def _after_fork_in_child() -> None:
    global _LOCK
    _LOCK = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def adopt(cells: list) -> None:
    """Hand the new ``cells`` to the process's coordinator (see the module doc).

    Raises ConnectionError if a coordinator given with ``with``/``publish`` is gone; an
    embedded one that is gone (a dead parent's) is replaced by a new one. Raises
    :class:`~shared_td.coordinator.client.CoordinatorTimeoutError` if the coordinator did
    not answer within its timeout (stopped or stalled, not gone: never replaced).
    """
    if not cells:
        return
    coord = client.Coordinator.current() or embedded_coordinator(start=True)
    if coord is None:
        return  # a daemonic worker: the cells stay its own
    try:
        coord.adopt_cells(cells)
    except ConnectionError as err:
        # only an embedded coordinator that is gone is replaced (a stalled one is not:
        # a new one would split the ownership; one given with `with` is the user's)
        if coord is not _EMBEDDED or isinstance(err, TimeoutError):
            raise
        _forget_embedded(coord)
        embedded_coordinator(start=True).adopt_cells(cells)


def embedded_coordinator(start: bool) -> client.Coordinator | None:
    """The embedded coordinator this process uses; started here if ``start`` and none
    is known (None in a daemonic worker, or if ``start`` is False and none is known).

    Raises CoordinatorTimeoutError if the one announced in the environment does not
    answer within its timeout (it is stopped or stalled: not replaced by a new one).
    """
    global _EMBEDDED
    if _EMBEDDED is None:
        # A round trip: made with no lock held (see client: no process-wide lock during
        # network I/O); two threads may both make one, the first one stored is used.
        announced = _from_environment()
        with _LOCK:
            if _EMBEDDED is None:
                _EMBEDDED = announced
    with _LOCK:
        if _EMBEDDED is None and start and not _is_daemonic():
            _EMBEDDED = _start_embedded()
            os.environ[ENV_VAR] = f"{_EMBEDDED.address};{_EMBEDDED.authkey.hex()}"
        return _EMBEDDED


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
    except (ConnectionError, ValueError, OSError, multiprocess.AuthenticationError):
        if os.environ.get(ENV_VAR) == announced:  # not one another thread started since
            del os.environ[ENV_VAR]  # a dead ancestor's: do not hand it to our children
        return None


def _is_daemonic() -> bool:
    return bool(multiprocessing.current_process().daemon or multiprocess.current_process().daemon)


def _start_embedded() -> client.Coordinator:
    """A started coordinator; it stops when this process exits (see Coordinator.start)."""
    return client.Coordinator(timeout=TIMEOUT).start()


set_cell_adopter(adopt)
