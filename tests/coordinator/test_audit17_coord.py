"""The single-machine Coordinator findings of the session-17 audit ("Trust").

Real managers, real signals (SIGSTOP, SIGALRM), real resource limits set on the manager
process with ``prlimit`` (only its soft limits, which it may raise again), real Unix
sockets for peers that never authenticate. Each test resumes what it stopped in a
``finally``; every wait is bounded.
"""
from __future__ import annotations

import contextlib
import errno
import multiprocessing
import os
import pickle
import resource
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time

import pytest
import torch

from tests.coordinator import audit17_children as kids
from tests.processes import WAIT, finish, wait_until

import shared_td
from shared_td.errors import CoordinatorTimeoutError
from shared_td.coordinator import accepting, channels, process, server
from tests.processes import all_threads_stopped


class Interrupted(Exception):
    """What a signal handler raises in the middle of a call (a test-timeout plugin)."""


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@contextlib.contextmanager
def soft_limit(pid: int, which: int, soft: int):
    """Process ``pid``'s soft limit ``which`` set to ``soft`` for the block (its hard
    limit untouched, so the old soft limit can be given back)."""
    old = resource.prlimit(pid, which)
    resource.prlimit(pid, which, (soft, old[1]))
    try:
        yield
    finally:
        resource.prlimit(pid, which, old)


@contextlib.contextmanager
def in_process_server(tmp_path):
    """A manager's server in this process (so that its deadline can be short): its
    accept loop runs in a thread, ended (and checked ended: no spin) on leaving."""
    srv = accepting.Server({}, str(tmp_path / "sock"), b"k" * 32, "pickle")
    srv.stop_event = threading.Event()
    loop = threading.Thread(target=srv.accepter, daemon=True)
    loop.start()
    try:
        yield srv
    finally:
        srv.listener._listener._socket.shutdown(socket.SHUT_RDWR)  # wakes its accept()
        srv.listener.close()
        loop.join(5)
    assert not loop.is_alive()  # a closed listener ends the loop


def challenged_peer(address: str) -> socket.socket:
    """A raw connection to the manager at ``address`` that read its challenge and says
    nothing (an unauthenticated peer)."""
    peer = socket.socket(socket.AF_UNIX)
    peer.settimeout(WAIT)
    peer.connect(address)
    header = peer.recv(4)
    assert len(header) == 4
    (length,) = struct.unpack("!i", header)
    while length:
        length -= len(peer.recv(length))
    return peer


# ----------------------------------------------------------------------------- 1: HIGH

@pytest.mark.parametrize("raised", [KeyboardInterrupt, Interrupted])
def test_interrupted_call_never_hands_its_answer_to_the_next(raised):
    """A call interrupted (Ctrl-C, an exception from a signal handler) after its request
    was sent must not leave its answer for the next call: attach("y") got the
    tensordict of "x"."""
    def interrupt(*_):
        raise raised()

    # (pytest-timeout's own alarm, if it set one, is given back afterwards)
    previous, previous_timer = signal.signal(signal.SIGALRM, interrupt), signal.getitimer(signal.ITIMER_REAL)
    try:
        with shared_td.Coordinator(timeout=10) as coord:
            coord.publish("x", shared_td.TensorDict(secret=torch.full((2,), 7.0)))
            coord.publish("y", shared_td.TensorDict(public=torch.zeros(3)))
            pid = coord.pid
            os.kill(pid, signal.SIGSTOP)
            try:
                assert wait_until(lambda: all_threads_stopped(pid), timeout=10)
                signal.setitimer(signal.ITIMER_REAL, 0.2)  # while the request waits for its answer
                with pytest.raises(raised):
                    coord.attach("x")
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
                os.kill(pid, signal.SIGCONT)
            assert coord.layout("y")["name"] == "y"
            view = coord.attach("y")
            assert list(view.keys()) == ["public"] and view["public"].tolist() == [0.0] * 3
            assert coord.names() == ["x", "y"]
    finally:
        signal.signal(signal.SIGALRM, previous)
        if previous_timer[0] > 0:
            signal.setitimer(signal.ITIMER_REAL, *previous_timer)


