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
import socket
import subprocess
import sys
import threading
import time
from multiprocessing import connection

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


def _send(kind: str, conn, ready, drop: bool, made=None, holders=(), stuck: bool = False, count: int = 1) -> None:
    """Send ``kind`` (or ``made[0]``, with these extra ``holders`` of its segment) on
    ``conn``, ``count`` times (ForkingPickler: duplicates held by this process's resource
    sharer), drop it if ``drop``, block this process's own resource sharer if ``stuck``
    (a receiver that connected to it and stopped answering), say so on ``ready``, then
    wait to be stopped."""
    sent = [_make(kind) if made is None else made[0] for _ in range(count)]
    if holders:
        sent[0]["a"]._backing.add_holders(holders)
    for each in sent:
        conn.send(each)
    if drop:
        del sent, made, each
        gc.collect()
    if stuck:
        from multiprocessing import resource_sharer
        blocker = socket.socket(socket.AF_UNIX)
        blocker.connect(resource_sharer._resource_sharer._address)  # (its challenge never answered)
    ready.set()
    time.sleep(WAIT)


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0] in "Tt"


def _refuse_sender(monkeypatch, error: OSError) -> list:
    """Make the /proc route of the sender (the pid stored in the list returned, [0])
    fail with ``error``; every other reopen_peer_fd works. The list then records the
    (pid, fd) of each reopen_peer_fd call."""
    original = platform.reopen_peer_fd
    calls = [None]

    def reopen(pid, fd, key):
        calls.append((pid, fd))
        if pid == calls[0]:
            raise error
        return original(pid, fd, key)

    monkeypatch.setattr(platform, "reopen_peer_fd", reopen)
    return calls


def _receive_from_stopped(monkeypatch, kind: str, *, drop: bool = False, made=None, holders=(), calls=None,
                          stop: bool = True, stuck: bool = False, count: int = 1, receive=None,
                          timeout: float = TIMEOUT):
    """(the sender's pid, {"value" or "error", "seconds"}) of receiving ``kind`` (or
    ``receive(connection)``) from a forked sender stopped with SIGSTOP once it sent it
    (running, if not ``stop``)."""
    monkeypatch.setattr(duplicates, "DUPLICATE_TIMEOUT", timeout)
    monkeypatch.setattr(duplicates, "_SILENT", {})
    context = multiprocessing.get_context("fork")
    ours, theirs = context.Pipe()
    ready = context.Event()
    sender = context.Process(target=_send, args=(kind, theirs, ready, drop, made, holders, stuck, count),
                             daemon=True)
    sender.start()
    theirs.close()
    if made is not None:  # (the sender has it now; this process no longer)
        made.clear()
        gc.collect()
    if calls is not None:
        calls[0] = sender.pid
    result = {}

    def receiving():
        start = time.monotonic()
        try:
            result["value"] = receive(ours) if receive else ours.recv()
        except BaseException as err:  # (reported to the test below)
            result["error"] = err
        result["seconds"] = time.monotonic() - start

    thread = threading.Thread(target=receiving, daemon=True)
    try:
        assert ready.wait(WAIT), "the sender sent nothing"
        if stop:
            os.kill(sender.pid, signal.SIGSTOP)
            assert wait_until(lambda: _stopped(sender.pid)), "the sender did not stop"
        thread.start()
        thread.join(8 * timeout + 5)
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


def test_a_stopped_sender_that_dropped_it_is_received_by_the_duplicate_it_holds(monkeypatch):
    """The sender dropped the tree (its own descriptor closed) and is stopped: the
    /proc route opens the duplicate its resource sharer holds until it is taken."""
    pid, result = _receive_from_stopped(monkeypatch, "tree", drop=True)
    assert "error" not in result, result
    assert result["seconds"] >= TIMEOUT * 0.9  # (the /proc route, after the bound)
    assert result["value"]["a"].tolist() == [7.0] * 4 and result["value"]["n", "b"].tolist() == [7.0] * 2


