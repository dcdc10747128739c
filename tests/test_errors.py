"""Every exception class of shared_td is defined in shared_td.errors and exported from
shared_td; the old import locations name the same classes."""
from __future__ import annotations

import importlib
import inspect
import os
import pkgutil

import pytest

import shared_td
from shared_td import errors

PACKAGE_DIR = os.path.dirname(shared_td.__file__)
# the command line's exit signals: caught by its main, never raised to a library user
CLI_SIGNALS = {"UsageError", "CommandError", "DemoUnavailable"}


def _modules():
    for info in pkgutil.walk_packages([PACKAGE_DIR], "shared_td."):
        if info.name not in ("shared_td.errors", "shared_td.__main__"):  # __main__ runs the CLI
            yield importlib.import_module(info.name)


def _own_exception_classes(module):
    return {name for name, value in vars(module).items()
            if inspect.isclass(value) and issubclass(value, BaseException)
            and value.__module__ == module.__name__}


def test_every_exception_class_is_defined_in_errors_and_exported():
    defined = {name for name, value in vars(errors).items()
               if inspect.isclass(value) and issubclass(value, BaseException)}
    assert defined == {
        "AtomicWriteError", "BatchDimError", "BatchSizeMismatchError", "ClusterAuthError", "CoordinatorAuthenticationError",
        "CoordinatorTimeoutError", "DemoNodeStoppedError", "FileReplacedError", "FileTooShortError", "FormatError", "IndexTypeError", "InPlaceKindError", "InPlaceWriteError", "KeyThroughLeafError", "KeyTypeError", "LockedTensorDictError", "MappingError",
        "NameClashError", "ArgumentGivenTwiceError", "NodeTakenOverError", "NotASaveError", "OwnerLostError", "ReadOnlyError", "SaveChangedError", "SegmentUnavailableError", "SplitSizeError", "StalePair", "StateDictKeysError",
        "StorageFullError", "TransferFailed", "TransferRefused", "TransposeDimError", "UnstorableValueError", "WorkerDiedError", "WorkerTraceback",
    }
    for name in defined:
        assert getattr(shared_td, name) is getattr(errors, name)
        assert name in shared_td.__all__
    for module in _modules():
        outside = _own_exception_classes(module)
        if module.__name__.split(".")[:2] == ["shared_td", "cli"]:
            outside -= CLI_SIGNALS
        assert not outside, f"exception classes of {module.__name__} outside errors.py"


def test_old_import_locations_name_the_same_classes():
    from shared_td.coordinator import CoordinatorTimeoutError
    from shared_td.storage.anonymous import SegmentUnavailableError
    from shared_td.storage.files import FileTooShortError, StorageFullError

    assert CoordinatorTimeoutError is shared_td.CoordinatorTimeoutError
    assert SegmentUnavailableError is shared_td.SegmentUnavailableError
    assert (FileTooShortError, StorageFullError) == (shared_td.FileTooShortError, shared_td.StorageFullError)


def test_an_atomic_write_refused_by_what_the_prefix_holds_is_an_atomic_write_error(tmp_path):
    import torch

    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "precious.txt").write_text("not ours")
    td = shared_td.TensorDict(a=torch.ones(2))
    with pytest.raises(shared_td.AtomicWriteError, match="not a saved tensordict"):
        td.memmap_(tmp_path / "p", atomic=True)
    with pytest.raises(shared_td.AtomicWriteError, match="existsok=False"):
        td.memmap_(tmp_path / "p", atomic=True, existsok=False)
    assert os.listdir(tmp_path / "p") == ["precious.txt"]  # nothing touched
