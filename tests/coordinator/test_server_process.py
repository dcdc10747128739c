"""One manager lifecycle (ServerProcess) for every coordinator, a manager that holds only
plain data, and the engine's hook for new shared cells.

Every wait is bounded; real processes, real signals.
"""
from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import stat
import subprocess
import sys
import textwrap

import pytest
import torch

from tests.processes import WAIT, alive, finish, wait_until
from tests.coordinator.test_leaks import holders_of

import shared_td
from shared_td.coordinator import ownership
from shared_td.coordinator.process import ServerProcess
from shared_td.storage import shared_value


@shared_td.tensorclass
class Pose:
    """Defined in this test module, which a fresh interpreter cannot import."""

    x: torch.Tensor
    label: str


def holds_torch(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as maps:
        return any("libtorch" in line for line in maps)


# ------------------------------------------------------------------ ServerProcess

@pytest.mark.timeout(60)
def test_start_and_stop_remove_the_process_and_its_private_directory():
    process = ServerProcess.start(os.urandom(32))
    directory = os.path.dirname(process.address)
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700 and alive(process.pid)
    assert f"-{process.pid}-" in os.path.basename(directory)
    process.stop(timeout=5)
    assert not alive(process.pid) and not os.path.exists(directory)
    process.stop(timeout=5)  # idempotent


@pytest.mark.timeout(60)
def test_stop_after_a_sigkill_reaps_it_and_removes_its_directory():
    process = ServerProcess.start(os.urandom(32))
    directory = os.path.dirname(process.address)
    os.kill(process.pid, signal.SIGKILL)
    assert wait_until(lambda: not alive(process.pid))
    assert os.path.isdir(directory)  # a killed server cannot clean up
    process.stop(timeout=5)
    assert not os.path.exists(directory)
    with pytest.raises(ChildProcessError):
        os.waitpid(process.pid, os.WNOHANG)  # reaped: no zombie left


def _stop_in_child(process: ServerProcess, queue) -> None:
    process.stop(timeout=5)
    queue.put("stopped")


@pytest.mark.timeout(60)
def test_only_the_owner_stops_it():
    ctx = multiprocessing.get_context("fork")
    with shared_td.Coordinator() as coord:
        queue = ctx.Queue()
        child = ctx.Process(target=_stop_in_child, args=(coord._process, queue))
        child.start()
        assert queue.get(timeout=WAIT) == "stopped" and finish(child) == 0
        assert coord.names() == []  # the fork child's copy stopped nothing
        pid = coord.pid
    assert wait_until(lambda: not alive(pid))


@pytest.mark.timeout(60)
def test_a_collected_started_coordinator_stops_its_manager():
    coord = shared_td.Coordinator().start()
    pid, directory = coord.pid, os.path.dirname(coord.address)
    del coord
    gc.collect()
    assert wait_until(lambda: not alive(pid)) and not os.path.exists(directory)


@pytest.mark.timeout(180)
def test_a_process_that_exits_stops_the_manager_it_started():
    # Stopped by the exiting process itself, not 0.2 s later by the manager's watch of
    # its parent: a check registered first runs last at exit, and finds it gone.
    body = textwrap.dedent("""
        import atexit, os, weakref

        def check():
            try:
                os.kill(coord_pid, 0)
                print("manager still running at exit", flush=True)
            except ProcessLookupError:  # stopped and reaped
                print("manager stopped at exit", flush=True)

        assert not weakref.finalize._registered_with_atexit  # so check() runs after it
        atexit.register(check)
        import shared_td
        coord = shared_td.Coordinator().start()
        coord_pid = coord.pid
        print(coord_pid, coord.address, flush=True)
    """)  # and exits without shutdown()
    result = subprocess.run([sys.executable, "-c", body], capture_output=True, text=True,
                            timeout=4 * WAIT)  # importing torch on a busy machine
    assert result.returncode == 0, result.stderr[-3000:]
    first, last = result.stdout.splitlines()
    pid, address = first.split()
    assert last == "manager stopped at exit"
    assert not alive(int(pid)) and not os.path.exists(os.path.dirname(address))


@pytest.mark.timeout(120)
def test_a_manager_whose_parent_died_before_it_ran_stops_too(short_tmp_path):
    """The parent was SIGKILLed right after starting the manager, before the manager's
    interpreter ran its first line, while another process held the read end of the
    manager's stdout (a fork made meanwhile by another thread of the parent): the
    manager's own ``os.getppid()`` named the reaper, which it watched for ever, keeping
    the parent's memory. It stops within seconds and removes its private directory."""
    body = textwrap.dedent("""
        import os, sys, time
        from shared_td.coordinator.process import ServerProcess
        popen = ServerProcess._launch(os.urandom(32))
        holder = os.fork()
        if holder == 0:  # holds the manager's stdout open, as a fork of the parent would
            time.sleep(60)
            os._exit(0)
        print(popen.pid, holder, flush=True)
        os._exit(0)  # at once: the manager's interpreter is still starting
    """)
    parent = subprocess.Popen([sys.executable, "-c", body], stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, TMPDIR=str(short_tmp_path)))
    pid = holder = None
    try:
        pid, holder = (int(number) for number in parent.stdout.readline().split())
        assert parent.wait(WAIT) == 0
        assert wait_until(lambda: not alive(pid), WAIT), "the manager outlived its parent"
        assert wait_until(lambda: not os.listdir(short_tmp_path), WAIT), os.listdir(short_tmp_path)
    finally:
        for left in (pid, holder):
            if left is not None and alive(left):
                os.kill(left, signal.SIGKILL)  # the holder, and the manager when the test fails
        parent.kill()
        parent.wait(WAIT)
        parent.stdout.close()


