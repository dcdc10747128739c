"""The checked model of one node's meta.json: NodeMeta, LeafMeta and ChildMeta.

``NodeMeta.from_json`` is the one place where a meta.json read from disk (or a layout
from the coordinator) is validated: the loader raises its errors, ``shared-td verify``
reports them. ``NodeMeta.to_json`` writes one, and the ``for_*`` constructors give the
layout of each node type as tensordict 0.15.3 writes it, field by field.

The names it writes and reads (node types, field names, side files) and the rules
shared with other modules (dtype names, ``node_entries``, ``check_batch_fits``) are in
format.py (docs/format.md).
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from shared_td.errors import FormatError
from shared_td.persist.format import (
    CLASS_TAGS, DTYPE_BY_NAME, EMPTY_STACK_BATCH, FORMAT_VERSION, LAZY_STACK_TYPE, NODE_FIELDS, STACK_MEMBERS,
    NON_TENSOR_DATA_TYPE, NON_TENSOR_STACK_TYPE, RESERVED_ENTRIES, STACK_PICKLE, TENSORDICT_TYPE,
    check_batch_fits, dtype_from_name, dtype_name, dumps, node_entries, shown_value,
)


#: No file holds more bytes than this; a larger shape is a damaged or hostile meta.json.
_MAX_BYTES = sys.maxsize
#: How deep the lists of a NonTensorStack's ``data`` may nest: one level per dimension of
#: its batch size (and one per level of nested list values). A load walks them
#: recursively, two frames a level, so a few hundred levels (~490 under Python's default
#: limit) ended in a RecursionError instead of an error naming the file. 100 is far more
#: dims than any batch has (tensordict 0.15.3 takes seconds to load a stack 25 deep);
#: refused here, in the one check of meta.json, ``shared-td verify`` refuses it too.
MAX_STACK_DEPTH = 100


@dataclass(frozen=True)
class LeafMeta:
    """A tensor leaf as its node's meta.json describes it (checked).

    ``shape`` is the shape of the tensor (of its sizes, for a nested tensor).
    """

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    is_nested: bool = False

    @property
    def nbytes(self) -> int:
        """Bytes its file must hold (of the data file of a nested tensor: unknown here)."""
        return math.prod(self.shape) * self.dtype.itemsize

    @classmethod
    def of(cls, key: str, tensor: torch.Tensor) -> "LeafMeta":
        """The entry the writer records for ``tensor`` (written to the CPU)."""
        return cls(key, tuple(tensor.shape), tensor.dtype)

    def to_json(self) -> dict:
        """Its entry in the node's meta.json (tensordict's field order)."""
        return {"device": "cpu", "shape": list(self.shape), "dtype": dtype_name(self.dtype),
                "is_nested": self.is_nested}


@dataclass(frozen=True)
class ChildMeta:
    """A sub-collection (a directory) listed in its parent's meta.json."""

    key: str
    type_name: str  # "TensorDict", "NonTensorData", ... as the parent records it

    def to_json(self) -> dict:
        return {"type": self.type_name}


