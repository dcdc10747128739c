"""Versioned trees and child processes of the atomic-write tests (tests/persist/test_atomic*.py).

The children are started with the "fork" start method, so torch is imported once, by
the test process. Each child first limits torch to one thread: an OpenMP thread pool
used by the parent does not survive a fork.
"""
from __future__ import annotations

import contextlib
import json
import os
import time
import traceback

import torch

from shared_td import LazyStackedTensorDict, TensorDict, load_memmap
from shared_td.persist import atomic
from shared_td.storage import files

FOREVER = 3600


def build(version: int, mib: int = 0) -> TensorDict:
    """A tree whose every leaf is filled with ``version``, tagged "v<version>".

    mib=0: a small nested tree with a lazy stack (last, so that a load that misses one of
    its members reaches no later entry); mib>0: four float leaves of mib/4 MiB each.
    """
    if mib:
        return TensorDict(
            {**{f"l{i}": torch.full((mib << 16,), float(version)) for i in range(4)}, "tag": f"v{version}"},
            [],
        )
    return TensorDict(
        {
            "a": torch.full((64,), float(version)),
            "nested": {"b": torch.full((3, 2), version, dtype=torch.int64)},
            "tag": f"v{version}",
            "stack": LazyStackedTensorDict(
                *[TensorDict(c=torch.full((2,), version, dtype=torch.int32)) for _ in range(3)]
            ),
        },
        [],
    )


def layout(td) -> dict:
    """key -> (dtype, shape) of every tensor leaf, plus the keys of non-tensor leaves."""
    return {
        key: (value.dtype, tuple(value.shape)) if isinstance(value, torch.Tensor) else "nt"
        for key, value in ((k, td.get(k)) for k in td.keys(include_nested=True, leaves_only=True))
    }


_LAYOUTS: dict = {}


def check(td, mib: int = 0) -> int:
    """The version of ``td`` if it is one complete, uniform build(version, mib); else AssertionError."""
    if mib not in _LAYOUTS:
        _LAYOUTS[mib] = layout(build(0, mib))
    tag = td["tag"]
    assert isinstance(tag, str) and tag.startswith("v"), tag
    version = int(tag[1:])
    assert layout(td) == _LAYOUTS[mib], (layout(td), _LAYOUTS[mib])
    for key in td.keys(include_nested=True, leaves_only=True):
        value = td.get(key)
        if isinstance(value, torch.Tensor):
            assert bool((value == version).all()), (key, version, value.unique()[:4])
    return version


def leftovers(prefix) -> list[str]:
    """The temporary directories of atomic writers beside ``prefix``."""
    parent, name = os.path.split(os.fspath(prefix))
    return sorted(e for e in os.listdir(parent) if e.startswith(f".{name}.shared_td-"))


def report(path, **fields) -> None:
    with open(path, "w") as handle:
        json.dump(fields, handle)


# ------------------------------------------------------------------ child targets
def writer(prefix, versions, mib, out) -> None:
    """Atomic rewrites of ``prefix`` with each version in turn; reports errors to ``out``."""
    torch.set_num_threads(1)
    errors = []
    for version in versions:
        try:
            build(version, mib).memmap_(prefix, atomic=True)
        except BaseException:
            errors.append(traceback.format_exc())
    report(out, errors=errors)


def reader(prefix, mib, stop, out) -> None:
    """load_memmap in a loop until ``stop`` is set; every load must be one complete version."""
    torch.set_num_threads(1)
    loads, errors, seen = 0, [], set()
    while not stop.is_set() or not loads:
        try:
            seen.add(check(load_memmap(prefix), mib))
        except BaseException:
            errors.append(traceback.format_exc())
        loads += 1
    report(out, loads=loads, errors=errors[:5], error_count=len(errors), seen=sorted(seen))