def test_context_is_deprecated_and_ignored():
    with pytest.warns(DeprecationWarning, match=r"context=.*ignored"):
        coord = shared_td.Coordinator(context="fork")
    with coord:
        assert coord.names() == []


# ------------------------------------------------------------------ a manager of plain data

@pytest.mark.timeout(60)
def test_the_manager_never_loads_torch_nor_unpickles_what_is_published(tmp_path):
    # Pose lives in this test module, which the manager's fresh interpreter cannot import:
    # publishing it works only because the manager keeps the pickle as opaque bytes.
    pose = Pose(x=torch.zeros(3), label="left", batch_size=[])
    with shared_td.Coordinator() as coord:
        coord.publish("pose", pose, share_non_tensor=True)
        coord.publish("td", shared_td.TensorDict(a=torch.ones(2), b="walk"), share_non_tensor=True)
        coord.publish("files", shared_td.TensorDict(a=torch.ones(2)), prefix=tmp_path / "f")
        assert not holds_torch(coord.pid)
        view = coord.attach("pose")
        assert type(view) is Pose and view.label == "left"
        view.x[1] = 5.0
        assert pose.x.tolist() == [0.0, 5.0, 0.0]
        layout = coord.layout("pose")
        assert layout["class"] == "Pose" and layout["name"] == "pose"
        assert coord.attach("td")["b"] == "walk"


@pytest.mark.timeout(60)
def test_the_manager_lets_go_of_a_replaced_tensordicts_memory():
    with shared_td.Coordinator() as coord:
        manager = coord.pid
        first = coord.publish("x", shared_td.TensorDict(a=torch.zeros(2)))
        inode = first["a"]._backing.key[1]
        assert holders_of(inode, [manager]) == [manager]
        coord.publish("x", shared_td.TensorDict(a=torch.ones(2)))  # a new segment
        assert holders_of(inode, [manager]) == []
        assert coord.attach("x")["a"].tolist() == [1.0, 1.0]


# ------------------------------------------------------------------ the engine's hook

def test_memmap_hands_its_new_slab_to_the_registered_adopter():
    """One slab (memfd) per memmap_ call holds all its new cells."""
    from shared_td.storage.shared_value import SharedValue

    handed = []
    shared_value.set_slab_adopter(handed.append)
    try:
        td = shared_td.TensorDict(a="x", b="y").memmap_(share_non_tensor=True)
        shared_td.TensorDict(c=torch.zeros(1)).memmap_(share_non_tensor=True)  # no cell: no call
        shared_td.TensorDict(d="z").memmap_()  # not shared: no call
    finally:
        shared_value.set_slab_adopter(ownership.adopt)
    assert len(handed) == 1 and len(handed[0]) == 1
    (slab,) = handed[0]
    cells = {cell.get(): cell for cell in (slab.cell(index, SharedValue) for index in range(slab.cells))}
    assert sorted(cells) == ["x", "y"]
    cells["x"].set("X")  # the very cells the tensordict reads
    assert td["a"] == "X" and td["b"] == "y"


def test_the_coordinator_package_registers_its_adopter():
    assert shared_value._ADOPTER is ownership.adopt
