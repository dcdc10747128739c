"""The manager's accept loop and the authkey handshake of each new connection.

``multiprocess.managers.Server`` accepts connections in one thread that, as written there:

* spins a core at 100% once the manager is out of descriptors (``accept`` fails with
  EMFILE at once, again and again: the pending peer stays in the backlog);
* dies for good the first time a thread cannot be started for a new connection
  (``RuntimeError: can't start new thread`` under a memory or thread limit): the manager
  lives on, its old connections work, and no new client ever gets in;
* waits for ever on a peer that connects and says nothing: each one holds a thread and a
  descriptor of the manager until it goes away;
* answers a peer that fails the handshake (a bad length header, garbage) with a
  pickled traceback, naming the server's files, before it proved it holds the authkey.

:class:`Server` is that server with its own accept loop and handshake: out of
descriptors it waits (a few ms, doubling up to :data:`BACKOFF_MAX_S`) and accepts again;
a thread that cannot be started is tried again with pauses for :data:`HANDSHAKE_S`
seconds, then that one connection is closed, and the loop goes on; a peer has
:data:`HANDSHAKE_S` seconds in all to complete the handshake and send its first request,
else its connection is shut down (one thread watches the deadlines of the handshakes
under way: a receive timeout bounds each read only); a peer that fails the handshake gets nothing but the closing (and the standard failure
message of a wrong key). Once authenticated, a connection waits for requests as long as
its client keeps it (a client idles between calls), and its calls and answers are
pickled by the standard library's pickle, in C (:meth:`Server.serve_client`).

Like ``server.py``, this module imports only the standard library and ``multiprocess``
(the manager never imports torch or the ``shared_td`` package).

Example:
    >>> import os, tempfile
    >>> with tempfile.TemporaryDirectory() as directory:
    ...     server = Server({}, os.path.join(directory, "sock"), os.urandom(32), "pickle")
    ...     server.listener.close()
    >>> HANDSHAKE_S
    5.0
"""
from __future__ import annotations

import errno
import pickle
import socket
import struct
import sys
import threading
import time
from traceback import format_exc

from multiprocess import connection, managers, process
from multiprocess.reduction import ForkingPickler

__all__ = ["BACKOFF_MAX_S", "HANDSHAKE_S", "Server"]

#: Seconds a new peer has to pass the authkey handshake and send its first request.
HANDSHAKE_S = 5.0
#: The longest pause, in seconds, of the accept loop while the manager is out of
#: descriptors or memory (it starts at 5 ms and doubles).
BACKOFF_MAX_S = 0.25
# accept() errors that mean the listener was closed (the manager is stopping)
_CLOSED = frozenset({errno.EBADF, errno.EINVAL, errno.ENOTSOCK})


class _Deadlines:
    """The handshakes under way, each with its deadline, and one thread that shuts down
    the socket of each that outlives it: that ends the reads of the thread serving it.
    (A receive timeout bounds each read, not the handshake: a peer that sends a byte now
    and then would hold a thread and a descriptor for minutes.)"""

    def __init__(self) -> None:
        self._pending: dict[int, tuple[float, object]] = {}
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None

    def begin(self, conn) -> None:
        with self._changed:
            if self._thread is None:  # started with the first handshake (short of threads:
                # the next one tries again; meanwhile each read is bounded on its own)
                thread = threading.Thread(target=self._run, name="shared_td-handshakes", daemon=True)
                try:
                    thread.start()
                    self._thread = thread
                except RuntimeError:
                    pass
            self._pending[id(conn)] = (time.monotonic() + HANDSHAKE_S, conn)
            self._changed.notify()

    def end(self, conn) -> None:
        with self._changed:
            self._pending.pop(id(conn), None)

    def _run(self) -> None:
        with self._changed:
            while True:
                now = time.monotonic()
                for key, (deadline, conn) in list(self._pending.items()):
                    if deadline <= now:
                        del self._pending[key]
                        _shut_down(conn)  # (still open: end() had not run; the fd is its)
                soonest = min((deadline for deadline, _ in self._pending.values()), default=now + 60.0)
                self._changed.wait(max(soonest - now, 0.01))


def _shut_down(conn) -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, 0, conn.fileno())
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # the peer left meanwhile
        pass
    finally:
        sock.detach()


