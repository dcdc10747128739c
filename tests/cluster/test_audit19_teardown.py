"""Session 19: the shutdown of a process whose node number was taken over.

Such a process leaves its queues to its successor, so no stop notice woke its service
thread's and its lanes' blocking pops: its ``shutdown()`` waited POP_S (60 s) for the
service thread, and the lanes were left inside torch at the interpreter's exit. Its pops
are now woken without putting anything in the successor's queues
(``cluster_wake.wake_pops``).
"""
from __future__ import annotations

import threading
import time

import pytest
import torch

pytest.importorskip("torch.distributed")

import shared_td  # noqa: E402
from shared_td.coordinator.cluster_liveness import LOST_AFTER_S, claim_token  # noqa: E402
from tests.cluster.test_cluster_store import pair, store  # noqa: E402,F401 - fixtures


def _taken_over(raw, a) -> None:
    """Node 1 (``a``) is taken over by a process B, as if ``a`` had been stopped past
    LOST_AFTER_S: B's token in the claim, and ``a`` looks at it when it runs again."""
    b_token = claim_token(a._store, 1, a._run)
    assert raw.compare_set("shared_td/claim/1", a._claim, b_token) == b_token.encode()
    a._liveness._confirmed_at -= LOST_AFTER_S + 1
    assert not a._liveness.still_mine()


def _popping(a) -> list[threading.Thread]:
    return [t for t in a._threads if t.name.endswith("-serve") or "-lane-" in t.name]


def test_a_taken_over_process_shuts_down_at_once_and_leaves_the_queues_alone(store, pair):
    """Before: its shutdown waited up to 60 s for the service thread's pop, and left
    the lanes' pops inside torch (joined for 1 s each)."""
    owner, a = pair
    owner.publish("p", shared_td.TensorDict(x=torch.zeros(4), batch_size=[4]))
    a.attach("p")
    popping = _popping(a)
    assert len(popping) == 2 and all(t.is_alive() for t in popping)
    _taken_over(store, a)
    began = time.monotonic()
    a.shutdown()
    assert time.monotonic() - began < 5.0
    assert not any(t.is_alive() for t in popping)
    for queue in ("queue/1", "lane/1/0"):  # no stop notice put there (a pair notice went back), no key left
        key = f"shared_td/{queue}"
        left = [store.queue_pop(key, False) for _ in range(store.queue_len(key))]
        assert not any(b'"op": "stop"' in value for value in left) and not store.check([key])


def test_the_successors_pop_is_woken_in_vain_and_gets_what_comes_next(store, pair):
    """B (here a thread popping node 1's service queue with the key) keeps waiting
    through the old process's shutdown, and the next value pushed there is B's."""
    owner, a = pair
    _taken_over(store, a)
    successor = owner._store  # (a thread of its own: its own connection, as B's)
    got, ready = [], threading.Event()

    def pop() -> None:
        successor.pop_json("queue/1", 0.001)  # its connection for that queue, made
        ready.set()
        got.append(successor.pop_json("queue/1", 10.0))

    popper = threading.Thread(target=pop)
    popper.start()
    assert ready.wait(10)
    time.sleep(0.05)  # (its pop waits as the old process wakes the queue's pops)
    a.shutdown()
    assert popper.is_alive() and not got  # woken in vain: it waits again
    owner._store.push_json("queue/1", {"op": "value", "from": 0})
    popper.join(5)
    assert got == [{"op": "value", "from": 0}]
