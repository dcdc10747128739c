"""A stalled coordinator never hangs a caller past its timeout ("Trust", item 7).

The manager is stopped with a real SIGSTOP: it still holds its socket, so the kernel
accepts connections (until the listen backlog is full) but nothing ever answers. Every
call, including a first connection's authkey handshake, must then end with an error that
is both a ConnectionError and a TimeoutError and names the address, within about the
caller's timeout; and no process-wide lock may be held meanwhile, so calls to a healthy
coordinator from other threads go on. Each test resumes or kills what it stopped in a
``finally``; every join and queue read is bounded.
"""
from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from tests.coordinator import coord_children as kids
from tests.processes import WAIT, alive, all_threads_stopped, finish, wait_until

import shared_td
from shared_td.coordinator import ownership


@contextlib.contextmanager
def stopped(pid: int):
    """Process ``pid`` stopped with SIGSTOP for the block (every thread of it: the
    signal is delivered asynchronously), resumed afterwards."""
    os.kill(pid, signal.SIGSTOP)
    try:
        assert wait_until(lambda: all_threads_stopped(pid), timeout=10)
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


@contextlib.contextmanager
def foreign_coordinator(tmp_path):
    """A coordinator started by a forked child (so this process has no connection to
    it yet): yields (address, authkey, manager pid); the child is killed afterwards,
    and its manager stops with it."""
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    owner = ctx.Process(target=kids.own_coordinator_then_wait, args=(str(tmp_path / "f"), queue))
    owner.start()
    try:
        address, authkey, manager = queue.get(timeout=WAIT)
        yield address, authkey, manager
    finally:
        owner.kill()
        finish(owner)
        queue.close()
        queue.join_thread()
        if "manager" in locals():
            os.kill(manager, signal.SIGCONT)  # a stopped manager cannot notice its parent died
            assert wait_until(lambda: not alive(manager), timeout=15)


def in_thread(target, *args, **kwargs):
    """Run ``target`` in a daemon thread; returns (thread, outcome dict) where the
    outcome gets ``result`` or ``error`` and ``seconds``."""
    outcome = {}

    def body():
        started = time.monotonic()
        try:
            outcome["result"] = target(*args, **kwargs)
        except BaseException as err:
            outcome["error"] = err
        outcome["seconds"] = time.monotonic() - started

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread, outcome


def assert_stalled_error(err, address, timeout):
    assert isinstance(err, ConnectionError) and isinstance(err, TimeoutError), repr(err)
    message = str(err)
    assert address in message and f"within {timeout:g} s" in message, message
    assert "stopped" in message and "kill -CONT" in message, message


@pytest.mark.timeout(90)
def test_attach_from_a_new_process_to_a_stopped_manager_raises_within_its_timeout(tmp_path):
    # a new (spawned) process: no connection yet, so the handshake itself must be bounded
    ctx = multiprocessing.get_context("spawn")
    with foreign_coordinator(tmp_path) as (address, authkey, manager):
        with stopped(manager):
            queue = ctx.Queue()
            child = ctx.Process(target=kids.attach_timed, args=(address, authkey, "anon", 2, queue))
            child.start()
            try:
                outcome = queue.get(timeout=WAIT)
            finally:
                child.kill()
                finish(child)
        kind, is_connection, is_timeout, message, seconds = outcome
        assert is_connection and is_timeout, outcome
        assert address in message and "within 2 s" in message, message
        assert 1.9 <= seconds < 3.5, seconds
        # resumed, it answers again
        assert shared_td.attach("anon", address=address, authkey=authkey)["a"].tolist() == [1.0, 1.0]


@pytest.mark.timeout(90)
def test_a_stalled_coordinator_holds_up_no_other_thread(tmp_path):
    healthy = shared_td.Coordinator().start()  # no call yet: no connection either
    try:
        with foreign_coordinator(tmp_path) as (address, authkey, manager):
            with stopped(manager):
                blocked, blocked_outcome = in_thread(
                    shared_td.attach, "anon", address=address, authkey=authkey, timeout=3)
                time.sleep(0.3)  # it is inside the handshake now
                started = time.monotonic()
                other, other_outcome = in_thread(
                    lambda: shared_td.Coordinator.connect(healthy.address, healthy.authkey).names())
                other.join(WAIT)
                assert other_outcome.get("result") == [], other_outcome
                assert time.monotonic() - started < 1.0, other_outcome
                assert blocked.is_alive()  # still waiting for the stopped one, bounded
                blocked.join(WAIT)
                assert not blocked.is_alive()
            assert_stalled_error(blocked_outcome["error"], address, 3)
            assert blocked_outcome["seconds"] < 4.5, blocked_outcome
    finally:
        healthy.shutdown()