class Server(managers.Server):
    """``multiprocess.managers.Server`` with the accept loop and handshake above."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._deadlines = _Deadlines()

    def start_accepting(self) -> None:
        """Start the accept loop's thread; before the manager reports its address, so
        that a manager unable to start it (a low RLIMIT_AS it inherited) fails its start
        with an error (``managers.Server.serve_forever`` started it itself, and its
        ``finally: sys.exit(0)`` swallowed that error: the manager exited silently once
        it had reported its address, and the first call found it gone)."""
        self.stop_event = threading.Event()
        # (as managers.Server.serve_forever: proxies unpickled here resolve to the objects;
        # set before the first connection can be served, not once serve_forever runs)
        process.current_process()._manager_server = self
        threading.Thread(target=self.accepter, name="shared_td-accept", daemon=True).start()

    def serve_forever(self) -> None:
        """Serve until a shutdown request (or the watch of the parent) sets ``stop_event``;
        :meth:`start_accepting` started the accept loop."""
        while not self.stop_event.is_set():
            self.stop_event.wait(1)

    def accepter(self) -> None:
        pause = 0.0
        while True:
            try:
                conn = self.listener.accept()
            except OSError as err:
                if err.errno in _CLOSED or getattr(self.listener, "_listener", True) is None:
                    return  # closed: the manager is stopping
                # EMFILE, ENFILE, ENOMEM: the peer stays in the backlog, and retrying at
                # once would spin a core until descriptors are freed (any other error,
                # ECONNABORTED say, gets a short pause too)
                pause = min(max(2 * pause, 0.005), BACKOFF_MAX_S)
                time.sleep(pause)
                continue
            pause = 0.0
            self._serve_in_thread(conn)

    def _serve_in_thread(self, conn) -> None:
        """Serve ``conn`` in a thread of its own; short of threads or memory ("can't
        start new thread"), try again with pauses for :data:`HANDSHAKE_S` seconds, then
        close it. (Closed at once, the client read an end of file and took the manager
        for dead: a caller that replaces a dead coordinator started a second one.)"""
        deadline, pause = time.monotonic() + HANDSHAKE_S, 0.0
        while True:
            try:
                threading.Thread(target=self.handle_request, args=(conn,), daemon=True).start()
                return
            except BaseException:  # noqa: B036 - can't start new thread, MemoryError
                if time.monotonic() >= deadline:
                    conn.close()
                    return
                pause = min(max(2 * pause, 0.005), BACKOFF_MAX_S)
                time.sleep(pause)  # let threads or memory be freed

    def handle_request(self, conn) -> None:
        try:
            request = self._authenticated_request(conn)
            if request is not None:
                self._answer(conn, request)
        except SystemExit:  # serve_client() ends with sys.exit(0) at the peer's EOF
            pass
        finally:
            conn.close()

    def _authenticated_request(self, conn):
        """The first request of a peer that passed the handshake within
        :data:`HANDSHAKE_S` seconds; None (nothing said to it) for any other peer."""
        deadlines = self._deadlines
        deadlines.begin(conn)
        try:
            _limit_waits(conn, HANDSHAKE_S)
            connection.deliver_challenge(conn, self.authkey)
            connection.answer_challenge(conn, self.authkey)
            request = conn.recv()
            _limit_waits(conn, 0)  # authenticated: it may idle between its calls
            return request
        except Exception:  # silent, slow, wrong key, garbage: no traceback for strangers
            return None
        finally:
            deadlines.end(conn)

    def _answer(self, conn, request) -> None:
        """What ``managers.Server._handle_request`` does after its handshake: run the
        server method the authenticated peer asked for (``accept_connection`` then
        serves its calls until it closes) and send the result."""
        try:
            _, funcname, args, kwds = request
            if funcname not in self.public:
                raise AttributeError(f"{funcname!r} unrecognized")
            func = getattr(self, funcname)
        except Exception:
            msg = ("#TRACEBACK", format_exc())
        else:
            try:
                msg = ("#RETURN", func(conn, *args, **kwds))
            except Exception:
                msg = ("#TRACEBACK", format_exc())
        try:
            conn.send(msg)
        except Exception:  # the peer left
            pass

    def serve_client(self, conn) -> None:
        """Answer the calls of an authenticated connection until its client closes it, as
        ``managers.Server.serve_client`` does for the objects it serves (here the
        registry only: no proxies), with the standard library's pickle, in C: the
        Connection's own pickler (dill, in Python) took ~40 us of CPU a call on this
        machine, of a 100 us round trip. An answer that pickle refuses goes through dill,
        as before; the client reads either (one format)."""
        while not self.stop_event.is_set():
            try:
                request = conn.recv_bytes()
            except EOFError:  # the client closed the connection
                sys.exit(0)  # (as the original: handle_request ends on SystemExit)
            answer = _answer_bytes(self._outcome(request))
            try:
                conn.send_bytes(answer)
            except Exception:  # the peer left
                conn.close()
                sys.exit(1)

    def _outcome(self, request: bytes) -> tuple:
        """``("#RETURN", result)`` of the pickled call ``request``, ``("#ERROR", exc)``
        of the exception it raised, ``("#TRACEBACK", text)`` of a call that is refused
        (an unknown object or a method that is not exposed) or does not unpickle."""
        try:
            ident, method, args, kwds = pickle.loads(request)
            target, exposed, _typeids = self.id_to_obj[ident]
            if method not in exposed:
                raise AttributeError(f"method {method!r} of {type(target)!r} object is not in exposed={exposed!r}")
            function = getattr(target, method)
        except Exception:
            return "#TRACEBACK", format_exc()
        try:
            return "#RETURN", function(*args, **kwds)
        except Exception as err:
            return "#ERROR", err


def _answer_bytes(outcome: tuple) -> bytes:
    """``outcome`` pickled: by pickle in C, else by dill (a value that only dill
    pickles), else the traceback of that failure (as ``#UNSERIALIZABLE``)."""
    try:
        return pickle.dumps(outcome, pickle.HIGHEST_PROTOCOL)
    except Exception:
        pass
    try:
        return bytes(ForkingPickler.dumps(outcome))
    except Exception:
        return pickle.dumps(("#UNSERIALIZABLE", format_exc()), pickle.HIGHEST_PROTOCOL)


def _limit_waits(conn, seconds: float) -> None:
    """Make each blocking read and write on ``conn`` fail with EAGAIN after ``seconds``
    (0: wait for ever)."""
    whole = int(seconds)
    timeval = struct.pack("@ll", whole, int((seconds - whole) * 1e6))
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, 0, conn.fileno())
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
    finally:
        sock.detach()  # the descriptor stays the Connection's
