"""The worker processes of ``TensorDictBase.map``/``map_iter``: a small pool that runs
``fn`` on each chunk it is sent and notices a worker that died.

Why not ``multiprocessing.Pool``: when one of its workers dies (SIGKILL, the OOM killer,
a segfault in ``fn``), the pool starts another one and the chunk it held is lost, so
``imap`` waits for its result for ever (tensordict 0.15.3's ``map`` hangs so). Here each
worker holds one chunk at a time on a pipe of its own, and the parent waits on the pipes
and on the processes' sentinels together: a worker that dies is a ``WorkerDiedError``
that names the chunk it held, at once, and every other worker is stopped.

Chunks and results travel through ``multiprocessing``'s pickler with torch's reductions
(``torch.multiprocessing``): a memory-mapped chunk goes by file name, a plain tensor
through shared memory, as with tensordict's pool.
"""
from __future__ import annotations

import os
import resource
import signal
import threading
import traceback
import weakref
from multiprocessing import connection, process as mp_process
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import torch

from shared_td.errors import WorkerDiedError, WorkerTraceback
from shared_td.platform import CreatorWatch
from shared_td.thread_pool import is_thread_refusal, limit_text, thread_refused

__all__ = ["run_chunks"]

_JOIN_S = 5.0  # seconds a stopped worker gets to exit before it is killed
_POLL_S = 1.0  # seconds between two looks at the workers while none answers (Ctrl-C is seen)


def run_chunks(fn: Callable, tasks: Iterable[tuple], *, workers: int, start_method: str | None, seed: int,
               threads: int, tasks_per_worker: int | None, ordered: bool, describe: Callable[[int], str]) -> Iterator:
    """Yield ``fn(chunk)`` for each ``(number, chunk, out)`` of ``tasks`` (with ``out``
    not None, the worker writes the result into it, ``out.update_(result)``, and None is
    yielded), computed by ``workers`` processes started with ``start_method`` (None: torch's
    default). In the order of the numbers if ``ordered``, else as they are done. Worker
    ``i`` seeds torch with ``seed + i`` and numpy with it too, and uses ``threads`` torch
    threads; it is replaced after ``tasks_per_worker`` chunks (None: never).

    Raises the error ``fn`` raised in a worker (the worker's traceback as its cause), or
    WorkerDiedError naming the chunk (``describe(number)``) a worker held when it died.
    Closing the generator early, or an error, stops every worker (within 5 s each, then
    SIGKILL) and closes every pipe.
    """
    import torch.multiprocessing as torch_mp  # (registers torch's reductions with the pickler)

    context = torch_mp.get_context(start_method)
    if threads > 1 and context.get_start_method() == "fork":
        # (measured: map(worker_threads=2) of a 16 MiB leaf never returned, as tensordict's)
        raise ValueError(
            f"map(worker_threads={threads}) with the 'fork' start method: a forked worker's torch threads hang "
            "once the parent has used its own (OpenMP is not fork-safe), so its chunk would never come back. "
            "Pass mp_start_method='spawn' or 'forkserver' for several threads per worker, or worker_threads=1.")
    pool = _Pool(context, fn, workers, seed, threads, tasks_per_worker)
    tasks = iter(tasks)
    done: dict[int, Any] = {}
    following = 0  # (ordered: the number of the next result to yield; numbers go from 0 up)
    try:
        exhausted = False
        while True:
            while not exhausted and pool.idle():
                task = next(tasks, None)
                if task is None:
                    exhausted = True
                else:
                    pool.give(task, describe)
            if exhausted and not pool.busy():
                break
            for number, result in pool.answers(describe):
                if not ordered:
                    yield result
                    continue
                done[number] = result
            while ordered and following in done:
                yield done.pop(following)
                following += 1
    finally:
        pool.close()


# The workers started in this process. A child made by os.fork inherits multiprocessing's
# table of this process's children (multiprocessing's own fork children get a fresh one):
# its normal exit (multiprocessing's atexit hook) then SIGTERMed these daemonic workers,
# which are the parent's, and the parent's map() failed with WorkerDiedError.
_LIVE: "weakref.WeakSet" = weakref.WeakSet()


