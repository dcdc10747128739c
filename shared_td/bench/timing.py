"""Measuring: best-of timing, fresh directories, the raw OS reference, the machine.

Examples:
    >>> best_of(3, lambda: [3, 1, 2], sorted) < 1.0
    True
"""
from __future__ import annotations

import contextlib
import gc
import os
import platform
import shutil
import statistics
import tempfile
import time
from typing import Callable, Iterator

import torch


def best_of(repeat: int, setup: Callable[[], object], run: Callable[[object], object]) -> float:
    """Best wall time of ``run(setup())`` over ``repeat`` runs (setup is not timed).

    The best run is the least disturbed one: on a shared machine noise only adds time.
    As ``timeit`` does, the garbage collector is off while ``run`` is timed (and what the
    previous run left is collected before), so that a collection of another variant's
    garbage does not fall into this one's time.
    """
    times = []
    for _ in range(repeat):
        state = setup()
        gc.collect()
        gc.disable()
        try:
            start = time.perf_counter()
            run(state)
            times.append(time.perf_counter() - start)
        finally:
            gc.enable()
    return min(times)


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """The objects made so far (torch's, tensordict's: ~0.3 s per full collection on 2
    cores) out of the garbage collector's reach meanwhile, so that the collection before
    each timed run (best_of) scans only what the runs made. Nested: an inner one freezes
    the objects made since, and the outermost unfreezes them all."""
    outermost = gc.get_freeze_count() == 0
    gc.freeze()
    try:
        yield
    finally:
        if outermost:
            gc.unfreeze()


def best_of_each(repeat: int, variants: dict[str, tuple[Callable, Callable]]) -> dict[str, float]:
    """Best wall time of each ``name: (setup, run)`` variant, the variants taking turns
    in a rotating order, so that a slow phase of the machine (page-cache writeback,
    another job) does not fall on one of them only.

    Example:
        >>> times = best_of_each(2, {"sort": (lambda: [2, 1], sorted), "max": (lambda: [2, 1], max)})
        >>> list(times) == ["sort", "max"] and all(t < 1.0 for t in times.values())
        True
    """
    names = list(variants)
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(repeat):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            setup, run = variants[name]
            times[name].append(best_of(1, setup, run))
    return {name: min(times[name]) for name in names}


def paired_medians(rounds: int, calls: dict[str, Callable[[], object]]) -> dict[str, float]:
    """Median wall time of one call of each ``name: call``, the calls alternating one by
    one (in a rotating order) over ``rounds`` rounds.

    For round trips of tens of microseconds: their times are bimodal on a shared machine
    (a wake-up of the peer's thread costs 20-60 us, or nothing), and a batch of one
    variant timed after a batch of the other met another phase of the machine (a raw
    ``TCPStore.add`` measured 19 us in one batch and 78 us in the next, with the cluster
    counter in between at 64 and 86 us): side by side call by call, both meet the same
    phases, and the median is the typical call.

    Example:
        >>> times = paired_medians(20, {"sort": lambda: sorted([2, 1]), "max": lambda: max([2, 1])})
        >>> list(times) == ["sort", "max"] and all(t < 1.0 for t in times.values())
        True
    """
    names = list(calls)
    times: dict[str, list[int]] = {name: [] for name in names}
    clock = time.perf_counter_ns
    for round_ in range(rounds):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            call = calls[name]
            start = clock()
            call()
            times[name].append(clock() - start)
    return {name: statistics.median(times[name]) / 1e9 for name in names}


def fresh_dir(root: str) -> Callable[[], str]:
    """A new, not yet existing directory under ``root`` at each call; the one handed out
    before is removed then (outside the timed part), so that the disk and the page
    cache do not fill up over the runs."""
    counter = iter(range(10**9))
    previous: list[str] = []
    # names of this sequence only: another case's sequence under the same root leaves
    # its last directory behind (a full run's tree_to_files met big_leaf's run24)
    base = tempfile.mkdtemp(prefix="runs", dir=root)

    def next_dir() -> str:
        for old in previous:
            shutil.rmtree(old, ignore_errors=True)
        previous[:] = [os.path.join(base, f"run{next(counter)}")]
        return previous[0]

    return next_dir


def raw_write(data: memoryview) -> Callable[[str], None]:
    """The OS reference: os.write of the same bytes into a new file."""

    def write(path: str) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = data
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)

    return write


def open_fds() -> int:
    """File descriptors this process holds (Linux)."""
    return len(os.listdir("/proc/self/fd"))


def describe_machine(root: str) -> str:
    """CPU, cores, versions and the filesystem of ``root``: what the numbers depend on."""
    fs = "?"
    try:
        with open("/proc/mounts") as mounts:
            best = ""
            for line in mounts:
                _, mount_point, kind = line.split()[:3]
                if root.startswith(mount_point) and len(mount_point) >= len(best):
                    best, fs = mount_point, kind
    except OSError:
        pass
    return (
        f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"torch {torch.__version__}, files on {fs} ({root})"
    )
