"""An anonymous segment sent through multiprocessing (its ForkingPickler: queues, process
arguments, DataLoader workers) travels as a duplicate descriptor, so the receiver gets it
after the sender dropped it, as tensordict 0.15.3 (torch) does; plain pickle keeps the
``/proc/<pid>/fd`` route. See the docstring of shared_td/storage/anonymous.py."""

import gc
import multiprocessing
import os
import pickle
from multiprocessing.reduction import ForkingPickler

import pytest
import torch

from tests.processes import WAIT, finish
from tests.storage import dupfd_children as kids

import shared_td
from shared_td.storage import anonymous
from shared_td.storage.anonymous import Segment, SegmentUnavailableError

pytestmark = pytest.mark.timeout(120)


def fd_count() -> int:
    gc.collect()
    return len(os.listdir("/proc/self/fd"))


def memfd_count() -> int:
    """This process's descriptors on anonymous memory (its segments and their duplicates)."""
    gc.collect()
    links = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            links.append(os.readlink(f"/proc/self/fd/{fd}"))
        except FileNotFoundError:  # the listing's own descriptor
            pass
    return sum(link.startswith("/memfd:") for link in links)


@pytest.mark.parametrize("method, name", [("fork", "shared_td"), ("fork", "tensordict"), ("spawn", "shared_td")])
def test_received_after_the_sender_dropped_it(method, name):
    if name == "tensordict":  # side by side: tensordict 0.15.3 receives it too
        pytest.importorskip("tensordict")
    context = multiprocessing.get_context(method)
    queue, events, done = context.Queue(), context.Queue(), context.Queue()
    process = context.Process(target=kids.send_and_drop, args=(name, queue, events, done))
    process.start()
    try:
        assert events.get(timeout=WAIT) == ("dropped", True)  # the sender holds no segment
        trees = queue.get(timeout=WAIT)
    finally:
        done.put(1)
        assert finish(process) == 0
    for kind in ("consolidated", "memmap"):
        assert trees[kind]["a"].tolist() == [7.0] * 4, kind
        assert trees[kind]["n", "b"].tolist() == [7.0] * 2, kind


def test_receiver_writes_reach_the_sender_and_one_segment_is_kept_once():
    context = multiprocessing.get_context("fork")
    queue, events, done = context.Queue(), context.Queue(), context.Queue()
    process = context.Process(target=kids.send_and_keep, args=(queue, events, done))
    process.start()
    try:
        one, two = queue.get(timeout=WAIT), queue.get(timeout=WAIT)
        # two pickles of one segment: one Segment (one descriptor) here
        assert one["a"]._backing is two["a"]._backing
        one["a"][1] = 5.0
        assert two["a"][1] == 5.0
        done.put(1)
        assert events.get(timeout=WAIT) == [0.0, 5.0, 0.0, 0.0]
    finally:
        done.put(1)
        assert finish(process) == 0


def test_no_descriptor_leaks_over_100_round_trips():
    segment = Segment.create(64)
    tree = shared_td.TensorDict({"a": torch.arange(4.0)}, []).memmap_()
    ForkingPickler.loads(ForkingPickler.dumps(tree))  # the resource sharer's listener, once
    before = fd_count()
    for _ in range(100):  # this process takes back its own duplicates and closes them
        assert ForkingPickler.loads(ForkingPickler.dumps(segment)) is segment
        assert ForkingPickler.loads(ForkingPickler.dumps(tree))["a"]._backing is tree["a"]._backing
    assert fd_count() == before

    # a receiver attaching 100 segments new to it, and dropping them
    memfds_before = memfd_count()
    context = multiprocessing.get_context("fork")
    queue, events = context.Queue(), context.Queue()
    process = context.Process(target=kids.receive_many, args=(queue, events, 100))
    process.start()
    try:
        for i in range(100):
            queue.put(shared_td.TensorDict({"a": torch.full((2,), float(i))}, []).memmap_())
        receiver_before, receiver_after, values = events.get(timeout=WAIT)
    finally:
        assert finish(process) == 0
    assert values == [float(i) for i in range(100)]
    assert receiver_after == receiver_before
    queue.close()
    queue.join_thread()
    assert memfd_count() == memfds_before  # no duplicate left in this sender's resource sharer