@dataclass(frozen=True)
class NodeMeta:
    """One node's meta.json, checked: what a load of that node may rely on.

    Built by :meth:`from_json`, the one place where meta.json is validated: the loader
    raises its errors, ``shared-td verify`` reports them. ``batch_size`` is None where
    the node kind records none (lazy stacks, non-tensor data, tensorclasses); ``entries``
    are the leaves and children of a TensorDict node in file order; ``document`` is the
    parsed JSON (non-tensor ``data``, tensorclass fields).

    Written the other way by :meth:`to_json`: a node kind builds its NodeMeta with one
    of the ``for_*`` constructors below (the layouts of tensordict 0.15.3, field by
    field), whose ``document`` holds the node's own fields in the order written.

    Example:
        >>> meta = NodeMeta.from_json({"_type": TENSORDICT_TYPE, "shape": [2],
        ...     "x": {"dtype": "torch.int8", "shape": [2, 3]}}, where="/d/meta.json")
        >>> meta.batch_size, meta.entries[0].nbytes
        ((2,), 6)
    """

    path: str | None  # the meta.json it was read from (None: built to be written)
    type: str
    batch_size: tuple[int, ...] | None = None
    device: str | None = None
    names: tuple | None = None
    stack_dim: int = 0
    stack_dim_name: str | None = None  # a lazy stack's name of its stack_dim
    entries: tuple[LeafMeta | ChildMeta, ...] = ()
    document: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)
    compact: bool = field(default=False, compare=False, repr=False)  # written without spaces

    def read_at(self, path: str) -> "NodeMeta":
        """This checked NodeMeta as read from the file ``path`` too (a meta.json of the
        same bytes: what :meth:`from_json` found does not depend on where it was read)."""
        copy = object.__new__(NodeMeta)
        copy.__dict__.update(self.__dict__)
        object.__setattr__(copy, "path", path)
        return copy

    def to_json(self) -> bytes:
        """The meta.json bytes: the entries first, in order (those named like node
        fields last, under RESERVED_ENTRIES), then the node's fields of ``document``.

        Example:
            >>> print(NodeMeta.for_tensorclass("<class 'mod.Obs'>").to_json().decode())
            {"_type": "<class 'mod.Obs'>"}
        """
        written: dict = {}
        reserved: dict = {}
        for entry in self.entries:
            (reserved if entry.key in NODE_FIELDS else written)[entry.key] = entry.to_json()
        for name, value in self.document.items():
            if name not in written and name != RESERVED_ENTRIES:  # a read document lists entries too
                written[name] = value
        if reserved:
            written[RESERVED_ENTRIES] = reserved
        return dumps(written, compact=self.compact)

    # --------------------------------------------------- the layouts a writer builds
    @classmethod
    def for_tensordict(cls, batch_size: Any, names: Any, entries: tuple) -> "NodeMeta":
        """A TensorDict node (its leaves are written to the CPU)."""
        document = {"shape": list(batch_size), "device": "cpu", "_type": TENSORDICT_TYPE,
                    "_format_version": FORMAT_VERSION, "_class": CLASS_TAGS[TENSORDICT_TYPE]}
        if names is not None:
            document["_names"] = list(names)
        return cls(None, TENSORDICT_TYPE, tuple(batch_size), "cpu", None if names is None else tuple(names),
                   entries=tuple(entries), document=document)

    @classmethod
    def for_lazy_stack(cls, stack_dim: int, stack_dim_name: str | None = None,
                       empty_batch: Any = None, members: int | None = None) -> "NodeMeta":
        """A LazyStackedTensorDict node (its members are the directories 0/, 1/, ...);
        ``members``: how many, written under STACK_MEMBERS (a load checks that each is
        there); ``empty_batch``: the batch size of a stack without members, written under
        EMPTY_STACK_BATCH (members give it otherwise)."""
        document = {"_type": LAZY_STACK_TYPE, "_format_version": FORMAT_VERSION,
                    "_class": CLASS_TAGS[LAZY_STACK_TYPE], "stack_dim": stack_dim, "stack_dim_name": stack_dim_name}
        if members is not None:
            document[STACK_MEMBERS] = members
        if empty_batch is not None:
            document[EMPTY_STACK_BATCH] = list(empty_batch)
        return cls(None, LAZY_STACK_TYPE, stack_dim=stack_dim, stack_dim_name=stack_dim_name, document=document)

    @classmethod
    def for_tensorclass(cls, type_str: str) -> "NodeMeta":
        """A tensorclass node (its tensordict is the directory _tensordict/)."""
        return cls(None, type_str, document={"_type": type_str})

    @classmethod
    def for_non_tensor_data(cls, data: Any, *, in_json: bool) -> "NodeMeta":
        """A NonTensorData node; ``in_json=False``: ``data`` goes to OTHER_PICKLE."""
        document: dict = {"_type": NON_TENSOR_DATA_TYPE}
        if in_json:
            document["data"] = _jsonable(data)
        document.update({"_metadata": None, "_is_non_tensor": True})
        return cls(None, NON_TENSOR_DATA_TYPE, document=document)

    @classmethod
    def for_non_tensor_stack(cls, device: Any, values: Any, *, in_json: bool) -> "NodeMeta":
        """A NonTensorStack node (compact JSON); ``in_json=False``: the values go to
        STACK_PICKLE, which ``data`` names."""
        document = {"_type": NON_TENSOR_STACK_TYPE, "_format_version": FORMAT_VERSION,
                    "_class": CLASS_TAGS[NON_TENSOR_STACK_TYPE], "stack_dim": 0,
                    "device": None if device is None else str(device),
                    "data": _jsonable(values) if in_json else STACK_PICKLE}
        return cls(None, NON_TENSOR_STACK_TYPE, document=document, compact=True)

    @classmethod
    def from_json(cls, document: Any, *, where: str) -> "NodeMeta":
        """Check a parsed meta.json; FormatError naming ``where`` and the field if wrong."""
        if not isinstance(document, dict):
            raise FormatError(where, f"holds a JSON {type(document).__name__}, not an object")
        type_str = document.get("_type")
        if not isinstance(type_str, str):
            raise FormatError(where, f"{shown_value(type_str)} is not a class name", field="_type")
        device = _device(document.get("device"), where, "device")
        if type_str == TENSORDICT_TYPE or _names_tensordict_subclass(type_str):
            type_str = TENSORDICT_TYPE  # (a subclass's own _type stays in document)
            batch_size = _sizes(document.get("shape", []), where, "shape")
            entries = tuple(_entry(key, item, where) for key, item in node_entries(document).items())
            for leaf in entries:
                if isinstance(leaf, LeafMeta) and not leaf.is_nested:
                    check_batch_fits(where, leaf.key, batch_size, leaf.shape)
            return cls(where, type_str, batch_size, device, _names(document, batch_size, where),
                       entries=entries, document=document)
        stack_dim = document.get("stack_dim", 0)
        if type(stack_dim) is not int or stack_dim < 0:
            raise FormatError(where, f"{shown_value(stack_dim)} is not a dimension (an integer >= 0)", field="stack_dim")
        stack_dim_name = document.get("stack_dim_name")
        if stack_dim_name is not None and not isinstance(stack_dim_name, str):
            raise FormatError(where, f"{shown_value(stack_dim_name)} is not a name (a string or null)", field="stack_dim_name")
        if type_str == NON_TENSOR_STACK_TYPE and _nests_deeper(document.get("data"), MAX_STACK_DEPTH):
            raise FormatError(where, f"its lists nest more than {MAX_STACK_DEPTH} deep (one level per "
                              "batch dimension): a damaged or hostile meta.json", field="data")
        if type_str == LAZY_STACK_TYPE:
            _check_stack_fields(document, stack_dim, where)
        return cls(where, type_str, None, device, stack_dim=stack_dim, stack_dim_name=stack_dim_name, document=document)


