"""Receiving a descriptor that its sender's ForkingPickler sent as a duplicate, within a bound.

multiprocessing's ForkingPickler (queues, pipes, DataLoader workers) sends a memfd (a
segment, a SharedCounter, a SharedValue) as ``multiprocessing.reduction.DupFd``: unless
a spawning child's arguments carry it, the sender's *resource sharer* thread holds a
duplicate until the receiver connects to it (a Unix socket), passes the authkey
handshake and takes it (SCM_RIGHTS). ``DupFd.detach()`` waits for ever on a sender that
lives but does not answer: one stopped (SIGSTOP, Ctrl-Z, a debugger) or hung. The
kernel queues the connection of a stopped listener, so the receiver then waits in the
handshake's first read. :func:`take_duplicate` makes the same exchange with every step
(connect, each read and write) bounded by :data:`DUPLICATE_TIMEOUT` in all, and
:func:`receive_duplicate` then tries the other routes (the sender's ``/proc``, the
holders) before it says which process did not answer and what to do.

A sender that went silent is not asked again for :data:`DUPLICATE_TIMEOUT` seconds: the
other segments of one unpickled tree go to the other routes at once, instead of each
waiting the full bound. The duplicates it holds stay in it until it exits (as for any
pickle never received); its resource sharer, once resumed, finds our connection closed
and prints that error (a ``BrokenPipeError`` traceback) on the sender's stderr, then
serves the next receiver as before.
"""
from __future__ import annotations

import errno
import multiprocessing
import multiprocessing.reduction
import os
import socket
import struct
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
#: stopped or hung. Set this attribute to wait longer or shorter.
DUPLICATE_TIMEOUT = 60.0

# A Unix socket whose listen backlog is full refuses a non-blocking connect at once
# (EAGAIN) instead of waiting: we ask again after this many seconds (as the coordinator's
# connect does), until the bound.
_CONNECT_RETRY = 0.01

# resource sharer address -> monotonic time until which that sender is not asked again
# (it went silent: see the module doc)
_SILENT: dict[Any, float] = {}


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


def take_duplicate(duplicate) -> int:
    """The descriptor that ``duplicate`` (a ``DupFd`` unpickled here) stands for; the
    caller owns it. A ``resource_sharer.DupFd`` is taken from its sender within
    :data:`DUPLICATE_TIMEOUT` seconds, else ``TimeoutError``; any other kind (a spawning
    child's, whose descriptor came with its arguments) is detached as it is.

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
    now = time.monotonic()
    if _SILENT.get(address, 0.0) > now:
        raise TimeoutError(f"it did not answer for {DUPLICATE_TIMEOUT:g} s a moment ago (not asked again)")
    try:
        return _take(address, key, now + DUPLICATE_TIMEOUT)
    except (TimeoutError, BlockingIOError) as err:  # (BlockingIOError: a read or write timed out)
        _SILENT[address] = time.monotonic() + DUPLICATE_TIMEOUT
        raise TimeoutError(f"it did not hand over the descriptor within {DUPLICATE_TIMEOUT:g} s") from err


def _take(address, key: int, deadline: float) -> int:
    """``resource_sharer.DupFd.detach()``'s exchange, each step bounded by ``deadline``."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        while True:
            sock.settimeout(_time_left(deadline))
            try:
                sock.connect(address)
                break
            except BlockingIOError:
                time.sleep(min(_CONNECT_RETRY, _time_left(deadline)))
        sock.setblocking(True)  # the Connection reads and writes the descriptor itself
        conn = connection.Connection(sock.detach())
    finally:
        sock.close()
    # the socket options go through a duplicate descriptor of our own (the options are
    # the socket's, shared by both), never through a socket object over conn's number
    with conn, socket.fromfd(conn.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as options:
        authkey = multiprocessing.current_process().authkey
        _bound(options, deadline)
        connection.answer_challenge(conn, authkey)
        _bound(options, deadline)
        connection.deliver_challenge(conn, authkey)
        _bound(options, deadline)
        conn.send((key, os.getpid()))
        _bound(options, deadline)
        return multiprocessing.reduction.recvfds(options, 1)[0]


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
    :class:`SegmentUnavailableError` naming it when the fallback fails too. For every
    user of memfds sent so (segments, SharedCounter, SharedValue)."""
    try:
        new_fd = take_duplicate(duplicate)
    except TimeoutError as err:  # (before _DUPLICATE_LOST: an OSError too)
        try:
            return fallback()
        except SegmentUnavailableError as gone:
            raise SegmentUnavailableError(
                f"The {what} (inode {key[1]}) sent by process {pid} could not be received: process "
                f"{pid} lives but {err} (shared_td.storage.duplicates.DUPLICATE_TIMEOUT): it is "
                "stopped (SIGSTOP, Ctrl-Z, a debugger) or hung. Resume it (`kill -CONT "
                f"{pid}`) before its receivers read what it sent. The other routes failed too: {gone}"
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
