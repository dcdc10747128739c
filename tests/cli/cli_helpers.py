"""Helpers of the command-line tests (tests/cli): sample saves, running the CLI, dead pids.

Imported by the test modules as ``tests.cli.cli_helpers`` (see tests/conftest.py).
"""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout

import pytest
import torch

import shared_td
from shared_td.cli import main

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def build(lib):
    """The same tree with ``lib`` (shared_td or tensordict): every kind of entry.

    Leaves (one with a key that is encoded on disk, one with no elements), a nested
    TensorDict, a JSON and a pickled NonTensorData, a NonTensorStack.
    """
    td = lib.TensorDict(
        {
            "obs": torch.arange(12, dtype=torch.float32).reshape(4, 3),
            "a/b c": torch.ones(4, dtype=torch.int64),
            "next": {"reward": torch.ones(4)},
            "empty": torch.zeros(4, 0),
        },
        batch_size=[4],
    )
    td["task"] = "walk " * 30  # longer than what inspect shows
    td["obj"] = lib.NonTensorData(data={1: complex(2, 3)}, batch_size=[4])
    td["stack"] = lib.NonTensorStack(*[lib.NonTensorData(x) for x in "abcd"])
    return td


def save_ours(path) -> str:
    build(shared_td).memmap_(str(path))
    return str(path)


def save_theirs(path) -> str:
    import tensordict

    build(tensordict).memmap_(str(path))
    return str(path)


def save_by(writer: str, path) -> str:
    """The tree saved at ``path`` by ``writer`` ("shared_td" or "tensordict"; the test is
    skipped when tensordict is not installed)."""
    if writer == "tensordict":
        pytest.importorskip("tensordict")
        return save_theirs(path)
    return save_ours(path)


def save_lazy_stack(path) -> str:
    stacked = shared_td.lazy_stack([shared_td.TensorDict(x=torch.zeros(2)), shared_td.TensorDict(x=torch.zeros(3))])
    stacked.memmap_(str(path))
    return str(path)


def run_cli(*args, timeout: float = 120, cwd: str | None = None, env: dict | None = None):
    """``python -m shared_td ARGS`` in a subprocess; the CompletedProcess (text)."""
    return subprocess.run(
        [sys.executable, "-m", "shared_td", *map(str, args)],
        capture_output=True, text=True, timeout=timeout, cwd=cwd or REPO,
        env=None if env is None else {**os.environ, **env},
    )


def run_main(*args) -> tuple[int, str, str]:
    """``shared_td.cli.main(ARGS)`` in this process (quicker than a subprocess):
    the exit code, stdout and stderr."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main([str(arg) for arg in args])
    return code, out.getvalue(), err.getvalue()


def run_json(*args) -> tuple[int, dict]:
    """Run in this process with ``--json``; the exit code and the parsed document."""
    code, out, err = run_main(*args, "--json")
    assert "Traceback" not in err, err
    return code, json.loads(out)


def dead_pid() -> int:
    """The pid of a process that has exited and been reaped (so no process has it now).

    Pids are reused only after wrapping around; the caller uses it at once.
    """
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(timeout=60)
    return child.pid


def problems_by_path(document: dict) -> dict[str, list[tuple[str, str]]]:
    """verify/inspect JSON problems: path -> [(severity, message)]."""
    found: dict = {}
    for problem in document["problems"]:
        found.setdefault(problem["path"], []).append((problem["severity"], problem["message"]))
    return found
