"""Leak checks that count only what the processes under test made.

A before/after listing of all of /dev/shm or of the temp directory fails whenever another
program (another test run, any ``multiprocessing`` program with its semaphores) creates
or removes an entry meanwhile. These helpers look only at what our processes made:

* the temp directory: :func:`private_tempdir` gives the test process
  (``tempfile.tempdir``) and every process it starts (``TMPDIR``) a directory of their
  own, so whatever is left in it is ours;
* /dev/shm: :class:`ShmWatch` samples, while the test runs, the /dev/shm entries that this
  process and its descendants hold open (``/proc/<pid>/fd``) or mapped
  (``/proc/<pid>/maps``); afterwards, an entry they held that still exists (same inode)
  is a leak, and so is any entry bearing our naming with the pid of one of our
  processes (``shared_td-<what>-<pid>-``, or torch's ``torch_<pid>_``);
* :func:`foreign_churn`: another program beside the test, which creates and removes
  ``multiprocessing`` semaphores in /dev/shm, files in the temp directory and directories
  named like another shared_td run's coordinators, so the tests show they stay green.

A helper module, not a test (pytest collects only test_*.py). Every wait is bounded.
"""
from __future__ import annotations

import contextlib
import os
import re
import select
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

SHM = "/dev/shm"
#: What shared_td or torch would name in /dev/shm (shared_td's names carry the maker's
#: pid, ``shared_td-<what>-<pid>-...``; torch's file_system sharing strategy names
#: ``torch_<pid>_<random>``): ours only when the pid is one of our processes' (another
#: program, e.g. a benchmark run beside the tests, makes ``shared_td_bench_*`` too).
OUR_SHM_NAME = re.compile(r"^shared_td[-_][a-z_]*?-?(\d+)-|^torch_(\d+)_")


@contextlib.contextmanager
def private_tempdir():
    """For the block, a temp directory of its own for this process and the processes it
    starts (removed afterwards). Start a process that must outlive the block (e.g. the
    embedded coordinator) before it.

    Short (``<tmp>/std-XXXXXXXX``): a coordinator's socket lives two levels below and a
    Unix socket path must fit in 108 bytes.
    """
    path = tempfile.mkdtemp(prefix="std-", dir=tempfile.gettempdir())
    saved_tempdir, saved_env = tempfile.tempdir, os.environ.get("TMPDIR")
    tempfile.tempdir, os.environ["TMPDIR"] = path, path
    try:
        yield path
    finally:
        tempfile.tempdir = saved_tempdir
        if saved_env is None:
            del os.environ["TMPDIR"]
        else:
            os.environ["TMPDIR"] = saved_env
        shutil.rmtree(path, ignore_errors=True)


def _processes() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, start time) of every process, from /proc/<pid>/stat."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        found[int(entry)] = (int(fields[1]), int(fields[19]))
    return found


