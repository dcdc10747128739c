"""Is an attached tensordict still the published one? ``is_stale`` and ``refresh``.

Publishing a name again (a new tensordict, new keys added with ``make_memmap``, or an
atomic rewrite of its prefix followed by ``publish``) raises its version; unpublishing
marks it withdrawn. A tensordict returned by ``attach`` (or ``publish``) remembers the
name and version it got. The coordinator keeps every name's current version in a small
shared-memory table (one u64 per name, see :class:`~shared_td.coordinator.registry.VersionTable`)
that this process maps once per coordinator, so :func:`is_stale` is one load from
shared memory (well under a microsecond), with no round trip to the manager.

A stale tensordict keeps working on the memory it mapped: writes land in the old
segments or the old files (an atomic rewrite swapped in new inodes), never in the new
layout's. :func:`refresh` attaches the current one.

Example:
    >>> import torch, shared_td
    >>> with shared_td.Coordinator() as coord:
    ...     _ = coord.publish("w", shared_td.TensorDict(a=torch.zeros(2)))
    ...     view = coord.attach("w")
    ...     _ = coord.publish("w", shared_td.TensorDict(a=torch.ones(2), b=torch.ones(1)))
    ...     stale = shared_td.is_stale(view)
    ...     view = shared_td.refresh(view)
    ...     stale, shared_td.is_stale(view), sorted(view.keys())
    (True, False, ['a', 'b'])
"""
from __future__ import annotations

import ctypes
import os
import select
import time
import weakref
from dataclasses import dataclass
from typing import Any

from shared_td.coordinator import channels
from shared_td.errors import SegmentUnavailableError
from shared_td.finalizers import Finalizer
from shared_td.platform import map_shared_bytes, pid_alive, unmap_bytes
from shared_td.storage.anonymous import attach_peer_fd
from shared_td.storage.cache import InodeCache
from shared_td.storage.fd_mapping import map_error

__all__ = ["is_stale", "refresh", "remember"]


@dataclass
class _Attachment:
    name: str
    version: int
    endpoint: Any  # has .attach(name) and .version(name)
    table: Any  # the mapped version table (_Table), or None
    slot: int | None
    holds: Any  # kept alive with the tensordict: the ParsedVersion it was attached from


# id(td) -> (weak reference, attachment). Keyed by identity: tensordicts have no hash.
_ATTACHMENTS: dict[int, tuple[weakref.ref, _Attachment]] = {}

