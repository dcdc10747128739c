"""`shared-td bench` and benchmarks/run.py: the cases run from the installed package, the
table has every case, tensordict's rows are optional."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.cli.cli_helpers import REPO, run_cli, run_main

from shared_td.bench import CASES, BenchOptions, options_from_args, run
from shared_td.bench.runner import table_rows


def _rows(out: str) -> dict[str, list[str]]:
    """case -> its column names, from the printed table."""
    rows: dict = {}
    for line in out.splitlines()[2:]:
        if line.startswith(tuple(CASES)):
            rows.setdefault(line[:16].strip(), []).append(line[16:42].strip())
    return rows


def test_quick_runs_every_case_in_bounded_time():
    # about 10 s alone on 2 idle cores (the run's worker and cluster_sync's ranks are
    # forks, not fresh interpreters); the timeout leaves room for a busy machine
    done = run_cli("bench", "--quick", timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert "cores" in lines[0] and "torch" in lines[0]
    assert "failed" not in done.stdout
    rows = _rows(done.stdout)
    assert list(rows) == list(CASES)
    assert rows["big_leaf"][0] == "raw os.write" and "shared_td threads=2" in rows["big_leaf"]
    assert "shared_td fds held" in rows["tree_anonymous"]
    # each tree case's first column is its floor (shared_td/bench/floors.py)
    assert rows["tree_load"][:3] == ["floor: json+open+mmap", "floor + our checks", "shared_td"]
    assert rows["tree_append"][:2] == ["floor: pwrite+meta", "shared_td"]
    assert rows["tree_anonymous"][:2] == ["floor: memfd+copy+view", "shared_td threads=0"]
    assert rows["tree_to_files"][:3] == ["floor: write+map", "floor: write only", "shared_td threads=0"]
    assert rows["atomic_rewrite"][:2] == ["floor: new dir+exchange", "memmap_ (new directory)"]
    assert rows["coord_attach"][:2] == ["floor anonymous", "anonymous, 100 leaves"]
    assert rows["coord_attach"][2:4] == ["floor files", "files, 100 leaves"]
    assert "anonymous, first attach" in rows["coord_attach"]  # a worker's one attach (issue 13)
    assert rows["consolidate"][:5] == ["memcpy floor (one cat)", "raw torch buffer + views",
                                       "walk + cat (nested dicts)", "shared_td", "shared_td share_memory"]
    assert rows["consol_pickle"][:2] == ["floor (one bytes object)", "shared_td"]
    assert rows["tree_walk"][:3] == ["floor: nested dicts walk", "shared_td keys", "shared_td items"]
    assert_replay_rows(done.stdout, rows)


def assert_replay_rows(out: str, rows: dict) -> None:
    """The replay cases (a spawn worker and a DataLoader with 2 workers really ran): a
    header naming the columns, then every operation."""
    assert rows["replay"] == ["operation", "buf[i] = step", "buf[i:i+64] = batch", "buf[idx64] = batch",
                              "buf[idx256] (sample)", "buf[i] (one row)"]
    assert rows["replay_worker"] == ["operation", *rows["replay"][1:5]]
    assert rows["replay_loader"] == ["operation", "DataLoader samples/s"]
    header = next(line for line in out.splitlines() if line.startswith("replay ") and "operation" in line)
    assert header.split()[2:] == ["raw", "torch", "tensordict", "shared_td", "shared_td/raw", "torch",
                                  "shared_td/tensordict"]


def test_the_repository_runner_takes_the_same_options():
    done = subprocess.run(
        [sys.executable, os.path.join("benchmarks", "run.py"), "--quick", "--only", "tree_load",
         "--only", "leaf_pickle", "--repeat", "2"],
        cwd=REPO, capture_output=True, text=True, timeout=240,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert list(_rows(done.stdout)) == ["tree_load", "leaf_pickle"]


def test_without_tensordict_its_rows_are_left_out_with_a_note(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tensordict", None)  # `import tensordict` fails
    assert run(BenchOptions.quick(only=["tree_load", "leaf_pickle"])) == 0
    out = capsys.readouterr().out
    assert "note: tensordict is not installed" in out.splitlines()[1]
    assert _rows(out) == {"tree_load": ["floor: json+open+mmap", "floor + our checks", "shared_td"],
                          "leaf_pickle": ["raw pickle of the bytes", "shared_td"]}


def test_a_failing_case_is_reported_and_the_others_run(monkeypatch, capsys):
    def broken(options, root):
        raise OSError("disk full")

    monkeypatch.setitem(CASES, "big_leaf", broken)
    assert run(BenchOptions.quick(only=["big_leaf", "tree_load"])) == 1
    out = capsys.readouterr().out
    assert "big_leaf        failed: OSError: disk full" in out and "tree_load" in _rows(out)


def test_options_quick_defaults_and_overrides():
    assert BenchOptions.quick(repeat=3) == BenchOptions(size_mib=16, repeat=3, nodes=100, rounds=20, early_peers=True)
    code, out, err = run_main("bench", "--repeat", "0")
    assert (code, out) == (2, "")
    assert err == "shared-td bench: usage error: --repeat must be at least 1, got 0\n"


def test_table_rows_show_ratios_to_the_first_column():
    assert table_rows("case", {"ref": 2.0, "half as fast": 4.0, "us": 2e-5, "count": 7}) == [
        "case            ref                           2.00 s         1.00x",
        "case            half as fast                  4.00 s         0.50x",
        "case            us                          20.00 us    100000.00x",
        "case            count                              7",
    ]



def test_grid_rows_show_shared_td_value_over_each_other_column():
    # a time: below 1 is faster; a rate: above 1 is faster (higher is better)
    from shared_td.bench.cases_replay import Rate

    results = {"op": {"raw torch": 2e-6, "tensordict": 6e-6, "shared_td": 3e-6},
               "DataLoader samples/s": {"raw torch": Rate(1000.0), "tensordict": Rate(400.0), "shared_td": Rate(500.0)}}
    assert table_rows("replay", results) == [
        "replay          operation                    raw torch  tensordict   shared_td  shared_td/raw torch"
        "  shared_td/tensordict",
        "replay          op                             2.00 us     6.00 us     3.00 us                1.50x"
        "                 0.50x",
        "replay          DataLoader samples/s           1,000/s       400/s       500/s                0.50x"
        "                 1.25x",
    ]


def test_a_quick_run_starts_the_sync_peers_first_and_stops_them_when_the_case_fails(monkeypatch, capsys):
    """cluster_sync's reference ranks start before the first case (their imports overlap
    it) and are stopped, bounded, even though the case fails without using them."""
    from shared_td.bench import runner

    order, started = [], []

    def early(options):
        order.append("peers")
        started.append(real_sync_peers(options))
        return started[-1]

    def first(options, root):
        order.append("tree_load")
        return {"floor": 1.0}

    def broken(options, root, peers=None):
        order.append(("cluster_sync", peers is not None and peers is started[0]))
        raise RuntimeError("gloo is down")

    real_sync_peers = runner.sync_peers
    monkeypatch.setattr(runner, "sync_peers", early)
    monkeypatch.setitem(CASES, "tree_load", first)
    monkeypatch.setitem(CASES, "cluster_sync", broken)
    assert run(BenchOptions.quick(only=["tree_load", "cluster_sync"])) == 1
    assert order == ["peers", "tree_load", ("cluster_sync", True)]
    assert "cluster_sync    failed: RuntimeError: gloo is down" in capsys.readouterr().out
    assert [proc.is_alive() for proc in started[0]._procs] == [False, False]


def test_a_full_run_starts_no_peers_before_the_case(monkeypatch):
    from shared_td.bench import runner

    monkeypatch.setattr(runner, "sync_peers", lambda options: pytest.fail("peers started early"))
    def case(options, root, **extra):
        assert not extra, extra  # the case starts its own peers: nothing else runs meanwhile
        return {"ran": 1.0}

    monkeypatch.setitem(CASES, "cluster_sync", case)
    assert run(BenchOptions(only=["cluster_sync"])) == 0


def test_a_quick_run_from_the_command_line_forks_its_processes_and_spawns_no_interpreter():
    """From the command line (a process that ran nothing before), a quick run forks the
    run's worker and cluster_sync's reference ranks at its start (copies of the runner
    with its imports done): a spawn, a fresh interpreter importing torch and tensordict
    (~4 s of CPU each), fails the run here."""
    body = ("import multiprocessing.context, sys\n"
            "def refuse(process):\n"
            "    raise AssertionError('a quick run spawned a fresh interpreter')\n"
            "multiprocessing.context.SpawnProcess.start = refuse\n"
            "from shared_td.cli import main\n"
            "sys.exit(main(['bench', '--quick', '--only', 'consol_pickle', '--only', 'cluster_push',\n"
            "               '--only', 'cluster_sync']))\n")
    done = subprocess.run([sys.executable, "-c", body], cwd=REPO, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "failed" not in done.stdout and list(_rows(done.stdout)) == ["consol_pickle", "cluster_push", "cluster_sync"]


def test_options_from_the_command_line_fork_only_for_a_quick_run():
    from shared_td.cli import build_parser

    assert options_from_args(build_parser("bench").parse_args(["bench", "--quick"])).fork
    assert not options_from_args(build_parser("bench").parse_args(["bench"])).fork
    assert not BenchOptions.quick().fork  # run() in a caller's process: spawned


def test_the_forked_processes_leave_when_the_run_is_killed():
    """A quick run's worker is a fork: it also holds the runner's end of their connection,
    and processes forked after it (cluster_sync's ranks, a case's own forks) hold it too,
    so no EOF tells it that the runner died. A SIGKILLed runner leaves neither its worker
    nor the ranks behind (bounded)."""
    import signal

    from tests.processes import WAIT, alive, wait_until

    body = ("import sys, time\n"
            "from shared_td.bench.cases_cluster import sync_peers\n"
            "from shared_td.bench.runner import BenchOptions\n"
            "from shared_td.bench.worker import JobWorker, fork_shared_worker\n"
            "worker = fork_shared_worker()\n"
            "peers = sync_peers(BenchOptions.quick(size_mib=1, fork=True))\n"
            "peers.ready()\n"
            "later = JobWorker('fork').start()  # forked after them all: holds their ends too\n"
            "print(worker._process.pid, later._process.pid, *[p.pid for p in peers._procs], flush=True)\n"
            "time.sleep(600)\n")
    runner = subprocess.Popen([sys.executable, "-c", body], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(pid) for pid in runner.stdout.readline().split()]
        assert len(pids) == 4 and all(alive(pid) for pid in pids)
        runner.send_signal(signal.SIGKILL)
        assert wait_until(lambda: not any(alive(pid) for pid in pids), WAIT), "a forked process outlived the run"
    finally:
        runner.kill()
        runner.wait(WAIT)
        runner.stdout.close()


def test_a_worker_whose_runner_died_before_the_worker_ran_leaves_too():
    """The runner was SIGKILLed before its new worker ran a line (a loaded machine): the
    worker's own ``os.getppid()`` then named the reaper, which it took for its runner
    and watched for ever (it held the runner's end of their connection too, as a fork:
    no EOF). Here the worker's first ``os.getppid()`` is made to come a second late,
    after the kill; the worker leaves within seconds all the same (CI saw one outlive
    its runner by more than 30 s)."""
    import signal

    from tests.processes import WAIT, alive, wait_until

    body = ("import os, time\n"
            "real = os.getppid\n"
            "def late():\n"
            "    time.sleep(1.0)  # as a child scheduled late\n"
            "    return real()\n"
            "os.getppid = late  # the fork below inherits it\n"
            "from shared_td.bench.worker import JobWorker\n"
            "print(JobWorker('fork').start()._process.pid, flush=True)\n"
            "time.sleep(600)\n")
    runner = subprocess.Popen([sys.executable, "-c", body], cwd=REPO, stdout=subprocess.PIPE, text=True)
    pid = None
    try:
        pid = int(runner.stdout.readline())
        runner.send_signal(signal.SIGKILL)  # at once: the worker's first getppid() is still a second away
        assert wait_until(lambda: not alive(pid), WAIT), "the worker outlived its runner"
    finally:
        if pid is not None and alive(pid):
            os.kill(pid, signal.SIGKILL)  # not left behind when the test fails
        runner.kill()
        runner.wait(WAIT)
        runner.stdout.close()


def _pid(connection):
    return os.getpid()


def test_a_worker_started_through_a_fork_server_waits_for_its_jobs():
    """A forkserver child's parent is the fork server: comparing its parent pid with its
    creator's said the creator was gone, so the worker left after its first idle second."""
    import time

    from shared_td.bench.worker import JobWorker

    worker = JobWorker("forkserver").start()
    try:
        time.sleep(2.5)  # idle past two looks at its caller
        assert worker.call(_pid, timeout=60) == worker._process.pid
    finally:
        worker.close()
