"""map() under RLIMIT_NPROC and with a result that cannot be sent back (limits22)."""
import pytest
import torch

import shared_td
from tests.processes import run_as_nobody

# users no other process runs as, one per test (xdist may run two at once; RLIMIT_NPROC
# counts the tasks of the user: the check's only; test_threads_rlimit_nproc.py: 2_000_022)
_UID, _UID_THREADS = 2_000_023, 2_000_024


class _Unpicklable:
    def __reduce__(self):
        raise TypeError("not this one")


def _unpicklable_result(chunk):
    return shared_td.TensorDict(a=chunk["a"] * 2, u=shared_td.NonTensorData(_Unpicklable()),
                                batch_size=chunk.batch_size)


def test_map_result_that_cannot_be_sent_back_is_a_runtime_error():
    td = shared_td.TensorDict(a=torch.arange(4.0), batch_size=[4])
    # before: TypeError "cannot unpack non-iterable RuntimeError object" in the parent
    with pytest.raises(RuntimeError, match="could not be sent back"):
        td.map(_unpicklable_result, num_workers=2, chunksize=1, mp_start_method="fork")


def test_map_workers_under_rlimit_nproc():
    run_as_nobody("""
    import resource
    import numpy.random  # (as root: a map worker seeds it, and the venv may be unreadable to the user)
    import torch
    import shared_td
    torch.set_num_threads(1)

    def nothing(chunk):
        return None

    # memory-mapped trees: their chunks reach the workers by file name (an anonymous tree's would
    # go through the resource_sharer that warm() starts as root: nobody cannot connect to it)
    def warm(base):
        mapped = shared_td.TensorDict(a=torch.arange(4.0), batch_size=[4]).memmap_(base + "/warm")
        mapped.map(nothing, num_workers=2, chunksize=1, mp_start_method="fork")

    def check(base):
        td = shared_td.TensorDict(a=torch.arange(4.0), batch_size=[4]).memmap_(base + "/td")
        tasks = len(os.listdir("/proc/self/task"))
        hard = resource.getrlimit(resource.RLIMIT_NPROC)[1]
        try:
            resource.setrlimit(resource.RLIMIT_NPROC, (tasks, hard))  # no worker may start
            try:
                td.map(nothing, num_workers=2, chunksize=1, mp_start_method="fork")
            except BlockingIOError as error:  # before: a bare EAGAIN
                assert "RLIMIT_NPROC" in str(error), error
            else:
                raise AssertionError("a worker started")
        finally:
            resource.setrlimit(resource.RLIMIT_NPROC, (hard, hard))
        assert td.map(nothing, num_workers=2, chunksize=1, mp_start_method="fork") is None  # works again
        return True
    """, timeout=120, uid=_UID)


class _NoThreads:
    """map_pool's ``threading`` in a fork worker that may start no thread (RLIMIT_NPROC
    reached by its siblings' threads)."""

    class Thread:
        def __init__(self, *args, **kwargs):
            pass

        def start(self):
            raise RuntimeError("can't start new thread")


def _doubled(chunk):
    return chunk.apply(lambda x: x * 2)


def test_map_worker_that_cannot_start_its_watch_thread_still_serves(monkeypatch):
    from shared_td.containers import map_pool

    monkeypatch.setattr(map_pool, "threading", _NoThreads)  # inherited by the fork workers
    td = shared_td.TensorDict(a=torch.arange(4.0), batch_size=[4])
    # before: WorkerDiedError "exited with code 1 while it computed chunk 0 ... If it ran out of memory"
    out = td.map(_doubled, num_workers=2, chunksize=1, mp_start_method="fork")
    assert out["a"].tolist() == [0.0, 2.0, 4.0, 6.0]


def test_map_thread_refused_names_rlimit_nproc():
    # docs43: torch sends a plain tensor through multiprocessing's resource_sharer, whose
    # listener is a thread of the sender (the parent for a chunk, a worker for a result):
    # refused, it was a bare "can't start new thread", or "could not be sent back"
    code = r'''
import os, resource, time, torch, shared_td as st
import numpy.random  # (as root: a map worker seeds it, and the venv may be unreadable to the user)
def fn(td):
    return td.apply(lambda x: x + 1)
def warm(base):
    torch.set_num_threads(1)
    import multiprocessing.popen_fork, multiprocessing.resource_sharer, multiprocessing.connection
    import multiprocessing.reduction, multiprocessing.synchronize, multiprocessing.queues
    import torch.multiprocessing.reductions as _r
    pid = os.fork()  # map's lazy imports, without starting a resource_sharer thread here as root
    if pid == 0:
        st.TensorDict({"a": torch.zeros(8)}, [8]).map(fn, num_workers=2, chunksize=4); os._exit(0)
    os.waitpid(pid, 0)
def check(base):
    torch.set_num_threads(1)
    outcomes = []
    for extra in range(2, 10):
        time.sleep(0.3)  # the previous try's workers gone
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read)
            tasks = len(os.listdir("/proc/self/task"))
            resource.setrlimit(resource.RLIMIT_NPROC, (tasks + extra,) * 2)
            try:
                td = st.TensorDict({"a": torch.zeros(8)}, [8])
                what = "ok" if td.map(fn, num_workers=2, chunksize=4)["a"].tolist() == [1.0] * 8 else "wrong"
            except BaseException as e:
                what = f"{type(e).__name__}: {e}"
            os.write(write, what.encode()); os._exit(0)
        os.close(write)
        with os.fdopen(read, "rb") as f:
            outcomes.append(f.read().decode())
        os.waitpid(pid, 0)
    print(outcomes)
    refused = [o for o in outcomes if o != "ok"]
    return (all("RLIMIT_NPROC" in o for o in refused)
            and any("could not start a thread" in o for o in refused) and outcomes[-1] == "ok")
'''
    run_as_nobody(code, timeout=240, uid=_UID_THREADS)
