"""The demo's stop path and arguments (audit, session 18): a second Ctrl-C with stuck
workers, Ctrl-C during start-up, a dead coordinator manager, a SIGKILLed worker's
message, and the argument checks.

The end-to-end tests run ``python -m shared_td demo`` in its own session (a terminal's
Ctrl-C is SIGINT to the whole process group), with a private TMPDIR and a marker in its
environment; every wait is bounded, and the cleanup kills only the processes carrying
this test's marker.
"""
from __future__ import annotations

import multiprocessing
import os
import re
import signal
import subprocess
import sys
import time
import uuid

import pytest

from tests.cli.cli_helpers import REPO, run_main

from shared_td.demo import supervise

START_BOUND = 180  # seconds for the demo's spawned processes to import torch on a loaded box

pytestmark = pytest.mark.timeout(START_BOUND + 120)


# ----------------------------------------------------------------- the argument checks
@pytest.fixture
def no_run(monkeypatch):
    """``run_demo`` replaced: a parse that lets a bad value through fails fast instead of
    running (``--seconds inf`` would run for ever)."""
    calls = []
    monkeypatch.setattr("shared_td.demo.run_demo", lambda **kwargs: calls.append(kwargs) or 1 / 0)
    return calls


@pytest.mark.parametrize("argv, words", [
    (["--seconds", "nan"], "argument --seconds: must be positive and finite, got nan"),
    (["--seconds", "inf"], "argument --seconds: must be positive and finite, got inf"),
    (["--seconds=-inf"], "argument --seconds: must be positive and finite, got -inf"),
    (["--buffer-size", "100"], "argument --buffer-size: must be at least 512 with 2 actors"),
    (["--buffer-size", "0"], "argument --buffer-size: must be positive and finite, got 0"),
    (["--actors", "5000"], "argument --actors: at most "),
])
def test_bad_arguments_are_usage_errors_naming_the_option(no_run, argv, words):
    code, out, err = run_main("demo", *argv)
    assert (code, out, no_run) == (2, "", [])
    assert words in err and "capacity" not in err and "Traceback" not in err


def test_actors_up_to_the_cap_are_accepted(no_run):
    from shared_td.cli.demo import max_actors

    rows = 2 * max_actors() * 128  # the smallest ring for that many actors
    code, _, err = run_main("demo", "--actors", max_actors(), "--buffer-size", str(rows))
    assert code == 1 and "division by zero" in err  # parsed, then our fake run failed
    assert no_run == [dict(seconds=20.0, actors=max_actors(), capacity=rows, nodes=1)]


@pytest.mark.parametrize("argv", [["--debug", "demo"], ["demo", "--debug"]])
def test_debug_shows_the_traceback_of_a_demo_failure(monkeypatch, argv):
    def failing(**kwargs):
        raise RuntimeError("a demo process failed during run (actor-0 exit code 1)")
    monkeypatch.setattr("shared_td.demo.run_demo", failing)
    code, _, err = run_main(*argv)
    assert code == 1 and "Traceback (most recent call last)" in err
    assert err.endswith("shared_td demo failed: a demo process failed during run (actor-0 exit code 1)\n")
    monkeypatch.setattr("shared_td.demo.run_demo", failing)
    code, _, err = run_main("demo")
    assert code == 1 and "Traceback" not in err


def test_a_closed_output_is_a_failure_not_success():
    # `shared-td demo | head -1`: the run stops early and nothing is checked: exit 1
    fake = ("import sys, shared_td.demo as demo\n"
            "def run_demo(**kwargs):\n"
            "    print('shared_td demo: starting', flush=True)\n"
            "    while True: print('x' * 4096, flush=True)\n"
            "demo.run_demo = run_demo\n"
            "from shared_td.cli import main\n"
            "sys.exit(main(['demo']))\n")
    reader = subprocess.Popen([sys.executable, "-c", fake], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        assert reader.stdout.readline() == "shared_td demo: starting\n"
        reader.stdout.close()  # the reader leaves, as `head -1` does
        assert reader.wait(timeout=120) == 1
        err = reader.stderr.read()
    finally:
        if reader.poll() is None:
            reader.kill()
            reader.wait(30)
    assert "shared_td demo failed: its output was closed (broken pipe)" in err and "Traceback" not in err


# ----------------------------------------------------------------- supervise, in-process
def _sleeper():
    time.sleep(60)


def test_a_worker_killed_by_a_signal_is_named_without_a_traceback_promise():
    process = multiprocessing.get_context("fork").Process(target=_sleeper, name="actor-0")
    process.start()
    os.kill(process.pid, signal.SIGKILL)
    process.join(30)
    with pytest.raises(RuntimeError) as failure:
        supervise.check_alive([process], "run")
    assert str(failure.value) == "a demo process failed during run (actor-0 killed by SIGKILL)"
    with pytest.raises(RuntimeError, match=r"^demo processes failed: actor-0 killed by SIGKILL$"):
        supervise.stop([process], report=True)


def test_stop_shares_one_deadline_and_kills_stopped_workers(monkeypatch):
    monkeypatch.setattr(supervise, "STOP_TIMEOUT", 0.6)
    ctx = multiprocessing.get_context("fork")
    processes = [ctx.Process(target=_sleeper, name=f"actor-{i}") for i in range(3)]
    for process in processes:
        process.start()
    try:
        for process in processes:
            os.kill(process.pid, signal.SIGSTOP)  # stuck
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="actor-0 hung and was killed, actor-1 hung"):
            supervise.stop(processes, report=True)
        assert time.monotonic() - started < 0.6 + 0.9  # one 0.6 s wait, not one each
        # (its own workers only: another test's helper process may still be ending)
        assert [process for process in multiprocessing.active_children() if process in processes] == []
    finally:
        for process in processes:
            try:
                if process.exitcode is None:
                    process.kill()
                    process.join(10)
            except ValueError:
                pass  # closed: reaped by stop()


