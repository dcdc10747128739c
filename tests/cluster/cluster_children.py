"""Node process trees for the cluster tests: each child is one "node" on 127.0.0.1.

A node runs its own Coordinator and a Cluster member, then executes the commands the
test sends on its queue (``publish``, ``attach``, ``sync``, ...), answering each on its
result queue: ``("ok", value)`` or ``("error", exception type, message)``. Every queue
read is bounded, and a node whose test went away stops by itself.
"""
from __future__ import annotations

import os
import queue as queues
import signal
import tempfile
import time

import torch

import shared_td
from shared_td.coordinator import cluster_replica, cluster_serve, cluster_waits
from shared_td.coordinator.cluster import Cluster
from shared_td.coordinator.cluster_transfer import PairGroups
from tests.cluster import stripe_children

IDLE_S = 60  # a node that gets no command for this long exits


def make_td(rows: int, fill: float = 0.0):
    return shared_td.TensorDict(
        w=torch.arange(rows, dtype=torch.float32) + fill,
        nested=shared_td.TensorDict(i=torch.full((rows, 3), int(fill), dtype=torch.int64), batch_size=[rows]),
        batch_size=[rows],
    )


@shared_td.tensorclass
class Step:
    """A tensorclass with a non-tensor field (defined here: every node and worker imports it)."""

    obs: torch.Tensor
    reward: torch.Tensor
    label: str


def kinds_td(rows: int, fill: float = 0.0):
    """A tree of every replicated kind: a tensorclass (with a non-tensor field), a lazy
    stack of members of different shapes (stacked along dim 1), a non-tensor value in a
    nested TensorDict, names of dims."""
    members = [shared_td.TensorDict(a=torch.full((rows,), fill + m), b=torch.full((rows, width), fill + m),
                                    batch_size=[rows]) for m, width in enumerate((2, 5))]
    td = shared_td.TensorDict(
        step=Step(obs=torch.arange(rows * 3.0).reshape(rows, 3) + fill, reward=torch.zeros(rows, 1), label="walk",
                  batch_size=[rows]),
        lazy=shared_td.LazyStackedTensorDict(*members, stack_dim=1),
        sub=shared_td.TensorDict(x=torch.full((rows,), fill), tag="t", batch_size=[rows]),
        batch_size=[rows],
    )
    td.names = ["time"]
    return td


def _as_test_says(tmpdir):
    # A forkserver child has the environment of the forkserver's start, not the test's
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    os.environ["TMPDIR"] = tempfile.tempdir = tmpdir


def node_main(url, node, nodes, authkey, commands, results, tmpdir, options=None):
    """``options``: more keyword arguments of this node's Cluster (e.g. ``stripes``), and
    ``min_rate``: this node's ``cluster_waits.MIN_RATE`` (a lower one makes a wait that
    only its bound ends last long enough to be told from one ended by the heartbeat)."""
    _as_test_says(tmpdir)
    options = dict(options or {})
    if "min_rate" in options:
        cluster_waits.MIN_RATE = options.pop("min_rate")
    coord = shared_td.Coordinator().start()
    try:
        cluster = Cluster(url, node, nodes, authkey=authkey, timeout=15.0, coordinator=coord,
                          hostname="127.0.0.1", **options).start()
    except BaseException as err:
        coord.shutdown()
        results.put(("error", type(err).__name__, str(err)))
        return
    coord.cluster = cluster  # as Coordinator(cluster=...) does: coord.attach goes through it
    results.put(("ok", os.getpid()))
    counters = {}
    while True:
        try:
            command, *args = commands.get(timeout=IDLE_S)
        except queues.Empty:
            break
        if command == "stop":
            break
        try:
            results.put(("ok", _run(cluster, coord, counters, command, *args)))
        except BaseException as err:  # reported, the node keeps serving
            results.put(("error", type(err).__name__, str(err)))
    cluster.shutdown()
    coord.shutdown()
    results.put(("ok", "stopped"))


