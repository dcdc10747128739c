"""What the sixteenth audit of the cluster found in a node's lifecycle and its store:

* a node process that ended without ``shutdown()`` (its script ended, or an exception
  escaped it) while its owner synced to it aborted with SIGABRT ("terminate called
  without an active exception"): its daemon threads came back from torch calls into the
  finalizing interpreter. Nothing shut the node down at exit (``shutdown()`` unregistered
  an exit hook that was never registered), and a Coordinator's finalizer stopped only
  its manager;
* each re-publish of a name with ``share_non_tensor`` values left the old generation's
  ``value/`` and ``valver/`` records in the store for good (9 -> 207 -> 407 keys after 1,
  100 and 200 publishes).

Nodes as real processes where the interpreter's exit is what is tested, in this process
on a loopback store otherwise; every wait bounded."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
import weakref

import pytest
import torch

pytest.importorskip("torch.distributed")

import shared_td  # noqa: E402
from shared_td.coordinator import cluster_serve  # noqa: E402
from shared_td.coordinator.cluster import Cluster  # noqa: E402
from tests.cluster.test_cluster_store import KEY, pair, store  # noqa: E402,F401 - fixtures
from tests.processes import wait_until  # noqa: E402

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# One node of a 3-node cluster: node 0 owns "x" and syncs it without a pause until told
# to stop; node 1 (a bare Cluster) and node 2 (a Coordinator(cluster=...)) attach it,
# see syncs arrive, then end without shutdown(): node 1's script simply ends, an
# exception escapes node 2's. Node 0 first forks a child whose exit runs the exit hooks
# it inherited: they must leave node 0 running (the replicas attach after it).
_NODE = textwrap.dedent("""
    import atexit, os, sys, time
    import torch, shared_td
    from shared_td.coordinator.cluster import Cluster

    url, node, folder = sys.argv[1], int(sys.argv[2]), sys.argv[3]

    def wait_file(name):
        end = time.monotonic() + 60
        while not os.path.exists(os.path.join(folder, name)):
            if time.monotonic() > end or os.path.exists(os.path.join(folder, "failed")):
                raise TimeoutError(name)
            time.sleep(0.01)

    if node == 1:
        cluster = Cluster(url, 1, 3, authkey=b"audit16-exit test key", timeout=15.0, hostname="127.0.0.1").start()
    else:
        coord = shared_td.Coordinator(cluster=url, node=node, nodes=3, authkey=b"audit16-exit test key", timeout=15.0).start()
        cluster = coord.cluster
    if node == 0:
        coord.publish("x", shared_td.TensorDict(w=torch.zeros(256), batch_size=[256]), replicate=True)
        child = os.fork()
        if child == 0:
            atexit._run_exitfuncs()  # what its interpreter's exit runs (os._exit: no gloo object is freed here)
            os._exit(0)
        if os.waitpid(child, 0)[1] != 0 or cluster._store.get_unchecked("claim/0") != cluster._claim.encode():
            open(os.path.join(folder, "failed"), "w").close()  # the others stop waiting
            raise AssertionError("the fork child's exit let node 0 go")
        open(os.path.join(folder, "published"), "w").close()
        end = time.monotonic() + 60
        while not os.path.exists(os.path.join(folder, "stop")) and time.monotonic() < end:
            cluster.sync("x", 2.0)
        coord.shutdown()
    else:
        wait_file("published")
        cluster.attach("x")
        end = time.monotonic() + 30
        while (cluster.version("x") or 0) < 4 and time.monotonic() < end:  # syncs come in
            time.sleep(0.005)
        print("synced to version", cluster.version("x"), flush=True)
        if node == 2:
            raise RuntimeError("escaped the script")
    # the end of the script: no shutdown() on nodes 1 and 2, whose lanes serve the syncs
