"""Import paths for the tests and their helper modules, in the test process and in its
children.

``tests/`` and its sub-folders are packages, and every module of them is imported by its
dotted name from the repository root: ``from tests import processes``,
``from tests.persist import atomic_children as kids``,
``from tests.persist.persist_helpers import dir_state``. The tests run with
``--import-mode=importlib``, which puts nothing on ``sys.path``, so the repository root
is put there once, here; spawn and forkserver children import their target's module by
that same name (it is what gets pickled) and find it through ``PYTHONPATH``.
"""
from __future__ import annotations

import os
import sys

import pytest

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(TESTS_DIR)

if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)


@pytest.fixture(autouse=True)
def child_import_path(monkeypatch):
    """Children find the test packages and the repository's shared_td."""
    path = os.pathsep.join([REPO_ROOT, os.environ.get("PYTHONPATH", "")])
    monkeypatch.setenv("PYTHONPATH", path.rstrip(os.pathsep))