def _run(cluster, coord, counters, command, *args):
    if command == "publish":
        name, rows, fill = args
        td = cluster.publish(name, make_td(rows, fill))
        return td["w"]._backing.key
    if command == "attach":
        td = cluster.attach(args[0])
        return td["w"]._backing.key, cluster.version(args[0])
    if command == "coord_attach":  # what the node's users call: Coordinator.attach, is_stale, refresh
        view = coord.attach(args[0])
        return (view["w"]._backing.key, shared_td.is_stale(view), shared_td.refresh(view)["w"]._backing.key,
                cluster.is_stale(args[0]), view["w"][:2].tolist())
    if command == "read":
        td = cluster.attach(args[0])
        return td["w"].tolist(), td["nested", "i"][:, 0].tolist()
    if command == "fill":  # owner: w <- arange + value, i <- value
        name, value = args
        td = cluster.attach(name)
        td["w"].copy_(torch.arange(td.batch_size[0], dtype=torch.float32) + value)
        td["nested", "i"].fill_(int(value))
        return None
    if command == "sync":
        report = cluster.sync(args[0], *args[1:])
        return report.version, report.delivered, sorted(report.dropped)
    if command == "sync_reasons":  # each dropped node with why
        report = cluster.sync(args[0], *args[1:])
        return report.version, report.delivered, report.dropped
    if command == "timed_sync":  # the sync's own duration, without the test's queues
        began = time.monotonic()
        report = cluster.sync(args[0], *args[1:])
        return time.monotonic() - began, report.version, report.delivered, sorted(report.dropped)
    if command == "pull":
        return cluster.pull(args[0])
    if command == "push":
        name, rows, value = args
        td = cluster.attach(name)
        td["w"][rows] = value
        return cluster.push(name, rows)
    if command == "pull_loop":  # pull until an error (the owner killed meanwhile)
        name, seconds, started = args
        deadline, pulls = time.monotonic() + seconds, 0
        while time.monotonic() < deadline:
            try:
                cluster.pull(name)
            except Exception as err:
                return pulls, type(err).__name__, time.monotonic(), cluster.version(name), repr(err.__cause__)[:300]
            pulls += 1
            _say_started(started, pulls)
        return pulls, None, time.monotonic(), cluster.version(name), None
    if command == "push_loop":  # push one row at a time until an error (the owner killed meanwhile)
        name, seconds, started = args
        td = cluster.attach(name)
        deadline, pushes = time.monotonic() + seconds, 0
        while time.monotonic() < deadline:
            row = pushes % td.batch_size[0]
            td["w"][row] = float(pushes)
            try:
                cluster.push(name, [row])
            except Exception as err:
                return pushes, type(err).__name__, time.monotonic(), repr(err.__cause__)[:300]
            pushes += 1
            _say_started(started, pushes)
        return pushes, None, time.monotonic(), None
    if command == "push_rows_loop":  # push its first `count` rows at once, in a loop, until an error
        name, count, seconds, started = args
        td = cluster.attach(name)
        deadline, pushes = time.monotonic() + seconds, 0
        while time.monotonic() < deadline:
            td["w"][:count] = float(pushes)
            try:
                cluster.push(name, slice(0, count))
            except Exception as err:
                return pushes, type(err).__name__, time.monotonic(), repr(err.__cause__)[:300]
            pushes += 1
            _say_started(started, pushes)
        return pushes, None, time.monotonic(), None
    if command == "push_cut":  # push the first `count` rows, SIGKILLed `delay` s into their send
        name, count, delay = args
        _die_during_big_sends(delay)
        td = cluster.attach(name)
        td["w"][:count] = -1.0
        return cluster.push(name, slice(0, count))
    if command == "unique_w":  # the distinct values of w
        return torch.unique(cluster.attach(args[0])["w"]).tolist()
    if command == "push_listeners":  # this node's threads that keep a receive posted for a peer's pushes
        return [t.name for t in cluster._threads if t.name.startswith(cluster_serve.LISTENER) and t.is_alive()]
    if command == "version":
        return cluster.version(args[0])
    if command == "wait_version":
        return cluster_replica.wait_version(cluster.attach(args[0]), args[1], timeout=10)
    if command == "worker_read":  # a spawn worker of this node attaches through the Coordinator
        return _worker_read(coord, args[0])
    if command == "coordinator":  # where this node's workers attach (the test attaches as one)
        return coord.address, coord.authkey
    if command == "counter_add":
        return cluster.counter(args[0]).fetch_add(args[1])
    if command == "claim_rows":  # take rows with a cluster SharedCounter, write and push them
        name, total, batch = args
        counter = shared_td.SharedCounter(f"{name}-cursor", cluster=cluster)
        td = cluster.attach(name)
        mine = []
        while True:
            start = counter.fetch_add(batch)
            if start >= total:
                return mine
            index = torch.arange(start, min(start + batch, total))
            td["w"][index] = float(cluster.node)
            td["nested", "i"][index] = cluster.node
            cluster.push(name, index)
            mine.extend(index.tolist())
    if command == "publish_kinds":  # a tensorclass and a lazy stack in one tree
        name, rows, fill = args
        return _kinds_state(cluster.publish(name, kinds_td(rows, fill), share_non_tensor=True))
    if command == "kinds":  # this node's view of such a tree
        return _kinds_state(cluster.attach(args[0]))
    if command == "fill_kinds":  # every tensor of the tree <- value
        name, value = args
        td = cluster.attach(name)
        for leaf in (td["step"].obs, td["step"].reward, td["sub", "x"], *(m[k] for m in td["lazy"].tensordicts
                                                                          for k in ("a", "b"))):
            leaf.fill_(value)
        return None
    if command == "push_kinds":  # rows of the tensorclass and of every member of the stack <- value, pushed
        name, rows, value = args
        td = cluster.attach(name)
        td["step"].obs[rows] = value
        for member in td["lazy"].tensordicts:
            member["b"][rows] = value
        return cluster.push(name, rows)
    if command == "worker_kinds":  # a spawn worker of this node attaches the tree by address
        return _in_worker(coord, worker_kinds, *args)
    if command == "publish_values":  # a tree with share_non_tensor values
        name, rows, task = args
        cluster.publish(name, values_td(rows, task), share_non_tensor=True)
        return None
    if command == "set_value":  # returns when it was set (CLOCK_MONOTONIC: one clock per machine)
        name, key, value = args
        td = cluster.attach(name)
        began = time.monotonic()
        td.set_(key, value)
        return began
    if command == "write_values":  # count writes in a row
        name, key, prefix, count = args
        td = cluster.attach(name)
        for i in range(count):
            td.set_(key, f"{prefix}-{i}")
        return None
    if command == "wait_value":  # the time the value was first seen here
        name, key, value, timeout = args
        td = cluster.attach(name)
        deadline = time.monotonic() + timeout
        while td[key] != value:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{key} is {td[key]!r}, not {value!r}, after {timeout} s")
            time.sleep(2e-5)
        return time.monotonic()
    if command == "get_value":
        return cluster.attach(args[0])[args[1]]
    if command == "worker_set":  # a spawn worker of this node sets the value through its own attach
        return _in_worker(coord, worker_set, *args)
    if command in stripe_children.COMMANDS:  # the striped transfers' own
        return stripe_children.COMMANDS[command](cluster, *args)
    raise ValueError(f"unknown command {command!r}")