""")


def test_a_node_whose_script_ends_without_shutdown_exits_cleanly_while_its_owner_syncs(store, tmp_path):
    """Before: node 1 exited with -6 (SIGABRT, "terminate called without an active
    exception" on stderr), 6 runs of 6 in the audit, and so did node 2."""
    url = f"tcp://127.0.0.1:{store.port}?host=0"
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo")
    procs = [subprocess.Popen([sys.executable, "-c", _NODE, url, str(n), str(tmp_path)], cwd=REPO_ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for n in range(3)]
    try:
        ended = {n: procs[n].communicate(timeout=90) for n in (1, 2)}
        (tmp_path / "stop").touch()
        ended[0] = procs[0].communicate(timeout=60)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate(timeout=30)
    codes = [proc.returncode for proc in procs]
    for n, (out, err) in sorted(ended.items()):
        assert "terminate called" not in err, (n, codes, err[-3000:])
        if n:
            assert "synced to version" in out, (n, out, err[-3000:])
    assert codes == [0, 0, 1], (codes, ended[0][1][-2000:], ended[1][1][-2000:], ended[2][1][-2000:])
    assert "RuntimeError: escaped the script" in ended[2][1]


def test_the_finalizer_of_a_coordinator_shuts_its_cluster_node_down_before_its_manager(store):
    """Before: the finalizer (a started Coordinator collected, or running at exit)
    stopped the manager only; the node's threads kept serving replicas published on the
    stopped manager, and nothing shut the node down."""
    coord = shared_td.Coordinator(cluster=f"tcp://127.0.0.1:{store.port}?host=0", node=0, nodes=1, authkey=KEY,
                                  timeout=10.0).start()
    cluster, manager = coord.cluster, coord._process._popen
    seen = []
    shutdown = cluster.shutdown

    def watched_shutdown():
        seen.append(manager.poll() is None)  # the manager still runs
        shutdown()

    cluster.shutdown = watched_shutdown
    try:
        [finalizer] = [f for f in list(weakref.finalize._registry) if f.peek() and f.peek()[0] is coord]
        finalizer()  # what the collection of coord, or the exit, runs
        assert seen == [True] and cluster._closed
        assert manager.poll() is not None
    finally:
        coord.shutdown()


def _values_td(mode: str):
    return shared_td.TensorDict(w=torch.zeros(4), mode=mode, batch_size=[4])


def test_republishing_a_name_with_values_keeps_the_store_keys_bounded(store):
    """Before: two more keys in the store for good with every publish."""
    with Cluster(store, node=0, nodes=1, authkey=KEY, timeout=10.0) as cluster:
        counts = []
        for publish in range(30):
            cluster.publish("cfg", _values_td("x" * 100), share_non_tensor=True)
            counts.append(store.num_keys())
        assert counts[-1] == counts[0], counts
        assert not store.check(["shared_td/value/cfg/1/0"]) and not store.check(["shared_td/valver/cfg/1/0"])
        assert cluster.attach("cfg")["mode"] == "x" * 100


def test_the_old_generations_records_go_also_when_a_replica_that_did_not_renew_yet_writes_them(
        store, pair, monkeypatch):
    """The owner's re-publish deletes the records of the generation it replaces; a read
    of them never waits (an attach racing the publish: it waited the store's timeout for
    a missing record, holding its lane and the renewal queued behind it), and a replica
    that had not renewed yet and writes a value makes them again: it deletes them once
    it sees the newer generation."""
    owner, other = pair
    owner.publish("cfg", _values_td("first"), share_non_tensor=True)
    replica = other.attach("cfg")
    monkeypatch.setattr(cluster_serve, "renew", lambda *args: None)  # node 1 stays at generation 1 for now
    owner.publish("cfg", _values_td("second"), share_non_tensor=True)
    old = ["shared_td/value/cfg/1/0", "shared_td/valver/cfg/1/0"]
    assert not any(store.check([key]) for key in old)
    began = time.monotonic()
    with pytest.raises(RuntimeError, match=r"Generation 1 of 'cfg' was replaced by a newer publish.*attach 'cfg' "
                                           r"again"):
        other._values.latest("cfg", 1, 1)
    assert time.monotonic() - began < 1.0
    written = other._values.published
    replica.set_("mode", "late")  # generation 1 on node 1: its records made again, then deleted
    assert wait_until(lambda: other._values.published > written, 5)
    assert wait_until(lambda: not any(store.check([key]) for key in old), 5), [store.check([k]) for k in old]
    assert owner.attach("cfg")["mode"] == "second"  # the new generation's value is untouched
    monkeypatch.undo()
    assert other.attach("cfg")["mode"] == "second" and not other.is_stale("cfg")
