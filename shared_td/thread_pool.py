"""The threads of a ``num_threads`` option (a save, a load, a consolidate, a pin), and
the error for a thread the system refuses.

``concurrent.futures.ThreadPoolExecutor`` starts its threads one by one as work is
submitted; a thread the system refused (``RLIMIT_NPROC``, the threads and processes of
this user; memory) made ``submit`` raise a bare ``RuntimeError: can't start new thread``
with the job queued all the same: the call failed, naming no limit, though the threads
started so far could have done the work (and a queued job could still run later, on a
descriptor its caller had closed). A :class:`ThreadPool` works on the threads the
system gives: :meth:`ThreadPool.start` returns None when it gives not even one, and the
caller then does the work itself; a later thread refused is no error.

Example:
    >>> pool = ThreadPool.start(2, "shared_td-example")
    >>> [future.result() for future in [pool.submit(pow, 2, n) for n in range(4)]]
    [1, 2, 4, 8]
    >>> pool.shutdown()
"""
from __future__ import annotations

import os
import queue
import resource
import threading
from concurrent.futures import Future
from typing import Any, Callable

__all__ = ["ThreadPool", "is_thread_refusal", "limit_text", "thread_refused"]


class ThreadPool:
    """Up to ``count`` threads, started as jobs come when no thread is idle (the first by
    :meth:`start`), running the jobs submitted in turn; :meth:`shutdown` (or the end of a
    ``with`` block) waits for every job submitted, then for the threads."""

    def __init__(self, count: int, name: str):
        # Private: use ThreadPool.start.
        self._count, self._name = count, name
        self._threads: list[threading.Thread] = []
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)  # (one release per thread waiting for a job)
        self._pid = os.getpid()  # (a fork child's copy has no thread: it refuses jobs)
        self._shut = False

    @classmethod
    def start(cls, count: int, name: str) -> "ThreadPool | None":
        """A pool of up to ``count`` threads named ``name-<i>``, or None if the system
        starts not even the first: the caller works alone."""
        pool = cls(count, name)
        return pool if pool._grow() else None

    def _grow(self) -> bool:
        """Start one more thread; whether the system started it."""
        thread = threading.Thread(target=_serve, args=(self._jobs, self._idle),
                                  name=f"{self._name}-{len(self._threads)}", daemon=True)
        try:
            thread.start()
        except RuntimeError:  # can't start new thread: the ones started do the work
            self._count = len(self._threads)  # (no more tries: each costs a clone)
            return False
        self._threads.append(thread)
        return True

    def submit(self, fn: Callable, *args: Any, **kwargs: Any) -> Future:
        """Run ``fn(*args, **kwargs)`` on a thread of the pool; its future."""
        if self._shut or os.getpid() != self._pid:  # (no thread would ever run it: its waiter hung)
            raise RuntimeError("ThreadPool.submit: the pool is shut down (or this is a fork child's copy of it).")
        future: Future = Future()
        self._jobs.put((future, fn, args, kwargs))
        if not self._idle.acquire(blocking=False) and len(self._threads) < self._count:
            self._grow()
        return future

    def map(self, fn: Callable, items) -> list:
        """``[fn(item) for item in items]``, run on the pool; the first error is raised
        once every call ended."""
        futures = [self.submit(fn, item) for item in items]
        for future in futures:
            future.exception()  # (wait for every one)
        return [future.result() for future in futures]

    def shutdown(self) -> None:
        """Wait for the jobs submitted, then end the threads (it may be called again)."""
        self._shut = True
        for _ in self._threads:
            self._jobs.put(None)
        for thread in self._threads:
            thread.join()
        self._threads = []

    def __enter__(self) -> "ThreadPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _serve(jobs: queue.SimpleQueue, idle: threading.Semaphore) -> None:
    while True:
        idle.release()
        job = jobs.get()
        if job is None:
            return
        future, fn, args, kwargs = job
        if not future.set_running_or_notify_cancel():
            continue
        try:
            result = fn(*args, **kwargs)
        except BaseException as error:  # noqa: B036 - the caller's to raise, as an executor's future does
            future.set_exception(error)
        else:
            future.set_result(result)
        del job, future, fn, args, kwargs  # (nothing of a job kept alive while waiting for the next)


def limit_text(which: int) -> str:
    """``"soft/hard"`` of the limit ``which`` (``resource.RLIMIT_...``), as ``ulimit`` words them.

    Example:
        >>> limit_text(resource.RLIMIT_CPU)
        'unlimited/unlimited'
    """
    return "/".join("unlimited" if value == resource.RLIM_INFINITY else str(value)
                    for value in resource.getrlimit(which))


def is_thread_refusal(error: BaseException) -> bool:
    """Whether ``error`` is ``Thread.start``'s for a thread the system refused."""
    return type(error) is RuntimeError and str(error) == "can't start new thread"


def thread_refused(error: BaseException, what: str,
                   fix: str = "pass num_threads=0 (the calling thread does the work)") -> RuntimeError:
    """The error for the thread of ``what`` that the system refused (``error``: the
    RuntimeError of ``Thread.start``); ``fix``: what helps besides raising the limit.

    Example:
        >>> "RLIMIT_NPROC soft/hard" in str(thread_refused(RuntimeError("can't start new thread"), "a write"))
        True
    """
    return RuntimeError(
        f"{error}: {what} could not start a thread. This user may have reached its limit on threads "
        f"and processes, RLIMIT_NPROC soft/hard = {limit_text(resource.RLIMIT_NPROC)} (`ulimit -u`), or "
        f"this process its memory limit, RLIMIT_AS soft/hard = {limit_text(resource.RLIMIT_AS)}. Raise the "
        f"limit, or {fix}.")
