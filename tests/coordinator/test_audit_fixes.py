"""Coordinator fixes from an audit: attach racing a republish or an unpublish, wrong and
malformed authkeys, the sweep of a live coordinator in another pid namespace, refresh
once the manager is gone, unpicklable non-tensor values, a SharedCounter whose sender
exited. Each test made its failure visible before its fix."""
from __future__ import annotations

import multiprocessing
import os
import pickle
import select
import shutil
import signal
import subprocess
import sys
import threading
import time

import multiprocess
import pytest
import torch

from tests.coordinator import audit_children as kids
from tests.processes import WAIT, alive, finish

import shared_td
from shared_td import platform
from shared_td.coordinator import client, published, server
from shared_td.errors import SegmentUnavailableError

RACE_SECONDS = 2.0  # how long a child attaches while the parent republishes


def pair(i: float) -> shared_td.TensorDict:
    return shared_td.TensorDict(a=torch.full((100,), float(i)), b=torch.full((100,), float(i)))


def race(method: str, how: str, step) -> tuple:
    """A child attaches "x" for RACE_SECONDS (``how``) while this process calls
    ``step(coord, i)`` in a loop; the child's report."""
    ctx = multiprocessing.get_context(method)
    with shared_td.Coordinator() as coord:
        coord.publish("x", pair(0))
        queue = ctx.Queue()
        child = ctx.Process(target=kids.attach_for,
                            args=(coord.address, coord.authkey, "x", RACE_SECONDS, how, queue))
        child.start()
        try:
            assert queue.get(timeout=WAIT) == ("ready",)
            report, i, hard_stop = None, 0, time.monotonic() + RACE_SECONDS + WAIT
            while report is None and time.monotonic() < hard_stop:
                i += 1
                step(coord, i)
                if not queue.empty():
                    report = queue.get(timeout=WAIT)
            assert report is not None, "the child never reported"
        finally:
            assert finish(child) == 0
    return report, i


def republish(coord, i):
    coord.publish("x", pair(i))


def publish_then_unpublish(coord, i):
    td = pair(i)
    td["s"] = shared_td.NonTensorData("v")
    coord.publish("x", td, share_non_tensor=True)
    coord.unpublish("x")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", ["fork", "spawn"])
@pytest.mark.parametrize("how", ["attach", "refresh"])
def test_attach_racing_a_republish_gets_a_whole_version(method, how):
    # the manager closed a replaced version's descriptors before the child reopened
    # them: SegmentUnavailableError ("process <manager> ... has exited") before the fix
    (kind, ok, missing, torn, other, sample), republished = race(method, how, republish)
    assert kind == "done"
    assert (other, torn, missing) == (0, 0, 0), sample
    assert ok > 0 and republished > 1


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_attach_racing_an_unpublish_gets_the_tensordict_or_a_key_error(method):
    (kind, ok, missing, torn, other, sample), _ = race(method, "attach", publish_then_unpublish)
    assert kind == "done"
    assert (other, torn) == (0, 0), sample
    assert ok + missing > 0


def test_attach_asks_again_only_while_the_version_changes(monkeypatch):
    # a version whose memory cannot be opened although the manager still publishes it
    # is no race: raised after one more try, not retried until the timeout
    tries = []

    def unavailable(*args):
        tries.append(args[0])
        raise SegmentUnavailableError("gone")

    with shared_td.Coordinator() as coord:
        coord.publish("x", pair(1))
        monkeypatch.setattr(published, "rebuild", unavailable)
        with pytest.raises(SegmentUnavailableError):
            coord.attach("x")
    assert len(tries) == 2 and tries[0] == tries[1]


# --------------------------------------------------------------------------- authkeys

