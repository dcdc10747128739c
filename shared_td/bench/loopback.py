"""The benchmark's ``TCPStore`` hosts: on 127.0.0.1, through
:func:`~shared_td.coordinator.store_host.host_tcp_store` (a listening socket of IPv4
only, so that torch's serving thread never asks DNS for a loopback client's name: see
that module's opening).

Example:
    >>> store = loopback_store(5.0)
    >>> store.set("k", b"v"); store.get("k")
    b'v'
"""
from __future__ import annotations

from shared_td.coordinator.store_host import host_tcp_store

#: Where the benchmark's stores listen, and where their clients connect.
HOST = "127.0.0.1"


def loopback_store(timeout: float):
    """A TCPStore hosted on a free port of 127.0.0.1, IPv4 only; ``timeout``: seconds
    any call of its own client may wait."""
    return host_tcp_store(HOST, 0, timeout=timeout)
