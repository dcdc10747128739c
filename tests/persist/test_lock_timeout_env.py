"""SHARED_TD_LOCK_TIMEOUT (audit of session 21, docs finding 4): one reader of the
variable (``writer_lock.lock_timeout``) for the writer lock and the wait for an earlier
background write. A finite number of seconds >= 0, else a ValueError naming the variable
and the value, before any wait (a negative one made filelock wait for ever); messages
show the value as given (``1.5 s``, not ``2 s``)."""
from __future__ import annotations

import time

import filelock
import pytest
import torch

import shared_td
from shared_td.persist import writer_lock
from tests.persist.test_audit18_memmap import hold_background_writes

VARIABLE = "SHARED_TD_LOCK_TIMEOUT"


@pytest.mark.parametrize("value,seconds", [(None, 600.0), ("1.5", 1.5), ("0", 0.0), (" 2 ", 2.0), ("1e1", 10.0)])
def test_lock_timeout_reads_the_variable(value, seconds, monkeypatch):
    if value is None:
        monkeypatch.delenv(VARIABLE, raising=False)
    else:
        monkeypatch.setenv(VARIABLE, value)
    assert writer_lock.lock_timeout() == seconds


@pytest.mark.parametrize("value", ["abc", "-5", "-0.1", "nan", "inf", "-inf"])  # (blank: unset)
def test_lock_timeout_refuses_what_is_no_bound(value, monkeypatch):
    monkeypatch.setenv(VARIABLE, value)
    with pytest.raises(ValueError, match=f"{VARIABLE}={value!r} is not a number of seconds >= 0"):
        writer_lock.lock_timeout()


@pytest.fixture
def held_lock(tmp_path):
    prefix = tmp_path / "p"
    shared_td.TensorDict(a=torch.zeros(2)).memmap_(prefix)
    with filelock.FileLock(tmp_path / ".p.lock"):
        yield prefix


@pytest.mark.parametrize("value", ["-5", "abc"])
def test_an_atomic_writer_refuses_a_bad_value_at_once(value, held_lock, monkeypatch):
    monkeypatch.setenv(VARIABLE, value)
    start = time.monotonic()
    with pytest.raises(ValueError, match=VARIABLE):
        shared_td.TensorDict(a=torch.ones(2)).memmap_(held_lock, atomic=True)
    assert time.monotonic() - start < 5  # "-5" waited for ever in filelock


def test_the_timeout_message_shows_the_value_given(held_lock, monkeypatch):
    monkeypatch.setenv(VARIABLE, "0.3")
    with pytest.raises(TimeoutError, match=r"for more than 0\.3 s"):
        shared_td.TensorDict(a=torch.ones(2)).memmap_(held_lock, atomic=True)


def test_the_wait_for_a_background_write_reads_it_too(tmp_path, monkeypatch):
    release = hold_background_writes(monkeypatch)
    prefix = tmp_path / "p"
    future = shared_td.TensorDict(a=torch.ones(1 << 18)).memmap_(prefix, num_threads=2, return_early=True)
    try:
        monkeypatch.setenv(VARIABLE, "abc")
        with pytest.raises(ValueError, match=f"{VARIABLE}='abc'"):
            shared_td.TensorDict(b=torch.ones(3)).memmap_(prefix)
    finally:
        release.set()
    assert future.result(timeout=30)["a"].shape == (1 << 18,)
