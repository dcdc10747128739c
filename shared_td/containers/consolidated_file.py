"""The file of ``consolidate(filename=)``, as tensordict 0.15.3 writes and reads it.

The file is the leaves' bytes, then the JSON metadata of the tree, then the length of
that JSON as a little-endian int64. The metadata of a node is
``{"cls", "non_tensors", "leaves", "cls_metadata"}`` plus one entry per nested
collection: ``leaves`` maps a key to ``[dtype, shape, start, stop, pad]`` (its bytes are
``data[start:stop]``, the last ``pad`` of them padding); ``non_tensors`` maps a key to
``[value, batch_size, device]``, the value itself in JSON (nothing is pickled: a value
JSON cannot hold is refused, as tensordict refuses it); a lazy stack or a NonTensorStack
keeps its members under ``"0"``, ``"1"``, ... (a NonTensorStack of several dims: one
NonTensorStack per row); a leaf's dtype must be one the reader knows; a tensorclass is
named by ``str(cls)`` and found among the classes this process has defined (never
imported).

The file is written beside its name and renamed over it once complete (NewFile): the
name holds the old file or the whole new one, and tensordicts that map the old file keep
their data. Reading: consolidated_load.py.

A tree consolidated again into its own file (its batch sizes or names changed) gets a
new file the same way: the file it maps is never written nor resized in place. Other
processes map it whole (tensordict 0.15.3's from_consolidated maps the file's size, and
so does every process that unpickled the tree's leaves): cutting it made their reads
past the new end a SIGBUS, and a reader saw a half-written tail. Under the rename they
keep the old inode, and a reader opens the old file or the new one, whole.
"""
from __future__ import annotations

import json
import os
import stat
from typing import Any, Iterator

import torch

from shared_td.errors import UnstorableValueError
from shared_td.keys import key_repr
from shared_td.persist import atomic, nodes
from shared_td.persist.format import DTYPE_BY_NAME, dtype_name
from shared_td.storage import files, mapping

# the fields of a node's metadata; every other key names a nested collection
FIELDS = ("cls", "non_tensors", "leaves", "cls_metadata")
# names a nested collection cannot have: the fields, and "size", which tensordict's reader
# (and ours, to read its files alike) drops at every node: it once held the file's size
RESERVED = FIELDS + ("size",)
TENSORDICT, LAZY, STACK = "TensorDict", "LazyStackedTensorDict", "NonTensorStack"
LENGTH = 8  # the int64 after the JSON


# ----------------------------------------------------------------------------- writing
def metadata_json(root: Any, places: Iterator[tuple[int, int]], kind_name, filename: str) -> bytes:
    """The JSON that follows the data: ``root``'s tree, its tensor leaves (in the order
    of consolidate()'s walk) at the ``(byte offset, nbytes)`` that ``places`` yields.
    ``kind_name(node)`` names a node's kind."""
    meta = _node_meta(root, places, kind_name, (), filename)
    return json.dumps(meta).encode("utf-8")


def _device(node: Any) -> str | None:
    device = getattr(node, "device", None)
    return None if device is None else str(device)


def _json_value(value: Any, where: tuple, filename: str) -> Any:
    try:
        json.dumps(value)
    except (TypeError, ValueError) as error:
        raise UnstorableValueError(
            f"consolidate(filename={filename!r}): the non-tensor value at {key_repr(where)} "
            f"(a {type(value).__name__}) cannot be written as JSON ({error}); the consolidated "
            "file keeps non-tensor values as JSON, as tensordict does. Store it as a tensor, "
            "or save the tree with memmap(prefix) instead, which pickles it (load it back with "
            "load_memmap(prefix, allow_pickle=True)).") from None
    return value


