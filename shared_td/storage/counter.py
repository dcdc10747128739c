"""SharedCounter: an int64 that the processes of a machine advance atomically.

The typical use is the write cursor of a shared ring buffer: each writer reserves ``n``
slots with ``start = cursor.fetch_add(n)`` and owns ``start .. start + n - 1``; no slot
is ever handed out twice or skipped, whatever the number of processes and threads.

How it is built, and why:

* The 8 bytes live in an anonymous :class:`~shared_td.storage.anonymous.Segment` (a
  memfd), so the counter pickles *by reference* exactly like anonymous tensors do: under
  fork, spawn and ``multiprocess``, while the sending process still holds it. Nothing
  is named in ``/dev/shm``; the memory is freed with the last holder.
* ``fetch_add`` reads and writes the value with ``pread``/``pwrite`` under an exclusive
  ``lockf`` lock on the memfd. ``lockf`` locks belong to a *process* (a fork child does
  not share its parent's lock, unlike open-file-description locks, which a fork child
  would share through the inherited descriptor), so threads of one process are
  serialised by a thread lock in addition.
* One ``SharedCounter`` object per segment per process (an inode cache, as for
  segments): two objects over the same memory in one process would have two thread
  locks and the process lock would not separate them. Closing any descriptor of a file
  drops the process's ``lockf`` locks on it, which is one more reason to hold exactly one.
* Cost: a few microseconds per call (four system calls); one Python integer per
  reservation, so reserve slots in batches on hot paths.
"""
from __future__ import annotations

import fcntl
import operator
import os
import struct
import threading

from shared_td.storage.anonymous import Segment
from shared_td.storage.cache import InodeCache

__all__ = ["SharedCounter"]

_INT64 = struct.Struct("<q")
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


class SharedCounter:
    """A signed 64-bit integer shared between processes, with an atomic ``fetch_add``.

    Args:
        value: the initial value (an int).

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

    __slots__ = ("_segment", "_lock", "__weakref__")

    def __init__(self, value: int = 0):
        value = _as_int(value, "value")
        if not _INT64_MIN <= value <= _INT64_MAX:
            raise OverflowError(f"A SharedCounter holds an int64; {value} does not fit.")
        segment = Segment.create(_INT64.size)
        segment.write(0, _INT64.pack(value))
        self._adopt(segment)
        _COUNTERS.put(segment.key, self)

    def _adopt(self, segment: Segment) -> None:
        self._segment = segment
        self._lock = threading.Lock()

    def fetch_add(self, n: int = 1) -> int:
        """Add ``n`` for every process and return the value from before the addition.

        ``n`` may be negative. TypeError if ``n`` is not an integer (a bool counts as
        none); OverflowError, with nothing changed, if the result leaves int64.

        Example:
            >>> counter = SharedCounter(10)
            >>> counter.fetch_add(-3), counter.value
            (10, 7)
        """
        n = _as_int(n, "n")
        fd = self._segment.fd
        with self._lock:
            fcntl.lockf(fd, fcntl.LOCK_EX, _INT64.size, 0)
            try:
                old = _INT64.unpack(os.pread(fd, _INT64.size, 0))[0]
                new = old + n
                if not _INT64_MIN <= new <= _INT64_MAX:
                    raise OverflowError(
                        f"SharedCounter.fetch_add({n}) on {old} leaves the int64 range."
                    )
                os.pwrite(fd, _INT64.pack(new), 0)
                return old
            finally:
                fcntl.lockf(fd, fcntl.LOCK_UN, _INT64.size, 0)

    @property
    def value(self) -> int:
        """The current value (a snapshot: other processes may add right after)."""
        fd = self._segment.fd
        with self._lock:
            # a shared lock: never a half-written value, whatever the platform's pread
            fcntl.lockf(fd, fcntl.LOCK_SH, _INT64.size, 0)
            try:
                return _INT64.unpack(os.pread(fd, _INT64.size, 0))[0]
            finally:
                fcntl.lockf(fd, fcntl.LOCK_UN, _INT64.size, 0)

    def __reduce__(self):
        # the segment pickles as a reference (pid, fd, inode), never the value
        return _attach, (self._segment,)

    def __repr__(self) -> str:
        return f"SharedCounter(value={self.value})"


# (st_dev, st_ino) of the segment -> this process's SharedCounter over it; a fork child
# gets fresh thread locks (a fork taken while another thread was inside fetch_add)
_COUNTERS = InodeCache(thread_locks=("_lock",))


def _attach(segment: Segment) -> SharedCounter:
    """Unpickle: this process's counter over ``segment``, made once."""

    def make() -> SharedCounter:
        counter = SharedCounter.__new__(SharedCounter)
        counter._adopt(segment)
        return counter

    return _COUNTERS.get_or_create(segment.key, make)


def _as_int(value, name: str) -> int:
    if isinstance(value, bool):
        raise TypeError(f"SharedCounter: {name} must be an int, not a bool.")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(
            f"SharedCounter: {name} must be an int, got {type(value).__name__} {value!r}."
        ) from None
