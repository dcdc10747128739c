"""A counter shared by every node of a cluster (``SharedCounter(cluster=...)``): one
``TCPStore.add`` of the cluster's store per ``fetch_add``."""
from __future__ import annotations

from shared_td.coordinator.cluster_store import SignedStore
from shared_td.storage.counter import INT64_MAX, INT64_MIN, counter_int

__all__ = ["ClusterCounter"]


class ClusterCounter:
    """A counter shared by every node of a cluster: ``fetch_add`` is one ``TCPStore.add``
    (atomic on the store host). The same methods as :class:`shared_td.SharedCounter`.
    A key that something else set to what is not an integer is a ValueError naming it
    when the counter is made and at every ``value`` read; a ``fetch_add`` after such a
    write tells only when the bytes do not start with an integer (the host adds to one
    they start with, ``b"12abc"``, and writes the sum back whole): checking there
    would cost each addition a second round trip.

    Example:
        >>> import datetime
        >>> from torch.distributed import TCPStore
        >>> raw = TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=5), wait_for_workers=False)
        >>> c = ClusterCounter(SignedStore(raw, b"k", timeout=5.0), "cursor")
        >>> c.fetch_add(3), c.fetch_add(), c.value
        (0, 3, 4)
    """

    def __init__(self, store: SignedStore, name: str):
        self._store, self.name, self._key = store, name, f"counter/{name}"
        # checked once, here: what something else wrote there (b"12abc") is a ValueError
        # naming the key, where each addition would silently use the integer it starts
        # with (checking at every fetch_add would cost a second round trip)
        store.read_counter(self._key)

    def fetch_add(self, n: int = 1) -> int:
        """Add ``n`` and return the value before, atomically across the cluster.
        TypeError if ``n`` is not an integer (a bool counts as none: ``int(1.5)`` was
        added before); OverflowError if the result leaves int64 (the store wraps it
        round: the addition is taken back, and a reader in between may see the wrap)."""
        n = counter_int(n, "n")
        if not INT64_MIN <= n <= INT64_MAX:
            raise OverflowError(f"SharedCounter.fetch_add({n}): n is outside the int64 range.")
        new = self._store.add(self._key, n)
        old = (new - n - INT64_MIN) % 2**64 + INT64_MIN  # what it held, in int64 as the store
        if not INT64_MIN <= old + n <= INT64_MAX:
            self._store.add(self._key, -n)
            raise OverflowError(f"SharedCounter.fetch_add({n}) on {old} leaves the int64 range.")
        return old

    @property
    def value(self) -> int:
        """The counter now (one round trip); ValueError naming the key when it holds
        what is not an integer (see ``SignedStore.read_counter``)."""
        return self._store.read_counter(self._key)

    def __repr__(self) -> str:
        return f"ClusterCounter({self.name!r})"
