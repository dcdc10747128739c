"""The examples and the demo, run as a user runs them: in a subprocess, bounded in time.

Each run gets a private TMPDIR, so "nothing left in the temp directory" is checked on a
directory no other program writes to, and an environment marker, which every process
it starts inherits, so "no child process left" is checked by scanning /proc for it.
"Nothing left in /dev/shm" counts only the entries that the processes of the run held
(sampled from their /proc/<pid>/fd and maps while it runs, see tests/leakcheck.py), and
another program makes and removes entries in /dev/shm and the temp directory meanwhile.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import uuid

import pytest

from tests.leakcheck import ShmWatch, foreign_churn

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(REPO_ROOT, "examples")
TIMEOUT = 240  # seconds: spawning processes that import torch is slow on a loaded 2-core box

pytestmark = pytest.mark.timeout(TIMEOUT + 60)


def processes_with(marker: str) -> list[int]:
    """Pids of live processes whose environment holds ``marker``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as environ:
                if marker.encode() in environ.read():
                    found.append(int(entry))
        except OSError:  # gone meanwhile, or not ours
            pass
    return found


def run_python(args: list[str], short_tmp_path) -> tuple[subprocess.CompletedProcess, str, ShmWatch]:
    """Run ``python <args>`` from the repository root with a private TMPDIR and a
    marker in its environment, beside another program that churns /dev/shm and the
    temp directory; returns the result, the marker and what its processes held in
    /dev/shm."""
    private_tmp = short_tmp_path / "tmp"
    private_tmp.mkdir()
    marker = f"shared_td-test-{uuid.uuid4().hex}"
    env = dict(os.environ, TMPDIR=str(private_tmp), SHARED_TD_TEST_MARKER=marker)
    with foreign_churn(), ShmWatch() as shm:
        result = subprocess.run([sys.executable, *args], cwd=REPO_ROOT, env=env,
                                capture_output=True, text=True, timeout=TIMEOUT)
    return result, marker, shm


def assert_nothing_left(short_tmp_path, marker: str, shm: ShmWatch) -> None:
    # the multiprocessing resource tracker leaves when its parent has exited (unlinking
    # what that left): give it a moment
    deadline = time.monotonic() + 15
    while processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert processes_with(marker) == []
    assert os.listdir(short_tmp_path / "tmp") == []
    assert shm.leftovers() == []


