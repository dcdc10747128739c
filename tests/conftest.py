"""Import paths for the test helper modules, in the test process and in its children.

The tests run with ``--import-mode=importlib``, which puts no test folder on
``sys.path``, yet test modules import sibling helper modules by name
(``import coord_children as kids``, ``from persist_helpers import dir_state``, ...).
Spawn and forkserver children import their target's module by name too, so they need
the same folders, which they get through ``PYTHONPATH``.
"""
from __future__ import annotations

import os
import sys

import pytest

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(TESTS_DIR)

# tests/ and each direct sub-folder holding Python files.
HELPER_DIRS = [TESTS_DIR] + sorted(
    entry.path for entry in os.scandir(TESTS_DIR)
    if entry.is_dir() and any(name.endswith(".py") for name in os.listdir(entry.path))
)

for folder in reversed(HELPER_DIRS):
    if folder not in sys.path:
        sys.path.insert(0, folder)


@pytest.fixture(autouse=True)
def child_import_path(monkeypatch):
    """Children find the helper modules and the repository's package."""
    path = os.pathsep.join([*HELPER_DIRS, REPO_ROOT, os.environ.get("PYTHONPATH", "")])
    monkeypatch.setenv("PYTHONPATH", path.rstrip(os.pathsep))
