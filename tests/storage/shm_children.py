"""Child-process targets for test_shm_crash.py (writers SIGKILLed mid-write, readers
that check every value they see, threads and processes contending for one cell).

Imported as ``tests.storage.shm_children`` (see tests/conftest.py).
"""
from __future__ import annotations

import gc
import pickle
import queue as queue_module
import threading
import time

MiB = 1 << 20
BLOB = 16 * MiB


def blob_value(i: int, size: int = BLOB) -> dict:
    """Version ``i`` of the shared value: its blob holds ``i % 251`` in every byte."""
    return {"id": i, "blob": bytes([i % 251]) * size}


def problem(value, size: int = BLOB) -> str | None:
    """What is wrong with ``value`` (an id whose blob holds other versions' bytes), or None."""
    if not isinstance(value, dict) or set(value) != {"id", "blob"}:
        return f"not a version dict: {type(value).__name__}"
    i, blob = value["id"], value["blob"]
    if len(blob) != size:
        return f"id {i}: blob of {len(blob)} bytes, not {size}"
    wanted = i % 251
    if blob.count(wanted) != size:
        others = sorted(set(blob[:: 4096]) - {wanted})[:5]
        return f"id {i}: blob holds bytes of other versions ({others} besides {wanted})"
    return None


def write_forever(td, first_id: int, key: str = "v") -> None:
    """Write versions first_id, first_id + 1, ... until killed."""
    i = first_id
    while True:
        td.set_(key, blob_value(i))
        i += 1


def sized_value(i: int, size: int) -> dict:
    """Version ``i`` of a value of ``size`` bytes (its size varies: see whole())."""
    return {"id": i, "blob": bytes([i % 251]) * size}


def not_whole(value) -> str | None:
    """What is wrong with a :func:`sized_value` (bytes of another version), or None."""
    if not isinstance(value, dict) or set(value) != {"id", "blob"}:
        return f"not a version dict: {type(value).__name__}"
    if value["blob"].count(value["id"] % 251) != len(value["blob"]):
        return f"id {value['id']}: blob holds bytes of other versions"
    return None


def grow_forever(td, key: str, first_id: int, seed: int) -> None:
    """Write ``key`` of ``td`` with values that mostly grow (each often outgrowing its
    region: a new region of the slab at each such write) until killed."""
    import random

    rng, size, i = random.Random(seed), 1000, first_id
    while True:
        size = int(size * rng.uniform(0.9, 1.4)) % (6 * MiB) + 1
        td.set_(key, sized_value(i, size))
        i += 1


def attached_reader(inbox, outbox) -> None:
    """Attach once (the first message: a pickled tensordict), then read continuously,
    checking every value, until "stop". A "check" message is answered with
    ``(problem of a read now, id read now, first problem seen while looping)``."""
    td = pickle.loads(inbox.get(timeout=30))
    first_bad = None
    while True:
        try:
            command = inbox.get_nowait()
        except queue_module.Empty:
            command = None
        if command == "stop":
            return
        value = td["v"]
        bad = problem(value)
        first_bad = first_bad or bad
        if command == "check":
            outbox.put((bad, value["id"] if isinstance(value, dict) else None, first_bad))
        elif command is None:
            time.sleep(0.001)


def fresh_reader(inbox, outbox) -> None:
    """For each pickled tensordict received: attach it anew (this process holds no copy
    of the cell: it was forked before the cell existed and drops it after each read),
    read once, answer ``(problem, id)``. Stops on "stop"."""
    while True:
        message = inbox.get(timeout=60)
        if message == "stop":
            return
        td = pickle.loads(message)
        value = td["v"]
        outbox.put((problem(value), value["id"] if isinstance(value, dict) else None))
        del td, value
        gc.collect()  # the cell dies here: the next message attaches it again


PAD = b"p" * 65536  # makes each read and write hold its lock a little longer


def contend(td, me: int, seconds: float, outbox) -> None:
    """One writer thread sets the shared value ``td["v"]`` to ``(me, 0, PAD)``,
    ``(me, 1, PAD)``, ...; reader threads read it and check that no writer's count goes
    back. Reports ``(me, writes, reads, errors)``."""
    errors: list[str] = []
    counts = {"writes": 0, "reads": 0}
    stop = threading.Event()

    def write() -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                td.set_("v", (me, counts["writes"], PAD))
            except Exception as err:  # every error is a lost write: report it
                errors.append(f"write {counts['writes']}: {err!r}")
                continue
            counts["writes"] += 1
        stop.set()

    def read() -> None:
        last = {}  # per reader thread
        while not stop.is_set():
            try:
                writer, n, _ = td["v"]
            except Exception as err:
                errors.append(f"read: {err!r}")
                continue
            counts["reads"] += 1
            if n < last.get(writer, -1):
                errors.append(f"writer {writer} went back from {last[writer]} to {n}")
            last[writer] = n

    # two readers: more chances for the interleaving that made the kernel answer EDEADLK
    threads = [threading.Thread(target=write), threading.Thread(target=read), threading.Thread(target=read)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(seconds + 30)
    outbox.put((me, counts["writes"], counts["reads"], errors[:5] + [f"{len(errors)} errors"] * bool(errors)))


def count(counter, threads: int, calls: int, tally) -> None:
    """``threads`` threads each call ``counter.fetch_add(1)`` ``calls`` times (0: until
    killed); thread ``t`` records in ``tally[t]`` how many of its calls returned, and
    sets ``tally[threads + t]`` if a call returned no more than its previous one (a torn
    value would)."""

    def run(t: int) -> None:
        last = -1
        while calls == 0 or tally[t] < calls:
            old = counter.fetch_add(1)
            if old <= last:
                tally[threads + t] = 1  # flag: went back
            last = old
            tally[t] += 1

    workers = [threading.Thread(target=run, args=(t,), daemon=True) for t in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(120)


# the two values a version-table writer alternates: every byte differs between them
TABLE_VALUES = (0x0123456789ABCDEF, 0xFEDCBA9876543210)


def store_table_forever(table, slot: int) -> None:
    """Store TABLE_VALUES alternately into ``slot`` of a VersionTable until killed."""
    first, second = TABLE_VALUES
    while True:
        table.store(slot, first)
        table.store(slot, second)


def read_table(reference, slot: int, stop, outbox) -> None:
    """Map the table named by ``reference`` as is_stale does and load ``slot`` until
    ``stop``; report ``(loads, values seen that are neither 0 nor TABLE_VALUES)``."""
    from shared_td.coordinator.staleness import _map_table

    pid, fd, key, nbytes = reference
    table = _map_table(pid, fd, key, nbytes)
    loads, bad = 0, set()
    allowed = {0, *TABLE_VALUES}
    while not stop.is_set() or loads == 0:
        for _ in range(1000):
            value = table.words[slot]
            if value not in allowed:
                bad.add(value)
        loads += 1000
    outbox.put((loads, sorted(bad)[:5]))
