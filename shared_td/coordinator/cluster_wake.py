"""Waking the blocking store pops of a node's serving threads without a message
(:func:`wake_pops`), for a process whose node number was taken over: its shutdown must
leave its queues to its successor (kept apart from
:mod:`~shared_td.coordinator.cluster_serve`, whose threads it wakes)."""
from __future__ import annotations

import time

__all__ = ["WAKE_EVERY_S", "wake_pops"]

#: What :func:`wake_pops` compares a queue's key with: the queue's name holds no plain
#: value, so the compare never matches and nothing is ever set.
_WAKE = "\0shared_td-wake"
#: The longest pause between two wake-ups of :func:`wake_pops`.
WAKE_EVERY_S = 0.2


def wake_pops(cluster, queues: list[str], threads: list, bound: float) -> None:
    """Wake the blocking pops of ``queues`` until ``threads`` ended (at most ``bound``
    s), putting nothing in the queues: for a process whose number was taken over, whose
    shutdown must leave the queues to its successor (a stop notice pushed there would
    be the successor's to pop, and a push wakes only the first waiter of a queue,
    maybe the successor's pop). A ``compare_set`` of a queue's name that never matches
    is the wake-up: the store's host (torch 2.13, libuv) wakes every wait on a key it
    is asked to compare, and a queue's key holds no plain value, so nothing is written
    (a host that stopped waking there would leave the shutdown as slow as before, not
    wrong). Each pop
    woken finds the queue empty (``QueueEmptyError``), sees the stop (``ended``) and
    ends; one that finds a value puts it back for the successor, as it does at any
    pop after the takeover (see ``cluster_serve._signed_requests``). The successor's own pops
    are woken with it and wait again (a wake-up in vain is "nothing yet"). Repeated,
    so that a thread entering its pop as the first wake-up goes is woken too (a thread
    busy past ``bound``, in a transfer, sees the stop before its next pop). Before,
    nothing woke them: the shutdown waited POP_S (60 s) for the service thread, and
    the lanes were left inside torch at the interpreter's exit.

    Example:
        >>> import datetime, threading
        >>> from types import SimpleNamespace
        >>> from torch.distributed import TCPStore
        >>> from shared_td.coordinator.cluster_store import SignedStore
        >>> raw = TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=5), wait_for_workers=False)
        >>> store = SignedStore(raw, b"k" * 32, timeout=5.0)
        >>> stop = threading.Event()
        >>> popper = threading.Thread(target=store.pop_json, args=("queue/1", 30.0, stop.is_set))
        >>> popper.start(); stop.set()
        >>> wake_pops(SimpleNamespace(_store=store), ["queue/1"], [popper], 5.0)
        >>> popper.is_alive(), raw.queue_len("shared_td/queue/1"), raw.check(["shared_td/queue/1"])
        (False, 0, False)
    """
    deadline, pause = time.monotonic() + bound, 0.01
    while any(thread.is_alive() for thread in threads) and time.monotonic() < deadline:
        try:
            for queue in queues:
                cluster._store.compare_set(queue, _WAKE, _WAKE)
        except (RuntimeError, OSError):
            return  # the store is gone: the pops fail by themselves
        alive = [thread for thread in threads if thread.is_alive()]
        if alive:
            alive[0].join(max(0.0, min(pause, deadline - time.monotonic())))
        pause = min(2 * pause, WAKE_EVERY_S)
