"""Receiving a descriptor that its sender's ForkingPickler sent as a duplicate, within a bound.

multiprocessing's ForkingPickler (queues, pipes, DataLoader workers) sends a memfd (a
segment, a SharedCounter, a SharedValue) as ``multiprocessing.reduction.DupFd``: unless
a spawning child's arguments carry it, the sender's *resource sharer* thread holds a
duplicate until the receiver connects to it (a Unix socket), passes the authkey
handshake and takes it (SCM_RIGHTS). ``DupFd.detach()`` waits for ever on a sender that
lives but does not answer: one stopped (SIGSTOP, Ctrl-Z, a debugger) or hung, or one
whose resource sharer waits on another receiver that stopped mid-handshake (CPython's
sharer serves one peer at a time, with no timeout). The kernel queues the connection of
a stopped listener, so the receiver then waits in the handshake's first read.
:func:`take_duplicate` makes the same exchange with every step (connect, each read and
write) bounded by :data:`DUPLICATE_TIMEOUT` in all, and :func:`receive_duplicate` then
tries the other routes (the sender's ``/proc``, the holders) before it says which
process did not answer, why, and what to do.

A sender that did not answer in time is not asked again while it stays stopped: the
same process (the start time in ``/proc/<pid>/stat`` recorded then), in state T or t,
looked at on each receive. The other segments of one unpickled tree go to the other
routes at once, instead of each waiting the full bound. A sender that runs again (or a
running one whose resource sharer is stuck) is asked again; one that exited refuses the
connection at once; a pid that now names another process is not skipped. A duplicate
not taken stays held by its sender until the sender exits (as for any pickle never
received); its resource sharer, once resumed, finds our connection closed and prints
that error (a ``BrokenPipeError`` traceback) on the sender's stderr, then serves the
next receiver as before.

A child forked while a take is in flight (a DataLoader worker started by another thread)
closes its copies of that take's descriptors: the sender's resource sharer would
otherwise wait on the connection, which we gave up, for as long as the child lives.
"""
from __future__ import annotations

import errno
import math
import multiprocessing
import multiprocessing.reduction
import os
import socket
import struct
import threading
import time
from multiprocessing import connection, resource_sharer
from typing import Any, Callable

from shared_td import platform
from shared_td.errors import MappingError, SegmentUnavailableError
from shared_td.storage.fd_mapping import descriptor_limits

__all__ = ["DUPLICATE_TIMEOUT", "held_duplicate", "receive_duplicate", "take_duplicate"]

#: Seconds a receiver waits, in all, for a sender's resource sharer to hand over a
#: duplicate descriptor (connect, handshake, the descriptor): the bound of a coordinator
#: call (``shared_td.coordinator.client.DEFAULT_TIMEOUT``, which this layer may not
#: import). A live sender answers in well under a millisecond; one silent this long is
#: stopped or hung. Set this attribute to wait longer or shorter (``float("inf")``: as
#: long as the socket options allow, about 31 years).
DUPLICATE_TIMEOUT = 60.0

# the longest wait that the socket options (a timeval of C longs) take: the bound used for
# a DUPLICATE_TIMEOUT of inf or more
_LONGEST = 1e9

# A Unix socket whose listen backlog is full refuses a non-blocking connect at once
# (EAGAIN) instead of waiting: we ask again after this many seconds (as the coordinator's
# connect does), until the bound.
_CONNECT_RETRY = 0.01

# Each read and write is bounded by the time left, but setting the socket options costs
# two system calls: they are set again only once more than this many seconds (at most a
# hundredth of the bound) passed since they were last set, the most a read may overrun.
_REARM = 0.01

# resource sharer address -> (pid, start time) of the sender that did not answer in time:
# not asked again while that process is stopped (see the module doc)
_SILENT: dict[Any, tuple[int, int]] = {}

# The descriptors of the takes in flight in this process (a connection to a sender's
# resource sharer, the duplicate of it that sets the socket options): a child forked
# meanwhile closes its copies. Each is opened and registered, and unregistered and
# closed, under _FDS_LOCK, which a fork waits for, so that no child gets one that is not
# registered. (Re-entrant: a signal handler that forks inside the lock does not hang.)
_IN_FLIGHT: set[int] = set()
_FDS_LOCK = threading.RLock()


def _close_in_child() -> None:
    global _FDS_LOCK
    for fd in _IN_FLIGHT:
        try:
            os.close(fd)
        except OSError:
            pass
    _IN_FLIGHT.clear()
    _FDS_LOCK = threading.RLock()  # (held by the forking thread: not ours to release)


