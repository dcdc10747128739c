"""The arguments of ``to()`` (TensorDict, NonTensorData, NonTensorStack), read as torch
reads ``Tensor.to``'s: a device, a dtype, or both (``to("cuda", torch.float16)``,
``to(device=..., dtype=...)``), or a tensor whose device and dtype are taken. Reading
only the first argument dropped the dtype of ``to(device, dtype)`` silently.
"""
from __future__ import annotations

import torch

from shared_td.containers.base import parse_device


def parse_to(args: tuple, kwargs: dict) -> tuple[torch.device | None, torch.dtype | None, bool]:
    """``(device, dtype, non_blocking)`` of ``to(*args, **kwargs)``; None for what is
    not asked. Arguments torch's ``Tensor.to`` refuses raise its error (a TypeError or
    RuntimeError), so that a mistyped one is not ignored.

    Example:
        >>> parse_to(("cpu", torch.float64), {})
        (device(type='cpu'), torch.float64, False)
        >>> parse_to((), {"dtype": torch.float16, "non_blocking": True})
        (None, torch.float16, True)
        >>> parse_to((torch.zeros(1, dtype=torch.int8),), {})
        (device(type='cpu'), torch.int8, False)
    """
    # (torch's own parser of Tensor.to's overloads, which tensordict uses as well)
    device, dtype, non_blocking, _memory_format = torch._C._nn._parse_to(*args, **kwargs)
    return parse_device(device), dtype, bool(non_blocking)