def test_a_stopped_sender_whose_proc_route_fails_is_an_error_naming_it(monkeypatch):
    calls = _refuse_sender(monkeypatch, FileNotFoundError(2, "No such file or directory (for this test)"))
    pid, result = _receive_from_stopped(monkeypatch, "tree", drop=True, calls=calls)
    error = result.get("error")
    assert isinstance(error, SegmentUnavailableError), result
    message = str(error)
    assert f"sent by process {pid} could not be received" in message
    assert f"did not hand over the descriptor within {TIMEOUT:g} s" in message
    assert f"kill -CONT {pid}" in message and "stopped (SIGSTOP" in message
    assert "The other routes failed too" in message and "for this test" in message
    assert {call[0] for call in calls[1:]} == {pid}  # (the /proc route was tried, and failed)


def test_a_stopped_sender_whose_proc_route_is_refused_is_an_error_naming_it(monkeypatch):
    calls = _refuse_sender(monkeypatch, PermissionError(13, "refused for this test"))
    pid, result = _receive_from_stopped(monkeypatch, "counter", calls=calls)
    error = result.get("error")
    assert isinstance(error, SegmentUnavailableError), result
    assert f"kill -CONT {pid}" in str(error) and "may not open the descriptors" in str(error)


def test_after_the_bound_and_the_proc_route_the_next_holder_is_tried(monkeypatch):
    """The sender is stopped and its /proc route fails; a holder of the tree's segment
    (here this process keeps a descriptor of it, as a coordinator would) gives it."""
    made = [_tree(7.0)]
    kept = os.dup(made[0]["a"]._backing.fd)
    calls = _refuse_sender(monkeypatch, FileNotFoundError(2, "gone for this test"))
    try:
        # (the forked sender has the tree; this process keeps only the descriptor, so
        # that the tree is not found here already)
        pid, result = _receive_from_stopped(
            monkeypatch, "tree", drop=True, made=made, holders=[(os.getpid(), kept)], calls=calls)
        assert "error" not in result, result
        assert result["value"]["a"].tolist() == [7.0] * 4
        assert calls[1][0] == pid and calls[-1] == (os.getpid(), kept)  # (the sender's route, then the holder)
    finally:
        os.close(kept)


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
    sender = context.Process(target=_send, args=("tree", theirs, ready, True), daemon=True)
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

made = [SharedValue.create("walk"), SharedCounter(7), MemoryMappedTensor.full((4,), fill_value=2.0).detach()]
data = ForkingPickler.dumps(made)
del made
gc.collect()  # the sender's own objects and their descriptors are gone: the duplicates are left
# what Python does when it starts to exit (a Finalize of priority 0), before a queue's
# feeder thread has sent what was put last
os.unlink(resource_sharer._resource_sharer._address)
reader, writer = multiprocessing.Pipe(duplex=False)

def receive():
    cell, counter, view = ForkingPickler.loads(data)
    writer.send(repr((cell.get(), counter.value, view.tolist())))

