"""Connections to coordinator manager processes: one per process and address, every
wait bounded.

Each process keeps one connection per coordinator address (re-made after a fork, never
shared with the parent), so after the first call a call is one round trip. Every wait of
a call is bounded by its ``timeout`` (one deadline for the whole call): connecting, the
authkey handshake of a new connection, sending, and the answer. A manager that is stopped
(SIGSTOP, a debugger) or stalled makes the call raise :class:`CoordinatorTimeoutError`
naming the address after about ``timeout`` seconds, and the connection is dropped: so
is it after any exception between the request's first byte and its answer's last (a
Ctrl-C, an exception from a signal handler), whose answer would otherwise be read by
the next call. A process out of file descriptors gets an OSError saying so (EMFILE),
never "the coordinator is gone". No process-wide lock is held while talking to a
manager: a thread waiting for a stalled coordinator never holds up calls to another one.

The wire protocol is the one of ``multiprocess.managers`` (what the manager's server
speaks), spoken here directly to the one registry object the server holds under
:data:`~shared_td.coordinator.server.REGISTRY_ID`.
"""
from __future__ import annotations

import ctypes
import errno
import os
import pickle
import socket
import threading
import time

from multiprocess import connection, managers

from shared_td import platform
from shared_td.coordinator.server import DIR_PATTERN, REGISTRY_ID
from shared_td.errors import CoordinatorAuthenticationError, CoordinatorTimeoutError
from shared_td.storage.fd_mapping import descriptor_limits

__all__ = [
    "CoordinatorAuthenticationError", "CoordinatorTimeoutError", "call", "connect", "drop_channel",
    "limit_waits", "time_left",
]


class _Channel:
    """One connection to one manager, used by one thread at a time, in one process."""

    def __init__(self, address: str, authkey: bytes, deadline: float):
        # an RLock for the ownership it checks in C: call() can give it back after an
        # exception without knowing whether its acquire had returned (see call)
        self.lock = threading.RLock()
        # True from just before a request is sent until its whole answer is read: set
        # and cleared by plain attribute stores (no Python call, so no point where a
        # signal handler's exception can land in between), so a connection left out of
        # step is known as such even when the cleanup after an interruption was itself
        # interrupted (a second Ctrl-C at _forget's entry): the next call drops it
        self.in_flight = False
        # True once out of the table (drop_channel): closed by whichever thread holds
        # ``lock`` then (see _close_retired), never under another thread's call
        self.retired = False
        self.conn = connect(address, authkey, deadline)
        try:
            # Serve this connection from the registry object (see server.REGISTRY_ID).
            limit_waits(self.conn, deadline)
            managers.dispatch(self.conn, None, "accept_connection", (REGISTRY_ID,))
        except BaseException:
            self.conn.close()
            raise


def connect(address: str, authkey: bytes, deadline: float) -> connection.Connection:
    """A connection to the manager at ``address`` that passed the authkey handshake,
    made before ``deadline`` (a ``time.monotonic()`` value), else TimeoutError.

    ``multiprocess.connection.Client`` would wait for ever on a manager that does not
    answer: a blocking connect() while its listen backlog is full, then the handshake's
    reads. Here the socket connects with a timeout, and each read and write of the
    handshake is bounded by what is left until the deadline (see :func:`limit_waits`).
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        while True:
            sock.settimeout(time_left(deadline))
            try:
                sock.connect(address)
                break
            except BlockingIOError:
                # A Unix socket's full backlog fails at once instead of waiting: the
                # manager is not accepting, ask again shortly.
                time.sleep(min(0.01, time_left(deadline)))
        sock.setblocking(True)  # the Connection reads and writes the descriptor itself
        conn = connection.Connection(sock.detach())
    finally:
        sock.close()
    try:
        limit_waits(conn, deadline)
        connection.answer_challenge(conn, authkey)
        limit_waits(conn, deadline)
        connection.deliver_challenge(conn, authkey)
    except connection.AuthenticationError as err:
        conn.close()
        raise _refused(address, authkey, err) from err
    except BaseException:
        conn.close()
        raise
    return conn


def _refused(address: str, authkey: bytes, err: BaseException) -> CoordinatorAuthenticationError:
    # never the key itself in the message: it is a secret; its length tells most mix-ups
    return CoordinatorAuthenticationError(
        f"The shared_td coordinator at {address} refused the authkey ({err}): the "
        f"{len(authkey)}-byte key given does not match the one it was started with. Pass "
        "that coordinator's Coordinator.authkey (32 bytes, or its 64-character hex), or "
        "send the Coordinator handle itself to the worker (it pickles with its key)."
    )


def time_left(deadline: float) -> float:
    """Seconds until ``deadline``; TimeoutError once it has passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the deadline passed")
    return left


