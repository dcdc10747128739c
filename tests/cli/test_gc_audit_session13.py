"""gc of a PATH whose parent directory cannot be listed, and of a tree whose directories
vanish while gc walks it.

* The leftovers of a saved tensordict or an archive lie beside it, in its parent. When
  that parent could be searched but not listed, gc raised the bare PermissionError
  ("shared-td gc: error: [Errno 13] Permission denied: ...") and ``gc --json`` printed no
  document; it is now a failure named in the report (exit code 1), as a subdirectory
  that cannot be listed is. ``gc --dry-run`` of a prefix whose leftovers cannot be
  looked for raised too (the OSError was caught without --dry-run only).
* A directory removed between gc listing its parent and descending into it (a
  concurrent atomic rewrite replaces directories) was reported as "cannot list" (exit
  code 1): gone, it holds no leftovers.
"""
from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import tempfile

import torch

import shared_td
from shared_td.cli import gc_cmd
from tests.cli.cli_helpers import dead_pid, run_main
from tests.processes import finish

FORK = multiprocessing.get_context("fork")


def _gc_beside_a_closed_parent(out: str, dead: int) -> None:
    """In a forked child (as nobody when root: root ignores file modes): a directory
    ``wx`` that may be searched but not listed (0o311), holding a save with a dead
    writer's temporary file inside and an archive; the gc runs go to ``out``."""
    report = open(out, "w")  # before the drop: nobody cannot reach the test's tmp_path
    if os.geteuid() == 0:
        os.setgroups([])
        os.setgid(65534)
        os.setuid(65534)
    area = tempfile.mkdtemp(prefix="shared_td-test-gc13-")
    try:
        parent = os.path.join(area, "wx")
        os.mkdir(parent)
        saved, archive = os.path.join(parent, "saved"), os.path.join(parent, "archive.tdz")
        shared_td.TensorDict({"a": torch.zeros(2)}, [2]).memmap_(saved)
        shared_td.TensorDict({"a": torch.zeros(2)}, [2]).memmap_(archive)
        stale = os.path.join(saved, f"meta.json.{dead}.1.tmp")
        open(stale, "w").close()
        os.chmod(parent, 0o311)
        try:
            runs = {
                "json": run_main("gc", "--json", saved),
                "dry_json": run_main("gc", "--dry-run", "--json", saved),
                "plain": run_main("gc", saved),
                "archive_json": run_main("gc", "--json", archive),
            }
        finally:
            os.chmod(parent, 0o700)
        json.dump({"parent": parent, "saved": saved, "runs": runs}, report)
    finally:
        report.close()
        shutil.rmtree(area, ignore_errors=True)


def test_gc_beside_a_parent_it_cannot_list_reports_a_failure(tmp_path):
    out = str(tmp_path / "report.json")
    child = FORK.Process(target=_gc_beside_a_closed_parent, args=(out, dead_pid()))
    child.start()
    assert finish(child) == 0
    with open(out) as report:
        found = json.load(report)
    parent, runs = found["parent"], found["runs"]
    cannot_list = f"cannot list {parent}: Permission denied"
    for run, dry_run in (("json", False), ("dry_json", True), ("archive_json", False)):
        code, stdout, err = runs[run]
        assert (code, err) == (1, ""), (run, err)  # the document, no bare error
        document = json.loads(stdout)
        assert document["dry_run"] is dry_run and document["removed"] == [] and document["skipped"] == []
        assert {"prefix": parent, "error": cannot_list} in document["failed"], run
    code, stdout, err = runs["plain"]
    assert (code, err) == (1, "") and f"failed  {parent}: {cannot_list}" in stdout.splitlines()


def test_a_directory_that_vanishes_during_the_walk_is_no_failure(tmp_path, monkeypatch):
    """A concurrent rewrite removes ``gone`` after gc listed tmp_path and before gc
    descends into it (done here where gc looks at tmp_path's entries, to be sure of the
    moment): nothing there to clean, and nothing failed."""
    prefix = str(tmp_path / "saved")
    shared_td.TensorDict({"a": torch.zeros(2)}, [2]).memmap_(prefix, atomic=True)  # leaves a lock file
    gone = tmp_path / "zz_gone"
    (gone / "inner").mkdir(parents=True)
    real_prefixes_in = gc_cmd.prefixes_in

    def prefixes_in_while_a_directory_goes(directory, *rest):
        if directory == str(tmp_path) and gone.exists():
            shutil.rmtree(gone)
        return real_prefixes_in(directory, *rest)

    monkeypatch.setattr(gc_cmd, "prefixes_in", prefixes_in_while_a_directory_goes)
    code, out, err = run_main("gc", "--json", tmp_path)
    assert not gone.exists()
    assert (code, err) == (0, ""), out
    document = json.loads(out)
    assert document["failed"] == [] and document["removed"] == [str(tmp_path / ".saved.lock")]
