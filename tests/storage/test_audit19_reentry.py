"""Audit 19 (third round), finding 3: a signal handler (or a finalizer) that uses a
SharedCounter or a shared non-tensor value while the code it interrupted is inside an
operation on the same lock is refused with a RuntimeError that says so, never a hang.

Before the fix the lock's thread lock was a plain ``threading.Lock``: the handler waited
for ever on a lock held by the very frame it had interrupted. Deterministic: the
lock's ``take`` is wrapped so that SIGUSR1 is raised right after the byte lock is taken
(its handler runs there, inside the locked section); a watchdog thread sends SIGUSR2
after HANG_S, whose handler raises ``Hung`` (the bound: a blocked acquire in the main
thread is interrupted by signals). tensordict 0.15.3 has no cross-process counter or
locked value: nothing to compare.
"""
from __future__ import annotations

import signal
import threading

import pytest

from shared_td import SharedCounter
from shared_td.storage.shared_value import SharedValue

pytestmark = pytest.mark.timeout(60)
HANG_S = 2.0  # the handler's operation takes microseconds; a hang is cut off here


class Hung(Exception):
    pass


def _interrupt_inside(lock, attribute: str, nested) -> None:
    """Make ``lock.<attribute>`` (take or take_shared) run ``nested`` as a SIGUSR1
    handler right after it takes the byte, once."""
    real = getattr(lock, attribute)

    def take():
        answer = real()
        setattr(lock, attribute, real)
        signal.raise_signal(signal.SIGUSR1)  # the handler runs as this call returns
        return answer

    setattr(lock, attribute, take)

    def handler(signum, frame):
        nested()

    signal.signal(signal.SIGUSR1, handler)


@pytest.fixture
def bounded():
    """SIGUSR2 raises Hung in the main thread after HANG_S unless cancelled."""
    def hung(signum, frame):
        raise Hung(f"the nested operation still waited after {HANG_S} s")

    old_usr1 = signal.getsignal(signal.SIGUSR1)
    old_usr2 = signal.signal(signal.SIGUSR2, hung)
    main = threading.get_ident()
    done = threading.Event()

    def watchdog():
        if not done.wait(HANG_S):
            signal.pthread_kill(main, signal.SIGUSR2)

    thread = threading.Thread(target=watchdog, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(HANG_S + 5)
        signal.signal(signal.SIGUSR2, old_usr2)
        signal.signal(signal.SIGUSR1, old_usr1)


def test_a_handler_using_the_counter_mid_fetch_add_is_refused(bounded):
    counter = SharedCounter(0)
    _interrupt_inside(counter._lock, "take", lambda: counter.fetch_add(1000))
    with pytest.raises(RuntimeError, match="signal handler") as caught:
        counter.fetch_add(1)
    assert "SharedCounter.fetch_add(1000)" in str(caught.value)
    # nothing held afterwards: the next operations run, and nothing was added twice
    assert not counter._lock.threads.locked()
    assert counter.fetch_add(5) in (0, 1) and counter.value in (5, 6)


def _stale(cell):
    cell._cached = (-1, None)  # the next get() reads under the lock


CELL_CASES = {
    # main operation, (lock, its take) where the handler fires, the handler's operation
    "get during get": (lambda c: c.get(), ("_value_lock", "take_shared"), lambda c: (_stale(c), c.get())),
    "set during get": (lambda c: c.get(), ("_value_lock", "take_shared"), lambda c: c.set(7)),
    "get while set publishes": (lambda c: c.set(2), ("_value_lock", "take"), lambda c: (_stale(c), c.get())),
    "set during set": (lambda c: c.set(2), ("_write_lock", "take"), lambda c: c.set(3)),
    "updating during updating": (lambda c: c.updating().__enter__(), ("_update_lock", "take"),
                                 lambda c: c.updating().__enter__()),
}


@pytest.mark.parametrize("case", list(CELL_CASES))
def test_a_handler_using_a_shared_value_mid_operation_is_refused(case, bounded):
    main, (lock_name, take), nested = CELL_CASES[case]
    cell = SharedValue.create(1)
    _stale(cell)
    _interrupt_inside(getattr(cell, lock_name), take, lambda: nested(cell))
    with pytest.raises(RuntimeError, match="signal handler"):
        main(cell)
    for name in ("_value_lock", "_write_lock", "_update_lock"):
        assert not getattr(cell, name).threads.locked(), name
    cell.set(9)  # every lock free again
    assert cell.get() == 9


def test_a_nested_updating_block_is_refused_not_a_hang(bounded):
    cell = SharedValue.create(1)
    with cell.updating():
        with pytest.raises(RuntimeError, match="nested"):
            with cell.updating():
                pass
        cell.set(2)
    assert cell.get() == 2


def test_an_updating_block_left_on_another_thread_frees_its_lock():
    # final audit of f386d0b: with the thread lock an RLock, a block whose generator was
    # resumed or closed on another thread could not release it ("cannot release
    # un-acquired lock"): other threads then hung and this one was refused as nested
    cell = SharedValue.create(1)
    block = cell.updating()
    block.__enter__()
    leaving = threading.Thread(target=block.__exit__, args=(None, None, None))
    leaving.start()
    leaving.join(10)
    assert not cell._update_lock.threads.locked()
    entered = []

    def other():
        with cell.updating():
            entered.append(True)

    thread = threading.Thread(target=other, daemon=True)
    thread.start()
    thread.join(10)
    assert entered == [True], "another thread's updating() waited for a lock no one holds"
    with cell.updating():  # nor is this thread refused as nested
        cell.set(3)
    assert cell.get() == 3
