"""``cluster_push``: a replica node pushes rows to the owner node, the two nodes in two
processes (as on two machines: each its own interpreter and GIL), on loopback.

This process is node 1 (the replica); a spawned child is node 0, the owner of "replay".
The reference is made of the same parts between the same two processes: a raw gloo
``send`` of the same bytes to a receive that the child has already posted (it loops on
them), then one ``TCPStore.add`` round trip. The columns take turns (best of each).
"""
from __future__ import annotations

import datetime
import multiprocessing
import os
import queue as queues

import torch
import torch.distributed as dist

from shared_td.bench.cases_cluster import _KEY
from shared_td.bench.timing import best_of_each

_ROWS, _ROW_FLOATS, _PUSHED = 4096, 256, 64  # the buffer, 1 KiB rows, rows per push
#: Seconds the child may take to start, and any wait of either side.
WAIT_S = 120.0


def _raw_rank(port: int, rank: int):
    """Rank ``rank`` of a raw two-rank gloo group, rendezvous on the store at ``port``."""
    options = dist.ProcessGroupGloo._Options()
    options._timeout = datetime.timedelta(seconds=WAIT_S)
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    store = dist.TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=WAIT_S))
    return dist.ProcessGroupGloo(dist.PrefixStore("raw", store), rank, 2, options)


def _payload_bytes() -> int:
    return _PUSHED * (8 + 4 * _ROW_FLOATS)  # the index, then the rows


def _owner_main(port: int, commands, results) -> None:
    """Node 0: own "replay", then post the raw receives it is asked for, until None."""
    import shared_td
    from shared_td.coordinator.cluster import Cluster

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    cluster = Cluster(f"tcp://127.0.0.1:{port}?host=0", 0, 2, authkey=_KEY, timeout=WAIT_S,
                      hostname="127.0.0.1").start()
    try:
        raw = _raw_rank(port, 1)
        cluster.publish("replay", shared_td.TensorDict(obs=torch.zeros(_ROWS, _ROW_FLOATS), batch_size=[_ROWS]))
        results.put("ready")
        buffer = torch.empty(_payload_bytes(), dtype=torch.uint8)
        while (asked := commands.get(timeout=WAIT_S)) is not None:  # bounded: the parent gone
            first, rounds = asked
            for n in range(rounds):
                raw.recv([buffer], 0, first + n).wait(datetime.timedelta(seconds=WAIT_S))
    finally:
        cluster.shutdown()


def case_cluster_push(options, root: str) -> dict:
    """``push`` of 64 rows of 1 KiB from a replica node to the owner node (another
    process), against a raw gloo send of the same bytes to a receive already posted in
    that process, plus one store round trip."""
    from shared_td.coordinator.cluster import Cluster

    store = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=WAIT_S), wait_for_workers=False)
    ctx = multiprocessing.get_context("spawn")
    commands, results = ctx.Queue(), ctx.Queue()
    owner = ctx.Process(target=_owner_main, args=(store.port, commands, results), daemon=True)
    owner.start()
    node = None
    try:
        node = Cluster(f"tcp://127.0.0.1:{store.port}?host=0", 1, 2, authkey=_KEY, timeout=WAIT_S,
                       hostname="127.0.0.1").start()
        raw = _raw_rank(store.port, 0)
        try:
            if results.get(timeout=WAIT_S) != "ready":
                raise RuntimeError("the owner node did not start")
        except queues.Empty:
            raise RuntimeError(f"the owner node did not start within {WAIT_S:g} s "
                               f"(exit code {owner.exitcode})") from None
        node.attach("replay")
        index = torch.arange(0, _ROWS, _ROWS // _PUSHED)
        payload = torch.ones(_payload_bytes(), dtype=torch.uint8)
        rounds = max(1, options.rounds // 10)
        tags = iter(range(0, 10**9, rounds))
        client = store.clone()

        def raw_rounds(_):
            first = next(tags)
            commands.put((first, rounds))  # the owner posts its receives, one after another
            for n in range(rounds):
                raw.send([payload], 1, first + n).wait(datetime.timedelta(seconds=WAIT_S))
                client.add("bench/rt", 1)

        times = best_of_each(options.repeat, {  # taking turns: a slow phase falls on both
            "raw gloo send + 1 store round trip": (lambda: None, raw_rounds),
            "shared_td push": (lambda: None, lambda _: [node.push("replay", index) for _ in range(rounds)]),
        })
        return {column: seconds / rounds for column, seconds in times.items()}
    finally:
        commands.put(None)
        if node is not None:
            node.shutdown()
        owner.join(30)
        if owner.is_alive():
            owner.kill()
            owner.join(5)
        for queue in (commands, results):
            queue.close()
            queue.join_thread()
