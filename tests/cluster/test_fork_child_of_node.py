"""A fork child of a node's process (a DataLoader worker, a forked actor): its store
calls make connections of its own (the inherited sockets are the parent's: a child's
call went out beside the parent's on one connection and each read the other's answer),
they are bounded by a watch of its own, and it is refused what only the node can do."""
from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

dist = pytest.importorskip("torch.distributed")

from shared_td.coordinator.cluster_store import SignedStore  # noqa: E402
from tests.cluster import stalled_host_children as children  # noqa: E402
from tests.cluster.test_cluster_store import store  # noqa: E402,F401 (a fixture)
from tests.processes import all_threads_stopped, fork_exit_code, wait_until  # noqa: E402

KEY = b"fork-child-of-a-node test key 0123"
BOUND_S = 60  # every wait of these tests


def _forked(body) -> int:
    """Run ``body()`` in a fork child (bounded by an alarm); the child's exit status:
    0 when it returned True."""
    pid = os.fork()
    if pid == 0:
        gc.disable()  # (the test process's garbage is not the child's to collect: a fork in a test runner)
        try:
            signal.alarm(BOUND_S)
            os._exit(0 if body() else 1)
        except BaseException:  # noqa: BLE001 - the status tells the test
            os._exit(2)
    return pid


def _status(pid: int) -> int:
    code = fork_exit_code(pid, BOUND_S + 5)
    assert code is not None, "the fork child did not end within its bound"
    return code


def test_a_fork_child_and_its_parent_use_the_store_at_once(store):  # noqa: F811 (fixture)
    signed = SignedStore(store, KEY, timeout=10.0)
    signed.set_json("value", {"x": 1})
    signed.add("count", 0)  # the parent's thread has its connection: the child inherits it
    adds = 2000

    def child() -> bool:
        return all(signed.add("count", 1) > 0 for _ in range(adds))

    pid = _forked(child)
    wrong = [value for value in (signed.get_json("value") for _ in range(adds)) if value != {"x": 1}]
    assert _status(pid) == 0
    assert wrong == []
    assert signed.add("count", 0) == adds  # every addition counted once, and this connection still answers
    signed.close()


def test_a_fork_childs_store_call_is_bounded_when_the_host_stops():
    ctx = multiprocessing.get_context("spawn")
    ports = ctx.Queue()
    host = ctx.Process(target=children.store_host, args=(ports,), daemon=True)
    host.start()
    try:
        import datetime

        # (the child's first call connects: torch's connect tries run within the raw store's timeout)
        raw = dist.TCPStore("127.0.0.1", ports.get(timeout=BOUND_S), None, False, datetime.timedelta(seconds=3))
        signed = SignedStore(raw, KEY, timeout=3.0)
        signed.set_json("a", 1)  # the parent's watch runs; the child's thread did not come along

        def child() -> bool:
            os.kill(host.pid, signal.SIGSTOP)
            wait_until(lambda: all_threads_stopped(host.pid), timeout=5)  # (kill returns before it stops)
            began = time.monotonic()
            try:
                signed.get_json("a")
            except ConnectionError:
                return time.monotonic() - began < 15.0
            return False

        # another thread of the parent with its connection (the child inherits its socket)
        forked, resumed, answers = threading.Event(), threading.Event(), []

        def other_thread() -> None:
            answers.append(signed.get_json("a"))
            forked.wait(BOUND_S)
            resumed.wait(BOUND_S)
            answers.append(signed.get_json("a"))

        thread = threading.Thread(target=other_thread, daemon=True)
        thread.start()
        status = _status(_forked(child))
        forked.set()
        assert status == 0, "the fork child's call to a stopped host was not bounded (3 s timeout)"
        os.kill(host.pid, signal.SIGCONT)
        resumed.set()
        thread.join(BOUND_S)
        # the child cut its own connection only: the parent's, which it inherited, still answer
        assert answers == [1, 1] and signed.get_json("a") == 1
    finally:
        os.kill(host.pid, signal.SIGCONT)
        host.kill()
        host.join(10)


_OWNER = textwrap.dedent("""
    import os, sys, time, torch, shared_td

    coord = shared_td.Coordinator(cluster=sys.argv[1], node=0, nodes=2, authkey=sys.argv[2], timeout=15.0).start()
    coord.publish("x", shared_td.TensorDict(w=torch.arange(4.0), batch_size=[4]), replicate=True)
    end = time.monotonic() + 90
    while not os.path.exists(sys.argv[3]) and time.monotonic() < end:
        time.sleep(0.05)
    coord.shutdown()
""")

# Node 1 attaches node 0's "x", then forks: the child tries what only the node does, then
# what it may do; the parent then pulls and pushes as before.
_REPLICA = textwrap.dedent("""
    import os, signal, socket, subprocess, sys, time, torch, shared_td

    key, stop = "fork child test key 0123", os.path.abspath("stop")
    free = socket.socket(); free.bind(("127.0.0.1", 0)); url = f"tcp://127.0.0.1:{free.getsockname()[1]}"; free.close()
    owner = subprocess.Popen([sys.executable, "-c", sys.argv[1], url, key, stop])
    try:
        coord = shared_td.Coordinator(cluster=url, node=1, nodes=2, authkey=key, timeout=15.0).start()
        end = time.monotonic() + 60
        while not coord.cluster.knows("x") and time.monotonic() < end:  # (the owner publishes it)
            time.sleep(0.05)
        view, counter = coord.attach("x"), coord.counter("c")
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            signal.alarm(60)
            said = []
            for what, call in [("pull", lambda: coord.pull("x")), ("push", lambda: coord.push("x", [0])),
                               ("sync", lambda: coord.sync("x")),
                               ("publish", lambda: coord.publish("y", shared_td.TensorDict(w=torch.zeros(2)),
                                                                 replicate=True))]:
                try:
                    call()
                    said.append(f"{what}: no error")
                except Exception as err:
                    said.append(f"{what}: " + ("refused" if "fork child of node 1" in str(err) else repr(err)))
            said.append(f"fetch_add {counter.fetch_add(5)} {coord.counter('c').fetch_add(1)}")
            said.append(f"attach {coord.attach('x')['w'].tolist()}")
            os.write(write, ";".join(said).encode())
            os._exit(0)
        os.close(write)
        _, status = os.waitpid(pid, 0)
        print(os.read(read, 65536).decode())
        view["w"][0] = 7.0
        coord.push("x", [0])
        print("parent", status, coord.pull("x"), view["w"].tolist(), counter.value)
        coord.shutdown()
    finally:
        open(stop, "w").close()
        owner.wait(60)
""")


def test_a_fork_child_of_a_node_is_refused_the_nodes_calls_and_keeps_its_counter(tmp_path):
    done = subprocess.run([sys.executable, "-c", _REPLICA, _OWNER], capture_output=True, text=True, timeout=150,
                          cwd=tmp_path, env={**os.environ, "GLOO_SOCKET_IFNAME": "lo"})
    assert done.returncode == 0, done.stderr[-3000:]
    child, parent = done.stdout.strip().splitlines()[-2:]
    assert child == ("pull: refused;push: refused;sync: refused;publish: refused;fetch_add 0 5;"
                     "attach [0.0, 1.0, 2.0, 3.0]"), child
    # the node pulls and pushes on (its push reached the owner: the pull brings the row back), the child's
    # additions counted
    assert parent == "parent 0 3 [7.0, 1.0, 2.0, 3.0] 6", parent  # (version 3: the publish, the attach, this pull)
