"""A Ctrl-C (a KeyboardInterrupt raised between two bytecodes, right after a call
returns included) never loses itself or a resource:

* one landing while a finalizer of shared_td runs reaches the program
  (shared_td.finalizers): before, Python dropped it there ("Exception ignored in:
  <finalize object ...>") and a worker looping on loads or attaches went on running
  after 1 SIGINT in 4 (loads of a consolidated file) or in 12 (attaches). Real SIGINTs
  at random moments into forked children; every wait bounded;
* one landing as a descriptor is handed to its owner closes it once (not twice: EBADF,
  or another file that took the number), and one landing once a descriptor is open
  and owned closes it (no leak). Deterministic: the call before the landing point is
  made to raise KeyboardInterrupt after it returned, as a SIGINT handled there would.
"""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
import traceback

import pytest
import torch

import shared_td
from shared_td.finalizers import Finalizer

TRIALS = 20
INTERRUPTED = 7  # a child's exit code once its KeyboardInterrupt reached its loop


def _child(loop, ready: int) -> None:
    """In a fork child: run ``loop`` until Ctrl-C; never returns."""
    code = 1
    try:
        os.write(ready, b"r")
        loop()
    except KeyboardInterrupt:
        code = INTERRUPTED
    except BaseException:
        traceback.print_exc()  # (what ended it instead: shown with the failure)
    finally:
        os._exit(code)


def _interrupt_children(loop, seed: int) -> list:
    """The outcome of each of TRIALS children, each sent SIGINT at a random moment of
    ``loop``: its exit code, or "still running" after 5 s (then killed)."""
    rng, outcomes = random.Random(seed), []
    for _ in range(TRIALS):
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read_end)
            _child(loop, write_end)
        os.close(write_end)
        try:
            assert os.read(read_end, 1) == b"r"
        finally:
            os.close(read_end)
        time.sleep(rng.uniform(0.02, 0.15))
        os.kill(pid, signal.SIGINT)
        deadline = time.monotonic() + 5
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                outcomes.append(os.waitstatus_to_exitcode(status))
                break
            if time.monotonic() > deadline:
                outcomes.append("still running")
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                break
            time.sleep(0.01)
    return outcomes


def _touch(td) -> None:
    td["a"].numpy().sum()  # (numpy: torch's thread pool is not a fork child's to use)


def test_ctrl_c_while_loaded_trees_are_unmapped(tmp_path):
    path = str(tmp_path / "tree.bin")
    shared_td.TensorDict(a=torch.ones(4 << 20)).consolidate(filename=path)

    def load_in_a_loop():
        while True:
            _touch(shared_td.TensorDict.from_consolidated(path))

    seed = random.randrange(1 << 30)
    outcomes = _interrupt_children(load_in_a_loop, seed)
    assert outcomes == [INTERRUPTED] * TRIALS, f"seed {seed}: {outcomes}"


def test_ctrl_c_while_attached_views_are_dropped():
    with shared_td.Coordinator(timeout=5) as coord:
        coord.publish("x", shared_td.TensorDict(a=torch.ones(1 << 20)))

        def attach_in_a_loop():
            while True:
                _touch(shared_td.attach("x", address=coord.address, authkey=coord.authkey, timeout=5))

        seed = random.randrange(1 << 30)
        outcomes = _interrupt_children(attach_in_a_loop, seed)
    assert outcomes == [INTERRUPTED] * TRIALS, f"seed {seed}: {outcomes}"


