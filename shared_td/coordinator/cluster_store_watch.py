"""A store host that stops answering: every store call of this process is bounded.

torch's TCPStore client (2.13) waits for the answer of a plain call (``check``, ``set``,
``add``, ``compare_set``...) with no time limit: a host that is stopped (SIGSTOP, a
frozen virtual machine) or cut off without a reset (a network partition) held every
call of every other node, and their shutdown, for as long as it lasted (a ``sync`` with
a 15 s timeout returned after 100 s, a node's close took 120 s: fuzz16). Its own
timeout bounds only the waits for keys.

So :class:`StallWatch` notes each store call in flight (the calling thread and when it
is due: the store's timeout, plus what the call itself waits for), and a thread of its
own looks every :data:`WATCH_EVERY_S`; once one is overdue, the host is taken as lost:
``on_stall`` is called (the store then opens no new connection to it) and every socket
of this process connected to the host's address is shut down, so every call blocked on
one fails at once (torch raises DistNetworkError: a ConnectionError for the caller, see
``cluster_store._store_call``) and every later call on them too. The host's name is
looked up by the watching thread only (as it starts, again at the stall: never on a
call's path, as a lookup may wait for the resolver). Nothing else of the process is
touched: a socket whose peer is not the host's address and port stays as it is. A call
that connects first is due later (``SignedStore._connecting_now``), and a time this
process itself did not run (stopped, its machine frozen) is not held against a call.

Example (a call registered with a due time already passed, on a store at no address:
nothing to cut, the stall is still said)::

    >>> said = []
    >>> watch = StallWatch(None, on_stall=lambda: said.append(True))
    >>> watch.calls[1] = time.monotonic() - 1.0   # (a thread's call, overdue)
    >>> watch.start(); watch.stalled.wait(5.0), said
    (True, [True])
    >>> watch.close()
"""
from __future__ import annotations

import ipaddress
import os
import socket
import threading
import time
from typing import Iterator

__all__ = ["StallWatch", "WATCH_EVERY_S", "cut_connections", "host_peers", "open_sockets", "resolving"]

#: How often the watch looks at the calls in flight (a stall is found this much late).
WATCH_EVERY_S = 0.25

#: How long a fork waits for this process's store connects (and host lookups) under way.
FORK_WAIT_S = 5.0

# The threads connecting to the store or looking its host up now. Each holds glibc's
# resolver lock for a while (torch's connect looks its peer's name up): a fork made then
# gives the child that lock held by a thread it does not have, and the child's own first
# connect (made anew there: see cluster_store's _STORES) waited on it for ever, where no
# stall watch can cut anything (review49). So a fork waits (at most FORK_WAIT_S) for those
# under way, and none starts until it is made; a child forked past that wait refuses to
# connect. The forking thread's own entry is not waited for: it cannot be connecting, so
# it is one a Ctrl-C left behind (a Python __exit__ can be cut before it runs).
_lookups: set[int] = set()
# held through a fork (see _before_fork); re-entrant: a signal handler that forks while its
# thread is inside resolving()'s own `with _no_new_lookups:` would wait for itself for ever
_no_new_lookups = threading.RLock()
_forked_mid_lookup = False


class resolving:
    """``with resolving():`` around a store connect or a host lookup (see above)."""

    def __enter__(self) -> None:
        if _forked_mid_lookup:
            raise ConnectionError(  # (an OSError: never taken for a Store that cannot be cloned)
                "This process was forked while another thread of its parent was connecting to the cluster store "
                f"(it did not end within {FORK_WAIT_S:g} s): a connect here could wait for ever on a lock that "
                "thread held. Fork once the node's connects are done, or use the forkserver or spawn start method.")
        with _no_new_lookups:
            _lookups.add(threading.get_ident())

    def __exit__(self, *exc) -> None:
        _lookups.discard(threading.get_ident())


def _others_lookups() -> set[int]:
    return _lookups - {threading.get_ident()}  # (one C call: other threads add and remove theirs)


def _before_fork() -> None:
    _no_new_lookups.acquire()
    end = time.monotonic() + FORK_WAIT_S
    while _others_lookups() and time.monotonic() < end:
        time.sleep(0.001)


def _after_fork_in_parent() -> None:
    _no_new_lookups.release()


def _after_fork_in_child() -> None:
    global _no_new_lookups, _forked_mid_lookup
    _forked_mid_lookup = _forked_mid_lookup or bool(_others_lookups())
    _lookups.clear()
    _no_new_lookups = threading.RLock()


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                    after_in_child=_after_fork_in_child)