def test_request_that_does_not_pickle_keeps_the_connection():
    """Nothing was sent: the connection is in step, and kept."""
    with shared_td.Coordinator(timeout=10) as coord:
        coord.names()
        kept = channels._CHANNELS[(os.getpid(), coord.address, coord.authkey)]
        with pytest.raises((pickle.PicklingError, TypeError, AttributeError)):
            channels.call(coord.address, coord.authkey, "layout", lambda: None, timeout=10)
        assert coord.names() == []
        assert channels._CHANNELS[(os.getpid(), coord.address, coord.authkey)] is kept


# ----------------------------------------------------------------------------- 2: the accept loop

def test_manager_out_of_descriptors_backs_off_and_accepts_again():
    """Out of descriptors, the manager's accept loop spun a core at 100%; once some are
    free again, it accepts the peers that waited."""
    with shared_td.Coordinator(timeout=5) as coord:
        pid = coord.pid
        coord.names()  # our connection, made before the limit
        peers = []
        try:
            with soft_limit(pid, resource.RLIMIT_NOFILE, open_fds(pid)):
                # two peers the manager cannot accept (no descriptor left for them)
                for _ in range(2):
                    peer = socket.socket(socket.AF_UNIX)
                    peer.connect(coord.address)
                    peers.append(peer)
                time.sleep(0.2)
                spent = cpu_seconds(pid)
                time.sleep(1.0)
                assert cpu_seconds(pid) - spent < 0.3  # spinning: ~1.0
                assert coord.names() == []  # an authenticated connection still works
            for peer in peers:  # accepted once descriptors are free (a pause of at most 0.25 s)
                peer.settimeout(5)
                assert len(peer.recv(4)) == 4  # the start of its challenge
        finally:
            for peer in peers:
                peer.close()


def test_manager_that_cannot_start_a_thread_keeps_accepting():
    """A failed thread start for one new connection killed the accept loop for good:
    the manager lived on and accepted nobody. Under a real memory limit, with silent
    peers holding the threads it allows: a client meanwhile gets CoordinatorTimeoutError
    within its timeout (never "gone"), and once the limit is lifted it is served."""
    with shared_td.Coordinator(timeout=3) as coord:
        pid = coord.pid
        coord.names()
        with open(f"/proc/{pid}/status") as status:
            vm = int(next(line for line in status if line.startswith("VmSize")).split()[1]) * 1024
        peers = []
        try:
            # room for a few 8 MiB thread stacks, not for eight: silent peers take them
            with soft_limit(pid, resource.RLIMIT_AS, vm + 20 * 2**20):
                for _ in range(8):
                    peer = socket.socket(socket.AF_UNIX)
                    peer.connect(coord.address)
                    peers.append(peer)
                    time.sleep(0.05)
                channels.drop_channel(coord.address)  # a new connection, not the one kept
                began = time.monotonic()
                with pytest.raises(CoordinatorTimeoutError) as caught:
                    shared_td.Coordinator.connect(coord.address, coord.authkey, timeout=1.5).names()
                assert "is gone" not in str(caught.value) and time.monotonic() - began < 4
        finally:
            for peer in peers:
                peer.close()
        channels.drop_channel(coord.address)
        assert shared_td.Coordinator.connect(coord.address, coord.authkey, timeout=10).names() == []


def test_a_thread_that_cannot_start_for_a_while_still_serves_the_connection(monkeypatch, tmp_path):
    """The session's own audit: a failed thread start closed the connection at once,
    and its client read an end of file from a live manager ("gone"). Now the start is
    tried again (an in-process server whose first three starts fail)."""
    failures = []

    class Flaky(threading.Thread):
        def start(self):
            if len(failures) < 3:
                failures.append(1)
                raise RuntimeError("can't start new thread")
            super().start()

    with in_process_server(tmp_path) as srv:
        with monkeypatch.context() as patched:
            patched.setattr(accepting.threading, "Thread", Flaky)
            challenged_peer(srv.address).close()  # challenged, not closed
        assert len(failures) == 3


