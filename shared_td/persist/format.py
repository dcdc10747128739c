"""The on-disk format: byte-compatible with tensordict 0.15.3 (docs/format.md).

One ``meta.json`` per node, raw little-endian C-order leaf files ``<name>.memmap``,
nested collections as sub-directories, non-tensor data as JSON (pickle only when asked
for on load).  Where tensordict loses information we keep it in fields that tensordict
ignores, so both libraries still read each other's directories:

* keys named like node fields (``shape``, ``device``, ``_type``, ...) are listed under
  ``"_shared_td_entries"`` (a dict without ``dtype``/``type``, which tensordict skips);
* float8 dtypes are written under their torch names (tensordict 0.15.3 cannot load
  them; we can);
* a lazy stack without members records its batch size under ``"_shared_td_batch_size"``
  (tensordict reads only ``stack_dim`` and ``stack_dim_name``).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from shared_td.errors import FormatError
from shared_td.keys import encode_key, is_safe_legacy_name
from shared_td.storage.files import Directory, file_kind

META = "meta.json"
LEAF_SUFFIX = ".memmap"
OTHER_PICKLE = "other.pickle"  # non-JSON data of a NonTensorData or tensorclass
STACK_PICKLE = "pickle.pkl"  # non-JSON data of a NonTensorStack
TENSORCLASS_CHILD = "_tensordict"
FORMAT_VERSION = 1
RESERVED_ENTRIES = "_shared_td_entries"
# The batch size of a lazy stack without members, which nothing else on disk gives.
EMPTY_STACK_BATCH = "_shared_td_batch_size"

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


def dtype_name(dtype: torch.dtype) -> str:
    """The dtype as written in meta.json (``"torch.float32"``)."""
    return str(dtype)


def dtype_from_name(name: Any, *, where: str, field: str | None = None) -> torch.dtype:
    """The dtype written as ``name``; FormatError naming the file (and field) when unknown."""
    dtype = DTYPE_BY_NAME.get(name) if isinstance(name, str) else None
    if dtype is None:
        raise FormatError(
            where, f"unknown dtype {_shown(name)}; this torch knows {sorted(DTYPE_BY_NAME)}.", field=field
        )
    return dtype


def node_entries(meta: dict) -> dict[str, dict]:
    """The per-key entries of a TensorDict node's meta.json, reserved names included.

    A top-level value under a node field's name is an entry when it is one (a dict with
    ``type``, or with ``dtype`` and ``shape``): tensordict 0.15.3 leaves there the
    entries of keys named ``_class``, ``_format_version`` and ``_names``.

    Examples:
        >>> node_entries({"x": {"dtype": "torch.float32", "shape": [2]}, "shape": [2]})
        {'x': {'dtype': 'torch.float32', 'shape': [2]}}
        >>> list(node_entries({"_class": {"dtype": "torch.int8", "shape": [2]}, "shape": [2]}))
        ['_class']
    """
    entries = {k: v for k, v in meta.items() if isinstance(v, dict)
               and (k not in NODE_FIELDS or (k != RESERVED_ENTRIES and _is_entry(v)))}
    reserved = meta.get(RESERVED_ENTRIES)
    if isinstance(reserved, dict):
        entries.update(reserved)
    return entries


def _is_entry(value: dict) -> bool:
    return "type" in value or ("dtype" in value and "shape" in value)


# ---------------------------------------------------------------- the checked node model
#: No file holds more bytes than this; a larger shape is a damaged or hostile meta.json.
_MAX_BYTES = sys.maxsize


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
                       empty_batch: Any = None) -> "NodeMeta":
        """A LazyStackedTensorDict node (its members are the directories 0/, 1/, ...);
        ``empty_batch``: the batch size of a stack without members, written under
        EMPTY_STACK_BATCH (members give it otherwise)."""
        document = {"_type": LAZY_STACK_TYPE, "_format_version": FORMAT_VERSION,
                    "_class": CLASS_TAGS[LAZY_STACK_TYPE], "stack_dim": stack_dim, "stack_dim_name": stack_dim_name}
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
            raise FormatError(where, f"{_shown(type_str)} is not a class name", field="_type")
        device = _device(document.get("device"), where, "device")
        if type_str == TENSORDICT_TYPE:
            batch_size = _sizes(document.get("shape", []), where, "shape")
            entries = tuple(_entry(key, item, where) for key, item in node_entries(document).items())
            for leaf in entries:
                if isinstance(leaf, LeafMeta) and not leaf.is_nested:
                    check_batch_fits(where, leaf.key, batch_size, leaf.shape)
            return cls(where, type_str, batch_size, device, _names(document, batch_size, where),
                       entries=entries, document=document)
        stack_dim = document.get("stack_dim", 0)
        if type(stack_dim) is not int or stack_dim < 0:
            raise FormatError(where, f"{_shown(stack_dim)} is not a dimension (an integer >= 0)", field="stack_dim")
        stack_dim_name = document.get("stack_dim_name")
        if stack_dim_name is not None and not isinstance(stack_dim_name, str):
            raise FormatError(where, f"{_shown(stack_dim_name)} is not a name (a string or null)", field="stack_dim_name")
        if type_str == LAZY_STACK_TYPE and EMPTY_STACK_BATCH in document:  # a 0 at stack_dim
            empty = _sizes(document[EMPTY_STACK_BATCH], where, EMPTY_STACK_BATCH)
            if len(empty) <= stack_dim or empty[stack_dim] != 0:
                raise FormatError(where, f"{list(empty)} is no batch size of an empty stack along "
                                  f"stack_dim {stack_dim}", field=EMPTY_STACK_BATCH)
        return cls(where, type_str, None, device, stack_dim=stack_dim, stack_dim_name=stack_dim_name, document=document)


def _entry(key: str, item: dict, where: str) -> LeafMeta | ChildMeta:
    # every field name below is built only on an error: this runs once per leaf of a load
    if "type" in item:
        if not isinstance(item["type"], str):
            raise FormatError(where, f"{_shown(item['type'])} is not a class name", field=f"{key}.type")
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
        raise FormatError(where, f"{_shown(is_nested)} is not true or false", field=f"{key}.is_nested")
    if not is_nested and math.prod(shape) * dtype.itemsize > _MAX_BYTES:
        raise FormatError(where, f"shape {list(shape)} of {dtype} needs more bytes than any "
                          "file can hold", field=f"{key}.shape")
    return LeafMeta(key, shape, dtype, is_nested)


def _sizes(value: Any, where: str, name: str, key: str | None = None) -> tuple[int, ...]:
    """A JSON list of sizes (integers >= 0, not booleans, each below 2**63); the error
    names the field ``name`` (of entry ``key``)."""
    if not isinstance(value, list) or not all(type(n) is int and 0 <= n <= _MAX_BYTES for n in value):
        raise FormatError(where, f"{_shown(value)} is not a list of sizes (integers >= 0)",
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
        raise FormatError(where, f"{_shown(value)} is not a device torch knows",
                          field=name if key is None else f"{key}.{name}") from None
    return value


def _names(document: dict, batch_size: tuple[int, ...], where: str) -> tuple | None:
    names = document.get("_names")
    if names is None or isinstance(names, dict):  # a dict: the entry of a key "_names"
        return None
    if not (isinstance(names, list) and len(names) == len(batch_size)
            and all(n is None or isinstance(n, str) for n in names)):
        raise FormatError(where, f"{_shown(names)} is not one name (a string or null) per batch "
                          f"dimension of {list(batch_size)}", field="_names")
    return tuple(names)


def _shown(value: Any, width: int = 80) -> str:
    """The repr of a bad value, cut to ``width`` characters (a hostile file may hold MBs)."""
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def check_batch_fits(where: str, key: str, batch_size, shape) -> None:
    """A leaf's or child's shape must start with its node's batch size (RuntimeError)."""
    if tuple(shape[: len(batch_size)]) != tuple(batch_size):
        raise FormatError(
            where, f"batch size {list(batch_size)} does not fit key {key!r} of shape "
            f"{list(shape)}: the leading dimensions of every entry must equal the batch size",
            field="shape",
        )