def _node_meta(node: Any, places: Iterator, kind_name, where: tuple, filename: str) -> dict:
    kind = kind_name(node)
    if kind == nodes.TENSORCLASS:
        meta = _node_meta(node._tensordict, places, kind_name, where, filename)
        meta["cls"] = str(type(node))
        return meta
    if kind == nodes.NON_TENSOR_STACK:
        return _stack_meta(node._flat_values(), list(node.batch_size), _device(node),
                           node.is_locked, where, filename)
    if kind == nodes.LAZY:
        names = node.names
        meta = {"cls": LAZY, "non_tensors": {}, "leaves": {}, "cls_metadata": {
            "stack_dim": node.stack_dim,
            "stack_dim_name": names[node.stack_dim] if names else None,
            "is_locked": node.is_locked}}
        for index, member in enumerate(node.tensordicts):
            meta[str(index)] = _node_meta(member, places, kind_name, where + (index,), filename)
        return meta
    if kind != nodes.TENSORDICT:  # a non-tensor root: tensordict has no format for it
        raise TypeError(f"consolidate(filename={filename!r}) writes tensordicts, tensorclasses "
                        f"and lazy stacks; a {type(node).__name__} has no consolidated file format.")
    names = node.names
    meta = {"cls": TENSORDICT, "non_tensors": {}, "leaves": {}, "cls_metadata": {
        "device": _device(node), "names": list(names) if names else [None] * node.batch_dims,
        "batch_size": list(node.batch_size), "is_locked": node.is_locked}}
    for key, value in node._tensordict.items():
        if isinstance(value, torch.Tensor):
            _check_dtype(value.dtype, where + (key,), filename)
            offset, nbytes = next(places)
            meta["leaves"][key] = [dtype_name(value.dtype), list(value.shape), offset, offset + nbytes, 0]
        elif kind_name(value) == nodes.NON_TENSOR_DATA or _is_0d_stack(value, kind_name):
            meta["non_tensors"][key] = [_json_value(value.data, where + (key,), filename),
                                        list(value.batch_size), _device(value)]
        elif key in RESERVED:
            raise ValueError(
                f"consolidate(filename={filename!r}): the nested collection {key_repr(where + (key,))} "
                f"is named like a field of the file's metadata ({', '.join(RESERVED)}), which "
                "tensordict's format cannot tell apart (its reader would lose it). Rename the key, "
                "or save with memmap().")
        else:
            meta[key] = _node_meta(value, places, kind_name, where + (key,), filename)
    return meta


def _is_0d_stack(value: Any, kind_name) -> bool:
    """A NonTensorStack without dims holds one value, written as a NonTensorData (the
    format's stacks have a dim 0 to stack along)."""
    return kind_name(value) == nodes.NON_TENSOR_STACK and not value.batch_dims


def _stack_meta(values: list, shape: list, device: str | None, locked: bool,
                where: tuple, filename: str) -> dict:
    """A NonTensorStack of ``shape`` (its ``values`` flat, in C order), as tensordict
    writes one: stacked along dim 0, a value per row (in ``non_tensors``) if it has one
    dim, else a NonTensorStack per row. The nesting follows the batch dims, never the
    values: a value may itself be a list, which the reader must not take for a dim."""
    if not shape:  # (one under a tensordict is written as its value: _is_0d_stack)
        raise TypeError(f"consolidate(filename={filename!r}): a NonTensorStack without dims has "
                        "no consolidated file format; consolidate a tensordict that holds it.")
    meta = {"cls": STACK, "non_tensors": {}, "leaves": {},
            "cls_metadata": {"stack_dim": 0, "stack_dim_name": None, "is_locked": locked}}
    if len(shape) == 1:
        for index, value in enumerate(values):
            meta["non_tensors"][str(index)] = [_json_value(value, where + (index,), filename), [], device]
        return meta
    step = len(values) // shape[0] if shape[0] else 0
    for index in range(shape[0]):
        # (a row is locked with its stack, as tensordict's rows are)
        meta[str(index)] = _stack_meta(values[index * step:(index + 1) * step], shape[1:], device,
                                       locked, where + (index,), filename)
    return meta


def _check_dtype(dtype: torch.dtype, where: tuple, filename: str) -> None:
    """Refuse, before anything is written, a leaf that from_consolidated could not read
    back (tensordict cannot write nor read these either)."""
    if DTYPE_BY_NAME.get(dtype_name(dtype)) is not dtype:
        raise TypeError(
            f"consolidate(filename={filename!r}): the tensor at {key_repr(where)} is {dtype}, "
            "a dtype that from_consolidated cannot read back. Store it viewed as one it can "
            "(e.g. tensor.view(torch.uint8), then .view(dtype) after loading), or consolidate "
            "without filename=.")


def _footer(metadata: bytes) -> bytes:
    return metadata + len(metadata).to_bytes(LENGTH, "little")