def watch(prefix, stop, out) -> None:
    """Count the times ``prefix`` is not a directory while ``stop`` is unset."""
    checks = missing = 0
    while not stop.is_set():
        checks += 1
        missing += not os.path.isdir(prefix)
    report(out, checks=checks, missing=missing)


def blocking_writer(prefix, version, mib, point, ready) -> None:
    """An atomic rewrite that sets ``ready`` and then blocks forever at ``point``:

    "start": before the write begins (the caller kills it after a delay of its own);
    "write": in the first pwrite of a leaf file;
    "swap": right before swap_into_place (the new tree is complete);
    "exchange": after the exchange, before the old tree is deleted;
    "renames": the fallback without exchange, between its two renames.
    """
    torch.set_num_threads(1)
    td = build(version, mib)

    def block(*args, **kwargs):
        ready.set()
        time.sleep(FOREVER)

    if point == "write":
        files.pwrite_all = block
    elif point == "swap":
        atomic.swap_into_place = block
    elif point == "exchange":
        remove = atomic.remove_tree
        mine = f".shared_td-new-{os.getpid()}-"
        atomic.remove_tree = lambda path: block() if mine in path else remove(path)
    elif point == "renames":
        rename, target = os.rename, os.path.abspath(prefix)
        atomic.rename_exchange = lambda first, second: False
        os.rename = lambda src, dst: (rename(src, dst), block() if src == target else None)
    if point == "start":
        ready.set()
    td.memmap_(prefix, atomic=True)
    time.sleep(FOREVER)  # "start": the caller kills us, finished or not


def write_at_descriptor_limit(prefix, spare, out) -> None:
    """An atomic rewrite when only ``spare`` more descriptors can be opened: reports
    the error (if any), its notes, and the temporary directories beside prefix while
    this process still runs (its own included)."""
    torch.set_num_threads(1)
    error = notes = None
    with descriptor_limit(spare):
        try:
            build(9).memmap_(prefix, atomic=True)
        except BaseException as caught:
            error, notes = repr(caught), getattr(caught, "__notes__", [])
    report(out, error=error, notes=notes, leftovers=leftovers(prefix))


def remove_at_descriptor_limit(path, spare, out) -> None:
    """atomic.remove_tree(path) when only ``spare`` more descriptors can be opened."""
    error = None
    with descriptor_limit(spare):
        try:
            atomic.remove_tree(path)
        except BaseException as caught:
            error = repr(caught)
    report(out, error=error, exists=os.path.lexists(path))


@contextlib.contextmanager
def descriptor_limit(spare: int):
    """RLIMIT_NOFILE lowered so that only ``spare`` more descriptors can be opened."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # new descriptors take the lowest free numbers below the limit: put the limit at the
    # (spare + 1)-th free number, so that exactly ``spare`` more can be opened
    limit, free = 0, 0
    while _is_open(limit) or free < spare:
        free += not _is_open(limit)
        limit += 1
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def as_nobody(action, directory, out) -> None:
    """Run ``action()`` in ``directory`` as the unprivileged user nobody (root bypasses
    file modes) and report its result or its error. The report file is opened and the
    directory entered first, so that its ancestors need not be open to nobody (pytest's
    temporary directories are not); ``action`` uses paths relative to it."""
    import pwd

    torch.set_num_threads(1)
    nobody = pwd.getpwnam("nobody")
    with open(out, "w") as handle:
        os.chdir(directory)
        os.setgroups([])
        os.setgid(nobody.pw_gid)
        os.setuid(nobody.pw_uid)
        try:
            fields = {"result": action(), "error": None}
        except BaseException as caught:
            fields = {"result": None, "error": repr(caught)}
        json.dump(fields, handle)


def with_umask(umask, action, out) -> None:
    """Run ``action()`` under ``umask`` (in a child: the umask is per process)."""
    torch.set_num_threads(1)
    os.umask(umask)
    try:
        report(out, result=action(), error=None)
    except BaseException:
        report(out, result=None, error=traceback.format_exc())