# ----------------------------------------------------------------- the demo, end to end
class Demo:
    """``python -m shared_td demo ARGS`` in its own session; stdout and stderr in files."""

    def __init__(self, tmp_path, *args):
        self.tmp = tmp_path / "tmp"
        self.tmp.mkdir()
        self.marker = f"shared_td-test-{uuid.uuid4().hex}"
        self.out, self.err = tmp_path / "out", tmp_path / "err"
        env = dict(os.environ, TMPDIR=str(self.tmp), SHARED_TD_TEST_MARKER=self.marker)
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.popen = subprocess.Popen([sys.executable, "-u", "-m", "shared_td", "demo", *args],
                                          cwd=REPO, env=env, stdout=out, stderr=err,
                                          start_new_session=True)

    def stdout(self) -> str:
        return self.out.read_text()

    def stderr(self) -> str:
        return self.err.read_text()

    def wait_for(self, what, text: str, timeout: float = START_BOUND) -> None:
        deadline = time.monotonic() + timeout
        while text not in what():
            assert self.popen.poll() is None, (self.popen.returncode, self.stdout(), self.stderr())
            assert time.monotonic() < deadline, f"no {text!r} within {timeout} s: {what()}"
            time.sleep(0.05)

    def workers(self) -> list[int]:
        """The demo's spawned children (actors and learner)."""
        found = []
        for entry in os.listdir("/proc"):
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    ppid = int(stat.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                    spawned = b"spawn_main" in cmdline.read()
            except (OSError, ValueError, IndexError):
                continue
            if ppid == self.popen.pid and spawned:
                found.append(int(entry))
        return found

    def ctrl_c(self) -> None:
        os.killpg(self.popen.pid, signal.SIGINT)  # what a terminal sends

    def ours(self) -> list[int]:
        """Live processes carrying this run's marker (zombies not counted)."""
        found = []
        for entry in os.listdir("/proc"):
            try:
                with open(f"/proc/{entry}/environ", "rb") as environ:
                    if self.marker.encode() not in environ.read():
                        continue
                with open(f"/proc/{entry}/stat") as stat:
                    if stat.read().rsplit(")", 1)[1].split()[0] != "Z":
                        found.append(int(entry))
            except OSError:
                pass
        return found

    def cleanup(self) -> None:
        for pid in self.ours():  # only what this test started
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.wait(30)


@pytest.fixture
def demo(short_tmp_path):
    runs = []

    def start(*args):
        runs.append(Demo(short_tmp_path, *args))
        return runs[-1]
    yield start
    for run in runs:
        run.cleanup()


def test_a_second_ctrl_c_kills_stuck_workers_at_once(demo):
    run = demo("--seconds", "60", "--buffer-size", "4096")
    run.wait_for(run.stdout, "%")  # the run is under way
    workers = run.workers()
    assert len(workers) == 3, workers
    for pid in workers:
        os.kill(pid, signal.SIGSTOP)  # stuck: they never see phase 2
    run.ctrl_c()
    run.wait_for(run.stderr, "shared_td demo: stopping 3 processes (up to 30 s; Ctrl-C again to kill them)",
                 timeout=20)
    run.ctrl_c()
    interrupted = time.monotonic()
    assert run.popen.wait(timeout=30) == 130
    assert time.monotonic() - interrupted < 20
    assert run.stderr().endswith("shared_td demo interrupted; everything was stopped\n"), run.stderr()
    deadline = time.monotonic() + 15  # the resource tracker leaves after its parent
    while run.ours() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert run.ours() == []
    assert os.listdir(run.tmp) == []


def test_ctrl_c_during_start_up_prints_no_worker_traceback(demo):
    run = demo("--seconds", "60", "--buffer-size", "4096")
    run.wait_for(run.stdout, "shared_td demo: starting")  # the workers are importing torch
    run.ctrl_c()
    assert run.popen.wait(timeout=START_BOUND) == 130
    err = run.stderr()
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert err.endswith("shared_td demo interrupted; everything was stopped\n"), err


def test_a_dead_coordinator_manager_fails_the_run(demo):
    run = demo("--seconds", "1", "--buffer-size", "4096")
    run.wait_for(run.stdout, "%")
    manager = int(re.search(r"shared_td-coord-(\d+)-", run.stdout())[1])  # its pid names its directory
    os.kill(manager, signal.SIGKILL)
    assert run.popen.wait(timeout=120) == 1, run.stdout()
    assert "result   OK" not in run.stdout()
    assert "shared_td demo failed: the coordinator's manager stopped during the run" in run.stderr()