def test_a_peer_that_dribbles_its_handshake_is_cut_off_at_the_deadline(monkeypatch, tmp_path):
    """The handshake's bound was each read's (a receive timeout): a peer that sent a byte
    of its answer now and then held a manager thread and descriptor for minutes."""
    monkeypatch.setattr(accepting, "HANDSHAKE_S", 0.6)
    with in_process_server(tmp_path) as srv:
        peer = challenged_peer(srv.address)
        peer.sendall(struct.pack("!i", 200))  # a 200-byte answer announced, then dribbled
        began, cut = time.monotonic(), False
        while time.monotonic() - began < 3 and not cut:
            time.sleep(0.15)  # (each byte well within the per-read bound)
            try:
                peer.sendall(b"x")
            except OSError:
                cut = True
        assert cut and time.monotonic() - began < 2
        peer.close()


def test_an_end_of_file_from_a_live_manager_is_not_a_gone_coordinator(tmp_path):
    """A live manager that closes a new connection in its handshake (it could start no
    thread for it) was reported gone, and ownership replaced it with a second one."""
    live = str(tmp_path / f"shared_td-coord-{os.getpid()}-abcdefgh" / "sock")
    err = channels._connect_error(live, EOFError())
    assert isinstance(err, CoordinatorTimeoutError) and f"manager process {os.getpid()} is alive" in str(err)
    exited = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                            text=True, timeout=60)
    dead = str(tmp_path / f"shared_td-coord-{int(exited.stdout)}-abcdefgh" / "sock")
    err = channels._connect_error(dead, EOFError())
    assert type(err) is ConnectionError and "is gone" in str(err)


def test_unauthenticated_peers_get_no_traceback_and_a_deadline(monkeypatch, tmp_path):
    """A peer that never completes the handshake held a thread and a descriptor of the
    manager for ever; one that sent a bad length header got a pickled traceback naming
    the server's files. (An in-process server, so that the deadline can be short.)"""
    monkeypatch.setattr(accepting, "HANDSHAKE_S", 0.3)
    with in_process_server(tmp_path) as srv:
        silent = challenged_peer(srv.address)
        started = time.monotonic()
        assert silent.recv(100) == b""  # closed by the manager
        assert time.monotonic() - started < 3
        silent.close()
        bad = challenged_peer(srv.address)
        bad.sendall(struct.pack("!i", 2**31 - 1) + b"x" * 10)
        try:
            said = bad.recv(1000)
        except ConnectionResetError:  # closed with our bytes unread
            said = b""
        assert said == b""  # closed, nothing said (was: '#TRACEBACK', ...)
        bad.close()


def test_manager_out_of_descriptors_names_itself():
    """EMFILE in the manager during a publish reached the client as a raw
    "[Errno 24] Too many open files: '/proc/<pid>/fd/4'", that reads like its own."""
    with shared_td.Coordinator(timeout=5) as coord:
        pid = coord.pid
        coord.names()
        with soft_limit(pid, resource.RLIMIT_NOFILE, open_fds(pid)):
            with pytest.raises(OSError) as caught:
                coord.publish("x", shared_td.TensorDict(a=torch.zeros(2)))
        assert caught.value.errno == errno.EMFILE
        assert f"manager process {pid}" in str(caught.value) and "RLIMIT_NOFILE" in str(caught.value)
        coord.publish("x", shared_td.TensorDict(a=torch.zeros(2)))  # once descriptors are free
        assert coord.names() == ["x"]


def test_manager_out_of_descriptors_in_an_adoption_keeps_none_of_its_cells():
    """adopt_cells kept each cell it had reopened before the one that failed; the
    creator records none of them as held (the call failed), so they were never released:
    each failed adoption deepened the shortage that failed it."""
    from shared_td.storage.shared_value import SharedValue

    with shared_td.Coordinator(timeout=5) as coord:
        pid = coord.pid
        coord.names()
        base = open_fds(pid)
        cells = [SharedValue.create(f"value {i}") for i in range(5)]
        with soft_limit(pid, resource.RLIMIT_NOFILE, base + 3):  # room for some of the 5
            with pytest.raises(OSError) as caught:
                coord.adopt_slabs([cell.slab for cell in cells])
        assert caught.value.errno == errno.EMFILE
        assert open_fds(pid) == base
        coord.adopt_slabs([cell.slab for cell in cells])  # once descriptors are free: all five
        assert open_fds(pid) == base + 5