def _in_a_fork_child(check) -> int:
    """``check()``'s exit code in a fork child (INTERRUPTED if a KeyboardInterrupt
    reached it), within 20 s."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = check()
        except KeyboardInterrupt:
            code = INTERRUPTED
        finally:
            os._exit(code)
    deadline = time.monotonic() + 20
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the child did not end within 20 s")
        time.sleep(0.01)


class _Owner:
    pass


def test_a_ctrl_c_landing_before_the_cleanup_runs_it_and_is_raised_again():
    def check():
        owner, fd = _Owner(), os.open(os.devnull, os.O_RDONLY)
        closing = Finalizer(owner, os.close, fd)
        # runs first (the last made): its Ctrl-C lands as it returns, and with the
        # interrupt raised again at once it would land before `closing` began
        Finalizer(owner, __import__("_thread").interrupt_main)
        try:
            del owner
            time.sleep(5)  # (ended by the Ctrl-C raised again)
        except KeyboardInterrupt:
            return 2 if closing.alive else 0
        return 3
    assert _in_a_fork_child(check) == 0


def _run_script(script: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(shared_td.__file__)))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                          timeout=120, env=env)


def test_any_dropped_ctrl_c_is_raised_again_and_other_reports_reach_the_hook_before():
    # (most Ctrl-C an attach loop lost landed in Python's own callbacks of the weak
    # containers shared_td's caches are; another library's finalizer drops them alike)
    done = _run_script("""
        import os, sys, time, weakref, _thread
        reports = []
        sys.unraisablehook = reports.append  # (in place before shared_td is imported)
        from shared_td.finalizers import Finalizer
        class Owner: pass
        foreign = Owner()
        weakref.finalize(foreign, _thread.interrupt_main)  # (a Ctrl-C landing in it)
        try:
            del foreign
            time.sleep(5)
            print("not raised")
        except KeyboardInterrupt:
            print("raised")
        failing = Owner()
        Finalizer(failing, os.close, -1)
        del failing
        print([report.exc_type.__name__ for report in reports])
    """)
    assert done.stdout.split("\n")[:2] == ["raised", "['OSError']"], done.stderr[-2000:]


def test_a_hook_put_in_front_that_chains_to_shared_td_s_gets_each_report_once():
    # (shared_td's hook put itself in front again at the next Finalizer, behind it the
    # hook that chains to it: a RecursionError, the report lost; review42)
    done = _run_script("""
        import os, sys
        from shared_td.finalizers import Finalizer
        class Owner: pass
        Finalizer(Owner(), os.getpid)
        seen, previous = [], sys.unraisablehook
        def logging_hook(unraisable):
            seen.append(unraisable.exc_type)
            previous(unraisable)
        sys.unraisablehook = logging_hook
        Finalizer(Owner(), os.getpid)
        failing = Owner()
        Finalizer(failing, os.close, -1)
        del failing
        print(len(seen))
    """)
    assert done.stdout.strip() == "1", done.stderr[-2000:]
    assert "RecursionError" not in done.stderr and "Bad file descriptor" in done.stderr  # (the default hook's)


def test_a_ctrl_c_as_the_version_table_opens_closes_the_manager_pidfd_once(monkeypatch):
    # (the table's own finalizer closed the pidfd, then the failing open closed it again:
    # an OSError EBADF instead of the KeyboardInterrupt, or a reused descriptor closed)
    from shared_td.coordinator import staleness
    from shared_td.storage.cache import InodeCache
    closed = []

    def close_then_ctrl_c(fd):
        os.close(fd)
        closed.append(fd)
        if len(closed) == 1:  # the table's descriptor, closed once mapped: a Ctrl-C lands as it returns
            raise KeyboardInterrupt

    with shared_td.Coordinator(timeout=5) as coord:
        coord.publish("x", shared_td.TensorDict(a=torch.zeros(2)))
        monkeypatch.setattr(staleness, "_TABLES", InodeCache())  # (as in a process that never mapped it)
        monkeypatch.setattr(staleness, "os", type("Os", (), {"close": staticmethod(close_then_ctrl_c),
                                                            "pidfd_open": staticmethod(os.pidfd_open)}))
        with pytest.raises(KeyboardInterrupt):
            shared_td.attach("x", address=coord.address, authkey=coord.authkey, timeout=5)
        assert len(closed) == 2 and len(set(closed)) == 2  # the table's descriptor, then the pidfd: once each


def test_a_ctrl_c_as_a_leaf_job_is_queued_never_closes_its_descriptor_twice(tmp_path, monkeypatch):
    # (the writer closed the descriptor it had just handed to the job, which still wrote
    # through it: EBADF, or another file that took its number meanwhile)
    from shared_td.persist import writer
    from shared_td.thread_pool import ThreadPool
    real_submit, closes, handed = ThreadPool.submit, [], []  # closes: the failed ones

    def submit_then_ctrl_c(pool, fn, *args, **kwargs):
        future = real_submit(pool, fn, *args, **kwargs)
        if not handed:
            handed.append((args[1], future))
            raise KeyboardInterrupt  # (landing as submit returns)
        return future

    def counting_close(fd):
        try:
            real_close(fd)
        except OSError as error:
            closes.append((fd, error))  # (EBADF: closed twice)
            raise

    real_close = os.close
    monkeypatch.setattr(ThreadPool, "submit", submit_then_ctrl_c)
    monkeypatch.setattr(writer.os, "close", counting_close)
    td = shared_td.TensorDict(a=torch.ones(writer._POOL_LEAF_BYTES), b=torch.ones(writer._POOL_LEAF_BYTES))
    with pytest.raises(KeyboardInterrupt):
        td.memmap(tmp_path / "saved", num_threads=2)
    future = handed[0][1]
    future.result(timeout=30)  # (the job wrote its leaf and closed the descriptor)
    monkeypatch.undo()
    assert closes == []


def _descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("failure", [KeyboardInterrupt, OSError])
def test_a_failure_as_a_save_s_meta_json_is_checked_closes_it(tmp_path, monkeypatch, failure):
    # (a Ctrl-C as fstat returned, or fstat failing, left meta.json open: atomic=True
    # writes and append_memmap check the save through it)
    from shared_td.persist import format as fmt
    (tmp_path / fmt.META).write_text("{}")
    real_fstat = os.fstat

    def fstat_then_fail(fd, *args, **kwargs):
        real_fstat(fd, *args, **kwargs)
        raise failure(5, "Input/output error") if failure is OSError else failure()

    before = _descriptors()
    monkeypatch.setattr(fmt.os, "fstat", fstat_then_fail)
    if failure is OSError:
        assert fmt.not_a_save(str(tmp_path)) == f"its {fmt.META} cannot be read: Input/output error"
    else:
        with pytest.raises(KeyboardInterrupt):
            fmt.not_a_save(str(tmp_path))
    monkeypatch.undo()
    assert _descriptors() == before


@pytest.mark.parametrize("landing", ["as fstat returns", "as the cache is looked up"])
def test_a_ctrl_c_as_a_new_segment_is_registered_leaks_no_memfd(monkeypatch, landing):
    from shared_td.storage import anonymous
    made = []
    real_create, real_fstat = anonymous.create_memfd, os.fstat

    def recorded_create(*args, **kwargs):
        made.append(real_create(*args, **kwargs))
        return made[-1]

    def fstat_then_ctrl_c(fd, *args, **kwargs):
        result = real_fstat(fd, *args, **kwargs)
        if fd in made:
            raise KeyboardInterrupt
        return result

    def lookup_interrupted(key):
        raise KeyboardInterrupt

    before = _descriptors()
    monkeypatch.setattr(anonymous, "create_memfd", recorded_create)
    if landing == "as fstat returns":
        monkeypatch.setattr(anonymous.os, "fstat", fstat_then_ctrl_c)
    else:
        monkeypatch.setattr(anonymous, "cached_segment", lookup_interrupted)
    with pytest.raises(KeyboardInterrupt):
        anonymous.Segment.create(4096)
    monkeypatch.undo()
    assert len(made) == 1 and _descriptors() == before


def _start_then_ctrl_c(name):
    real_start = threading.Thread.start

    def start(self):
        real_start(self)
        if self.name == name:
            raise KeyboardInterrupt  # (landing as start() returns, or in its wait: the thread runs)
    return start


def _join(name):
    for thread in [t for t in threading.enumerate() if t.name == name]:
        thread.join(60)


def test_a_ctrl_c_as_an_early_write_starts_leaves_it_locked_and_recorded(tmp_path, monkeypatch):
    # (the caller unlocked the tree and dropped the write's record while the write went
    # on: entries set meanwhile were lost, and a second write did not wait; review42)
    from shared_td.persist import in_flight
    td = shared_td.TensorDict(a=torch.ones(4 << 20), b=torch.ones(4 << 20))
    monkeypatch.setattr(threading.Thread, "start", _start_then_ctrl_c("shared_td-memmap"))
    try:
        with pytest.raises(KeyboardInterrupt):
            td.memmap_(tmp_path, num_threads=4, return_early=True)
        monkeypatch.undo()
        writing = any(t.name == "shared_td-memmap" and t.is_alive() for t in threading.enumerate())
        locked, recorded = td.is_locked, bool(in_flight._running)
        try:
            td["c"] = torch.zeros(3)
            added = True
        except shared_td.LockedTensorDictError:
            added = False
    finally:
        monkeypatch.undo()
        _join("shared_td-memmap")
    if td.is_memmap():  # the write ran: it owned the tree (locked, recorded) until it ended
        assert not writing or (locked and recorded and not added)
    else:  # its caller took it back first: never run, nothing kept locked
        assert added and not locked
    assert not added or "c" in td.keys()


def test_a_hook_swapped_in_and_restored_leaves_no_trace_in_shared_td_s_chain():
    # (shared_td's hook, put in front of a block's own hook by a Finalizer made in the
    # block, kept handing every later report to that block's hook once the block had
    # restored shared_td's: lost to the default hook; review44)
    done = _run_script("""
        import sys
        from shared_td.finalizers import Finalizer
        class Owner: pass
        seen, old = [], sys.unraisablehook
        sys.unraisablehook = seen.append  # (as test.support.catch_unraisable_exception)
        Finalizer(Owner(), len, ())
        sys.unraisablehook = old
        class Bad:
            def __del__(self):
                raise ValueError("after the block")
        Bad()
        print(len(seen))
    """)
    assert done.stdout.strip() == "0" and "after the block" in done.stderr, done.stderr[-2000:]


def test_a_keyboard_interrupt_dropped_in_a_worker_thread_never_interrupts_the_main_one():
    # (Python raises a signal's KeyboardInterrupt only in the main thread: one dropped in
    # a worker's finalizer was raised there, asynchronously or by a raise; the hook sent
    # the main thread a SIGINT nobody pressed; review44)
    done = _run_script("""
        import threading, time, weakref
        import shared_td
        def interrupted():
            raise KeyboardInterrupt  # (as an asynchronous exception aimed at the worker)
        def worker():
            class Owner: pass
            owner = Owner()
            weakref.finalize(owner, interrupted)
            del owner
        thread = threading.Thread(target=worker)
        thread.start()
        thread.join()
        try:
            time.sleep(1)
            print("not interrupted")
        except KeyboardInterrupt:
            print("interrupted")
    """)
    assert done.stdout.strip() == "not interrupted", done.stderr[-2000:]
    assert "Exception ignored in" in done.stderr  # (reported as any other)


def test_a_leaf_job_the_pool_refuses_closes_its_descriptor(tmp_path, monkeypatch):
    # (from bbb9332 on the job owned fd from the submit on, even a submit that raised and
    # queued nothing: a pool refusing work, as a ThreadPoolExecutor did once the main
    # thread had returned, left the leaf file open; review44)
    from shared_td.persist import writer
    from shared_td.thread_pool import ThreadPool

    def refusing_submit(pool, fn, *args, **kwargs):
        raise RuntimeError("cannot schedule new futures after interpreter shutdown")

    td = shared_td.TensorDict(a=torch.ones(writer._POOL_LEAF_BYTES), b=torch.ones(writer._POOL_LEAF_BYTES))
    before = _descriptors()
    monkeypatch.setattr(ThreadPool, "submit", refusing_submit)
    with pytest.raises(RuntimeError, match="cannot schedule"):
        td.memmap(tmp_path / "saved", num_threads=2)
    monkeypatch.undo()
    assert _descriptors() == before
