"""The benchmark's ``TCPStore`` hosts on loopback, listening on IPv4 only.

A ``TCPStore`` host that listens itself binds ``::`` (dual stack), so a client on
127.0.0.1 reaches it as ``::ffff:127.0.0.1``; torch formats the address of each
connection it accepts with ``getnameinfo`` (a reverse lookup, in the store's one event
loop thread), and that mapped address is in no hosts file, so each accept asks the DNS
resolver. A resolver that drops a query (one in ~25-60 on the CI machine) then holds the
store's loop for its 5 s timeout, and every client of the store -- every node's calls
and connects -- waits with it. A store given a listening socket bound to 127.0.0.1 sees
its peers as 127.0.0.1, which ``/etc/hosts`` names: no DNS query on the store's side.
(Each client still resolves the store's mapped address once per connect, in its own
thread: torch prefers IPv6 and has no switch for it.)

Example:
    >>> store = loopback_store(5.0)
    >>> store.set("k", b"v"); store.get("k")
    b'v'
"""
from __future__ import annotations

import datetime
import os
import socket

import torch.distributed as dist

#: Where the benchmark's stores listen, and where their clients connect.
HOST = "127.0.0.1"


def loopback_store(timeout: float) -> dist.TCPStore:
    """A TCPStore hosted on a free port of 127.0.0.1, IPv4 only (see the module's
    opening); ``timeout``: seconds any call of its own client may wait."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind((HOST, 0))
        port = listener.getsockname()[1]
        # the store owns (and closes) the descriptor it is given: a copy of ours, so that
        # ours is closed here whatever happens; it listens once the store's loop runs
        handed = os.dup(listener.fileno())
    finally:
        listener.close()
    ident = os.fstat(handed).st_ino
    try:
        return dist.TCPStore(HOST, port, None, True, datetime.timedelta(seconds=timeout),
                             wait_for_workers=False, master_listen_fd=handed)
    except BaseException:
        # torch may have closed it already, and another thread reused the number for
        # another file since: closed only if it is still our socket
        try:
            if os.fstat(handed).st_ino == ident:
                os.close(handed)
        except OSError:
            pass
        raise
