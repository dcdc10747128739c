"""The manager side of the Coordinator: the registry, its private directory, the sweep.

Everything here runs inside the manager process that :class:`~shared_td.Coordinator`
starts (a :class:`multiprocess.managers.BaseManager` process). Clients never touch this
module's objects directly: they speak the manager's own wire protocol to one registry
object that the server holds under the fixed id :data:`REGISTRY_ID`.

Why the manager *unpickles* what is published: an anonymous leaf pickles as "descriptor
``fd`` of process ``pid``" (see :mod:`shared_td.storage.anonymous`), so it can only be
received while its sender still holds it. By unpickling each published tensordict once,
the manager opens its own descriptor on every memfd segment and
:class:`~shared_td.storage.shared_value.SharedValue`, keeps them alive, and re-pickles the
tensordict *itself*, so that attaching names the manager's pid and descriptors and works
after the publisher has exited. File-backed leaves pickle as paths; the manager maps them
too (cheap, untouched pages cost nothing).

Besides published tensordicts the manager holds:

* *adopted cells*: the memfds of ``share_non_tensor=True`` values that a process handed
  over (:meth:`Registry.adopt_cells`), so that they stay attachable after it exits;
* the *version table*: one memfd of u64 slots, one per published name, that attached
  processes map read-only to check ``is_stale`` without a round trip.

This module imports neither torch nor the ``shared_td`` package at load time: the
embedded coordinator runs it as a script in a fresh interpreter (see
:mod:`shared_td.coordinator.ownership`), which then starts in ~0.1 s instead of the ~2.5 s
of importing torch. torch is imported only when a tensordict is published to it. Its
operating-system primitives come from ``shared_td/platform.py``, which is torch-free and
imports nothing of the package: run as a script, this module loads that one file by
its path.

Example (what a client call amounts to, in the manager)::

    >>> import pickle, torch, shared_td
    >>> registry = Registry()
    >>> td = shared_td.TensorDict(x=torch.zeros(3)).memmap_()
    >>> info, stamp = registry.publish("demo", pickle.dumps(td))
    >>> info["version"], info["leaves"][0]["where"]
    (1, 'anonymous')
    >>> pickle.loads(registry.attach("demo")[0])["x"].tolist()
    [0.0, 0.0, 0.0]
"""
from __future__ import annotations

import mmap
import os
import pickle
import re
import resource
import shutil
import signal
import stat
import struct
import sys
import tempfile
import threading
import time

from multiprocess import managers