def _say_started(path: str, calls: int) -> None:
    """After a loop's first call came back: create ``path``, which the test waits for
    before it kills the owner (a fixed pause could end before a 100 MB push did, on a
    loaded machine, and the loop then had no call to show)."""
    if calls == 1:
        open(path, "x").close()


def _die_during_big_sends(delay: float) -> None:
    """From now on, this process SIGKILLs itself ``delay`` s after it posts a gloo send of
    over 1 MiB: the message is cut in the middle, as by a machine that dies."""
    real = PairGroups.send

    def send(self, peer, generation, tensor, tag, deadline=None, stripes=1):
        works = real(self, peer, generation, tensor, tag, deadline, stripes)
        if tensor.numel() > 1 << 20:
            time.sleep(delay)
            os.kill(os.getpid(), signal.SIGKILL)
        return works

    PairGroups.send = send


def values_td(rows: int, task):
    return shared_td.TensorDict(w=torch.zeros(rows), task=task, batch_size=[rows])


def _worker_read(coord, name):
    return _in_worker(coord, worker_attach, name)


def _in_worker(coord, target, *args):
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    worker = ctx.Process(target=target, args=(coord.address, coord.authkey, *args, out))
    worker.start()
    try:
        return out.get(timeout=60)
    finally:
        worker.join(30)
        if worker.is_alive():
            worker.kill()
            worker.join(5)


