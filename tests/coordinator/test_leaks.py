"""Issue 5, point 3: anonymous memory is freed when the coordinator shuts down or the
last user is gone; a SIGKILL of any process (publisher, worker, manager, the process
that started the manager) leaves nothing in /dev/shm, the temp directory or the socket
directory; a full memory or tmpfs is a Python exception naming the size, never SIGBUS.
"""
from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from tests.coordinator import coord_children as kids
from tests.leakcheck import ShmWatch, foreign_churn, private_tempdir
from tests.processes import WAIT, alive, finish, small_tmpfs, wait_until
from tests.coordinator.test_coordinator import assert_nothing_left, open_descriptors, run

import shared_td


def holders_of(inode: int, pids) -> list[int]:
    """The processes among ``pids`` that hold a descriptor or a mapping of ``inode``."""
    found = []
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    if os.stat(f"/proc/{pid}/fd/{fd}").st_ino == inode:
                        found.append(pid)
                        break
                except OSError:
                    pass
            else:
                with open(f"/proc/{pid}/maps") as maps:
                    if any(line.split()[4] == str(inode) for line in maps if "memfd:" in line):
                        found.append(pid)
        except OSError:  # the process is gone
            pass
    return found


@pytest.mark.timeout(120)
def test_anonymous_memory_is_freed_when_unpublished_and_dropped_or_shut_down():
    ctx = multiprocessing.get_context("fork")
    with shared_td.Coordinator() as coord:
        manager = coord.pid
        for name in ("dropped", "kept"):
            process, queue = run(ctx, kids.publish_and_exit, coord.address, coord.authkey, name)
            status, publisher, key = queue.get(timeout=WAIT)
            assert status == "ok" and finish(process) == 0
        dropped_inode = coord.attach("dropped")["x"]._backing.key[1]
        kept = coord.attach("kept")
        kept_inode = kept["x"]._backing.key[1]
        assert holders_of(dropped_inode, [manager]) == [manager]
        # the last user gone: unpublished (the manager lets go) and dropped here
        coord.unpublish("dropped")
        gc.collect()
        assert wait_until(lambda: holders_of(dropped_inode, [manager, os.getpid()]) == [])
        assert holders_of(kept_inode, [manager, os.getpid()]) == [manager, os.getpid()]
    # the coordinator shut down: only our own mapping keeps "kept"
    assert wait_until(lambda: not alive(manager))
    del kept
    gc.collect()
    assert holders_of(kept_inode, [os.getpid()]) == []


@pytest.mark.timeout(180)
def test_sigkill_of_any_process_leaves_nothing_behind(tmp_path):
    # beside another program that makes and removes entries in /dev/shm and the temp dir
    with foreign_churn(), private_tempdir() as tempdir:
        before = open_descriptors()
        with ShmWatch() as shm:
            sigkill_each_kind_of_process(tmp_path)
        assert_nothing_left(shm, tempdir, before)


def sigkill_each_kind_of_process(tmp_path):
    ctx = multiprocessing.get_context("fork")

    # the process that started a manager
    queues = []
    owner, queue = run(ctx, kids.own_coordinator_then_wait, str(tmp_path / "f"))
    queues.append(queue)
    address, authkey, manager = queue.get(timeout=WAIT)
    os.kill(owner.pid, signal.SIGKILL)
    assert finish(owner) == -signal.SIGKILL
    assert wait_until(lambda: not alive(manager), timeout=15)

    coord = shared_td.Coordinator().start()
    # a publisher and a worker mid-write
    publisher, queue = run(ctx, kids.publish_and_exit, coord.address, coord.authkey, "p")
    queues.append(queue)
    assert queue.get(timeout=WAIT)[0] == "ok"
    finish(publisher)
    writer, queue = run(ctx, kids.write_forever, coord.address, coord.authkey, "p", "x")
    queues.append(queue)
    assert queue.get(timeout=WAIT) == "attached"
    os.kill(writer.pid, signal.SIGKILL)
    assert finish(writer) == -signal.SIGKILL
    # the manager itself; the next coordinator sweeps its directory
    manager = coord.pid
    os.kill(manager, signal.SIGKILL)
    assert wait_until(lambda: not alive(manager))
    coord.shutdown()
    with shared_td.Coordinator() as sweeper:
        sweeper.names()
    for q in queues:
        q.close()
        q.join_thread()


def run_limited(body: str) -> subprocess.CompletedProcess:
    code = textwrap.dedent("""
        import resource, signal
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a core dump
        resource.setrlimit(resource.RLIMIT_FSIZE, (2**20, resource.RLIM_INFINITY))
    """) + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


@pytest.mark.timeout(150)
def test_memory_over_a_limit_is_an_exception_naming_the_size_never_sigbus():
    # A real limit (RLIMIT_FSIZE applies to memfds), not a mocked fallocate: the
    # segment of 4 MiB and a 2 MiB non-tensor value cannot be reserved.
    result = run_limited("""
        import torch, shared_td
        try:
            shared_td.TensorDict(a=torch.zeros(2**20)).memmap_()
        except shared_td.storage.files.StorageFullError as err:
            print("segment:", err)
        td = shared_td.TensorDict(task="small").memmap_(share_non_tensor=True)
        try:
            td.set_("task", "x" * 2**21)
        except shared_td.storage.files.StorageFullError as err:
            print("value:", err)
        print("still:", td["task"])
    """)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert "4194304 bytes (4.0 MiB)" in lines[0] and lines[0].startswith("segment:")
    assert lines[1].startswith("value:") and "bytes" in lines[1]
    assert lines[2] == "still: small"


@pytest.mark.timeout(120)
def test_a_full_tmpfs_is_an_exception_naming_the_size_never_sigbus(tmp_path):
    with small_tmpfs(tmp_path / "small") as mount_point:
        code = textwrap.dedent(f"""
            import torch, shared_td
            try:
                shared_td.TensorDict(a=torch.zeros(2**20)).memmap_({str(mount_point / "td")!r})
            except shared_td.storage.files.StorageFullError as err:
                print(err)
        """)
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100)
    assert result.returncode == 0, result.stderr[-3000:]  # a SIGBUS would be -7
    assert "4194304 bytes (4.0 MiB)" in result.stdout, result.stdout
