"""Bounded waits on child processes, for the multi-process tests.

A helper module, not a test (pytest collects only test_*.py); imported by name through
the sys.path that tests/conftest.py sets up.
"""
from __future__ import annotations

import pytest

WAIT = 30  # seconds: the bound on every join / queue read


def finish(process, timeout: float = WAIT) -> int:
    """Join ``process`` within ``timeout`` seconds and return its exit code; a process
    still alive then is killed and the test fails."""
    process.join(timeout)
    if process.is_alive():
        process.kill()
        process.join(timeout)
        pytest.fail("child process hung")
    return process.exitcode
