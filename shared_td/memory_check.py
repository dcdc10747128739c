"""The memory check: how much more memory this process can take before the OOM killer
ends some process, and the refusal of anonymous memory (a memfd made or grown) bigger
than that, before any byte is reserved.

A memfd has no size limit of its own: reserving more than the memory fills RAM (then
swap) until the OOM killer ends some process, possibly another one. What is available is
``MemAvailable + SwapFree`` of ``/proc/meminfo`` or, under a cgroup's memory limit, that
cgroup's room: its limit less its usage, plus its file cache (reclaimable), plus its swap
room (past its limit the kernel swaps the cgroup's pages out rather than kill).

Torch-free, and imports nothing of shared_td: :mod:`shared_td.platform` loads it by path
when it is loaded alone (the coordinator's manager process, see
:mod:`shared_td.coordinator.server`).
"""
from __future__ import annotations

import errno
import os

__all__ = ["check_growth", "check_memory_room", "memory_room"]

# Smaller reservations are not checked (reading /proc costs ~20 us a segment): they ask
# no more than any allocation of the process does.
_CHECKED_SIZE = 1 << 24


def check_growth(nbytes: int) -> None:
    """:func:`check_memory_room` for ``nbytes`` more of anonymous memory (a memfd made or
    grown), if that is big enough to be worth the check (``_CHECKED_SIZE``)."""
    if nbytes >= _CHECKED_SIZE:
        check_memory_room(nbytes)


def check_memory_room(nbytes: int) -> None:
    """An ``OSError`` ``ENOMEM`` naming ``nbytes`` and the memory available when ``nbytes``
    more bytes cannot be had without the OOM killer: more than :func:`memory_room`.

    Example:
        >>> check_memory_room(1)
        >>> check_memory_room(1 << 62)
        Traceback (most recent call last):
        ...
        OSError: [Errno 12] Not enough memory for 4611686018427387904 bytes (4294967296.0 GiB) ...
    """
    room, why = memory_room()
    if nbytes > room:
        raise OSError(errno.ENOMEM, (
            f"Not enough memory for {nbytes} bytes ({nbytes / 2**30:.1f} GiB) of shared memory: "
            f"{room} bytes ({room / 2**30:.1f} GiB) are available ({why})"))


def memory_room() -> tuple[int, str]:
    """``(bytes, how they were found)``: how much more memory this process can take:
    ``MemAvailable + SwapFree`` of ``/proc/meminfo``, or less under a cgroup's limit.

    Example:
        >>> room, why = memory_room(); room > 0, why.startswith("MemAvailable ")
        (True, True)
    """
    fields = {}
    with open("/proc/meminfo") as source:
        for line in source:
            name, _, value = line.partition(":")
            fields[name] = int(value.split()[0]) * 1024
    available, swap = fields.get("MemAvailable", fields.get("MemFree", 0)), fields.get("SwapFree", 0)
    room, why = available + swap, f"MemAvailable {available} + SwapFree {swap}"
    limited = _cgroup_room(swap)
    if limited is not None and limited[0] < room:
        return limited[0], f"{why}; {limited[1]}"
    return room, why


def _cgroup_room(swap_free: int = 0) -> tuple[int, str] | None:
    """``(bytes, text)``: the room under the tightest memory limit of this process's
    cgroup and its ancestors (v2 ``memory.max``, v1 ``memory.limit_in_bytes``), usage
    less the file cache the kernel can reclaim, plus the swap room of that cgroup (at
    most ``swap_free``, the system's: see :func:`_cgroup_level`); None without a limit."""
    try:
        with open("/proc/self/cgroup") as source:
            lines = [line.split(":", 2) for line in source.read().splitlines()]
    except OSError:
        return None
    tightest = None
    for _, controllers, path in lines:
        if controllers == "":  # v2
            base, names = "/sys/fs/cgroup", ("memory.max", "memory.current", "")
        elif "memory" in controllers.split(","):
            base, names = "/sys/fs/cgroup/memory", ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_")
        else:
            continue
        directory = os.path.normpath(base + path)
        while directory.startswith(base):
            found = _cgroup_level(directory, *names, swap_free=swap_free)
            if found is not None and (tightest is None or found < tightest[0]):
                tightest = (found, f"the memory limit of cgroup {directory} (and its swap room)")
            directory = "" if directory == base else os.path.dirname(directory)
    return tightest


def _cgroup_level(directory: str, limit_name: str, usage_name: str, prefix: str,
                  swap_free: int = 0) -> int | None:
    """Room under the memory limit of one cgroup ``directory``; None without one.

    Past its limit the kernel swaps the cgroup's pages out rather than kill, so its swap
    room counts too, at most ``swap_free``: v2 ``memory.swap.max - memory.swap.current``,
    v1 ``memory.memsw.limit_in_bytes - memory.memsw.usage_in_bytes`` less the memory part
    (memsw counts memory and swap together); without these files (no swap accounting)
    the cgroup's swap is not limited: ``swap_free``."""
    try:
        limit = _cgroup_number(directory, limit_name)
        if limit is None:
            return None
        usage = _cgroup_number(directory, usage_name)
        with open(os.path.join(directory, "memory.stat")) as source:
            cache = sum(int(line.split()[1]) for line in source
                        if line.split()[0] in (prefix + "active_file", prefix + "inactive_file"))
        swap_names = ("memory.memsw.limit_in_bytes", "memory.memsw.usage_in_bytes") if prefix else \
            ("memory.swap.max", "memory.swap.current")
        swap = swap_free
        try:
            swap_limit = _cgroup_number(directory, swap_names[0])
        except OSError:
            swap_limit = None  # no swap accounting: not limited here
        if swap_limit is not None:
            try:
                swap_usage = _cgroup_number(directory, swap_names[1])
            except OSError:
                swap_usage = 0
            # v1: memsw's room is memory's and swap's together
            swap = swap_limit - swap_usage - (limit - usage if prefix else 0)
    except (OSError, ValueError, IndexError, TypeError):
        return None
    return max(limit - usage + cache, 0) + max(min(swap, swap_free), 0)


def _cgroup_number(directory: str, name: str) -> int | None:
    """The number in the cgroup file ``name``; None for no limit ("max" in v2, ~2**63 in v1)."""
    with open(os.path.join(directory, name)) as source:
        value = source.read().strip()
    return None if value == "max" or int(value) >= 1 << 62 else int(value)
