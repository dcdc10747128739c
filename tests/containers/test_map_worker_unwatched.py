"""review54: a fork worker of map() that could not start its creator-watch thread ends once
its caller is gone (it held its own pipe's parent end: no end of file, it waited for ever)."""
import os
import signal
import subprocess
import sys
import textwrap
import time

_CALLER = textwrap.dedent("""
    import os, sys, time, torch
    import shared_td
    from shared_td.containers import map_pool

    class _NoThreads:
        class Thread:
            def __init__(self, *a, **k): pass
            def start(self): raise RuntimeError("can't start new thread")

    map_pool.threading = _NoThreads  # (inherited by the fork workers)

    def slow(chunk):
        with open(sys.argv[1], "a") as f:
            f.write(f"{os.getpid()}\\n")
        time.sleep(1.0)
        return chunk

    td = shared_td.TensorDict(a=torch.arange(4.0), batch_size=[4])
    td.map(slow, num_workers=2, chunksize=1, mp_start_method="fork")
""")


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_unwatched_map_worker_ends_after_its_killed_caller(tmp_path):
    pids = tmp_path / "pids"
    pids.touch()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    caller = subprocess.Popen([sys.executable, "-c", _CALLER, str(pids)], env=env)
    workers = []
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(workers) < 2:
            time.sleep(0.05)
            workers = sorted({int(p) for p in pids.read_text().split()})
        assert len(workers) == 2
        os.kill(caller.pid, signal.SIGKILL)
        caller.wait()
        deadline = time.monotonic() + 10  # (a chunk takes 1 s)
        while time.monotonic() < deadline and any(map(_alive, workers)):
            time.sleep(0.1)
        assert not [pid for pid in workers if _alive(pid)]  # before: both waited for ever
    finally:
        caller.kill()
        caller.wait()
        for pid in workers:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