def worker_attach(address, authkey, name, out):
    td = shared_td.attach(name, address=address, authkey=authkey)
    out.put((td["w"].tolist(), td["w"]._backing.key, cluster_replica.replica_version(td)))


def _kinds_state(td):
    """What a test compares of a kinds_td tree, as plain data."""
    lazy = td["lazy"]
    return {
        "classes": (type(td).__name__, type(td["step"]).__name__, type(lazy).__name__),
        "batch": (list(td.batch_size), list(td["step"].batch_size), list(lazy.batch_size), lazy.stack_dim),
        "names": td.names, "label": td["step"].label, "tag": td["sub", "tag"],
        "obs": td["step"].obs.tolist(), "x": td["sub", "x"].tolist(),
        "members": [{k: m[k].tolist() for k in ("a", "b")} for m in lazy.tensordicts],
        "segment": tuple(td["step"].obs._backing.key),
        "version": cluster_replica.replica_version(td) if _is_replica(td) else None,
    }


def _is_replica(td):
    try:
        cluster_replica.replica_version(td)
    except ValueError:
        return False
    return True


def worker_kinds(address, authkey, name, label, out):
    td = shared_td.attach(name, address=address, authkey=authkey)
    state = _kinds_state(td)
    td["step"].set_("label", label)  # the worker's write reaches every node
    out.put(state)


def worker_set(address, authkey, name, key, value, out):
    td = shared_td.attach(name, address=address, authkey=authkey)
    before = td[key]
    td.set_(key, value)
    out.put((before, time.monotonic()))


def coordinator_node(url, node, nodes, authkey, results, tmpdir):
    """A node through the Coordinator's own API: node 0 owns "policy", node 1 attaches,
    each step checked against the other node through the store's counter."""
    _as_test_says(tmpdir)
    try:
        with shared_td.Coordinator(cluster=url, node=node, nodes=nodes, authkey=authkey, timeout=15.0) as coord:
            steps = coord.counter("steps")
            if node == 0:
                td = coord.publish("policy", make_td(16, 2.0), replicate=True)
                steps.fetch_add(1)  # published
                _wait_counter(steps, 2)  # node 1 attached
                td["w"].fill_(5.0)
                report = coord.sync("policy")
                steps.fetch_add(1)  # synced
                _wait_counter(steps, 4)  # node 1 pushed rows 0 and 1
                results.put(("ok", report.delivered, td["w"][:3].tolist(), coord.version("policy")))
                _wait_counter(steps, 5)  # node 1 done: keep serving until then
            else:
                _wait_counter(steps, 1)
                view = coord.attach("policy")
                first = view["w"][:2].tolist()
                steps.fetch_add(1)
                _wait_counter(steps, 3)
                synced = view["w"][:2].tolist(), coord.version("policy")
                view["w"][:2] = -1.0
                coord.push("policy", [0, 1])
                steps.fetch_add(1)
                results.put(("ok", first, synced, coord.attach("policy") is view, coord.names()))
                steps.fetch_add(1)
    except BaseException as err:
        results.put(("error", type(err).__name__, str(err)))


def _wait_counter(counter, value, timeout=30):
    import time

    deadline = time.monotonic() + timeout
    while counter.value < value:
        if time.monotonic() > deadline:
            raise TimeoutError(f"counter {counter.name} did not reach {value}")
        time.sleep(0.01)
