"""The Coordinator with real processes: fork and spawn workers, real SIGKILLs, leak checks.

Every join and queue read is bounded; a hung child fails the test instead of the run.
"""
from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import socket
import stat
import tempfile
import time

import multiprocess
import pytest
import torch

from tests.coordinator import coord_children as kids
from tests.leakcheck import ShmWatch, foreign_churn, private_tempdir
from tests.processes import WAIT, alive, finish, wait_until

import shared_td
from shared_td.coordinator import server


def run(ctx, target, *args):
    """Start ``target`` in a ``ctx`` process; returns (process, queue)."""
    queue = ctx.Queue()
    process = ctx.Process(target=target, args=(*args, queue))
    process.start()
    return process, queue


def open_descriptors() -> dict[str, str]:
    """This process's open descriptors and what they name (after a collection: garbage
    of earlier tests must not close descriptors between two calls)."""
    gc.collect()
    fds = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the listdir descriptor itself
            pass
    return fds


def assert_nothing_left(shm: ShmWatch, tempdir: str, fds_before: dict) -> None:
    """Only what our processes made counts (another program may run beside the test):
    the entries left in the private temp directory, the /dev/shm entries that our
    processes held and left (see leakcheck), and the descriptors this process opened and
    still holds. A descriptor of before that is gone is no leak: a store server thread of
    an earlier test closes its end of a connection whenever that peer's process ends."""
    assert os.listdir(tempdir) == []
    assert shm.leftovers() == []
    opened = opened_since(fds_before)
    assert opened == {}, opened


def opened_since(before: dict) -> dict:
    """The descriptors opened since ``before`` (an ``open_descriptors()``) and still
    held: only these count, since one listed before may close meanwhile (see above)."""
    now = open_descriptors()
    return {fd: name for fd, name in now.items() if before.get(fd) != name}


def tree(n=3):
    return shared_td.TensorDict(
        {"obs": torch.zeros(4, 2), "nested": {"r": torch.arange(4.0)}}, batch_size=[4]
    )


# ------------------------------------------------------------------ in one process

@pytest.mark.timeout(60)
@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_lifecycle_private_socket_and_authkey(context):
    coord = shared_td.Coordinator(context=context)
    with pytest.raises(RuntimeError, match="not started"):
        coord.address
    with coord:
        directory, sock = os.path.split(coord.address)
        assert server.DIR_PATTERN.match(os.path.basename(directory))
        assert os.path.dirname(directory) == tempfile.gettempdir()
        assert f"-{coord.pid}-" in directory
        assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
        assert stat.S_ISSOCK(os.stat(coord.address).st_mode) and sock == "sock"
        assert isinstance(coord.authkey, bytes) and len(coord.authkey) == 32
        with pytest.raises(RuntimeError, match="already started"):
            coord.start()
        # a wrong key is refused by the handshake
        with pytest.raises(multiprocess.AuthenticationError):
            shared_td.attach("x", address=coord.address, authkey=os.urandom(32))
        # nothing on the network: the socket is AF_UNIX
        probe = socket.socket(socket.AF_UNIX)
        probe.connect(coord.address)
        probe.close()
        pid = coord.pid
    assert not os.path.exists(directory)
    assert wait_until(lambda: not alive(pid))
    coord.shutdown()  # idempotent


@pytest.mark.timeout(60)
def test_publish_attach_layout_versions_unpublish(tmp_path):
    with shared_td.Coordinator() as coord:
        td = coord.publish("anon", tree())
        assert td.is_memmap() and td.is_locked
        coord.publish("file", tree(), prefix=tmp_path / "f")
        assert coord.names() == ["anon", "file"]

        layout = coord.layout("anon")
        assert layout["version"] == 1 and layout["class"] == "TensorDict"
        assert layout["batch_size"] == [4]
        assert {leaf["key"]: leaf["where"] for leaf in layout["leaves"]} == {
            "obs": "anonymous", "nested.r": "anonymous"}
        assert {leaf["key"]: (leaf["shape"], leaf["dtype"]) for leaf in layout["leaves"]} == {
            "obs": ([4, 2], "torch.float32"), "nested.r": ([4], "torch.float32")}
        wheres = [leaf["where"] for leaf in coord.layout("file")["leaves"]]
        assert all(w.startswith(str(tmp_path / "f")) for w in wheres), wheres

        for name in ["anon", "file"]:
            view = coord.attach(name)
            assert view.is_locked
            view["nested", "r"][2] = 42.0
            assert coord.attach(name)["nested", "r"][2] == 42.0
        assert td["nested", "r"][2] == 42.0  # the same memory, no copy

        coord.publish("anon", tree())
        assert coord.layout("anon")["version"] == 2
        assert coord.attach("anon")["nested", "r"][2] == 2.0  # the new tensordict

        with pytest.raises(KeyError, match=r"'nope'.*\['anon', 'file'\]"):
            coord.attach("nope")
        coord.unpublish("anon")
        assert coord.names() == ["file"]
        with pytest.raises(KeyError, match="anon"):
            coord.layout("anon")
        coord.publish("anon", tree())
        assert coord.layout("anon")["version"] == 3  # versions survive unpublish


