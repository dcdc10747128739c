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

import datetime

import torch.distributed as dist

from shared_td.coordinator.store_host import host_tcp_store

#: Where the benchmark's stores listen, and where their clients connect.
HOST = "127.0.0.1"


def loopback_store(timeout: float):
    """A TCPStore hosted on a free port of 127.0.0.1, IPv4 only; ``timeout``: seconds
    any call of its own client may wait."""
    return host_tcp_store(HOST, 0, timeout=timeout)


def raw_gloo_rank(port: int, rank: int, timeout: float):
    """Rank ``rank`` of a raw two-rank gloo group of its own (``raw/`` keys of the
    loopback store at ``port``; ``timeout``: seconds for its rendezvous and any wait):
    the raw reference of the cases whose two nodes run in two processes, built in those
    very processes beside the nodes."""
    options = dist.ProcessGroupGloo._Options()
    options._timeout = datetime.timedelta(seconds=timeout)
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=HOST)]
    store = dist.TCPStore(HOST, port, None, False, datetime.timedelta(seconds=timeout))
    return dist.ProcessGroupGloo(dist.PrefixStore("raw", store), rank, 2, options)
