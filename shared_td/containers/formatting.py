"""The repr of tensordicts, in tensordict 0.15's compact style.

``TensorDict(batch_size=[3], fields={a: f32[4], n: {b: bf16[2]}, task: str})``: keys in
sorted order, each tensor as its dtype and feature shape (the dims after the batch).
"""
from __future__ import annotations

from typing import Any

import torch

_SHORT_DTYPES = {
    torch.float32: "f32", torch.float64: "f64", torch.float16: "f16", torch.bfloat16: "bf16",
    torch.int8: "i8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64",
    torch.uint8: "u8", torch.uint16: "u16", torch.uint32: "u32", torch.uint64: "u64",
    torch.complex64: "c64", torch.complex128: "c128", torch.complex32: "c32", torch.bool: "bool",
}
_ONE_LINE_LIMIT = 80


def _dtype_name(dtype: torch.dtype) -> str:
    return _SHORT_DTYPES.get(dtype, str(dtype).replace("torch.", ""))


def _format_value(value: Any, batch_dims: int) -> str:
    from shared_td.containers.base import is_non_tensor, is_tensor_collection

    if isinstance(value, torch.Tensor):
        feature = ",".join(str(d) for d in value.shape[batch_dims:])
        return f"{_dtype_name(value.dtype)}[{feature}]"
    if is_non_tensor(value):
        return type(value.data).__name__ if type(value).__name__ == "NonTensorData" else type(value).__name__
    if is_tensor_collection(value):
        inner = value if hasattr(value, "_keys_str") else value._tensordict
        body = _format_fields(inner, value.batch_dims)
        if type(value).__name__ in ("TensorDict",):
            return body
        return f"{type(value).__name__}{body}"
    return type(value).__name__


def _format_fields(td: Any, batch_dims: int) -> str:
    keys = sorted(td._keys_str())
    return "{" + ", ".join(f"{k}: {_format_value(td._get_str(k, None), batch_dims)}" for k in keys) + "}"


def format_collection(td: Any, name: str | None = None) -> str:
    """The repr of a tensordict (or tensorclass, through its inner tensordict)."""
    name = name or type(td).__name__
    inner = td if hasattr(td, "_keys_str") else td._tensordict
    header = [f"batch_size=[{','.join(str(d) for d in td.batch_size)}]"]
    if getattr(td, "device", None) is not None:
        header.append(f"device={td.device}")
    if getattr(inner, "_stack_dim", None) is not None:
        header.append(f"stack_dim={inner._stack_dim}")
    keys = sorted(inner._keys_str())
    fields = [f"{k}: {_format_value(inner._get_str(k, None), td.batch_dims)}" for k in keys]
    one_line = f"{name}({', '.join(header)}, fields={{{', '.join(fields)}}})"
    if len(one_line) <= _ONE_LINE_LIMIT:
        return one_line
    body = ",\n    ".join(fields)
    return f"{name}({', '.join(header)}, fields={{\n    {body}}})"
