"""Audit 21: only the process that adopted a shared non-tensor value releases it.

A fork child inherits its parent's adopted values and their release finalizers. Before,
a child that dropped its inherited copy and then made a value of its own told the
coordinator to release the PARENT's cell (its adopt_cells carried the release): once the
parent (the creator) exited, the value could no longer be attached, although the README
promises it stays attachable while its coordinator lives. Now the manager keys its holds
by (adopter pid, inode) and honours a release from the adopter only, the child's
inherited finalizers do nothing, and its inherited list of releases is cleared at fork.
Releases that an adopt_cells call failed to deliver are sent with the next one.

tensordict 0.15.3 has no coordinator: nothing to compare.
"""
from __future__ import annotations

import gc
import multiprocessing as mp
import os
import pickle

import pytest

import shared_td
from shared_td import NonTensorData, TensorDict
from shared_td.coordinator import client, ownership
from shared_td.coordinator.registry import Registry
from shared_td.platform import new_memfd

pytestmark = pytest.mark.timeout(120)

_td = None  # the worker's value, inherited by its fork child


def _grandchild():
    global _td
    _td = None  # drop the inherited copy (the parent still holds its own)
    gc.collect()
    TensorDict(t=NonTensorData(1)).memmap_(share_non_tensor=True)  # adopts: any releases go with it
    shared_td.Coordinator.current()  # waits for a background hand-over (embedded coordinator)


def _worker(coord, queue):
    """Make a value (adopted by ``coord``, or the embedded coordinator if None), fork a
    child that drops its copy and makes a value, then send the value's pickle and exit."""
    global _td
    try:
        if coord is not None:
            coord.__enter__()
        _td = TensorDict(s=NonTensorData("precious")).memmap_(share_non_tensor=True)
        shared_td.Coordinator.current()  # (the embedded hand-over done)
        child = mp.get_context("fork").Process(target=_grandchild)
        child.start()
        child.join(30)
        queue.put((child.exitcode, pickle.dumps(_td)))
        if coord is not None:
            client._leave(coord)  # (its manager is the test's to stop)
    except BaseException as err:
        queue.put((repr(err), None))
        raise


@pytest.mark.parametrize("start", ["fork", "spawn"])
def test_a_fork_childs_drop_never_releases_its_parents_value(start, monkeypatch):
    with shared_td.Coordinator(timeout=10) as coord:
        ctx = mp.get_context(start)
        if start == "spawn":  # the embedded coordinator of the spawned worker: this one
            monkeypatch.setenv(ownership.ENV_VAR, f"{coord.address};{coord.authkey.hex()}")
            given = None
        else:
            given = coord
        queue = ctx.Queue()
        worker = ctx.Process(target=_worker, args=(given, queue))
        worker.start()
        exitcode, blob = queue.get(timeout=60)
        worker.join(30)
        assert exitcode == 0 and worker.exitcode == 0
        # the creator exited: the value lives on in the coordinator's hold
        assert pickle.loads(blob)["s"] == "precious"


def test_the_manager_honours_a_release_from_the_adopter_only():
    registry = Registry()
    fd = new_memfd("fix21", 8)
    st = os.fstat(fd)
    key = (st.st_dev, st.st_ino)
    me = os.getpid()
    _pid, (held,) = registry.adopt_cells(me, [(fd, key)], [])
    registry.adopt_cells(me + 1, [], [key])  # another process (a fork child) releases it
    assert os.path.samestat(os.fstat(held), st)  # still held
    registry.adopt_cells(me, [], [key])  # the adopter does
    with pytest.raises(OSError):
        os.fstat(held)
    os.close(fd)


def test_releases_are_kept_when_the_adopt_call_fails(monkeypatch):
    with shared_td.Coordinator(timeout=10) as coord:
        client._RELEASED[coord.address] = [(1, 2)]

        def failing(*_args):
            raise TimeoutError("no answer")

        monkeypatch.setattr(coord, "_call", failing)
        with pytest.raises(TimeoutError):
            coord.adopt_slabs([])
        assert client._RELEASED.pop(coord.address) == [(1, 2)]


def test_a_fork_child_inherits_no_releases():
    client._RELEASED["/nowhere"] = [(1, 2)]
    try:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: reports whether it inherited the parent's list
            os.write(write, b"1" if client._RELEASED else b"0")
            os._exit(0)
        os.close(write)
        assert os.read(read, 1) == b"0"
        os.waitpid(pid, 0)
        os.close(read)
    finally:
        client._RELEASED.pop("/nowhere", None)
