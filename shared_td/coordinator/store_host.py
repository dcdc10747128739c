"""Hosting the cluster's ``TCPStore`` on a listening socket we make ourselves.

torch's TCPStore server listens on ``::`` (IPv6, dual stack), so an IPv4 client arrives
as ``::ffff:a.b.c.d``, and the server names every connection it accepts with
``getnameinfo``: a reverse DNS lookup, made in the one thread that serves every client
of the store (seen with strace: one PTR query per accepted connection). The resolver's
``/etc/hosts`` entries are IPv4, so the mapped address always goes to DNS; a resolver
that drops the query holds that thread for its 5 s timeout (one query in ~25 on the
machine of our CI), and with it every ``get``, ``add`` and heartbeat of every node.

:func:`host_tcp_store` gives torch a socket of the address's own family instead
(``master_listen_fd``): an IPv4 peer is then an IPv4 address, which ``/etc/hosts`` names
without a DNS query for loopback, and a loopback host is listened on at that address
only, not on every interface. A client's own connect still resolves its peer (torch
does that in the connecting thread, for that connection only):
:class:`~shared_td.coordinator.cluster_store.SignedStore` connects those ahead.

Example:
    >>> store = host_tcp_store("127.0.0.1", 0, timeout=5.0)
    >>> store.set("k", "v"); store.get("k")
    b'v'
    >>> listening_address(store.port)
    ('127.0.0.1', ...)
"""
from __future__ import annotations

import datetime
import ipaddress
import os
import socket

import torch.distributed as dist

__all__ = ["host_tcp_store", "listening_address"]

_BACKLOG = 512  # connections waiting to be accepted: every thread of every node connects


def _bind_address(host: str) -> tuple[int, str]:
    """(family, address to bind) for a store that clients reach at ``host``: a loopback
    host is bound as such (nothing else can reach it), any other host on every interface
    of its family, as torch does (a name may resolve differently on other machines)."""
    infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    families = {info[0] for info in infos}
    family = socket.AF_INET if socket.AF_INET in families else socket.AF_INET6
    address = next(info[4][0] for info in infos if info[0] == family)
    if ipaddress.ip_address(address.split("%")[0]).is_loopback:
        return family, address
    return family, "0.0.0.0" if family == socket.AF_INET else "::"


def host_tcp_store(host: str, port: int, *, timeout: float) -> "dist.TCPStore":
    """A TCPStore server for clients that connect to ``host:port`` (``port`` 0: a free
    one, read it from ``.port``), listening on a socket of ``host``'s own family (see the
    module's opening); waits bounded by ``timeout`` seconds.

    Raises:
        OSError: the address cannot be bound (e.g. the port is in use), naming it.
    """
    family, address = _bind_address(host)
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind((address, port))
        except OSError as err:
            raise OSError(err.errno, f"cannot host the cluster store on {address}:{port}: {err.strerror}") from err
        listener.listen(_BACKLOG)
        bound_port = listener.getsockname()[1]
        # torch adopts the descriptor it is given and closes it with the store: give it a
        # duplicate, so that ours is closed here whatever happens
        handed = os.dup(listener.fileno())
        try:
            return dist.TCPStore(host, bound_port, None, True, datetime.timedelta(seconds=timeout),
                                 wait_for_workers=False, master_listen_fd=handed)
        except BaseException:
            _close_if_same(handed, listener.fileno())
            raise
    finally:
        listener.close()


def _close_if_same(fd: int, original: int) -> None:
    """Close ``fd`` if it still is a duplicate of ``original`` (still open here, so its
    inode is unique): a failed TCPStore may or may not have adopted and closed it, and
    the number may already name another thread's new file."""
    try:
        same = os.fstat(fd).st_ino == os.fstat(original).st_ino
    except OSError:
        return
    if same:
        os.close(fd)


def listening_address(port: int) -> tuple[str, int] | None:
    """The local address of this process's listening TCP socket on ``port``, or None:
    what a test (or a curious user) checks to see where a store is reachable."""
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            probe = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        with probe:
            if probe.type != socket.SOCK_STREAM or probe.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            if probe.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) and probe.getsockname()[1] == port:
                return probe.getsockname()[:2]
    return None