class NewFile:
    """The file of one ``consolidate(filename=path)``: made beside ``path`` under a
    hidden name, the metadata written after its ``nbytes`` of data (which the caller
    copies into ``backing``, the shared mapping), then renamed over ``path`` by
    :meth:`commit` once the data are complete, or removed by :meth:`abort`. The hidden
    name is :func:`shared_td.persist.atomic.temporary_name`'s, so that the file of a
    writer killed before either is removed by ``shared_td.gc(path)``.

    A symlink or directory at ``path`` is refused (the rename would replace the link
    itself); so is a missing parent directory.
    """

    def __init__(self, path: str, nbytes: int, metadata: bytes):
        self.path = path
        parent, self.name = os.path.split(path)
        self.temp: str | None = None
        try:
            self.directory = files.Directory.open(parent, action="write the consolidated file")
        except FileNotFoundError as err:
            raise RuntimeError(f"consolidate(filename=): {err.strerror}: {parent} (create the directory first)") from err
        try:
            st = self.directory.lstat(self.name)
            kind = None if st is None else files.file_kind(st.st_mode)
            if kind is not None:
                raise RuntimeError(f"consolidate(filename={path!r}): the path is {kind}; refusing to "
                                   "replace it. Pass the path of a regular file (or a new one).")
            self.temp = atomic.temporary_name(self.name)  # what shared_td.gc(path) removes
            fd, _ = files.reserve_file(self.directory, self.temp, existsok=False)
            try:
                if st is not None:  # the new file keeps the old one's permissions (the rename replaces it)
                    os.fchmod(fd, stat.S_IMODE(st.st_mode))
                footer = _footer(metadata)
                files.reserve_space(fd, nbytes + len(footer), path)
                files.pwrite_all(fd, footer, nbytes, where=f"file {path}")
                # named by its final path: that is what pickles of its leaves will map
                self.backing = files.backing_from_fd(path, fd, shared=True, bound=True) if nbytes else None
            finally:
                os.close(fd)
        except BaseException:
            self.abort()
            raise

    def commit(self) -> None:
        try:
            os.rename(self.temp, self.name, src_dir_fd=self.directory.fd, dst_dir_fd=self.directory.fd)
        except OSError as err:
            self.abort()
            raise type(err)(err.errno, f"consolidate(filename=): cannot put the new file in place: "
                                       f"{err.strerror}: {self.path}") from None
        self.temp = None
        self.directory.close()

    def abort(self) -> None:
        """Remove the new file (if any) and let go of the directory; safe to call twice."""
        if self.temp is not None:
            try:
                os.unlink(self.temp, dir_fd=self.directory.fd)
            except FileNotFoundError:
                pass
            self.temp = None
        if getattr(self, "directory", None) is not None:
            self.directory.close()


def holds_metadata(path: str, backing: Any, data_size: int, metadata: bytes) -> bool:
    """Whether the file at ``path`` is the one ``backing`` maps and holds the tree of
    ``metadata`` after its ``data_size`` bytes of data: a tree consolidated into it again,
    unchanged, is then returned as it is (nothing to write). The lock flags and devices
    are not compared: the file records the tree that was consolidated (unlocked, its
    device None, as tensordict writes it), the result is locked and on the CPU, and
    tensordict's rewrite changes only batch sizes and names. Only reads.

    Example:
        >>> import tempfile, torch
        >>> from shared_td import TensorDict
        >>> with tempfile.TemporaryDirectory() as d:
        ...     c = TensorDict(a=torch.ones(2)).consolidate(filename=f"{d}/td.bin")
        ...     c.consolidate(filename=f"{d}/td.bin") is c
        True
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if files.file_kind(st.st_mode) is not None or not mapping.same_mapping(files.mapped_backing(st), backing):
            return False
        length = st.st_size - data_size - LENGTH
        if length <= 0 or os.pread(fd, LENGTH, st.st_size - LENGTH) != length.to_bytes(LENGTH, "little"):
            return False
        old = os.pread(fd, length, data_size)
    finally:
        os.close(fd)
    try:
        return _settled(json.loads(old)) == _settled(json.loads(metadata))
    except ValueError:  # (not ours to judge here: a new file replaces it)
        return False


def _settled(meta: Any) -> Any:
    """``meta`` without the lock flags and devices of its nodes (see holds_metadata)."""
    if not isinstance(meta, dict):
        return meta
    settled = {key: _settled(value) for key, value in meta.items() if key != "cls_metadata"}
    if isinstance(meta.get("cls_metadata"), dict):
        settled["cls_metadata"] = {key: value for key, value in meta["cls_metadata"].items()
                                   if key not in ("is_locked", "device")}
    return settled