child = multiprocessing.get_context("fork").Process(target=receive)
child.start()
print("received", reader.recv() if reader.poll(60) else "nothing", flush=True)
child.join(60)
"""


def test_a_duplicate_is_received_once_the_sharer_socket_is_gone_and_the_object_dropped(tmp_path):
    """The receiver's /proc route names the duplicate the sender still holds, not the
    dropped object's descriptor (a cell, a counter, a plain view of a segment): a cell put
    on a queue as main returned was lost about half the time (Python unlinks the resource
    sharer's socket as it starts to exit, and the cell, dropped once pickled, had closed
    its descriptor)."""
    script = tmp_path / "socket_gone.py"
    script.write_text(SOCKET_GONE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=90, env=env)
    assert "received ('walk', 7, [2.0, 2.0, 2.0, 2.0])" in result.stdout, result.stdout + result.stderr[-2000:]


# -- audit 22 (storage): a default socket timeout, the bound per read, the timeout's
# value, the skip of a silent sender, a fork during a take


def test_a_default_socket_timeout_does_not_make_a_live_sender_silent(monkeypatch):
    """socket.setdefaulttimeout() (set by many applications) made the options socket,
    which shares conn's open file description, non-blocking: the handshake's first read
    failed at once, taken for the bound (the sender marked silent, its duplicate left)."""
    from multiprocessing import resource_sharer
    monkeypatch.setattr(duplicates, "_SILENT", {})
    fd = os.memfd_create("default-timeout")
    previous = socket.getdefaulttimeout()
    socket.setdefaulttimeout(5.0)
    try:
        start = time.monotonic()
        mine = duplicates.take_duplicate(resource_sharer.DupFd(fd))  # (our own resource sharer)
        assert os.path.samestat(os.fstat(mine), os.fstat(fd)) and time.monotonic() - start < 1
        os.close(mine)
        assert duplicates._SILENT == {}
    finally:
        socket.setdefaulttimeout(previous)
        os.close(fd)


def _fake_sharer(tmp_path, delay: float):
    """The address of a resource sharer (a thread here) that answers each handshake
    message ``delay`` seconds late, and a DupFd naming it."""
    from multiprocessing import resource_sharer
    from multiprocessing.process import current_process
    address = str(tmp_path / "sharer")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(address)
    listener.listen(1)

    def serve():
        with listener:
            sock, _ = listener.accept()
        with connection.Connection(sock.detach()) as conn:
            try:
                time.sleep(delay)
                conn.send_bytes(connection.CHALLENGE + os.urandom(40))
                conn.recv_bytes(256)
                time.sleep(delay)
                conn.send_bytes(connection.WELCOME)
                conn.poll(WAIT)  # (then never hands over anything)
            except OSError:  # (the receiver gave up, as it should)
                pass

    assert current_process().authkey  # (the handshake's key)
    threading.Thread(target=serve, daemon=True).start()
    duplicate = resource_sharer.DupFd.__new__(resource_sharer.DupFd)
    duplicate._id = (address, 1)
    return duplicate


def test_a_slow_sender_is_waited_for_at_most_the_bound_in_all(monkeypatch, tmp_path):
    """Each read is bounded by the time left: two reads of one handshake step each
    waited up to the step's bound (here 0.6 s for a bound of 0.4 s)."""
    monkeypatch.setattr(duplicates, "DUPLICATE_TIMEOUT", 0.4)
    monkeypatch.setattr(duplicates, "_SILENT", {})
    duplicate = _fake_sharer(tmp_path, 0.3)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="within 0.4 s"):
        duplicates.take_duplicate(duplicate)
    assert time.monotonic() - start < 0.5


@pytest.mark.parametrize("value", [float("inf"), 1e300])
def test_an_infinite_duplicate_timeout_waits_as_long_as_possible(monkeypatch, value):
    from multiprocessing import resource_sharer
    monkeypatch.setattr(duplicates, "DUPLICATE_TIMEOUT", value)
    monkeypatch.setattr(duplicates, "_SILENT", {})
    fd = os.memfd_create("infinite")
    try:
        mine = duplicates.take_duplicate(resource_sharer.DupFd(fd))
        assert os.path.samestat(os.fstat(mine), os.fstat(fd))
        os.close(mine)
    finally:
        os.close(fd)


@pytest.mark.parametrize("value", [float("nan"), 0, -1.0])
def test_a_duplicate_timeout_that_is_no_bound_is_refused_naming_it(monkeypatch, value):
    from multiprocessing import resource_sharer
    monkeypatch.setattr(duplicates, "DUPLICATE_TIMEOUT", value)
    fd = os.memfd_create("no-bound")
    duplicate = resource_sharer.DupFd(fd)
    try:
        with pytest.raises(ValueError, match="DUPLICATE_TIMEOUT .* a number > 0"):
            duplicates.take_duplicate(duplicate)
    finally:
        monkeypatch.setattr(duplicates, "DUPLICATE_TIMEOUT", 5.0)
        os.close(duplicates.take_duplicate(duplicate))  # (not left registered in our sharer)
        os.close(fd)


