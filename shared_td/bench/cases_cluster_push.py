"""``cluster_push``: a replica node pushes rows to the owner node, the two nodes in two
processes (as on two machines: each its own interpreter and GIL), on loopback.

This process is node 1 (the replica); the run's worker process (:mod:`~shared_td.bench.worker`)
is node 0, the owner of "replay", for the time of the case.
The reference is made of the same parts between the same two processes: a raw gloo
``send`` of the same bytes to a receive that the child has already posted (it loops on
them), then one ``TCPStore.add`` round trip. A second reference shows what any push that
returns once the owner has the rows costs before it does any work: the same raw send,
then an answer of ANSWER_BYTES from a thread of the owner's process, which posted its
next receive first (as the owner of a push keeps one posted), into a receive posted
beside the send (a ping-pong: the send's wait alone ends once the bytes are written
locally, before the owner has them). The columns take turns (best of each).
"""
from __future__ import annotations

import datetime
import os

import torch

from shared_td.bench.cases_cluster import _KEY
from shared_td.bench.timing import best_of_each
from shared_td.bench.worker import shared_worker
from shared_td.bench.loopback import loopback_store, raw_gloo_rank
from shared_td.coordinator.cluster_transfer import ANSWER_BYTES, ANSWER_TAG_BIT

_ROWS, _ROW_FLOATS, _PUSHED = 4096, 256, 64  # the buffer, 1 KiB rows, rows per push
#: Seconds the child may take to start, and any wait of either side.
WAIT_S = 120.0


def _payload_bytes() -> int:
    return _PUSHED * (8 + 4 * _ROW_FLOATS)  # the index, then the rows


def _owner_job(connection, port: int) -> None:  # a job of the run's worker
    """Node 0: own "replay", answer "ready", then post the raw receives it is asked for
    (``(first tag, rounds, answered)``; when ``answered``, each received message is
    answered on its tag + ANSWER_TAG_BIT, the next receive posted first), until None."""
    import shared_td
    from shared_td.coordinator.cluster import Cluster

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    cluster = Cluster(f"tcp://127.0.0.1:{port}?host=0", 0, 2, authkey=_KEY, timeout=WAIT_S,
                      hostname="127.0.0.1").start()
    try:
        raw = raw_gloo_rank(port, 1, WAIT_S)
        cluster.publish("replay", shared_td.TensorDict(obs=torch.zeros(_ROWS, _ROW_FLOATS), batch_size=[_ROWS]))
        connection.send("ready")
        buffers = [torch.empty(_payload_bytes(), dtype=torch.uint8) for _ in range(2)]
        answer, wait = torch.zeros(ANSWER_BYTES, dtype=torch.uint8), datetime.timedelta(seconds=WAIT_S)
        while True:
            if not connection.poll(WAIT_S):  # bounded: the caller stalled or gone
                raise TimeoutError(f"cluster_push's caller sent nothing within {WAIT_S:g} s")
            if (asked := connection.recv()) is None:
                return
            first, rounds, answered = asked
            posted = raw.recv([buffers[0]], 0, first)
            for n in range(rounds):
                posted.wait(wait)
                if n + 1 < rounds:  # the next receive before the answer (two buffers, taking turns)
                    posted = raw.recv([buffers[(n + 1) % 2]], 0, first + n + 1)
                if answered:
                    raw.send([answer], 0, (first + n) | ANSWER_TAG_BIT).wait(wait)
    finally:
        cluster.shutdown()


def case_cluster_push(options, root: str) -> dict:
    """``push`` of 64 rows of 1 KiB from a replica node to the owner node (another
    process), against a raw gloo send of the same bytes to a receive already posted in
    that process, plus one store round trip, and against the same send answered by that
    process (see the module's opening)."""
    from shared_td.coordinator.cluster import Cluster

    store = loopback_store(WAIT_S)
    worker = shared_worker()
    owner = worker.start_job(_owner_job, store.port)
    node, owner_ended = None, False
    try:
        node = Cluster(f"tcp://127.0.0.1:{store.port}?host=0", 1, 2, authkey=_KEY, timeout=WAIT_S,
                       hostname="127.0.0.1").start()
        raw = raw_gloo_rank(store.port, 0, WAIT_S)
        if not owner.poll(WAIT_S):
            raise RuntimeError(f"the owner node did not start within {WAIT_S:g} s")
        if (said := owner.recv()) != "ready":  # the job ended: its answer, an error
            owner_ended = True
            raise RuntimeError(f"the owner node did not start: {said[1]}")
        node.attach("replay")
        index = torch.arange(0, _ROWS, _ROWS // _PUSHED)
        payload = torch.ones(_payload_bytes(), dtype=torch.uint8)
        rounds = max(1, options.rounds // 10)
        tags = iter(range(0, 10**9, rounds))
        client, answer = store.clone(), torch.empty(ANSWER_BYTES, dtype=torch.uint8)
        wait = datetime.timedelta(seconds=WAIT_S)

        def raw_rounds(_):
            first = next(tags)
            owner.send((first, rounds, False))  # the owner posts its receives, one after another
            for n in range(rounds):
                raw.send([payload], 1, first + n).wait(wait)
                client.add("bench/rt", 1)

        def answered_rounds(_):
            first = next(tags)
            owner.send((first, rounds, True))
            for n in range(rounds):
                answered = raw.recv([answer], 1, (first + n) | ANSWER_TAG_BIT)
                raw.send([payload], 1, first + n).wait(wait)
                answered.wait(wait)

        times = best_of_each(options.repeat, {  # taking turns: a slow phase falls on all
            "raw gloo send + 1 store round trip": (lambda: None, raw_rounds),
            "raw gloo send + answer (no work)": (lambda: None, answered_rounds),
            "shared_td push": (lambda: None, lambda _: [node.push("replay", index) for _ in range(rounds)]),
        })
        return {column: seconds / rounds for column, seconds in times.items()}
    finally:
        try:
            if node is not None:
                node.shutdown()
        finally:
            if not owner_ended:
                _end_owner(worker, owner)


def _end_owner(worker, owner) -> None:
    """End the owner's job (bounded: a worker that does not answer is stopped)."""
    try:
        owner.send(None)
    except OSError:  # the worker is gone: result() says so
        pass
    worker.result(WAIT_S)
