"""The TCPStore the cluster tests host on 127.0.0.1 (a free port, no other address): the
bench's, listening on 127.0.0.1 only (see shared_td.coordinator.store_host); and a
heartbeat that another process keeps writing into it."""
from __future__ import annotations

import contextlib
import threading

from shared_td.bench.loopback import loopback_store

__all__ = ["beating", "loopback_store"]


@contextlib.contextmanager
def beating(signed, node: int, every: float):
    """While the block runs, ``signed`` (a SignedStore: in the tests, of another authkey)
    writes the heartbeat ``hb/<node>``, a new number every ``every`` seconds, as a
    running node does; it stands still after the block."""
    stop = threading.Event()

    def beat():
        for number in range(1_000_000):
            signed.set_json(f"hb/{node}", {"beat": number, "pid": 1})
            if stop.wait(every):
                return

    beater = threading.Thread(target=beat, daemon=True)
    beater.start()
    try:
        yield
    finally:
        stop.set()
        beater.join(5)