def held_in_shm(pid: int) -> set[tuple[str, int]]:
    """(path, inode) of the /dev/shm entries process ``pid`` holds open or mapped
    (an unlinked one too: its path then no longer names it)."""
    held = set()
    try:
        with open(f"/proc/{pid}/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].startswith(SHM + "/"):
                    held.add((fields[5].rstrip("\n").removesuffix(" (deleted)"), int(fields[4])))
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith(SHM + "/"):
                    held.add((target.removesuffix(" (deleted)"), os.stat(f"/proc/{pid}/fd/{fd}").st_ino))
            except OSError:  # closed meanwhile
                pass
    except OSError:  # the process is gone
        pass
    return held


class ShmWatch:
    """What this process and its descendants hold in /dev/shm while the ``with`` block
    runs, sampled every ``interval`` seconds; :meth:`leftovers` after the block.

    A descendant is remembered (with its start time, so a reused pid is not taken for
    it) after it exits or is orphaned. What our processes already held when the watch
    started is not this test's.
    """

    def __init__(self, interval: float = 0.02):
        self.interval = interval
        self.pids: dict[int, int] = {}  # pid -> start time, every process watched so far
        self.seen: dict[tuple[str, int], int] = {}  # (path, inode) -> a pid that held it
        self.before: set[tuple[str, int]] = set()
        self.present: dict[str, int] = {}  # path -> inode of every /dev/shm entry at the start
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "ShmWatch":
        self.present = _inodes_in_shm()
        self.sample()
        self.before = set(self.seen)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(30)
        self.sample()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def sample(self) -> None:
        processes = _processes()
        me = os.getpid()
        self.pids.setdefault(me, processes[me][1])
        grown = True
        while grown:  # descendants of the processes watched (that are still those)
            grown = False
            for pid, (parent, started) in processes.items():
                if pid not in self.pids and self.pids.get(parent) == processes.get(parent, (0, -1))[1]:
                    self.pids[pid] = started
                    grown = True
        for pid, started in self.pids.items():
            if processes.get(pid, (0, None))[1] == started:
                for entry in held_in_shm(pid):
                    self.seen.setdefault(entry, pid)

    def leftovers(self) -> list[str]:
        """/dev/shm entries our processes made and left: held during the watch (not
        before) and still there with the same inode, or named like ours and not there
        before the watch (a stale entry of a dead process whose pid one of ours reuses
        is not ours)."""
        now = _inodes_in_shm()
        left = {path for path in named_like_ours(self.pids)
                if path not in self.present or self.present[path] != now.get(path)}
        for path, inode in set(self.seen) - self.before:
            try:
                if os.stat(path).st_ino == inode:
                    left.add(path)
            except OSError:
                pass
        return sorted(left)


def this_process_in_shm() -> set[tuple[str, int]]:
    """What this process holds in /dev/shm, and the entries named like ours there (for a
    before/after comparison within one process)."""
    return held_in_shm(os.getpid()) | {(path, 0) for path in named_like_ours({os.getpid()})}


def _inodes_in_shm() -> dict[str, int]:
    found = {}
    for name in os.listdir(SHM):
        path = os.path.join(SHM, name)
        try:
            found[path] = os.lstat(path).st_ino
        except OSError:  # removed meanwhile
            pass
    return found


def named_like_ours(pids) -> list[str]:
    """Entries of /dev/shm named like shared_td's, or like torch's of one of ``pids``."""
    found = []
    for name in os.listdir(SHM):
        match = OUR_SHM_NAME.search(name)
        if match and int(match.group(1) or match.group(2)) in pids:
            found.append(os.path.join(SHM, name))
    return found


CHURN = textwrap.dedent("""
    import multiprocessing, os, select, sys, time, uuid
    if os.fork():
        os._exit(0)  # detached: the test's process tree does not hold this program
    root = sys.argv[1]
    ctx = multiprocessing.get_context("spawn")  # its semaphores stay named in /dev/shm
    made = []  # (semaphore, file, directory), oldest first
    print("ready", flush=True)
    deadline = time.monotonic() + float(sys.argv[2])
    while time.monotonic() < deadline and not select.select([sys.stdin], [], [], 0.005)[0]:
        tag = uuid.uuid4().hex[:8]
        path = os.path.join(root, f"foreign-{tag}")
        open(path, "w").close()
        directory = os.path.join(root, f"shared_td-coord-{os.getpid()}-{tag}")  # another run's
        os.mkdir(directory)
        made.append((ctx.Semaphore(), path, directory))
        if len(made) > 8:
            _, path, directory = made.pop(0)  # the semaphore is unlinked when collected
            os.unlink(path)
            os.rmdir(directory)
    for _, path, directory in made:
        os.unlink(path)
        os.rmdir(directory)
    made.clear()
""")


@contextlib.contextmanager
def foreign_churn(seconds: float = 240):
    """Another program, not a descendant of this one, that creates and removes entries
    in /dev/shm and in the (real, shared) temp directory for the block (``seconds`` at
    most)."""
    root = tempfile.gettempdir()
    env = {k: v for k, v in os.environ.items() if k != "TMPDIR"}
    launcher = subprocess.Popen([sys.executable, "-c", CHURN, root, str(seconds)], env=env,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        launcher.wait(30)  # it exits once the program forked itself away
        ready, _, _ = select.select([launcher.stdout], [], [], 30)
        assert ready and launcher.stdout.readline() == b"ready\n", "the foreign program did not start"
        time.sleep(0.2)  # let it make a few entries first
        yield
    finally:
        launcher.stdin.close()  # EOF: the program cleans up and exits
        launcher.stdout.close()
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(30)