def _disown_in_child() -> None:
    for process in list(_LIVE):
        mp_process._children.discard(process)
    _LIVE.clear()


os.register_at_fork(after_in_child=_disown_in_child)


class _Worker:
    __slots__ = ("process", "pipe", "holding", "served")

    def __init__(self, process: Any, pipe: Any):
        self.process, self.pipe, self.holding, self.served = process, pipe, None, 0


class _Pool:
    def __init__(self, context: Any, fn: Callable, size: int, seed: int, threads: int, tasks_per_worker: int | None):
        self._context, self._fn, self._seed, self._threads = context, fn, seed, threads
        self._limit = tasks_per_worker
        self._started = 0
        self._workers: list[_Worker] = []
        try:
            for _ in range(size):
                self._workers.append(self._start())
        except BaseException:  # (a worker that could not start: the others are stopped)
            self.close()
            raise

    def _start(self) -> _Worker:
        mine, theirs = self._context.Pipe()
        process = self._context.Process(
            target=_serve, args=(self._fn, theirs, self._seed + self._started, self._threads),
            name=f"shared_td-map-{self._started}", daemon=True)
        self._started += 1
        try:
            process.start()
        except BlockingIOError as error:  # fork or exec refused (EAGAIN): say which limit
            mine.close()
            theirs.close()
            raise BlockingIOError(error.errno, (
                f"map(): worker process {self._started - 1} could not be started ({error.strerror}): this user may "
                f"have reached its limit on processes and threads, RLIMIT_NPROC soft/hard = "
                f"{limit_text(resource.RLIMIT_NPROC)} "
                "(ulimit -u), or the system its memory. Use fewer workers (num_workers=) or raise the limit."
            )) from error
        _LIVE.add(process)
        theirs.close()  # (the worker's end: its death then reads as end of file here)
        return _Worker(process, mine)

    def idle(self) -> bool:
        return any(worker.holding is None for worker in self._workers)

    def busy(self) -> bool:
        return any(worker.holding is not None for worker in self._workers)

    def give(self, task: tuple, describe: Callable[[int], str]) -> None:
        worker = next(worker for worker in self._workers if worker.holding is None)
        worker.holding = task[0]
        try:
            worker.pipe.send(task)
        except (BrokenPipeError, ConnectionResetError):  # it died while idle
            raise self._died(worker, describe) from None
        except RuntimeError as error:
            if not is_thread_refusal(error):
                raise
            # torch shares a plain tensor's storage through multiprocessing's resource_sharer,
            # whose listener is a thread of the sender
            raise thread_refused(error, f"map(), sending {describe(task[0])} to a worker",
                                 "use fewer workers, or map a memory-mapped tensordict "
                                 "(its chunks go by file name)") from error

    def answers(self, describe: Callable[[int], str]) -> list:
        """The ``(number, result)`` of the workers that answered, waiting for one (the
        error ``fn`` raised, or WorkerDiedError, is raised)."""
        busy = [worker for worker in self._workers if worker.holding is not None]
        waited = [worker.pipe for worker in busy] + [worker.process.sentinel for worker in busy]
        ready = set(connection.wait(waited, timeout=_POLL_S))
        out = []
        for worker in busy:
            if worker.pipe in ready or worker.pipe.poll():  # (an answer sent just before it exited)
                try:
                    ok, value = worker.pipe.recv()
                except (EOFError, OSError):
                    ok, value = None, None
                if ok is None:
                    raise self._died(worker, describe)
                if not ok:
                    error, text = value
                    raise error from WorkerTraceback(text)
                out.append((worker.holding, value))
                worker.holding = None
                worker.served += 1
                if self._limit is not None and worker.served >= self._limit:
                    self._replace(worker)
            elif worker.process.sentinel in ready:
                raise self._died(worker, describe)
        return out

    def _died(self, worker: _Worker, describe: Callable[[int], str]) -> WorkerDiedError:
        worker.process.join(_JOIN_S)
        code = worker.process.exitcode
        how = (f"was killed by {signal.Signals(-code).name}" if code is not None and code < 0
               else f"exited with code {code}")
        return WorkerDiedError(
            f"map(): worker process {worker.process.pid} {how} while it computed {describe(worker.holding)}; "
            "the other workers were stopped and no result is returned. If it ran out of memory, use more, "
            "smaller chunks (num_chunks= or chunksize=) or fewer workers.")

    def _replace(self, worker: _Worker) -> None:
        _stop(worker)
        self._workers[self._workers.index(worker)] = self._start()

    def close(self) -> None:
        for worker in self._workers:
            _stop(worker)
        self._workers = []


