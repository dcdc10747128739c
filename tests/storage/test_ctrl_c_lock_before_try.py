"""A Ctrl-C landing right as a lock's acquire() returns, before the try whose finally
releases it, must not leave the lock held (inject43): every later publish of the name on
this node timed out ("another publish ... did not end")."""
import threading
import types

import pytest

from shared_td.coordinator import cluster_generations


class _InterruptedOnce:
    """A lock whose first acquire takes it, then raises KeyboardInterrupt (a SIGINT
    handled right after acquire returned)."""

    def __init__(self, lock):
        self.lock, self.armed = lock, True

    def acquire(self, *args, **kwargs):
        got = self.lock.acquire(*args, **kwargs)
        if self.armed:
            self.armed = False
            raise KeyboardInterrupt
        return got

    def release(self):
        self.lock.release()

    def __getattr__(self, name):
        return getattr(self.lock, name)


def _free_in_another_thread(lock) -> bool:
    out = []

    def take():
        got = lock.acquire(timeout=0.5)
        out.append(got)
        if got:
            lock.release()

    thread = threading.Thread(target=take)
    thread.start()
    thread.join(5)
    return out == [True]


def test_a_ctrl_c_as_the_publish_lock_is_taken_leaves_it_free(monkeypatch):
    made = []
    real_factory = cluster_generations._new_lock
    cluster = types.SimpleNamespace(timeout=1.0)

    def wrapped():  # the lock publish_lock makes for the name, wrapped
        made.append(_InterruptedOnce(real_factory()))
        return made[-1]

    monkeypatch.setattr(cluster_generations, "_new_lock", wrapped)
    with pytest.raises(KeyboardInterrupt):
        with cluster_generations.publish_lock(cluster, "x"):
            pass
    assert made and _free_in_another_thread(made[0].lock)
    with cluster_generations.publish_lock(cluster, "x"):  # the next publish goes on
        pass
