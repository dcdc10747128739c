"""One child process that runs the benchmark cases' jobs, one after another.

A spawned worker costs ~4 s of CPU on 2 cores (a fresh interpreter importing torch and
tensordict), so the cases that need a process of their own (the cold
``share_nontensor``, ``consol_pickle``, ``replay_worker``, ``cluster_push``'s owner node)
share one per run instead of starting their own: :func:`shared_worker` spawns it on first
use, :func:`close_shared_worker` (called at the end of the run) stops it. A quick run
from the command line forks it instead, at its very start (:func:`fork_shared_worker`):
a copy of the runner that has imported everything already and done nothing else yet
(no coordinator, no thread of a case, no lock held), so a few ms instead of seconds, and
as cold as a spawned one for what the cases measure in it. Every wait is bounded by
``timeout``.

A job is a module-level function (it is pickled by reference); it gets the worker's end
of the connection as its first argument, for a conversation of its own with the caller
(see :meth:`JobWorker.start_job`), and its return value comes back.

Example:
    >>> worker = JobWorker()
    >>> worker.call(_pid) != os.getpid()
    True
    >>> worker.close()
"""
from __future__ import annotations

import atexit
import multiprocessing
import os
from typing import Any, Callable

from shared_td.platform import CreatorWatch

#: Seconds a job may take (the first one includes the worker's imports).
TIMEOUT = 120.0
#: Seconds between two looks, by an idle worker, at whether its caller still runs.
_LOOK_S = 1.0


def _pid(connection) -> int:
    return os.getpid()


def _serve(connection) -> None:
    """The worker's loop: run each ``(function, args)`` received, answer ``("ok",
    result)`` or ``("error", text)``; stop at None, or within a second once the caller is
    gone (its end of the connection may live on in processes forked after this one, and
    in this one when it is a fork, so no EOF need come)."""
    caller = CreatorWatch()  # (not os.getppid() now: the caller may be gone already)
    while True:
        try:
            while not connection.poll(_LOOK_S):
                if caller.gone():  # orphaned: the caller died (a SIGKILL)
                    return
            job = connection.recv()
        except EOFError:  # the caller is gone
            return
        if job is None:
            return
        function, args = job
        try:
            answer = ("ok", function(connection, *args))
        except Exception as error:  # the caller reports it as its case's failure
            answer = ("error", f"{type(error).__name__}: {error}")
        connection.send(answer)


class JobWorker:
    """A child process running jobs; started on the first job or by :meth:`start`.

    ``start_method``: "spawn" (a fresh interpreter, the default) or "fork" (a copy of
    this process: only before this process started threads or coordinators, which the
    copy would not have, or hold copies of).
    """

    def __init__(self, start_method: str = "spawn"):
        self._start_method = start_method
        self._process = None
        self._connection = None

    def start(self) -> "JobWorker":
        """Start the process now (idempotent)."""
        if self._process is None:
            ctx = multiprocessing.get_context(self._start_method)
            self._connection, theirs = ctx.Pipe()
            # not daemonic: a job may start processes (the cold share_nontensor starts a
            # coordinator); it exits when the connection closes or we die (see _serve)
            self._process = ctx.Process(target=_serve, args=(theirs,))
            self._process.start()
            theirs.close()
        return self

    def start_job(self, function: Callable, *args: Any):
        """Send ``function(connection, *args)`` to the worker; returns this end of the
        connection, for the job's own conversation. End with :meth:`result`."""
        self.start()
        self._connection.send((function, args))
        return self._connection

    def result(self, timeout: float = TIMEOUT) -> Any:
        """The return value of the job sent last (RuntimeError with its error)."""
        if not self._connection.poll(timeout):
            self.close()
            raise TimeoutError(f"the benchmark worker sent nothing within {timeout:.0f} s")
        kind, value = self._connection.recv()
        if kind == "error":
            raise RuntimeError(f"the benchmark worker failed: {value}")
        return value

    def call(self, function: Callable, *args: Any, timeout: float = TIMEOUT) -> Any:
        """``function(connection, *args)`` run in the worker: its return value."""
        self.start_job(function, *args)
        return self.result(timeout)

    @property
    def started(self) -> bool:
        return self._process is not None

    def close(self) -> None:
        """Stop the worker (killed if it does not stop within a few seconds)."""
        process, connection = self._process, self._connection
        self._process = self._connection = None
        if process is None:
            return
        try:
            connection.send(None)
        except OSError:
            pass  # gone already
        process.join(10)
        if process.is_alive():
            process.kill()
            process.join(10)
        connection.close()


_SHARED: JobWorker | None = None


def shared_worker() -> JobWorker:
    """The run's worker (spawned on its first job, unless forked already)."""
    global _SHARED
    if _SHARED is None:
        _SHARED = JobWorker()
    return _SHARED


def fork_shared_worker() -> JobWorker:
    """Fork the run's worker now (see the module's opening: at the start of a run only)."""
    global _SHARED
    if _SHARED is None:
        _SHARED = JobWorker("fork").start()
    return _SHARED


def close_shared_worker() -> None:
    """Stop the run's worker, if it was started."""
    global _SHARED
    worker, _SHARED = _SHARED, None
    if worker is not None:
        worker.close()


atexit.register(close_shared_worker)  # before multiprocessing joins its children at exit
