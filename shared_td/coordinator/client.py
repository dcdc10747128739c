"""The client side of the Coordinator: a handle that starts or reaches a manager process.

A :class:`Coordinator` owns (or, after :meth:`Coordinator.connect`, merely reaches) a
manager process that keeps a registry of published tensordicts. Only small metadata and
pickles *by reference* travel through it; the bulk data stays in files or memfd segments
that every attached process maps.

Example:
    >>> import torch, shared_td
    >>> with shared_td.Coordinator() as coord:
    ...     td = coord.publish("batch", shared_td.TensorDict(obs=torch.zeros(4), batch_size=[4]))
    ...     # in any process: shared_td.attach("batch", address=coord.address, authkey=coord.authkey)
    ...     view = coord.attach("batch")
    ...     view["obs"][0] = 1.0
    ...     td["obs"][0].item(), coord.names(), coord.layout("batch")["version"]
    (1.0, ['batch'], 1)

Connections (see :mod:`shared_td.coordinator.channels`): each process keeps one
connection per coordinator address (re-made after a fork, never shared with the parent),
so after the first call an attach is one round trip plus unpickling (only the tree
around the leaves, for a version this process parsed before: see
:mod:`shared_td.coordinator.published`). A call that finds the
manager gone raises :class:`ConnectionError` naming the address; data already attached is
untouched by that.

Every wait of a call is bounded by its ``timeout``: a manager that is stopped (SIGSTOP, a
debugger) or stalled makes the call raise :class:`CoordinatorTimeoutError` (a
ConnectionError and a TimeoutError) naming the address after about ``timeout`` seconds.
"""
from __future__ import annotations

import os
import time
import warnings
import weakref

from shared_td.containers.unpicklable import check_picklable, naming_unpicklable
from shared_td.coordinator import published, staleness
from shared_td.coordinator.channels import CoordinatorAuthenticationError, call, drop_channel
from shared_td.coordinator.process import ServerProcess
from shared_td.errors import CoordinatorTimeoutError, SegmentUnavailableError
from shared_td.finalizers import Finalizer
from shared_td.storage.anonymous import add_segment_holders
from shared_td.thread_pool import is_thread_refusal, thread_refused

__all__ = ["Coordinator", "CoordinatorAuthenticationError", "CoordinatorTimeoutError", "attach"]

#: Seconds a call waits for the manager (connecting, handshake, answer) before giving up
#: with :class:`CoordinatorTimeoutError`.
DEFAULT_TIMEOUT = 60.0
#: Seconds :meth:`Coordinator.shutdown` waits for a manager to take its stop request
#: (at most the handle's timeout); one that does not is killed.
SHUTDOWN_TIMEOUT = 5.0


