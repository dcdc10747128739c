"""``map``/``map_iter`` on a pool of the caller's own (``pool=``): its ``imap_unordered``
runs the chunks, and a worker that dies is noticed.

A ``multiprocessing`` pool starts another worker when one dies, and the task it held is
lost: its ``imap`` then waits for ever. So each task marks, in shared memory, the pid of
the worker that runs it and when it is done; while the caller waits for the next
result it looks, every quarter second, at the worker of each chunk running, and raises
:class:`~shared_td.errors.WorkerDiedError` naming the chunk once that worker is gone. A
result can be lost after its chunk is done, too: torch sends the tensors of a result
through the worker's ``resource_sharer``, and if the worker dies before the pool's
result thread took them, that thread ends for good (no result of any chunk comes any
more; the pool is broken). That is raised at once, and a chunk done whose result has
not come ``_RESULT_GRACE`` after its worker ended is given up. The pool stays the
caller's to terminate. Not seen: a pool broken before the call (a worker killed while
it waited for a task holds the pool's task queue, so no chunk ever starts).
"""
from __future__ import annotations

import os
import sys
import time
from typing import Any, Callable, Iterator

import torch

from shared_td.errors import WorkerDiedError
from shared_td.platform import pid_alive

_TICK = 0.25  # seconds between two looks at the workers
_RESULT_GRACE = 10.0  # seconds for the result of a chunk done to arrive once its worker ended


def pool_results(pool: Any, fn: Callable, tasks: Iterator[tuple], total: int, ordered: bool,
                 describe: Callable[[int], str]) -> Iterator:
    """The results of ``fn`` on the chunks of ``tasks`` (``(number, chunk, out)``) run by
    ``pool``, in their order if ``ordered``."""
    from shared_td.containers.tensordict import TensorDict

    # (in an anonymous segment: sent by reference with every pickler, multiprocess's dill too,
    # where a share_memory_() tensor would travel as a copy)
    marks = TensorDict(pid=torch.zeros(total, dtype=torch.int64), done=torch.zeros(total, dtype=torch.bool),
                       batch_size=[total]).memmap_()
    timeout_error = getattr(sys.modules.get(type(pool).__module__), "TimeoutError", TimeoutError)
    arrivals = pool.imap_unordered(_Marked(fn), ((n, chunk, out, marks[n]) for n, chunk, out in tasks), 1)
    waiting: dict[int, Any] = {}
    watch = _Watch(marks, describe)
    following = 0
    for _ in range(total):
        while True:
            try:
                number, result = arrivals.next(timeout=_TICK)
                break
            except timeout_error:
                try:
                    watch.check(pool)
                except WorkerDiedError:
                    _forget_job(pool, arrivals)
                    raise
        watch.arrived(number)
        if not ordered:
            yield result
            continue
        waiting[number] = result
        while following in waiting:
            yield waiting.pop(following)
            following += 1


class _Marked:
    """``fn`` as the pool's workers call it: the task's mark holds the worker's pid
    while it runs, and says when it is done."""

    def __init__(self, fn: Callable):
        self.fn = fn

    def __call__(self, task: tuple) -> tuple[int, Any]:
        number, chunk, out, mark = task
        mark["pid"].fill_(os.getpid())
        result = self.fn(chunk)
        if out is not None:
            if result is not None:
                out.update_(result)
            result = None
        mark["done"].fill_(True)
        return number, result


class _Watch:
    """What the caller knows of the chunks: which arrived, which are done since when."""

    def __init__(self, marks: Any, describe: Callable[[int], str]):
        self.marks, self.describe = marks, describe
        self.received: set[int] = set()
        self.done_since: dict[int, float] = {}

    def arrived(self, number: int) -> None:
        self.received.add(number)

    def check(self, pool: Any) -> None:
        pids, done = self.marks["pid"].tolist(), self.marks["done"].tolist()
        pending = [number for number, pid in enumerate(pids) if pid and number not in self.received]
        # (multiprocessing's own thread that receives the results; private, so looked up with care)
        results_thread = getattr(pool, "_result_handler", None)
        if pending and results_thread is not None and not results_thread.is_alive() and _state_of(pool) == "RUN":
            raise WorkerDiedError(
                f"The pool given to map() stopped receiving results (its result thread ended: a worker died "
                f"while a result it sent was being received), so the {len(pending)} chunks still pending "
                f"({self.describe(pending[0])} first) are lost. The pool is broken: terminate() it, or let "
                f"shared_td run the workers (no pool=).")
        now = time.monotonic()
        for number in pending:
            if not done[number]:
                if not pid_alive(pids[number]):
                    raise WorkerDiedError(
                        f"A worker of the pool given to map() (pid {pids[number]}) ended while it computed "
                        f"{self.describe(number)}: that chunk is lost, and the pool's imap would wait for it for "
                        f"ever. terminate() the pool if it is of no more use, or let shared_td run the workers (no "
                        f"pool=): it stops them all.")
            elif pid_alive(pids[number]):  # (still sending it: a large result takes its time)
                self.done_since.pop(number, None)
            elif now - self.done_since.setdefault(number, now) > _RESULT_GRACE:
                raise WorkerDiedError(
                    f"The result of {self.describe(number)}, computed by the pool given to map() (worker pid "
                    f"{pids[number]}), has not come {_RESULT_GRACE:.0f} s after its worker ended: it is lost (the "
                    f"worker died before the result was received). terminate() the pool.")


def _forget_job(pool: Any, arrivals: Any) -> None:
    """Drop this map's job from a pool whose result thread ended: a job left in its
    cache makes the pool's ``terminate()`` raise CPython's AssertionError ("Cannot have
    cache with result_handler not alive") before it stops the workers."""
    results_thread = getattr(pool, "_result_handler", None)
    if results_thread is not None and not results_thread.is_alive():
        getattr(pool, "_cache", {}).pop(getattr(arrivals, "_job", None), None)


def _state_of(pool: Any) -> str:
    """The pool's state ("RUN" while it takes tasks), or "RUN" if it does not say."""
    return str(getattr(pool, "_state", "RUN"))
