"""The on-disk format: byte-compatible with tensordict 0.15.3 (docs/format.md).

One ``meta.json`` per node, raw little-endian C-order leaf files ``<name>.memmap``,
nested collections as sub-directories, non-tensor data as JSON (pickle only when asked
for on load).  Where tensordict loses information we keep it in fields that tensordict
ignores, so both libraries still read each other's directories:

* keys named like node fields (``shape``, ``device``, ``_type``, ...) are listed under
  ``"_shared_td_entries"`` (a dict without ``dtype``/``type``, which tensordict skips);
* float8 dtypes are written under their torch names (tensordict 0.15.3 cannot load
  them; we can);
* a lazy stack without members records its batch size under ``"_shared_td_batch_size"``,
  and every lazy stack its member count under ``"_shared_td_members"`` (tensordict reads
  only ``stack_dim`` and ``stack_dim_name``).

This module holds the names and rules of the format: file and node-type names, dtype
names, the entries of a node (``node_entries``, ``check_batch_fits``), the file names of
a key, JSON values, the names beside and inside a prefix (lock file, temporaries) and
whether a directory is a save at all (``not_a_save``). The checked model of one
meta.json (NodeMeta, LeafMeta, ChildMeta: parsing, validating and writing it) is in
node_meta.py, which builds on these names.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import threading
from typing import Any

import torch

from shared_td.errors import FormatError
from shared_td.keys import encode_key, is_safe_legacy_name
from shared_td.persist import bounded_reads
from shared_td.storage.files import Directory, file_kind, read_whole

META = "meta.json"
LEAF_SUFFIX = ".memmap"
OTHER_PICKLE = "other.pickle"  # non-JSON data of a NonTensorData or tensorclass
STACK_PICKLE = "pickle.pkl"  # non-JSON data of a NonTensorStack
TENSORCLASS_CHILD = "_tensordict"
FORMAT_VERSION = 1
RESERVED_ENTRIES = "_shared_td_entries"
# The batch size of a lazy stack without members, which nothing else on disk gives.
EMPTY_STACK_BATCH = "_shared_td_batch_size"
# A lazy stack's member count: its members are the directories 0/, 1/, ... and a loader
# stops at the first missing one, so without it a lost member is a shorter stack.
STACK_MEMBERS = "_shared_td_members"

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
            where, f"unknown dtype {shown_value(name)}; this torch knows {sorted(DTYPE_BY_NAME)}.", field=field
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


def shown_value(value: Any, width: int = 80) -> str:
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


# why write_temporary could not create its file in a directory
_DIRECTORY_NOT_WRITABLE = {
    errno.EACCES: "this process has no permission to create files in its directory (its mode or ACL)",
    errno.EPERM: "this process may not create files in its directory",
    errno.EROFS: "its directory is on a read-only file system",
}


def write_temporary(directory: Directory, name: str, data: bytes) -> str:
    """Write ``data`` to a new temporary file beside ``name`` in ``directory``; returns
    the temporary's name.

    The caller renames it over ``name`` (atomic: readers see the old or the new file).
    A failed write removes the temporary at once; no room is a StorageFullError naming
    the file and the bytes needed; a directory this process may not write, an OSError
    naming the file and the fix.
    """
    temporary = f"{name}.{os.getpid()}.{threading.get_ident()}.tmp"
    try:
        directory.unlink(temporary)  # left by a killed writer of the same pid and thread id
        directory.write_new_file(temporary, data, final=name)
    except OSError as error:
        if error.errno not in _DIRECTORY_NOT_WRITABLE:
            raise
        # (the bare error named the temporary only: "Permission denied: .../meta.json.<pid>.<tid>.tmp")
        raise OSError(error.errno, (
            f"Cannot write {directory.join(name)}: {_DIRECTORY_NOT_WRITABLE[error.errno]}, and a "
            f"file there is replaced by a new one made beside it ({temporary}). Make the directory "
            f"{directory.path} writable, or write the tree to a new prefix (memmap_(new_prefix), or "
            "atomic=True, which makes a new version of the whole save beside it).")) from None
    return temporary


# write_temporary's names for the files of a node: <file>.<pid>.<thread id>.tmp
_TEMPORARY_NAME = re.compile(
    "(?:" + "|".join(re.escape(n) for n in (META, OTHER_PICKLE, STACK_PICKLE)) + r")\.(?P<pid>[0-9]+)\.[0-9]+\.tmp"
)
# staged_leaf_name's: hidden and tagged, as a leaf's own name is any key's (a user's file
# "x.memmap.1.2.tmp" beside the save is not ours); a key's file always ends with LEAF_SUFFIX
_STAGED_LEAF_NAME = re.compile(
    rf"\.(?:.+{re.escape(LEAF_SUFFIX)})\.shared_td\.(?P<pid>[0-9]+)\.[0-9]+\.tmp", re.DOTALL
)


def staged_leaf_name(name: str) -> str:
    """The temporary a writer stages the new bytes of the existing leaf file ``name`` in
    (renamed over ``name`` at its node's commit, just before its meta.json): unique to
    this process and thread, like :func:`write_temporary`'s, and a dead writer's is
    removed by gc as theirs are (:func:`temporary_writer_pid`).

    Example:
        >>> temporary_writer_pid(staged_leaf_name("a.memmap")) == os.getpid()
        True
    """
    return f".{name}.shared_td.{os.getpid()}.{threading.get_ident()}.tmp"


def temporary_writer_pid(name: str) -> int | None:
    """The pid of the writer that made ``name`` with :func:`write_temporary` or
    :func:`staged_leaf_name`, else None.

    Examples:
        >>> temporary_writer_pid("meta.json.4242.1399.tmp"), temporary_writer_pid("notes.tmp")
        (4242, None)
        >>> temporary_writer_pid(".a.memmap.shared_td.4242.1399.tmp"), temporary_writer_pid("a.memmap.4242.1.tmp")
        (4242, None)
    """
    match = _TEMPORARY_NAME.fullmatch(name) or _STAGED_LEAF_NAME.fullmatch(name)
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
    followed) of at most ``bounded_reads.MAX_META_BYTES`` (a bigger one is not read)
    holding a JSON object whose ``_type`` is known and which has the fields that type
    always has (:data:`REQUIRED_FIELDS`). Whether its shapes, dtypes and files
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
    except FileNotFoundError:
        return f"it has no {META}"
    except OSError as error:
        return f"its {META} cannot be read: {error.strerror}"
    if kind == "a symlink":
        return f"its {META} is a symlink (not followed)"
    if kind is not None:
        return f"its {META} is {kind}, not a regular file"
    try:  # (closed whatever happens once open returned: an fstat failing, or a Ctrl-C, left it open)
        stat = os.fstat(fd)
        kind = file_kind(stat.st_mode)  # replaced since the lstat
        if kind is not None:
            return f"its {META} is {kind}, not a regular file"
        data = read_whole(fd, stat.st_size, path, bounded_reads.MAX_META_BYTES)
    except FormatError as error:
        return f"its {META} is too big: {error.reason}"
    except OSError as error:
        return f"its {META} cannot be read: {error.strerror}"
    finally:
        os.close(fd)
    try:
        meta = json.loads(data.decode("utf-8"))  # (loader.read_meta says why it decodes)
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
