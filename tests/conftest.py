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
import pathlib
import shutil
import sys
import tempfile

import pytest

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(TESTS_DIR)

if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

# torch's TCPStore client names each connection it makes by a reverse DNS lookup of the
# store's address taken as IPv4-mapped IPv6 (::ffff:127.0.0.1), which /etc/hosts does not
# answer; the CI machine's resolver drops about one such query in 60-100, and glibc waits
# 5 s for it (strace: one PTR query per connect; measured: one connect in 60-100 to a
# loopback store took 5.0 s, and the tests waited for those in 28 of their slowest 120
# phases). The lookup only names the peer in torch's log lines, so one try of 1 s is
# plenty here. Set before anything resolves; children inherit it; a value already set is
# kept. (The README's "Across machines" says the same to users.)
os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")


@pytest.fixture(autouse=True)
def child_import_path(monkeypatch):
    """Children find the test packages and the repository's shared_td."""
    path = os.pathsep.join([REPO_ROOT, os.environ.get("PYTHONPATH", "")])
    monkeypatch.setenv("PYTHONPATH", path.rstrip(os.pathsep))


@pytest.fixture
def short_tmp_path():
    """A private directory directly in the system's temp directory, for a test that gives
    it to processes as their TMPDIR: a coordinator's Unix socket lives there and its path
    may have 107 bytes, which pytest's ``tmp_path`` can exceed (under pytest-xdist its
    worker's ``popen-gwN/`` level made 9 tests fail with ENAMETOOLONG). Removed after the
    test."""
    path = tempfile.mkdtemp(prefix="std-test-")
    yield pathlib.Path(path)
    shutil.rmtree(path, ignore_errors=True)
