"""share_non_tensor values owned by a coordinator (issue 5, point 4), with real processes.

A value made by ``memmap_(share_non_tensor=True)`` is adopted by the process's
coordinator (a ``with coord:`` block, or an embedded one started on demand), so its
pickle stays attachable after its creator exited or was SIGKILLed; reading an unchanged
value takes no lock and no round trip. Every join and queue read is bounded.
"""
from __future__ import annotations

import json
import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from tests.coordinator import nt_children as kids
from tests.leakcheck import ShmWatch, foreign_churn, private_tempdir
from tests.processes import WAIT, alive, finish, wait_until
from tests.coordinator.test_coordinator import assert_nothing_left, open_descriptors

import shared_td
from shared_td.coordinator import ownership


def start(ctx, target, *args, daemon=None):
    queue = ctx.Queue()
    process = ctx.Process(target=target, args=(*args, queue), daemon=daemon)
    process.start()
    return process, queue


def run_script(body: str, timeout: float = 60) -> dict:
    """Run ``body`` in a fresh interpreter with no coordinator announced; it prints one
    JSON line as its last line, which is returned."""
    env = {k: v for k, v in os.environ.items() if k != ownership.ENV_VAR}
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(body)], env=env,
                            capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------ the read path

def test_reading_an_unchanged_value_is_lock_free_and_cheap(tmp_path):
    td = shared_td.TensorDict(task="walk", obs=torch.zeros(1)).memmap_(share_non_tensor=True)
    cell = td.get("task")._shared_value
    assert td["task"] == "walk"
    rounds = 20_000
    best_get, best_td = float("inf"), float("inf")
    for _ in range(3):
        begin = time.perf_counter()
        for _ in range(rounds):
            cell.get()
        best_get = min(best_get, (time.perf_counter() - begin) / rounds)
        begin = time.perf_counter()
        for _ in range(rounds):
            td["task"]
        best_td = min(best_td, (time.perf_counter() - begin) / rounds)
    # ~0.3 us and ~2 us measured; the target is 5 us for td[key]. Loose bounds
    # here: this machine's two cores are shared with other jobs.
    assert best_get < 5e-6, best_get
    assert best_td < 20e-6, best_td
    # a write is seen by the next read (the version moved, so the slow path runs)
    td.set_("task", "run")
    assert td["task"] == "run" and cell.get() == "run"


@pytest.mark.timeout(120)
def test_concurrent_writers_and_lock_free_readers_never_see_a_torn_value():
    ctx = multiprocessing.get_context("fork")
    td = shared_td.TensorDict(task=(0, "", 0)).memmap_(share_non_tensor=True)
    blob = pickle.dumps(td)
    go = ctx.Event()
    writers = [start(ctx, kids.write_consistent, blob, 300, go) for _ in range(2)]
    go.set()
    reads = changes = 0
    last = None
    while any(p.is_alive() for p, _ in writers) or reads == 0:
        i, text, negative = td["task"]
        assert text == "x" * (i % 3000) and negative == -i, (i, len(text), negative)
        changes += (i, negative) != last
        last = (i, negative)
        reads += 1
    for process, queue in writers:
        assert queue.get(timeout=WAIT) == "written"
        assert finish(process) == 0
    assert td["task"][0] == 299 and changes > 1


# ------------------------------------------------------------------ the embedded coordinator

def test_embedded_coordinator_starts_once_on_demand_and_stops_at_exit():
    out = run_script("""
        import json, os, time, shared_td
        from shared_td.coordinator import ownership
        assert ownership.embedded_coordinator(start=False) is None
        begin = time.perf_counter()
        td = shared_td.TensorDict(task="walk").memmap_(share_non_tensor=True)
        first = time.perf_counter() - begin
        coord = ownership.embedded_coordinator(start=False)
        begin = time.perf_counter()
        again = shared_td.TensorDict(task="run").memmap_(share_non_tensor=True)
        second = time.perf_counter() - begin
        assert ownership.embedded_coordinator(start=False) is coord  # once per process
        assert shared_td.Coordinator.current() is coord
        holders = td.get("task")._shared_value.holders
        print(json.dumps({"pid": coord.pid, "address": coord.address, "first": first,
                          "second": second, "holders": holders,
                          "env": os.environ[ownership.ENV_VAR].split(";")[0]}))
    """)
    assert out["holders"][0][0] == out["pid"] and out["env"] == out["address"]
    # the start (~0.15 s here) is paid by the first memmap_ only
    assert out["first"] < 10 and out["second"] < 0.5, out
    assert wait_until(lambda: not alive(out["pid"]))
    assert not os.path.exists(os.path.dirname(out["address"]))


@pytest.mark.timeout(60)
def test_embedded_coordinator_stops_when_its_process_is_sigkilled():
    body = textwrap.dedent("""
        import json, sys, time, shared_td
        from shared_td.coordinator import ownership
        td = shared_td.TensorDict(task="walk").memmap_(share_non_tensor=True)
        coord = ownership.embedded_coordinator(start=False)
        print(json.dumps({"pid": coord.pid, "address": coord.address}), flush=True)
        time.sleep(120)
    """)
    env = {k: v for k, v in os.environ.items() if k != ownership.ENV_VAR}
    process = subprocess.Popen([sys.executable, "-c", body], env=env, stdout=subprocess.PIPE, text=True)
    try:
        out = json.loads(process.stdout.readline())
    finally:
        process.kill()
        process.wait(WAIT)
        process.stdout.close()
    assert wait_until(lambda: not alive(out["pid"]), timeout=15)
    assert not os.path.exists(os.path.dirname(out["address"]))


