"""`inspect --json` and `gc --json` when PATH itself is refused (missing, a dangling
symlink, a symlink loop, neither a directory nor an archive, permission denied, no
meta.json): they print their JSON document with that one error (nothing on stdout
before), in the words stderr shows without --json; exit codes as without --json."""
from __future__ import annotations

import json
import multiprocessing
import os

import pytest
import torch

from tests.cli.cli_helpers import run_main
from tests.processes import finish

import shared_td

INSPECT_KEYS = {"prefix", "tree", "totals", "problems"}
GC_KEYS = {"dry_run", "removed", "skipped", "failed"}
FORK = multiprocessing.get_context("fork")


def refused_paths(tmp_path) -> dict[str, str]:
    """how -> a PATH refused whole by every command (each made under tmp_path)."""
    (tmp_path / "plain_file").write_text("x")
    os.mkfifo(tmp_path / "fifo")
    os.symlink(tmp_path / "nowhere", tmp_path / "dangling")
    os.symlink(tmp_path / "loop_b", tmp_path / "loop_a")
    os.symlink(tmp_path / "loop_a", tmp_path / "loop_b")
    return {
        "missing": str(tmp_path / "missing"),
        "dangling symlink": str(tmp_path / "dangling"),
        "symlink loop": str(tmp_path / "loop_a"),
        "a file, no archive": str(tmp_path / "plain_file"),
        "a FIFO": str(tmp_path / "fifo"),
        "below a file": str(tmp_path / "plain_file" / "x"),
    }


def stderr_words(command: str, path: str) -> str:
    """What ``command PATH`` says on stderr without --json (exit code 1, nothing on
    stdout), without its "shared-td COMMAND: error: " opening."""
    code, out, err = run_main(command, path)
    assert (code, out) == (1, ""), (command, path, err)
    [line] = err.splitlines()
    opening = f"shared-td {command}: error: "
    assert line.startswith(opening), line
    return line[len(opening):]


def check_inspect_document(out: str, path: str, problem_path: str = ".") -> str:
    """The refused PATH's inspect document; its one problem's message."""
    document = json.loads(out)
    assert set(document) == INSPECT_KEYS
    assert document["prefix"] == os.path.abspath(path) and document["tree"] is None
    assert set(document["totals"].values()) == {0}
    [problem] = document["problems"]
    assert problem["severity"] == "error" and problem["path"] == problem_path
    return problem["message"]


def check_gc_document(out: str, path: str, dry_run: bool) -> str:
    """The refused PATH's gc document; its one failure's error."""
    document = json.loads(out)
    assert set(document) == GC_KEYS
    assert document["dry_run"] is dry_run
    assert document["removed"] == [] and document["skipped"] == []
    [failure] = document["failed"]
    assert failure["prefix"] == os.path.abspath(path)
    return failure["error"]


def test_inspect_json_describes_a_refused_root(tmp_path):
    for how, path in refused_paths(tmp_path).items():
        code, out, err = run_main("inspect", "--json", path)
        assert (code, err) == (1, ""), how
        message = check_inspect_document(out, path)
        assert message == stderr_words("inspect", path), how
        # one refusal, shared with verify: the same words in its document
        code, out, err = run_main("verify", "--json", path)
        assert (code, err) == (1, "") and json.loads(out)["problems"][0]["message"] == message, how


@pytest.mark.parametrize("damage", ["no meta.json", "meta.json not JSON", "meta.json no save"])
def test_inspect_json_describes_a_root_meta_json_it_refuses(tmp_path, damage):
    prefix = str(tmp_path / "saved")
    shared_td.TensorDict({"a": torch.zeros(2)}, [2]).memmap_(prefix)
    meta = os.path.join(prefix, "meta.json")
    if damage == "no meta.json":
        os.remove(meta)
    else:
        with open(meta, "w") as file:
            file.write("{" if damage == "meta.json not JSON" else '{"name": "x"}')
    code, out, err = run_main("inspect", "--json", prefix)
    assert (code, err) == (1, "")
    assert check_inspect_document(out, prefix, "meta.json") == stderr_words("inspect", prefix)


@pytest.mark.parametrize("dry_run", [False, True])
def test_gc_json_describes_a_refused_root(tmp_path, dry_run):
    options = ["--dry-run"] if dry_run else []
    for how, path in refused_paths(tmp_path).items():
        code, out, err = run_main("gc", "--json", *options, path)
        assert (code, err) == (1, ""), how
        assert check_gc_document(out, path, dry_run) == stderr_words("gc", path), how
    assert sorted(os.listdir(tmp_path)) == ["dangling", "fifo", "loop_a", "loop_b", "plain_file"]


