"""The coordinator's registry: what the manager process holds for its clients.

Everything here runs inside the manager process (see :mod:`shared_td.coordinator.server`,
which serves one :class:`Registry` to every client). Like the server, this module imports
nothing but the standard library: no torch, no ``shared_td``, no container. A published
tensordict reaches it as plain data, made by the client (see
:mod:`shared_td.coordinator.published`):

* its pickle, *opaque* bytes that the manager never unpickles;
* its *references*: ``(pid, fd, (st_dev, st_ino), how)`` of every memfd the pickle names
  (anonymous segments, shared non-tensor cells) in the publishing process, ``how``
  being opaque bytes for the client;
* its layout: class, batch size, and per leaf its key, shape, dtype and where it lives.

Why the manager opens a descriptor on each reference: a memfd can only be reached while a
process holds it (``/proc/<pid>/fd/<fd>``). The manager reopens each one while its
publisher waits for the reply, keeps the descriptor until the name is replaced or
unpublished, and hands ``(its pid, its fd, key, how)`` to attaching processes: so attaching
works after the publisher has exited, and the manager never maps a byte of the data. An
attach that opens them after the name was replaced or unpublished finds them closed (or
their numbers reused: the inode check says so) and asks again (see
:func:`shared_td.coordinator.client.attach`): the manager keeps no old version alive.

Besides published tensordicts the registry holds:

* *adopted cells*: the memfds (slabs) of ``share_non_tensor=True`` values that a process
  handed over (:meth:`Registry.adopt_cells`), so that they stay attachable after it exits;
* the *version table*: one memfd of u64 slots, one per published name, that attached
  processes map read-only to check ``is_stale`` without a round trip.

Example (what a client call amounts to, in the manager)::

    >>> fd = os.memfd_create("example"); st = os.fstat(fd)
    >>> registry = Registry()
    >>> layout = {"class": "TensorDict", "batch_size": [], "leaves": []}
    >>> reference = (os.getpid(), fd, (st.st_dev, st.st_ino), b"<how>")
    >>> info, stamp = registry.publish("demo", b"<pickle>", [reference], layout)
    >>> info["name"], info["version"], stamp["slot"]
    ('demo', 1, 0)
    >>> blob, references, version, _ = registry.attach("demo")
    >>> references[0][0] == os.getpid() and references[0][1] != fd  # the registry's own descriptor
    True
"""
from __future__ import annotations

import errno
import mmap
import os
import resource
import struct
import sys
import threading

try:  # server.py, run as a script, loaded platform.py alone from its path first
    platform = sys.modules["shared_td.platform"]
except KeyError:
    from shared_td import platform

__all__ = ["Registry", "VersionTable", "VERSION_SLOTS", "WITHDRAWN"]

#: Slots of the version table (8 bytes each). A name published after these are all
#: taken gets no slot, and ``is_stale`` asks the manager instead (one round trip).
VERSION_SLOTS = 4096
#: High bit of a slot: the name was unpublished (the low bits keep its last version).
WITHDRAWN = 1 << 63
_SLOT = struct.Struct("<Q")


