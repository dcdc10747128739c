"""`shared-td verify`: a sound save passes (ours and tensordict 0.15.3's); each kind of
damage is reported with its path and the right exit code."""
from __future__ import annotations

import os
import shutil

import pytest

from tests.cli.cli_helpers import (
    problems_by_path, run_cli, run_json, run_main, save_by, save_lazy_stack, save_ours,
)

from shared_td.cli import main


@pytest.mark.parametrize("writer", ["shared_td", "tensordict"])
def test_a_sound_save_passes(tmp_path, writer):
    prefix = save_by(writer, tmp_path / "saved")
    code, out, err = run_main("verify", prefix)
    assert (code, err) == (0, ""), out + err
    assert out == f"ok: {prefix}: 2 nodes, 4 leaves (96 B), 3 non-tensor values\n"
    code, document = run_json("verify", prefix)
    assert (code, document["ok"], document["problems"]) == (0, True, [])


def test_lazy_stack_passes_and_a_gap_is_an_error(tmp_path):
    prefix = save_lazy_stack(tmp_path / "lazy")
    assert main(["verify", "-q", prefix]) == 0
    os.rename(os.path.join(prefix, "1"), os.path.join(prefix, "2"))  # member 1 missing
    code, document = run_json("verify", prefix)
    assert code == 1
    (severity, message), = problems_by_path(document)["."]
    assert severity == "error" and "member 1 of 2 of this lazy stack is missing" in message


def _damaged(tmp_path, damage):
    prefix = save_ours(tmp_path / "saved")
    damage(prefix)
    code, document = run_json("verify", prefix)
    return code, problems_by_path(document)


def test_truncated_leaf(tmp_path):
    code, problems = _damaged(tmp_path, lambda p: os.truncate(os.path.join(p, "obs.memmap"), 47))
    assert code == 1
    [(severity, message)] = problems["obs.memmap"]
    assert severity == "error" and "47 bytes" in message and "needs 48" in message


def test_longer_leaf_is_fine(tmp_path):  # tensordict's own artifact has trailing bytes
    code, problems = _damaged(tmp_path, lambda p: os.truncate(os.path.join(p, "obs.memmap"), 64))
    assert (code, problems) == (0, {})


def test_broken_meta_json(tmp_path):
    def damage(prefix):
        with open(os.path.join(prefix, "next", "meta.json"), "w") as file:
            file.write('{"reward": ')

    code, problems = _damaged(tmp_path, damage)
    assert code == 1
    assert list(problems) == [os.path.join("next", "meta.json")]  # its files: no warnings
    [(severity, message)] = problems[os.path.join("next", "meta.json")]
    assert severity == "error" and message.startswith("not valid JSON")


def test_a_root_meta_json_that_is_no_save_is_a_one_line_error(tmp_path):
    # the words atomic=True uses to refuse replacing such a directory (format.not_a_save)
    prefix = save_ours(tmp_path / "saved")
    for content, why in [("[1, 2]", "its meta.json holds a JSON list, not an object"),
                         ('{"name": "x"}', "its meta.json has no _type (it holds the keys 'name')")]:
        with open(os.path.join(prefix, "meta.json"), "w") as file:
            file.write(content)
        for command in ("verify", "inspect"):
            code, out, err = run_main(command, prefix)
            assert (code, out) == (1, "")
            assert err == f"shared-td {command}: error: {prefix}: not a saved tensordict: {why}.\n"


def test_missing_leaf_file(tmp_path):
    code, problems = _damaged(tmp_path, lambda p: os.unlink(os.path.join(p, "a%2Fb%20c.memmap")))
    assert code == 1
    [(severity, message)] = problems["a%2Fb%20c.memmap"]
    assert severity == "error" and "missing" in message and "'a/b c'" in message


def test_missing_child_directory(tmp_path):
    code, problems = _damaged(tmp_path, lambda p: shutil.rmtree(os.path.join(p, "next")))
    assert code == 1 and problems["next"][0][0] == "error"


def test_symlinks_are_errors_escaping_or_not(tmp_path):
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"\0" * 64)

    def damage(prefix):
        leaf = os.path.join(prefix, "obs.memmap")
        os.unlink(leaf)
        os.symlink(outside, leaf)  # a listed leaf, leading out
        os.symlink("/", os.path.join(prefix, "next", "root"))  # an unlisted one, leading out
        os.symlink("task", os.path.join(prefix, "task2"))  # one that stays inside

    code, problems = _damaged(tmp_path, damage)
    assert code == 1
    assert problems["obs.memmap"][0][0] == "error" and "symlink" in problems["obs.memmap"][0][1]
    assert problems[os.path.join("next", "root")] == [
        ("error", "a symlink to / (escapes the prefix); never followed")]
    assert problems["task2"] == [("error", "a symlink to task (inside the prefix); never followed")]


def test_unknown_extra_file_is_a_warning_with_exit_code_0(tmp_path):
    def damage(prefix):
        with open(os.path.join(prefix, "notes.txt"), "w") as file:
            file.write("hello")
        open(os.path.join(prefix, "next", "old%20key.memmap"), "wb").close()

    code, problems = _damaged(tmp_path, damage)
    assert code == 0
    assert problems == {
        "notes.txt": [("warning", "an unknown file: no meta.json names it")],
        os.path.join("next", "old%20key.memmap"): [
            ("warning", "an unknown file: a leaf file of key 'old key', which no meta.json lists")],
    }


def test_text_report_lists_each_problem_with_its_full_path(tmp_path):
    prefix = save_ours(tmp_path / "saved")
    os.truncate(os.path.join(prefix, "obs.memmap"), 0)
    open(os.path.join(prefix, "stray"), "w").close()
    done = run_cli("verify", prefix)
    assert done.returncode == 1 and done.stderr == ""
    lines = done.stdout.splitlines()
    assert lines[0].startswith(f"FAILED: {prefix}: 1 error, 1 warning")
    assert lines[1].startswith(f"error    {prefix}/obs.memmap: 0 bytes")
    assert lines[2] == f"warning  {prefix}/stray: an unknown file: no meta.json names it"
    code, out, _ = run_main("verify", "--quiet", prefix)
    assert code == 1 and out.splitlines() == lines[1:]


def test_not_a_save_is_a_one_line_error(tmp_path):
    (tmp_path / "file").write_text("x")
    for target in [tmp_path / "missing", tmp_path, tmp_path / "file"]:
        code, out, err = run_main("verify", target)
        assert (code, out) == (1, "") and len(err.splitlines()) == 1
        assert err.startswith("shared-td verify: error: ") and "Traceback" not in err
    done = run_cli("verify", tmp_path / "missing")  # the same through python -m shared_td
    assert done.returncode == 1
    assert done.stderr == f"shared-td verify: error: No such directory: {tmp_path / 'missing'}\n"