def _check_stack_fields(document: dict, stack_dim: int, where: str) -> None:
    """shared_td's fields of a lazy stack's meta.json: EMPTY_STACK_BATCH has a 0 at
    ``stack_dim``, STACK_MEMBERS is a count (0 beside EMPTY_STACK_BATCH)."""
    members = document.get(STACK_MEMBERS)
    if members is not None and (type(members) is not int or members < 0):
        raise FormatError(where, f"{shown_value(members)} is not a member count (an integer >= 0)",
                          field=STACK_MEMBERS)
    if EMPTY_STACK_BATCH in document:  # a 0 at stack_dim
        empty = _sizes(document[EMPTY_STACK_BATCH], where, EMPTY_STACK_BATCH)
        if len(empty) <= stack_dim or empty[stack_dim] != 0:
            raise FormatError(where, f"{list(empty)} is no batch size of an empty stack along "
                              f"stack_dim {stack_dim}", field=EMPTY_STACK_BATCH)
        if members:
            raise FormatError(where, f"{members} members, but {EMPTY_STACK_BATCH} is written only for a "
                              "stack without members", field=STACK_MEMBERS)


def _names_tensordict_subclass(type_str: str) -> bool:
    """Whether ``type_str`` names a subclass of TensorDict defined in this process (the
    node kinds decide: tensordict 0.15.3 writes a subclass's own ``_type`` over the
    TensorDict layout)."""
    from shared_td.persist import nodes  # (nodes builds on this module)

    try:
        return nodes.kind_for_type_string(type_str).name == nodes.TENSORDICT
    except RuntimeError:  # no kind reads it: the loader says so
        return False