def test_a_resumed_sender_is_asked_again(monkeypatch):
    """A sender skipped while it is stopped is asked again once it runs: the next tree
    it sent comes through its resource sharer, not through /proc (the duplicate not
    taken in time stays held by it until it exits, as any pickle never received)."""
    original = platform.reopen_peer_fd
    calls = [None]  # ([0]: the sender's pid, set below; then each /proc route taken)

    def counting(pid, fd, key):
        calls.append((pid, fd))
        return original(pid, fd, key)

    monkeypatch.setattr(platform, "reopen_peer_fd", counting)

    def receive_resumed(ours):
        first = ours.recv()  # (the bound, then /proc)
        routes = len(calls)
        os.kill(calls[0], signal.SIGCONT)
        assert wait_until(lambda: not _stopped(calls[0])), "the sender was not resumed"
        second = ours.recv()
        return first, second, routes

    pid, result = _receive_from_stopped(monkeypatch, "tree", drop=True, count=2, receive=receive_resumed,
                                        calls=calls)
    assert "error" not in result, result
    first, second, routes = result["value"]
    assert first["a"].tolist() == second["a"].tolist() == [7.0] * 4
    assert routes > 1 and len(calls) == routes  # (/proc for the first only)


def test_a_sender_still_stopped_after_the_bound_is_not_asked_again(monkeypatch):
    """A sender that stays stopped longer than the bound is skipped for the next
    segment too (it was asked again once a fixed window of one bound had passed)."""
    timeout = 0.3

    def receive_twice(ours):
        first = ours.recv()  # (the bound, then /proc)
        time.sleep(timeout * 1.5)
        start = time.monotonic()
        second = ours.recv()
        return first, second, time.monotonic() - start

    pid, result = _receive_from_stopped(monkeypatch, "tree", drop=True, count=2, receive=receive_twice,
                                        timeout=timeout)
    assert "error" not in result, result
    first, second, seconds = result["value"]
    assert second["a"].tolist() == [7.0] * 4 and seconds < timeout / 2


def test_a_running_sender_whose_sharer_is_stuck_is_an_error_naming_the_cause(monkeypatch):
    """A running sender whose resource sharer waits on another receiver (connected and
    silent) is not told to be resumed with kill -CONT: the error names the stuck peer."""
    calls = _refuse_sender(monkeypatch, FileNotFoundError(2, "gone for this test"))
    pid, result = _receive_from_stopped(monkeypatch, "counter", calls=calls, stop=False, stuck=True)
    error = result.get("error")
    assert isinstance(error, SegmentUnavailableError), result
    message = str(error)
    assert f"process {pid} lives but it did not hand over the descriptor within {TIMEOUT:g} s" in message
    assert "kill -CONT" not in message and "it is running" in message
    assert "waits on another receiver" in message


def _silent_sharer(tmp_path):
    """A listener that never accepts (a connection waits in its backlog, unanswered, as
    with a stopped sender) and a DupFd naming it."""
    from multiprocessing import resource_sharer
    address = str(tmp_path / "silent-sharer")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(address)
    listener.listen(4)
    duplicate = resource_sharer.DupFd.__new__(resource_sharer.DupFd)
    duplicate._id = (address, 1)
    return listener, duplicate


