"""Small persistence fixes of session 19: ``num_threads=-1`` (accepted by tensordict
0.15.3, which writes and loads in the calling thread for it), side by side; a failed
``return_early`` write whose future nobody reads warns when the future is freed."""
from __future__ import annotations

import concurrent.futures
import gc
import os
import signal
import subprocess
import sys
import threading
import warnings

import pytest
import torch

import shared_td
from shared_td.persist import api
from tests.reference import LIBS

WAIT = 30  # seconds: the bound on every wait for a background write

def _tree(lib):
    return lib.TensorDict(a=torch.arange(3.0), n=lib.TensorDict(b=torch.ones(3, 2), batch_size=[3]),
                          batch_size=[3])


WRITES = {
    "memmap_": lambda lib, path, n: _tree(lib).memmap_(path, num_threads=n),
    "memmap_early": lambda lib, path, n: _tree(lib).memmap_(path, num_threads=n, return_early=True),
    "memmap": lambda lib, path, n: _tree(lib).memmap(path, num_threads=n),
    "memmap_like": lambda lib, path, n: _tree(lib).memmap_like(path, num_threads=n),
    "save": lambda lib, path, n: _tree(lib).save(path, num_threads=n),
    "save_function": lambda lib, path, n: lib.save(_tree(lib), path, num_threads=n),
    "lazy": lambda lib, path, n: lib.LazyStackedTensorDict.lazy_stack([_tree(lib), _tree(lib)]).memmap(
        path, num_threads=n),
}


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("write", list(WRITES))
@pytest.mark.parametrize("count", [-1, -4])
def test_a_negative_num_threads_writes_in_the_calling_thread(lib, write, count, tmp_path):
    # before: shared_td raised ValueError("num_threads must be an int >= 0")
    before = threading.active_count()
    out = WRITES[write](lib, tmp_path / "p", count)
    # a tensordict (no future, even with return_early=True): the write is done
    assert isinstance(out, lib.LazyStackedTensorDict if write == "lazy" else lib.TensorDict)
    assert out.is_memmap() and threading.active_count() == before
    if write != "memmap_like":
        assert lib.load_memmap(tmp_path / "p")["a"].tolist() == out["a"].tolist()


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("load", ["method", "function", "tensorclass"])
def test_a_negative_num_threads_loads_in_the_calling_thread(lib, load, tmp_path):
    @lib.tensorclass
    class Step:
        x: torch.Tensor

    if load == "tensorclass":
        Step(x=torch.arange(3.0), batch_size=[3]).memmap(tmp_path / "p")
        assert Step.load_memmap(tmp_path / "p", num_threads=-1).x.tolist() == [0.0, 1.0, 2.0]
        return
    _tree(lib).memmap(tmp_path / "p")
    read = lib.TensorDict.load_memmap if load == "method" else lib.load_memmap
    assert read(tmp_path / "p", num_threads=-1)["n", "b"].sum().item() == 6.0


def _meta_tree():
    # consolidate cannot copy a meta leaf: its background copy fails
    return shared_td.TensorDict(a=torch.zeros(3), b=torch.empty(3, device="meta"), batch_size=[3])


def _failing_write(monkeypatch):
    def write_tree(*args, **kwargs):
        raise OSError(28, "No space left on device (test)")

    monkeypatch.setattr(api, "write_tree", write_tree)


EARLY = {
    "memmap_": lambda path: _tree(shared_td).memmap_(path, num_threads=2, return_early=True),
    "memmap": lambda path: _tree(shared_td).memmap(path, num_threads=2, return_early=True),
    "consolidate": lambda path: _meta_tree().consolidate(num_threads=2, return_early=True),
}


def _background_write_over(future):
    """Wait until the write's thread has ended (it holds the future until then)."""
    concurrent.futures.wait(future.futures, timeout=WAIT)
    for thread in threading.enumerate():
        if thread.name.startswith(("shared_td-memmap", "shared_td-consolidate")):
            thread.join(WAIT)


def _shared_td_warnings(record):
    return [str(w.message) for w in record if "background write" in str(w.message)]


@pytest.mark.parametrize("call", list(EARLY))
def test_a_failed_early_write_whose_future_is_dropped_unread_warns(call, tmp_path, monkeypatch):
    # before: nothing at all said that the save was missing
    _failing_write(monkeypatch)
    future = EARLY[call](tmp_path / "p")
    _background_write_over(future)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        del future
        gc.collect()  # (the error's traceback holds the future in a cycle)
    [message] = _shared_td_warnings(record)
    assert ("No space left" in message and str(tmp_path / "p") in message) if call != "consolidate" \
        else "consolidate" in message and "meta" in message
    assert "never read" in message and record[0].category is RuntimeWarning


