"""shared_td.SharedCounter: atomic fetch_add across real fork, spawn and multiprocess
processes (with threads inside each), pickling by reference, bad input, descriptors.

Every join and queue read is bounded, so a hung child fails the test instead of the run.
"""
from __future__ import annotations

import gc
import multiprocessing
import os
import pickle
import queue as queue_module

import multiprocess
import numpy as np
import pytest
import torch

from tests.storage import counter_children as kids
from tests.leakcheck import this_process_in_shm
from tests.processes import finish

from shared_td import SharedCounter
from shared_td.storage import counter as counter_module

pytestmark = pytest.mark.timeout(120)
WAIT = 60  # seconds: the bound on every join / queue read


def test_fetch_add_returns_the_old_value():
    counter = SharedCounter()
    assert counter.value == 0
    assert counter.fetch_add() == 0
    assert counter.fetch_add(10) == 1
    assert counter.fetch_add(-4) == 11
    assert counter.fetch_add(0) == 7 and counter.value == 7
    assert SharedCounter(-5).value == -5
    assert repr(SharedCounter(3)) == "SharedCounter(value=3)"


def test_integer_like_input_is_accepted():
    counter = SharedCounter(np.int64(2))
    assert counter.fetch_add(np.int32(3)) == 2
    assert counter.fetch_add(torch.tensor(5)) == 5
    assert counter.value == 10 and type(counter.value) is int


@pytest.mark.parametrize("bad", [1.0, 1.5, "1", None, True, torch.tensor(1.0), [1]])
def test_non_integers_are_refused_and_change_nothing(bad):
    counter = SharedCounter(4)
    with pytest.raises(TypeError, match="must be an int"):
        counter.fetch_add(bad)
    with pytest.raises(TypeError, match="must be an int"):
        SharedCounter(bad)
    assert counter.value == 4


def test_int64_overflow_is_refused_and_changes_nothing():
    top = 2**63 - 1
    counter = SharedCounter(top - 1)
    assert counter.fetch_add(1) == top - 1
    with pytest.raises(OverflowError, match="int64"):
        counter.fetch_add(1)
    assert counter.value == top
    with pytest.raises(OverflowError, match="int64"):
        SharedCounter(2**63)
    bottom = SharedCounter(-(2**63))
    with pytest.raises(OverflowError):
        bottom.fetch_add(-1)
    assert bottom.value == -(2**63)


def test_pickles_by_reference():
    counter = SharedCounter(5)
    blob = pickle.dumps(counter)
    assert b"\x05\x00\x00\x00\x00\x00\x00\x00" not in blob  # the value is not in it
    # one object per segment per process, so one thread lock guards it
    assert pickle.loads(blob) is counter
    assert multiprocess.reduction.ForkingPickler.loads(
        multiprocess.reduction.ForkingPickler.dumps(counter)) is counter


def test_one_descriptor_nothing_in_dev_shm_closed_when_collected():
    gc.collect()  # (earlier tests' garbage holding descriptors would be freed in the count)
    fds_before = len(os.listdir("/proc/self/fd"))
    shm_before = this_process_in_shm()
    counter = SharedCounter()
    assert len(os.listdir("/proc/self/fd")) == fds_before + 1
    assert this_process_in_shm() == shm_before
    del counter
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) == fds_before


def hammer(ctx, processes=3, calls=1500, threads=2):
    """Processes x threads reserve random-sized ranges at once; returns the reservations
    and the counter."""
    counter = SharedCounter(100)
    queue = ctx.Queue()
    children = [ctx.Process(target=kids.reserve_many, args=(counter, calls, threads, seed, queue))
                for seed in range(processes)]
    for child in children:
        child.start()
    reports = [queue.get(timeout=WAIT) for _ in children]
    for child in children:
        assert finish(child, WAIT) == 0
    assert all(status == "ok" for status, _ in reports), reports
    reservations = [r for _, rs in reports for r in rs]
    assert len(reservations) == processes * threads * calls
    return reservations, counter


@pytest.mark.parametrize("ctx", [
    multiprocessing.get_context("fork"),
    multiprocessing.get_context("spawn"),
    multiprocess.get_context("spawn"),
], ids=["fork", "spawn", "multiprocess-spawn"])
def test_concurrent_processes_get_every_slot_exactly_once(ctx):
    reservations, counter = hammer(ctx)
    slots = [start + i for start, n in reservations for i in range(n)]
    # exactly once: no slot twice, none skipped between the start and the final value
    assert len(slots) == len(set(slots))
    assert sorted(slots) == list(range(100, counter.value))


def test_fork_while_another_thread_holds_the_lock():
    counter = SharedCounter()
    queue = multiprocessing.get_context("fork").Queue()
    with counter._lock.threads:  # as if a thread were entering fetch_add at the fork
        child = multiprocessing.get_context("fork").Process(target=kids.add_one, args=(counter, queue))
        child.start()
        assert queue.get(timeout=WAIT) == 0
    assert finish(child, WAIT) == 0
    assert counter.value == 1


def test_a_fork_child_does_not_share_the_lock_its_parent_holds():
    """The child takes its own open-file-description lock: a lock the parent holds at
    the fork (a thread inside fetch_add) excludes it until released."""
    counter = SharedCounter()
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    with counter._lock.hold():
        child = ctx.Process(target=kids.add_one, args=(counter, queue))
        child.start()
        with pytest.raises(queue_module.Empty):
            queue.get(timeout=0.5)
    assert queue.get(timeout=WAIT) == 0
    assert finish(child, WAIT) == 0
    assert counter.value == 1


def test_two_handles_in_one_process_share_one_lock():
    counter = SharedCounter()
    segment = counter._segment
    other = counter_module._attach(os.getpid(), segment.fd, segment.key)
    assert other is counter
