"""Watching the demo's processes: bounded waits that give up as soon as one of them died,
and a bounded stop that kills what hangs.

Example:
    >>> exit_reason(1), exit_reason(-9)
    ('exit code 1', 'killed by SIGKILL')
"""
from __future__ import annotations

import signal
import sys
import time
from contextlib import contextmanager
from multiprocessing import resource_tracker

__all__ = ["check_alive", "exit_reason", "ignore_ctrl_c", "manager_answers", "start_all", "stop", "wait_for"]

STOP_TIMEOUT = 30.0  # seconds for all the processes together to finish their step and exit
KILL_TIMEOUT = 10.0  # seconds for the killed ones to be reaped (SIGKILL cannot be refused)


def exit_reason(exitcode: int) -> str:
    """How a process ended, from ``multiprocessing.Process.exitcode`` (-N: signal N)."""
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


def check_alive(processes, what: str) -> None:
    """RuntimeError naming the processes (``multiprocessing.Process``) that exited."""
    dead = [p for p in processes if p.exitcode is not None]
    if dead:
        codes = ", ".join(f"{p.name} {exit_reason(p.exitcode)}" for p in dead)
        # a signal leaves no traceback: point at one only when a process could print it
        hint = "; see its traceback above" if any(p.exitcode > 0 for p in dead) else ""
        raise RuntimeError(f"a demo process failed during {what} ({codes}){hint}")


def wait_for(condition, processes, timeout: float, what: str) -> None:
    """Wait until ``condition()``; RuntimeError if one of ``processes`` died or after
    ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        check_alive(processes, what)
        if time.monotonic() > deadline:
            raise RuntimeError(f"the demo's processes did not {what} within {timeout:g} s")
        time.sleep(0.05)


@contextmanager
def _ctrl_c_held():
    """SIGINT blocked in this thread for the block; one that arrives meanwhile is
    delivered (KeyboardInterrupt) when the block ends."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def start_all(processes) -> None:
    """Start each process with SIGINT blocked: a child inherits the mask, so a Ctrl-C
    from the terminal (sent to the whole process group) while it is still importing
    torch stays pending instead of killing it with a traceback; the worker then ignores
    it (:func:`ignore_ctrl_c`) and the parent, which gets it once the starts are done,
    stops every process."""
    # multiprocessing starts its resource tracker with the first spawned process, and
    # unblocks SIGINT in this thread when it has: start it before blocking
    resource_tracker.ensure_running()
    for process in processes:
        with _ctrl_c_held():
            process.start()


def ignore_ctrl_c() -> None:
    """In a worker: ignore SIGINT (the parent stops it through the shared state), then
    unblock it (:func:`start_all` started the worker with SIGINT blocked); a Ctrl-C
    pending from start-up is dropped."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _started(process) -> bool:
    """Whether ``process`` was started and not closed (a closed one was reaped)."""
    try:
        return process.pid is not None
    except ValueError:  # closed by an earlier stop()
        return False


def stop(processes, report: bool, announce: bool = False) -> None:
    """Wait up to :data:`STOP_TIMEOUT` seconds, all the processes together, for every
    started process to exit, then SIGKILL those still running (a stuck or stopped one
    too) and reap them; if ``report``, raise RuntimeError when any failed or hung.

    ``announce`` (after a Ctrl-C): say on stderr what is being waited for. A
    KeyboardInterrupt during the wait (a second Ctrl-C) kills every process still
    running at once, reaps them, and is raised again. When this returns or raises,
    every started process has exited and been reaped.
    """
    started = [p for p in processes if _started(p)]
    running = [p for p in started if p.exitcode is None]
    if announce and running:
        print(f"shared_td demo: stopping {len(running)} processes (up to {STOP_TIMEOUT:g} s; "
              "Ctrl-C again to kill them)", file=sys.stderr, flush=True)
    hung = set()
    try:
        deadline = time.monotonic() + STOP_TIMEOUT
        for process in running:
            process.join(max(deadline - time.monotonic(), 0.0))
    finally:  # on time, late or interrupted: kill the rest now, and reap everything
        with _ctrl_c_held():  # a third Ctrl-C waits until the kills are done
            hung = {p for p in started if p.exitcode is None}
            for process in hung:
                process.kill()  # SIGKILL: works on a stopped process too
            for process in hung:
                process.join(KILL_TIMEOUT)
    failed = []
    for process in started:
        if process in hung:
            failed.append(f"{process.name} hung and was killed")
        elif process.exitcode != 0:
            failed.append(f"{process.name} {exit_reason(process.exitcode)}")
        if process.exitcode is not None:
            process.close()
    if failed and report:
        raise RuntimeError(f"demo processes failed: {', '.join(failed)}")


def manager_answers(coord) -> None:
    """RuntimeError if the coordinator's manager does not answer (one round trip): the
    workers never call it during the run, so a manager that died would go unseen."""
    try:
        coord.names()
    except (ConnectionError, OSError) as error:
        raise RuntimeError(f"the coordinator's manager stopped during the run: {error}") from error