def test_attach_is_cheap_for_100_leaves():
    """The issue asks <= 2 ms; measured ~1.5 ms here, asserted loosely (shared CI)."""
    with shared_td.Coordinator() as coord:
        coord.publish("wide", shared_td.TensorDict({f"k{i}": torch.zeros(4) for i in range(100)}))
        coord.attach("wide")  # the connection is made once per process
        rounds = 50
        start = time.perf_counter()
        for _ in range(rounds):
            coord.attach("wide")
        per_attach = (time.perf_counter() - start) / rounds
    assert per_attach < 0.02, per_attach


# ------------------------------------------------------------------ across processes

@pytest.mark.timeout(90)
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_workers_attach_by_name_and_share_writes(tmp_path, method):
    ctx = multiprocessing.get_context(method)
    with shared_td.Coordinator() as coord:
        anon = coord.publish("anon", tree())
        on_file = coord.publish("file", tree(), prefix=tmp_path / "f")
        anon["obs"][0] = 5.0
        on_file["obs"][0] = 6.0
        process, queue = run(ctx, kids.attach_write_read, coord.address, coord.authkey,
                             "anon", "obs", 11.0)
        assert queue.get(timeout=WAIT) == ("ok", [5.0, 5.0], True)
        assert finish(process) == 0
        # a pickled handle works as well (non-owning in the child)
        process, queue = run(ctx, kids.attach_with_handle, coord, "file", "obs", 12.0)
        status, names, description = queue.get(timeout=WAIT)
        assert (status, names) == ("ok", ["anon", "file"]) and "connected" in description
        assert finish(process) == 0
        assert anon["obs"][1].tolist() == [11.0, 11.0]
        assert on_file["obs"][1].tolist() == [12.0, 12.0]
        assert coord.names() == ["anon", "file"]  # the owner's connection still works


@pytest.mark.timeout(90)
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_anonymous_data_outlives_its_publisher(method):
    ctx = multiprocessing.get_context(method)
    with shared_td.Coordinator() as coord:
        process, queue = run(ctx, kids.publish_and_exit, coord.address, coord.authkey, "p")
        status, publisher, inode = queue.get(timeout=WAIT)
        assert status == "ok", publisher
        assert finish(process) == 0 and not alive(publisher)
        td = coord.attach("p")
        assert td["x"].tolist() == [7.0] * 3
        assert td["x"]._backing.key == tuple(inode)  # the publisher's very memory
        td["x"][0] = 1.0
        assert coord.attach("p")["x"][0] == 1.0


@pytest.mark.timeout(90)
def test_worker_killed_mid_write_breaks_nothing():
    ctx = multiprocessing.get_context("fork")
    with shared_td.Coordinator() as coord:
        coord.publish("w", tree())
        writer, queue = run(ctx, kids.write_forever, coord.address, coord.authkey, "w", "obs")
        assert queue.get(timeout=WAIT) == "attached"
        time.sleep(0.2)  # let it write for a while
        os.kill(writer.pid, signal.SIGKILL)
        assert finish(writer) == -signal.SIGKILL
        # the coordinator and other workers carry on
        assert coord.names() == ["w"]
        last = coord.attach("w")["obs"][0, 0].item()
        assert last >= 1.0
        reader, queue = run(ctx, kids.attach_write_read, coord.address, coord.authkey,
                            "w", "obs", -1.0)
        status, row0, _ = queue.get(timeout=WAIT)
        assert status == "ok" and row0[0] >= 1.0
        assert finish(reader) == 0
        assert coord.attach("w")["obs"][1].tolist() == [-1.0, -1.0]


@pytest.mark.timeout(90)
def test_coordinator_killed_clear_error_data_survives(tmp_path):
    coord = shared_td.Coordinator().start()
    coord.publish("anon", tree())
    coord.publish("file", tree(), prefix=tmp_path / "f")
    anon, on_file = coord.attach("anon"), coord.attach("file")
    address, authkey, pid = coord.address, coord.authkey, coord.pid
    directory = os.path.dirname(address)

    os.kill(pid, signal.SIGKILL)
    assert wait_until(lambda: not alive(pid))
    for call in [coord.names, lambda: coord.attach("anon"), lambda: coord.layout("anon"),
                 lambda: shared_td.attach("anon", address=address, authkey=authkey)]:
        with pytest.raises(ConnectionError, match=f"coordinator at {address} is gone"):
            call()
    # attached data, anonymous and file-backed, stays readable and writable
    for td in [anon, on_file]:
        td["obs"][3] = 9.0
        assert td["obs"][3].tolist() == [9.0, 9.0]
        assert td["nested", "r"].tolist() == [0.0, 1.0, 2.0, 3.0]

    # the killed manager left its private directory; the next Coordinator sweeps it (a
    # Coordinator that another test process starts meanwhile may be that next one: the
    # directory was then gone before this line, which made the test fail under -n 2)
    with shared_td.Coordinator() as other:
        assert wait_until(lambda: not os.path.exists(directory))
        assert other.names() == []
    coord.shutdown()  # the handle of the dead manager shuts down quietly