class Registry:
    """Name -> published tensordict, held alive in the manager process.

    Each entry keeps the publisher's pickle, the manager's own descriptor on every memfd
    it names (so that the memory outlives the publisher), a layout summary and a version.
    Methods are called from the server's per-connection threads, hence the lock.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._entries: dict[str, dict] = {}
        # Never forgotten, so a name published again after unpublish gets a higher version.
        self._versions: dict[str, int] = {}
        self._slots: dict[str, int | None] = {}  # name -> its slot in the version table
        self._table: VersionTable | None = None  # made on the first publish
        # (adopter pid, (st_dev, st_ino)) -> our descriptor: released by its adopter only
        # (a fork child inherits the adopter's copies, not its holds)
        self._cells: dict[tuple[int, tuple[int, int]], int] = {}

    def publish(self, name: str, blob: bytes, references: list, layout: dict) -> tuple[dict, dict]:
        """Hold the tensordict pickled as ``blob`` under ``name``.

        ``references`` are ``(pid, fd, (st_dev, st_ino), how)`` of the memfds the pickle
        names (the publisher is alive: it waits for this reply); ``layout`` is its summary
        (``class``, ``batch_size``, ``leaves``). Returns the layout with its ``name`` and
        ``version``, and the name's *stamp*: where attached processes read its current
        version without asking (see :meth:`_stamp`).
        """
        if not isinstance(name, str) or not name:
            raise TypeError(f"A published name must be a non-empty str, got {name!r}.")
        if not isinstance(blob, bytes) or not isinstance(layout, dict):
            raise TypeError("publish takes the pickle as bytes and the layout as a dict.")
        fds: list[int] = []
        try:
            for pid, fd, key, _how in references:
                fds.append(_reopen(pid, fd, key))
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        own = [(os.getpid(), fd, tuple(key), how) for fd, (_, _, key, how) in zip(fds, references)]
        with self._lock:
            version = self._versions.get(name, 0) + 1
            self._versions[name] = version
            info = {"name": name, "version": version, **layout}
            # Replacing an old entry drops the manager's hold on its memfds; attached
            # processes keep their own descriptors and mappings.
            old = self._entries.get(name)
            self._entries[name] = {"blob": blob, "references": own, "layout": info}
            self._store_version(name, version)
            stamp = self._stamp(name)
        if old is not None:
            _close_references(old)
        return info, stamp

    def attach(self, name: str) -> tuple[bytes, list, int, dict]:
        """The pickle of ``name``, the references it resolves to here (this process's pid
        and descriptors), its version and its stamp; KeyError if unknown."""
        with self._lock:
            entry = self._entry(name)
            return entry["blob"], entry["references"], entry["layout"]["version"], self._stamp(name)

    def version(self, name: str) -> int:
        """The current version of ``name``, with :data:`WITHDRAWN` set if it was
        unpublished (what its slot holds); KeyError if it was never published."""
        with self._lock:
            if name not in self._versions:
                self._entry(name)  # raises the KeyError listing the names
            return self._versions[name] | (0 if name in self._entries else WITHDRAWN)

    def adopt_cells(self, pid: int, cells: list, released: list) -> tuple[int, list[int]]:
        """Hold the memfd cells ``cells`` (``(fd, key)`` in process ``pid``) until the
        manager stops; first drop those whose keys are in ``released``.

        Returns this process's pid and its descriptor for each cell, which the creator
        records as a fallback holder. A cell already adopted by ``pid`` keeps its
        descriptor. All or nothing: a failed reopen (the manager out of descriptors) keeps
        none of the new. A release is honoured only from the process that adopted the
        cell: a fork child that drops its inherited copy never releases its parent's.
        """
        if type(pid) is not int:
            raise TypeError(f"adopt_cells takes the adopting process's pid (an int), got {pid!r}")
        with self._lock:
            for key in released:
                fd = self._cells.pop((pid, tuple(key)), None)
                if fd is not None:
                    os.close(fd)
            # reopened aside, kept only once all are: a cell the creator does not record
            # as held (this call failed) would be held here, unreleased, until the end
            new: dict = {}
            try:
                for fd, key in cells:
                    held = (pid, tuple(key))
                    if held not in self._cells and held not in new:
                        new[held] = _reopen(pid, fd, key)
            except BaseException:
                for fd in new.values():
                    os.close(fd)
                raise
            self._cells.update(new)
            return os.getpid(), [self._cells[(pid, tuple(key))] for _fd, key in cells]

    def _store_version(self, name: str, value: int) -> None:
        if name not in self._slots:
            if self._table is None:
                try:
                    self._table = VersionTable(VERSION_SLOTS)
                except OSError as err:
                    raise _table_refused(err) from err
            taken = len(self._slots)
            self._slots[name] = taken if taken < self._table.slots else None
        slot = self._slots[name]
        if slot is not None:
            self._table.store(slot, value)

    def _stamp(self, name: str) -> dict:
        """``{"table": (pid, fd, (st_dev, st_ino), nbytes) or None, "slot": int or None}``."""
        slot = self._slots.get(name)
        table = None if slot is None else self._table.reference()
        return {"table": table, "slot": slot}

    def layout(self, name: str) -> dict:
        """The layout summary of ``name``: ``name``, ``version``, ``class``,
        ``batch_size``, ``leaves``. KeyError if unknown."""
        with self._lock:
            return self._entry(name)["layout"]

    def names(self) -> list[str]:
        """The published names, sorted."""
        with self._lock:
            return sorted(self._entries)

    def unpublish(self, name: str) -> None:
        """Forget ``name``; its anonymous memory is freed once no process maps it."""
        with self._lock:
            entry = self._entry(name)
            del self._entries[name]
            self._store_version(name, self._versions[name] | WITHDRAWN)
        _close_references(entry)

    def info(self) -> dict:
        """Facts about the manager process (pid, names), for tests and debugging."""
        return {"pid": os.getpid(), "names": self.names()}

    def _entry(self, name: str) -> dict:
        try:
            return self._entries[name]
        except KeyError:
            raise KeyError(
                f"No tensordict is published as {name!r}; published names: "
                f"{sorted(self._entries)}."
            ) from None


def _reopen(pid: int, fd: int, key) -> int:
    """The manager's own descriptor on descriptor ``fd`` of process ``pid``."""
    try:
        return platform.reopen_peer_fd(pid, fd, key)
    except OSError as err:
        raise _manager_short_of(err) from err


