"""The tensorclass protocol: which objects are tensorclasses, and the one rule for
reaching the tensordict that holds a tensorclass's fields.

A tensorclass (``shared_td.containers.tensorclass``) marks its class with
``_is_tensorclass`` and keeps an instance's fields in an inner TensorDict, its
``_tensordict``; code that walks, prints, locks, writes or saves nested collections
treats the instance as that tensordict. (A TensorDict's own ``_tensordict`` is something
else: its dict of entries.) The protocol needs no container class, so it lives at the
bottom of the layers (it imports nothing): the containers and the persistence engine
below them use the same two functions.
"""
from __future__ import annotations

import functools
from typing import Any

__all__ = ["is_tensorclass", "mark_tensorclass", "unwrap_tensorclass"]


# asked once per class, not once per node of every walk (a class without the mark raises
# and catches an AttributeError inside getattr); bounded, so that classes made on the fly
# do not pile up
@functools.lru_cache(maxsize=4096)
def _marked(cls: type) -> bool:
    return bool(getattr(cls, "_is_tensorclass", False))


def is_tensorclass(obj: Any) -> bool:
    """True for a tensorclass (the class or an instance)."""
    return _marked(obj if isinstance(obj, type) else type(obj))


def mark_tensorclass(cls: type) -> None:
    """Make ``cls`` a tensorclass (the decorator's last step; a class seen before it was
    decorated is not remembered as a plain class)."""
    cls._is_tensorclass = True
    _marked.cache_clear()


def unwrap_tensorclass(value: Any) -> Any:
    """The inner tensordict of a tensorclass instance; any other value (a tensordict, a
    tensor, a non-tensor leaf) unchanged.

    Example:
        >>> import torch
        >>> from shared_td import TensorDict, tensorclass
        >>> @tensorclass
        ... class Step:
        ...     obs: torch.Tensor
        >>> step = Step(obs=torch.zeros(2, 3), batch_size=[2])
        >>> type(unwrap_tensorclass(step)).__name__, unwrap_tensorclass(step)["obs"].shape
        ('TensorDict', torch.Size([2, 3]))
        >>> td = TensorDict(a=torch.ones(1))
        >>> unwrap_tensorclass(td) is td
        True
    """
    return value._tensordict if _marked(type(value)) else value