@pytest.mark.timeout(90)
def test_a_call_on_an_open_connection_to_a_stopped_manager_times_out(tmp_path):
    with shared_td.Coordinator(timeout=1) as coord:
        coord.publish("x", shared_td.TensorDict(a=torch.ones(2)))
        manager = coord.pid  # the connection is made
        with stopped(manager):
            for call in [coord.names, lambda: coord.attach("x")]:
                started = time.monotonic()
                with pytest.raises(TimeoutError) as caught:
                    call()
                assert time.monotonic() - started < 2.5
                assert_stalled_error(caught.value, coord.address, 1)
            # a second thread queued behind a stalled call waits no longer than its own timeout
            first, first_outcome = in_thread(coord.names)
            second, second_outcome = in_thread(coord.names)
            first.join(WAIT)
            second.join(WAIT)
            for outcome in (first_outcome, second_outcome):
                assert_stalled_error(outcome["error"], coord.address, 1)
                assert outcome["seconds"] < 2.5, outcome
        assert coord.names() == ["x"]  # resumed: a new connection works


@pytest.mark.timeout(90)
def test_a_full_listen_backlog_is_a_timeout_too(tmp_path):
    with foreign_coordinator(tmp_path) as (address, authkey, manager):
        probes = []
        try:
            with stopped(manager):
                while True:  # fill the stopped manager's backlog: connect() would block
                    probe = socket.socket(socket.AF_UNIX)
                    probe.setblocking(False)
                    try:
                        probe.connect(address)
                    except BlockingIOError:
                        probe.close()
                        break
                    probes.append(probe)
                    assert len(probes) < 10_000
                attaching, outcome = in_thread(
                    shared_td.attach, "anon", address=address, authkey=authkey, timeout=1)
                attaching.join(10)
                assert not attaching.is_alive(), "attach blocked in connect()"
                assert_stalled_error(outcome["error"], address, 1)
                assert outcome["seconds"] < 2.5, outcome
        finally:
            for probe in probes:
                probe.close()


@pytest.mark.timeout(90)
def test_leaving_a_with_block_stops_a_stopped_manager_in_bounded_time():
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=kids.stop_own_manager_then_leave, args=(queue,))
    child.start()
    manager = None
    try:
        _, manager, address = queue.get(timeout=WAIT)
        kind, seconds, _ = queue.get(timeout=WAIT)
        assert kind == "left" and seconds < 10, seconds
        assert finish(child) == 0
        assert wait_until(lambda: not alive(manager), timeout=5)
        assert not os.path.exists(os.path.dirname(address))
    finally:
        child.kill()
        finish(child)
        if manager is not None and alive(manager):
            os.kill(manager, signal.SIGCONT)
            os.kill(manager, signal.SIGKILL)


@pytest.mark.timeout(120)
def test_share_non_tensor_with_a_stopped_embedded_coordinator_raises_within_its_timeout():
    # A process whose environment announces a coordinator (its parent's embedded one)
    # hands its shared values to it: stopped, that is a clear error, not a hang, and not
    # a second coordinator started behind the user's back.
    body = textwrap.dedent("""
        import json, time, shared_td
        from shared_td.coordinator import ownership
        ownership.TIMEOUT = 2
        started = time.monotonic()
        try:
            shared_td.TensorDict(task="walk").memmap_(share_non_tensor=True)
            outcome = {"error": None}
        except BaseException as err:
            outcome = {"error": type(err).__name__, "message": str(err),
                       "timeout": isinstance(err, TimeoutError)}
        outcome["seconds"] = time.monotonic() - started
        outcome["embedded"] = ownership._EMBEDDED is not None
        print(json.dumps(outcome))
    """)
    with shared_td.Coordinator() as coord:
        env = dict(os.environ, **{ownership.ENV_VAR: f"{coord.address};{coord.authkey.hex()}"})
        with stopped(coord.pid):
            result = subprocess.run([sys.executable, "-c", body], env=env,
                                    capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr[-3000:]
        outcome = json.loads(result.stdout.strip().splitlines()[-1])
        assert outcome["error"] == "CoordinatorTimeoutError" and outcome["timeout"], outcome
        assert coord.address in outcome["message"] and "within 2 s" in outcome["message"]
        assert outcome["seconds"] < 3.5 and not outcome["embedded"], outcome