def limit_waits(conn: connection.Connection, deadline: float) -> None:
    """Make each blocking read and write on ``conn`` wait at most the time left now until
    ``deadline``, then fail with EAGAIN (BlockingIOError), so that a peer that stops
    answering, even in the middle of a message, cannot block us for ever. Two socket
    options, a few microseconds.

    Example:
        >>> a, b = connection.Pipe()
        >>> limit_waits(a, time.monotonic() + 0.05)
        >>> try:
        ...     a.recv_bytes()
        ... except BlockingIOError:
        ...     print("no answer within 0.05 s")
        no answer within 0.05 s
        >>> a.close(); b.close()
    """
    left = time_left(deadline)
    seconds = int(left)
    # a zero timeval would mean "wait for ever": at least one microsecond
    timeval = _TIMEVAL(seconds, max(1, int((left - seconds) * 1e6)))
    # setsockopt(2) on the Connection's own descriptor number, through the C library:
    # never a socket object over it (one would own the descriptor: an exception raised
    # by a signal handler before it was detached left it to close that number again
    # later, by then maybe another thread's file)
    fd = conn.fileno()
    for option in (socket.SO_RCVTIMEO, socket.SO_SNDTIMEO):
        if _LIBC.setsockopt(fd, socket.SOL_SOCKET, option, ctypes.byref(timeval), ctypes.sizeof(timeval)):
            code = ctypes.get_errno()
            raise OSError(code, f"setsockopt on descriptor {fd}: {os.strerror(code)}")


class _TIMEVAL(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_usec", ctypes.c_long)]


_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.setsockopt.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_uint32]
_LIBC.setsockopt.restype = ctypes.c_int


# (pid, address, authkey) -> channel: a wrong key must never ride on a right key's connection
_CHANNELS: dict[tuple[int, str, bytes], _Channel] = {}
# Guards _CHANNELS only, never held while talking to a manager: a thread connecting to a
# stalled coordinator must not hold up threads calling other coordinators. An RLock for
# its C ``_is_owned()``: a signal handler or finalizer that runs while its own thread holds
# it (mid-lookup) must not wait for itself (call() takes a side connection then).
_CHANNELS_LOCK = threading.RLock()


def _after_fork_in_child() -> None:
    # Never talk over a socket the parent also uses: forget the inherited ones (their
    # descriptors close with the objects, in this process only) and a possibly held lock.
    global _CHANNELS_LOCK
    _CHANNELS_LOCK = threading.RLock()
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
    """Close ``channel`` (whose lock the caller holds) and stop handing it out. Cleanup
    only: an interrupted call's connection is never reused whether or not this ran to
    the end (its ``in_flight`` mark stays set, and the next call drops it)."""
    with _CHANNELS_LOCK:
        for key in [k for k, c in _CHANNELS.items() if c is channel]:
            del _CHANNELS[key]
    channel.retired = True
    channel.conn.close()


def drop_channel(address: str) -> None:
    """Stop handing out this process's connections to ``address`` and close them, each
    by the thread that holds its lock: this one if no call is on it, else the thread
    whose call is, when that call ends.

    A connection's descriptor is closed under its lock only: ``Connection.close`` is not
    thread-safe, and a close racing another thread's call (or its own close) closed the
    number twice; by then it might name another thread's new file or socket (audit 21).

    Example:
        >>> drop_channel("/nonexistent/sock")  # no connection: nothing to do
    """
    pid = os.getpid()
    with _CHANNELS_LOCK:
        dropped = [_CHANNELS.pop(k) for k in list(_CHANNELS) if k[:2] == (pid, address)]
    for channel in dropped:
        channel.retired = True  # before the try below: see _close_retired
        _close_retired(channel)


def _close_retired(channel: _Channel) -> None:
    """Close retired ``channel`` if its lock is free now; else its holder will.

    Every thread that takes a channel's lock closes it if it is retired, and every
    thread that gives the lock back looks again once it is free (``call``'s finally):
    whichever thread last sees it retired with the lock free closes it; two threads
    never close it together. A thread inside a call on it (this function run by a
    signal handler or finalizer mid-call) leaves it to that call.
    """
    if channel.lock._is_owned() or not channel.lock.acquire(blocking=False):
        return
    try:
        if not channel.conn.closed:
            channel.conn.close()
    finally:
        channel.lock.release()


def _reach(address: str, authkey: bytes, deadline: float, timeout: float, make) -> _Channel:
    """``make(address, authkey, deadline)``'s channel, its failures said as call() says them."""
    try:
        return make(address, authkey, deadline)
    except (TimeoutError, BlockingIOError) as err:
        raise _stalled(address, timeout, err) from err
    except CoordinatorAuthenticationError:
        raise  # a ConnectionError too, but the coordinator is there: not "gone"
    except (OSError, EOFError) as err:
        raise _connect_error(address, err) from err