def _load_platform():
    """shared_td's platform module: imported from the package, or, when this file runs
    as a script (see the module doc), loaded alone from its path beside the package's."""
    if __package__:
        from shared_td import platform as module

        return module
    import importlib.util

    package_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location(
        "_shared_td_platform", os.path.join(package_dir, "platform.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


platform = _load_platform()
__all__ = ["DIR_PATTERN", "REGISTRY_ID", "Registry", "CoordinatorManager", "sweep_dead_dirs"]

#: Name of a coordinator's private directory under ``tempfile.gettempdir()``:
#: ``shared_td-coord-<manager pid>-<mkdtemp suffix>``. The sweep touches nothing else.
DIR_PREFIX = "shared_td-coord-"
DIR_PATTERN = re.compile(r"^shared_td-coord-(\d+)-[a-z0-9_]{8}$")

#: The server-side id of the registry object; fixed, so clients need no ``create`` call.
REGISTRY_ID = "shared_td-registry"

# How often the manager checks that the process that started it is still alive.
_PARENT_POLL_S = 0.2

#: Slots of the version table (8 bytes each). A name published after these are all
#: taken gets no slot, and ``is_stale`` asks the manager instead (one round trip).
VERSION_SLOTS = 4096
#: High bit of a slot: the name was unpublished (the low bits keep its last version).
WITHDRAWN = 1 << 63
_SLOT = struct.Struct("<Q")


class Registry:
    """Name -> published tensordict, held alive in the manager process.

    Each entry keeps the unpickled tensordict (so the manager holds a descriptor on every
    anonymous segment), the manager's own pickle of it (what :meth:`attach` returns),
    a layout summary and a version. Methods are called from the server's per-connection
    threads, hence the lock.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._entries: dict[str, dict] = {}
        # Never forgotten, so a name published again after unpublish gets a higher version.
        self._versions: dict[str, int] = {}
        self._slots: dict[str, int | None] = {}  # name -> its slot in the version table
        self._table: VersionTable | None = None  # made on the first publish
        self._cells: dict[tuple[int, int], int] = {}  # (st_dev, st_ino) -> our descriptor

    def publish(self, name: str, blob: bytes) -> tuple[dict, dict]:
        """Adopt the pickled tensordict ``blob`` under ``name``.

        Returns its layout and its *stamp*: where attached processes read its current
        version without asking (see :meth:`stamp`).
        """
        if not isinstance(name, str) or not name:
            raise TypeError(f"A published name must be a non-empty str, got {name!r}.")
        # Unpickling opens our own descriptors on the publisher's segments (it is alive:
        # it is waiting for this reply) and maps its files.
        td = pickle.loads(blob)
        own_blob = pickle.dumps(td)  # now naming this process's pid and descriptors
        with self._lock:
            version = self._versions.get(name, 0) + 1
            self._versions[name] = version
            info = layout_of(td, name, version)
            # Replacing an old entry drops the manager's hold on its segments; attached
            # processes keep their own descriptors and mappings.
            self._entries[name] = {"td": td, "blob": own_blob, "layout": info}
            self._store_version(name, version)
            return info, self._stamp(name)

    def attach(self, name: str) -> tuple[bytes, int, dict]:
        """The manager's pickle of ``name``, its version and its stamp; KeyError if unknown."""
        with self._lock:
            entry = self._entry(name)
            return entry["blob"], entry["layout"]["version"], self._stamp(name)

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
        records as a fallback holder. A cell already adopted keeps its descriptor.
        """
        with self._lock:
            for key in released:
                fd = self._cells.pop(tuple(key), None)
                if fd is not None:
                    os.close(fd)
            fds = []
            for fd, key in cells:
                key = tuple(key)
                if key not in self._cells:
                    self._cells[key] = platform.reopen_peer_fd(pid, fd, key)
                fds.append(self._cells[key])
            return os.getpid(), fds

    def _store_version(self, name: str, value: int) -> None:
        if name not in self._slots:
            if self._table is None:
                self._table = VersionTable(VERSION_SLOTS)
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
        """The layout summary of ``name`` (see :func:`layout_of`)."""
        with self._lock:
            return self._entry(name)["layout"]

    def names(self) -> list[str]:
        """The published names, sorted."""
        with self._lock:
            return sorted(self._entries)

    def unpublish(self, name: str) -> None:
        """Forget ``name``; its anonymous memory is freed once no process maps it."""
        with self._lock:
            self._entry(name)
            del self._entries[name]
            self._store_version(name, self._versions[name] | WITHDRAWN)

    def info(self) -> dict:
        """Facts about the manager process (pid, directory), for tests and debugging."""
        return {"pid": os.getpid(), "names": self.names()}

    def _entry(self, name: str) -> dict:
        try:
            return self._entries[name]
        except KeyError:
            raise KeyError(
                f"No tensordict is published as {name!r}; published names: "
                f"{sorted(self._entries)}."
            ) from None


def layout_of(td, name: str, version: int) -> dict:
    """A plain-dict summary of ``td``: class, batch size, and per leaf its key, shape,
    dtype and where it lives (a file path, ``"anonymous"`` or ``"non-tensor"``).

    Example:
        >>> import torch, shared_td
        >>> td = shared_td.TensorDict(a=torch.zeros(2, 3), batch_size=[2]).memmap_()
        >>> layout_of(td, "t", 1)["leaves"]
        [{'key': 'a', 'shape': [2, 3], 'dtype': 'torch.float32', 'where': 'anonymous'}]
    """
    import torch  # only a manager that is published to needs it (see the module doc)

    from shared_td.containers.base import is_leaf_nontensor

    leaves = []
    for key, value in td.items(True, True, is_leaf_nontensor):
        key_str = ".".join(key) if isinstance(key, tuple) else key
        if isinstance(value, torch.Tensor):
            backing_path = getattr(getattr(value, "_backing", None), "path", None)
            leaves.append({
                "key": key_str, "shape": list(value.shape), "dtype": str(value.dtype),
                "where": backing_path or "anonymous",
            })
        else:  # a non-tensor leaf (shared as a SharedValue or held in the pickle)
            leaves.append({"key": key_str, "shape": list(value.batch_size),
                           "dtype": type(value).__name__, "where": "non-tensor"})
    return {
        "name": name, "version": version, "class": type(td).__name__,
        "batch_size": list(td.batch_size), "leaves": leaves,
    }


# ----------------------------------------------------------------------------- sweep

def sweep_dead_dirs(root: str | None = None) -> list[str]:
    """Remove private directories of coordinators whose manager process is dead.

    Only entries of ``root`` (default ``tempfile.gettempdir()``) named exactly like ours
    (:data:`DIR_PATTERN`), that are real directories owned by this user, are considered;
    the pid in the name is probed with :func:`shared_td.platform.pid_alive` (a zombie
    is dead). Returns the removed paths.

    Example:
        >>> sweep_dead_dirs()  # doctest: +SKIP
        ['/tmp/shared_td-coord-41234-k2j4h5g6']
    """
    root = root or tempfile.gettempdir()
    removed = []
    try:
        entries = os.listdir(root)
    except OSError:
        return removed
    for entry in entries:
        match = DIR_PATTERN.match(entry)
        if match is None or platform.pid_alive(int(match.group(1))):
            continue
        path = os.path.join(root, entry)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        # never follow a link, never touch another user's directory
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


# ----------------------------------------------------------------------------- server

_REGISTRY: Registry | None = None


def get_registry() -> Registry:
    """This process's registry (created on first use); the manager's ``registry`` typeid."""
    global _REGISTRY
    if _REGISTRY is None:
        _REGISTRY = Registry()
    return _REGISTRY


class CoordinatorManager(managers.BaseManager):
    """A BaseManager whose server listens on a Unix socket in a fresh private directory.

    The address cannot be chosen by the caller: the manager process creates
    ``<tmp>/shared_td-coord-<its pid>-<random suffix>`` (mode 0700, by ``mkdtemp``), listens on
    ``sock`` inside it, and reports that path back through the start pipe.
    """

    @classmethod
    def _run_server(cls, registry, address, authkey, serializer, writer,
                    initializer=None, initargs=()):
        # Replaces BaseManager._run_server (same arguments; ``address`` is ignored).
        def report(address: str) -> None:
            writer.send(address)
            writer.close()

        serve(authkey, report, typeids=registry)


_EXPOSED = ("publish", "attach", "layout", "names", "unpublish", "info", "version", "adopt_cells")


def serve(authkey: bytes, report, typeids=None) -> None:
    """Run the coordinator server in this process until it is shut down or its parent
    dies; ``report(address)`` is called once it listens."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the parent
    parent = os.getppid()
    _raise_descriptor_limit()
    sweep_dead_dirs()
    directory = tempfile.mkdtemp(prefix=f"{DIR_PREFIX}{os.getpid()}-")
    server = None
    try:
        server = managers.Server(typeids or {}, os.path.join(directory, "sock"), authkey, "pickle")
        # Pin the registry under a fixed id with a refcount no client ever drops:
        # clients then need no create/incref/decref, and a forked client that
        # inherited a connection can never unbalance a refcount.
        server.id_to_obj[REGISTRY_ID] = (get_registry(), _EXPOSED, None)
        server.id_to_refcount[REGISTRY_ID] = 1
        report(server.address)
        threading.Thread(target=_watch_parent, args=(server, parent), daemon=True).start()
        server.serve_forever()  # ends with SystemExit after a shutdown request
    finally:
        if server is not None:
            # the listener's own finalizer unlinks the socket: run it before rmtree
            try:
                server.listener.close()
            except OSError:
                pass
        shutil.rmtree(directory, ignore_errors=True)


def serve_embedded() -> None:
    """Entry point of an embedded coordinator (this file run as a script): the authkey
    comes on stdin, the address goes to stdout as one line."""
    authkey = sys.stdin.buffer.read(32)
    sys.stdin.close()

    def report(address: str) -> None:
        sys.stdout.write(address + "\n")
        sys.stdout.flush()

    try:
        serve(authkey, report)
    except SystemExit:
        pass


def _raise_descriptor_limit() -> None:
    # The manager holds one descriptor per adopted cell and segment: use the hard limit.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            pass


# ----------------------------------------------------------------------------- memfds

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


def _watch_parent(server, parent: int) -> None:
    """Stop the server once the process that started it is gone (even by SIGKILL).

    The manager holds anonymous memory for its creator's job; outliving it would keep
    that memory until reboot. ``serve_forever`` then exits cleanly, removing the
    private directory.
    """
    while os.getppid() == parent:
        time.sleep(_PARENT_POLL_S)
    # serve_forever creates stop_event; the parent may have died before it ran
    while getattr(server, "stop_event", None) is None:
        time.sleep(_PARENT_POLL_S)
    server.stop_event.set()


if __name__ == "__main__":
    serve_embedded()