os.register_at_fork(before=lambda: _FDS_LOCK.acquire(), after_in_parent=lambda: _FDS_LOCK.release(),
                    after_in_child=_close_in_child)


def held_duplicate(fd: int) -> tuple[Any, int]:
    """``multiprocessing.reduction.DupFd(fd)``, and the number of the descriptor that it
    holds in this process until a receiver takes it: the one a receiver opens through
    ``/proc/<pid>/fd`` when it cannot reach the resource sharer. Python unlinks the
    sharer's socket when it starts to exit (a ``Finalize`` of priority 0), before a
    queue's feeder thread has sent what was put last, and the object that owned ``fd``
    (a cell put on the queue and dropped) may have closed it by then: the duplicate stays
    open until it is taken or this process exits. For a spawning child's arguments (which
    carry the descriptor itself) it is ``fd``.

    Example:
        >>> fd = os.memfd_create("example")
        >>> duplicate, held = held_duplicate(fd)
        >>> os.path.samestat(os.fstat(held), os.fstat(fd)), held != fd
        (True, True)
        >>> mine = take_duplicate(duplicate)  # (taken: the held one is closed)
        >>> os.close(mine); os.close(fd)
    """
    if multiprocessing.context.get_spawning_popen() is not None:
        return multiprocessing.reduction.DupFd(fd), fd
    held = os.dup(fd)
    duplicate = resource_sharer.DupFd.__new__(resource_sharer.DupFd)
    # what DupFd.__init__ registers, with the number of its duplicate known to us
    duplicate._id = resource_sharer._resource_sharer.register(
        lambda conn, pid: multiprocessing.reduction.send_handle(conn, held, pid), lambda: os.close(held))
    return duplicate, held


def take_duplicate(duplicate, pid: int | None = None) -> int:
    """The descriptor that ``duplicate`` (a ``DupFd`` unpickled here; sent by process
    ``pid`` if known) stands for; the caller owns it. A ``resource_sharer.DupFd`` is
    taken from its sender within :data:`DUPLICATE_TIMEOUT` seconds, else
    ``TimeoutError`` (at once if that sender did not answer in time before and is still
    stopped); any other kind (a spawning child's, whose descriptor came with its
    arguments) is detached as it is.

    Example:
        >>> from multiprocessing import resource_sharer
        >>> fd = os.memfd_create("example")
        >>> mine = take_duplicate(resource_sharer.DupFd(fd))  # (our own resource sharer)
        >>> os.path.samestat(os.fstat(mine), os.fstat(fd))
        True
        >>> os.close(mine); os.close(fd)
    """
    if not isinstance(duplicate, resource_sharer.DupFd):
        return duplicate.detach()
    address, key = duplicate._id  # (what DupFd.detach() connects to and asks for)
    timeout = _timeout()
    silent = _SILENT.get(address)
    if silent is not None:
        if _still_stopped(*silent):
            raise TimeoutError(f"it did not hand over a descriptor within {timeout:g} s and is still stopped "
                               "(not asked again)")
        _SILENT.pop(address, None)  # (resumed, exited, or its pid names another process now)
    deadline = time.monotonic() + timeout
    try:
        return _take(address, key, deadline, timeout)
    except BlockingIOError as err:  # (a read or write waited until its socket option's bound)
        if time.monotonic() < deadline - _CONNECT_RETRY:
            # not the bound: a read failed at once (a non-blocking socket): not a silence
            raise OSError(errno.EAGAIN, f"the exchange with its resource sharer failed: {err}") from err
        _remember_silent(address, pid)
        raise TimeoutError(f"it did not hand over the descriptor within {timeout:g} s") from err
    except TimeoutError as err:
        _remember_silent(address, pid)
        raise TimeoutError(f"it did not hand over the descriptor within {timeout:g} s") from err


def sender_stopped(pid) -> bool:
    """Whether process ``pid`` is stopped (SIGSTOP, Ctrl-Z: state T) or stopped by a
    debugger (t); false if gone or ``None``.

    Example:
        >>> sender_stopped(os.getpid()), sender_stopped(None)
        (False, False)
    """
    stat = _proc_stat(pid)
    return stat is not None and stat[0] in (b"T", b"t")