def test_a_root_that_is_accepted_still_gives_the_usual_documents(tmp_path):
    prefix = str(tmp_path / "saved")
    shared_td.TensorDict({"a": torch.zeros(2)}, [2]).memmap_(prefix)
    code, out, err = run_main("inspect", "--json", prefix)
    assert (code, err) == (0, "") and json.loads(out)["tree"]["children"][0]["key"] == "a"
    code, out, err = run_main("gc", "--json", tmp_path)
    assert (code, err) == (0, "") and json.loads(out)["failed"] == []


def _main_as_nobody(args, out) -> None:
    """``main(ARGS)`` as the user nobody (root bypasses file modes), in a forked child;
    its exit code, stdout and stderr go to ``out`` as JSON (opened before the drop)."""
    with open(out, "w") as report:
        os.setgroups([])
        os.setgid(65534)
        os.setuid(65534)
        json.dump(run_main(*args), report)


def run_unprivileged(tmp_path, *args) -> tuple[int, str, str]:
    """``main(ARGS)`` without the right to look into a directory closed to this user:
    as nobody when root, else as this user."""
    if os.geteuid() != 0:
        return run_main(*args)
    out = str(tmp_path / "report.json")
    child = FORK.Process(target=_main_as_nobody, args=(args, out))
    child.start()
    assert finish(child) == 0
    with open(out) as report:
        return tuple(json.load(report))


def test_a_root_that_cannot_be_looked_at_is_described_too(tmp_path):
    """Permission denied: a save in a directory this process may not search."""
    closed = tmp_path / "closed"
    prefix = str(closed / "saved")
    shared_td.TensorDict({"a": torch.zeros(2)}, [2]).memmap_(prefix)
    # root: nobody reaches closed/ (pytest's directories are 0700), never into it
    os.chmod(closed, 0o700 if os.geteuid() == 0 else 0)
    try:
        for command, check in [("inspect", check_inspect_document),
                               ("gc", lambda out, path: check_gc_document(out, path, False))]:
            plain = run_unprivileged(tmp_path, command, prefix)
            assert plain[:2] == (1, "") and "Permission denied" in plain[2], plain
            code, out, err = run_unprivileged(tmp_path, command, "--json", prefix)
            assert (code, err) == (1, ""), err
            assert plain[2] == f"shared-td {command}: error: {check(out, prefix)}\n"
    finally:
        os.chmod(closed, 0o700)


def _gc_of_an_unreadable_subdirectory_as_nobody(out) -> None:
    """As nobody (file modes hold): a directory of its own in the temp dir with a save
    and a closed subdirectory; ``gc --json`` of it and ``gc`` of it go to ``out``."""
    import shutil
    import tempfile

    report = open(out, "w")  # before the drop: nobody cannot reach tmp_path
    os.setgroups([])
    os.setgid(65534)
    os.setuid(65534)
    area = tempfile.mkdtemp(prefix="shared_td-test-gc-")
    try:
        shared_td.TensorDict({"a": torch.zeros(2)}, [2]).memmap_(os.path.join(area, "saved"))
        closed = os.path.join(area, "closed")
        os.mkdir(closed)
        os.chmod(closed, 0)
        results = [run_main("gc", "--json", area), run_main("gc", area)]
        os.chmod(closed, 0o700)
        json.dump({"closed": closed, "results": results}, report)
    finally:
        report.close()
        shutil.rmtree(area, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="switches to the user nobody (needs root)")
def test_gc_of_a_tree_with_a_directory_it_cannot_list_says_so(tmp_path):
    """A subdirectory gc cannot list could hold leftovers: it is a failure named in
    the report (exit code 1), not '0 leftovers removed'."""
    out = str(tmp_path / "report.json")
    child = FORK.Process(target=_gc_of_an_unreadable_subdirectory_as_nobody, args=(out,))
    child.start()
    assert finish(child) == 0
    with open(out) as report:
        found = json.load(report)
    (code, stdout, err), (plain_code, plain_out, plain_err) = found["results"]
    assert (code, err) == (1, ""), err
    [failure] = json.loads(stdout)["failed"]
    assert failure["prefix"] == found["closed"] and "Permission denied" in failure["error"]
    assert plain_code == 1 and found["closed"] in plain_out and "Permission denied" in plain_out
