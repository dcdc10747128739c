"""How to test multi-process code with shared_td: a pytest file to copy.

* The ``coordinator`` fixture starts a Coordinator for one test and always shuts it
  down, also when the test fails (the manager process and its directory go with it).
* Workers are *spawn* processes, the strictest start method: they import their target
  by module name, so targets are module-level functions of an importable file (this
  one), and they receive only picklable arguments -- here the coordinator's address
  and key, and a SharedCounter (a reference, not a value).
* Every wait is bounded (joins with a timeout, then kill), so a hung worker fails the
  test instead of hanging the run.
* The assertions run in the parent, on the same memory the workers wrote.

Run:  python -m pytest examples/multiprocess_test.py
"""
from __future__ import annotations

import multiprocessing
import os

import pytest
import torch

import shared_td

WAIT = 60  # seconds: the bound on each worker


def write_rows(address: str, authkey: bytes, worker_id: int, rows: int) -> None:
    """Worker: attach "results" by name and fill this worker's rows."""
    td = shared_td.attach("results", address=address, authkey=authkey)
    mine = slice(worker_id * rows, (worker_id + 1) * rows)
    td["value"][mine] = worker_id + 1.0
    td["pid"][mine] = os.getpid()


def append_entries(address: str, authkey: bytes, cursor: shared_td.SharedCounter,
                   worker_id: int, count: int) -> None:
    """Worker: append ``count`` entries to the shared log "log", one slot at a time."""
    log = shared_td.attach("log", address=address, authkey=authkey)
    for _ in range(count):
        slot = cursor.fetch_add(1)  # this slot is ours: no other worker gets it
        log["writer"][slot] = worker_id
        log["writes"][slot] += 1


@pytest.fixture
def coordinator():
    coord = shared_td.Coordinator().start()
    try:
        yield coord
    finally:
        coord.shutdown()


def run_workers(target, argument_lists) -> list[int | None]:
    """Start one spawn process per argument list, wait (bounded), return exit codes."""
    ctx = multiprocessing.get_context("spawn")
    workers = [ctx.Process(target=target, args=args) for args in argument_lists]
    for worker in workers:
        worker.start()
    try:
        for worker in workers:
            worker.join(WAIT)
    finally:
        for worker in workers:
            if worker.is_alive():  # hung: kill it, the exit code says so
                worker.kill()
                worker.join(WAIT)
    return [worker.exitcode for worker in workers]


def test_spawn_workers_attach_by_name_and_write(coordinator):
    td = coordinator.publish("results", shared_td.TensorDict(
        value=torch.zeros(8), pid=torch.zeros(8, dtype=torch.int64), batch_size=[8]))
    codes = run_workers(write_rows, [(coordinator.address, coordinator.authkey, i, 4)
                                     for i in range(2)])
    assert codes == [0, 0]
    assert td["value"].tolist() == [1.0] * 4 + [2.0] * 4  # seen here, no copy back
    pids = set(td["pid"].tolist())
    assert len(pids) == 2 and os.getpid() not in pids


def test_a_shared_cursor_hands_out_every_slot_once(coordinator):
    workers, per_worker = 3, 50
    size = workers * per_worker
    log = coordinator.publish("log", shared_td.TensorDict(
        writer=torch.full((size,), -1), writes=torch.zeros(size, dtype=torch.int64),
        batch_size=[size]))
    cursor = shared_td.SharedCounter()
    codes = run_workers(append_entries, [
        (coordinator.address, coordinator.authkey, cursor, i, per_worker) for i in range(workers)])
    assert codes == [0] * workers
    assert cursor.value == size
    assert (log["writes"] == 1).all()  # no slot lost, none written twice
    assert torch.bincount(log["writer"]).tolist() == [per_worker] * workers
