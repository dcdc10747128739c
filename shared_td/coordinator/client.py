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

Connections: each process keeps one connection per coordinator address (re-made after a
fork, never shared with the parent), so after the first call an attach is one round trip
plus unpickling. A call that finds the manager gone raises :class:`ConnectionError`
naming the address; data already attached is untouched by that.

Every wait of a call is bounded by its ``timeout`` (one deadline for the whole call):
connecting, the authkey handshake of a new connection, sending, and the answer. A manager
that is stopped (SIGSTOP, a debugger) or stalled makes the call raise
:class:`CoordinatorTimeoutError` (a ConnectionError and a TimeoutError) naming the address
after about ``timeout`` seconds, and the connection is dropped. No process-wide lock is held
while talking to a manager: a thread waiting for a stalled coordinator never holds up calls
to another one.
"""
from __future__ import annotations

import os
import pickle
import shutil
import socket
import struct
import subprocess
import threading
import time

import multiprocess
from multiprocess import connection, managers

from shared_td.coordinator import staleness
from shared_td.coordinator.server import DIR_PATTERN, REGISTRY_ID, CoordinatorManager, sweep_dead_dirs

__all__ = ["Coordinator", "CoordinatorTimeoutError", "attach"]

#: Seconds a call waits for the manager (connecting, handshake, answer) before giving up
#: with :class:`CoordinatorTimeoutError`.
DEFAULT_TIMEOUT = 60.0
#: Seconds :meth:`Coordinator.shutdown` waits for a manager to take its stop request
#: (at most the handle's timeout); one that does not is killed.
SHUTDOWN_TIMEOUT = 5.0


class CoordinatorTimeoutError(ConnectionError, TimeoutError):
    """A coordinator did not answer within the caller's timeout: its manager process is
    stopped (SIGSTOP, a debugger) or stalled. Both a ConnectionError (the call failed to
    reach the coordinator) and a TimeoutError (it may answer again later)."""


class Coordinator:
    """A handle on a coordinator manager process.

    ``Coordinator()`` makes an unstarted handle; :meth:`start` (or ``with``) starts the
    manager, :meth:`shutdown` (or leaving the ``with``) stops it. The manager listens on
    a Unix socket in a private 0700 directory with a random 32-byte :attr:`authkey`, so
    only processes given ``address`` and ``authkey`` can connect, and nothing listens on
    the network. It also stops by itself when the process that started it dies.

    Pickling a handle (e.g. as a worker's argument) sends ``address`` and ``authkey``;
    the receiver gets a non-owning handle (its :meth:`shutdown` only disconnects).

    Inside ``with coord:`` (and during :meth:`publish`) this coordinator is the one
    that adopts the values of ``memmap_(share_non_tensor=True)`` in this process, so
    they outlive the process that made them (see :meth:`current`).

    Args:
        context: the ``multiprocess`` start method of the manager (``"fork"``,
            ``"spawn"``, ``"forkserver"``; default: multiprocess's default).
        timeout: seconds each call may take in all (connecting, the handshake of a new
            connection, the answer) before :class:`CoordinatorTimeoutError`.

    Example:
        >>> coord = Coordinator().start()
        >>> len(coord.authkey), coord.address.endswith("/sock")
        (32, True)
        >>> coord.shutdown()
    """

    def __init__(self, *, context: str | None = None, timeout: float = DEFAULT_TIMEOUT,
                 cluster=None, node: int | None = None, nodes: int | None = None, authkey=None):
        self._context = context
        self._timeout = timeout
        # Across machines (see shared_td.coordinator.cluster): joined by start()
        if cluster is None and (node is not None or nodes is not None or authkey is not None):
            raise ValueError("node=, nodes= and authkey= belong to a cluster: pass cluster= too.")
        self._cluster_args = None if cluster is None else (cluster, node, nodes, authkey)
        self.cluster = None  # this node's Cluster member once started
        self._manager: CoordinatorManager | None = None
        self._popen: subprocess.Popen | None = None  # an embedded coordinator's process
        self._address: str | None = None
        self._authkey: bytes | None = None
        # A fork child inherits this object without being the owner: ownership is the
        # pid that started the manager, never a flag copied along.
        self._owner_pid = os.getpid()

    @classmethod
    def connect(cls, address: str, authkey: bytes, *, timeout: float = DEFAULT_TIMEOUT) -> "Coordinator":
        """A non-owning handle on the running coordinator at ``address``.

        Raises ConnectionError if it is not running (checked with one round trip), or
        CoordinatorTimeoutError if it does not answer within ``timeout`` seconds.
        """
        handle = cls(timeout=timeout)
        handle._owner_pid = None
        handle._address, handle._authkey = address, _as_key(authkey)
        _call(handle._address, handle._authkey, "names", timeout=timeout)
        return handle

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "Coordinator":
        """Start the manager process; returns self. RuntimeError if already started."""
        if self._address is not None:
            raise RuntimeError("This Coordinator is already started or connected.")
        sweep_dead_dirs()  # leftovers of coordinators killed earlier
        authkey = os.urandom(32)
        ctx = multiprocess.get_context(self._context)
        manager = CoordinatorManager(authkey=authkey, ctx=ctx)
        # The manager's finalizer (shutdown(), and at exit) connects to send its stop
        # request: with a deadline, so a stopped manager is killed instead of waited for.
        manager._Client = _StopRequestClient(min(self._timeout, SHUTDOWN_TIMEOUT))
        manager.start()
        self._manager, self._address, self._authkey = manager, manager.address, authkey
        if self._cluster_args is not None:
            self._join_cluster()
        return self

    def _join_cluster(self) -> None:
        from shared_td.coordinator.cluster import Cluster

        spec, node, nodes, cluster_key = self._cluster_args
        try:
            self.cluster = Cluster(spec, node, nodes, authkey=cluster_key, timeout=self._timeout,
                                   coordinator=self).start()
        except BaseException:
            self.shutdown()
            raise

    def shutdown(self) -> None:
        """Stop the manager (owner) or just disconnect (non-owner). Idempotent.

        Attached processes keep their mappings: anonymous memory is freed by the kernel
        once the last of them is gone. Works after the manager was killed too: then it
        removes the dead manager's private directory.
        """
        address, manager = self._address, self._manager
        if address is None:
            return
        if self.cluster is not None and self._owns():
            self.cluster.shutdown()
        _drop_channel(address)
        self._address = None
        if not self._owns():
            return
        if self._popen is not None:
            self._stop_embedded(address)
        if manager is None:
            return
        self._manager = None
        process = manager._process
        manager.shutdown()  # asks the server to stop, joins, terminates if it must
        if process.is_alive():
            process.kill()
            process.join(5)
        if not process.is_alive():
            _remove_private_dir(address)
            process.close()  # releases the sentinel descriptor now

    def _stop_embedded(self, address: str) -> None:
        popen, self._popen = self._popen, None
        try:
            deadline = time.monotonic() + min(self._timeout, SHUTDOWN_TIMEOUT)
            conn = _connect(address, self._authkey, deadline)
            try:
                _limit_waits(conn, deadline)
                managers.dispatch(conn, None, "shutdown")
            finally:
                conn.close()
            popen.wait(SHUTDOWN_TIMEOUT)
        except (OSError, EOFError, subprocess.TimeoutExpired):
            popen.kill()
            popen.wait(5)
        _remove_private_dir(address)

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
        from shared_td.coordinator import ownership

        return ownership.embedded_coordinator(start=False)

    def __reduce__(self):
        return Coordinator.connect, (self.address, self.authkey)

    def __repr__(self) -> str:
        state = self._address or "not started"
        return f"Coordinator({state}, {'owner' if self._owns() else 'connected'})"

    def _owns(self) -> bool:
        return self._owner_pid == os.getpid()

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

        Example:
            >>> with Coordinator() as coord:                     # doctest: +SKIP
            ...     coord.publish("weights", td, prefix="/data/weights")
        """
        if replicate:
            if self.cluster is None or prefix is not None or memmap_kwargs:
                raise ValueError(f"publish({name!r}, replicate=True) needs a Coordinator(cluster=...) "
                                 "and anonymous memory (no prefix, no memmap_ options).")
            return self.cluster.publish(name, td)  # owner: this node; publishes here too
        _IN_USE.append(self)  # adopts the share_non_tensor values this makes
        try:
            td.memmap_(prefix, **memmap_kwargs)
        finally:
            _leave(self)
        # by reference: file paths and (pid, fd) of segments, never the bytes
        _layout, stamp = self._call("publish", name, pickle.dumps(td))
        staleness.remember(td, name, _layout["version"], stamp,
                           _Endpoint(self.address, self.authkey, self._timeout))
        return td

    def attach(self, name: str):
        """The locked tensordict published as ``name``, over the same memory.

        KeyError (listing the published names) if nothing is published as ``name``.
        With a cluster, a name replicated from another node is this node's replica (made
        and filled on first attach).
        """
        if self.cluster is not None and name not in self.cluster._owned and self.cluster.knows(name):
            return self.cluster.attach(name)
        return attach(name, address=self.address, authkey=self.authkey, timeout=self._timeout)

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
        freed when the last one drops it. KeyError if unknown."""
        self._call("unpublish", name)

    def _call(self, method: str, *args):
        self._check()
        return _call(self._address, self._authkey, method, *args, timeout=self._timeout)

    def _check(self) -> None:
        if self._address is None:
            raise RuntimeError("This Coordinator is not started (call start(), or use `with`).")


def attach(name: str, *, address: str, authkey: bytes, timeout: float = DEFAULT_TIMEOUT):
    """Attach, in any process of this user, the tensordict published as ``name``.

    Returns a locked tensordict whose leaves map the published memory: writes are seen
    by every process, no bytes are copied. ``authkey`` may be the bytes or their hex.

    Raises:
        KeyError: nothing is published as ``name`` (the message lists what is).
        ConnectionError: the coordinator at ``address`` is gone.
        CoordinatorTimeoutError: it did not answer within ``timeout`` seconds (its
            manager is stopped or stalled); also a ConnectionError and a TimeoutError.

    Example:
        >>> td = attach("batch", address=addr, authkey=key)   # doctest: +SKIP
    """
    authkey = _as_key(authkey)
    blob, version, stamp = _call(address, authkey, "attach", name, timeout=timeout)
    td = pickle.loads(blob)
    staleness.remember(td, name, version, stamp, _Endpoint(address, authkey, timeout))
    return td


class _Endpoint:
    """Where a tensordict was attached from: what :func:`shared_td.refresh` needs."""

    def __init__(self, address: str, authkey: bytes, timeout: float):
        self.address, self.authkey, self._timeout = address, authkey, timeout

    def attach(self, name: str):
        return attach(name, address=self.address, authkey=self.authkey, timeout=self._timeout)

    def _call(self, method: str, *args):
        return _call(self.address, self.authkey, method, *args, timeout=self._timeout)


# Coordinators of this process's active ``with`` blocks and publish calls, innermost
# last (process-wide, not per thread: a worker thread's memmap_ uses the same one).
_IN_USE: list[Coordinator] = []


def _leave(coord: Coordinator) -> None:
    for i in range(len(_IN_USE) - 1, -1, -1):
        if _IN_USE[i] is coord:
            del _IN_USE[i]
            return


def _remove_private_dir(address: str) -> None:
    directory = os.path.dirname(address)
    if DIR_PATTERN.match(os.path.basename(directory)):
        shutil.rmtree(directory, ignore_errors=True)


# ---------------------------------------------------------------------- connections

class _Channel:
    """One connection to one manager, used by one thread at a time, in one process."""

    def __init__(self, address: str, authkey: bytes, deadline: float):
        self.lock = threading.Lock()
        self.conn = _connect(address, authkey, deadline)
        try:
            # Serve this connection from the registry object (see server.REGISTRY_ID).
            _limit_waits(self.conn, deadline)
            managers.dispatch(self.conn, None, "accept_connection", (REGISTRY_ID,))
        except BaseException:
            self.conn.close()
            raise


def _connect(address: str, authkey: bytes, deadline: float) -> connection.Connection:
    """A connection to the manager at ``address`` that passed the authkey handshake,
    made before ``deadline`` (a ``time.monotonic()`` value), else TimeoutError.

    ``multiprocess.connection.Client`` would wait for ever on a manager that does not
    answer: a blocking connect() while its listen backlog is full, then the handshake's
    reads. Here the socket connects with a timeout, and each read and write of the
    handshake is bounded by what is left until the deadline (see :func:`_limit_waits`).
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        while True:
            sock.settimeout(_time_left(deadline))
            try:
                sock.connect(address)
                break
            except BlockingIOError:
                # A Unix socket's full backlog fails at once instead of waiting: the
                # manager is not accepting, ask again shortly.
                time.sleep(min(0.01, _time_left(deadline)))
        sock.setblocking(True)  # the Connection reads and writes the descriptor itself
        conn = connection.Connection(sock.detach())
    finally:
        sock.close()
    try:
        _limit_waits(conn, deadline)
        connection.answer_challenge(conn, authkey)
        _limit_waits(conn, deadline)
        connection.deliver_challenge(conn, authkey)
    except BaseException:
        conn.close()
        raise
    return conn


def _time_left(deadline: float) -> float:
    """Seconds until ``deadline``; TimeoutError once it has passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the deadline passed")
    return left


def _limit_waits(conn: connection.Connection, deadline: float) -> None:
    """Make each blocking read and write on ``conn`` wait at most the time left now until
    ``deadline``, then fail with EAGAIN (BlockingIOError), so that a peer that stops
    answering, even in the middle of a message, cannot block us for ever. Two socket
    options, a few microseconds."""
    left = _time_left(deadline)
    seconds = int(left)
    # a zero timeval would mean "wait for ever": at least one microsecond
    timeval = struct.pack("@ll", seconds, max(1, int((left - seconds) * 1e6)))
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, 0, conn.fileno())
    try:
        if socket.getdefaulttimeout() is not None:
            sock.setblocking(True)  # a socket object made the descriptor non-blocking
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
    finally:
        sock.detach()  # the descriptor stays the Connection's


class _StopRequestClient:
    """``BaseManager._Client`` for the stop request of the manager's finalizer: a
    connection made within ``timeout`` seconds (the finalizer then terminates and
    kills a manager that did not stop)."""

    def __init__(self, timeout: float):
        self.timeout = timeout

    def __call__(self, address: str, authkey: bytes) -> connection.Connection:
        deadline = time.monotonic() + self.timeout
        conn = _connect(address, authkey, deadline)
        _limit_waits(conn, deadline)
        return conn


# (pid, address, authkey) -> channel: a wrong key must never ride on a right key's connection
_CHANNELS: dict[tuple[int, str, bytes], _Channel] = {}
# Guards _CHANNELS only, never held while talking to a manager: a thread connecting to a
# stalled coordinator must not hold up threads calling other coordinators.
_CHANNELS_LOCK = threading.Lock()


def _after_fork_in_child() -> None:
    # Never talk over a socket the parent also uses: forget the inherited ones (their
    # descriptors close with the objects, in this process only) and a possibly held lock.
    global _CHANNELS_LOCK
    _CHANNELS_LOCK = threading.Lock()
    _CHANNELS.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _channel(address: str, authkey: bytes, deadline: float) -> _Channel:
    key = (os.getpid(), address, authkey)
    with _CHANNELS_LOCK:
        channel = _CHANNELS.get(key)
    if channel is not None:
        return channel
    # Connect with no lock held; two threads may both connect, the first one stored wins.
    channel = _Channel(address, authkey, deadline)
    with _CHANNELS_LOCK:
        stored = _CHANNELS.setdefault(key, channel)
    if stored is not channel:
        channel.conn.close()
    return stored


def _forget(channel: _Channel) -> None:
    """Close ``channel`` (whose lock the caller holds) and stop handing it out."""
    with _CHANNELS_LOCK:
        for key in [k for k, c in _CHANNELS.items() if c is channel]:
            del _CHANNELS[key]
    channel.conn.close()


def _drop_channel(address: str) -> None:
    pid = os.getpid()
    with _CHANNELS_LOCK:
        dropped = [_CHANNELS.pop(k) for k in list(_CHANNELS) if k[:2] == (pid, address)]
    for channel in dropped:
        channel.conn.close()


def _call(address: str, authkey: bytes, method: str, *args, timeout: float):
    """Call ``method`` of the manager's registry; server exceptions are re-raised here.

    Everything (connecting if needed, waiting for another thread's call on the same
    connection, sending, the answer) happens within ``timeout`` seconds, else
    CoordinatorTimeoutError.
    """
    if not address or authkey is None:
        raise ValueError("Both address= and authkey= of a running Coordinator are needed.")
    deadline = time.monotonic() + timeout
    while True:
        try:
            channel = _channel(address, authkey, deadline)
            # queued behind another thread's call: wait no longer than our own deadline
            if not channel.lock.acquire(timeout=_time_left(deadline)):
                raise TimeoutError("another thread's call on this connection did not end")
        except (TimeoutError, BlockingIOError) as err:
            raise _stalled(address, timeout, err) from err
        except (OSError, EOFError) as err:
            raise _gone(address, err) from err
        if not channel.conn.closed:
            break
        channel.lock.release()  # another thread's call failed and closed it: connect anew
    try:
        _limit_waits(channel.conn, deadline)
        channel.conn.send((REGISTRY_ID, method, args, {}))
        if not channel.conn.poll(_time_left(deadline)):
            raise TimeoutError("no answer")
        kind, result = channel.conn.recv()
    except (TimeoutError, BlockingIOError) as err:  # the deadline passed (EAGAIN: a read/write's)
        _forget(channel)  # an answer may still come: never read it as the next call's
        raise _stalled(address, timeout, err) from err
    except (OSError, EOFError) as err:  # ConnectionError, BrokenPipe...
        _forget(channel)
        raise _gone(address, err) from err
    finally:
        channel.lock.release()
    if kind == "#RETURN":
        return result
    raise managers.convert_to_error(kind, result)


def _gone(address: str, err: BaseException) -> ConnectionError:
    return ConnectionError(
        f"The shared_td coordinator at {address} is gone ({type(err).__name__}: {err}): "
        "it was shut down or its process died. Tensordicts already attached stay readable "
        "and writable; publish again through a new Coordinator."
    )


def _stalled(address: str, timeout: float, err: BaseException) -> CoordinatorTimeoutError:
    match = DIR_PATTERN.match(os.path.basename(os.path.dirname(address)))
    pid = match.group(1) if match else "PID"  # the manager's pid is in its directory name
    return CoordinatorTimeoutError(
        f"The shared_td coordinator at {address} did not answer within {timeout:g} s "
        f"({err}): its manager process {pid} is stopped (SIGSTOP, Ctrl-Z, a debugger) or "
        f"stalled. Check it with `ps -o pid,stat,cmd -p {pid}` (state T: stopped; "
        f"`kill -CONT {pid}` resumes it), or pass a longer timeout=. Tensordicts already "
        "attached stay readable and writable."
    )


def _as_key(authkey) -> bytes:
    if isinstance(authkey, str):
        return bytes.fromhex(authkey)
    return bytes(authkey)
