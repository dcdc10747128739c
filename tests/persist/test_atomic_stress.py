"""atomic=True against real processes and real signals: writers SIGKILLed at random
moments and at fixed points of a large rewrite, and many processes rewriting one prefix
while others load it. Children are forked from the test process (see atomic_children).

The many-process stress test runs bounded by default; SHARED_TD_STRESS=1 runs the long
version (marked `stress`).
"""
from __future__ import annotations

import json
import multiprocessing
import os
import random
import shutil
import time

import pytest

from tests.persist import atomic_children as kids
from tests.persist.persist_helpers import dir_state

import shared_td
from shared_td import load_memmap

FORK = multiprocessing.get_context("fork")
STRESS = os.environ.get("SHARED_TD_STRESS") == "1"
BIG_MIB = 64  # the tree rewritten under SIGKILL: four 16 MiB leaves
JOIN = 60


@pytest.fixture
def place(tmp_path):
    """prefix in tmp/data, with neighbours that no writer or gc of prefix may touch:
    a saved sibling, a dead writer's leftover of that sibling, and a directory outside."""
    data, outside = tmp_path / "data", tmp_path / "outside"
    kids.build(5).memmap(data / "other")
    dead = FORK.Process(target=os._exit, args=(0,))
    dead.start()
    dead.join()
    (data / f".other.shared_td-new-{dead.pid}-x").mkdir()
    kids.build(6).memmap(outside / "p")
    (outside / f".p.shared_td-new-{dead.pid}-y").mkdir()
    neighbours = {"data": dir_state(data), "outside": dir_state(outside)}
    yield data / "p"
    state = dir_state(data)
    for name in list(state):
        if name == "p" or name.startswith("p" + os.sep) or name == ".p.lock":
            del state[name]
    assert state == neighbours["data"]
    assert dir_state(outside) == neighbours["outside"]


def kill(process) -> None:
    process.kill()
    process.join(JOIN)
    assert process.exitcode == -9


def assert_clean(prefix, version, mib=0) -> None:
    """prefix holds ``version`` and nothing of a writer is left beside it."""
    assert kids.leftovers(prefix) == []
    assert os.path.exists(prefix.parent / ".p.lock")
    assert kids.check(load_memmap(prefix), mib) == version


def clean_up(prefix, how, version, mib) -> int:
    """Remove a dead writer's leftovers by gc or by the next atomic write; the version at prefix."""
    if how == "gc":
        assert shared_td.gc(prefix) and kids.leftovers(prefix) == []
        return kids.check(load_memmap(prefix), mib)
    kids.build(version, mib).memmap_(prefix, atomic=True)
    return version


# ----------------------------------------------------------------- SIGKILL
def test_sigkill_at_random_moments_of_a_large_rewrite(place):
    prefix, rng, current = place, random.Random(1234), 1
    kids.build(current, BIG_MIB).memmap_(prefix, atomic=True)
    outcomes = []
    for round_ in range(6):
        new, ready = current + 1, FORK.Event()
        child = FORK.Process(target=kids.blocking_writer, args=(str(prefix), new, BIG_MIB, "start", ready))
        child.start()
        assert ready.wait(JOIN)
        delay = rng.uniform(0, 0.25)
        time.sleep(delay)
        kill(child)
        found = kids.check(load_memmap(prefix), BIG_MIB)  # complete, old or new: nothing else
        assert found in (current, new), (round_, delay, found)
        outcomes.append(found == new)
        current = found
        if kids.leftovers(prefix):
            current = clean_up(prefix, "gc" if round_ % 2 else "write", current + 10, BIG_MIB)
        assert_clean(prefix, current, BIG_MIB)
    assert len(outcomes) == 6


@pytest.mark.parametrize("how", ["gc", "write"])
@pytest.mark.parametrize(
    "point, survivor", [("write", "old"), ("swap", "old"), ("exchange", "new"), ("renames", "old")]
)
def test_sigkill_at_fixed_points(place, point, survivor, how):
    prefix, mib = place, 8
    kids.build(1, mib).memmap_(prefix, atomic=True)
    ready = FORK.Event()
    child = FORK.Process(target=kids.blocking_writer, args=(str(prefix), 2, mib, point, ready))
    child.start()
    assert ready.wait(JOIN), point
    kill(child)
    assert kids.leftovers(prefix)
    if point == "renames":  # the fallback's missing window: the old tree waits beside
        assert not os.path.exists(prefix)
    else:
        assert kids.check(load_memmap(prefix), mib) == {"old": 1, "new": 2}[survivor]
    if how == "gc":
        assert_clean(prefix, clean_up(prefix, how, 0, mib), mib)
        assert kids.check(load_memmap(prefix), mib) == {"old": 1, "new": 2}[survivor]
    else:
        assert_clean(prefix, clean_up(prefix, how, 3, mib), mib)


# ----------------------------------------------------------------- stress
def run_stress(tmp_path, writers: int, rewrites: int, readers: int, mib: int = 0) -> None:
    """``writers`` processes each rewrite prefix ``rewrites`` times (version w*1000+i, every
    leaf filled with it) while ``readers`` processes load it in a loop."""
    prefix = tmp_path / "p"
    kids.build(0, mib).memmap_(prefix, atomic=True)
    stop = FORK.Event()
    versions = {w: [w * 1000 + i for i in range(rewrites)] for w in range(1, writers + 1)}
    procs = [
        FORK.Process(target=kids.reader, args=(str(prefix), mib, stop, tmp_path / f"r{r}.json"))
        for r in range(readers)
    ] + [
        FORK.Process(target=kids.writer, args=(str(prefix), versions[w], mib, tmp_path / f"w{w}.json"))
        for w in versions
    ]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + (600 if STRESS else 120)
    try:
        for proc in procs[readers:]:
            proc.join(max(1, deadline - time.monotonic()))
    finally:
        stop.set()
        for proc in procs:
            proc.join(max(1, deadline - time.monotonic()))
            if proc.exitcode is None:
                proc.kill()
    assert [p.exitcode for p in procs] == [0] * len(procs)
    for w in versions:
        assert json.loads((tmp_path / f"w{w}.json").read_text())["errors"] == []
    all_versions = {0} | {v for vs in versions.values() for v in vs}
    for r in range(readers):
        result = json.loads((tmp_path / f"r{r}.json").read_text())
        assert result["error_count"] == 0, result["errors"]
        assert result["loads"] > 0 and set(result["seen"]) <= all_versions
    # the last swap was some writer's last rewrite, complete: the very files a save writes
    final = kids.check(load_memmap(prefix), mib)
    assert final in {vs[-1] for vs in versions.values()}
    reference = tmp_path.parent / f"{tmp_path.name}-reference"
    kids.build(final, mib).memmap(reference)
    assert dir_state(prefix) == dir_state(reference)
    shutil.rmtree(reference)
    assert sorted(os.listdir(tmp_path)) == sorted(
        [".p.lock", "p"] + [f"r{r}.json" for r in range(readers)] + [f"w{w}.json" for w in versions]
    )


def test_stress_bounded(tmp_path):
    start = time.monotonic()
    run_stress(tmp_path, writers=4, rewrites=12, readers=2)
    assert time.monotonic() - start < 60


@pytest.mark.stress
@pytest.mark.timeout(900)
@pytest.mark.skipif(not STRESS, reason="long stress test: set SHARED_TD_STRESS=1")
def test_stress_long(tmp_path):
    run_stress(tmp_path, writers=8, rewrites=25, readers=2)
    run_stress(tmp_path / "big", writers=4, rewrites=5, readers=2, mib=16)