@pytest.mark.timeout(90)
def test_creator_killed_manager_exits_and_cleans_up(tmp_path):
    ctx = multiprocessing.get_context("fork")
    owner, queue = run(ctx, kids.own_coordinator_then_wait, str(tmp_path / "f"))
    address, authkey, manager_pid = queue.get(timeout=WAIT)
    attached = shared_td.attach("anon", address=address, authkey=authkey)
    os.kill(owner.pid, signal.SIGKILL)
    assert finish(owner) == -signal.SIGKILL
    # the orphaned manager notices, stops, and removes its directory
    assert wait_until(lambda: not alive(manager_pid), timeout=15)
    assert not os.path.exists(os.path.dirname(address))
    with pytest.raises(ConnectionError, match="is gone"):
        shared_td.attach("anon", address=address, authkey=authkey)
    attached["a"][0] = 3.0  # our own descriptor keeps the memory
    assert attached["a"].tolist() == [3.0, 1.0]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_plain_passing_still_works_with_a_coordinator_running(method):
    ctx = multiprocessing.get_context(method)
    with shared_td.Coordinator() as coord:
        td = coord.publish("t", tree())
        loose = tree().memmap_()  # never published
        process, queue = run(ctx, kids.fill_leaf, [td, loose], "obs", 4.0)
        assert queue.get(timeout=WAIT) == "ok"
        assert finish(process) == 0
        assert td["obs"].eq(4.0).all() and loose["obs"].eq(4.0).all()
        assert coord.attach("t")["obs"].eq(4.0).all()


# ------------------------------------------------------------------ leaks and sweep

@pytest.mark.timeout(90)
def test_nothing_left_behind(tmp_path):
    ctx = multiprocessing.get_context("fork")
    td = None
    with foreign_churn(), private_tempdir() as tempdir:
        before = open_descriptors()  # (the watch's own reads of /proc come and go)
        with ShmWatch() as shm, shared_td.Coordinator() as coord:
            coord.publish("a", tree())
            coord.publish("f", tree(), prefix=tmp_path / "f")
            process, queue = run(ctx, kids.attach_write_read, coord.address, coord.authkey,
                                 "a", "obs", 1.0)
            assert queue.get(timeout=WAIT)[0] == "ok"
            assert finish(process) == 0
            queue.close()
            queue.join_thread()
            td = coord.attach("a")
            coord.unpublish("a")
            assert td["obs"][1].tolist() == [1.0, 1.0]  # still ours after unpublish
        del td, process, queue
        assert_nothing_left(shm, tempdir, before)


def test_sweep_touches_only_dead_coordinators_of_our_pattern(tmp_path):
    dead = multiprocessing.get_context("fork").Process(target=os.getpid)
    dead.start()
    finish(dead)
    names = {
        f"shared_td-coord-{dead.pid}-abcd1234": False,   # ours, dead: removed
        f"shared_td-coord-{os.getpid()}-abcd1234": True,  # ours, alive: kept
        f"shared_td-coord-{dead.pid}-short": True,       # not our pattern
        f"other-{dead.pid}-abcd1234": True,
    }
    for name in names:
        (tmp_path / name).mkdir()
    (tmp_path / f"shared_td-coord-{dead.pid}-file0000").write_text("a file")  # not a dir
    removed = server.sweep_dead_dirs(str(tmp_path))
    assert removed == [str(tmp_path / f"shared_td-coord-{dead.pid}-abcd1234")]
    for name, kept in names.items():
        assert (tmp_path / name).exists() == kept
    assert (tmp_path / f"shared_td-coord-{dead.pid}-file0000").exists()


@pytest.mark.timeout(60)
def test_shared_non_tensor_values_through_the_coordinator():
    with shared_td.Coordinator() as coord:
        td = shared_td.TensorDict(a=torch.zeros(2), mode="walk", batch_size=[2])
        coord.publish("n", td, share_non_tensor=True)
        leaves = {leaf["key"]: leaf["where"] for leaf in coord.layout("n")["leaves"]}
        assert leaves == {"a": "anonymous", "mode": "non-tensor"}
        coord.attach("n").set_("mode", "run")
        assert td["mode"] == "run" and coord.attach("n")["mode"] == "run"
