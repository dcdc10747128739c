"""The dispatcher: --help of every command, usage errors (exit 2), failures (exit 1, one
line, a traceback only with --debug), lazily imported commands, the entry points."""
from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys

import pytest

from tests.cli.cli_helpers import REPO, run_cli, run_main

from shared_td import cli

OURS = ["inspect", "verify", "gc", "bench", "demo"]


def test_top_level_help_lists_every_command_with_examples():
    done = run_cli("--help", timeout=120)
    assert done.returncode == 0 and done.stderr == ""
    for name in cli.COMMANDS:
        assert f"    {name} " in done.stdout
    assert "examples:" in done.stdout and "shared-td inspect /data/buffer" in done.stdout


@pytest.mark.parametrize("command", OURS)
def test_every_command_has_help_with_examples(command):
    code, out, err = run_main(command, "--help")
    assert (code, err) == (0, "")
    assert out.startswith(f"usage: shared-td {command} ")
    assert "examples:" in out and f"shared-td {command} " in out.split("examples:")[1]


@pytest.mark.parametrize("argv", [[], ["nope"], ["inspect"], ["verify", "--no-such-option", "x"],
                                  ["gc", "--wait", "soon", "."], ["bench", "--only", "nope"]])
def test_usage_errors_exit_2_without_traceback(argv):
    code, out, err = run_main(*argv)
    assert code == 2 and out == ""
    assert err.startswith("usage: shared-td") and "Traceback" not in err


def test_failure_is_one_line_and_debug_shows_the_traceback(tmp_path):
    missing = tmp_path / "missing"
    done = run_cli("inspect", missing)
    assert done.returncode == 1
    assert done.stderr == f"shared-td inspect: error: No such directory: {missing}\n"
    for argv in (["--debug", "inspect", missing], ["inspect", "--debug", missing]):
        code, _, err = run_main(*argv)
        assert code == 1 and "Traceback (most recent call last)" in err
        assert err.endswith(f"shared-td inspect: error: No such directory: {missing}\n")


def test_only_the_command_run_is_imported(monkeypatch):
    monkeypatch.setitem(cli.COMMANDS, "gc", ("shared_td.cli.no_such_module", "broken"))
    code, out, _ = run_main("--help")  # listing the commands imports none of them
    assert code == 0 and "broken" in out
    code, _, err = run_main("gc", ".")
    assert code == 1
    assert err == ("shared-td gc: error: ModuleNotFoundError: No module named "
                   "'shared_td.cli.no_such_module'\n")


def test_a_demo_missing_from_the_build_is_one_clear_line(monkeypatch):
    # the demo lives in its own module; when a build lacks it, `demo` says so
    monkeypatch.setitem(cli.COMMANDS, "demo", ("shared_td.cli.demo_not_in_this_build", "demo"))
    code, out, err = run_main("demo")
    assert (code, out) == (1, "")
    assert err == "shared-td demo: the demo is not available in this build\n"


def test_version_and_console_script():
    code, out, _ = run_main("--version")
    assert code == 0 and out.strip() == f"shared-td {__import__('shared_td').__version__}"
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as file:
        scripts = tomllib.load(file)["project"]["scripts"]
    module, function = scripts["shared-td"].split(":")
    assert getattr(importlib.import_module(module), function) is cli.main
    installed = shutil.which("shared-td", path=os.path.dirname(sys.executable))
    if installed is None:
        pytest.skip("shared_td is installed here without its console script (an old install)")
    done = subprocess.run([installed, "--version"], capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout) == (0, out)