@pytest.mark.parametrize("read", [
    lambda future: future.result(timeout=WAIT),
    lambda future: future.exception(timeout=WAIT),
    lambda future: future.futures[0].result(timeout=WAIT),
    lambda future: future.resulting_td,
], ids=["result", "exception", "futures", "resulting_td"])
def test_a_failed_early_write_whose_error_was_read_does_not_warn(read, tmp_path, monkeypatch):
    _failing_write(monkeypatch)
    future = EARLY["memmap"](tmp_path / "p")
    _background_write_over(future)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with pytest.raises(OSError, match="No space left"):
            raise read(future)  # (exception() returns the error, the others raise it)
        del future
        gc.collect()
    assert _shared_td_warnings(record) == []


@pytest.mark.parametrize("call", ["memmap_", "memmap"])
def test_a_successful_early_write_dropped_unread_does_not_warn(call, tmp_path):
    future = EARLY[call](tmp_path / "p")
    _background_write_over(future)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        del future
        gc.collect()
    assert _shared_td_warnings(record) == []
    assert shared_td.load_memmap(tmp_path / "p")["a"].tolist() == [0.0, 1.0, 2.0]


# ----------------------------------------------------------------- the embedded coordinator
# (shared_td/coordinator/ownership.py: the owner of memmap_(share_non_tensor=True)'s values)

@pytest.fixture(scope="module")
def running_coordinator():
    with shared_td.Coordinator() as coord:
        yield coord


def test_an_announced_coordinator_that_refuses_the_key_is_an_error(running_coordinator, monkeypatch):
    # before: treated as a dead ancestor's coordinator (the variable removed, None
    # returned): memmap_(share_non_tensor=True) then started a second coordinator
    from shared_td.coordinator import ownership

    announced = f"{running_coordinator.address};{(b'x' * 32).hex()}"
    monkeypatch.setenv(ownership.ENV_VAR, announced)
    with pytest.raises(shared_td.CoordinatorAuthenticationError) as caught:
        ownership._from_environment()
    message = str(caught.value) + " ".join(getattr(caught.value, "__notes__", []))
    assert running_coordinator.address in message and "does not match" in message
    assert ownership.ENV_VAR in message
    assert os.environ[ownership.ENV_VAR] == announced  # kept: the coordinator is there


def test_a_hand_over_the_embedded_coordinator_refuses_is_an_error(running_coordinator, monkeypatch):
    # before: the coordinator was forgotten as gone and another one started in its place
    from shared_td.coordinator import client, ownership

    refused = client.Coordinator()
    refused._address, refused._authkey = running_coordinator.address, b"x" * 32
    monkeypatch.setattr(ownership, "_EMBEDDED", refused)
    monkeypatch.delenv(ownership.ENV_VAR, raising=False)
    with pytest.raises(shared_td.CoordinatorAuthenticationError, match="does not match"):
        ownership._hand_over([])
    assert ownership._EMBEDDED is refused and ownership.ENV_VAR not in os.environ


# ---------------------------------------------------------------------- the command line
# (shared_td/cli/startup.py; here as the brief of session 19 names this file)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: a sitecustomize that stops the child in its import of torch (the package imports it)
#: and says so on stderr: the SIGINT then comes while torch is being imported, every time
_BLOCK_IN_TORCH_IMPORT = """
import sys, time
class _Block:
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            sys.meta_path.remove(self)
            sys.stderr.write("IMPORTING-TORCH\\n")
            sys.stderr.flush()
            time.sleep(30)  # (the bound if no signal came)
        return None
sys.meta_path.insert(0, _Block())
"""


def _command(how: str) -> list[str]:
    if how == "-m":
        return [sys.executable, "-m", "shared_td", "verify", REPO]
    script = os.path.join(os.path.dirname(sys.executable), "shared-td")
    if not os.path.exists(script):
        pytest.skip("the shared-td console script is not installed next to this python")
    return [script, "verify", REPO]


@pytest.mark.parametrize("how", ["-m", "shared-td"])
def test_ctrl_c_while_the_command_line_imports_torch_is_one_line_and_130(how, tmp_path):
    # before: Python's traceback of the interrupted import, and the exit of a SIGINT
    assert _interrupted_while_importing_torch(_BLOCK_IN_TORCH_IMPORT, how, tmp_path) == (
        130, "shared-td: interrupted\n")