def call(address: str, authkey: bytes, method: str, *args, timeout: float):
    """Call ``method`` of the manager's registry; server exceptions are re-raised here.

    Everything (connecting if needed, waiting for another thread's call on the same
    connection, sending, the answer) happens within ``timeout`` seconds, else
    CoordinatorTimeoutError. A call made by a thread that is itself in the middle of a
    call on the same connection (a signal handler or a finalizer that runs mid-call)
    goes over a connection of its own, closed after it.
    """
    if not address or authkey is None:
        raise ValueError("Both address= and authkey= of a running Coordinator are needed.")
    deadline = time.monotonic() + timeout
    # pickled in C before anything is sent: requests are plain data (the Connection's
    # own pickler, dill in Python, took ~16 us of CPU per request here), and a value
    # that does not pickle fails here, with the connection untouched
    request = pickle.dumps((REGISTRY_ID, method, args, {}), pickle.HIGHEST_PROTOCOL)
    while True:
        if _CHANNELS_LOCK._is_owned():
            # this thread was interrupted while it looked up or dropped a connection (a
            # signal handler or finalizer mid-call): the table is not ours to use now
            kind, result = _side_call(address, authkey, request, deadline, timeout)
            break
        channel = _reach(address, authkey, deadline, timeout, _channel)
        if channel.lock._is_owned():
            # this very thread is inside a call on this connection (a signal handler or
            # a finalizer calling the coordinator mid-call): waiting for the lock would
            # wait for itself, and taking it again would interleave two requests
            kind, result = _side_call(address, authkey, request, deadline, timeout)
            break
        try:
            # queued behind another thread's call: wait no longer than our own deadline
            if not channel.lock.acquire(timeout=time_left(deadline)):
                raise TimeoutError("another thread's call on this connection did not end")
        except BaseException as err:
            # An exception raised by a signal handler (Ctrl-C) right after acquire
            # returned would leave the lock held, and every later call on this
            # connection waiting for it. release() checks in C that the lock is ours
            # (RuntimeError if not), with no Python code in between that a handler
            # could interrupt.
            try:
                channel.lock.release()
            except RuntimeError:
                pass  # not taken: the wait timed out or was interrupted
            if isinstance(err, (TimeoutError, BlockingIOError)):
                raise _stalled(address, timeout, err) from err
            raise
        # From here the lock is ours: released on every way out (the finally below)
        try:
            if channel.in_flight or channel.retired or channel.conn.closed:
                # an earlier call was interrupted between its request and the end of its
                # answer (and maybe its cleanup too), or failed and closed it: the answer
                # may still come, so never talk on it again; connect anew. Or it was
                # dropped while this call waited for it: closed here, under its lock.
                _forget(channel)
                continue
            limit_waits(channel.conn, deadline)
            channel.in_flight = True  # a plain store: see _Channel
            channel.conn.send_bytes(request)
            if not channel.conn.poll(time_left(deadline)):
                raise TimeoutError("no answer")
            kind, result = _answer(channel.conn)
            channel.in_flight = False
            break
        except BaseException as err:
            # From the first byte sent until the whole answer is read, the connection
            # is out of step on ANY exception: a timeout, a dead peer, but also a
            # KeyboardInterrupt or an exception raised by a signal handler (SIGALRM test
            # timeouts), SystemExit, a MemoryError, an answer that fails to unpickle.
            # Its answer may still come, and the next call on this connection would
            # read it as its own (attach("y") returning the tensordict of "x"): the
            # in_flight mark already keeps it from being used again; closing it now
            # frees its descriptor at once.
            _forget(channel)
            if isinstance(err, (TimeoutError, BlockingIOError)):  # the deadline passed (EAGAIN)
                raise _stalled(address, timeout, err) from err
            if isinstance(err, (OSError, EOFError)):  # ConnectionError, BrokenPipe...
                raise gone(address, err) from err
            raise
        finally:
            channel.lock.release()
            if channel.retired:  # dropped meanwhile (drop_channel): closed by the lock's holder
                _close_retired(channel)
    if kind == "#RETURN":
        return result
    raise managers.convert_to_error(kind, result)


def _answer(conn) -> tuple:
    """The manager's answer on ``conn``, unpickled in C (the Connection's own ``recv``
    unpickles in Python, through dill: ~10 us more here; the manager pickles with the
    standard pickle, or with dill a value that only it pickles: one format, read by both)."""
    return pickle.loads(conn.recv_bytes())


