"""Child-process targets for test_nontensor_coordinator.py and test_stale.py.

Importable by name (spawn children import their target). Each reports on a queue and
never waits without a timeout.
"""
import os
import pickle
import time


import shared_td


def make_shared(coord, value, queue):
    """Make a shared non-tensor value (inside ``with coord`` if one is given), send its
    pickle and the holders of its cell, then exit."""
    try:
        # no tensor: anonymous segments outlive their creator only when published
        td = shared_td.TensorDict(task=value, batch_size=[2])
        if coord is None:
            td.memmap_(share_non_tensor=True)
        else:
            with coord:
                td.memmap_(share_non_tensor=True)
        cell = td.get("task")._shared_value
        queue.put(("ok", os.getpid(), pickle.dumps(td), list(cell.holders)))
    except BaseException as err:
        queue.put(("error", repr(err), None, None))
        raise


def make_shared_then_sleep(coord, value, queue):
    """Like make_shared, then stay alive (until SIGKILLed by the test)."""
    make_shared(coord, value, queue)
    time.sleep(120)


def keep_writing(blob, rounds, queue):
    """Attach the pickled tensordict, then write ``task`` = i and read it back
    ``rounds`` times; reports what it saw (read-your-writes must always hold)."""
    try:
        td = pickle.loads(blob)
        queue.put(("attached", td["task"]))
        mismatches = 0
        for i in range(rounds):
            td.set_("task", f"w{i}")
            if td["task"] != f"w{i}":
                mismatches += 1
            time.sleep(0.001)
        queue.put(("done", td["task"], mismatches))
    except BaseException as err:
        queue.put(("error", repr(err), None))
        raise


def write_consistent(blob, rounds, go, queue):
    """Write values whose parts must agree: (i, 'x' * i, -i)."""
    td = pickle.loads(blob)
    go.wait(30)
    for i in range(rounds):
        td.set_("task", (i, "x" * (i % 3000), -i))
    queue.put("written")


def read_value(blob, queue):
    try:
        queue.put(("ok", pickle.loads(blob)["task"]))
    except BaseException as err:
        queue.put(("error", repr(err)))
        raise


def report_embedded(queue):
    """In a (daemonic) worker: share a value; report the cell's holders and whether an
    embedded coordinator was started here."""
    from shared_td.coordinator import ownership

    try:
        td = shared_td.TensorDict(task="d").memmap_(share_non_tensor=True)
        queue.put(("ok", list(td.get("task")._shared_value.holders),
                   ownership.embedded_coordinator(start=False) is not None, td["task"]))
    except BaseException as err:
        queue.put(("error", repr(err), None, None))
        raise


def watch_for_new_layout(address, authkey, name, go, queue):
    """Attach ``name``; after ``go``, wait until it is stale, refresh, report the keys."""
    try:
        td = shared_td.attach(name, address=address, authkey=authkey)
        queue.put(("attached", sorted(td.keys()), shared_td.is_stale(td)))
        go.wait(30)
        deadline = time.monotonic() + 30
        while not shared_td.is_stale(td) and time.monotonic() < deadline:
            time.sleep(0.001)
        stale = shared_td.is_stale(td)
        td["a"].fill_(-1.0)  # into the old layout's memory
        fresh = shared_td.refresh(td)
        queue.put(("refreshed", stale, sorted(fresh.keys()), shared_td.is_stale(fresh),
                   fresh["a"].tolist()))
    except BaseException as err:
        queue.put(("error", repr(err), None, None, None))
        raise
