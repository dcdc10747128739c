"""How each container class appears on disk: its kind, its children, its meta.json.

The containers know nothing of files; this module is the one place that looks inside
them to describe them to the writer and to rebuild them in the loader.
"""
from __future__ import annotations

import pickle
from typing import Any, Iterator

import torch

from shared_td.persist import format as fmt

TENSORDICT, LAZY, TENSORCLASS, NON_TENSOR_DATA, NON_TENSOR_STACK = (
    "tensordict", "lazy", "tensorclass", "non_tensor_data", "non_tensor_stack",
)


def kind_of(obj: Any) -> str:
    """The node kind of a container instance."""
    from shared_td.containers.nontensor import NonTensorData, NonTensorStack
    from shared_td.containers.tensordict import TensorDict

    if isinstance(obj, NonTensorData):
        return NON_TENSOR_DATA
    if isinstance(obj, NonTensorStack):
        return NON_TENSOR_STACK
    if isinstance(obj, TensorDict):
        return TENSORDICT
    if getattr(type(obj), "_is_tensorclass", False):
        return TENSORCLASS
    from shared_td.containers.lazy import LazyStackedTensorDict

    if isinstance(obj, LazyStackedTensorDict):
        return LAZY
    raise TypeError(
        f"Cannot memory-map a {type(obj).__name__}: only TensorDict, "
        "LazyStackedTensorDict, tensorclass instances and non-tensor data can be."
    )


def type_string(obj: Any, kind: str) -> str:
    """The ``_type`` written in meta.json (tensordict's class names, for interop)."""
    if kind == TENSORCLASS:
        return str(type(obj))
    return {
        TENSORDICT: fmt.TENSORDICT_TYPE,
        LAZY: fmt.LAZY_STACK_TYPE,
        NON_TENSOR_DATA: fmt.NON_TENSOR_DATA_TYPE,
        NON_TENSOR_STACK: fmt.NON_TENSOR_STACK_TYPE,
    }[kind]


def child_type_name(obj: Any) -> str:
    """What a parent's meta.json records of a child collection (``{"type": ...}``)."""
    kind = kind_of(obj)
    return type(obj).__name__ if kind == TENSORCLASS else fmt.CHILD_TYPE_NAMES[type_string(obj, kind)]


def children(obj: Any, kind: str) -> Iterator[tuple[str, Any]]:
    """The sub-collections written as sub-directories, with their fixed names."""
    if kind == LAZY:
        for index, member in enumerate(obj.tensordicts):
            yield str(index), member
    elif kind == TENSORCLASS:
        yield fmt.TENSORCLASS_CHILD, obj._tensordict


def node_document(obj: Any, kind: str, entries: dict | None = None) -> tuple[bytes, dict[str, bytes]]:
    """The meta.json bytes of a node and the side files it needs (pickles).

    ``entries`` is the per-key metadata of a TensorDict node (built by the writer).
    """
    type_str = type_string(obj, kind)
    if kind == TENSORDICT:
        document = _tensordict_document(obj, entries or {}, type_str)
        return fmt.dumps(document), {}
    if kind == LAZY:
        document = {
            "_type": type_str, "_format_version": fmt.FORMAT_VERSION,
            "_class": fmt.CLASS_TAGS[type_str], "stack_dim": obj.stack_dim,
            "stack_dim_name": None,
        }
        return fmt.dumps(document), {}
    if kind == TENSORCLASS:
        return fmt.dumps({"_type": type_str}), {}
    if kind == NON_TENSOR_DATA:
        document = {"_type": type_str}
        side = {}
        if fmt.is_json_value(obj.data):
            document["data"] = _jsonable(obj.data)
        else:
            side[fmt.OTHER_PICKLE] = pickle.dumps({"data": obj.data})
        document.update({"_metadata": None, "_is_non_tensor": True})
        return fmt.dumps(document), side
    values = obj.tolist()
    document = {
        "_type": type_str, "_format_version": fmt.FORMAT_VERSION,
        "_class": fmt.CLASS_TAGS[type_str], "stack_dim": 0,
        "device": None if obj.device is None else str(obj.device),
    }
    if fmt.is_json_value(values):
        document["data"] = _jsonable(values)
        return fmt.dumps(document, compact=True), {}
    document["data"] = fmt.STACK_PICKLE
    return fmt.dumps(document, compact=True), {fmt.STACK_PICKLE: pickle.dumps(values)}


def _tensordict_document(td: Any, entries: dict, type_str: str) -> dict:
    document: dict = {}
    reserved: dict = {}
    for key, entry in entries.items():
        (reserved if key in fmt.NODE_FIELDS else document)[key] = entry
    document.update(
        {
            "shape": list(td.batch_size), "device": "cpu", "_type": type_str,
            "_format_version": fmt.FORMAT_VERSION, "_class": fmt.CLASS_TAGS[type_str],
        }
    )
    if td.names is not None:
        document["_names"] = td.names
    if reserved:
        document[fmt.RESERVED_ENTRIES] = reserved
    return document


def _jsonable(value: Any) -> Any:
    """Tuples and sets become lists, as JSON has only lists."""
    if isinstance(value, (list, tuple, set)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    return value


def side_files(kind: str) -> tuple[str, ...]:
    """Pickle side files a node kind may own (removed when a new save does not need them)."""
    if kind in (NON_TENSOR_DATA, TENSORCLASS):
        return (fmt.OTHER_PICKLE,)
    if kind == NON_TENSOR_STACK:
        return (fmt.STACK_PICKLE,)
    return ()


def empty_like_batch(td: Any) -> Any:
    """A TensorDict with ``td``'s batch size and names, on the CPU, without entries."""
    from shared_td.containers.tensordict import TensorDict

    return TensorDict._new_unsafe({}, td.batch_size, torch.device("cpu"), td.names)