def _start_time(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as stat:
        return int(stat.read().rsplit(")", 1)[1].split()[19])


@pytest.mark.parametrize("then", ["still stopped", "pid reused", "gone"])
def test_a_silent_sender_is_skipped_only_while_the_same_process_is_stopped(monkeypatch, tmp_path, then):
    """The skip of a sender that did not answer in time holds while that very process is
    stopped: a pid that names another (stopped) process now, or a gone one, is asked
    again (here its socket is gone: that fails at once, not after the bound)."""
    monkeypatch.setattr(duplicates, "DUPLICATE_TIMEOUT", 0.1)
    monkeypatch.setattr(duplicates, "_SILENT", {})
    sender = subprocess.Popen(["sleep", "30"])
    try:
        os.kill(sender.pid, signal.SIGSTOP)
        assert wait_until(lambda: _stopped(sender.pid)), "the sender did not stop"
        listener, duplicate = _silent_sharer(tmp_path)
        with listener, pytest.raises(TimeoutError, match="did not hand over the descriptor within 0.1 s"):
            duplicates.take_duplicate(duplicate, sender.pid)
        os.unlink(duplicate._id[0])  # (asked again: FileNotFoundError at once)
        if then == "pid reused":  # (the same pid, stopped, started later: another process)
            started = _start_time(sender.pid) + 1
            monkeypatch.setattr(duplicates, "_proc_stat", lambda pid: (b"T", started), raising=False)
        elif then == "gone":
            sender.kill()
            sender.wait(WAIT)
        start = time.monotonic()
        if then == "still stopped":
            with pytest.raises(TimeoutError, match="is still stopped .not asked again."):
                duplicates.take_duplicate(duplicate, sender.pid)
        else:
            with pytest.raises(FileNotFoundError):
                duplicates.take_duplicate(duplicate, sender.pid)
            assert duplicates._SILENT == {}
        assert time.monotonic() - start < 0.05
    finally:
        sender.kill()
        sender.wait(WAIT)


def _socket_inodes() -> set[str]:
    found = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:"):
            found.add(target)
    return found


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # (os.fork with threads, Python >= 3.12)
def test_a_child_forked_during_a_take_does_not_keep_its_connection(monkeypatch, tmp_path):
    """A take runs on a user's thread while another forks (a DataLoader worker): the
    child closes its copies of the take's socket. Kept, the sender's resource sharer
    (one peer at a time, no timeout) waited on that connection for the child's life."""
    monkeypatch.setattr(duplicates, "DUPLICATE_TIMEOUT", 5.0)
    monkeypatch.setattr(duplicates, "_SILENT", {})
    listener, duplicate = _silent_sharer(tmp_path)
    before = _socket_inodes()

    def take():
        try:
            duplicates.take_duplicate(duplicate)
        except (OSError, EOFError):  # (the connection closed below: nothing handed over)
            pass

    taking = threading.Thread(target=take, daemon=True)
    reader, writer = os.pipe()
    accepted = None
    try:
        taking.start()
        listener.settimeout(WAIT)
        accepted, _ = listener.accept()
        ours = os.readlink(f"/proc/self/fd/{accepted.fileno()}")
        assert wait_until(lambda: _socket_inodes() - before - {ours}), "the take opened no socket"
        take_socket = _socket_inodes() - before - {ours}
        child = os.fork()
        if child == 0:  # (the child: says whether it has the take's socket, and exits)
            try:
                os.write(writer, b"kept" if _socket_inodes() & take_socket else b"none")
            finally:
                os._exit(0)
        os.close(writer)
        writer = None
        os.waitpid(child, 0)
        assert os.read(reader, 8) == b"none", "the forked child kept the take's connection"
    finally:
        if accepted is not None:
            accepted.close()  # (the take ends: the sharer closed the connection)
        listener.close()
        taking.join(WAIT)
        os.close(reader)
        if writer is not None:
            os.close(writer)
    assert not taking.is_alive() and duplicates._IN_FLIGHT == set()


def test_a_quick_take_sets_the_socket_options_a_few_times_only(monkeypatch):
    """Each read is bounded by the time left, but the options are set again only once
    more than 10 ms passed (11 settings of 2 system calls each made a take 22% slower)."""
    from multiprocessing import resource_sharer
    monkeypatch.setattr(duplicates, "_SILENT", {})
    fd = os.memfd_create("quick")
    try:
        os.close(duplicates.take_duplicate(resource_sharer.DupFd(fd)))  # (our resource sharer started)
        settings = []
        bound = duplicates._bound
        monkeypatch.setattr(duplicates, "_bound", lambda *args: (settings.append(args), bound(*args))[1])
        mine = duplicates.take_duplicate(resource_sharer.DupFd(fd))
        assert os.path.samestat(os.fstat(mine), os.fstat(fd))
        os.close(mine)
        assert 1 <= len(settings) <= 4, len(settings)
    finally:
        os.close(fd)