def test_actor_learner_example(short_tmp_path):
    result, marker, shm = run_python(
        [os.path.join(EXAMPLES, "actor_learner.py"), "--seconds", "3", "--actors", "2"], short_tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    throughput = re.search(r"throughput: 2 actors wrote ([\d,]+) transitions \(([\d.]+[kMG]?)/s\), "
                           r"the learner sampled ([\d,]+)", result.stdout)
    assert throughput, result.stdout
    assert int(throughput[1].replace(",", "")) > 0 and int(throughput[3].replace(",", "")) > 0
    cursor = re.search(r"cursor: reserved ([\d,]+) slots = written ([\d,]+); "
                       r"every slot written exactly once", result.stdout)
    assert cursor, result.stdout
    assert cursor[1] == cursor[2] and int(cursor[1].replace(",", "")) > 0
    assert_nothing_left(short_tmp_path, marker, shm)


def test_multiprocess_test_example_passes_under_pytest(short_tmp_path):
    result, marker, shm = run_python(
        ["-m", "pytest", "-q", "-p", "no:cacheprovider", os.path.join(EXAMPLES, "multiprocess_test.py")],
        short_tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"\b2 passed\b", result.stdout), result.stdout
    assert_nothing_left(short_tmp_path, marker, shm)


def test_demo_runs_reports_and_leaves_nothing_behind(short_tmp_path):
    # the README's main job, as CI runs it (issue 6: --seconds 5)
    result, marker, shm = run_python(["-m", "shared_td", "demo", "--seconds", "5"], short_tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "shared_td demo: 2 actor processes and 1 learner for 5." in out, out
    assert re.search(r"written +[\d,]+ transitions \([\d.]+[kMG]?/s", out), out
    assert re.search(r"sampled +[\d,]+ transitions", out), out
    assert re.search(r"reserved ([\d,]+) slots = written \1; every slot written exactly once", out), out
    assert "all 4 processes map the same memory" in out, out
    assert out.rstrip().endswith("result   OK"), out
    assert_nothing_left(short_tmp_path, marker, shm)


def test_demo_refuses_bad_options():
    code = ("import argparse; from shared_td.cli import demo; p = argparse.ArgumentParser(); "
            "demo.add_arguments(p); p.parse_args(['--actors', '0'])")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=TIMEOUT)
    assert result.returncode == 2 and "must be positive" in result.stderr, result.stderr


@pytest.mark.parametrize("script", ["shared_buffer.py", "dataloader_workers.py"])
def test_older_examples_run(short_tmp_path, script):
    result, marker, shm = run_python([os.path.join(EXAMPLES, script)], short_tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    expected = {"shared_buffer.py": "actors wrote 128 rows into shared memory",
                "dataloader_workers.py": "every sample was marked seen in the shared files: True"}
    assert expected[script] in result.stdout, result.stdout
    assert_nothing_left(short_tmp_path, marker, shm)


def test_readme_actor_learner_snippet_runs(short_tmp_path):
    with open(os.path.join(REPO_ROOT, "README.md")) as readme:
        text = readme.read()
    section = text[text.index("### Actor/learner: a shared replay buffer"):]
    snippet = re.search(r"```python\n(.*?)```", section, re.S)[1]
    assert len(snippet.splitlines()) <= 25
    script = short_tmp_path / "snippet.py"
    script.write_text(snippet)
    result, marker, shm = run_python([str(script)], short_tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.split() == ["320", "320"]  # 2 actors x 10 x 16 rows, all written
    assert_nothing_left(short_tmp_path, marker, shm)


def test_a_demo_worker_whose_parent_died_before_it_checked_in_leaves():
    """The demo's parent was SIGKILLed before a worker checked in (still attaching on a
    loaded machine): the worker's own ``os.getppid()`` named the reaper, which it took
    for its parent, and it waited for a start that would never come, for ever. Here the
    worker's first ``os.getppid()`` comes a second late, after its parent is gone: it
    leaves within seconds all the same."""
    from tests.processes import WAIT, alive, wait_until

    body = """
import multiprocessing, os, time
import torch
from shared_td import TensorDict
from shared_td.demo.replay import check_in, running
state = TensorDict(inode=torch.zeros(1, dtype=torch.int64), ready=torch.zeros(1, dtype=torch.bool),
                   phase=torch.zeros((), dtype=torch.int64), batch_size=[])
buffer = TensorDict(obs=torch.zeros(4), batch_size=[4]).memmap_()
def worker():
    parent = check_in(state, 0, buffer)
    while running(state, parent):
        time.sleep(0.01)
real = os.getppid
def late():
    time.sleep(1.0)  # as a worker scheduled late
    return real()
os.getppid = late  # the fork below inherits it
child = multiprocessing.get_context("fork").Process(target=worker)
child.start()
print(child.pid, flush=True)
os._exit(0)  # at once, as a SIGKILL: the worker's first getppid() is still a second away
"""
    parent = subprocess.Popen([sys.executable, "-c", body], stdout=subprocess.PIPE, text=True)
    pid = None
    try:
        pid = int(parent.stdout.readline())
        assert wait_until(lambda: not alive(pid), WAIT), "the demo worker outlived its parent"
    finally:
        if pid is not None and alive(pid):
            os.kill(pid, 9)  # not left behind when the test fails
        parent.kill()
        parent.wait(WAIT)
        parent.stdout.close()


def _forkserver_worker(results) -> None:  # a forkserver child: its parent is the server
    import torch

    from shared_td import TensorDict
    from shared_td.demo.replay import check_in, running

    state = TensorDict(inode=torch.zeros(1, dtype=torch.int64), ready=torch.zeros(1, dtype=torch.bool),
                       phase=torch.ones((), dtype=torch.int64), batch_size=[])
    buffer = TensorDict(obs=torch.zeros(4), batch_size=[4]).memmap_()
    parent = check_in(state, 0, buffer)
    results.put(running(state, parent))


def test_a_demo_worker_started_through_a_fork_server_runs_while_its_parent_does():
    """A forkserver child's parent is the fork server: comparing its parent pid with its
    creator's said the creator was gone at once, and the worker stopped before it began
    (forkserver is Linux's default start method from Python 3.14)."""
    import multiprocessing

    from tests.processes import WAIT, finish

    ctx = multiprocessing.get_context("forkserver")
    results = ctx.Queue()
    child = ctx.Process(target=_forkserver_worker, args=(results,))
    child.start()
    try:
        assert results.get(timeout=4 * WAIT) is True
    finally:
        assert finish(child) == 0