def _side_call(address: str, authkey: bytes, request: bytes, deadline: float, timeout: float):
    """One request over a one-off connection (never handed out, closed after), within
    the same deadline: for a call nested in this thread's own call on its connection."""
    side = _reach(address, authkey, deadline, timeout, _Channel)
    try:
        limit_waits(side.conn, deadline)
        side.conn.send_bytes(request)
        if not side.conn.poll(time_left(deadline)):
            raise TimeoutError("no answer")
        return _answer(side.conn)
    except (TimeoutError, BlockingIOError) as err:
        raise _stalled(address, timeout, err) from err
    except (OSError, EOFError) as err:
        raise gone(address, err) from err
    finally:
        side.conn.close()


#: errno values of a connection that this process could not make for want of its own
#: resources: the coordinator may be fine, so never "gone" (a caller that replaces a gone
#: coordinator would start a second one and split the ownership of its values).
RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})


def _connect_error(address: str, err: BaseException) -> OSError:
    """What a failure to reach the manager at ``address`` means: this process out of
    descriptors or memory (an OSError with that errno, not a ConnectionError); a manager
    that is alive but closed the connection in the handshake (short of threads or
    memory, it serves no new connection: CoordinatorTimeoutError, as a stalled one);
    else the coordinator is gone (ENOENT: its socket was removed; ECONNREFUSED: nothing
    listens; a reset or EOF in the handshake from a manager that died)."""
    if isinstance(err, OSError) and err.errno in RESOURCE_ERRNOS:
        return out_of_resources(err, f"to connect to the shared_td coordinator at {address}")
    pid = _manager_pid(address)
    if isinstance(err, (EOFError, ConnectionResetError, BrokenPipeError)) and pid and platform.pid_alive(pid):
        return CoordinatorTimeoutError(
            f"The shared_td coordinator at {address} closed a new connection before the handshake ended "
            f"({type(err).__name__}: {err}), and its manager process {pid} is alive: it is short of threads or "
            f"memory{_address_space_limit(pid)} (or this process was stopped past the 5 s a handshake may take). "
            f"Check `ps -o pid,stat,rss,nlwp -p {pid}`; tensordicts already attached stay readable and writable.")
    return gone(address, err)


def _address_space_limit(pid: int) -> str:
    """The manager's own RLIMIT_AS (inherited from the process that started it), as
    words for an error, when it has one: a low one is the likely cause."""
    try:
        with open(f"/proc/{pid}/limits") as limits:
            soft = next((line.split()[3] for line in limits if line.startswith("Max address space")), "unlimited")
    except (OSError, IndexError):
        return ""
    if not soft.isdigit():
        return ""
    return (f"; its RLIMIT_AS is {int(soft) >> 20} MiB (inherited from the process that started it: raise it "
            "there before Coordinator.start)")


def _manager_pid(address: str) -> int | None:
    """The manager's pid, from the name of its socket's directory (None if not ours)."""
    match = DIR_PATTERN.match(os.path.basename(os.path.dirname(address)))
    return int(match.group(1)) if match else None


def out_of_resources(err: OSError, doing: str) -> OSError:
    """An OSError with ``err``'s errno saying that THIS process (not the coordinator)
    ran out of descriptors or memory while ``doing``, with its RLIMIT_NOFILE.

    Example:
        >>> err = out_of_resources(OSError(errno.EMFILE, "Too many open files"), "to connect")
        >>> err.errno == errno.EMFILE, "RLIMIT_NOFILE soft/hard" in str(err)
        (True, True)
    """
    if err.errno in (errno.EMFILE, errno.ENFILE):
        what = descriptor_limits(err.errno)
    else:
        what = "This process is out of memory: free memory, then try again."
    return OSError(err.errno, f"Could not open a descriptor {doing} ({err}); the coordinator itself may be "
                              f"fine. {what}")


def gone(address: str, err: BaseException) -> ConnectionError:
    """The error for a coordinator whose manager is gone (``err``: how it showed)."""
    pid = _manager_pid(address)
    process = f"its manager process {pid}" if pid else "its manager process"
    return ConnectionError(
        f"The shared_td coordinator at {address} is gone ({type(err).__name__}: {err}): "
        f"it was shut down or {process} died. Tensordicts already attached stay readable "
        "and writable; publish again through a new Coordinator."
    )


def _stalled(address: str, timeout: float, err: BaseException) -> CoordinatorTimeoutError:
    pid = _manager_pid(address) or "PID"  # the manager's pid is in its directory name
    return CoordinatorTimeoutError(
        f"The shared_td coordinator at {address} did not answer within {timeout:g} s "
        f"({err}): its manager process {pid} is stopped (SIGSTOP, Ctrl-Z, a debugger) or "
        f"stalled, or (for a new connection) out of file descriptors. Check it with "
        f"`ps -o pid,stat,cmd -p {pid}` (state T: stopped; `kill -CONT {pid}` resumes it) and "
        f"`ls /proc/{pid}/fd | wc -l`, or pass a longer timeout=. Tensordicts already "
        "attached stay readable and writable."
    )


