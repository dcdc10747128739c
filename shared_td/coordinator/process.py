"""ServerProcess: one coordinator manager process, from start to the removal of its files.

Both a :class:`~shared_td.Coordinator` started by the user and the embedded coordinator
that ``memmap_(share_non_tensor=True)`` starts on demand (see
:mod:`shared_td.coordinator.ownership`) run one of these: ``coordinator/server.py`` as a
script in a fresh interpreter (the server module says why not a fork), about 0.1 s.

Ownership and lifetime: the process that called :meth:`ServerProcess.start` owns it; only
that process's :meth:`ServerProcess.stop` stops it (a fork child's copy does nothing). The
server stops by itself within 0.2 s when its owner is gone, even by SIGKILL, and then
removes its private directory; :meth:`stop` removes the directory of a server that was
killed. The authkey travels on the server's stdin, never on its command line (``ps``
shows that), and its address comes back on its stdout.

Example:
    >>> process = ServerProcess.start(os.urandom(32))
    >>> process.address.endswith("/sock"), os.path.isdir(os.path.dirname(process.address))
    (True, True)
    >>> process.stop(timeout=5)
    >>> os.path.exists(os.path.dirname(process.address))
    False
"""
from __future__ import annotations

import errno
import os
import resource
import select
import shutil
import subprocess
import sys
import tempfile
import time

from multiprocess import managers

from shared_td.coordinator import channels, server
from shared_td.storage.fd_mapping import descriptor_limits

__all__ = ["ServerProcess", "START_TIMEOUT"]

#: Seconds to wait for a new server to listen.
START_TIMEOUT = 30.0
#: Seconds :meth:`ServerProcess.stop` waits for the server to exit after its stop
#: request (and for a killed one to be reaped).
EXIT_TIMEOUT = 5.0

# Runs server.py without the script's own directory on sys.path (its siblings must not
# shadow top-level modules of the same name).
_BOOT = "import runpy, sys; del sys.path[0]; runpy.run_path(sys.argv[1], run_name='__main__')"


#: The longest path a Unix socket may be bound to on Linux, in bytes (``sun_path`` is
#: 108 bytes, with a terminating NUL).
MAX_SOCKET_PATH = 107


def _check_socket_path(root: str) -> None:
    """OSError (ENAMETOOLONG) naming ``TMPDIR`` if the socket of a manager's private
    directory under ``root`` (``<root>/shared_td-coord-<pid>-<8 characters>/sock``)
    could pass :data:`MAX_SOCKET_PATH` bytes: the manager would fail to bind it, so it
    is checked before one is launched.

    Example:
        >>> _check_socket_path("/tmp")
        >>> _check_socket_path("/" + "x" * 90)
        Traceback (most recent call last):
        ...
        OSError: [Errno 36] ...
    """
    try:
        with open("/proc/sys/kernel/pid_max") as pid_max:  # the manager's pid is in the name
            digits = len(str(int(pid_max.read()) - 1))
    except (OSError, ValueError):
        digits = 7  # pid_max is at most 2**22
    length = len(os.fsencode(os.path.join(root, f"{server.DIR_PREFIX}{'9' * digits}-{'x' * 8}", "sock")))
    if length > MAX_SOCKET_PATH:
        spare = length - MAX_SOCKET_PATH
        raise OSError(errno.ENAMETOOLONG,
                      f"The shared_td coordinator's socket would be {root}/{server.DIR_PREFIX}<pid>-"
                      f"<8 characters>/sock, {length} bytes: over the {MAX_SOCKET_PATH} bytes a Unix "
                      f"socket's path may have. The temporary directory ({root}, from TMPDIR) is "
                      f"{len(os.fsencode(root))} bytes long: set TMPDIR to a directory at least "
                      f"{spare} bytes shorter (e.g. /tmp) for the process that starts it.")


