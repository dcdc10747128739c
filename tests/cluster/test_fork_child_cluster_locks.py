"""fork21: a fork child of a cluster node's process, made while another thread of the parent held
a lock the child's reads take (each in a script of its own, a real fork, bounded)."""
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch.distributed")

from tests.cluster.test_fork_child_of_node import _OWNER  # noqa: E402 (node 0 publishing "x")

BOUND_S = 120

_GENERATIONS = textwrap.dedent("""
    import os, signal, sys, threading, time
    from shared_td.coordinator import cluster_generations as generations

    class Store:  # gen/x missing, name/x committed: the look takes the module's lock
        def get_signed(self, key):
            return (None, None) if key.startswith("gen/") else ({"generation": 1, "digest": "d", "owner": 0}, b"b")
        def compare_set(self, *args): return b""
        def sign(self, key, data): return data

    held, go = threading.Event(), threading.Event()
    def holder():
        with generations._LOCK:
            held.set(); go.wait(30)
    threading.Thread(target=holder, daemon=True).start(); held.wait(10)
    pid = os.fork()
    if pid == 0:
        signal.alarm(10)
        generations.read_identity(Store(), "x", lambda: None)
        os._exit(0)
    go.set()
    _, status = os.waitpid(pid, 0)
    print("child", os.waitstatus_to_exitcode(status))
    print("parent", generations.read_identity(Store(), "x", lambda: None))
""")


def test_fork_child_reads_a_name_while_a_parent_thread_holds_the_generations_lock():
    done = subprocess.run([sys.executable, "-c", _GENERATIONS], capture_output=True, text=True, timeout=BOUND_S)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["child", "0", "parent", "(1,", "'d')"], done.stdout  # (-14: the alarm)


# node 1 attaches "x"; a thread of it is inside another attach (holds the node's attach lock, as a
# renewal lane does) at the fork and ends it 0.5 s later; the child then attaches and refreshes "x"
_REPLICA = textwrap.dedent("""
    import os, signal, socket, subprocess, sys, threading, time, torch, shared_td

    key, stop = "fork21 attach lock test key 01234", os.path.abspath("stop")
    free = socket.socket(); free.bind(("127.0.0.1", 0)); url = f"tcp://127.0.0.1:{free.getsockname()[1]}"; free.close()
    owner, main = subprocess.Popen([sys.executable, "-c", sys.argv[1], url, key, stop]), os.getpid()
    try:
        coord = shared_td.Coordinator(cluster=url, node=1, nodes=2, authkey=key, timeout=15.0).start()
        end = time.monotonic() + 60
        while not coord.cluster.knows("x") and time.monotonic() < end:
            time.sleep(0.05)
        view = coord.attach("x")
        held, go = threading.Event(), threading.Event()
        def attaching():
            with coord.cluster._attaching:
                held.set(); go.wait(30)
        threading.Thread(target=attaching, daemon=True).start(); held.wait(10)
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            signal.alarm(60)
            time.sleep(1.0)
            began = time.monotonic()
            try:
                said = f"{coord.attach('x')['w'].tolist()} {shared_td.refresh(view) is view}"
            except Exception as err:
                said = repr(err)
            os.write(write, f"{said} {time.monotonic() - began < 5}".encode())
            os._exit(0)
        os.close(write)
        time.sleep(0.5); go.set()
        _, status = os.waitpid(pid, 0)
        print(os.read(read, 65536).decode())
        print("parent", os.waitstatus_to_exitcode(status), coord.attach("x")["w"].tolist())
        coord.shutdown()
    finally:
        if os.getpid() == main:
            open(stop, "w").close()
            owner.wait(60)
""")


def test_fork_child_attaches_its_nodes_replica_while_a_parent_thread_attaches(tmp_path):
    done = subprocess.run([sys.executable, "-c", _REPLICA, _OWNER], capture_output=True, text=True,
                          timeout=BOUND_S, cwd=tmp_path, env={**os.environ, "GLOO_SOCKET_IFNAME": "lo"})
    assert done.returncode == 0, done.stderr[-3000:]
    child, parent = done.stdout.strip().splitlines()[-2:]
    # before the fix: "TimeoutError('Another attach on this node did not end within 15 s.') False"
    assert child == "[0.0, 1.0, 2.0, 3.0] True True", child
    assert parent == "parent 0 [0.0, 1.0, 2.0, 3.0]", parent
