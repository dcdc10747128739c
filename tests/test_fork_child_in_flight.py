"""Fork children made while the parent's threads run shared_td work (helper fork19): a
child's normal exit neither waits for the parent's background write nor ends the
parent's map() workers. Each case runs in a script of its own: the child leaves by a
real ``sys.exit`` (its exit hooks run), which a child of the test process must not do."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

import shared_td

PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(shared_td.__file__)))  # (the package tested)
# Forks, the child exits normally under a 20 s alarm; prints how the child ended.
_FORK_AND_EXIT = textwrap.dedent("""
    import os, signal, sys, time

    def fork_and_exit_normally():
        pid = os.fork()
        if pid == 0:
            signal.alarm(20)
            sys.exit(0)  # threading's and atexit's hooks run
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return f"child exit {os.waitstatus_to_exitcode(status)}"
            time.sleep(0.05)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        return "child hung"
""")

_DURING_WRITE = _FORK_AND_EXIT + textwrap.dedent("""
    import torch, shared_td

    td = shared_td.TensorDict({f"k{i}": torch.randn(2_000_000) for i in range(16)}, batch_size=[])
    future = td.memmap_(sys.argv[1], num_threads=2, return_early=True)  # long enough to run at the fork
    print(fork_and_exit_normally())
    future.result(60)
    print("saved", torch.equal(shared_td.load_memmap(sys.argv[1])["k3"], td["k3"]))
""")

_DURING_MAP = _FORK_AND_EXIT + textwrap.dedent("""
    import threading, torch, shared_td

    def slow_double(td):
        time.sleep(3)
        return td.apply(lambda x: x * 2)

    if __name__ == "__main__":
        td, result = shared_td.TensorDict(a=torch.arange(8.0), batch_size=[8]), {}

        def run():
            try:
                result["out"] = td.map(slow_double, num_workers=2, chunksize=4)["a"].tolist()
            except Exception as error:
                result["out"] = repr(error)

        thread = threading.Thread(target=run)
        thread.start()
        time.sleep(1.5)  # the workers run their chunks
        print(fork_and_exit_normally())
        thread.join(60)
        print("map", result.get("out"))
""")


def _run(script: str, tmp_path, *args: str) -> list[str]:
    path = tmp_path / "case.py"
    path.write_text(script)
    done = subprocess.run([sys.executable, str(path), *args], capture_output=True, text=True, timeout=150,
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": PACKAGE_ROOT})
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()


@pytest.mark.timeout(200)
def test_a_fork_child_made_during_a_background_write_exits(tmp_path):
    # before: the child waited at exit for the parent's write, which no thread of its runs (the alarm)
    assert _run(_DURING_WRITE, tmp_path, str(tmp_path / "td")) == ["child exit 0", "saved True"]


@pytest.mark.timeout(200)
def test_a_fork_childs_exit_leaves_the_parents_map_workers(tmp_path):
    # before: the child's exit SIGTERMed the parent's workers (multiprocessing's table of children,
    # inherited), and the parent's map raised WorkerDiedError
    assert _run(_DURING_MAP, tmp_path) == ["child exit 0", "map [0.0, 2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 14.0]"]
