"""pin_memory(): the tensor leaves of a tree in pinned (page-locked) memory.

Copies from pinned memory to an accelerator are faster and can run asynchronously
(``to("cuda", non_blocking=True)``); a DataLoader with ``pin_memory=True`` calls
``pin_memory()`` on each batch it hands out. Every tensor leaf is copied once, on
``num_threads`` threads if asked (a tensor held under two keys gets one copy, which the
two keys share; tensordict 0.15.3 makes two, except with ``inplace=True``); as in
tensordict, the new tree has the same structure, classes and non-tensor values, and is
locked if the tree was. ``inplace=True`` puts the copies in the tree's own nodes, except
in a node that is locked, memory-mapped or shared, whose leaves stay where they are
(tensordict writes the pinned copies back into them: the same values, still pageable).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from shared_td.thread_pool import ThreadPool

if TYPE_CHECKING:  # (base imports this module)
    from shared_td.containers.base import TensorDictBase


def check_pinnable(what: str, fix: str) -> None:
    """Pinning needs an accelerator: say so before any copy (torch's own error, from
    ``pin_memory()`` or ``torch.empty(pin_memory=True)``, does not say why)."""
    if not torch.accelerator.is_available():
        raise RuntimeError(
            f"{what}: pinned memory needs a CUDA or other accelerator backend, and torch finds "
            f"none on this machine (torch.accelerator.is_available() is False). {fix}")


def pinned_copies(leaves: list[torch.Tensor], num_threads: int | None) -> dict[int, torch.Tensor]:
    """``{id(leaf): its pinned copy}`` for ``leaves`` (one copy per distinct tensor),
    made on ``num_threads`` threads when that is 2 or more."""
    distinct = {id(leaf): leaf for leaf in leaves}  # (keeps each alive: the ids stay theirs)
    if num_threads is not None and (not isinstance(num_threads, int) or num_threads < 0):
        raise ValueError(f"pin_memory(num_threads={num_threads!r}): an int >= 0 or None is needed.")
    pool = ThreadPool.start(min(num_threads, len(distinct)), "shared_td-pin") \
        if num_threads and num_threads > 1 and len(distinct) > 1 else None
    if pool is not None:  # (None also when the system starts no thread: RLIMIT_NPROC)
        with pool:
            return dict(zip(distinct, pool.map(torch.Tensor.pin_memory, distinct.values())))
    return {key: leaf.pin_memory() for key, leaf in distinct.items()}


def pinned_node(node: Any, copies: dict[int, torch.Tensor], inplace: bool) -> Any:
    """``node`` (a tensordict, lazy stack, tensorclass or non-tensor value) with its
    tensor leaves replaced by their ``copies``: a new node, or ``node`` itself if
    ``inplace`` (see the module's opening)."""
    if getattr(type(node), "_is_non_tensor", False):
        return node
    if getattr(type(node), "_is_tensorclass", False):
        inner = pinned_node(node._tensordict, copies, inplace)
        return node if inner is node._tensordict else type(node)._from_tensordict(inner)
    members = getattr(node, "tensordicts", None)
    if members is not None:  # a lazy stack: its members, stacked again
        pinned = [pinned_node(member, copies, inplace) for member in members]
        return node if inplace else node._restack(pinned, member_wise=True)
    entries = node._tensordict
    if inplace:
        if not (node._is_locked or node._is_memmap or node._is_shared):
            for key, value in entries.items():
                if isinstance(value, torch.Tensor):
                    entries[key] = copies[id(value)]  # an existing key: the dict keeps its size
        for value in entries.values():
            if not isinstance(value, torch.Tensor):
                pinned_node(value, copies, True)
        return node
    out = node._map_entries(
        lambda value: copies[id(value)] if isinstance(value, torch.Tensor) else pinned_node(value, copies, False),
        node._batch_size, node.names)
    if node._is_locked:
        out.lock_()
    return out


class PinningOps:
    """The mixin of TensorDictBase for pinning its leaves."""

    def pin_memory(self, num_threads: int | None = None, inplace: bool = False) -> "TensorDictBase":
        """A tensordict whose tensor leaves are in pinned (page-locked) memory, for fast
        and asynchronous copies to an accelerator (``to("cuda", non_blocking=True)``); a
        DataLoader with ``pin_memory=True`` calls it on each batch.

        Each tensor leaf is copied once (on ``num_threads`` threads when 2 or more); the
        result has the same structure, classes and non-tensor values, and is locked if
        this one is. ``inplace=True`` puts the copies in this tensordict's own nodes and
        returns it, except in nodes that are locked, memory-mapped or shared, whose
        leaves stay where they are (as in tensordict). Without an accelerator torch
        cannot pin: RuntimeError that says so.

        Examples:
            >>> import torch
            >>> from shared_td import TensorDict
            >>> td = TensorDict(obs=torch.zeros(1000, 3), batch_size=[1000])
            >>> pinned = td.pin_memory()  # doctest: +SKIP
            >>> pinned["obs"].is_pinned()  # doctest: +SKIP
            True
        """
        from shared_td.containers.consolidation import stored_leaves

        check_pinnable("pin_memory()", "Pinning only speeds up copies to an accelerator: "
                               "leave it out on this machine.")
        copies = pinned_copies(stored_leaves(self), num_threads)
        return pinned_node(self, copies, inplace)

    def pin_memory_(self, num_threads: int = 0) -> "TensorDictBase":
        """``pin_memory(num_threads=num_threads, inplace=True)`` (tensordict 0.15.3 keeps
        this name, deprecated, for that)."""
        return self.pin_memory(num_threads=num_threads, inplace=True)