def _interrupted_while_importing_torch(site_code: str, how: str, site) -> tuple[int, str]:
    """Run the command line with ``site_code`` as its sitecustomize (in ``site``), send
    it SIGINT once it says IMPORTING-TORCH; its exit code and stderr (bounded)."""
    (site / "sitecustomize.py").write_text(site_code)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), REPO])}
    child = subprocess.Popen(_command(how), cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    try:
        assert child.stderr.readline() == "IMPORTING-TORCH\n"
        child.send_signal(signal.SIGINT)
        _, err = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)
    return child.returncode, err


def test_ctrl_c_while_a_command_module_is_imported_is_one_line_and_130(monkeypatch, capsys):
    # before: the KeyboardInterrupt left main() (a traceback); cli.main's own import of the
    # command's module (verify_cmd imports torch) is after the package's import
    from shared_td import cli

    def interrupted(name):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli.importlib, "import_module", interrupted)
    try:
        code = cli.main(["verify", REPO])
    except KeyboardInterrupt:
        pytest.fail("main() let the KeyboardInterrupt out")
    assert (code, capsys.readouterr().err) == (130, "shared-td: interrupted\n")


def test_a_program_importing_shared_td_keeps_its_keyboard_interrupt():
    # (only the command line's process gets the one-line exit)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.mark.parametrize("argv, command, expected", [
    (["/v/bin/shared-td"], ["/v/bin/python", "/v/bin/shared-td", "verify", "x"], True),
    (["-m"], ["python", "-m", "shared_td", "verify", "x"], True),
    (["-m"], ["python", "-X", "dev", "-mshared_td"], True),
    (["-m"], ["python", "-m", "pytest", "tests"], False),
    (["/work/prog.py"], ["python", "/work/prog.py"], False),
    # a spawned child of the command line gets its parent's sys.argv, not its command
    (["/v/bin/shared-td"], ["python", "-B", "-c", "from multiprocessing.spawn import spawn_main",
                            "--multiprocessing-fork"], False),
], ids=["script", "-m", "-m-joined", "other-m", "program", "spawned-child"])
def test_only_the_command_lines_own_process_exits_quietly(argv, command, expected, monkeypatch):
    from shared_td.cli import startup

    monkeypatch.setattr(sys, "argv", argv)
    monkeypatch.setattr(sys, "orig_argv", command)
    assert startup._is_command_line() is expected


#: as _BLOCK_IN_TORCH_IMPORT, but the wait is inside code that swallows every exception,
#: as torch's C import of numpy does: an exception raised by the handler there is lost
_SWALLOW_IN_TORCH_IMPORT = """
import sys, time
class _Block:
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            sys.meta_path.remove(self)
            try:  # (said inside: the signal must come where it is swallowed)
                sys.stderr.write("IMPORTING-TORCH\\n")
                sys.stderr.flush()
                time.sleep(30)  # (the bound if no signal came)
            except BaseException:
                pass  # swallowed, as C code may
            sys.stderr.write("RAN-ON\\n")
        return None
sys.meta_path.insert(0, _Block())
"""


def test_ctrl_c_swallowed_by_the_import_still_stops_the_command(tmp_path):
    # before: the SystemExit raised into the import was swallowed, "interrupted" printed,
    # and the command ran to its end with exit 0 (the audit saw 4 of 8 demo runs do so)
    assert _interrupted_while_importing_torch(_SWALLOW_IN_TORCH_IMPORT, "-m", tmp_path) == (
        130, "shared-td: interrupted\n")


_HELD_FUTURE_SCRIPT = """
import time, torch, shared_td
from shared_td.persist import api

def write_tree(*args, **kwargs):
    raise OSError(28, "No space left on device (test)")

api.write_tree = write_tree  # the write fails in the background
td = shared_td.TensorDict(a=torch.zeros(3), b=torch.ones(2), batch_size=[])
held = td.memmap({prefix!r}, num_threads=2, return_early=True)
while not held.done():
    time.sleep(0.01)
print("end of script")
"""


def test_a_failed_write_whose_future_is_held_unread_at_exit_is_reported(tmp_path):
    # before: a module-level future of a write that failed before the end was never freed
    # before the last collection that warns, and the exit hook knew only running writes
    prefix = tmp_path / "save"
    script = tmp_path / "held.py"
    script.write_text(_HELD_FUTURE_SCRIPT.format(prefix=str(prefix)))
    done = subprocess.run([sys.executable, str(script)], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": REPO})
    assert done.stdout == "end of script\n", done.stderr
    assert "failed and its future was never read" in done.stderr, done.stderr
