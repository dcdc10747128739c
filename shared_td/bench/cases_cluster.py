"""Benchmark cases across machines, on loopback: two cluster nodes in one process.

Both nodes are :class:`~shared_td.coordinator.cluster.Cluster` members of this process
(their own threads, sockets and gloo pairs), beside a raw reference made of the same
torch.distributed parts: a two-rank gloo group whose ranks run in two threads, and the
bare ``TCPStore``. The ratios compare like with like on the same machine and run. The
three cases share one loopback per run (the runner closes it at the end).
"""
from __future__ import annotations

import datetime
import threading

import torch
import torch.distributed as dist

from shared_td.bench.timing import best_of

_KEY = b"benchmark key"


class _Loopback:
    """A TCPStore on a free port, two cluster nodes and a raw two-rank gloo pair."""

    def __init__(self):
        from shared_td.coordinator.cluster import Cluster

        self.store = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=30),
                                   wait_for_workers=False)
        url = f"tcp://127.0.0.1:{self.store.port}?host=0"
        self.nodes = [Cluster(url, n, 2, authkey=_KEY, timeout=60, hostname="127.0.0.1") for n in range(2)]
        self._in_threads(lambda n: self.nodes[n].start())
        self._raw: list | None = None  # made by the first raw_transfer (see raw)

    @property
    def raw(self) -> list:
        """The raw two-rank gloo pair, made on first use (its connection takes 5 s now
        and then on this machine: only the cases that compare with it pay for it)."""
        if self._raw is None:
            ranks = [None, None]
            self._in_threads(lambda rank: ranks.__setitem__(rank, self._raw_rank(rank)))
            self._raw = ranks
        return self._raw

    def _raw_rank(self, rank: int):
        options = dist.ProcessGroupGloo._Options()
        options._timeout = datetime.timedelta(seconds=60)
        options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        return dist.ProcessGroupGloo(dist.PrefixStore("raw", self.store.clone()), rank, 2, options)  # a client each: a TCPStore client serialises its calls

    @staticmethod
    def _in_threads(work) -> None:
        threads = [threading.Thread(target=work, args=(n,)) for n in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)

    def raw_transfer(self, send: torch.Tensor, recv: torch.Tensor, tag: int) -> None:
        raw = self.raw  # made here, before the receiver's thread needs it
        receiver = threading.Thread(target=lambda: raw[1].recv([recv], 0, tag).wait())
        receiver.start()
        raw[0].send([send], 1, tag).wait()
        receiver.join(60)

    def close(self) -> None:
        for node in self.nodes:
            node.shutdown()


_SHARED: _Loopback | None = None


def _loopback() -> _Loopback:
    """The run's loopback, started by its first cluster case (one start per run, not
    one per case); :func:`close_loopback` ends it with the run."""
    global _SHARED
    if _SHARED is None:
        _SHARED = _Loopback()
    return _SHARED


def close_loopback() -> None:
    """Shut the run's loopback down, if it was started."""
    global _SHARED
    loop, _SHARED = _SHARED, None
    if loop is not None:
        loop.close()


def case_cluster_sync(options, root: str) -> dict:
    """``sync`` of size-mib MiB owner -> one replica node (returns once the replica has
    it) against a raw gloo send/recv of the same bytes between two ranks."""
    import shared_td

    loop = _loopback()
    nbytes = options.size_mib << 20
    owner, other = loop.nodes
    owner.publish("weights", shared_td.TensorDict(w=torch.ones(nbytes // 4), batch_size=[]))
    other.attach("weights")
    send, recv = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    tags = iter(range(1, 10**9))
    return {
        "raw gloo send/recv": best_of(options.repeat, lambda: None,
                                      lambda _: loop.raw_transfer(send, recv, next(tags))),
        "shared_td sync": best_of(options.repeat, lambda: None, lambda _: owner.sync("weights")),
    }


def case_cluster_push(options, root: str) -> dict:
    """``push`` of 64 rows of 1 KiB from a replica node, against a raw gloo send of the
    same bytes plus one store round trip."""
    import shared_td

    loop = _loopback()
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


def case_cluster_counter(options, root: str) -> dict:
    """A cluster counter's ``fetch_add`` against a raw ``TCPStore.add``, per call."""
    loop = _loopback()
    counter = loop.nodes[1].counter("cursor")
    client = dist.TCPStore("127.0.0.1", loop.store.port, None, False, datetime.timedelta(seconds=30))
    rounds = options.rounds * 10
    return {
        "raw TCPStore.add": best_of(options.repeat, lambda: None,
                                    lambda _: [client.add("raw", 1) for _ in range(rounds)]) / rounds,
        "shared_td fetch_add": best_of(options.repeat, lambda: None,
                                       lambda _: [counter.fetch_add(1) for _ in range(rounds)]) / rounds,
    }
