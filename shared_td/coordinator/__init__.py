"""The Coordinator: a manager process that owns a registry of published tensordicts.

``Coordinator().publish(name, td)`` memory-maps ``td`` and registers it; any process
given the coordinator's ``address`` and ``authkey`` calls ``attach(name, ...)`` and gets a
tensordict over the same memory. The manager keeps anonymous segments alive, so data
outlives its publisher; it listens on a Unix socket in a private directory.

Example:
    >>> import torch, shared_td
    >>> with shared_td.Coordinator() as coord:
    ...     _ = coord.publish("x", shared_td.TensorDict(a=torch.ones(2)))
    ...     shared_td.attach("x", address=coord.address, authkey=coord.authkey)["a"].tolist()
    [1.0, 1.0]
"""
from shared_td.coordinator.client import Coordinator, CoordinatorTimeoutError, attach
from shared_td.coordinator import ownership  # registers the adopter of new shared cells
from shared_td.coordinator.cluster_replica import version, wait_version
from shared_td.coordinator.staleness import is_stale, refresh

__all__ = ["Coordinator", "CoordinatorTimeoutError", "attach", "is_stale", "refresh", "version", "wait_version"]
