"""Benchmark cases across machines, on loopback: two cluster nodes in one process.

Both nodes are :class:`~shared_td.coordinator.cluster.Cluster` members of this process
(their own threads, sockets and gloo pairs). ``cluster_sync`` times ``sync`` until a
worker process of node 1, attached through node 1's real Coordinator (not the network),
has seen the new version; its references -- a raw gloo ``send``/``recv`` and tensordict
0.15.3's ``consolidate()``+``send``/``recv``, ``init_remote``/``from_remote_init`` and
per-leaf ``send``/``recv`` of the same tree -- run in two spawned processes of a
registered default gloo group, as a user runs them
(:mod:`~shared_td.bench.cases_cluster_peers`). ``cluster_push`` and ``cluster_counter``
compare with the same torch.distributed parts in this process: a two-rank gloo group
whose ranks run in two threads, and the bare ``TCPStore``.
"""
from __future__ import annotations

import datetime
import multiprocessing
import threading

import torch
import torch.distributed as dist

from shared_td.bench.cases_cluster_peers import policy_tree, start_peers
from shared_td.bench.timing import best_of

_KEY = b"benchmark key"


class _Loopback:
    """A TCPStore on a free port, two cluster nodes and a raw two-rank gloo pair."""

    def __init__(self, coordinator=None):
        from shared_td.coordinator.cluster import Cluster

        self.store = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=30),
                                   wait_for_workers=False)
        url = f"tcp://127.0.0.1:{self.store.port}?host=0"
        self.nodes = [Cluster(url, n, 2, authkey=_KEY, timeout=60, hostname="127.0.0.1",
                              coordinator=coordinator if n == 1 else None) for n in range(2)]
        self.raw = [None, None]
        self._in_threads(lambda n: self.nodes[n].start())
        self._in_threads(self._raw_rank)

    def _raw_rank(self, rank: int) -> None:
        options = dist.ProcessGroupGloo._Options()
        options._timeout = datetime.timedelta(seconds=60)
        options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        self.raw[rank] = dist.ProcessGroupGloo(dist.PrefixStore("raw", self.store.clone()), rank, 2, options)  # a client each: a TCPStore client serialises its calls

    @staticmethod
    def _in_threads(work) -> None:
        threads = [threading.Thread(target=work, args=(n,)) for n in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)

    def raw_transfer(self, send: torch.Tensor, recv: torch.Tensor, tag: int) -> None:
        self.pair(lambda: self.raw[0].send([send], 1, tag).wait(),
                  lambda: self.raw[1].recv([recv], 0, tag).wait())

    @staticmethod
    def pair(send, receive) -> None:
        """``send()`` here and ``receive()`` in a thread (rank 1), both to the end."""
        receiver = threading.Thread(target=receive)
        receiver.start()
        send()
        receiver.join(60)

    def close(self) -> None:
        for node in self.nodes:
            node.shutdown()


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


def case_cluster_sync(options, root: str) -> dict:
    """``sync`` of a tree of min(size-mib, 100) MiB owner -> one replica node, until a
    worker process of that node sees it, against a raw gloo send/recv of the same bytes
    and tensordict 0.15.3's ways, each between two processes of a registered gloo group
    (see :mod:`~shared_td.bench.cases_cluster_peers`; its columns are left out without
    tensordict)."""
    from shared_td import Coordinator

    nbytes = min(options.size_mib, 100) << 20
    peers = start_peers(nbytes, options.repeat)  # they get ready while this process does
    try:
        synced = _sync_column(options, nbytes, Coordinator, peers.ready)
    except BaseException:
        peers.close()
        raise
    return {**peers.measure(), "shared_td sync+worker": synced}


def _sync_column(options, nbytes: int, Coordinator, before_timing) -> float:
    node1 = Coordinator().start()
    ctx = multiprocessing.get_context("fork")  # the worker needs no fresh interpreter
    here, there = ctx.Pipe()
    worker = ctx.Process(target=_replica_worker, args=(node1.address, node1.authkey, "weights", there),
                         daemon=True)
    worker.start()
    loop = _Loopback(coordinator=node1)
    try:
        owner, other = loop.nodes
        weights = owner.publish("weights", policy_tree(nbytes))
        other.attach("weights")
        here.send(True)
        if not here.poll(60) or here.recv() != "attached":
            raise RuntimeError("the replica node's worker did not attach")
        fills = iter(range(1, 10**9))

        def refill():  # untimed: new contents, as a learner's step makes them
            value = float(next(fills))
            for leaf in weights.values(True, True):
                leaf.fill_(value)
            return value

        def sync_seen(value):
            report = owner.sync("weights")
            here.send((report.version, value))
            if not here.poll(60) or not here.recv():
                raise RuntimeError("the replica node's worker did not see the synced version")

        before_timing()  # nothing else of the case runs meanwhile
        return best_of(options.repeat, refill, sync_seen)
    finally:
        try:
            here.send(None)  # the worker leaves
        except OSError:
            pass  # it is gone already: joined below
        worker.join(30)
        if worker.is_alive():
            worker.kill()
            worker.join(5)
        here.close()
        there.close()
        loop.close()
        node1.shutdown()


def case_cluster_push(options, root: str) -> dict:
    """``push`` of 64 rows of 1 KiB from a replica node, against a raw gloo send of the
    same bytes plus one store round trip."""
    import shared_td

    loop = _Loopback()
    try:
        owner, other = loop.nodes
        owner.publish("replay", shared_td.TensorDict(obs=torch.zeros(4096, 256), batch_size=[4096]))
        other.attach("replay")
        index = torch.arange(0, 4096, 64)
        payload = torch.ones(64 * 1024 + 64 * 8, dtype=torch.uint8)
        recv = torch.empty_like(payload)
        tags = iter(range(1, 10**9))

        def raw(_):
            loop.raw_transfer(payload, recv, next(tags))
            loop.store.add("bench/rt", 1)

        rounds = max(1, options.rounds // 10)
        return {
            "raw gloo send + 1 store round trip": best_of(options.repeat, lambda: None,
                                                          lambda s: [raw(s) for _ in range(rounds)]) / rounds,
            "shared_td push": best_of(options.repeat, lambda: None,
                                      lambda _: [other.push("replay", index) for _ in range(rounds)]) / rounds,
        }
    finally:
        loop.close()


def case_cluster_counter(options, root: str) -> dict:
    """A cluster counter's ``fetch_add`` against a raw ``TCPStore.add``, per call."""
    loop = _Loopback()
    try:
        counter = loop.nodes[1].counter("cursor")
        client = dist.TCPStore("127.0.0.1", loop.store.port, None, False, datetime.timedelta(seconds=30))
        rounds = options.rounds * 10
        return {
            "raw TCPStore.add": best_of(options.repeat, lambda: None,
                                        lambda _: [client.add("raw", 1) for _ in range(rounds)]) / rounds,
            "shared_td fetch_add": best_of(options.repeat, lambda: None,
                                           lambda _: [counter.fetch_add(1) for _ in range(rounds)]) / rounds,
        }
    finally:
        loop.close()
