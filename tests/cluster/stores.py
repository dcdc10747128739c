"""The TCPStore the cluster tests host on 127.0.0.1 (a free port, no other address)."""
from __future__ import annotations

import datetime

import torch.distributed as torch_dist


def loopback_store(timeout: float) -> "torch_dist.TCPStore":
    """A store hosted by this process on a free loopback port; waits bounded by ``timeout``."""
    return torch_dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=timeout),
                               wait_for_workers=False)
