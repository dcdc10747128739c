"""A node that waits for an answer keeps its stderr quiet (audit 21, finding 3).

A pull waiting for its owner's answer popped its reply queue in 0.25 s slices, and each
slice that found nothing was a TCPStore pop that timed out, which torch's C++ side logs
at WARNING: two lines (``[c10d] waitForInput: poll ... returned 0, likely a timeout`` and
``... timed out after 249ms``) every 0.25 s on the waiting node's stderr, 26 lines for one
pull whose owner was SIGKILLed. The wait is now one pop for the whole deadline, woken by
a signed notice when the owner is found lost or the node shuts down.

Two node processes on a store that the test hosts: node 0 owns a name, node 1 (its
stderr captured) pulls it while node 0 is stopped (SIGSTOP) for ~2 s, so that the pull
waits that long for the answer and then gets it; then node 0 is SIGKILLed and node 1's
pull raises OwnerLostError within the bound the other owner-loss tests hold; then node
1 shuts down. Its stderr holds no c10d timeout line. Every wait bounded.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

pytest.importorskip("torch.distributed")

import shared_td  # noqa: E402
from tests.cluster.test_cluster_store import pair, store  # noqa: E402,F401 - fixtures
from tests.cluster.test_cluster_owner_loss import WITHIN_S  # noqa: E402
from tests.processes import all_threads_stopped, wait_until  # noqa: E402

pytestmark = pytest.mark.timeout(120)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: How long the owner is stopped while node 1's pull waits for its answer (under the
#: 2.5 s after which a stopped owner looks at its claim, and the 3 s it is lost after).
STOPPED_S = 2.0

_NODE = textwrap.dedent("""
    import os, sys, time
    import torch, shared_td
    from shared_td.coordinator.cluster import Cluster

    url, node, folder = sys.argv[1], int(sys.argv[2]), sys.argv[3]

    def wait_file(name):
        end = time.monotonic() + 60
        while not os.path.exists(os.path.join(folder, name)):
            if time.monotonic() > end:
                raise TimeoutError(name)
            time.sleep(0.01)

    def mark(name, text=""):
        with open(os.path.join(folder, name + ".tmp"), "w") as f:
            f.write(text)
        os.rename(os.path.join(folder, name + ".tmp"), os.path.join(folder, name))

    cluster = Cluster(url, node, 2, authkey=b"quiet-waits test key", timeout=15.0, hostname="127.0.0.1").start()
    if node == 0:
        cluster.publish("x", shared_td.TensorDict(w=torch.zeros(64), batch_size=[64]))
        mark("published", str(os.getpid()))
        time.sleep(90)  # stopped, then killed, by the test
    else:
        wait_file("published")
        cluster.attach("x")
        mark("attached")
        wait_file("stopped")
        began = time.monotonic()
        cluster.pull("x")
        mark("pulled", str(time.monotonic() - began))
        wait_file("killed")
        try:
            while True:
                cluster.pull("x")
        except Exception as err:
            mark("lost", f"{time.clock_gettime(time.CLOCK_MONOTONIC)} {type(err).__name__}: {err}")
        cluster.shutdown()
""")


def _read(folder, name: str, proc, timeout: float = 60.0) -> str:
    path = folder / name
    end = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > end or proc.poll() is not None:
            raise AssertionError(f"no {name!r} from {proc.args[-2:]} (rc {proc.poll()})")
        time.sleep(0.01)
    return path.read_text()


def _c10d_timeouts(err: str) -> list[str]:
    return [line for line in err.splitlines() if "c10d" in line and ("timeout" in line or "timed out" in line)]


def test_a_pull_waiting_for_an_answer_or_for_a_killed_owner_logs_no_c10d_timeouts(store, tmp_path):
    url = f"tcp://127.0.0.1:{store.port}?host=0"
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo")
    errs = [open(tmp_path / f"err{n}.txt", "w+") for n in range(2)]
    procs = [subprocess.Popen([sys.executable, "-c", _NODE, url, str(n), str(tmp_path)], cwd=REPO_ROOT, env=env,
                              stdout=subprocess.DEVNULL, stderr=errs[n]) for n in range(2)]
    try:
        owner = int(_read(tmp_path, "published", procs[0]))
        _read(tmp_path, "attached", procs[1])
        # the pull waits ~STOPPED_S for the answer of a stopped (not lost) owner, then gets it
        os.kill(owner, signal.SIGSTOP)
        try:
            assert wait_until(lambda: all_threads_stopped(owner), timeout=5)  # (kill returns before it stops)
            (tmp_path / "stopped").touch()
            time.sleep(STOPPED_S)
        finally:
            os.kill(owner, signal.SIGCONT)
        waited = float(_read(tmp_path, "pulled", procs[1]))
        assert waited > STOPPED_S / 2, waited
        # the owner killed: node 1's pull waits until it is found lost
        os.kill(owner, signal.SIGKILL)
        killed = time.monotonic()
        (tmp_path / "killed").touch()
        ended, error = _read(tmp_path, "lost", procs[1]).split(" ", 1)
        assert error.startswith("OwnerLostError"), error
        assert float(ended) - killed < WITHIN_S, (float(ended) - killed, error)
        assert procs[1].wait(timeout=30) == 0
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=30)
    errs[1].seek(0)
    err = errs[1].read()
    for f in errs:
        f.close()
    assert not _c10d_timeouts(err), (len(_c10d_timeouts(err)), err[-2000:])


def test_a_pull_waiting_for_an_answer_ends_at_once_when_its_node_shuts_down(pair, monkeypatch, capfd):
    """The pull's one long pop is woken by the shutdown (before, it looked at the
    node's state every 0.25 s, each look a logged timeout). In this process: the
    owner's answer never comes (node 1's requests to it are dropped), the owner beats."""
    owner, other = pair
    owner.publish("p", shared_td.TensorDict(x=torch.zeros(4), batch_size=[4]))
    other.attach("p")
    push = other._store.push_json
    monkeypatch.setattr(other._store, "push_json",
                        lambda queue, value: None if queue.startswith("lane/0/") else push(queue, value))
    ended = []

    def pull():
        try:
            other.pull("p")
        except Exception as err:  # noqa: BLE001 - the test looks at it
            ended.append((time.monotonic(), err))

    puller = threading.Thread(target=pull)
    puller.start()
    time.sleep(1.0)  # the pull waits for its answer
    assert not ended and puller.is_alive()
    shut = time.monotonic()
    other.shutdown()
    puller.join(10)
    assert ended and isinstance(ended[0][1], RuntimeError), ended
    assert "while it waited for node 0's answer about 'p'" in str(ended[0][1])
    assert ended[0][0] - shut < 1.0, ended[0][0] - shut
    err = capfd.readouterr().err
    assert not _c10d_timeouts(err), (len(_c10d_timeouts(err)), err[-2000:])
