"""Benchmark cases across machines, on loopback.

``cluster_sync`` times ``sync`` from the owner node (this process) until a worker
process of node 1, attached through node 1's real Coordinator (not the network), has
seen the new version, unstriped and striped over 2 and 4 gloo groups
(:func:`striped_sync_columns`); node 1 runs in the run's worker process
(:func:`_replica_node_job`), as on another machine. Its references -- a raw gloo
``send``/``recv`` (also striped, the same way) and tensordict 0.15.3's
``consolidate()``+``send``/``recv``, ``init_remote``/``from_remote_init`` and per-leaf
``send``/``recv`` of the same tree -- run in two spawned processes of a registered
default gloo group, as a user runs them (:mod:`~shared_td.bench.cases_cluster_peers`);
one more raw ``send``/``recv`` runs between the nodes' own two processes
(:func:`_raw_between_the_nodes`): the reference that differs from the sync in nothing but
the sync's own work (the dedicated ranks hold nothing else; the nodes' processes hold
the cluster's threads, node 1's Coordinator and the run's other cases).
``cluster_counter`` compares with a bare ``TCPStore.add``; it and ``cluster_value``
share one loopback cluster of two nodes in this process per run
(:class:`SharedLoopback`); ``cluster_push`` runs its two nodes in two processes
(:mod:`~shared_td.bench.cases_cluster_push`). The stores listen on IPv4 127.0.0.1 only
(:mod:`~shared_td.bench.loopback`).
"""
from __future__ import annotations

import contextlib
import multiprocessing
import os
import threading

from shared_td.bench.cases_cluster_peers import STRIPED, policy_tree, start_peers
from shared_td.bench.loopback import HOST, loopback_store, raw_gloo_rank
from shared_td.bench.timing import best_of, paired_medians
from shared_td.bench.worker import shared_worker

_KEY = b"shared_td benchmark key"  # (16 bytes at least)
#: Seconds a loopback cluster may take to start (its nodes give up after 60 s).
_START_S = 130.0


class _Loopback:
    """A TCPStore on a free port and two cluster nodes of this process.

    The store listens on IPv4 only (:mod:`~shared_td.bench.loopback`: no reverse lookup
    in its event loop), and both nodes join through this process's store object, so
    that no node makes a connection of its own in the foreground at its start (their
    threads' connections are made ahead, in the background, by the nodes)."""

    def __init__(self, coordinator=None):
        from shared_td.coordinator.cluster import Cluster

        self.store = loopback_store(30.0)
        self.nodes = [Cluster(self.store, n, 2, authkey=_KEY, timeout=60, hostname=HOST,
                              coordinator=coordinator if n == 1 else None) for n in range(2)]
        errors = []

        def join(node):
            try:
                node.start()
            except Exception as error:  # raised below, in the caller's thread
                errors.append(error)

        threads = [threading.Thread(target=join, args=(node,)) for node in self.nodes]  # each waits for the other
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)  # bounded: each node's start gives up within its timeout (60 s)
        if errors or any(thread.is_alive() for thread in threads):
            self.close()
            raise RuntimeError(f"the loopback cluster's nodes did not start: {errors or 'timed out'}")

    def close(self) -> None:
        for node in self.nodes:
            node.shutdown()


