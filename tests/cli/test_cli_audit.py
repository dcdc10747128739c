"""The command line's answers to an audit: gc of an archive, verify --json when the root
itself is refused, unambiguous escaping (backslashes too), clear errors (a symlink loop,
--wait, an archive's damaged meta.json)."""
from __future__ import annotations

import json
import os
import zipfile

import pytest
import torch

from tests.cli.cli_helpers import dead_pid, run_cli, run_json, run_main

import shared_td
from shared_td.cli.common import shown


def _archive(tmp_path, name="x.tdz") -> str:
    path = str(tmp_path / name)
    shared_td.TensorDict({"a": torch.zeros(2)}, [2]).save(path)
    return path


# ---------------------------------------------------------------- 1. gc of an archive
def test_gc_of_an_archive_lists_and_removes_its_lock_and_dead_temporaries(tmp_path):
    archive = _archive(tmp_path)
    lock = str(tmp_path / ".x.tdz.lock")
    temporary = str(tmp_path / f".x.tdz.shared_td-new-{dead_pid()}-0123456789ab")
    open(temporary, "wb").close()  # a killed archive writer's half-written file
    other = str(tmp_path / ".other.shared_td-new-1-0123456789ab")
    os.mkdir(other)  # another prefix's: not this archive's
    assert os.path.exists(lock)
    code, document = run_json("gc", "--dry-run", archive)
    assert code == 0 and sorted(document["removed"]) == sorted([temporary, lock])
    assert os.path.exists(temporary) and os.path.exists(lock)
    code, out, err = run_main("gc", archive)
    assert (code, err) == (0, "") and out.splitlines()[-1] == f"2 leftovers removed under {archive}"
    assert sorted(os.listdir(tmp_path)) == sorted([".other.shared_td-new-1-0123456789ab", "x.tdz"])
    assert shared_td.load(archive)["a"].tolist() == [0.0, 0.0]


