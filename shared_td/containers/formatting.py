"""The repr of tensordicts, in tensordict 0.15's compact style.

``TensorDict(batch_size=[3], fields={a: f32[4], n: {b: bf16[2]}, task: str})``: entries
in sorted order, each tensor as its dtype and feature shape (the dims after the batch).
A container that does not fit in 80 columns is written one entry per line, and so on
recursively for each nested one that does not fit on its line.
"""
from __future__ import annotations

from typing import Any, Union

import torch

from shared_td.containers.value_kinds import is_non_tensor, is_tensor_collection
from shared_td.tensorclass_protocol import unwrap_tensorclass


_WIDTH = 80
_INDENT = "    "

# An entry's rendering: a token ("f32[4]", "str") or a nested container as
# (prefix, [(key, entry), ...]), the prefix naming a class or extra batch dims.
Entry = Union[str, tuple]


def _dtype_name(dtype: torch.dtype) -> str:
    """f32, i64, u8, c64, bf16, bool, f8_e4m3fn: shortened as tensordict does."""
    name = str(dtype).replace("torch.", "")
    for long, short in (("float", "f"), ("uint", "u"), ("int", "i"), ("complex", "c")):
        name = name.replace(long, short)
    return name


def _entry(value: Any, owner: Any) -> Entry:
    if isinstance(value, torch.Tensor):
        feature = ",".join(str(d) for d in value.shape[owner.batch_dims :])
        token = f"{_dtype_name(value.dtype)}[{feature}]"
        if owner.device is None and value.device.type != "cpu":
            token += f"@{value.device}"
        return token
    if is_non_tensor(value):
        return type(value.data).__name__ if type(value).__name__ == "NonTensorData" else type(value).__name__
    if is_tensor_collection(value):
        prefix = "" if type(value).__name__ == "TensorDict" else type(value).__name__
        extra = value.batch_size[owner.batch_dims :]
        if extra:
            prefix += f"[{','.join(str(d) for d in extra)}]"
        return prefix, _entries(value)
    return type(value).__name__


def _entries(td: Any) -> list:
    inner = unwrap_tensorclass(td)
    # A container may render its own entries (a lazy stack shows differing dims as -1).
    hook = getattr(inner, "_repr_entry", None)
    entries = [
        (key, hook(key) if hook is not None else _entry(inner._get_str(key, None), td))
        for key in inner._keys_str()
    ]
    # tensordict sorts the rendered "key: value" strings, not the bare keys.
    entries = sorted(entries, key=lambda entry: f"{entry[0]}: {_flat(entry[1])}")
    # a tensorclass lists its empty fields last, as "name: None"
    return entries + [(name, "None") for name in getattr(td, "_empty_fields", tuple)()]


def _flat(entry: Entry) -> str:
    if isinstance(entry, str):
        return entry
    prefix, entries = entry
    return prefix + "{" + ", ".join(f"{k}: {_flat(v)}" for k, v in entries) + "}"


def _render(entry: Entry, indent: str, used: int, tail: int) -> str:
    """One line if it fits in the width, given ``used`` columns before it and ``tail``
    after it; otherwise one entry per line, each rendered by the same rule."""
    flat = _flat(entry)
    if isinstance(entry, str) or not entry[1] or used + len(flat) + tail <= _WIDTH:
        return flat
    prefix, entries = entry
    pad = indent + _INDENT
    lines = []
    for i, (key, value) in enumerate(entries):
        value_tail = tail + 1 if i == len(entries) - 1 else 1
        lines.append(f"{pad}{key}: {_render(value, pad, len(pad) + len(key) + 2, value_tail)}")
    return prefix + "{\n" + ",\n".join(lines) + "}"


def format_collection(td: Any, name: str | None = None) -> str:
    """The repr of a tensordict (or tensorclass, through its inner tensordict)."""
    name = name or type(td).__name__
    inner = unwrap_tensorclass(td)
    header = [f"batch_size=[{','.join(str(d) for d in td.batch_size)}]"]
    if getattr(td, "device", None) is not None:
        header.append(f"device={td.device}")
    if inner is td and getattr(inner, "_stack_dim", None) is not None:  # (a tensorclass: not shown)
        header.append(f"stack_dim={inner._stack_dim}")
    head = f"{name}(" + "".join(f"{h}, " for h in header) + "fields="
    return head + _render(("", _entries(td)), "", len(head), 1) + ")"
