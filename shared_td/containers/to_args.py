"""The arguments of ``to()`` (TensorDict, NonTensorData, NonTensorStack), read as torch
reads ``Tensor.to``'s: a device, a dtype, or both (``to("cuda", torch.float16)``,
``to(device=..., dtype=...)``), or a tensor whose device and dtype are taken. Reading
only the first argument dropped the dtype of ``to(device, dtype)`` silently.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Any

import torch

from shared_td.containers.base import parse_device


#: tensordict's own keywords of ``to()`` that change nothing here (accepted, ignored),
#: and ``inplace``, which the caller reads itself
_IGNORED = ("non_blocking_pin", "num_threads", "inplace")


def parse_to(args: tuple, kwargs: dict, batch_size: Any = None) -> tuple[torch.device | None, torch.dtype | None, bool]:
    """``(device, dtype, non_blocking)`` of ``to(*args, **kwargs)``; None for what is
    not asked. Besides torch's forms, tensordict's: ``other=`` (or a first argument) that
    is a tensordict gives its device, and its dtype when all its leaves are tensors of
    one dtype (as tensordict 0.15.3); ``non_blocking_pin=`` and ``num_threads=`` are
    accepted and change nothing; ``batch_size=`` must be ``batch_size`` (the caller's,
    when given: a tensordict's ``to`` does not reshape it here, a ValueError says what
    to do). Arguments torch's ``Tensor.to`` refuses raise its error (a TypeError or
    RuntimeError), so that a mistyped one is not ignored.

    Example:
        >>> parse_to(("cpu", torch.float64), {})
        (device(type='cpu'), torch.float64, False)
        >>> parse_to((), {"dtype": torch.float16, "non_blocking": True, "num_threads": 2})
        (None, torch.float16, True)
        >>> parse_to((torch.zeros(1, dtype=torch.int8),), {})
        (device(type='cpu'), torch.int8, False)
    """
    kwargs = {name: value for name, value in kwargs.items() if name not in _IGNORED}
    wanted = kwargs.pop("batch_size", None)
    if wanted is not None and batch_size is not None and torch.Size(wanted) != torch.Size(batch_size):
        raise ValueError(
            f"to(batch_size={list(wanted)}) would change the batch size {list(batch_size)}: "
            "shared_td's to() moves and casts only. Set td.batch_size = ... (or reshape) "
            "before or after the move.")
    other = kwargs.pop("other", None)
    if other is None and args and _is_tensordict(args[0]):
        other, args = args[0], args[1:]
    if other is not None:
        if args or kwargs:
            raise TypeError("to(other) takes no other argument: give other.device and a dtype instead.")
        # its dtype: the one of all its tensor leaves, None if they differ (non-tensor
        # entries do not count), as tensordict 0.15.3's to(other=...) takes; a tensor's own
        return parse_device(other.device), other.dtype, False
    # (torch's own parser of Tensor.to's overloads, which tensordict uses as well)
    device, dtype, non_blocking, _memory_format = torch._C._nn._parse_to(*args, **kwargs)
    return parse_device(device), dtype, bool(non_blocking)


def _is_tensordict(value: Any) -> bool:
    return hasattr(value, "batch_size") and hasattr(value, "device") and not isinstance(value, torch.Tensor)


# True inside a ``to()`` call: the copies that a tree's nodes and a lazy stack's members
# make of themselves for it are left unlocked; only the outermost call locks its result,
# as its own tree was (tensordict 0.15.3 locks a copy as its root, whatever the nodes)
_INSIDE_TO: contextvars.ContextVar[bool] = contextvars.ContextVar("shared_td_inside_to", default=False)


@contextlib.contextmanager
def copied_as_root(source: Any, result: list):
    """Around the body of a ``to()``: ``result[0]``, set by the body, is locked when
    ``source`` is and this is the outermost ``to()`` (a new tree only: ``source`` itself,
    unchanged, is never touched).

    Example:
        >>> from shared_td import TensorDict
        >>> td = TensorDict(a=torch.zeros(2), n=TensorDict(b=torch.zeros(2), batch_size=[2]), batch_size=[2])
        >>> td["n"].lock_().is_locked, td.to(torch.float64)["n"].is_locked  # (a locked node, an unlocked root)
        (True, False)
        >>> td.lock_().to(torch.float64)["n"].is_locked
        True
    """
    outermost = not _INSIDE_TO.get()
    token = _INSIDE_TO.set(True)
    try:
        yield result
    finally:
        _INSIDE_TO.reset(token)
    moved = result[0] if result else None
    if outermost and moved is not None and moved is not source and source.is_locked and not moved.is_locked:
        moved.lock_()
