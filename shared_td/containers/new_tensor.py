"""``td.new_tensor(data)``: a tensordict whose leaves are copies of ``data``, one per leaf
of ``td``, each of that leaf's dtype (tensordict 0.15.3's ``new_tensor``, built as
``torch.Tensor.new_tensor`` is, leaf by leaf)."""
from __future__ import annotations

from typing import Any

import torch

from shared_td.containers.value_kinds import is_non_tensor, is_tensor_collection, parse_device
from shared_td.keys import RAISE
from shared_td.tensorclass_protocol import unwrap_tensorclass

#: ``device`` not given: each copy goes to its data's device
DATA_DEVICE = object()


def new_tensor(td: Any, data: Any, *, dtype: torch.dtype | None = None, device: Any = DATA_DEVICE,
               requires_grad: bool = False, pin_memory: bool | None = None) -> Any:
    """A TensorDict of batch size ``data``'s shape whose every tensor leaf is a copy of
    ``data`` (a tensor, a list, tuple, NumPy array or number: what
    ``torch.Tensor.new_tensor`` takes) of the dtype of ``td``'s leaf there (``dtype``
    overrides it), or, for a tensordict or tensorclass ``data``, a copy of its leaf at
    the same key (a KeyError names a key it lacks). The copies are on ``device``, else
    on the data's device; the result's device is ``device``, else ``data``'s. A
    non-tensor entry is :func:`non_tensor_like` (a NonTensorData keeps ``td``'s value
    for every row), and a lazy stack gives a TensorDict of its common keys, as in
    tensordict 0.15.3 (``td.new_tensor`` of a tensorclass gives one of its class).

    Example:
        >>> from shared_td import TensorDict
        >>> td = TensorDict(a=torch.zeros(3), b=torch.zeros(3, dtype=torch.int64), batch_size=[3])
        >>> out = td.new_tensor([1, 2])
        >>> out.batch_size, out["a"], out["b"]
        (torch.Size([2]), tensor([1., 2.]), tensor([1, 2]))
    """
    from shared_td.containers.tensordict import TensorDict

    if is_tensor_collection(data):
        shape, data_device = data.batch_size, data.device
    else:
        data = data if isinstance(data, torch.Tensor) else torch.as_tensor(data)  # (copied per leaf)
        shape, data_device = data.shape, data.device
    given = {"dtype": dtype, "requires_grad": requires_grad, "pin_memory": pin_memory}
    if device is not DATA_DEVICE:
        device = given["device"] = parse_device(device)
    entries, out_device = {}, data_device if device is DATA_DEVICE else device
    for key in unwrap_tensorclass(td)._keys_str():
        value = td.get(key)  # (a lazy stack's: its common keys, stacked)
        source = data.get(key, RAISE) if is_tensor_collection(data) else data  # (a KeyError names the key)
        if is_non_tensor(value):  # no leaf to copy the data as: td's value, as in tensordict 0.15.3
            entries[key] = non_tensor_like(value, torch.Size(shape), out_device)
            continue
        entries[key] = _copy(value, source, device, given) if isinstance(value, torch.Tensor) else \
            value.new_tensor(source, **given)
    return TensorDict._new_unsafe(entries, torch.Size(shape), out_device)


def non_tensor_like(value: Any, batch_size: torch.Size, device: Any) -> Any:
    """The entry that the ``new_*`` methods (``new_empty``/``new_zeros``/...,
    ``new_tensor``) make of the non-tensor entry ``value`` for a batch of
    ``batch_size`` on ``device``, as tensordict 0.15.3 makes it: a NonTensorData keeps
    its one value for every row; a NonTensorStack, whose rows have no value to make,
    becomes an empty tensordict in its place.

    Example:
        >>> non_tensor_like(NonTensorData("x", batch_size=[3]), torch.Size([2]), None).tolist()
        ['x', 'x']
    """
    from shared_td.containers.nontensor import NonTensorData
    from shared_td.containers.tensordict import TensorDict

    if type(value) is NonTensorData:
        return NonTensorData(value.data, batch_size=batch_size, device=device)
    return TensorDict._new_unsafe({}, batch_size, device)


def _copy(leaf: torch.Tensor, source: torch.Tensor, device: Any, given: dict) -> torch.Tensor:
    """``leaf.new_tensor(source, ...)``, without torch's warning on copying a tensor."""
    out = source.detach().to(device=source.device if device is DATA_DEVICE else device,
                             dtype=given["dtype"] or leaf.dtype, copy=True)
    if given["pin_memory"]:
        out = out.pin_memory()
    return out.requires_grad_() if given["requires_grad"] else out