class SharedLoopback:
    """The loopback cluster that ``cluster_counter`` and ``cluster_value`` share in a run:
    one cluster start instead of one per case (a start makes ~20 store connections, and a
    connect waits 5 s whenever the resolver drops torch's reverse lookup, see
    :mod:`~shared_td.bench.loopback`). ``early``: started now, in a background thread, so
    that its start, stalls included, overlaps the cases before (a quick run, after its
    forks: see the runner); else at the first :meth:`get`. The caller must :meth:`close`."""

    def __init__(self, early: bool):
        self._loop: _Loopback | None = None
        self._error: Exception | None = None
        self._thread: threading.Thread | None = None
        if early:
            self._thread = threading.Thread(target=self._start, name="shared_td-bench-loopback", daemon=True)
            self._thread.start()

    def _start(self) -> None:
        try:
            self._loop = _Loopback()
        except Exception as error:  # get() raises it, in a case
            self._error = error

    def get(self) -> _Loopback:
        """The started cluster (the error of its start, if it failed)."""
        if self._thread is None:
            if self._loop is None:
                self._loop = _Loopback()
            return self._loop
        self._thread.join(_START_S)
        if self._thread.is_alive():
            raise TimeoutError(f"the loopback cluster did not start within {_START_S:g} s")
        if self._error is not None:
            raise self._error
        return self._loop

    def close(self) -> None:
        """Stop the cluster (bounded: waits for a start in progress first). Idempotent."""
        if self._thread is not None:
            self._thread.join(_START_S)
        loop, self._loop = self._loop, None
        if loop is not None:
            loop.close()


def _replica_worker(address: str, authkey: bytes, name: str, conn) -> None:
    """A worker of node 1: attaches ``name`` through its node's coordinator (its one
    replica, no copy), then for each (version, value) asked answers once the replica
    holds that version and its first and last leaves read ``value``."""
    import shared_td
    from shared_td.coordinator.cluster_replica import replica_version

    conn.recv()  # the replica exists now
    td = shared_td.attach(name, address=address, authkey=authkey)
    first, last = td["layer0", "weight"], td["layer3", "bias"]
    conn.send("attached")
    while (asked := conn.recv()) is not None:
        version, value = asked
        conn.send(replica_version(td) >= version and float(first[0]) == value and float(last[-1]) == value)


def _replica_node_job(connection, port: int) -> None:  # a job of the run's worker
    """Node 1, the replica node, in the run's worker: another process, as on another
    machine (its own interpreter and GIL: with both nodes in one process, the replica's
    receive waited up to ~3 ms for the GIL the owner held). Its Coordinator, where the
    case's worker attaches, then its Cluster member; answers ``("ready", address,
    authkey)`` before it joins the cluster, and "attached" once it holds the replica of
    each name it is sent, until None. Asked ``(RAW, nbytes, first tag, rounds)``, it
    serves the raw reference of this very pair of processes (:func:`_raw_rounds`)."""
    import shared_td
    from shared_td.coordinator.cluster import Cluster

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    coord = shared_td.Coordinator().start()
    cluster = raw = None
    try:
        connection.send(("ready", coord.address, coord.authkey))
        cluster = Cluster(f"tcp://{HOST}:{port}?host=0", 1, 2, authkey=_KEY, timeout=60, hostname=HOST,
                          coordinator=coord).start()
        while True:
            if not connection.poll(_START_S):  # bounded: the caller stalled or gone
                raise TimeoutError(f"cluster_sync's caller sent nothing within {_START_S:g} s")
            if (asked := connection.recv()) is None:
                return
            if isinstance(asked, tuple) and asked[0] == _RAW:
                raw = _raw_rounds(raw, port, *asked[1:])
                continue
            cluster.attach(asked)
            connection.send("attached")
    finally:
        if cluster is not None:
            cluster.shutdown()
        coord.shutdown()


_RAW = "raw"  # what asks node 1 for the raw reference's receives


def _raw_rounds(raw, port: int, nbytes: int, first: int, rounds: int):
    """Node 1's half of the raw reference between the nodes' own processes: ``rounds``
    receives of ``nbytes`` on tags ``first``.., each answered with 8 bytes (on the tag +
    ANSWER_TAG_BIT) once it completed, the next posted first; joins the raw group
    (``raw``: None the first time) and returns it."""
    import datetime

    import torch

    from shared_td.coordinator.cluster_transfer import ANSWER_TAG_BIT

    raw = raw or raw_gloo_rank(port, 1, _START_S)
    wait = datetime.timedelta(seconds=_START_S)
    buffer, answer = torch.empty(nbytes, dtype=torch.uint8), torch.zeros(8, dtype=torch.uint8)
    posted = raw.recv([buffer], 0, first)
    for n in range(rounds):
        posted.wait(wait)
        if n + 1 < rounds:
            posted = raw.recv([buffer], 0, first + n + 1)
        raw.send([answer], 0, (first + n) | ANSWER_TAG_BIT).wait(wait)
    return raw


