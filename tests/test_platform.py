"""shared_td.platform: the operating-system primitives, with real processes (a real zombie,
a real child of another user, a real peer's descriptor), and the one ImportError of an
unsupported system."""
from __future__ import annotations

import errno
import os
import pwd
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tests.processes import WAIT, wait_until
from shared_td import platform
from shared_td.persist import atomic

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _state(pid: int) -> bytes:
    with open(f"/proc/{pid}/stat", "rb") as stat_file:
        return stat_file.read().rsplit(b")", 1)[1].split()[0]


def _zombie() -> int:
    """A child that has exited and is not reaped yet (the caller reaps it)."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    assert wait_until(lambda: _state(pid) == b"Z", WAIT), "the child did not become a zombie"
    return pid


def _reap(pid: int) -> None:
    os.waitpid(pid, 0)


def _sleeper() -> int:
    pid = os.fork()
    if pid == 0:
        try:
            time.sleep(WAIT)
        finally:
            os._exit(0)
    return pid


def _fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


# ------------------------------------------------------------------ pid_alive


def test_a_zombie_is_dead_and_a_running_child_alive():
    running = _sleeper()
    zombie = _zombie()
    try:
        assert os.kill(zombie, 0) is None  # the kernel still knows it ...
        assert not platform.pid_alive(zombie)  # ... but it will never act again
        assert platform.pid_alive(running)
        assert platform.pid_alive(os.getpid())
    finally:
        _reap(zombie)
        os.kill(running, signal.SIGKILL)
        _reap(running)
    assert not platform.pid_alive(zombie) and not platform.pid_alive(running)


@pytest.mark.parametrize("pid", [0, -1, "minus our pid"])
def test_a_pid_of_zero_or_below_names_no_process(pid):
    # os.kill would take these for process groups (ours): not a process that is alive.
    # (Our pid is read in the test: a parameter must be the same in every pytest-xdist
    # worker that collects it.)
    pid = -os.getpid() if pid == "minus our pid" else pid
    assert not platform.pid_alive(pid)


def test_another_users_process_is_alive():
    if os.getuid() != 0:
        pytest.skip("needs root to start a child of another user")
    nobody = pwd.getpwnam("nobody").pw_uid
    parent = os.getpid()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.setuid(nobody)  # now kill(parent, 0) is EPERM
            try:
                os.kill(parent, 0)
                seen = b"signal allowed"
            except PermissionError:
                seen = str(platform.pid_alive(parent)).encode()
            os.write(write_end, seen)
        finally:
            os._exit(0)
    os.close(write_end)
    try:
        _reap(pid)
        assert os.read(read_end, 64) == b"True"
    finally:
        os.close(read_end)


def test_atomic_leftovers_of_a_zombie_writer_are_found(tmp_path):
    """One rule for every user of liveness: a writer that is a zombie left its staging
    directory for good (the writer's own check said 'alive' before)."""
    zombie = _zombie()
    try:
        leftover = tmp_path / f".buffer.shared_td-new-{zombie}-0123456789ab"
        leftover.mkdir()
        assert atomic.find_leftovers(str(tmp_path / "buffer")) == [str(leftover)]
    finally:
        _reap(zombie)


def test_the_coordinator_sweep_and_atomic_agree_on_a_zombie(tmp_path):
    from shared_td.coordinator import server

    zombie = _zombie()
    try:
        directory = tmp_path / f"shared_td-coord-{zombie}-abcd1234"
        directory.mkdir()
        staging = tmp_path / f".p.shared_td-new-{zombie}-0123456789ab"
        staging.mkdir()
        assert server.sweep_dead_dirs(str(tmp_path)) == [str(directory)]
        assert atomic.find_leftovers(str(tmp_path / "p")) == [str(staging)]
    finally:
        _reap(zombie)


# ------------------------------------------------------------------ memfds


def test_new_memfd_reserves_its_bytes_and_closes_on_failure():
    fd = platform.new_memfd("test", 4096)
    try:
        st = os.fstat(fd)
        assert st.st_size == 4096 and st.st_blocks * 512 >= 4096  # reserved, not sparse
        assert not os.get_inheritable(fd)  # close-on-exec
    finally:
        os.close(fd)
    # a real limit, in a child: a file size limit of 4 KiB (never a huge request, which
    # tmpfs would try to satisfy from the machine's memory)
    child = os.fork()
    if child == 0:
        code = 1
        try:
            import resource

            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a kill
            resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
            before = _fds()
            try:
                platform.new_memfd("too-big", 1 << 20)
            except OSError as err:
                # 2: the wrong error; 3: the failed memfd's descriptor leaked
                code = 2 if err.errno != errno.EFBIG else 3 if _fds() != before else 0
        finally:
            os._exit(code)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_reopen_peer_fd_opens_a_live_peers_memfd_and_refuses_a_gone_or_reused_one():
    read_end, write_end = os.pipe()
    fd = platform.new_memfd("peer", 8)
    st = os.fstat(fd)
    key = (st.st_dev, st.st_ino)
    child = os.fork()
    if child == 0:  # the peer: holds the memfd until its parent says go
        try:
            os.close(write_end)
            os.read(read_end, 1)
        finally:
            os._exit(0)
    os.close(read_end)
    os.close(fd)  # only the child holds it now
    try:
        mine = platform.reopen_peer_fd(child, fd, key)
        os.pwrite(mine, b"peer", 0)
        again = platform.reopen_peer_fd(child, fd, key)
        assert os.path.samestat(os.fstat(mine), st) and os.pread(again, 4, 0) == b"peer"
        os.close(again)
        # the descriptor number names another file now (our view of another key)
        with pytest.raises(OSError) as caught:
            platform.reopen_peer_fd(child, fd, (st.st_dev, st.st_ino + 1))
        assert caught.value.errno == errno.ESTALE and str(fd) in str(caught.value)
        os.close(mine)
    finally:
        os.close(write_end)
        _reap(child)
    with pytest.raises(FileNotFoundError):
        platform.reopen_peer_fd(child, fd, key)


# ------------------------------------------------------------------ mapping, locks, renames


def test_map_shared_bytes_sees_another_process_write_and_keeps_no_descriptor():
    fd = platform.new_memfd("map", 64)
    before = _fds()
    address = platform.map_shared_bytes(fd, 64)
    try:
        assert _fds() == before
        child = os.fork()
        if child == 0:
            os.pwrite(fd, b"\x2a", 8)
            os._exit(0)
        _reap(child)
        import ctypes

        assert ctypes.c_uint8.from_address(address + 8).value == 42
    finally:
        platform.unmap_bytes(address, 64)
        os.close(fd)
    with pytest.raises(OSError) as caught:
        platform.map_shared_bytes(fd, 64)  # closed: EBADF
    assert caught.value.errno == errno.EBADF


def test_try_flock_is_refused_while_another_process_holds_the_lock(tmp_path):
    path = tmp_path / "lock"
    path.touch()
    read_end, write_end = os.pipe()
    ready_read, ready_write = os.pipe()
    child = os.fork()
    if child == 0:
        try:
            held = os.open(path, os.O_RDONLY)
            os.write(ready_write, b"1" if platform.try_flock(held) else b"0")
            os.read(read_end, 1)
        finally:
            os._exit(0)
    try:
        assert os.read(ready_read, 1) == b"1"
        fd = os.open(path, os.O_RDONLY)
        try:
            assert not platform.try_flock(fd)
        finally:
            os.close(fd)
    finally:
        os.write(write_end, b"x")
        _reap(child)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert platform.try_flock(fd)  # the holder died: the lock went with it
    finally:
        os.close(fd)
    for end in (read_end, write_end, ready_read, ready_write):
        os.close(end)


def test_rename_exchange_swaps_and_reports_what_it_cannot(tmp_path, monkeypatch):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.write_text("file")
    assert platform.rename_exchange(str(a), str(b))
    assert a.read_text() == "file" and b.is_dir()
    with pytest.raises(FileNotFoundError, match="missing"):
        platform.rename_exchange(str(a), str(tmp_path / "missing"))
    monkeypatch.setattr(platform, "_renameat2", None)  # a C library without it
    assert not platform.rename_exchange(str(a), str(b))
    assert a.read_text() == "file" and b.is_dir()  # nothing changed


# ------------------------------------------------------------------ the supported platform


def _import_shared_td_after(setup: str) -> subprocess.CompletedProcess:
    body = textwrap.dedent(setup) + "\nimport shared_td\n"
    env = {**os.environ, "PYTHONPATH": REPO_ROOT}
    return subprocess.run([sys.executable, "-c", body], env=env, capture_output=True,
                          text=True, timeout=WAIT)


@pytest.mark.parametrize("setup, named", [
    ("import sys; sys.platform = 'darwin'", "Linux (this is 'darwin')"),
    ("import sys; sys.platform = 'win32'", "Linux (this is 'win32')"),
    ("import os; del os.memfd_create", "os.memfd_create"),
    ("import fcntl; del fcntl.F_OFD_SETLKW", "open-file-description locks (fcntl.F_OFD_SETLKW"),
    ("import fcntl; del fcntl.F_ADD_SEALS", "memfd seals (fcntl.F_ADD_SEALS"),
    ("import os; isdir = os.path.isdir; os.path.isdir = lambda p: p != '/proc/self/fd' and isdir(p)",
     "/proc (mounted procfs)"),
])
def test_an_unsupported_system_gets_one_import_error_naming_what_is_missing(setup, named):
    result = _import_shared_td_after(setup)
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: shared_td runs on Linux only: it needs memfd_create")
    assert f"this system lacks {named}" in last


def test_the_coordinator_script_loads_platform_alone_without_torch():
    """server.py run as a script (as the embedded coordinator runs it) uses this very
    platform.py, loaded by its path, and imports neither torch nor the package."""
    from shared_td.coordinator import server

    body = textwrap.dedent("""
        import runpy, sys
        del sys.path[0]
        names = runpy.run_path(sys.argv[1])
        print(names["platform"].__file__)
        print("torch" in sys.modules, "shared_td" in sys.modules)
    """)
    result = subprocess.run([sys.executable, "-c", body, server.__file__], capture_output=True,
                            text=True, timeout=WAIT, env={k: v for k, v in os.environ.items()
                                                          if k != "PYTHONPATH"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:2] == [platform.__file__, "False False"]
    assert server.platform is platform  # imported as part of the package: the same module


def test_loading_platform_starts_no_program():
    """Loading platform.py (each coordinator server loads it at its start, ~0.1 s in all)
    finds libc without ctypes.util.find_library, which runs ``ldconfig -p`` in a
    subprocess (a fork and an exec, tens of ms) and imports ctypes.util."""
    from shared_td.coordinator import server

    body = textwrap.dedent("""
        import runpy, sys
        started = []
        sys.addaudithook(lambda event, args: started.append(event)
                         if event in ("subprocess.Popen", "os.posix_spawn", "os.fork", "os.exec") else None)
        del sys.path[0]
        runpy.run_path(sys.argv[1])  # the coordinator server's module: platform.py, by path
        print(started, "ctypes.util" in sys.modules)
    """)
    result = subprocess.run([sys.executable, "-c", body, server.__file__], capture_output=True,
                            text=True, timeout=WAIT, env={k: v for k, v in os.environ.items()
                                                          if k != "PYTHONPATH"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[] False"
