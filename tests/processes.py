"""Bounded waits on child processes, for the multi-process tests.

A helper module, not a test (pytest collects only test_*.py); imported as
``tests.processes`` (see tests/conftest.py).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import pytest

from shared_td.platform import pid_alive

WAIT = 30  # seconds: the bound on every join / queue read


def finish(process, timeout: float = WAIT) -> int:
    """Join ``process`` within ``timeout`` seconds and return its exit code; a process
    still alive then is killed and the test fails."""
    process.join(timeout)
    if process.is_alive():
        process.kill()
        process.join(timeout)
        pytest.fail("child process hung")
    return process.exitcode


def fork_exit_code(pid: int, timeout: float = WAIT) -> int | None:
    """The exit code of the fork child ``pid`` (``os.waitstatus_to_exitcode``: minus the
    signal that ended it), waited for within ``timeout`` seconds; None for a child still
    running then, which is killed (and reaped)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None


@contextlib.contextmanager
def held_elsewhere(lock, timeout: float = WAIT):
    """``lock`` held by another thread for the block, as a sync or a transfer under way
    on its caller's thread holds it (the cluster's locks are re-entrant RLocks: held by
    the test's own thread, they would not look held to its calls)."""
    taken, done = threading.Event(), threading.Event()

    def hold():
        with lock:
            taken.set()
            done.wait(timeout)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    try:
        assert taken.wait(timeout), "the lock was not taken"
        yield
    finally:
        done.set()
        holder.join(timeout)


def wait_until(condition, timeout: float = 10.0) -> bool:
    """Poll ``condition()`` until it is true or ``timeout`` seconds passed; its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def all_threads_stopped(pid: int) -> bool:
    """Whether every thread of process ``pid`` is stopped (SIGSTOP is delivered
    asynchronously: ``kill`` returns before the target stops, and a thread of it may
    still serve a request meanwhile)."""
    states = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/stat", "rb") as stat:
                states.append(stat.read().rsplit(b")", 1)[1].split()[0])
        except OSError:  # a thread that ended meanwhile
            pass
    return all(state in (b"T", b"t") for state in states)


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie counts as dead), as shared_td sees it."""
    return pid_alive(pid)


@contextlib.contextmanager
def small_tmpfs(path, size: str = "1m"):
    """A real tmpfs of ``size`` mounted at the new directory ``path`` for the block, then
    unmounted; the test is skipped (saying why) where mounting needs root it lacks."""
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                             capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {mounted.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


# The script run_as_nobody runs: the caller's code defines warm(base) and check(base).
_AS_NOBODY = """
import os, sys
base = sys.argv[1]
{code}
warm(base)  # as the caller: the lazy imports (as root, the interpreter may be unreadable to nobody)
if os.getuid() != 0:
    raise SystemExit(0 if check(base) else 1)
pid = os.fork()  # root writes read-only files and directories: the user nobody does not
if pid == 0:
    try:
        os.setgid({uid}); os.setgroups([]); os.setuid({uid})
    except OSError:
        os._exit(77)
    os._exit(0 if check(base) else 1)
_, status = os.waitpid(pid, 0)
raise SystemExit(os.waitstatus_to_exitcode(status))
"""


def run_as_nobody(code: str, timeout: float = 120, uid: int = 65534) -> subprocess.CompletedProcess:
    """Run ``code`` (Python source defining ``warm(base)`` and ``check(base) -> bool``)
    in a new interpreter: ``warm`` as this user, then ``check`` as the user nobody in a
    fork child when this is root (who writes read-only files), else directly. ``base``:
    a fresh directory anyone may write (pytest's tmp_path may lie under a root-only one),
    removed afterwards, made writable again first. Skips the test when root cannot drop
    to nobody; fails it, with the output, unless ``check`` returned True. ``uid``: another
    user (and group) than nobody's 65534, one no other process runs as (a limit per user,
    RLIMIT_NPROC, then counts only the check's tasks)."""
    base = tempfile.mkdtemp()
    os.chmod(base, 0o777)
    try:
        done = subprocess.run([sys.executable, "-c", _AS_NOBODY.format(code=textwrap.dedent(code), uid=int(uid)), base],
                              timeout=timeout, capture_output=True, text=True)
    finally:
        for root, directories, _ in os.walk(base):
            for name in directories:
                os.chmod(os.path.join(root, name), 0o755)
        shutil.rmtree(base)
    if done.returncode == 77:
        pytest.skip("cannot drop to the user nobody")
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    return done
