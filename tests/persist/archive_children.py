"""Child-process targets of the archive tests (tests/persist/test_archive.py)."""
from __future__ import annotations

import resource
import traceback

import torch

from tests.persist.atomic_children import build, report

import shared_td


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