class Coordinator:
    """A handle on a coordinator manager process.

    ``Coordinator()`` makes an unstarted handle; :meth:`start` (or ``with``) starts the
    manager, :meth:`shutdown` (or leaving the ``with``) stops it. The manager listens on
    a Unix socket in a private 0700 directory with a random 32-byte :attr:`authkey`, so
    only processes given ``address`` and ``authkey`` can connect, and nothing listens on
    the network. It also stops by itself when the process that started it dies.

    Pickling a handle (e.g. as a worker's argument) sends ``address``, ``authkey`` and
    ``timeout``; the receiver gets a non-owning handle (its :meth:`shutdown` only
    retires the handle). A started handle that is garbage-collected, or still running when this
    process exits, stops its manager (and first shuts its cluster node down).

    Inside ``with coord:`` (and during :meth:`publish`) this coordinator is the one
    that adopts the values of ``memmap_(share_non_tensor=True)`` in this process, so
    they outlive the process that made them (see :meth:`current`).

    The manager runs ``coordinator/server.py`` in a fresh interpreter (a
    :class:`~shared_td.coordinator.process.ServerProcess`; it starts in a fraction of a
    second, 0.2-0.7 s measured on a busy 2-core machine): it imports neither torch nor
    the user's ``__main__`` and inherits nothing of this process.

    Args:
        context: deprecated and ignored (a DeprecationWarning says so): it chose the
            ``multiprocess`` start method of the manager, which now always starts in a
            fresh interpreter.
        timeout: seconds each call may take in all (connecting, the handshake of a new
            connection, the answer) before :class:`CoordinatorTimeoutError`.
        cluster, node, nodes, authkey, stripes: join a cluster of machines at
            :meth:`start` (see :class:`~shared_td.coordinator.cluster.Cluster`;
            ``stripes``: how many gloo connections carry one large transfer).

    Example:
        >>> coord = Coordinator().start()
        >>> len(coord.authkey), coord.address.endswith("/sock")
        (32, True)
        >>> coord.shutdown()
    """

    def __init__(self, *, context: str | None = None, timeout: float = DEFAULT_TIMEOUT,
                 cluster=None, node: int | None = None, nodes: int | None = None, authkey=None,
                 stripes: int | None = None):
        if context is not None:
            warnings.warn(
                "Coordinator(context=...) is deprecated and ignored: the manager always "
                "starts in a fresh interpreter (no fork, no spawn of __main__). Remove "
                "the argument.", DeprecationWarning, stacklevel=2,
            )
        self._timeout = timeout
        self._process: ServerProcess | None = None  # the manager, when this handle started it
        # Across machines (see shared_td.coordinator.cluster): joined by start()
        if cluster is None and (node is not None or nodes is not None or authkey is not None or stripes is not None):
            raise ValueError("node=, nodes=, authkey= and stripes= belong to a cluster: pass cluster= too.")
        self._cluster_args = None if cluster is None else (cluster, node, nodes, authkey, stripes)
        self.cluster = None  # this node's Cluster member once started
        self._address: str | None = None
        self._authkey: bytes | None = None

    @classmethod
    def connect(cls, address: str, authkey: bytes, *, timeout: float = DEFAULT_TIMEOUT) -> "Coordinator":
        """A non-owning handle on the running coordinator at ``address``.

        Raises ConnectionError if it is not running (checked with one round trip),
        CoordinatorAuthenticationError (also a ConnectionError) if it refuses ``authkey``,
        or CoordinatorTimeoutError if it does not answer within ``timeout`` seconds.
        """
        handle = cls(timeout=timeout)
        handle._address, handle._authkey = address, _as_key(authkey)
        call(handle._address, handle._authkey, "names", timeout=timeout)
        return handle

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "Coordinator":
        """Start the manager process; returns self. RuntimeError if already started."""
        if self._address is not None:
            raise RuntimeError("This Coordinator is already started or connected.")
        process = ServerProcess.start(os.urandom(32))
        self._process, self._address, self._authkey = process, process.address, process.authkey
        # collected, or still running at exit: stop it (in the owner only, see ServerProcess),
        # its cluster node first (a weak reference: the node refers to this handle)
        member: list = []
        Finalizer(self, _stop_manager, process, member, min(self._timeout, SHUTDOWN_TIMEOUT))
        if self._cluster_args is not None:
            self._join_cluster(member)
        return self

    def _join_cluster(self, member: list) -> None:
        from shared_td.coordinator.cluster import Cluster

        spec, node, nodes, cluster_key, stripes = self._cluster_args
        try:
            self.cluster = Cluster(spec, node, nodes, authkey=cluster_key, timeout=self._timeout,
                                   coordinator=self, stripes=stripes).start()
            member.append(weakref.ref(self.cluster))
        except BaseException as error:
            self.shutdown()
            if is_thread_refusal(error):
                raise thread_refused(error, f"Cluster node {node}'s start",
                                     "end threads or processes of this user") from error
            raise

    def shutdown(self) -> None:
        """Stop the manager (owner), or make this handle unusable (non-owner: the
        process's connection, shared by its other handles and threads, stays). Idempotent.

        Attached processes keep their mappings: anonymous memory is freed by the kernel
        once the last of them is gone. Works after the manager was killed too: then it
        removes the dead manager's private directory. A stopped (SIGSTOP) or stalled
        manager is killed after at most ``min(timeout, 5)`` seconds.
        """
        address = self._address
        if address is None:
            return
        if self.cluster is not None and self._process is not None and self._process.owned_here():
            self.cluster.shutdown()
        if self._process is not None:
            # the manager stops: this process's connection to it goes. A non-owning handle
            # only forgets its address: the connection is per process, and other handles
            # and threads of this process are using it (audit 21)
            drop_channel(address)
        self._address = None
        if self._process is not None:  # stops it in the owning process only
            self._process.stop(min(self._timeout, SHUTDOWN_TIMEOUT))

    def __enter__(self) -> "Coordinator":
        if self._address is None:
            self.start()
        _IN_USE.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _leave(self)
        self.shutdown()

    @staticmethod
    def current() -> "Coordinator | None":
        """The coordinator that adopts this process's new ``share_non_tensor`` values.

        The innermost ``with coord:`` block (or :meth:`publish` call) of this process;
        else the embedded coordinator this process uses (one it started, or its
        parent's: inherited by fork, or found through the ``SHARED_TD_COORDINATOR``
        environment variable); else None. Never starts one.

        Example:
            >>> with Coordinator() as coord:
            ...     Coordinator.current() is coord
            True
        """
        if _IN_USE:
            return _IN_USE[-1]
        from shared_td.coordinator import ownership  # (it imports this module)

        return ownership.embedded_coordinator(start=False)

    def __reduce__(self):
        # with its timeout=: a worker's calls wait as long as its sender's would
        return _connected, (self.address, self.authkey, self._timeout)

    def __repr__(self) -> str:
        if self._address is None:
            return "Coordinator(not started)"
        owns = self._process is not None and self._process.owned_here()
        return f"Coordinator({self._address}, {'owner' if owns else 'connected'})"

    # ------------------------------------------------------------------ properties
    @property
    def address(self) -> str:
        """Path of the manager's Unix socket."""
        self._check()
        return self._address

    @property
    def authkey(self) -> bytes:
        """The 32 random bytes a process must present to connect (a secret)."""
        self._check()
        return self._authkey

    @property
    def pid(self) -> int:
        """The manager process's pid."""
        return self._call("info")["pid"]

    # ------------------------------------------------------------------ registry
    def publish(self, name: str, td, prefix=None, *, replicate: bool = False, **memmap_kwargs):
        """Memory-map ``td`` in place and publish it as ``name``; returns ``td``.

        ``td.memmap_(prefix, **memmap_kwargs)`` puts the leaves in files under ``prefix``,
        or in anonymous shared memory when ``prefix`` is None; then the manager adopts
        the tensordict (holding its own descriptor on each anonymous segment), so it
        stays attachable after this process exits. Publishing a name again replaces it
        and increases its version.

        With ``replicate=True`` (a Coordinator in a cluster), this node owns ``name``
        and every other node can attach a replica of it (see
        :mod:`shared_td.coordinator.cluster`); ``share_non_tensor=True`` then shares its
        NonTensorData values with every process of every node.

        Example:
            >>> import tempfile
            >>> with tempfile.TemporaryDirectory() as d, Coordinator() as coord:
            ...     td = coord.publish("weights", TensorDict(w=torch.zeros(3)), prefix=os.path.join(d, "weights"))
            ...     td.is_memmap(), coord.names()
            (True, ['weights'])
        """
        if replicate:
            share = memmap_kwargs.pop("share_non_tensor", False)
            if self.cluster is None or prefix is not None or memmap_kwargs:
                raise ValueError(f"publish({name!r}, replicate=True) needs a Coordinator(cluster=...) "
                                 "and anonymous memory (no prefix; of the memmap_ options, only "
                                 "share_non_tensor).")
            return self.cluster.publish(name, td, share_non_tensor=share)  # owner: this node; here too
        _IN_USE.append(self)  # adopts the share_non_tensor values this makes
        try:
            # every non-tensor value is pickled below, after memmap_ changed td in place:
            # checked first, so that an error's "nothing was done" is true (audit 21)
            check_picklable(td, f"publish({name!r})", shared=True)
            # (an error of a non-tensor value that does not pickle names its key)
            with naming_unpicklable(td, f"publish({name!r})", shared=True):
                td.memmap_(prefix, **memmap_kwargs)
                # by reference: file paths and (pid, fd) of memfds, never the bytes; the
                # layout as plain data (the manager imports no container)
                blob, references = published.pickle_by_reference(td)
        finally:
            _leave(self)
        layout, stamp = self._call("publish", name, blob, references, published.layout_of(td))
        staleness.remember(td, name, layout["version"], stamp,
                           _Endpoint(self.address, self.authkey, self._timeout))
        if self.cluster is not None and not self.cluster.holds(name):
            self.cluster.local_names.record(name)  # so that other nodes' attach says where it is
        return td

    def attach(self, name: str):
        """The locked tensordict published as ``name``, over the same memory.

        KeyError (listing the published names) if nothing is published as ``name``.
        With a cluster, a name replicated from another node is this node's replica (made
        and filled on first attach); a name published without ``replicate=True`` on
        another node raises a KeyError that names that node.
        """
        # a shut-down cluster is skipped: its names are left to this Coordinator (a name
        # published here with replicate=True stays attachable; asking the closed cluster
        # raised its RuntimeError, audit 18)
        cluster = self.cluster if self.cluster is not None and not self.cluster._closed else None
        # a replica this node holds: no store round trip (it stays readable without the store)
        if cluster is not None and name not in cluster._owned and (cluster.replicates(name) or cluster.knows(name)):
            return cluster.attach(name)
        try:
            return attach(name, address=self.address, authkey=self.authkey, timeout=self._timeout)
        except KeyError as err:
            if cluster is None:
                raise
            raise cluster.local_names.error(name, err) from err

    # ------------------------------------------------------------------ across machines
    def pull(self, name: str) -> int:
        """Replica <- owner (see :meth:`shared_td.coordinator.cluster.Cluster.pull`)."""
        return self._member().pull(name)

    def push(self, name: str, index) -> None:
        """Rows ``index`` of this node's replica -> the owner (:meth:`Cluster.push`)."""
        return self._member().push(name, index)

    def sync(self, name: str, timeout: float | None = None):
        """Owner -> every replica; a SyncReport (:meth:`Cluster.sync`)."""
        return self._member().sync(name, timeout)

    def version(self, name: str) -> int | None:
        """The version of ``name`` this node holds (:meth:`Cluster.version`)."""
        return self._member().version(name)

    def counter(self, name: str):
        """A counter shared by every node (``fetch_add`` is one ``TCPStore.add``)."""
        return self._member().counter(name)

    def _member(self):
        if self.cluster is None:
            raise RuntimeError("This Coordinator is in no cluster: make it with "
                               "Coordinator(cluster=..., node=..., nodes=...) and start() it.")
        return self.cluster

    def names(self) -> list[str]:
        """The published names, sorted."""
        return self._call("names")

    def layout(self, name: str) -> dict:
        """The layout of ``name``: ``name``, ``version``, ``class``, ``batch_size`` and
        ``leaves`` (each ``key``, ``shape``, ``dtype``, ``where``: a file path,
        ``"anonymous"`` or ``"non-tensor"``). KeyError if unknown."""
        return self._call("layout", name)

    def unpublish(self, name: str) -> None:
        """Forget ``name``. Attached processes keep their mappings; anonymous memory is
        freed when the last one drops it. KeyError if unknown. ValueError for a name
        the cluster holds here (``replicate=True``, or a replica): it would be gone on
        this node only, while the cluster went on syncing and serving it."""
        # keyed on what the cluster holds now (a name it gave up, taken over while this
        # node was stopped, was refused for good: audit 18)
        cluster = self.cluster
        if cluster is not None and cluster.holds(name) and (name in cluster._owned or cluster.replicates(name)):
            held = "owned here" if name in cluster._owned else "a replica"
            raise ValueError(
                f"{name!r} is held by this node's cluster ({held}): unpublish forgets a name on this node "
                "only, so it is refused (the cluster would go on syncing "
                f"and serving {name!r}). Publish {name!r} again (on its owner node) to replace its contents, or "
                "publish under another name; shutting this node's cluster down lets it go.")
        self._call("unpublish", name)
        if self.cluster is not None:
            self.cluster.local_names.forget(name)

    def adopt_slabs(self, slabs: list) -> None:
        """Hold the memfds of shared non-tensor values ``slabs`` (new
        :class:`~shared_td.storage.value_slab.ValueSlab` objects of this process) in the
        manager too, so that their cells stay attachable after this process exits, while
        the manager lives. One round trip; each slab records the manager as a fallback
        holder. Slabs this process dropped since the last call are released in the same trip.
        """
        address = self.address
        released = _RELEASED.pop(address, [])
        adopter = os.getpid()
        try:
            pid, fds = self._call("adopt_cells", adopter, [(slab.fd, slab.key) for slab in slabs], released)
        except BaseException:
            # not told (or not known to be): told with the next adoption instead (telling
            # twice is harmless), else the manager held them until it stopped
            _RELEASED.setdefault(address, [])[:0] = released
            raise
        for slab, fd in zip(slabs, fds):
            slab.add_holders([(pid, fd)])
            # once this process drops the slab, the manager may drop it too (told with
            # the next adoption: a finalizer must not make a round trip); only this
            # process's drop: a fork child's inherited copy is not the adopter's
            Finalizer(slab, _release_later, address, slab.key, adopter)

    def _call(self, method: str, *args):
        self._check()
        return call(self._address, self._authkey, method, *args, timeout=self._timeout)

    def _check(self) -> None:
        if self._address is None:
            raise RuntimeError("This Coordinator is not started (call start(), or use `with`).")


