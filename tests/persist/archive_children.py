"""Helpers and child-process targets of the archive tests (tests/persist/test_archive*.py,
tests/interop/test_archive_interop.py)."""
from __future__ import annotations

import os
import resource
import traceback

import torch

from tests.persist.atomic_children import build, report

import shared_td
from shared_td import TensorDict


def save_forever(path, first_version, mib, ready) -> None:
    """Save build(version, mib) to the archive ``path``, version after version, until
    killed; ``ready`` is set once the first save has started."""
    torch.set_num_threads(1)
    version = first_version
    ready.set()
    while True:
        build(version, mib).save(path)
        version += 1


def save_under_file_size_limit(path, version, mib, limit, out) -> None:
    """Save build(version, mib) to ``path`` with RLIMIT_FSIZE at ``limit`` bytes;
    reports the error's type and text (or None) to ``out``."""
    torch.set_num_threads(1)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
    try:
        build(version, mib).save(path)
    except BaseException as error:
        report(out, error=type(error).__name__, text=str(error), trace=traceback.format_exc())
        return
    report(out, error=None, text="")


def write_through_pickled_leaf(leaf, value) -> None:
    """Fill a leaf received by pickle (a view of an archive loaded with mode="r+")."""
    torch.set_num_threads(1)
    leaf.fill_(value)


def read_pickled_leaf(leaf, queue) -> None:
    queue.put(leaf.tolist())


def load_in_child(path, queue) -> None:
    """Load the archive ``path`` and send back its "a" leaf as a list."""
    queue.put(shared_td.load_memmap(path)["a"].tolist())


def save_blocked_mid_write(path, version, mib, ready) -> None:
    """Save build(version, mib) to ``path`` but stop forever inside the write of its
    second member (``ready`` set then), to be SIGKILLed there."""
    import time

    from shared_td.persist import archive_write

    torch.set_num_threads(1)
    real, calls = archive_write._write_member, []

    def blocking(*args):
        calls.append(args[1])
        if len(calls) == 2:
            ready.set()
            time.sleep(3600)
        return real(*args)

    archive_write._write_member = blocking
    build(version, mib).save(path)


# ------------------------------------------------------------------ helpers
def saved_archive(tmp_path, name="t.tdz", **kwargs):
    """A small nested TensorDict saved as the archive ``tmp_path / name``."""
    path = tmp_path / name
    TensorDict(a=torch.arange(4.0), n=TensorDict(b=torch.ones(2)), batch_size=[]).save(path, **kwargs)
    return path


def maps_of(path) -> list[tuple[int, int]]:
    """Address ranges of this process's mappings of the file ``path`` (/proc/self/maps)."""
    st = os.stat(path)
    found = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 6 and int(fields[4]) == st.st_ino:
                start, end = (int(x, 16) for x in fields[0].split("-"))
                found.append((start, end))
    return found


def inside(tensor, ranges) -> bool:
    return any(start <= tensor.data_ptr() < end for start, end in ranges)


def unpickle_and_report(data: bytes, queue) -> None:
    """Unpickle ``data`` (a pickled tensordict) and report its leaf "a", or the error."""
    import pickle

    try:
        queue.put(("read", pickle.loads(data)["a"].tolist()))
    except Exception as error:  # noqa: BLE001 - reported to the test
        queue.put((type(error).__name__, str(error)))
