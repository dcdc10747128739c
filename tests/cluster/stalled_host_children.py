"""Children of test_store_host_stopped.py: a process that only hosts a TCPStore, and a
cluster node (its own Coordinator) that runs the commands it is sent, timing each."""
from __future__ import annotations

import datetime
import os
import queue as queues
import time

#: How long a child waits for its next command before it stops by itself.
IDLE_S = 120


def store_host(results) -> None:
    """Host a TCPStore on 127.0.0.1 (a free port, said through ``results``) until killed."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=30), wait_for_workers=False)
    results.put(store.port)
    time.sleep(IDLE_S)


def node(url: str, number: int, authkey: str, timeout: float, commands, results) -> None:
    """Node ``number`` of 2 (node 0 hosts the store): "publish" / "attach" of "p", then
    "sync", "counter" or "stop"; each answer is (what, seconds it took)."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import torch

    import shared_td

    coord = shared_td.Coordinator(cluster=url, node=number, nodes=2, authkey=authkey, timeout=timeout).start()
    results.put(("ok", os.getpid()))
    while True:
        try:
            command = commands.get(timeout=IDLE_S)
        except queues.Empty:
            command = "stop"
        started = time.monotonic()
        if command == "stop":
            coord.shutdown()
            results.put(("stopped", time.monotonic() - started))
            return
        try:
            if command == "publish":
                coord.publish("p", shared_td.TensorDict(w=torch.zeros(8), batch_size=[8]), replicate=True)
            elif command == "attach":
                coord.attach("p")
            elif command == "sync":
                coord.sync("p")
            elif command == "counter":
                shared_td.SharedCounter("c", cluster=coord).fetch_add(1)
            outcome = ("ok",)
        except Exception as err:  # noqa: BLE001 - reported to the test
            outcome = (type(err).__name__, str(err))
        results.put((outcome, time.monotonic() - started))
