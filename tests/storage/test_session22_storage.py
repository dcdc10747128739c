"""Receiving from a sender that is stopped (SIGSTOP) is bounded (session 22).

multiprocessing's ForkingPickler sends anonymous memory (a tree's segment, a
SharedCounter, a SharedValue) as a duplicate descriptor that the sender's resource
sharer thread hands over: a stopped sender never answers, and the receiver waited for
ever in the handshake. Now it waits at most ``duplicates.DUPLICATE_TIMEOUT`` (made short
here), then takes the ``/proc`` route, then the holders, and else says which process did
not answer and to resume it. Real forked senders, really stopped; every receive runs in
a thread joined within a bound, and the sender is killed and continued in a ``finally``.

tensordict 0.15.3 (torch's own reducers) waits for ever in the same place: not run here.
"""
from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from shared_td import SharedCounter, TensorDict
from shared_td import platform
from shared_td.errors import SegmentUnavailableError
from shared_td.storage import duplicates
from shared_td.storage.shared_value import SharedValue
from tests.processes import WAIT, wait_until

pytestmark = pytest.mark.timeout(120)

TIMEOUT = 0.5  # seconds: DUPLICATE_TIMEOUT in the receiver, for these tests


def _tree(value: float):
    return TensorDict({"a": torch.full((4,), value), "n": {"b": torch.full((2,), value)}}, []).memmap_()


def _make(kind: str):
    if kind == "tree":
        return _tree(7.0)
    if kind == "trees":  # three trees, three segments
        return [_tree(float(value)) for value in range(3)]
    if kind == "counter":
        return SharedCounter(5)
    return SharedValue.create("walk")


def _send(kind: str, conn, ready, drop: bool, holder: bool) -> None:
    """Send ``kind`` on ``conn`` (ForkingPickler: duplicates held by this process's
    resource sharer), drop it if ``drop`` (keeping a descriptor of its segment as a
    holder of it if ``holder``), say so on ``ready``, then wait to be stopped."""
    sent = _make(kind)
    if holder:
        segment = sent["a"]._backing
        segment.add_holders([(os.getpid(), os.dup(segment.fd))])
    conn.send(sent)
    if drop:
        del sent
        segment = None
        gc.collect()
    ready.set()
    time.sleep(WAIT)


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0] in "Tt"


def _receive_from_stopped(monkeypatch, kind: str, *, drop: bool = False, holder: bool = False):
    """(the sender's pid, {"value" or "error", "seconds"}) of receiving ``kind`` from a
    forked sender stopped with SIGSTOP once it sent it."""
    monkeypatch.setattr(duplicates, "DUPLICATE_TIMEOUT", TIMEOUT)
    monkeypatch.setattr(duplicates, "_SILENT", {})
    context = multiprocessing.get_context("fork")
    ours, theirs = context.Pipe()
    ready = context.Event()
    sender = context.Process(target=_send, args=(kind, theirs, ready, drop, holder), daemon=True)
    sender.start()
    theirs.close()
    result = {}

    def receive():
        start = time.monotonic()
        try:
            result["value"] = ours.recv()
        except BaseException as err:  # (reported to the test below)
            result["error"] = err
        result["seconds"] = time.monotonic() - start

    thread = threading.Thread(target=receive, daemon=True)
    try:
        assert ready.wait(WAIT), "the sender sent nothing"
        os.kill(sender.pid, signal.SIGSTOP)
        assert wait_until(lambda: _stopped(sender.pid)), "the sender did not stop"
        thread.start()
        thread.join(8 * TIMEOUT + 5)
        assert not thread.is_alive(), "the receive from a stopped sender did not return"
        return sender.pid, result
    finally:
        sender.kill()  # (SIGKILL ends a stopped process too; its sockets close)
        os.kill(sender.pid, signal.SIGCONT)
        sender.join(WAIT)
        if thread.is_alive():
            thread.join(WAIT)
        ours.close()


@pytest.mark.parametrize("kind", ["tree", "counter", "value"])
def test_a_stopped_sender_that_holds_it_is_received_by_proc_after_the_bound(monkeypatch, kind):
    pid, result = _receive_from_stopped(monkeypatch, kind)
    assert "error" not in result, result
    assert TIMEOUT * 0.9 <= result["seconds"] < 6 * TIMEOUT + 2
    received = result["value"]
    if kind == "tree":
        assert received["a"].tolist() == [7.0] * 4 and received["n", "b"].tolist() == [7.0] * 2
    elif kind == "counter":
        assert received.value == 5
    else:
        assert received.get() == "walk"