def attach(name: str, *, address: str, authkey: bytes, timeout: float = DEFAULT_TIMEOUT):
    """Attach, in any process of this user, the tensordict published as ``name``.

    Returns a locked tensordict whose leaves map the published memory: writes are seen
    by every process, no bytes are copied. ``authkey`` may be the bytes or their hex.
    Racing a ``publish`` or ``unpublish`` of ``name``, it returns the old or the new
    version whole, or raises KeyError once it is unpublished.

    Raises:
        KeyError: nothing is published as ``name`` (the message lists what is).
        ConnectionError: the coordinator at ``address`` is gone.
        CoordinatorAuthenticationError: it refused ``authkey`` (also a ConnectionError).
        ValueError, TypeError: ``authkey`` is not a key (empty, a str that is not hex).
        CoordinatorTimeoutError: it did not answer within ``timeout`` seconds (its
            manager is stopped or stalled); also a ConnectionError and a TimeoutError.

    Example:
        >>> with Coordinator() as coord:
        ...     _ = coord.publish("batch", TensorDict(x=torch.ones(2)))
        ...     td = attach("batch", address=coord.address, authkey=coord.authkey)
        ...     td["x"].tolist(), td.is_locked
        ([1.0, 1.0], True)
    """
    authkey = _as_key(authkey)
    deadline = time.monotonic() + timeout
    failed_version = None
    while True:
        left = timeout if failed_version is None else max(deadline - time.monotonic(), 0.001)
        blob, references, version, stamp = call(address, authkey, "attach", name, timeout=left)
        try:
            # a version this process parsed already (and still holds) is not parsed again
            td, parsed = published.rebuild((address, name, version), blob, references)
            break
        except SegmentUnavailableError:
            # The references name the manager's descriptors, which it closes when the
            # name is published again or unpublished: between its answer and our
            # opening them through /proc they may be gone (or their numbers reused),
            # although the manager lives. Ask again: a newer version, or a KeyError.
            # The same version failing twice is no such race, so that is raised.
            if version == failed_version or time.monotonic() >= deadline:
                raise
            failed_version = version
    for pid, fd, key, _how in references:
        # the manager holds each segment while the name is published: a segment (or a
        # view of it) this process sends on is received from it once this process exited
        add_segment_holders(key, [(pid, fd)])
    staleness.remember(td, name, version, stamp, _Endpoint(address, authkey, timeout), holds=parsed)
    return td


