"""``clear_device_``, ``auto_device_`` and ``filter_empty_``, tensordict 0.15.3's in-place
resets of a tree: a mixin of TensorDictBase. None of them moves or copies a leaf.

A lazy stack does each on its members (its device is theirs); a non-tensor entry has no
nested tensordict and keeps its own device.
"""
from __future__ import annotations

from typing import Any

import torch

from shared_td.containers.value_kinds import is_non_tensor, is_tensor_collection
from shared_td.tensorclass_protocol import unwrap_tensorclass

__all__ = ["TreeResets"]


class TreeResets:
    """Mixin of TensorDictBase: in-place resets of the device and of empty branches."""

    def clear_device_(self) -> Any:
        """Set the device of this tensordict and of its nested ones to None; returns self.

        The leaves stay where they are; afterwards leaves of any device may be set.
        Allowed on a locked tensordict, as in tensordict.

        Example:
            >>> td = TensorDict(a=torch.zeros(3), n={"b": torch.zeros(3)}, batch_size=[3], device="cpu")
            >>> td.clear_device_().device, td["n"].device, td["a"].device
            (None, None, device(type='cpu'))
        """
        for node in _nodes(self):
            node._device = None
        if hasattr(self, "_empty_device"):  # (a lazy stack with no member: its own device)
            self._empty_device = None
        return self

    def auto_device_(self) -> Any:
        """Set the device of this tensordict and of its nested ones to the device of its
        tensor leaves when they all have one, else to None; returns self.

        Example:
            >>> td = TensorDict(a=torch.zeros(3), n={"b": torch.zeros(3)}, batch_size=[3])
            >>> td.device, td.auto_device_().device, td["n"].device
            (None, device(type='cpu'), device(type='cpu'))
        """
        devices = {leaf.device for leaf in self.values(True, True) if isinstance(leaf, torch.Tensor)}
        device = devices.pop() if len(devices) == 1 else None
        for node in _nodes(self):
            node._device = device
        return self

    def filter_empty_(self) -> Any:
        """Remove, in place, the nested tensordicts that hold no leaf (tensor or
        non-tensor entry), also those that hold only empty ones; returns self.

        Raises:
            LockedTensorDictError: if one would be removed from a locked tensordict.

        Example:
            >>> td = TensorDict(a=torch.zeros(3), b={}, c={"d": {}}, batch_size=[3])
            >>> list(td.filter_empty_().keys())
            ['a']
        """
        members = getattr(self, "tensordicts", None)
        if members is not None:
            for member in members:
                member.filter_empty_()
            return self
        for key, value in list(self._tensordict.items()):
            if isinstance(value, torch.Tensor) or is_non_tensor(value) or not is_tensor_collection(value):
                continue
            inner = unwrap_tensorclass(value)
            inner.filter_empty_()
            if not _holds_entries(inner):
                self._check_unlocked((key,), "remove an empty nested tensordict")
                del self._tensordict[key]
        return self


def _holds_entries(node: Any) -> bool:
    members = getattr(node, "tensordicts", None)
    if members is not None:
        return any(_holds_entries(member) for member in members)
    return bool(node._tensordict)


def _nodes(td: Any):
    """``td`` and every tensordict nested in it (lazy stacks: their members), not the
    non-tensor entries (but ``td`` itself when it is one)."""
    node = unwrap_tensorclass(td)
    if is_non_tensor(node):  # a NonTensorData/NonTensorStack reset itself: its own device only
        yield node
        return
    members = getattr(node, "tensordicts", None)
    if members is not None:
        for member in members:
            yield from _nodes(member)
        return
    yield node
    for value in node._tensordict.values():
        if not isinstance(value, torch.Tensor) and is_tensor_collection(value) and not is_non_tensor(value):
            yield from _nodes(value)
