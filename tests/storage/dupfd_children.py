"""Child-process targets and DataLoader pieces for test_segment_dupfd.py: senders that
drop an anonymous segment before its receiver reads it, and a receiver counting its own
descriptors.

Imported as ``tests.storage.dupfd_children`` (see tests/conftest.py), so that spawn
children and spawn DataLoader workers find these by name.
"""
from __future__ import annotations

import gc
import os
import weakref

import torch

WAIT = 30  # seconds: the bound on every queue read


def library(name: str):
    if name == "tensordict":
        import tensordict
        return tensordict
    import shared_td
    return shared_td


def anonymous_trees(name: str, value: float) -> dict:
    """A ``consolidate(share_memory=True)`` tree and an anonymous ``memmap_()`` tree, both
    holding ``value`` at "a" (4 elements) and "b" (one nested leaf)."""
    lib = library(name)

    def tree():
        return lib.TensorDict({"a": torch.full((4,), value), "n": {"b": torch.full((2,), value)}}, [])

    return {"consolidated": tree().consolidate(share_memory=True), "memmap": tree().memmap_()}


def _segments(trees: dict) -> list:
    """Weak references to the shared_td segments under ``trees`` (none for tensordict)."""
    found = []
    for tree in trees.values():
        for leaf in tree.values(True, True):
            backing = getattr(leaf, "_backing", None)
            if backing is not None and not any(ref() is backing for ref in found):
                found.append(weakref.ref(backing))
    return found


def send_and_drop(name: str, queue, events, done) -> None:
    """Put both anonymous trees on ``queue``, drop them once pickled, say so on
    ``events`` (with whether every segment of this process was freed), stay alive until
    ``done`` says go."""
    trees = anonymous_trees(name, 7.0)
    refs = _segments(trees)
    queue.put(trees)
    del trees
    queue.close()
    queue.join_thread()  # pickled and written: the queue's buffer holds the trees no more
    gc.collect()
    events.put(("dropped", all(ref() is None for ref in refs)))
    done.get(timeout=WAIT)


def send_and_keep(queue, events, done) -> None:
    """Put one anonymous ``memmap_()`` tree on ``queue`` twice (two pickles of one segment),
    keep it, and once ``done`` says so report on ``events`` what its "a" holds then."""
    import shared_td
    tree = shared_td.TensorDict({"a": torch.zeros(4)}, []).memmap_()
    queue.put(tree)
    queue.put(tree)
    done.get(timeout=WAIT)
    events.put(tree["a"].tolist())


def receive_many(queue, events, count: int) -> None:
    """Receive ``count`` trees (each in a new segment), drop each, and report this
    process's descriptors before the first and after the last, and the values seen."""
    first = queue.get(timeout=WAIT)
    values = [first["a"][0].item()]
    del first
    gc.collect()
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(count - 1):
        tree = queue.get(timeout=WAIT)
        values.append(tree["a"][0].item())
        del tree
    gc.collect()
    events.put((before, len(os.listdir("/proc/self/fd")), values))


class AnonymousSamples(torch.utils.data.Dataset):
    """Item ``i`` is a tree holding ``i``, in an anonymous segment of the worker: a
    ``consolidate(share_memory=True)`` one or a ``memmap_()`` one (``kind``)."""

    def __init__(self, kind: str, length: int = 4):
        self.kind = kind
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int):
        return anonymous_trees("shared_td", float(index))[self.kind]


def first(samples: list):
    """A collate_fn that keeps the worker's own sample (no copy into a new batch)."""
    return samples[0]


def send_counter_and_drop(queue, events, done) -> None:
    """Put a SharedCounter at 5 on ``queue``, drop it once pickled, say so on ``events``,
    stay alive until ``done`` says go."""
    import shared_td

    counter = shared_td.SharedCounter()
    counter.fetch_add(5)
    queue.put(counter)
    del counter
    queue.close()
    queue.join_thread()
    gc.collect()
    events.put("dropped")
    done.get(timeout=WAIT)


def add_many(counter, times: int, events, go) -> None:
    """Once ``go`` says so, ``times`` fetch_add(1) on ``counter`` (received as a spawn
    argument), then say so."""
    events.put("ready")
    go.get(timeout=WAIT)
    for _ in range(times):
        counter.fetch_add(1)
    events.put("done")