def _connected(address: str, authkey: bytes, timeout: float) -> Coordinator:
    """What an unpickled Coordinator handle is: :meth:`Coordinator.connect` with the
    sender's ``timeout`` (a keyword argument, which a ``__reduce__`` cannot pass)."""
    return Coordinator.connect(address, authkey, timeout=timeout)


class _Endpoint:
    """Where a tensordict was attached from: what :func:`shared_td.refresh` needs."""

    def __init__(self, address: str, authkey: bytes, timeout: float):
        self.address, self.authkey, self._timeout = address, authkey, timeout

    def attach(self, name: str):
        return attach(name, address=self.address, authkey=self.authkey, timeout=self._timeout)

    def version(self, name: str) -> int:
        return call(self.address, self.authkey, "version", name, timeout=self._timeout)


# Coordinators of this process's active ``with`` blocks and publish calls, innermost
# last (process-wide, not per thread: a worker thread's memmap_ uses the same one).
_IN_USE: list[Coordinator] = []
# address -> keys of slabs this process dropped, released with its next adopt_slabs
_RELEASED: dict[str, list] = {}


def _stop_manager(process: ServerProcess, member: list, timeout: float) -> None:
    """The finalizer of a started Coordinator (collected, or still running at exit): its
    cluster node first, then its manager; both only in the process that started them.
    The node goes first: its threads serve the replicas published on the manager, and a
    node left running at exit aborted the process (see ``cluster_membership``)."""
    node = member[0]() if member else None
    if node is not None and process.owned_here():
        node.shutdown()
    process.stop(timeout)