def test_a_wrong_authkey_names_the_address_and_is_caught_as_before():
    with shared_td.Coordinator() as coord:
        coord.publish("x", pair(1))
        for attempt in (
            lambda: shared_td.attach("x", address=coord.address, authkey=os.urandom(32), timeout=5),
            lambda: shared_td.attach("x", address=coord.address, authkey=os.urandom(32).hex(), timeout=5),
            lambda: shared_td.Coordinator.connect(coord.address, os.urandom(32), timeout=5),
        ):
            with pytest.raises(client.CoordinatorAuthenticationError) as caught:
                attempt()
            message = str(caught.value)
            assert coord.address in message and "does not match" in message
            assert "is gone" not in message  # the coordinator is there
            # what callers caught before still catches it
            assert isinstance(caught.value, ConnectionError)
            assert isinstance(caught.value, multiprocess.AuthenticationError)
            assert isinstance(caught.value, multiprocessing.AuthenticationError)
        # the right key still works after the refusals
        assert shared_td.attach("x", address=coord.address, authkey=coord.authkey.hex())["a"][0] == 1


@pytest.mark.parametrize("key, error, says", [
    ("zz-not-hex", ValueError, "not hexadecimal"),
    (b"", ValueError, "is empty"),
    ("", ValueError, "is empty"),
    (5, TypeError, "must be bytes or their hex str"),
])
def test_a_malformed_authkey_says_what_a_key_looks_like(key, error, says):
    with pytest.raises(error, match=says) as caught:
        shared_td.attach("x", address="/nowhere/sock", authkey=key, timeout=5)
    assert "Coordinator.authkey" in str(caught.value)


# --------------------------------------------------------------------------- the sweep

def fake_dir(root, pid: int):
    path = root / f"shared_td-coord-{pid}-abcd1234"
    path.mkdir()
    return path


def dead_pid() -> int:
    child = multiprocessing.get_context("fork").Process(target=os.getpid)
    child.start()
    finish(child)
    return child.pid


def test_sweep_spares_a_locked_directory_whose_pid_looks_dead(tmp_path):
    # as a live manager in another pid namespace: its pid means nothing here, its lock does
    path = fake_dir(tmp_path, dead_pid())
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert platform.try_flock(fd)
        assert server.sweep_dead_dirs(str(tmp_path)) == []
        assert path.is_dir()
    finally:
        os.close(fd)
    assert server.sweep_dead_dirs(str(tmp_path)) == [str(path)]  # unlocked: removed
    assert not path.exists()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_sweep_removes_a_directory_once_its_lock_holder_is_killed(tmp_path, method):
    ctx = multiprocessing.get_context(method)
    path = fake_dir(tmp_path, dead_pid())
    queue = ctx.Queue()
    holder = ctx.Process(target=kids.hold_flock, args=(str(path), queue))
    holder.start()
    try:
        assert queue.get(timeout=WAIT)[0] == "locked"
        assert server.sweep_dead_dirs(str(tmp_path)) == [] and path.is_dir()
    finally:
        holder.kill()
        finish(holder)
    assert server.sweep_dead_dirs(str(tmp_path)) == [str(path)]  # the kernel dropped it


def test_a_manager_holds_the_lock_of_its_directory():
    with shared_td.Coordinator() as coord:
        directory = os.path.dirname(coord.address)
        assert server.DIR_PATTERN.match(os.path.basename(directory))
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            assert not platform.try_flock(fd)
        finally:
            os.close(fd)


_INNER = """
import os, sys, torch, shared_td
# the manager (this process's next child) gets the pid that is dead outside
with open("/proc/sys/kernel/ns_last_pid", "w") as f:
    f.write(str(int(sys.argv[1]) - 1))
coord = shared_td.Coordinator().start()
coord.publish("x", shared_td.TensorDict(a=torch.zeros(2)))
print(coord.address, coord.authkey.hex(), flush=True)
sys.stdin.readline()
coord.shutdown()
"""