def _proc_stat(pid) -> tuple[bytes, int] | None:
    """(state, start time) of process ``pid`` from ``/proc/<pid>/stat`` (fields 3 and 22;
    the start time in clock ticks after boot tells a reused pid), None if there is none."""
    if not isinstance(pid, int):
        return None
    try:
        fields = platform.process_stat(pid)
        return fields[0], int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def _remember_silent(address, pid) -> None:
    """Process ``pid``, whose resource sharer at ``address`` did not answer in time, is not
    asked again while it stays stopped (see :func:`_still_stopped`)."""
    stat = _proc_stat(pid)
    if stat is not None:  # (none: gone, or not known: nothing to skip)
        _SILENT[address] = (pid, stat[1])


def _still_stopped(pid: int, started: int) -> bool:
    """Whether process ``pid``, which started at ``started``, still lives and is stopped:
    false for another process that now has its pid."""
    stat = _proc_stat(pid)
    return stat is not None and stat[0] in (b"T", b"t") and stat[1] == started


def _timeout() -> float:
    """:data:`DUPLICATE_TIMEOUT`, checked: a number of seconds > 0, at most :data:`_LONGEST`."""
    try:
        timeout = float(DUPLICATE_TIMEOUT)
    except (TypeError, ValueError):
        timeout = math.nan
    if not timeout > 0:  # (NaN too)
        raise ValueError("shared_td.storage.duplicates.DUPLICATE_TIMEOUT is the number of seconds a receiver "
                         "waits for a sender's resource sharer: a number > 0 (float('inf') for as long as "
                         f"possible), not {DUPLICATE_TIMEOUT!r}")
    return min(timeout, _LONGEST)


class _BoundedConnection(connection.Connection):
    """A Connection whose every read and write first calls ``limit()`` (which bounds the
    socket's wait by the time left, see :func:`_bound`): the handshake's messages take
    two reads each, and one bound per message let a slow sender take twice the time."""

    limit: Callable[[], None]

    def _send(self, buf, write=None):
        super()._send(buf, lambda handle, data: (self.limit(), os.write(handle, data))[1])

    def _recv(self, size, read=None):
        return super()._recv(size, lambda handle, wanted: (self.limit(), os.read(handle, wanted))[1])


def _take(address, key: int, deadline: float, timeout: float) -> int:
    """``resource_sharer.DupFd.detach()``'s exchange, each step bounded by ``deadline``
    (``timeout`` seconds after it began); its descriptors registered in :data:`_IN_FLIGHT`."""
    with _FDS_LOCK:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        _IN_FLIGHT.add(sock.fileno())
    fds, opened = [sock.fileno()], [sock]  # (what to unregister and close at the end)
    try:
        while True:
            sock.settimeout(_time_left(deadline))
            try:
                sock.connect(address)
                break
            except BlockingIOError:
                time.sleep(min(_CONNECT_RETRY, _time_left(deadline)))
        sock.setblocking(True)  # the Connection reads and writes the descriptor itself
        # the socket options go through a duplicate descriptor of our own (the options are
        # the socket's, shared by both), never through a socket object over conn's number
        with _FDS_LOCK:
            options = socket.fromfd(sock.fileno(), socket.AF_UNIX, socket.SOCK_STREAM)
            _IN_FLIGHT.add(options.fileno())
        fds.append(options.fileno())
        opened.append(options)
        # fromfd's socket object takes socket.getdefaulttimeout(): one set (an application's
        # socket.setdefaulttimeout) makes it non-blocking, and O_NONBLOCK is the open file
        # description's, which conn shares: every read would fail at once. Blocking reads,
        # bounded by the socket options instead:
        options.setblocking(True)
        conn = _BoundedConnection(sock.detach())
        opened[0] = conn
        slack, armed = min(_REARM, timeout / 100), [-math.inf]

        def limit() -> None:
            now = time.monotonic()
            if now - armed[0] > slack:
                _bound(options, deadline)
                armed[0] = now

        conn.limit = limit
        authkey = multiprocessing.current_process().authkey
        connection.answer_challenge(conn, authkey)
        connection.deliver_challenge(conn, authkey)
        conn.send((key, os.getpid()))
        limit()
        return multiprocessing.reduction.recvfds(options, 1)[0]
    finally:
        with _FDS_LOCK:
            _IN_FLIGHT.difference_update(fds)
            for each in opened:
                each.close()


def _time_left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the deadline passed")
    return left


def _bound(sock: socket.socket, deadline: float) -> None:
    """Each blocking read and write on ``sock`` waits at most the time left until
    ``deadline``, then fails with EAGAIN (BlockingIOError)."""
    left = _time_left(deadline)
    seconds = int(left)
    # a zero timeval would mean "wait for ever": at least one microsecond
    timeval = struct.pack("@ll", seconds, max(1, int((left - seconds) * 1e6)))
    for option in (socket.SO_RCVTIMEO, socket.SO_SNDTIMEO):
        sock.setsockopt(socket.SOL_SOCKET, option, timeval)


