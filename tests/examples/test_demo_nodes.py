"""``python -m shared_td demo --nodes 2``: the actor/learner demo on a two-node cluster over
loopback, run as a user runs it (a subprocess, a private TMPDIR, bounded in time), with
the same checks as the one-node demo and nothing left behind by either node's process
tree (see tests/examples/test_examples.py for how the leftovers are counted)."""
from __future__ import annotations

import re

import pytest

from tests.examples.test_examples import TIMEOUT, assert_nothing_left, run_python

pytest.importorskip("torch.distributed")
pytestmark = pytest.mark.timeout(TIMEOUT + 60)


def test_two_node_demo_runs_reports_and_leaves_nothing_behind(tmp_path):
    result, marker, shm = run_python(
        ["-m", "shared_td", "demo", "--nodes", "2", "--seconds", "4", "--buffer-size", "8192"], tmp_path)
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
    assert_nothing_left(tmp_path, marker, shm)
