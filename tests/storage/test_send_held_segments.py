"""A tree that a worker attached from a Coordinator (anonymous segments, which the
coordinator holds), or a plain view of one of its leaves, sent by that worker to another
process, is received after the worker exited: the pickle names the coordinator as a
fallback holder of each segment (see shared_td.storage.holders), as a SharedValue's does.
Real processes, fork and spawn, the worker joined before the receiver unpickles.

tensordict 0.15.3 has no coordinator (and its anonymous tensors are torch's shared
memory, received only while a sender lives): nothing to compare side by side here.
"""
from __future__ import annotations

import gc
import multiprocessing
import os
import pickle
import subprocess
import sys

import pytest
import torch

import shared_td
from shared_td.errors import SegmentUnavailableError
from shared_td.storage import anonymous
from tests.processes import WAIT, finish

NAME = "held"


@pytest.fixture(scope="module")
def coord():
    with shared_td.Coordinator() as coord:
        td = shared_td.TensorDict({"a": torch.arange(6.0), "n": {"b": torch.ones(3, 2)}}, batch_size=[]).memmap_()
        coord.publish(NAME, td)
        del td  # only the coordinator holds the segments now
        gc.collect()
        yield coord


def _worker(address, authkey, queues) -> None:
    td = shared_td.attach(NAME, address=address, authkey=authkey)
    item = (td, td["a"].view(2, 3))  # the tree, and a plain torch view of a leaf
    queues["queue"].put(item)  # ForkingPickler: a duplicate descriptor, lost when this exits
    queues["pickle"].put(pickle.dumps(item))  # plain pickle: this process's /proc/<pid>/fd
    # exits here: the queues' feeders write the items first (joined at exit)


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def _receive(queue, route):
    """What the receiver reports of one route: the values, the descriptors it opened and
    the segments of the tree; it writes through the tree (and the view, sent by reference)."""
    before = _open_fds()
    item = queue.get(timeout=WAIT)
    td, view = pickle.loads(item) if route == "pickle" else item
    opened = len(_open_fds() - before)
    segments = {leaf._backing.key for leaf in td.values(True, True)}
    values = (td["a"].tolist(), view.tolist(), td["n", "b"].tolist())
    td["a"][4] += 20.0  # seen by the coordinator's other attachers
    if route == "queue":  # (plain pickle sends a plain tensor by value, as torch does)
        view[1, 2] += 50.0  # td["a"][5]
    td["n", "b"][0, 0] += 7.0
    return values, opened, len(segments)


def _receiver(queues, results) -> None:
    # one process receives both, one after the other: the first tree dropped (its
    # descriptor closed) before the second arrives, so each attaches anew
    for route, queue in queues.items():
        try:
            results.put((route, "ok", *_receive(queue, route)))
        except Exception as err:  # reported to the test, not lost in a child's stderr
            results.put((route, "error", f"{type(err).__name__}: {err}"))
        gc.collect()


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_held_tree_sent_by_a_worker_is_received_after_it_exited(coord, method):
    context = multiprocessing.get_context(method)
    queues, results = {route: context.Queue() for route in ("queue", "pickle")}, context.Queue()
    worker = context.Process(target=_worker, args=(coord.address, coord.authkey, queues))
    worker.start()
    assert finish(worker) == 0  # gone before anything is received
    receiver = context.Process(target=_receiver, args=(queues, results))
    receiver.start()
    outcomes = {outcome[0]: outcome[1:] for outcome in (results.get(timeout=WAIT) for _ in queues)}
    assert finish(receiver) == 0
    a_then = [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    for route, b00 in (("queue", 1.0), ("pickle", 8.0)):
        assert outcomes[route][0] == "ok", (route, outcomes[route][1])
        _, (a, view, b), opened, segments = outcomes[route]
        assert a == a_then, route
        # (the view pickled by value in the worker holds the values then)
        assert view == ([[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]] if route == "pickle" else [a_then[:3], a_then[3:]])
        assert b == [[b00, 1.0], [1.0, 1.0], [1.0, 1.0]], route
        assert opened == segments, route  # one descriptor per segment, the view's shared with the tree's
        a_then = a_then[:4] + [a_then[4] + 20.0, a_then[5] + (50.0 if route == "queue" else 0.0)]
    attached = coord.attach(NAME)  # another attacher of the coordinator sees the writes
    assert attached["a"].tolist() == [0.0, 1.0, 2.0, 3.0, 44.0, 55.0]
    assert attached["n", "b"][0, 0].item() == 15.0
    attached["a"][4:], attached["n", "b"][0, 0] = torch.tensor([4.0, 5.0]), 1.0


def _dead_pid() -> int:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(done.stdout)


def test_every_route_tried_is_named_when_none_holds_the_segment():
    segment = anonymous.Segment.create(64)
    gone = _dead_pid()
    segment.add_holders([(gone, 9)])
    sent = pickle.dumps(segment)
    del segment
    gc.collect()
    with pytest.raises(SegmentUnavailableError) as caught:
        pickle.loads(sent)
    message = str(caught.value)
    assert "could not be attached from any process that held it" in message
    assert f"(1) its sender, process {os.getpid()}" in message and "released in this process" in message
    assert f"(2) a coordinator holding it, process {gone} (descriptor 9)" in message
    assert message.count("publish them through a Coordinator") == 1  # the advice, once


def test_a_segment_no_coordinator_holds_keeps_its_error():
    segment = anonymous.Segment.create(64)
    assert segment.holders == ()
    assert len(segment.__reduce__()[1]) == 4  # pickled as before: no holders named
    sent = pickle.dumps(segment)
    del segment
    gc.collect()
    with pytest.raises(SegmentUnavailableError, match=r"sent by process \d+ is gone \(it was released in this process\)"):
        pickle.loads(sent)