def _why_silent(pid: int) -> str:
    """Why process ``pid``, which lives, did not hand over a duplicate, and what to do."""
    if sender_stopped(pid):
        return (f"it is stopped (SIGSTOP, Ctrl-Z, a debugger). Resume it (`kill -CONT {pid}`) before its "
                "receivers read what it sent.")
    # (CPython's resource sharer serves one peer at a time and waits on it for ever)
    return ("it is running, so its resource sharer thread is hung, or waits on another receiver that "
            "connected to it and stopped answering (a stopped or hung process that unpickles what "
            f"process {pid} sent). Resume or end that receiver, or send through a Coordinator.")


# what taking the sender's duplicate raises when that is not possible: its process (and
# resource sharer) gone, or the receiver not of its family (another authkey)
_DUPLICATE_LOST = (OSError, EOFError, multiprocessing.AuthenticationError)


def receive_duplicate(duplicate, key: tuple[int, int], nbytes: int, pid: int, *, what: str,
                      cached: Callable[[tuple], Any], adopt: Callable[[int], Any],
                      fallback: Callable[[], Any]) -> Any:
    """Unpickle a memfd that process ``pid`` sent through ForkingPickler as
    ``multiprocessing.reduction.DupFd``: take the duplicate (always, so that the sender's
    resource sharer lets it go); ``cached(key)`` if this process has that memory already
    (the duplicate closed), else check that it is the memory ``key`` with at least
    ``nbytes`` bytes, give it this process's own open file description (close-on-exec,
    as the ``/proc`` route opens: the duplicate shares the sender's, and a lock on an
    open file description, a ByteLock, does not exclude another holder of the same one)
    and return ``adopt(fd)``, which owns it. ``fallback()`` (the ``/proc`` route, which
    names the user ``what`` and its fix) when the duplicate cannot be taken; a sender
    that does not answer within :data:`DUPLICATE_TIMEOUT` (stopped, hung) is a
    :class:`SegmentUnavailableError` naming it, and why, when the fallback fails too;
    its duplicate stays held by the sender until it exits (as any pickle never
    received). For every user of memfds sent so (segments, SharedCounter, SharedValue)."""
    try:
        new_fd = take_duplicate(duplicate, pid)
    except TimeoutError as err:  # (before _DUPLICATE_LOST: an OSError too)
        try:
            return fallback()
        except SegmentUnavailableError as gone:
            raise SegmentUnavailableError(
                f"The {what} (inode {key[1]}) sent by process {pid} could not be received: process "
                f"{pid} lives but {err} (shared_td.storage.duplicates.DUPLICATE_TIMEOUT): "
                f"{_why_silent(pid)} The other routes failed too: {gone}"
            ) from err
    except _DUPLICATE_LOST as err:
        try:
            return fallback()
        except SegmentUnavailableError as gone:
            raise gone from err
    except RuntimeError as err:
        if "ancdata" not in str(err):
            raise
        # recvfds: the kernel dropped the descriptor sent, as this process could take
        # no more (RLIMIT_NOFILE): the shortage is ours. The /proc route may still work
        # (the receiving socket is closed by now); if the sender no longer holds it, the
        # fault is still this process's limit, not the sender's exit
        try:
            return fallback()
        except SegmentUnavailableError:
            raise MappingError(errno.EMFILE, (
                f"Cannot receive the {what} (inode {key[1]}) that process {pid} sent: the "
                f"descriptor it sent was dropped, this process could take no more. "
                f"{descriptor_limits(errno.EMFILE)}")) from err
    found = cached(key)
    if found is not None:
        os.close(new_fd)
        return found
    try:
        st = os.fstat(new_fd)
        if (st.st_dev, st.st_ino) != key or st.st_size < nbytes:
            raise SegmentUnavailableError(
                f"The descriptor received for the {what} (inode {key[1]}) sent by process {pid} "
                f"names another file (inode {st.st_ino}, {st.st_size} bytes): refused. The "
                "sender's resource sharer answered for another object (was the sender forked "
                "without multiprocessing?); send it from a multiprocessing process, or publish it "
                "through a Coordinator."
            )
        platform.reopen_description(new_fd)
    except BaseException:
        os.close(new_fd)
        raise
    return adopt(new_fd)
