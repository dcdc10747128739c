"""The TCPStore the cluster tests host on 127.0.0.1 (a free port, no other address): the
bench's, listening on 127.0.0.1 only (see shared_td.coordinator.store_host)."""
from __future__ import annotations

from shared_td.bench.loopback import loopback_store

__all__ = ["loopback_store"]
