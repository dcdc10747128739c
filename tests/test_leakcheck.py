"""The leak checks of tests/leakcheck.py count what our processes made, and only that.

Beside another program that makes and removes entries in /dev/shm and the temp directory
(foreign_churn), a leak planted by one of our processes (held in /dev/shm and left
there, named like ours, or left in the private temp directory) is reported, and nothing
else is: the checks stay green beside other programs without going blind.
"""
from __future__ import annotations

import mmap
import multiprocessing
import os
import tempfile
import time
import uuid

import pytest

from tests.leakcheck import SHM, ShmWatch, foreign_churn, private_tempdir
from tests.processes import finish

pytestmark = pytest.mark.timeout(60)


def make_shm(name: str, hold: float = 0.0, unlink: bool = False) -> str:
    """Create /dev/shm/<name>, map it for ``hold`` seconds, unlink it if asked."""
    path = os.path.join(SHM, name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.ftruncate(fd, 4096)
    mapping = mmap.mmap(fd, 4096)
    os.close(fd)
    time.sleep(hold)
    if unlink:
        os.unlink(path)
    mapping.close()
    return path


def leak_things(tag: str) -> None:
    """A process of ours that leaks: what the checks must report."""
    make_shm(f"planted-{tag}-held", hold=0.3)  # a name no rule knows: seen held
    make_shm(f"planted-{tag}-cleaned", hold=0.3, unlink=True)  # removed: no leak
    make_shm(f"torch_{os.getpid()}_planted-{tag}")  # torch's naming, with our pid
    make_shm(f"shared_td-planted-{os.getpid()}-{tag}")  # our naming and pid, never held long
    with open(os.path.join(tempfile.gettempdir(), f"planted-{tag}"), "w"):
        pass
    if os.fork() == 0:  # a grandchild, soon orphaned: still ours
        time.sleep(0.3)  # (its parent has exited by now)
        make_shm(f"planted-{tag}-orphan", hold=0.3)
        os._exit(0)
    time.sleep(0.1)  # seen as our descendant before it is orphaned


def test_a_planted_leak_is_reported_and_another_programs_entries_are_not():
    tag = uuid.uuid4().hex[:8]
    make_shm(f"torch_1_planted-{tag}")  # torch's naming, not our pid: not ours
    make_shm(f"shared_td-planted-1-{tag}")  # shared_td's naming, not our pid: not ours
    make_shm(f"shared_td_bench_planted-{tag}")  # e.g. a benchmark run beside the tests
    child = None
    try:
        with foreign_churn(), private_tempdir() as tempdir, ShmWatch() as shm:
            child = multiprocessing.get_context("fork").Process(target=leak_things, args=(tag,))
            child.start()
            assert finish(child) == 0
            time.sleep(0.8)  # the orphaned grandchild's turn
            left_in_tempdir = os.listdir(tempdir)
        assert left_in_tempdir == [f"planted-{tag}"]
        assert shm.leftovers() == sorted(os.path.join(SHM, name) for name in [
            f"planted-{tag}-held", f"torch_{child.pid}_planted-{tag}",
            f"shared_td-planted-{child.pid}-{tag}", f"planted-{tag}-orphan"])
    finally:
        for name in os.listdir(SHM):
            if f"planted-{tag}" in name:
                os.unlink(os.path.join(SHM, name))


def test_nothing_reported_when_our_processes_clean_up():
    tag = uuid.uuid4().hex[:8]
    with foreign_churn(), private_tempdir() as tempdir, ShmWatch() as shm:
        child = multiprocessing.get_context("fork").Process(
            target=make_shm, args=(f"planted-{tag}",), kwargs={"hold": 0.3, "unlink": True})
        child.start()
        assert finish(child) == 0
        assert os.listdir(tempdir) == []
    assert shm.leftovers() == []
    assert any(path.endswith(f"planted-{tag}") for path, _ in shm.seen)  # it was seen


def test_an_entry_named_with_a_reused_pid_before_the_watch_is_not_ours():
    # a CI run failed on /dev/shm/shared_td-planted-19371-...: left hours before by a
    # process whose pid a node of the test was given again
    tag = uuid.uuid4().hex[:8]
    stale = make_shm(f"shared_td-planted-{os.getpid()}-{tag}")  # our naming, our pid, already there
    try:
        with ShmWatch() as shm:
            pass
        assert shm.leftovers() == []
    finally:
        os.unlink(stale)