def file_names(key: str, *, leaf: bool, robust_key: bool = True) -> list[str]:
    """The file names a key may have, in the order a loader tries them.

    Its robust (encoded) name first, then its raw legacy name when that stays inside
    the directory (tensordict 0.15.3's rule, docs/format.md §4). A leaf's names end in .memmap.

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


def _jsonable(value: Any) -> Any:
    """Tuples and sets become lists, as JSON has only lists."""
    if isinstance(value, (list, tuple, set)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    return value


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


def nested_sizes_name(leaf_file: str) -> str:
    """The file of a nested tensor's int64 sizes, beside its data file (tensordict
    0.15.3 writes nested tensors so; shared_td reads neither yet).

    Examples:
        >>> nested_sizes_name("obs.memmap")
        'obs.shape.memmap'
    """
    return leaf_file[: -len(LEAF_SUFFIX)] + ".shape" + LEAF_SUFFIX


# The longest sibling name made from a prefix's: ".<stem>.shared_td-new-<pid>-<12 hex>"
# (pid at most 7 digits) takes 36 bytes more than <stem>; a name is at most 255 bytes.
_STEM_MAX = 255 - 36


def sibling_stem(name: str) -> str:
    """The part of the names of the files made beside ``name`` (its lock file, the
    temporaries of atomic writes) that comes from it: ``name`` itself, or, for a name
    too long to be part of those (up to 255 bytes is a valid name: tensordict 0.15.3
    saves to it), its start and a hash of the whole, always the same for one name.

    Examples:
        >>> sibling_stem("buf")
        'buf'
        >>> stem = sibling_stem("a" * 250)
        >>> len(stem.encode()) <= 219 and stem.startswith("a" * 100) and stem == sibling_stem("a" * 250)
        True
    """
    raw = os.fsencode(name)
    if len(raw) <= _STEM_MAX:
        return name
    digest = hashlib.sha256(raw).hexdigest()[:16]
    start = raw[: _STEM_MAX - len(digest) - 1].decode("utf-8", "ignore")  # whole characters
    return f"{start}~{digest}"


def lock_path(prefix: str) -> str:
    """The lock file of ``prefix``: ``.<name>.lock`` beside it, so that it survives
    every swap of the directory (``<name>``: see :func:`sibling_stem`).

    Examples:
        >>> lock_path("/data/buf")
        '/data/.buf.lock'
    """
    parent, name = os.path.split(os.path.abspath(prefix))
    return os.path.join(parent, f".{sibling_stem(name)}.lock")


def prefix_of_lock(name: str) -> str | None:
    """The name of the prefix whose lock file is named ``name``, else None.

    Examples:
        >>> prefix_of_lock(".buf.lock"), prefix_of_lock("buf.lock"), prefix_of_lock(".lock")
        ('buf', None, None)
    """
    if name.startswith(".") and name.endswith(".lock") and len(name) > len("..lock"):
        prefix = name[1:-len(".lock")]
        return prefix if os.path.basename(lock_path(prefix)) == name else None
    return None


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


# The fields that a node's meta.json always has, by _type, as tensordict 0.15.3 and
# shared_td write them (each tuple: one of these names). A tensorclass's _type names
# its class ("<class 'module.Name'>") and its tensors are in a _tensordict/ directory.
REQUIRED_FIELDS = {
    TENSORDICT_TYPE: (("shape",), ("device",)),
    LAZY_STACK_TYPE: (("stack_dim",),),
    NON_TENSOR_DATA_TYPE: (("data", "_is_non_tensor"),),  # no data: it is in other.pickle
    NON_TENSOR_STACK_TYPE: (("stack_dim",), ("data",)),
}
_CLASS_TYPE = re.compile(r"<class '[^'\s]+\.[^'\s]+'>")


def not_a_save(directory: str) -> str | None:
    """Why ``directory`` is not the root of a saved tensordict (written by tensordict or
    shared_td), in words; None when it is one.

    Only "is this a save at all": its meta.json is a regular file (a symlink is not
    followed) holding a JSON object whose ``_type`` is known and which has the fields
    that type always has (:data:`REQUIRED_FIELDS`). Whether its shapes, dtypes and files
    make sense is for the loader and ``shared-td verify``. atomic=True replaces only a
    save; verify and inspect refuse the same directories with the same words.

    Examples:
        >>> not_a_save("data/photos")
        "its meta.json has no _type (it holds the keys 'name')"
    """
    path = os.path.join(directory, META)
    try:
        # what it is before opening it: opening a socket fails, a FIFO or device may block
        kind = file_kind(os.lstat(path).st_mode)
        if kind is None:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
            kind = file_kind(os.fstat(fd).st_mode)  # replaced since the lstat
            if kind is not None:
                os.close(fd)
    except FileNotFoundError:
        return f"it has no {META}"
    except OSError as error:
        return f"its {META} cannot be read: {error.strerror}"
    if kind == "a symlink":
        return f"its {META} is a symlink (not followed)"
    if kind is not None:
        return f"its {META} is {kind}, not a regular file"
    with os.fdopen(fd, "rb") as file:
        data = file.read()
    try:
        meta = json.loads(data.decode("utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError) as error:
        return f"its {META} is not valid JSON ({error})"
    child = os.path.join(directory, TENSORCLASS_CHILD)
    return save_problem(meta, tensorclass_child=os.path.isdir(child) and not os.path.islink(child))


def save_problem(meta: Any, *, tensorclass_child: bool) -> str | None:
    """:func:`not_a_save` for a parsed meta.json (``tensorclass_child``: whether the
    directory holds a _tensordict/ directory)."""
    if not isinstance(meta, dict):
        return f"its {META} holds a JSON {type(meta).__name__}, not an object"
    if "_type" not in meta:
        keys = ", ".join(repr(k) for k in list(meta)[:5]) + (", ..." if len(meta) > 5 else "")
        return f"its {META} has no _type (it holds the keys {keys or 'none'})"
    type_str = meta["_type"]
    if type_str in REQUIRED_FIELDS:
        for names in REQUIRED_FIELDS[type_str]:
            if not any(name in meta for name in names):
                wanted = " or ".join(repr(name) for name in names)
                return f"its {META} has the _type {type_str} but no {wanted}"
        return None
    if not isinstance(type_str, str) or not _CLASS_TYPE.fullmatch(type_str):
        return f"its {META} has the _type {type_str!r}, which names no tensordict class"
    if not tensorclass_child:
        return (f"its {META} names the class {type_str}, but the {TENSORCLASS_CHILD}/ "
                "directory of a saved tensorclass is missing")
    return None