def test_plain_pickle_keeps_the_proc_route():
    segment = Segment.create(64)
    assert segment.__reduce__()[0] is anonymous._attach  # what the Coordinator pickles
    blob = pickle.dumps(segment)
    assert b"_receive" not in blob and b"_attach" in blob
    assert b"_receive" in bytes(ForkingPickler.dumps(segment))


class _Duplicate:
    """Stands for a DupFd: ``detach()`` gives ``fd`` or raises ``error``."""

    def __init__(self, fd=None, error=None):
        self.fd, self.error = fd, error

    def detach(self):
        if self.error is not None:
            raise self.error
        return self.fd


def test_a_descriptor_of_another_file_is_refused_and_closed():
    wanted, other = Segment.create(64), Segment.create(64)
    key = wanted.key
    del wanted
    gc.collect()  # not attached here: the received descriptor is checked
    before = fd_count()
    with pytest.raises(SegmentUnavailableError, match=r"names another file .*refused"):
        anonymous._receive(_Duplicate(os.dup(other.fd)), key, 64, os.getpid(), 99)
    assert fd_count() == before


def test_a_duplicate_that_cannot_be_taken_falls_back_to_proc():
    segment = Segment.create(64)
    lost = ConnectionRefusedError("the sender's resource sharer is gone")
    # attached here already: that segment, nothing to take
    found = anonymous._receive(_Duplicate(error=lost), segment.key, 64, os.getpid(), segment.fd)
    assert found is segment
    key, fd = segment.key, segment.fd
    del segment, found
    lost = ConnectionRefusedError("the sender's resource sharer is gone")  # a fresh traceback
    gc.collect()
    with pytest.raises(SegmentUnavailableError, match="gone") as caught:
        anonymous._receive(_Duplicate(error=lost), key, 64, os.getpid(), fd)
    assert caught.value.__cause__ is lost


@pytest.mark.parametrize("method, kind", [("fork", "consolidated"), ("fork", "memmap"), ("spawn", "memmap")])
def test_dataloader_workers_return_anonymous_trees(method, kind):
    workers = 2 if method == "fork" else 1  # a spawn worker's start costs seconds
    loader = torch.utils.data.DataLoader(kids.AnonymousSamples(kind), batch_size=1, num_workers=workers,
                                         collate_fn=kids.first, multiprocessing_context=method)
    batches = list(loader)
    assert [batch["a"].tolist() for batch in batches] == [[float(i)] * 4 for i in range(4)]
    assert [batch["n", "b"].tolist() for batch in batches] == [[float(i)] * 2 for i in range(4)]
    leaf = batches[0]["a"]
    assert type(leaf._backing) is Segment  # still the worker's shared memory, writable
    leaf[0] = -1.0
    assert batches[0]["a"][0] == -1.0


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_counter_is_received_after_the_sender_dropped_it(method):
    """A SharedCounter put on a queue by a process that then dropped it: its own pickle
    named the sender's descriptor, gone by then (SegmentUnavailableError)."""
    context = multiprocessing.get_context(method)
    queue, events, done = context.Queue(), context.Queue(), context.Queue()
    process = context.Process(target=kids.send_counter_and_drop, args=(queue, events, done))
    process.start()
    try:
        assert events.get(timeout=WAIT) == "dropped"
        counter = queue.get(timeout=WAIT)
        assert counter.fetch_add(1) == 5 and counter.value == 6
    finally:
        done.put(1)
        assert finish(process) == 0


def test_a_counter_received_as_a_duplicate_still_excludes_its_sender():
    """A duplicated descriptor shares the sender's open file description, and a lock
    on an open file description does not exclude another holder of the same one: a
    counter sent to a spawn child (a process argument) lost additions racing its
    sender's (the actor/learner example: the cursor reserved 64 slots fewer than the
    actors wrote). The received segment now opens its own description."""
    import shared_td

    counter, times = shared_td.SharedCounter(), 20000
    context = multiprocessing.get_context("spawn")
    events, go = context.Queue(), context.Queue()
    children = [context.Process(target=kids.add_many, args=(counter, times, events, go)) for _ in range(2)]
    for child in children:
        child.start()
    try:
        assert [events.get(timeout=WAIT) for _ in children] == ["ready", "ready"]
        for _ in children:
            go.put(1)  # all three add at once
        for _ in range(times):
            counter.fetch_add(1)
        assert [events.get(timeout=WAIT) for _ in children] == ["done", "done"]
    finally:
        for child in children:
            assert finish(child) == 0
    assert counter.value == 3 * times