def test_gc_of_a_file_that_is_no_archive_says_what_to_give(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    code, out, err = run_main("gc", tmp_path / "notes.txt")
    assert (code, out) == (1, "")
    assert err == (f"shared-td gc: error: {tmp_path / 'notes.txt'} is a file but no saved tensordict "
                   "archive, not a directory: give a directory to search or a saved tensordict "
                   "(a directory or a .tdz archive)\n")


# ---------------------------------------------------------------- 2. verify --json at the root
def _root_cases(tmp_path):
    """(prefix, problem path) for each way the root itself is refused."""
    cases = []
    for name, damage in [("not_json", lambda p: open(p, "w").write("{")),
                         ("missing", os.remove),
                         ("fifo", lambda p: (os.remove(p), os.mkfifo(p)))]:
        prefix = str(tmp_path / name)
        shared_td.TensorDict({"a": torch.zeros(2)}, [2]).memmap_(prefix)
        damage(os.path.join(prefix, "meta.json"))
        cases.append((prefix, "meta.json"))
    (tmp_path / "plain_file").write_text("x")
    cases.append((str(tmp_path / "plain_file"), "."))
    cases.append((_damaged_meta_archive(tmp_path), "meta.json"))
    return cases


def _damaged_meta_archive(tmp_path) -> str:
    """An archive whose meta.json data no longer match their stored CRC-32."""
    path = _archive(tmp_path, "damaged.tdz")
    with zipfile.ZipFile(path) as archive:
        info = archive.getinfo("meta.json")
        assert info.compress_type == zipfile.ZIP_STORED
    with open(path, "r+b") as file:  # one byte of the stored JSON (its local header read)
        file.seek(info.header_offset + 26)
        lengths = file.read(4)
        start = info.header_offset + 30 + int.from_bytes(lengths[:2], "little") + int.from_bytes(lengths[2:], "little")
        file.seek(start + 1)
        byte = file.read(1)
        file.seek(start + 1)
        file.write(bytes([byte[0] ^ 0x01]))
    return path


def test_verify_json_lists_a_refused_root_as_its_problem(tmp_path):
    for prefix, path in _root_cases(tmp_path):
        code, out, err = run_main("verify", "--json", prefix)
        assert (code, err) == (1, ""), prefix
        document = json.loads(out)
        assert set(document) == {"prefix", "ok", "totals", "problems"}
        assert document["prefix"] == prefix and document["ok"] is False
        assert set(document["totals"].values()) == {0}
        [problem] = document["problems"]
        assert problem["severity"] == "error" and problem["path"] == path
        assert problem["absolute_path"] == os.path.normpath(os.path.join(prefix, path))
        assert problem["message"]
        # without --json: the same one line on stderr as before
        code, out, err = run_main("verify", prefix)
        assert (code, out) == (1, "") and len(err.splitlines()) == 1


# ---------------------------------------------------------------- 3. unambiguous escaping
def test_shown_escapes_backslashes():
    assert shown("a\\nb") == "a\\\\nb" and shown("a\nb") == "a\\nb"
    assert shown("a\\nb") != shown("a\nb")
    assert shown("C:\\x1b") == "C:\\\\x1b" and shown("C:\x1b") == "C:\\x1b"
    assert shown("plain") == "plain"


def test_two_different_names_never_print_the_same(tmp_path):
    reports = []
    for name in ["a\\nb", "a\nb"]:  # a backslash and an n; a newline
        prefix = str(tmp_path / name)
        shared_td.TensorDict({"a": torch.zeros(2)}, [2]).memmap_(prefix)
        code, out, err = run_main("verify", prefix)
        assert (code, err) == (0, "")
        reports.append(out)
    assert reports[0] != reports[1]
    assert reports[0].startswith(f"ok: {tmp_path}/a\\\\nb: ") and reports[1].startswith(f"ok: {tmp_path}/a\\nb: ")


def test_inspect_quotes_a_key_with_a_backslash_and_json_stays_raw(tmp_path):
    prefix = str(tmp_path / "keys")
    shared_td.TensorDict({"k\\ney": torch.zeros(2), "k\ney": torch.zeros(2), "v": "x\\y"}, [2]).memmap_(prefix)
    code, out, err = run_main("inspect", prefix)
    assert (code, err) == (0, "")
    labels = [line.split()[1] for line in out.splitlines()[1:4]]
    assert sorted(labels) == sorted(["'k\\\\ney'", "'k\\ney'", "v"])  # repr: distinct
    assert "'x\\\\y'" in out  # a value is its repr, escaped once (not twice)
    code, document = run_json("inspect", prefix)
    assert sorted(child["key"] for child in document["tree"]["children"]) == sorted(["k\\ney", "k\ney", "v"])


def test_gc_report_escapes_backslashes_and_json_is_raw(tmp_path):
    root = tmp_path / "da\\nta"
    prefix = root / "p"
    shared_td.TensorDict(x=torch.zeros(2)).memmap_(str(prefix), atomic=True)
    code, out, err = run_main("gc", "--dry-run", root)
    assert (code, err) == (0, "")
    assert out.splitlines()[-1] == f"1 leftover to remove under {tmp_path}/da\\\\nta"
    code, document = run_json("gc", "--dry-run", root)
    assert document["removed"] == [str(root / ".p.lock")]


# ---------------------------------------------------------------- 4. clear errors
def test_a_symlink_loop_is_said_to_be_one(tmp_path):
    loop = tmp_path / "loop1"
    os.symlink(tmp_path / "loop2", loop)
    os.symlink(loop, tmp_path / "loop2")
    for command in ("inspect", "verify", "gc"):
        code, out, err = run_main(command, loop)
        assert (code, out) == (1, ""), command
        assert err.startswith(f"shared-td {command}: error: {loop} is a symlink loop (ELOOP"), err
    code, document = run_json("verify", loop)
    assert code == 1 and "symlink loop" in document["problems"][0]["message"]


def test_a_dangling_symlink_is_said_to_be_one(tmp_path):
    link = tmp_path / "link"
    os.symlink(tmp_path / "gone", link)
    code, out, err = run_main("verify", link)
    assert (code, out) == (1, "")
    assert err.startswith(f"shared-td verify: error: {link} is a symlink to {tmp_path / 'gone'}, which does not exist")


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "-1", "abc"])
def test_gc_wait_must_be_a_finite_number_of_seconds(tmp_path, value):
    # a usage error (2) whether or not any lock is held: checked by the parser
    done = run_cli("gc", f"--wait={value}", tmp_path, timeout=60)
    assert done.returncode == 2 and done.stdout == "", done
    assert done.stderr.startswith("usage: shared-td gc")
    assert "shared-td gc: error: argument --wait: " in done.stderr


def test_gc_wait_accepts_zero_and_fractions(tmp_path):
    for value in ("0", "0.5", "2"):
        code, out, err = run_main("gc", "--wait", value, tmp_path)
        assert (code, err) == (0, "")


def test_an_archive_meta_json_failing_its_checksum_is_said_to_be_damaged(tmp_path):
    archive = _damaged_meta_archive(tmp_path)
    for command in ("inspect", "verify"):
        code, out, err = run_main(command, archive)
        assert (code, out) == (1, "")
        assert "its meta.json does not match its stored checksum (Bad CRC-32" in err, err
        assert "the archive is damaged" in err and "not valid JSON" not in err