def _inherited_limits() -> str:
    """This process's RLIMIT_AS, which the manager inherits, as words for a failed start
    when it is set: a manager short of address space cannot start its threads."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return ""
    return (f" The manager inherits this process's RLIMIT_AS of {soft >> 20} MiB, which may be too low for "
            "it to start its threads: raise it (resource.setrlimit, `ulimit -v`) before Coordinator.start "
            "and lower it after.")


class ServerProcess:
    """A coordinator server running in a child interpreter of this process."""

    def __init__(self, popen: subprocess.Popen, address: str, authkey: bytes):
        # Private: use ServerProcess.start.
        self._popen: subprocess.Popen | None = popen
        self.address, self.authkey, self.pid = address, authkey, popen.pid
        self._owner_pid = os.getpid()

    @classmethod
    def start(cls, authkey: bytes, *, timeout: float = START_TIMEOUT) -> "ServerProcess":
        """Start a server that accepts ``authkey``; returns once it listens.

        Its private directory is made under this process's ``tempfile.gettempdir()``.
        RuntimeError if it does not listen within ``timeout`` seconds (it is killed), or
        exits before it listens (its exit code, and its error output above); OSError if
        its socket's path would be too long for a Unix socket (a long ``TMPDIR``).
        """
        _check_socket_path(tempfile.gettempdir())
        try:
            popen = cls._launch(authkey)
        except OSError as err:  # (subprocess's pipes): the raw errno named no limit
            if err.errno not in (errno.EMFILE, errno.ENFILE):
                raise
            raise OSError(err.errno, f"Could not start the shared_td coordinator's manager process: this process "
                                     f"is out of descriptors ({err}). {descriptor_limits(err.errno)}") from err
        try:
            ready, _, _ = select.select([popen.stdout], [], [], timeout)
            address = popen.stdout.readline().decode().strip() if ready else ""
            popen.stdout.close()
            if not address:
                try:  # an end of its output without an address: it is exiting
                    code = popen.wait(EXIT_TIMEOUT) if ready else popen.poll()
                except subprocess.TimeoutExpired:
                    code = None
                raise RuntimeError(
                    f"The shared_td coordinator exited with code {code} before listening; see "
                    f"its error output above.{_inherited_limits()}" if code is not None else
                    f"The shared_td coordinator did not start within {timeout:g} s.{_inherited_limits()}"
                )
        except BaseException:
            popen.kill()
            popen.wait()
            raise
        return cls(popen, address, authkey)

    @staticmethod
    def _launch(authkey: bytes) -> subprocess.Popen:
        """Run server.py, give it ``authkey`` and return (it reports its address on its
        stdout). Its last argument is this process's pid, the owner it watches."""
        popen = subprocess.Popen(
            [sys.executable, "-c", _BOOT, server.__file__, str(os.getpid())],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True,
            env=dict(os.environ, TMPDIR=tempfile.gettempdir()),
        )
        try:
            popen.stdin.write(authkey)
            popen.stdin.close()
        except BaseException:
            popen.kill()
            popen.wait()
            raise
        return popen

    def owned_here(self) -> bool:
        """Whether this process started it (a fork child's copy is not the owner)."""
        return os.getpid() == self._owner_pid

    def stop(self, timeout: float) -> None:
        """Stop the server and remove its private directory. Idempotent; does nothing in
        a process that does not own it.

        The stop request is sent within ``timeout`` seconds; a server that does not take
        it (stopped by SIGSTOP, stalled) or does not exit within :data:`EXIT_TIMEOUT` is
        killed. A server that died already is only reaped.
        """
        popen = self._popen
        if popen is None or not self.owned_here():
            return
        self._popen = None
        try:
            deadline = time.monotonic() + timeout
            conn = channels.connect(self.address, self.authkey, deadline)
            try:
                channels.limit_waits(conn, deadline)
                managers.dispatch(conn, None, "shutdown")
            finally:
                conn.close()
            popen.wait(EXIT_TIMEOUT)
        except Exception:  # gone, stalled, slow to exit, or an error reply: no more asking
            popen.kill()
            popen.wait(EXIT_TIMEOUT)
        directory = os.path.dirname(self.address)
        if server.DIR_PATTERN.match(os.path.basename(directory)):
            shutil.rmtree(directory, ignore_errors=True)

    def __repr__(self) -> str:
        state = "running" if self._popen is not None else "stopped"
        return f"ServerProcess(pid={self.pid}, {self.address}, {state})"
