"""SharedCounter: an int64 that the processes of a machine advance atomically.

The typical use is the write cursor of a shared ring buffer: each writer reserves ``n``
slots with ``start = cursor.fetch_add(n)`` and owns ``start .. start + n - 1``; no slot
is ever handed out twice or skipped, whatever the number of processes and threads.

How it is built, and why:

* The 8 bytes live in an anonymous :class:`~shared_td.storage.anonymous.Segment` (a
  memfd), so the counter pickles *by reference* exactly like anonymous tensors do: under
  fork, spawn and ``multiprocess``, while the sending process still holds it; through
  multiprocessing's queues, process arguments and DataLoader workers (its
  ``ForkingPickler``) as a duplicate descriptor, so while the sending process lives,
  even once it dropped the counter (see :mod:`~shared_td.storage.anonymous`). Nothing
  is named in ``/dev/shm``; the memory is freed with the last holder.
* The value is one aligned 8-byte word of the segment's mapping. ``fetch_add`` loads
  and stores it while holding an exclusive :class:`~shared_td.platform.ByteLock` (a
  thread lock, then an open-file-description lock on the memfd): atomic between every
  process and thread, and never a false ``EDEADLK`` between threads of two processes.
  A process killed inside ``fetch_add`` has stored the new word entirely or not at all
  (one aligned 8-byte store, see :mod:`shared_td.platform`), and the kernel drops its
  lock: nothing is torn, and an addition is lost only if its call never returned.
  ``value`` is one aligned 8-byte load, without a lock.
* One ``SharedCounter`` object per segment per process (an inode cache, as for
  segments): two objects over the same memory in one process would have two thread
  locks sharing one open file description, and the OFD lock would not separate them.
  A fork child reopens its own description of the memfd (the cache's at-fork hook), so
  that a lock its parent holds excludes it too.
* Cost: about a microsecond or two per call (two system calls); one Python integer per
  reservation, so reserve slots in batches on hot paths.
* Across machines, ``SharedCounter(name, cluster=coord)`` is the cluster's counter
  ``name`` instead (``fetch_add`` is one ``TCPStore.add`` on the store host): any
  ``cluster`` object with a ``counter(name)`` method (a clustered
  :class:`~shared_td.Coordinator` or its ``Cluster``) makes it, so this module needs
  nothing from the coordinator layer above it.
"""
from __future__ import annotations

import ctypes
import multiprocessing.reduction
import operator
import os

from shared_td.platform import ByteLock, reopen_description
from shared_td.storage.anonymous import Segment, attach_segment, receive_segment
from shared_td.storage.cache import InodeCache
from shared_td.storage.duplicates import held_duplicate

__all__ = ["INT64_MAX", "INT64_MIN", "SharedCounter", "counter_int"]

#: The range of a counter (one int64 word).
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class SharedCounter:
    """A signed 64-bit integer shared between processes, with an atomic ``fetch_add``.

    Args:
        value: the initial value (an int); with ``cluster``, the counter's name instead
            (default ``"counter"``): every node that names the same counter shares it.
        cluster: a clustered Coordinator (or anything with a ``counter(name)`` method):
            the result is then that cluster-wide counter (``fetch_add`` is one
            ``TCPStore.add``, tens of microseconds on a LAN), which starts at 0 and is
            not picklable (each process asks its own node's cluster for it).

    Examples:
        >>> import pickle
        >>> cursor = SharedCounter()
        >>> cursor.fetch_add(4), cursor.fetch_add(4), cursor.value
        (0, 4, 8)
        >>> same = pickle.loads(pickle.dumps(cursor))   # e.g. a worker's argument
        >>> same.fetch_add(1), cursor.value
        (8, 9)

        A ring buffer of ``capacity`` rows reserves its rows like this::

            start = cursor.fetch_add(batch)
            rows = torch.arange(start, start + batch) % capacity
            buffer[rows] = transitions
    """

    __slots__ = ("_segment", "_word", "_lock", "__weakref__")

    def __new__(cls, value: int | str = 0, *, cluster=None):
        if cluster is None:
            return super().__new__(cls)
        counter = getattr(cluster, "counter", None)
        if counter is None:
            raise TypeError(f"SharedCounter(cluster=...) needs a clustered Coordinator (or an object "
                            f"with a counter(name) method), got a {type(cluster).__name__}.")
        if not isinstance(value, str):
            if value != 0:
                raise ValueError("A cluster SharedCounter starts at 0 (no node can set it for the others "
                                 "without a race): pass its name, SharedCounter(name, cluster=coord).")
            value = "counter"
        return counter(value)  # not a SharedCounter: __init__ is not called

    def __init__(self, value: int = 0, *, cluster=None):
        value = counter_int(value, "value")
        if not INT64_MIN <= value <= INT64_MAX:
            raise OverflowError(f"A SharedCounter holds an int64; {value} does not fit.")
        segment = Segment.create(8)
        self._adopt(segment)
        self._word.value = value
        _COUNTERS.put(segment.key, self)

    def _adopt(self, segment: Segment) -> None:
        self._segment = segment  # keeps the mapping that _word points into
        # the segment's mapping starts on a page: the word is 8-byte aligned
        self._word = ctypes.c_int64.from_address(segment.storage.data_ptr())
        self._lock = ByteLock(segment.fd, 0)

    def _after_fork(self) -> None:
        # our own open file description, so that the parent's lock excludes us
        try:
            reopen_description(self._segment.fd)
            error = None
        except OSError as err:
            error = err
        self._lock.renew_after_fork(error)

    def fetch_add(self, n: int = 1) -> int:
        """Add ``n`` for every process and return the value from before the addition.

        ``n`` may be negative. TypeError if ``n`` is not an integer (a bool counts as
        none); OverflowError, with nothing changed, if the result leaves int64.

        Example:
            >>> counter = SharedCounter(10)
            >>> counter.fetch_add(-3), counter.value
            (10, 7)
        """
        n = counter_int(n, "n")
        lock = self._lock
        # this shape exactly: a Ctrl-C here never leaves the lock held (see ByteLock); a
        # signal handler using this counter mid-operation is refused, never a hang
        if lock.threads._is_owned():
            raise lock.reentered(f"SharedCounter.fetch_add({n})")
        with lock.threads:
            try:
                lock.take()
                old = self._word.value
                new = old + n
                if not INT64_MIN <= new <= INT64_MAX:
                    raise OverflowError(
                        f"SharedCounter.fetch_add({n}) on {old} leaves the int64 range."
                    )
                self._word.value = new  # one aligned 8-byte store
                return old
            finally:
                lock.give_back()

    @property
    def value(self) -> int:
        """The current value (a snapshot: other processes may add right after); one
        aligned 8-byte load, never half of a value."""
        return self._word.value

    def __reduce__(self):
        # a reference (this process, its descriptor of the segment, the inode), never the
        # value; the counter's own, not the segment's pickle, so that a receiver whose
        # sender is gone is told about a SharedCounter and what to do
        segment = self._segment
        return _attach, (os.getpid(), segment.fd, segment.key)

    def __deepcopy__(self, memo: dict) -> "SharedCounter":
        # a new counter starting at the current value: a deep copy is not tied to this one
        # (by __reduce__ it came back as this same counter, this process's from the cache)
        return SharedCounter(self.value)

    def _reduce_with_duplicate(self):
        # multiprocessing's ForkingPickler (registered below): a duplicate descriptor of its
        # segment (storage/anonymous.py), so that a queue's receiver needs only the sending
        # process alive, not its counter; the counter's own, so that a receiver whose
        # sender is gone is told about a SharedCounter
        # (/proc route: the duplicate's own number, see held_duplicate)
        duplicate, held = held_duplicate(self._segment.fd)
        return _receive, (duplicate, self._segment.key, os.getpid(), held)

    def __repr__(self) -> str:
        return f"SharedCounter(value={self.value})"


