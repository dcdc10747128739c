"""The TCPStore the cluster tests host on 127.0.0.1 (a free port, no other address)."""
from __future__ import annotations

from shared_td.coordinator.store_host import host_tcp_store


def loopback_store(timeout: float):
    """A store hosted by this process on a free loopback port (listening on 127.0.0.1
    only, see store_host); waits bounded by ``timeout``."""
    return host_tcp_store("127.0.0.1", 0, timeout=timeout)
