"""InodeCache: one object per file or memfd per process, keyed by ``(st_dev, st_ino)``;
MappingCache: the same for mappings, with the storage of each.

Mapping a file once however many leaves of it are unpickled, and keeping a single
descriptor per segment, both need such a table. Values are held weakly, so a dead
object leaves no entry; a live entry keeps its descriptor (or mapping) open, so its
inode number cannot be reused meanwhile.
"""
from __future__ import annotations

import os
import threading
import weakref
from typing import Any, Callable


class InodeCache:
    """A thread-safe weak map ``(st_dev, st_ino) -> object``, fresh locks after fork.

    Args:
        thread_locks: names of ``threading.Lock`` attributes of the stored objects that a
            fork child gets fresh too, as it gets a fresh lock of the map itself.
        after_fork: name of a method (no arguments) of the stored objects that a fork
            child calls on each, before any code of the child runs (e.g. to reopen its
            own open file description, see :mod:`shared_td.platform`).
    """

    def __init__(self, thread_locks: tuple[str, ...] = (), after_fork: str | None = None) -> None:
        self._items: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._lock = threading.Lock()
        self._thread_locks = thread_locks
        self._after_fork = after_fork
        # a fork taken while another thread held a lock must not leave the child waiting
        # for a thread that does not exist there
        os.register_at_fork(after_in_child=self._renew_locks)

    def _renew_locks(self) -> None:
        self._lock = threading.Lock()
        for item in list(self._items.values()):
            for name in self._thread_locks:
                setattr(item, name, threading.Lock())
            if self._after_fork is not None:
                getattr(item, self._after_fork)()

    def get(self, key: tuple) -> Any:
        with self._lock:
            return self._items.get(key)

    def put(self, key: tuple, value: Any) -> None:
        with self._lock:
            self._items[key] = value

    def get_or_create(self, key: tuple, make: Callable[[], Any]) -> Any:
        """The object stored under ``key``, else ``make()``'s, stored: made under the
        lock, so two threads never open the same inode twice."""
        with self._lock:
            value = self._items.get(key)
            if value is None:
                value = make()
                self._items[key] = value
            return value

    def put_if_absent(self, key: tuple, value: Any) -> Any:
        """Store ``value`` unless another thread stored one first; returns the stored one."""
        with self._lock:
            existing = self._items.get(key)
            if existing is None:
                self._items[key] = value
                return value
            return existing

    def values(self) -> list:
        with self._lock:
            return list(self._items.values())

    def clear(self) -> None:
        with self._lock:
            self._items.clear()


class MappingCache(InodeCache):
    """An :class:`InodeCache` of this process's mappings (a FileBacking, a Segment per
    inode) that also holds, weakly, the storage of each: plain views (``detach()``,
    ``.data``) keep a mapping after every object of it is gone, and the same file or
    segment received again must reuse that mapping (one mapping, one descriptor per
    segment), not be mapped once more per tensor received. ``clear()`` forgets both.

    Example:
        >>> cache, storage = MappingCache(), torch.zeros(1).untyped_storage()
        >>> cache.keep_storage((1, 2), storage); cache.storage((1, 2)) is storage
        True
        >>> del storage; cache.storage((1, 2)) is None
        True
    """

    def __init__(self) -> None:
        super().__init__()
        self._storages: weakref.WeakValueDictionary = weakref.WeakValueDictionary()

    def keep_storage(self, key: tuple, storage) -> None:
        if storage is not None:
            self._storages[key] = storage

    def storage(self, key: tuple):
        """The live storage of this process's mapping of ``key``, or None."""
        return self._storages.get(key)

    def clear(self) -> None:
        super().clear()
        self._storages.clear()
