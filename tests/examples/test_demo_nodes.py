"""``python -m shared_td demo --nodes 2``: the actor/learner demo on a two-node cluster over
loopback, run as a user runs it (a subprocess, a private TMPDIR, bounded in time), with
the same checks as the one-node demo and nothing left behind by either node's process
tree (see tests/examples/test_examples.py for how the leftovers are counted)."""
from __future__ import annotations

import itertools
import os
import queue
import random
import re
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest

from tests.examples.test_examples import REPO_ROOT, TIMEOUT, assert_nothing_left, run_python
from tests.leakcheck import ShmWatch

pytest.importorskip("torch.distributed")
import torch  # noqa: E402
pytestmark = pytest.mark.timeout(TIMEOUT + 60)


def test_two_node_demo_runs_reports_and_leaves_nothing_behind(short_tmp_path):
    result, marker, shm = run_python(
        ["-m", "shared_td", "demo", "--nodes", "2", "--seconds", "4", "--buffer-size", "8192"], short_tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "1 learner on node 0 and 2 actor processes on node 1 (spawn), a cluster on 127.0.0.1:" in out, out
    assert re.search(r"\] +\d+% .* written [\d.]+[kMG]? .* sampled .* policy v\d+ +loss", out), out
    assert "2 actor processes on node 1 and 1 learner on node 0 for 4." in out, out
    written = re.search(r"written +([\d,]+) transitions \([\d.]+[kMG]?/s", out)
    assert written and int(written[1].replace(",", "")) > 0, out
    # the cursor is cluster-wide: every slot it handed out reached node 0's buffer once
    assert re.search(r"reserved ([\d,]+) slots = written \1; every slot written exactly once", out), out
    pushes, syncs = re.search(r"([\d,]+) pushes carried the rows to node 0 and ([\d,]+) syncs", out).groups()
    assert int(pushes.replace(",", "")) > 0 and int(syncs.replace(",", "")) > 0, out
    assert "the processes of each node map its one copy of the buffer" in out, out
    assert out.rstrip().endswith("result   OK"), out
    assert_nothing_left(short_tmp_path, marker, shm)


def _pushed_ring(lose: bool, capacity: int = 8, batch: int = 2, actors: int = 2):
    """Node 0's ring and node 1's state as the two-node demo leaves them (fabricated: no
    processes), three laps pushed one after the other with their tickets, then either
    one push of the last lap that returned but never landed (``lose``: its rows keep the
    previous lap's positions) or actor 0's batch of the second lap pushed only after the
    next lap's batch of the same rows (a late push)."""
    from shared_td.demo.nodes import actors_layout
    from shared_td.demo.replay import batch_history, replay_layout, ring_rows

    ring, state = replay_layout(capacity), actors_layout(actors, batch_history(capacity, batch))
    tickets, recorded, held_up = iter(range(1_000)), [0] * actors, capacity + batch

    def push(actor: int, start: int, lands: bool = True) -> None:
        begun = next(tickets)
        if lands:
            ring["index"][ring_rows(start, batch, capacity)] = torch.arange(start, start + batch)
        history = state["batches"][actor]
        history[recorded[actor] % len(history)] = torch.tensor([start, begun, next(tickets)])
        recorded[actor] += 1
        state["written"][actor] += batch

    for start in range(0, 3 * capacity, batch):
        if not lose and start == held_up:
            continue  # actor 0's rows, written into node 1's replica, not pushed yet
        push(1 if not lose and start != held_up else start // batch % actors, start,
             lands=not (lose and start == 2 * capacity + batch))
        if not lose and start == held_up + capacity:
            push(0, held_up)  # after the next lap's push of the same rows
    return ring, 3 * capacity, state


def test_the_two_node_check_tells_a_lost_push_from_a_late_one():
    # before (session 22): node 1 recorded no tickets and node 0 checked positions alone, so
    # a push of the last lap that never landed passed as a late write
    from shared_td.demo.nodes import node_slots_check
    from shared_td.demo.replay import slots_check

    ring, reserved, state = _pushed_ring(lose=True)
    assert slots_check(ring, reserved, reserved)[0]  # (positions alone: not seen)
    ok, message = node_slots_check(ring, reserved, reserved, state, batch_size=2)
    assert not ok and message.startswith("2 rows hold the position one lap before") and "a lost write" in message
    ring, reserved, state = _pushed_ring(lose=False)
    ok, message = node_slots_check(ring, reserved, reserved, state, batch_size=2)
    assert ok and "(2 rows kept a write that finished after the next lap's" in message, message
    state["written"][0] += 2  # node 1 counted rows that node 0 never received
    assert node_slots_check(ring, reserved, reserved, state, batch_size=2) == (
        False, "node 1 counted 26 rows pushed, node 0 received 24")


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as listing:
            return [int(child) for child in listing.read().split()]
    except OSError:
        return []


def test_node1_killed_mid_run_fails_the_demo_in_bounded_time_and_leaves_nothing(short_tmp_path):
    private_tmp = short_tmp_path / "tmp"
    private_tmp.mkdir()
    marker = f"shared_td-test-{uuid.uuid4().hex}"
    env = dict(os.environ, TMPDIR=str(private_tmp), SHARED_TD_TEST_MARKER=marker)
    with ShmWatch() as shm:
        demo = subprocess.Popen([sys.executable, "-m", "shared_td", "demo", "--nodes", "2", "--seconds", "60",
                                 "--buffer-size", "8192"], cwd=REPO_ROOT, env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            lines = queue.Queue()
            threading.Thread(target=lambda: [lines.put(line) for line in itertools.chain(demo.stdout, [None])],
                             daemon=True).start()
            seen, before = "", []
            while " written " not in seen:  # the run is under way (bounded by the queue's timeout)
                seen = lines.get(timeout=TIMEOUT)
                # a demo that ended before its run began fails here, with what it said
                assert seen is not None, ("the demo ended before its run began", "".join(before))
                before.append(seen)
            # node 1: the demo's child with children of its own (its actors and manager)
            node1 = [pid for pid in _children(demo.pid) if len(_children(pid)) >= 2]
            assert len(node1) == 1, (node1, [(pid, _children(pid)) for pid in _children(demo.pid)])
            time.sleep(random.uniform(0.0, 1.0))
            os.kill(node1[0], signal.SIGKILL)
            killed = time.monotonic()
            assert demo.wait(timeout=TIMEOUT) == 1
            assert time.monotonic() - killed < 60
        finally:
            if demo.poll() is None:
                demo.kill()
                demo.wait(30)
    out = "".join(before + list(iter(lambda: _get(lines), None)))
    assert "shared_td demo failed: " in out and "node 1" in out, out
    assert_nothing_left(short_tmp_path, marker, shm)  # node 1's actors and manager stopped too


def _get(lines):
    try:
        return lines.get(timeout=5)
    except queue.Empty:
        return None
