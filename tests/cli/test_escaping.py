"""verify, inspect and gc print every path and key with its control characters escaped:
a name on disk cannot forge a report line or send escape sequences to the terminal."""
from __future__ import annotations

import os
import re

import torch

from tests.cli.cli_helpers import dead_pid, run_main

import shared_td
from shared_td.cli.common import shown

# what a terminal acts on: C0 controls but the newline that ends each line, DEL, C1
CONTROL = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f]")
NAME = "sa\x1b[31mve\nd\r"  # an escape sequence, a newline and a carriage return


def _hostile_save(tmp_path) -> str:
    prefix = str(tmp_path / NAME)
    td = shared_td.TensorDict({"k\x1b]0;pwned\x07": torch.zeros(2), "line\nbreak": {"x": torch.ones(2)}}, [2])
    td.memmap_(prefix)
    open(os.path.join(prefix, "stray\r\x1b[2K.txt"), "w").close()  # a warning
    os.symlink("/", os.path.join(prefix, "ln\x1b[0m"))  # an error
    return prefix


def test_verify_escapes_paths_and_names(tmp_path):
    prefix = _hostile_save(tmp_path)
    code, out, err = run_main("verify", prefix)
    assert (code, err) == (1, "")
    assert not CONTROL.search(out), repr(out)
    lines = out.splitlines()
    assert len(lines) == 3  # the summary, one error, one warning: no forged line
    assert lines[0].startswith(f"FAILED: {shown(prefix)}: 1 error, 1 warning")
    assert lines[1].startswith(f"error    {shown(prefix)}/ln\\x1b[0m: a symlink to /")
    assert lines[2] == f"warning  {shown(prefix)}/stray\\r\\x1b[2K.txt: an unknown file: no meta.json names it"


def test_inspect_escapes_paths_and_names(tmp_path):
    prefix = _hostile_save(tmp_path)
    code, out, err = run_main("inspect", prefix)
    assert (code, err) == (0, "")
    assert not CONTROL.search(out), repr(out)
    lines = out.splitlines()
    assert lines[0] == f"{shown(prefix)}: TensorDict, batch size [2]"
    assert len(lines) == 1 + 3 + 2  # header, 3 entries, totals, the hint to run verify
    assert "'k\\x1b]0;pwned\\x07'" in out and "'line\\nbreak'" in out
    assert lines[-1] == f"1 error, 1 warning: run `shared-td verify {shown(prefix)}` for the list"


def test_gc_escapes_paths(tmp_path):
    root = tmp_path / "data\x1b[1m"
    prefix = root / NAME
    shared_td.TensorDict(x=torch.zeros(2)).memmap_(str(prefix), atomic=True)
    leftover = root / f".{NAME}.shared_td-new-{dead_pid()}-0123456789ab"
    leftover.mkdir()
    code, out, err = run_main("gc", "--dry-run", root)
    assert (code, err) == (0, "")
    assert not CONTROL.search(out), repr(out)
    lines = out.splitlines()
    assert len(lines) == 3  # the leftover directory, the lock file, the total
    assert lines[0].startswith(f"would remove  {shown(str(leftover))}  (temporary directory")
    assert lines[-1] == f"2 leftovers to remove under {shown(str(root))}"


def test_an_error_message_is_escaped_too(tmp_path):
    missing = tmp_path / "no\x1b[5msuch"
    code, out, err = run_main("verify", missing)
    assert (code, out) == (1, "") and not CONTROL.search(err), repr(err)
    assert err == f"shared-td verify: error: No such directory: {shown(str(missing))}\n"


def test_shown_leaves_printable_text_alone():
    assert shown("plain/päth with spaces ü") == "plain/päth with spaces ü"
    assert shown("a\tb\x00c\x9bd\u2028") == "a\\tb\\x00c\\x9bd\\u2028"
    assert shown(os.fsdecode(b"bad\xffbyte")) == "bad\\udcffbyte"