def _entry(key: str, item: dict, where: str) -> LeafMeta | ChildMeta:
    # every field name below is built only on an error: this runs once per leaf of a load
    if "type" in item:
        if not isinstance(item["type"], str):
            raise FormatError(where, f"{shown_value(item['type'])} is not a class name", field=f"{key}.type")
        return ChildMeta(key, item["type"])
    if not ("dtype" in item and "shape" in item):
        raise FormatError(where, "neither a tensor (dtype and shape) nor a collection (type)", field=key)
    name = item["dtype"]
    dtype = DTYPE_BY_NAME.get(name) if isinstance(name, str) else None
    if dtype is None:
        dtype_from_name(name, where=where, field=f"{key}.dtype")  # raises, naming the field
    shape = _sizes(item["shape"], where, "shape", key)
    _device(item.get("device"), where, "device", key)
    is_nested = item.get("is_nested", False)
    if type(is_nested) is not bool:
        raise FormatError(where, f"{shown_value(is_nested)} is not true or false", field=f"{key}.is_nested")
    if not is_nested and math.prod(shape) * dtype.itemsize > _MAX_BYTES:
        raise FormatError(where, f"shape {list(shape)} of {dtype} needs more bytes than any "
                          "file can hold", field=f"{key}.shape")
    return LeafMeta(key, shape, dtype, is_nested)


def _nests_deeper(value: Any, depth: int) -> bool:
    """Whether lists nest more than ``depth`` deep in ``value`` (JSON: lists are lists).
    Level by level, without recursion, and stopping below ``depth``: a hostile file may
    nest them as deep as the JSON parser went.

    Examples:
        >>> _nests_deeper([[1, [2]], 3], 2), _nests_deeper([[1, [2]], 3], 3), _nests_deeper("x", 0)
        (True, False, False)
    """
    level = [value] if type(value) is list else []
    for _ in range(depth):
        # (the set of types first: a stack of a million strings is looked at in C)
        level = [item for items in level if list in set(map(type, items)) for item in items
                 if type(item) is list]
    return bool(level)


def _sizes(value: Any, where: str, name: str, key: str | None = None) -> tuple[int, ...]:
    """A JSON list of sizes (integers >= 0, not booleans, each below 2**63); the error
    names the field ``name`` (of entry ``key``)."""
    if not isinstance(value, list) or not all(type(n) is int and 0 <= n <= _MAX_BYTES for n in value):
        raise FormatError(where, f"{shown_value(value)} is not a list of sizes (integers >= 0)",
                          field=name if key is None else f"{key}.{name}")
    return tuple(value)


def _device(value: Any, where: str, name: str, key: str | None = None) -> str | None:
    """A device name torch knows, or None (also written as "None"); the error names the
    field ``name`` (of entry ``key``)."""
    if value is None or value == "None":
        return None
    if value == "cpu" and type(value) is str:  # what every save of ours holds: no parse
        return value
    try:
        if not isinstance(value, str):
            raise TypeError
        torch.device(value)
    except (RuntimeError, TypeError, ValueError):
        raise FormatError(where, f"{shown_value(value)} is not a device torch knows",
                          field=name if key is None else f"{key}.{name}") from None
    return value


def _names(document: dict, batch_size: tuple[int, ...], where: str) -> tuple | None:
    names = document.get("_names")
    if names is None or isinstance(names, dict):  # a dict: the entry of a key "_names"
        return None
    if not (isinstance(names, list) and len(names) == len(batch_size)
            and all(n is None or isinstance(n, str) for n in names)):
        raise FormatError(where, f"{shown_value(names)} is not one name (a string or null) per batch "
                          f"dimension of {list(batch_size)}", field="_names")
    return tuple(names)


def _jsonable(value: Any) -> Any:
    """Tuples and sets become lists, as JSON has only lists."""
    if isinstance(value, (list, tuple, set)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    return value
