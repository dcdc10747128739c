"""survey (what ``shared-td verify`` and ``inspect`` print) of a prefix that atomic=True
rewrites meanwhile: each survey reports one whole version, as each load loads one.

The survey reads through the root opened once and starts again when the root was
replaced under it; a prefix replaced during every try is refused in words that say it
is being rewritten, never reported as a mix of two versions. (tensordict 0.15.3 has no
atomic rewrite nor survey to compare with.)
"""
from __future__ import annotations

import errno
import multiprocessing
import time

import pytest
import torch

from tests.cli.cli_helpers import run_json, run_main

from shared_td import LazyStackedTensorDict, TensorDict
from shared_td.persist import survey as survey_module
from shared_td.persist.survey import survey
from shared_td.persist.survey_files import OnDisk

FORK = multiprocessing.get_context("fork")
REWRITES = 30  # the writer's rewrites the surveys must see (each one raced ~0.7 surveys before the fix)
DEADLINE = 5.0  # seconds: the survey loop's bound, whatever the writer managed
JOIN = 10


def version(i: int) -> TensorDict:
    """Two layouts that share no file: even versions hold nested nodes with leaves a
    and b, odd ones leaves c and a lazy stack (found by its member directories)."""
    if i % 2 == 0:
        return TensorDict({f"k{j}": TensorDict(a=torch.full((4,), i), b=torch.zeros(2)) for j in range(4)})
    return TensorDict({**{f"k{j}": TensorDict(c=torch.full((3,), i)) for j in range(4)},
                       "s": LazyStackedTensorDict(*[TensorDict(d=torch.zeros(2)) for _ in range(3)])})


def layouts(tmp_path) -> list[set[str]]:
    """The paths that the survey of each layout, saved alone, shows."""
    shown = []
    for i in (0, 1):
        version(i).memmap(tmp_path / f"layout{i}")
        found = survey(str(tmp_path / f"layout{i}"))
        assert found.problems == []
        shown.append({entry.path for entry in found.root.walk()})
    return shown


def writer(prefix: str, stop, done) -> None:
    """Rewrite ``prefix`` atomically, alternating layouts, until ``stop`` is set;
    ``done`` counts the rewrites."""
    torch.set_num_threads(1)  # (an OpenMP pool of the parent does not survive the fork)
    i = 1
    while not stop.is_set():
        version(i).memmap(prefix, atomic=True)
        with done.get_lock():
            done.value += 1
        i += 1


def test_surveys_racing_a_writer_process_report_whole_versions(tmp_path):
    expected = layouts(tmp_path)
    prefix = str(tmp_path / "buf")
    version(0).memmap(prefix, atomic=True)
    stop, done = FORK.Event(), FORK.Value("i", 0)
    child = FORK.Process(target=writer, args=(prefix, stop, done))
    child.start()
    whole, mixed, refused = 0, [], 0
    try:
        deadline = time.monotonic() + DEADLINE
        while done.value < REWRITES and time.monotonic() < deadline and len(mixed) < 5:
            try:
                found = survey(prefix)
            except OSError as error:  # replaced during every try: said so, never a mix
                assert error.errno == errno.EAGAIN and "being rewritten" in str(error), error
                refused += 1
                continue
            paths = {entry.path for entry in found.root.walk()}
            if found.problems or paths not in expected:
                mixed.append([(p.path, p.message) for p in found.problems][:3] or sorted(paths))
            else:
                whole += 1
        rewrites = done.value
    finally:
        stop.set()
        child.join(JOIN)
        if child.is_alive():
            child.kill()
            child.join(JOIN)
    assert mixed == [], f"{len(mixed)} mixed surveys, the first ones: {mixed}"
    assert child.exitcode == 0
    assert rewrites >= 5, f"the writer rewrote the prefix {rewrites} times only: nothing was raced"
    assert whole > refused, (whole, refused)


def _rewrite_when(monkeypatch, method: str, when) -> list[int]:
    """Rewrite the prefix (the other layout) in-process whenever OnDisk.``method``
    is called with arguments for which ``when(*args)`` holds; the versions written."""
    written = []
    original = getattr(OnDisk, method)

    def hooked(self, *args):
        if when(*args):
            written.append(len(written) + 1)
            version(written[-1]).memmap(self.root, atomic=True)
        return original(self, *args)

    monkeypatch.setattr(OnDisk, method, hooked)
    return written


def test_a_rewrite_in_the_middle_of_a_survey_makes_it_start_again(tmp_path, monkeypatch):
    """Swapped in once, between reading the root's meta.json and a nested one: the
    survey is the new version's, whole (before: the nodes below the root were read
    from the new version under the old root's meta.json, the new lazy stack 's' an
    unknown directory: inspect showed a tree of both)."""
    expected = layouts(tmp_path)
    prefix = str(tmp_path / "buf")
    version(0).memmap(prefix)
    written = _rewrite_when(monkeypatch, "read_meta", lambda directory: directory == "k0" and not written)
    found = survey(prefix)
    assert written == [1]
    assert found.problems == [] and {entry.path for entry in found.root.walk()} == expected[1]
    assert run_main("verify", "-q", prefix)[0] == 0  # (no more rewrites: written is not empty)


def test_a_prefix_replaced_during_every_survey_is_said_to_be_rewritten(tmp_path, monkeypatch):
    """Replaced while each try lists its directories: after survey.TRIES tries, an
    error saying so (verify: exit code 1, one line; --json: one error at '.')
    instead of a tree mixed from two versions."""
    # (each try rewrites the prefix: keep it quick)
    monkeypatch.setattr(survey_module, "TRIES", 3, raising=False)
    prefix = str(tmp_path / "buf")
    version(0).memmap(prefix)
    written = _rewrite_when(monkeypatch, "listing", lambda: True)
    with pytest.raises(OSError, match="being rewritten") as raised:
        survey(prefix)
    assert raised.value.errno == errno.EAGAIN and raised.value.survey_path == "."
    assert str(raised.value) == (f"{prefix} was replaced by a new version during each of 3 surveys: it is "
                                 "being rewritten (atomic=True) continually; run again when its writers pause")
    assert len(written) == 3
    code, out, err = run_main("verify", prefix)
    assert (code, out) == (1, "") and err == f"shared-td verify: error: {raised.value}\n"
    code, document = run_json("verify", prefix)
    assert code == 1 and [(p["path"], p["severity"]) for p in document["problems"]] == [(".", "error")]