class _Table:
    """A coordinator's version table mapped in this process, and how to tell whether its
    manager (process ``pid``) still lives: a pidfd (``pidfd``, or None where the kernel
    has none), which, unlike the pid, cannot come to name another process."""

    def __init__(self, fd: int, nbytes: int, pid: int, pidfd: int | None):
        # Owns pidfd from the call on: closed when this object dies, a failure below
        # included (the caller, which cannot tell whether the call got this far, never
        # closes it: a Ctrl-C landing as it returned had it closed twice, once more a
        # descriptor number the process had reused meanwhile).
        if pidfd is not None:
            Finalizer(self, os.close, pidfd)
        self.pid, self._exited = pid, None
        try:
            address = map_shared_bytes(fd, nbytes)
        except OSError as error:  # ENOMEM: RLIMIT_AS, vm.max_map_count (named, as for a segment)
            raise map_error(error.errno, fd, nbytes, True,
                            f"the coordinator version table of manager process {pid}") from None
        unmap = Finalizer(self, unmap_bytes, address, nbytes)
        unmap.atexit = False  # exit unmaps anyway; a late is_stale must not find it gone
        self.words = (ctypes.c_uint64 * (nbytes // 8)).from_address(address)
        if pidfd is not None:
            # poll, not select: select refuses descriptors past 1023
            self._exited = select.poll()
            self._exited.register(pidfd, select.POLLIN)

    def manager_alive(self) -> bool:
        """Whether the manager still runs: no round trip, a poll of its pidfd (readable
        once it has exited, SIGKILL included), a few microseconds."""
        if self._exited is None:
            return pid_alive(self.pid)
        return not self._exited.poll(0)


# (st_dev, st_ino) of a version table -> its mapping here, shared by the attachments of
# one coordinator, unmapped with the last of them
_TABLES = InodeCache()


def remember(td: Any, name: str, version: int, stamp: dict, endpoint: Any, holds: Any = None) -> None:
    """Record that ``td`` is version ``version`` of ``name`` (called by attach/publish);
    ``holds`` lives as long as ``td`` does."""
    table = None
    if stamp["table"] is not None:
        # how long to watch for the manager's exit is bounded by the call's own timeout
        wait = min(_EXIT_SHOWS_S, getattr(endpoint, "_timeout", _EXIT_SHOWS_S))
        table = _map_table(*stamp["table"], address=endpoint.address, wait=wait)
    attachment = _Attachment(name, version, endpoint, table, stamp["slot"], holds)
    key = id(td)

    def forget(_ref, key=key, attachments=_ATTACHMENTS):
        # bound here: at interpreter exit the module's globals may already be None
        attachments.pop(key, None)

    _ATTACHMENTS[key] = (weakref.ref(td, forget), attachment)


# How long a manager whose table just vanished may take to be seen exited: a process
# closes its descriptors in the kernel before its exit shows (pidfd, /proc state)
_EXIT_SHOWS_S = 0.5


def _map_table(pid: int, fd: int, key: tuple[int, int], nbytes: int, *, address: str | None = None,
               wait: float = _EXIT_SHOWS_S):
    """The version table that manager ``pid`` holds as ``fd``, mapped here (shared by
    this process's attachments); ``address`` names the coordinator in errors. If the
    table cannot be opened, whether the manager has exited is watched for up to
    ``wait`` seconds: then the coordinator is gone (ConnectionError)."""
    key = tuple(key)
    failed = []  # (error, pidfd) of an attempt that found the table missing

    def open_table() -> _Table:
        # Only an attempt, under the cache's process-wide lock: the wait that tells a
        # dead manager from a live one happens below, after the lock is released, so
        # that other threads' attach and publish calls never wait on it.
        # The pidfd first: the table opened after it proves that its process is the manager.
        try:
            pidfd = os.pidfd_open(pid)
        except (AttributeError, OSError):  # no pidfd here (kernel < 5.3), or it just died
            pidfd = None
        try:
            own_fd = attach_peer_fd(pid, fd, key, what="coordinator version table", min_size=nbytes)
        except SegmentUnavailableError as err:
            failed.append((err, pidfd))  # from here the pidfd is closed below
            raise
        except BaseException:
            if pidfd is not None:
                os.close(pidfd)
            raise
        try:
            return _Table(own_fd, nbytes, pid, pidfd)  # (which owns pidfd from the call on)
        finally:
            os.close(own_fd)  # the mapping keeps the memory

    try:
        return _TABLES.get_or_create(key, open_table)
    except SegmentUnavailableError as err:
        # The manager answered, then died before we opened its table (the answer's other
        # references may all be files): the coordinator is gone, as channels.call says
        # when it dies before answering. If it lives, the table itself is the trouble.
        if not failed or failed[0][0] is not err or not _exited(pid, failed[0][1], wait):
            raise
        exited = ProcessLookupError(f"its manager process {pid} exited right after answering")
        raise channels.gone(address or "(address not given)", exited) from err
    finally:
        if failed and failed[0][1] is not None:
            os.close(failed[0][1])


def _exited(pid: int, pidfd: int | None, wait: float = _EXIT_SHOWS_S) -> bool:
    """Whether the manager ``pid`` has exited, or does within ``wait`` seconds."""
    if pidfd is not None:
        exited = select.poll()
        exited.register(pidfd, select.POLLIN)  # readable once it has exited
        return bool(exited.poll(max(0.0, wait) * 1000))
    deadline = time.monotonic() + wait
    while pid_alive(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)
    return True


def _attachment(td: Any) -> _Attachment:
    entry = _ATTACHMENTS.get(id(td))
    if entry is None or entry[0]() is not td:
        raise ValueError(
            "This tensordict was not returned by attach() or Coordinator.publish(), so it "
            "has no published version to compare with."
        )
    return entry[1]


def is_stale(td: Any) -> bool:
    """True if the name that ``td`` was attached (or published) as has been published
    again, or unpublished, since then (an unpublished name's slot keeps its version
    with the :data:`~shared_td.coordinator.registry.WITHDRAWN` bit set). No round trip:
    one read of the coordinator's shared version table (a round trip only past its
    4096 names).

    It does not check that the manager lives (that would cost a system call per check):
    once the coordinator is gone, its table stays mapped and answers what was last
    published (False, unless something newer was published before it went). Call
    :func:`refresh` to learn that it is gone: it raises ConnectionError then.

    Raises:
        ValueError: ``td`` was not returned by ``attach``/``Coordinator.publish``.
        ConnectionError: past 4096 names, when the coordinator is gone.

    Example:
        >>> with shared_td.Coordinator() as coord:
        ...     view = coord.publish("weights", TensorDict(w=torch.zeros(3)))
        ...     before = shared_td.is_stale(view)
        ...     _ = coord.publish("weights", TensorDict(w=torch.ones(3)))
        ...     before, shared_td.is_stale(view)
        (False, True)
    """
    attachment = _attachment(td)
    if attachment.table is not None:
        current = attachment.table.words[attachment.slot]
    else:
        current = attachment.endpoint.version(attachment.name)
    return current != attachment.version


def refresh(td: Any) -> Any:
    """The current tensordict published under ``td``'s name (a new object; ``td``
    itself is unchanged and keeps mapping the old memory). Returns ``td`` itself when
    it is not stale and the coordinator's manager still runs (checked without a round
    trip: a poll of its pidfd).

    Raises:
        KeyError: the name was unpublished.
        ConnectionError: the coordinator is gone (its manager exited or was killed),
            stale or not: naming its address and the manager's pid.
        ValueError: ``td`` was not returned by ``attach``/``Coordinator.publish``.

    Example:
        >>> with shared_td.Coordinator() as coord:
        ...     td = coord.publish("weights", TensorDict(w=torch.zeros(3)))
        ...     _ = coord.publish("weights", TensorDict(w=torch.ones(3)))
        ...     if shared_td.is_stale(td):
        ...         td = shared_td.refresh(td)
        ...     td["w"].tolist()
        [1.0, 1.0, 1.0]
    """
    attachment = _attachment(td)
    if not is_stale(td):
        table = attachment.table
        # a dead manager's table never changes: "not stale" would be returned for ever
        if table is not None and not table.manager_alive():
            raise ConnectionError(
                f"The shared_td coordinator at {attachment.endpoint.address} is gone (its "
                f"manager process {table.pid} exited): {attachment.name!r} cannot be "
                "refreshed. Tensordicts already attached stay readable and writable; "
                "publish again through a new Coordinator."
            )
        return td
    return attachment.endpoint.attach(attachment.name)
