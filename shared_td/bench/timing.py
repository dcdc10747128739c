"""Measuring: best-of timing, fresh directories, the raw OS reference, the machine.

Examples:
    >>> best_of(3, lambda: [3, 1, 2], sorted) < 1.0
    True
"""
from __future__ import annotations

import os
import platform
import time
from typing import Callable

import torch


def best_of(repeat: int, setup: Callable[[], object], run: Callable[[object], object]) -> float:
    """Best wall time of ``run(setup())`` over ``repeat`` runs (setup is not timed).

    The best run is the least disturbed one: on a shared machine noise only adds time.
    """
    times = []
    for _ in range(repeat):
        state = setup()
        start = time.perf_counter()
        run(state)
        times.append(time.perf_counter() - start)
    return min(times)


def fresh_dir(root: str) -> Callable[[], str]:
    """A new, not yet existing directory under ``root`` at each call."""
    counter = iter(range(10**9))
    return lambda: os.path.join(root, f"run{next(counter)}")


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