def _stop(worker: _Worker) -> None:
    """End ``worker``: asked to (None on its pipe) when idle, else terminated; killed if
    it has not exited within _JOIN_S; its pipe closed."""
    process = worker.process
    try:
        if worker.holding is None and process.is_alive():
            worker.pipe.send(None)
        else:
            process.terminate()
    except (OSError, ValueError):  # (a pipe the worker closed by dying)
        process.terminate()
    process.join(_JOIN_S)
    if process.is_alive():
        process.kill()
        process.join(_JOIN_S)
    worker.pipe.close()


def _serve(fn: Callable, pipe: Any, seed: int, threads: int) -> None:  # in the worker process
    unwatched = _end_with_creator()  # (None: a thread watches the creator)
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    torch.set_num_threads(threads)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (Ctrl-C is the parent's to handle: it stops the workers)
    while True:
        if unwatched is not None:  # no watch thread: look at the creator while waiting for a task
            while not pipe.poll(_POLL_S):
                if unwatched.gone():
                    return
        try:
            task = pipe.recv()
        except EOFError:  # the parent is gone
            return
        if task is None:
            return
        number, chunk, out = task
        try:
            result = fn(chunk)
            if out is not None:
                if result is not None:
                    out.update_(result)
                result = None
            answer = (True, result)
        except BaseException as error:  # (sent back: the parent raises it)
            answer = (False, _portable(error))
        del task, chunk, out
        if unwatched is not None and unwatched.gone():  # (a send nobody reads could block for ever)
            return
        try:
            pipe.send(answer)
        except (BrokenPipeError, ConnectionResetError):  # the parent is gone: nobody to answer
            return
        except Exception as error:  # a result that cannot be pickled: said so, not a dead worker
            if is_thread_refusal(error):  # (torch sends a plain tensor through a thread of this worker)
                failed = thread_refused(error, "map(): a worker, sending the result of fn for a chunk back,",
                                        "use fewer workers, or pass a memory-mapped or shared out= "
                                        "(the workers write it themselves)")
            else:
                failed = RuntimeError(f"map(): the result of fn for a chunk could not be sent back to the "
                                      f"parent process ({type(error).__name__}: {error}).")
            pipe.send((False, (failed, "".join(traceback.format_exception(error)))))
        del answer


def _end_with_creator() -> "CreatorWatch | None":
    """End this worker as soon as the process that started it ends, SIGKILLed included:
    nobody would take the result of the chunk it computes (before, it ran that chunk to
    its end, minutes of a core for a long ``fn``). A watch of the process, not of a
    thread (as PR_SET_PDEATHSIG would be): a map called from a thread that ends later
    keeps its workers. Without a thread (RLIMIT_NPROC, memory) the watch is returned:
    the worker looks at it between chunks (a fork worker holds its own pipe's parent
    end, and those of the workers forked before it: the end of file never comes)."""
    watch = CreatorWatch()

    def end_when_gone() -> None:
        watch.wait()
        os._exit(1)

    try:
        threading.Thread(target=end_when_gone, name="shared_td-map-creator-watch", daemon=True).start()
    except RuntimeError:  # no thread (RLIMIT_NPROC, memory): the worker serves, looking at the watch itself
        return watch
    return None


def _portable(error: BaseException) -> tuple:
    """``(error, the worker's traceback as text)`` to send (an exception's cause is not
    pickled); a RuntimeError saying what it was in place of one that cannot be pickled."""
    import pickle

    text = "".join(traceback.format_exception(error))
    if not isinstance(error, Exception):  # (SystemExit raised in the parent would end it)
        return RuntimeError(f"map(): fn raised {type(error).__name__}: {error}"), text
    try:
        pickle.dumps(error)
    except Exception:
        error = RuntimeError(f"map(): fn raised {type(error).__name__}: {error}")
    return error, text
