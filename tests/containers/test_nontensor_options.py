"""tensordict 0.15.3's global options of non-tensor data: set_list_to_stack / list_to_stack
and set_capture_non_tensor_stack / capture_non_tensor_stack (torchrl calls
``set_list_to_stack(True).set()`` at import: code doing so failed to import shared_td's)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import shared_td
from shared_td.containers import nontensor_options
from tests.reference import LIBS


_VARIABLES = ("LIST_TO_STACK", "CAPTURE_NONTENSOR_STACK")


@pytest.fixture(autouse=True)
def modes_restored():
    """Every test leaves the process-wide modes as it found them: shared_td's, and
    tensordict's with the environment variables its set() writes."""
    before = dict(nontensor_options._MODES)
    environment = {name: os.environ.get(name) for name in _VARIABLES}
    options = sys.modules.get("tensordict._utils_options")
    theirs = {name: getattr(options, f"_{name}") for name in _VARIABLES} if options else {}
    yield
    nontensor_options._MODES.update(before)
    for name, value in environment.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    for name, value in theirs.items():
        setattr(options, f"_{name}", value)


@pytest.mark.parametrize("lib", LIBS)
def test_set_list_to_stack_true_set_as_torchrl_calls_it(lib):
    lib.set_list_to_stack(True).set()
    assert lib.list_to_stack() is True and lib.list_to_stack(allow_none=True) is True
    td = lib.TensorDict({"info": ["a", "b", "c"]}, [3])
    assert type(td.get("info")).__name__ == "NonTensorStack" and td[1]["info"] == "b"


def test_never_set_reads_none_with_allow_none():
    nontensor_options._MODES["LIST_TO_STACK"] = None
    assert shared_td.list_to_stack(allow_none=True) is None and shared_td.list_to_stack() is True
    assert shared_td.capture_non_tensor_stack() is False


def test_false_keeps_a_list_as_one_value_and_numbers_as_a_tensor():
    with pytest.warns(DeprecationWarning, match="set_non_tensor"):
        mode = shared_td.set_list_to_stack(False)
    with mode:
        assert shared_td.list_to_stack() is False
        td = shared_td.TensorDict({"info": ["a", "b", "c"], "n": [1, 2, 3]}, [3])
        td["short"] = ["x", "y"]  # one value: no batch-size error
        assert isinstance(td.get("info"), shared_td.NonTensorData) and td.get("info").data == ["a", "b", "c"]
        assert td["short"] == ["x", "y"] and torch.equal(td["n"], torch.tensor([1, 2, 3]))
    assert shared_td.list_to_stack() is True  # restored on leaving the block
    assert type(shared_td.TensorDict({"info": ["a", "b", "c"]}, [3]).get("info")).__name__ == "NonTensorStack"


def test_the_block_restores_the_mode_set_inside_it_and_nests():
    with pytest.warns(DeprecationWarning):
        off = shared_td.set_list_to_stack(False)
    with shared_td.set_list_to_stack(True):
        with off:
            with shared_td.set_list_to_stack(True):
                assert shared_td.list_to_stack() is True
            assert shared_td.list_to_stack() is False
            shared_td.set_list_to_stack(True).set()
        assert shared_td.list_to_stack() is True
    with off:
        off.set()
    assert shared_td.list_to_stack() is True  # (tensordict's rule: leaving the block restores)


def test_as_a_decorator_each_call_runs_in_the_mode():
    with pytest.warns(DeprecationWarning):
        @shared_td.set_list_to_stack(False)
        def build():
            return shared_td.TensorDict({"info": ["a", "b"]}, [2]), shared_td.list_to_stack()

    first, mode = build()
    assert mode is False and isinstance(first.get("info"), shared_td.NonTensorData)
    assert build()[1] is False and shared_td.list_to_stack() is True


@pytest.mark.parametrize("lib", LIBS)
def test_capture_non_tensor_stack(lib):
    items = [lib.NonTensorData("a"), lib.NonTensorData("a")]
    assert type(torch.stack(items)).__name__ == "NonTensorStack"
    with pytest.warns(DeprecationWarning):
        capture = lib.set_capture_non_tensor_stack(True)
    with capture:
        assert lib.capture_non_tensor_stack() is True
        one = torch.stack(items)
        assert type(one).__name__ == "NonTensorData" and one.data == "a" and one.batch_size == torch.Size([2])
        tds = torch.stack([lib.TensorDict(x=lib.NonTensorData("a")), lib.TensorDict(x=lib.NonTensorData("a"))])
        assert type(tds.get("x")).__name__ == "NonTensorData"
        different = torch.stack([lib.NonTensorData("a"), lib.NonTensorData("b")])
        assert type(different).__name__ == "NonTensorStack" and different.tolist() == ["a", "b"]
    assert lib.capture_non_tensor_stack() is False


@pytest.mark.parametrize("variable,value,expected", [
    ("LIST_TO_STACK", "0", "False"), ("LIST_TO_STACK", "none", "True"),
    ("CAPTURE_NONTENSOR_STACK", "1", "True")])
def test_the_environment_sets_the_mode_at_import(variable, value, expected):
    read = "list_to_stack" if variable == "LIST_TO_STACK" else "capture_non_tensor_stack"
    done = subprocess.run([sys.executable, "-c", f"import shared_td; print(shared_td.{read}())"],
                          env={**os.environ, variable: value}, capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr.decode()
    assert done.stdout.decode().strip() == expected


def test_the_mode_reaches_processes_started_in_it():
    """As tensordict's, set() and a block write the environment variable (a spawn worker
    started in the block builds what the parent builds) and leaving restores it."""
    os.environ.pop("LIST_TO_STACK", None)
    with pytest.warns(DeprecationWarning):
        off = shared_td.set_list_to_stack(False)
    with off:
        done = subprocess.run([sys.executable, "-c", "import shared_td; print(shared_td.list_to_stack())"],
                              capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr.decode()
    assert done.stdout.decode().strip() == "False"
    assert "LIST_TO_STACK" not in os.environ and shared_td.list_to_stack(allow_none=True) is None
    shared_td.set_list_to_stack(True).set()
    assert os.environ["LIST_TO_STACK"] == "True"


def test_a_decorated_generator_runs_each_step_in_the_mode():
    with pytest.warns(DeprecationWarning):
        @shared_td.set_list_to_stack(False)
        def modes():
            reply = yield shared_td.list_to_stack()
            try:
                yield (reply, shared_td.list_to_stack())
            except KeyError:
                yield ("thrown", shared_td.list_to_stack())
            return "done"

    steps = modes()
    assert next(steps) is False and shared_td.list_to_stack() is True  # outside between steps
    assert steps.send("r") == ("r", False)
    assert steps.throw(KeyError("k")) == ("thrown", False)
    with pytest.raises(StopIteration) as stop:
        next(steps)
    assert stop.value.value == "done" and shared_td.list_to_stack() is True