class StallWatch:
    """The store calls in flight (:attr:`calls`: thread ident -> ``time.monotonic()``
    by which the call is due) and the thread that watches them (see the module's
    opening). ``address``: the store host's ``(host, port)``, or None for a store that
    is not reached over the network (nothing to cut). :attr:`spared`: sockets (as
    :func:`open_sockets` names them) that a stall leaves alone."""

    def __init__(self, address: tuple[str, int] | None, on_stall):
        self.address = address
        self.spared: frozenset[str] = frozenset()  # never cut (cut_connections): a fork child's inherited ones
        self.calls: dict[int, float] = {}
        self.stalled = threading.Event()  # set once a call was overdue (the host is lost)
        self.cap: float | None = None  # see hurry()
        self._on_stall = on_stall
        self._ended = threading.Event()
        self._thread: threading.Thread | None = None
        self._starting = threading.Lock()

    def start(self) -> None:
        """Start the watching thread (once: at the store's first call). A daemon: it
        never enters torch, so the interpreter's exit never waits for it nor aborts. A
        thread that cannot start (the thread limit) is tried again at the next call;
        the call goes on meanwhile, unwatched, as every call did before the watch."""
        if self._thread is not None:  # (each call asks: no lock once it runs)
            return
        with self._starting:
            if self._thread is None and not self._ended.is_set():
                thread = threading.Thread(target=self._watch, name="shared_td-store-watch", daemon=True)
                try:
                    thread.start()
                except RuntimeError:
                    return
                self._thread = thread

    def begin(self, thread: int, seconds: float) -> None:
        """Note the call ``thread`` makes now, due within ``seconds``, and watch. Called
        inside the ``try`` whose ``finally`` removes it (``calls.pop(thread, None)``): a
        Ctrl-C landing once it is noted then still removes it (left, it would later be
        found overdue: a healthy host taken as lost)."""
        self.calls[thread] = time.monotonic() + seconds
        self.start()

    def hurry(self, seconds: float | None) -> None:
        """Every call in flight now or made later is due within ``seconds`` from now
        at the latest, also one that waits longer by itself (a queue's pop): for a
        closing node, whose pops end once its stop notices come (at once from a host
        that answers). None: no such bound any more (a close that was interrupted)."""
        self.cap = None if seconds is None else time.monotonic() + seconds
        self.start()

    def close(self) -> None:
        """End the watching thread (the store closed)."""
        self._ended.set()
        with self._starting:
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(5 * WATCH_EVERY_S)

    def _watch(self) -> None:
        # the host's addresses: looked up first while it answers (off every call's path),
        # again at the stall; an empty answer (a lookup lost) is looked up at each look
        peers = host_peers(*self.address) if self.address is not None else set()
        looked_again = False
        # (thread, due) of each call in flight -> its due, pushed back by the times this
        # process itself did not run (SIGSTOP, a frozen machine: this thread's sleep
        # overran) while it was in flight: on resuming, this thread may look before the
        # caller reads the answer waiting for it (review48: a healthy host taken as lost)
        excused: dict[tuple[int, float], float] = {}
        last = time.monotonic()
        while not self._ended.wait(WATCH_EVERY_S):
            calls = self.calls.copy()  # (one C call: other threads add and remove theirs)
            if not self.stalled.is_set():
                now = time.monotonic()
                overran, last = now - last - WATCH_EVERY_S, now
                pause = overran if overran > WATCH_EVERY_S else 0.0
                excused = {call: excused.get(call, call[1]) + pause for call in calls.items()}
                if not any(due < now for due in excused.values()) and not (calls and self.cap is not None
                                                                           and self.cap < now):
                    continue
                self.stalled.set()
                self._on_stall()
            if calls and self.address is not None:
                # again at each look while calls are in flight: a connect that torch's
                # client is making tries again (until its timeout) after each cut
                if not looked_again or not peers:
                    peers, looked_again = peers | host_peers(*self.address), True
                cut_connections(peers, self.spared)


def _plain(address: str) -> str:
    """``address`` with an IPv4 address mapped into IPv6 (``::ffff:127.0.0.1``, how
    torch's client sockets name their peer) written as the IPv4 one."""
    try:
        parsed = ipaddress.ip_address(address.split("%")[0])
    except ValueError:
        return address
    mapped = getattr(parsed, "ipv4_mapped", None)
    return str(mapped or parsed)


def host_peers(host: str, port: int) -> set[tuple[str, int]]:
    """The ``(address, port)`` pairs of ``host``:``port`` as a connected socket names
    its peer (see :func:`_plain`); empty when ``host`` cannot be resolved."""
    try:
        with resolving():
            found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        return {(_plain(info[4][0]), port) for info in found}
    except OSError:
        return set()


def _sockets() -> Iterator[tuple[int, str]]:
    """``(descriptor, name)`` of each socket this process has open, as ``/proc/self/fd``
    names it (``socket:[inode]``: the same name in every process that holds one)."""
    for name in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # (closed meanwhile)
            continue
        if link.startswith("socket:"):
            yield int(name), link


def open_sockets() -> frozenset[str]:
    """The names of the sockets this process has open (see :func:`_sockets`)."""
    return frozenset(link for _fd, link in _sockets())


def cut_connections(peers: set[tuple[str, int]], spared: frozenset[str] = frozenset()) -> int:
    """Shut down every socket of this process connected to one of ``peers`` (see
    :func:`host_peers`), but those ``spared`` (see :func:`open_sockets`); returns how
    many. A blocked receive on one returns at once. Every other descriptor is left as
    it is."""
    cut = 0
    for fd, link in _sockets():
        if link in spared:
            continue
        try:
            copy = os.dup(fd)  # (its own descriptor: the number may be closed meanwhile)
        except OSError:
            continue
        try:
            sock = socket.socket(fileno=copy)
        except OSError:  # not a socket any more (the number was reused)
            os.close(copy)
            continue
        with sock:  # closes the copy only; shutdown() acts on the connection itself
            try:
                peer = sock.getpeername() if sock.family in (socket.AF_INET, socket.AF_INET6) else None
                if sock.type == socket.SOCK_STREAM and peer and (_plain(peer[0]), peer[1]) in peers:
                    sock.shutdown(socket.SHUT_RDWR)
                    cut += 1
            except OSError:
                pass  # not connected (a listening socket, one being closed)
    return cut