# (st_dev, st_ino) of the segment -> this process's SharedCounter over it; a fork child
# reopens its own description and gets a fresh thread lock (a fork taken while another
# thread was inside fetch_add)
_COUNTERS = InodeCache(after_fork="_after_fork")


# why a pickled counter can no longer be attached, and the fix
_SENDER_GONE_ADVICE = (
    "A SharedCounter lives in anonymous shared memory, held by the processes that have "
    "it, so a pickled one can only be unpickled while its sender still holds it: keep "
    "the sender alive until every receiver has unpickled it (e.g. create the counter in "
    "the parent process and join the workers before it exits, or have each worker "
    "acknowledge once it started). A receiver that has unpickled it keeps working after "
    "the sender exits, and can itself send it on."
)


_WHAT = "SharedCounter (8 bytes of anonymous shared memory)"


def _attach(pid: int, fd: int, key: tuple[int, int]) -> SharedCounter:
    """Unpickle: this process's counter over the segment ``key`` that process ``pid``
    holds as ``fd``, made once; a SegmentUnavailableError saying what to do if that
    process is gone."""
    key = tuple(key)
    counter = _COUNTERS.get(key)
    if counter is not None:
        return counter
    return _adopt_received(attach_segment(pid, fd, key, 8, advice=_SENDER_GONE_ADVICE, what=_WHAT))


def _receive(duplicate, key: tuple[int, int], pid: int, fd: int) -> SharedCounter:
    """Unpickle a counter sent by ForkingPickler: its segment received as a duplicate
    descriptor (the ``/proc`` route, :func:`_attach`, if that cannot be taken).

    Example:
        >>> from multiprocessing.reduction import ForkingPickler
        >>> cursor = SharedCounter(5)
        >>> ForkingPickler.loads(ForkingPickler.dumps(cursor)) is cursor
        True
    """
    return _adopt_received(receive_segment(duplicate, key, 8, pid, fd, what=_WHAT, advice=_SENDER_GONE_ADVICE))


def _adopt_received(segment) -> SharedCounter:
    """This process's counter over ``segment``, made once."""

    def make() -> SharedCounter:
        counter = SharedCounter.__new__(SharedCounter)
        counter._adopt(segment)
        return counter

    return _COUNTERS.get_or_create(tuple(segment.key), make)


multiprocessing.reduction.ForkingPickler.register(SharedCounter, SharedCounter._reduce_with_duplicate)


def counter_int(value, name: str) -> int:
    """``value`` as an int for a counter (any integer type; a bool counts as none):
    TypeError naming ``name`` otherwise."""
    if isinstance(value, bool):
        raise TypeError(f"SharedCounter: {name} must be an int, not a bool.")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(
            f"SharedCounter: {name} must be an int, got {type(value).__name__} {value!r}."
        ) from None