# ----------------------------------------------------------------------------- 3: the client's own EMFILE

def test_client_out_of_descriptors_is_not_a_gone_coordinator():
    """The client's own EMFILE read "the coordinator is gone", and the announced
    coordinator was then dropped (and a second one would have been started)."""
    with shared_td.Coordinator(timeout=5) as coord:
        coord.publish("x", shared_td.TensorDict(a=torch.zeros(2)))
        ctx = multiprocessing.get_context("fork")
        queue = ctx.Queue()
        child = ctx.Process(target=kids.out_of_descriptors, args=(coord.address, coord.authkey, queue))
        child.start()
        try:
            outcomes, still_announced = queue.get(timeout=WAIT)
        finally:
            finish(child)
            queue.close()
            queue.join_thread()
    for kind, is_connection_error, number, message in outcomes:
        assert kind == "OSError" and not is_connection_error and number == errno.EMFILE, message
        assert "out of file descriptors (RLIMIT_NOFILE soft/hard = " in message
    assert still_announced


def test_publish_out_of_its_own_descriptors_says_so_with_the_limit():
    """The segment of a publish in a process out of descriptors was a bare "[Errno 24]
    Too many open files" (attach and connect said so, with the limit)."""
    with shared_td.Coordinator(timeout=5) as coord:
        ctx = multiprocessing.get_context("fork")
        queue = ctx.Queue()
        child = ctx.Process(target=kids.publish_without_descriptors, args=(coord, queue))
        child.start()
        try:
            kind, _, number, message = queue.get(timeout=WAIT)
        finally:
            finish(child)
            queue.close()
            queue.join_thread()
    assert kind == "OSError" and number == errno.EMFILE, message
    assert "RLIMIT_NOFILE" in message


# ----------------------------------------------------------------------------- 4, 5, 6

def test_pickled_handle_keeps_its_timeout():
    with shared_td.Coordinator(timeout=1.5) as coord:
        worker = pickle.loads(pickle.dumps(coord))
        assert worker._timeout == 1.5 and worker.names() == []


def test_long_tmpdir_is_refused_before_launch(monkeypatch, tmp_path):
    root = tmp_path / ("x" * max(1, 100 - len(str(tmp_path))))
    root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    started = time.monotonic()
    with pytest.raises(OSError, match="TMPDIR") as caught:
        shared_td.Coordinator().start()
    assert caught.value.errno == errno.ENAMETOOLONG and "107 bytes" in str(caught.value)
    assert time.monotonic() - started < 1 and os.listdir(root) == []


def test_manager_that_dies_before_listening_says_so(monkeypatch, tmp_path):
    """Was "did not start within 30 s" after 0.1 s."""
    monkeypatch.setenv("PYTHONHOME", str(tmp_path / "missing"))  # its interpreter cannot start
    with pytest.raises(RuntimeError, match="exited with code 1 before listening"):
        process.ServerProcess.start(os.urandom(32))


def test_manager_whose_owner_left_before_the_address_prints_nothing():
    """A manager whose owner is killed before it reads the address printed a
    BrokenPipeError traceback."""
    manager = subprocess.Popen(
        [sys.executable, "-c", process._BOOT, server.__file__, str(os.getpid())],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env=dict(os.environ, TMPDIR=tempfile.gettempdir()),
    )
    manager.stdout.close()  # the owner's end of the pipe is gone before the report
    try:
        _, err = manager.communicate(os.urandom(32), timeout=WAIT)
    except subprocess.TimeoutExpired:
        manager.kill()
        manager.communicate(timeout=WAIT)
        pytest.fail("the manager did not stop")
    assert manager.returncode == 0 and b"Traceback" not in err, err.decode()
