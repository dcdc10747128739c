"""Watching the demo's processes: bounded waits that give up as soon as one of them died,
and a bounded stop that kills what hangs."""
from __future__ import annotations

import time

__all__ = ["check_alive", "stop", "wait_for"]

STOP_TIMEOUT = 30.0  # seconds for each process to finish its step and exit


def check_alive(processes, what: str) -> None:
    """RuntimeError naming the processes (``multiprocessing.Process``) that exited."""
    dead = [p for p in processes if p.exitcode is not None]
    if dead:
        codes = ", ".join(f"{p.name} exit code {p.exitcode}" for p in dead)
        raise RuntimeError(f"a demo process failed during {what} ({codes}); see its traceback above")


def wait_for(condition, processes, timeout: float, what: str) -> None:
    """Wait until ``condition()``; RuntimeError if one of ``processes`` died or after
    ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        check_alive(processes, what)
        if time.monotonic() > deadline:
            raise RuntimeError(f"the demo's processes did not {what} within {timeout:g} s")
        time.sleep(0.05)


def stop(processes, report: bool) -> None:
    """Join every started process; kill one that does not stop in time; if ``report``,
    raise RuntimeError when any failed or hung."""
    failed = []
    for process in processes:
        if process.pid is None:
            continue  # never started
        process.join(STOP_TIMEOUT)
        if process.exitcode is None:
            failed.append(f"{process.name} hung and was killed")
            process.kill()
            process.join(STOP_TIMEOUT)
        elif process.exitcode != 0:
            failed.append(f"{process.name} exit code {process.exitcode}")
        process.close()
    if failed and report:
        raise RuntimeError(f"demo processes failed: {', '.join(failed)}")
