"""The on-disk format: byte-compatible with tensordict 0.15.3 (docs/format.md).

One ``meta.json`` per node, raw little-endian C-order leaf files ``<name>.memmap``,
nested collections as sub-directories, non-tensor data as JSON (pickle only when asked
for on load).  Where tensordict loses information we keep it in fields that tensordict
ignores, so both libraries still read each other's directories:

* keys named like node fields (``shape``, ``device``, ``_type``, ...) are listed under
  ``"_shared_td_entries"`` (a dict without ``dtype``/``type``, which tensordict skips);
* float8 dtypes are written under their torch names (tensordict 0.15.3 cannot load
  them; we can).
"""
from __future__ import annotations

import json
import os
import re
import threading
from typing import Any

import torch

from shared_td.keys import encode_key, is_safe_legacy_name
from shared_td.storage.files import Directory

META = "meta.json"
LEAF_SUFFIX = ".memmap"
OTHER_PICKLE = "other.pickle"  # non-JSON data of a NonTensorData or tensorclass
STACK_PICKLE = "pickle.pkl"  # non-JSON data of a NonTensorStack
TENSORCLASS_CHILD = "_tensordict"
FORMAT_VERSION = 1
RESERVED_ENTRIES = "_shared_td_entries"

TENSORDICT_TYPE = "<class 'tensordict._td.TensorDict'>"
LAZY_STACK_TYPE = "<class 'tensordict._lazy.LazyStackedTensorDict'>"
NON_TENSOR_DATA_TYPE = "<class 'tensordict.tensorclass.NonTensorData'>"
NON_TENSOR_STACK_TYPE = "<class 'tensordict.tensorclass.NonTensorStack'>"
CLASS_TAGS = {
    TENSORDICT_TYPE: "tensordict:TensorDict",
    LAZY_STACK_TYPE: "tensordict:LazyStackedTensorDict",
    NON_TENSOR_STACK_TYPE: "tensordict:NonTensorStack",
}
# What a parent's meta.json says of a child collection, by the child's _type.
CHILD_TYPE_NAMES = {
    TENSORDICT_TYPE: "TensorDict",
    LAZY_STACK_TYPE: "LazyStackedTensorDict",
    NON_TENSOR_DATA_TYPE: "NonTensorData",
    NON_TENSOR_STACK_TYPE: "NonTensorStack",
}
NODE_FIELDS = frozenset(
    {"shape", "device", "_type", "_format_version", "_class", "_names", RESERVED_ENTRIES}
)

_DTYPES = [
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.uint16, torch.uint32, torch.uint64, torch.float16, torch.bfloat16, torch.float32,
    torch.float64, torch.complex32, torch.complex64, torch.complex128,
    torch.qint8, torch.qint32, torch.quint8, torch.quint4x2,
]
_DTYPES += [getattr(torch, name) for name in dir(torch) if name.startswith("float8_")]
DTYPE_BY_NAME = {str(dtype): dtype for dtype in _DTYPES}


class FormatError(ValueError):
    """A saved directory does not hold what its meta.json says (or is not one at all)."""


def dtype_name(dtype: torch.dtype) -> str:
    """The dtype as written in meta.json (``"torch.float32"``)."""
    return str(dtype)


def dtype_from_name(name: str, *, where: str) -> torch.dtype:
    """The dtype written as ``name``; FormatError naming the file when unknown."""
    try:
        return DTYPE_BY_NAME[name]
    except KeyError:
        raise FormatError(
            f"{where}: unknown dtype {name!r}; this torch knows {sorted(DTYPE_BY_NAME)}."
        ) from None


def node_entries(meta: dict) -> dict[str, dict]:
    """The per-key entries of a TensorDict node's meta.json, reserved names included.

    Examples:
        >>> node_entries({"x": {"dtype": "torch.float32", "shape": [2]}, "shape": [2]})
        {'x': {'dtype': 'torch.float32', 'shape': [2]}}
    """
    entries = {k: v for k, v in meta.items() if isinstance(v, dict) and k not in NODE_FIELDS}
    reserved = meta.get(RESERVED_ENTRIES)
    if isinstance(reserved, dict):
        entries.update(reserved)
    return entries


def file_names(key: str, *, leaf: bool, robust_key: bool = True) -> list[str]:
    """The file names a key may have, in the order a loader tries them.

    Its robust (encoded) name first, then its raw legacy name when that stays inside
    the directory (tensordict 0.15.3's rule, spec §4.7). A leaf's names end in .memmap.

    Examples:
        >>> file_names("a b", leaf=True)
        ['a%20b.memmap', 'a b.memmap']
        >>> file_names("../x", leaf=False)
        ['..%2Fx']
    """
    suffix = LEAF_SUFFIX if leaf else ""
    names = [encode_key(key) + suffix] if robust_key else []
    if is_safe_legacy_name(key, directory=not leaf) and key + suffix not in names:
        names.append(key + suffix)
    return names


def leaf_entry(tensor: torch.Tensor) -> dict:
    """The meta.json entry of a tensor leaf."""
    return {
        "device": "cpu",
        "shape": list(tensor.shape),
        "dtype": dtype_name(tensor.dtype),
        "is_nested": False,
    }


def is_json_value(value: Any) -> bool:
    """True if ``value`` survives a JSON round trip as tensordict expects it."""
    if value is None or isinstance(value, (str, bool, int)):
        return True
    if isinstance(value, float):
        return value == value and value not in (float("inf"), float("-inf"))
    if isinstance(value, (list, tuple)):  # a set is pickled, as tensordict does: JSON
        return all(is_json_value(v) for v in value)  # would load it as a list
    if isinstance(value, dict):
        return all(isinstance(k, str) and is_json_value(v) for k, v in value.items())
    return False


def dumps(document: dict, *, compact: bool = False) -> bytes:
    """meta.json bytes, with the separators tensordict writes (spaced, or compact)."""
    separators = (",", ":") if compact else (", ", ": ")
    return json.dumps(document, separators=separators).encode("utf-8")


def write_temporary(directory: Directory, name: str, data: bytes) -> str:
    """Write ``data`` to a new temporary file beside ``name`` in ``directory``; returns
    the temporary's name.

    The caller renames it over ``name`` (atomic: readers see the old or the new file).
    A failed write removes the temporary at once; no room is a StorageFullError naming
    the file and the bytes needed.
    """
    temporary = f"{name}.{os.getpid()}.{threading.get_ident()}.tmp"
    directory.unlink(temporary)  # left by a killed writer of the same pid and thread id
    directory.write_new_file(temporary, data, final=name)
    return temporary


# write_temporary's names for the files of a node: <file>.<pid>.<thread id>.tmp
_TEMPORARY_NAME = re.compile(
    "(?:" + "|".join(re.escape(n) for n in (META, OTHER_PICKLE, STACK_PICKLE)) + r")\.(?P<pid>[0-9]+)\.[0-9]+\.tmp"
)


def temporary_writer_pid(name: str) -> int | None:
    """The pid of the writer that made ``name`` with :func:`write_temporary`, else None.

    Examples:
        >>> temporary_writer_pid("meta.json.4242.1399.tmp"), temporary_writer_pid("notes.tmp")
        (4242, None)
    """
    match = _TEMPORARY_NAME.fullmatch(name)
    return int(match["pid"]) if match else None
