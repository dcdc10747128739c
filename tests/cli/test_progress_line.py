"""The progress line of ``inspect``/``verify`` while an archive's data are read for
their checksums (before, a large archive said nothing for minutes): on a terminal only,
after a delay, throttled, erased before the report; and the survey's progress calls."""
from __future__ import annotations

import io
from contextlib import redirect_stdout

import torch

from tests.cli.cli_helpers import run_main

import shared_td
from shared_td.cli import main, progress_line
from shared_td.cli.progress_line import ProgressLine
from shared_td.persist.survey import survey


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _archive(tmp_path) -> str:
    prefix = str(tmp_path / "saved.tdz")
    shared_td.TensorDict(a=torch.arange(300_000.0), b=torch.ones(5, 1000), batch_size=[]).memmap(prefix)
    return prefix


def test_the_survey_reports_every_byte_read_in_order(tmp_path):
    seen = []
    survey(_archive(tmp_path), lambda done, total: seen.append((done, total)))
    total = seen[-1][1]
    assert total >= (300_000 + 5000) * 4 and seen[-1] == (total, total)
    assert all(a[0] <= b[0] and a[1] == total for a, b in zip(seen, seen[1:]))
    assert len(seen) > 2  # (a member of 1.2 MB is read in chunks of 1 MiB)


def test_the_line_waits_its_delay_is_throttled_and_is_erased():
    out, clock = _Terminal(), _Clock()
    line = ProgressLine("checking", out, delay=1.0, every=0.25, clock=clock)
    line(10, 100)
    assert out.getvalue() == ""  # a quick run shows nothing
    clock.now = 1.0
    line(20, 100)
    assert out.getvalue() == "\rchecking: 20 B of 100 B (20%)"
    clock.now = 1.1
    line(30, 100)  # too soon: not redrawn
    line(100, 100)  # the end is always drawn
    assert out.getvalue().endswith("\rchecking: 100 B of 100 B (100%)")
    line.close()
    assert out.getvalue().endswith("\r" + " " * len("checking: 100 B of 100 B (100%)") + "\r")


def test_nothing_is_written_where_stderr_is_no_terminal():
    out = io.StringIO()
    line = ProgressLine("checking", out, delay=0.0, every=0.0)
    line(5, 10)
    line.close()
    assert out.getvalue() == ""


def test_verify_on_a_terminal_shows_the_line_then_erases_it_before_the_report(tmp_path, monkeypatch):
    archive = _archive(tmp_path)
    monkeypatch.setattr(progress_line, "DELAY_S", 0.0)
    monkeypatch.setattr(progress_line, "EVERY_S", 0.0)
    terminal, out = _Terminal(), io.StringIO()
    monkeypatch.setattr("sys.stderr", terminal)
    with redirect_stdout(out):
        code = main(["verify", archive])
    assert code == 0 and out.getvalue().startswith("ok: ")
    shown = terminal.getvalue()
    assert "\rchecking the archive's data: " in shown and "(100%)" in shown and shown.endswith("\r")
    code, _, err = run_main("verify", archive)  # (its stderr is no terminal)
    assert code == 0 and "checking" not in err