def _raw_between_the_nodes(options, nbytes: int, node1, port: int, refill) -> float:
    """The raw reference in the two processes the nodes run in (this one and node 1's):
    a gloo send of ``nbytes`` from this process, refilled as the synced tree is, until
    node 1's answer that it received them (best of ``options.repeat``). The other raw
    columns run between two processes started for them (cases_cluster_peers), which
    hold nothing else."""
    import torch

    from shared_td.coordinator.cluster_transfer import ANSWER_TAG_BIT

    rounds = options.repeat + 1  # the first one untimed
    node1.send((_RAW, nbytes, 0, rounds))
    raw = raw_gloo_rank(port, 0, _START_S)
    payload, answer = torch.empty(nbytes, dtype=torch.uint8), torch.empty(8, dtype=torch.uint8)
    tags = iter(range(rounds))

    def fill():
        with _one_thread():
            payload.fill_(refill())

    def send(_):
        tag = next(tags)
        answered = raw.recv([answer], 1, tag | ANSWER_TAG_BIT)
        raw.send([payload], 1, tag).wait()
        answered.wait()

    send(fill())
    return best_of(options.repeat, fill, send)


def sync_peers(options):
    """``cluster_sync``'s two reference ranks for ``options``, started now (forked with
    ``options.fork``; see :func:`~shared_td.bench.cases_cluster_peers.start_peers`)."""
    return start_peers(_sync_bytes(options), options.repeat, "fork" if options.fork else "spawn")


def _sync_bytes(options) -> int:
    return min(options.size_mib, 100) << 20


def case_cluster_sync(options, root: str, peers=None) -> dict:
    """``sync`` of a tree of min(size-mib, 100) MiB owner -> one replica node, until a
    worker process of that node sees it, against a raw gloo send/recv of the same bytes
    and tensordict 0.15.3's ways, each between two processes of a registered gloo group
    (see :mod:`~shared_td.bench.cases_cluster_peers`; its columns are left out without
    tensordict). ``peers``: those ranks if the caller started them already
    (:func:`sync_peers`); the case closes them in any case."""
    nbytes = _sync_bytes(options)
    if peers is None:
        peers = start_peers(nbytes, options.repeat)  # they get ready while this process does
    try:
        synced = _sync_column(options, nbytes, peers.ready)
    except BaseException:
        peers.close()
        raise
    return {**peers.measure(), **synced}


def _sync_column(options, nbytes: int, before_timing) -> dict:
    from shared_td.coordinator.cluster import Cluster

    store = loopback_store(_START_S)
    worker = shared_worker()
    node1 = worker.start_job(_replica_node_job, store.port)
    node1_ended, owner, reader = False, None, None
    here, there = multiprocessing.Pipe()
    try:
        said = _said(node1)
        if said[0] != "ready":  # the job ended: its answer, an error
            node1_ended = True
            raise RuntimeError(f"the replica node did not start: {said[1]}")
        _, address, authkey = said
        # forked before this process's node makes its threads; it needs no fresh interpreter
        reader = multiprocessing.get_context("fork").Process(
            target=_replica_worker, args=(address, authkey, "weights", there), daemon=True)
        reader.start()
        owner = Cluster(store, 0, 2, authkey=_KEY, timeout=60, hostname=HOST).start()  # node 1 waits for it
        weights = owner.publish("weights", policy_tree(nbytes))
        node1.send("weights")
        if (said := _said(node1)) != "attached":
            node1_ended = True
            raise RuntimeError(f"the replica node did not attach: {said[1]}")
        here.send(True)
        if not here.poll(60) or here.recv() != "attached":
            raise RuntimeError("the replica node's worker did not attach")
        fills = iter(range(1, 10**9))

        def refill():  # untimed: new contents, as a learner's step makes them
            value = float(next(fills))
            with _one_thread():
                for leaf in weights.values(True, True):
                    leaf.fill_(value)
            return value

        def sync_seen(value):
            report = owner.sync("weights")
            here.send((report.version, value))
            if not here.poll(60) or not here.recv():
                raise RuntimeError("the replica node's worker did not see the synced version")

        before_timing()  # nothing else of the case runs meanwhile
        return {"shared_td sync+worker": best_of(options.repeat, refill, sync_seen),
                **striped_sync_columns(options, nbytes, owner, refill, sync_seen),
                "raw gloo send/recv, nodes' processes": _raw_between_the_nodes(
                    options, nbytes, node1, store.port, refill)}
    finally:
        _end_sync_processes(worker, node1, node1_ended, reader, here)
        there.close()
        if owner is not None:
            owner.shutdown()