def test_a_sigkilled_embedded_coordinator_is_replaced_and_swept():
    out = run_script("""
        import json, os, signal, time, shared_td
        from shared_td.coordinator import ownership
        from shared_td.platform import pid_alive
        td = shared_td.TensorDict(task="walk").memmap_(share_non_tensor=True)
        first = ownership.embedded_coordinator(start=False)
        pid, address = first.pid, first.address
        os.kill(pid, signal.SIGKILL)
        while pid_alive(pid):
            time.sleep(0.01)
        again = shared_td.TensorDict(task="run").memmap_(share_non_tensor=True)
        second = ownership.embedded_coordinator(start=False)
        td.set_("task", "still shared")
        print(json.dumps({"dead": address, "pid": second.pid, "address": second.address,
                          "value": td["task"], "again": again["task"],
                          "holders": again.get("task")._shared_value.holders}))
    """)
    assert out["value"] == "still shared" and out["again"] == "run"
    assert out["holders"][0][0] == out["pid"]
    assert not os.path.exists(os.path.dirname(out["dead"]))  # swept by the new one
    assert wait_until(lambda: not alive(out["pid"]))
    assert not os.path.exists(os.path.dirname(out["address"]))


@pytest.mark.timeout(90)
def test_a_daemonic_worker_keeps_its_values_without_a_manager(monkeypatch):
    monkeypatch.delenv(ownership.ENV_VAR, raising=False)
    ctx = multiprocessing.get_context("spawn")
    process, queue = start(ctx, kids.report_embedded, daemon=True)
    status, holders, started, value = queue.get(timeout=WAIT)
    assert finish(process) == 0
    assert (status, holders, started, value) == ("ok", [], False, "d")


# ------------------------------------------------------------------ outliving the creator

@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_value_made_inside_with_coord_outlives_its_creator(method):
    ctx = multiprocessing.get_context(method)
    value = "ü long value " * 100
    with shared_td.Coordinator() as coord:
        process, queue = start(ctx, kids.make_shared, coord, value)
        status, creator, blob, holders = queue.get(timeout=WAIT)
        assert status == "ok", creator
        assert finish(process) == 0 and wait_until(lambda: not alive(creator))
        assert [pid for pid, _ in holders] == [coord.pid]
        td = pickle.loads(blob)  # the creator is gone: reopened from the coordinator
        assert td["task"] == value
        td.set_("task", "from the parent")
        reader, queue = start(ctx, kids.read_value, blob)
        assert queue.get(timeout=WAIT) == ("ok", "from the parent")
        assert finish(reader) == 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_children_use_the_parents_embedded_coordinator(method):
    coord = ownership.embedded_coordinator(start=True)  # inherited / announced in env
    assert os.environ[ownership.ENV_VAR].startswith(coord.address + ";")
    ctx = multiprocessing.get_context(method)
    process, queue = start(ctx, kids.make_shared, None, "from a child")
    status, creator, blob, holders = queue.get(timeout=WAIT)
    assert status == "ok", creator
    assert finish(process) == 0 and wait_until(lambda: not alive(creator))
    assert [pid for pid, _ in holders] == [coord.pid]
    assert pickle.loads(blob)["task"] == "from a child"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_sigkill_of_the_creator_while_a_child_reads_and_writes(method):
    ctx = multiprocessing.get_context(method)
    with shared_td.Coordinator() as coord:
        creator, queue = start(ctx, kids.make_shared_then_sleep, coord, "start")
        status, creator_pid, blob, _ = queue.get(timeout=WAIT)
        assert status == "ok", creator_pid
        writer, writes = start(ctx, kids.keep_writing, blob, 300)
        assert writes.get(timeout=WAIT) == ("attached", "start")
        os.kill(creator_pid, signal.SIGKILL)
        assert finish(creator) == -signal.SIGKILL
        assert writes.get(timeout=WAIT) == ("done", "w299", 0)
        assert finish(writer) == 0
        # attached after the creator was killed and the writer exited
        assert pickle.loads(blob)["task"] == "w299"


@pytest.mark.timeout(120)
def test_values_leave_nothing_behind():
    ctx = multiprocessing.get_context("fork")
    ownership.embedded_coordinator(start=True)
    shared_td.TensorDict(task="warm").memmap_(share_non_tensor=True)  # connection made

    # (the embedded coordinator, started above, lives on after the private temp dir)
    with foreign_churn(), private_tempdir() as tempdir:
        before = open_descriptors()  # (the watch's own reads of /proc come and go)
        with ShmWatch() as shm, shared_td.Coordinator() as coord:
            creator, queue = start(ctx, kids.make_shared_then_sleep, coord, "x")
            status, creator_pid, blob, _ = queue.get(timeout=WAIT)
            os.kill(creator_pid, signal.SIGKILL)
            assert finish(creator) == -signal.SIGKILL
            td = pickle.loads(blob)
            td.set_("task", "y")
            shared_td.TensorDict(task="z").memmap_(share_non_tensor=True)  # embedded one
            queue.close()
            queue.join_thread()
            del td, queue, creator
        assert_nothing_left(shm, tempdir, before)
