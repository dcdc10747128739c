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

Why the embedded coordinator is a fresh interpreter and not a fork: forking took
~15 ms here, but the child would keep, for the life of the process, copy-on-write
copies of every private page its creator later writes or frees (a trainer's weights,
buffers: up to its whole memory) and every descriptor the creator had open (pipes
whose readers then never see EOF, segments never freed). ``spawn`` re-imports the
user's ``__main__`` (a script without the ``if __name__ == "__main__"`` guard would
fail) and torch (~2.5 s). So the embedded coordinator runs
``shared_td/coordinator/server.py`` as a script in a new interpreter that imports only
``multiprocess``: about 0.1 s, paid once per process, on its first
``memmap_(share_non_tensor=True)``, never on a read or a write.

Example:
    >>> import shared_td
    >>> td = shared_td.TensorDict(task="walk").memmap_(share_non_tensor=True)
    >>> embedded_coordinator(start=False) is not None   # started on demand
    True
"""
from __future__ import annotations

import atexit
import os
import select
import subprocess
import sys
import threading
import weakref

import multiprocess
import multiprocessing

from shared_td.coordinator import client, server

__all__ = ["adopt", "embedded_coordinator", "ENV_VAR"]

#: ``"<socket address>;<authkey hex>"`` of the embedded coordinator, for child processes.
ENV_VAR = "SHARED_TD_COORDINATOR"
#: Seconds to wait for a new embedded coordinator to listen.
START_TIMEOUT = 30.0
#: Seconds each call to the embedded coordinator waits (connecting and answering) before
#: CoordinatorTimeoutError: a stopped or stalled one never hangs ``memmap_`` for ever.
TIMEOUT = client.DEFAULT_TIMEOUT

_EMBEDDED: client.Coordinator | None = None
_LOCK = threading.Lock()
# address -> keys of cells this process dropped, released with the next adopt_cells
_RELEASED: dict[str, list] = {}


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
    coord = client._IN_USE[-1] if client._IN_USE else embedded_coordinator(start=True)
    if coord is None:
        return  # a daemonic worker: the cells stay its own
    try:
        _hand_over(coord, cells)
    except ConnectionError as err:
        if client._IN_USE or coord is not _EMBEDDED or isinstance(err, TimeoutError):
            raise
        _forget_embedded(coord)
        _hand_over(embedded_coordinator(start=True), cells)


def _hand_over(coord: client.Coordinator, cells: list) -> None:
    released = _RELEASED.pop(coord.address, [])
    pid, fds = coord._call("adopt_cells", os.getpid(), [(c.fd, c.key) for c in cells], released)
    for cell, fd in zip(cells, fds):
        cell.add_holders([(pid, fd)])
        # once this process drops the cell, the coordinator may drop it too (told with
        # the next adoption: a finalizer must not make a round trip)
        weakref.finalize(cell, _release_later, coord.address, cell.key)


def _release_later(address: str, key: tuple[int, int]) -> None:
    _RELEASED.setdefault(address, []).append(key)


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
    """Run server.py in a new interpreter; returns the owning handle."""
    authkey = os.urandom(32)
    boot = "import runpy, sys; del sys.path[0]; runpy.run_path(sys.argv[1], run_name='__main__')"
    popen = subprocess.Popen(
        [sys.executable, "-c", boot, server.__file__],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True,
    )
    try:
        popen.stdin.write(authkey)  # never on the command line: ps shows that
        popen.stdin.close()
        ready, _, _ = select.select([popen.stdout], [], [], START_TIMEOUT)
        address = popen.stdout.readline().decode().strip() if ready else ""
        popen.stdout.close()
        if not address:
            raise RuntimeError(
                f"The embedded shared_td coordinator did not start within {START_TIMEOUT} s "
                f"(exit code {popen.poll()}); see its error output above."
            )
    except BaseException:
        popen.kill()
        popen.wait()
        raise
    handle = client.Coordinator(timeout=TIMEOUT)
    handle._popen, handle._address, handle._authkey = popen, address, authkey
    atexit.register(handle.shutdown)  # a no-op in fork children: they do not own it
    return handle