def innermost() -> Coordinator | None:
    """The coordinator of the innermost ``with coord:`` block or ``publish`` call of this
    process, if any (:meth:`Coordinator.current` without the embedded one)."""
    return _IN_USE[-1] if _IN_USE else None


def _leave(coord: Coordinator) -> None:
    for i in range(len(_IN_USE) - 1, -1, -1):
        if _IN_USE[i] is coord:
            del _IN_USE[i]
            return


def _release_later(address: str, key: tuple[int, int], adopter: int) -> None:
    # a fork child runs its parent's finalizers on its inherited copies: not its release
    # to make (the manager would refuse it anyway, see Registry.adopt_cells)
    if os.getpid() == adopter:
        _RELEASED.setdefault(address, []).append(key)


# the parent's drops are the parent's to tell, never a fork child's
os.register_at_fork(after_in_child=_RELEASED.clear)


def _as_key(authkey) -> bytes:
    """``authkey`` as bytes: bytes-like as is, a str as hex (``Coordinator.authkey.hex()``).
    A ValueError or TypeError that says what a key looks like otherwise (never showing
    the key: it is a secret)."""
    if isinstance(authkey, str):
        try:
            key = bytes.fromhex(authkey)
        except ValueError:
            raise ValueError(
                f"authkey= is a str of {len(authkey)} characters that is not hexadecimal: a "
                "key is the coordinator's Coordinator.authkey, as bytes (32) or as their hex "
                "string (64 characters 0-9a-f, Coordinator.authkey.hex())."
            ) from None
    elif isinstance(authkey, (bytes, bytearray, memoryview)):
        key = bytes(authkey)
    else:  # bytes(5) would be five zero bytes: never a key
        raise TypeError(f"authkey= must be bytes or their hex str (Coordinator.authkey), got a "
                        f"{type(authkey).__name__}.")
    if not key:
        raise ValueError("authkey= is empty: pass the coordinator's Coordinator.authkey (32 "
                         "bytes, or its 64-character hex).")
    return key