def test_a_stopped_sender_that_dropped_it_is_an_error_naming_it(monkeypatch):
    pid, result = _receive_from_stopped(monkeypatch, "tree", drop=True)
    error = result.get("error")
    assert isinstance(error, SegmentUnavailableError), result
    message = str(error)
    assert f"sent by process {pid} could not be received" in message
    assert f"did not hand over the descriptor within {TIMEOUT:g} s" in message
    assert f"kill -CONT {pid}" in message and "stopped (SIGSTOP" in message
    assert "The other routes failed too" in message  # (the /proc route's own words follow)


def test_a_stopped_sender_whose_proc_route_is_refused_is_an_error_naming_it(monkeypatch):
    def refused(pid, fd, key):
        raise PermissionError(13, "refused for this test")

    monkeypatch.setattr(platform, "reopen_peer_fd", refused)
    pid, result = _receive_from_stopped(monkeypatch, "counter")
    error = result.get("error")
    assert isinstance(error, SegmentUnavailableError), result
    assert f"kill -CONT {pid}" in str(error) and "may not open the descriptors" in str(error)


def test_after_the_bound_the_next_holder_is_tried(monkeypatch):
    """The sender dropped the tree; a holder of its segment (here a descriptor the same
    process kept, as a coordinator's would be) still gives it."""
    pid, result = _receive_from_stopped(monkeypatch, "tree", drop=True, holder=True)
    assert "error" not in result, result
    assert result["value"]["a"].tolist() == [7.0] * 4


def test_a_silent_sender_is_waited_for_once_per_bound_not_once_per_segment(monkeypatch):
    pid, result = _receive_from_stopped(monkeypatch, "trees")
    assert "error" not in result, result
    assert [tree["a"][0].item() for tree in result["value"]] == [0.0, 1.0, 2.0]
    assert result["seconds"] < 2.5 * TIMEOUT + 1  # (three segments: 3 bounds if each waited)


def test_a_live_sender_still_hands_over_its_duplicate(monkeypatch):
    """The bounded exchange is the resource sharer's own: a running sender's duplicate
    is taken (not the /proc route), after the sender dropped what it sent."""
    monkeypatch.setattr(duplicates, "_SILENT", {})
    context = multiprocessing.get_context("fork")
    ours, theirs = context.Pipe()
    ready = context.Event()
    sender = context.Process(target=_send, args=("tree", theirs, ready, True, False), daemon=True)
    sender.start()
    theirs.close()
    try:
        assert ready.wait(WAIT) and ours.poll(WAIT)
        assert ours.recv()["a"].tolist() == [7.0] * 4
    finally:
        sender.kill()
        sender.join(WAIT)
        ours.close()


SOCKET_GONE = """
import gc, multiprocessing, os, sys
from multiprocessing import resource_sharer
from multiprocessing.reduction import ForkingPickler
import torch
from shared_td import MemoryMappedTensor, SharedCounter
from shared_td.storage.shared_value import SharedValue

kind = sys.argv[1]
made = {"cell": lambda: SharedValue.create("walk"), "counter": lambda: SharedCounter(7),
        "view": lambda: MemoryMappedTensor.full((4,), fill_value=2.0).detach()}[kind]()
data = ForkingPickler.dumps(made)
del made
gc.collect()  # the sender's own object and its descriptor are gone: the duplicate is left
# what Python does when it starts to exit (a Finalize of priority 0), before a queue's
# feeder thread has sent what was put last
os.unlink(resource_sharer._resource_sharer._address)
reader, writer = multiprocessing.Pipe(duplex=False)
child = multiprocessing.get_context("fork").Process(target=lambda: writer.send(repr(
    (lambda got: got.get() if kind == "cell" else got.value if kind == "counter" else got.tolist())(
        ForkingPickler.loads(data)))))
child.start()
print("received", reader.recv() if reader.poll(60) else "nothing", flush=True)
child.join(60)
"""


@pytest.mark.parametrize("kind", ["cell", "counter", "view"])
def test_a_duplicate_is_received_once_the_sharer_socket_is_gone_and_the_object_dropped(kind, tmp_path):
    """The receiver's /proc route names the duplicate the sender still holds, not the
    dropped object's descriptor: a cell put on a queue as main returned was lost about
    half the time (Python unlinks the resource sharer's socket as it starts to exit, and
    the cell, dropped once pickled, had closed its descriptor)."""
    script = tmp_path / "socket_gone.py"
    script.write_text(SOCKET_GONE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, str(script), kind], capture_output=True, text=True,
                            timeout=90, env=env)
    expected = {"cell": "'walk'", "counter": "7", "view": "[2.0, 2.0, 2.0, 2.0]"}[kind]
    assert f"received {expected}" in result.stdout, result.stdout + result.stderr[-2000:]