@pytest.mark.timeout(120)
def test_sweep_spares_a_live_coordinator_in_another_pid_namespace(short_tmp_path):
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1) to make a pid namespace")
    probe = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"],
                           capture_output=True, timeout=WAIT)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a pid namespace here (needs root): {probe.stderr.decode().strip()}")
    target = dead_pid()
    inner = subprocess.Popen(
        ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", _INNER, str(target)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env=dict(os.environ, TMPDIR=str(short_tmp_path)),
    )
    try:
        ready, _, _ = select.select([inner.stdout], [], [], 90)
        assert ready, "the coordinator in the other pid namespace did not start"
        address, key = inner.stdout.readline().split()
        directory = os.path.dirname(address)
        pid = int(server.DIR_PATTERN.match(os.path.basename(directory)).group(1))
        if alive(pid):
            pytest.skip(f"the other namespace's manager pid {pid} is alive here too")
        assert server.sweep_dead_dirs(str(short_tmp_path)) == []
        assert os.path.exists(address)
        assert shared_td.Coordinator.connect(address, key, timeout=WAIT).names() == ["x"]
        inner.stdin.write("\n")
        inner.stdin.flush()
        assert inner.wait(WAIT) == 0
        assert not os.path.exists(directory)  # removed by its own manager
    finally:
        if inner.poll() is None:
            inner.kill()
            inner.wait(WAIT)


# --------------------------------------------------------------------------- refresh

@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_refresh_raises_once_the_manager_is_killed(method):
    ctx = multiprocessing.get_context(method)
    coord = shared_td.Coordinator().start()
    try:
        coord.publish("w", pair(1))
        view = coord.attach("w")
        assert shared_td.refresh(view) is view  # not stale, manager alive
        rounds = 2000
        begin = time.perf_counter()
        for _ in range(rounds):
            shared_td.refresh(view)
        assert (time.perf_counter() - begin) / rounds < 100e-6  # no round trip (~100 us)
        go, queue = ctx.Event(), ctx.Queue()
        child = ctx.Process(target=kids.refresh_after_kill,
                            args=(coord.address, coord.authkey, "w", go, queue))
        child.start()
        assert queue.get(timeout=WAIT) == ("ready",)
        pid = coord._process.pid
        # wait on a pidfd, not the pid's state: the leader of a killed multi-threaded
        # process is a zombie while its other threads still exit, and a pidfd becomes
        # readable only once all of them are gone
        exited, pidfd = select.poll(), os.pidfd_open(pid)
        try:
            exited.register(pidfd, select.POLLIN)
            os.kill(pid, signal.SIGKILL)
            assert exited.poll(WAIT * 1000)
        finally:
            os.close(pidfd)
        go.set()
        kind, stale, message = queue.get(timeout=WAIT)
        assert finish(child) == 0
        assert (kind, stale) == ("ConnectionError", False)
        assert coord.address in message and str(pid) in message
        assert not shared_td.is_stale(view)  # the table answers what was last published
        with pytest.raises(ConnectionError, match=f"is gone .*{pid}"):
            shared_td.refresh(view)
    finally:
        coord.shutdown()


# --------------------------------------------------------------------------- messages

@pytest.mark.parametrize("share", [False, True])
def test_publishing_an_unpicklable_value_names_its_key(share):
    td = shared_td.TensorDict(a=torch.zeros(2), nested=shared_td.TensorDict(
        s=shared_td.NonTensorData(threading.Lock())))
    with shared_td.Coordinator() as coord:
        with pytest.raises(TypeError) as caught:
            coord.publish("u", td, share_non_tensor=share)
        assert coord.names() == []
    message = str(caught.value)
    assert "'u'" in message and "('nested', 's')" in message and "picklable" in message


@pytest.mark.timeout(60)
def test_a_counter_whose_sender_exited_says_it_may_be_a_counter():
    code = "import pickle, sys, shared_td; sys.stdout.write(pickle.dumps(shared_td.SharedCounter(5)).hex())"
    sent = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=WAIT, check=True).stdout
    with pytest.raises(SegmentUnavailableError) as caught:
        pickle.loads(bytes.fromhex(sent))
    message = str(caught.value)
    assert "SharedCounter" in message and "keep the sender alive" in message
    assert "give tensors a filename for data" not in message  # the old, tensor-only advice