def _table_refused(err: OSError) -> OSError:
    """The error of the manager's version table (a memfd) that could not be made: past
    the manager's RLIMIT_FSIZE, which it inherits from the process that started the
    coordinator (`ulimit -f`: the raw "File too large" read as the caller's own), or
    short of memory; else :func:`_manager_short_of`."""
    if err.errno not in (errno.EFBIG, errno.ENOSPC, errno.ENOMEM):
        return _manager_short_of(err)
    if err.errno == errno.EFBIG:
        soft, hard = (("unlimited" if value == resource.RLIM_INFINITY else str(value))
                      for value in resource.getrlimit(resource.RLIMIT_FSIZE))
        why = (f"its RLIMIT_FSIZE soft/hard = {soft}/{hard} bytes, inherited from the process that started the "
               "coordinator: raise it there (`ulimit -f unlimited`)")
    else:
        why = "the machine is short of memory (a memfd's pages are RAM)"
    return OSError(err.errno, f"The shared_td coordinator's manager process {os.getpid()} could not make its "
                              f"version table of {VERSION_SLOTS * _SLOT.size} bytes: {why} ({err}).")


def _manager_short_of(err: OSError) -> OSError:
    """``err``, or, when the manager is out of descriptors (EMFILE, ENFILE), an OSError
    that says so, naming the manager and its limit: the raw "Too many open files:
    '/proc/<pid>/fd/4'" reaches the client, where it reads like the caller's own."""
    if err.errno not in (errno.EMFILE, errno.ENFILE):
        return err
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return OSError(err.errno, (
        f"The shared_td coordinator's manager process {os.getpid()} is out of file descriptors "
        f"(its RLIMIT_NOFILE soft/hard = {soft}/{hard}; it holds one per anonymous leaf and "
        f"shared non-tensor value published or adopted): {err}. Unpublish names no longer "
        "needed, or start the coordinator from a process with a higher hard limit "
        "(`ulimit -Hn`): the manager raises its soft limit to the hard one it inherits."))


def _close_references(entry: dict) -> None:
    for _, fd, _, _ in entry["references"]:
        os.close(fd)


class VersionTable:
    """A memfd of ``slots`` u64 words that the manager writes and attached processes map.

    Only the manager writes it (under the registry's lock), each entry with one aligned
    8-byte store through the mapping (a ctypes u64 at an 8-byte-aligned address, which
    CPython stores with one 8-byte move; x86-64 and arm64 make it single-copy atomic), and
    readers load an entry with one aligned 8-byte load. So a reader never sees half of a
    version, and a manager killed at any instant leaves each entry old or new, never torn:
    there is no multi-word state to commit. The bytes are reserved at creation (no SIGBUS
    on a full memory).

    Example:
        >>> table = VersionTable(4)
        >>> table.store(2, 7)
        >>> table.words[2], table.reference()[3]
        (7, 32)
    """

    def __init__(self, slots: int):
        import ctypes

        self.slots = slots
        self.fd = platform.new_memfd(f"shared_td-versions-{os.getpid()}", slots * _SLOT.size)
        st = os.fstat(self.fd)
        self.key = (st.st_dev, st.st_ino)
        self._map = mmap.mmap(self.fd, slots * _SLOT.size)
        self.words = (ctypes.c_uint64 * slots).from_buffer(self._map)

    def store(self, slot: int, value: int) -> None:
        self.words[slot] = value

    def reference(self) -> tuple:
        """``(pid, fd, (st_dev, st_ino), nbytes)``: how a client opens it via /proc."""
        return os.getpid(), self.fd, self.key, self.slots * _SLOT.size