def _said(connection):
    """The next message of the replica node's job (bounded)."""
    if not connection.poll(_START_S):
        raise TimeoutError(f"the replica node sent nothing within {_START_S:g} s")
    return connection.recv()


def _end_sync_processes(worker, node1, node1_ended: bool, reader, here) -> None:
    """End the replica node's worker and job (bounded: a process that does not answer
    is stopped)."""
    try:
        here.send(None)  # the worker leaves
    except OSError:
        pass  # it is gone already: joined below
    if reader is not None:
        reader.join(30)
        if reader.is_alive():
            reader.kill()
            reader.join(5)
    here.close()
    if not node1_ended:
        try:
            node1.send(None)
        except OSError:  # the run's worker is gone: result() says so
            pass
        worker.result(_START_S)


@contextlib.contextmanager
def _one_thread():
    """torch on one thread in the block. After a parallel ``fill_`` of the tree, torch's
    OpenMP workers spin for ~10 ms of CPU (libgomp, measured: 8-10 ms of CPU in a 50 ms
    sleep after a 100 MB ``fill_``), which on 2 cores took a core from the gloo threads
    of the timed ``sync`` right after the untimed refill (the raw reference writes
    nothing between its transfers)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def striped_sync_columns(options, nbytes: int, owner, refill, sync_seen) -> dict:
    """The same ``sync`` (until the worker sees it) with the owner's ``stripes`` set to
    each count of STRIPED: the payload in that many byte ranges over as many gloo groups
    of the pair (built by one untimed sync first). None for ``nbytes`` under
    ``STRIPE_MIN_BYTES``: that goes over one group whatever the count."""
    from shared_td.coordinator.cluster_transfer import STRIPE_MIN_BYTES

    columns = {}
    if nbytes < STRIPE_MIN_BYTES:
        return columns
    unstriped = owner.stripes
    try:
        for count in STRIPED:
            owner.stripes = count
            sync_seen(refill())  # the pair's extra groups are built here, untimed
            columns[f"shared_td sync x{count} stripes+worker"] = best_of(options.repeat, refill, sync_seen)
    finally:
        owner.stripes = unstriped
    return columns


def case_cluster_counter(options, root: str, loop: _Loopback | None = None) -> dict:
    """A cluster counter's ``fetch_add`` against a raw ``TCPStore.add``: the median call,
    the two alternating call by call. ``loop``: the run's loopback cluster
    (:class:`SharedLoopback`), else the case starts its own."""
    own = loop is None
    if own:
        loop = _Loopback()
    try:
        counter = loop.nodes[1].counter("cursor")
        counter.value  # untimed: this thread's connection to the store, made now
        client = loop.store  # a bare TCPStore client: the store object's own connection
        # call by call, side by side (see paired_medians): batches timed one after the
        # other gave ratios from 0.8x to 2x on an idle machine
        return paired_medians(options.rounds * 10 * options.repeat, {
            "raw TCPStore.add": lambda: client.add("raw", 1),
            "shared_td fetch_add": lambda: counter.fetch_add(1),
        })
    finally:
        if own:
            loop.close()
