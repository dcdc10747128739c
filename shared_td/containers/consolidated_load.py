"""``from_consolidated``: the tree of a file that ``consolidate(filename=)`` wrote, here
or by tensordict 0.15.3 (the format: consolidated_file.py).

Reading trusts nothing in the file: the length, the JSON, every offset, shape and dtype
are checked against the file before a view is made, and every error is a FormatError
naming the file. The data are mapped copy-on-write, as tensordict maps them: in-place
writes into the loaded leaves stay in this process. The result is consolidated (its
leaves are views of the one mapping) and locked only if the file says its tree was.

Sent to another process, the tree goes as a plain consolidated tree does (its one
buffer, then the skeleton: consolidated_pickle.py): a pickle carries its bytes, and
multiprocessing (a Queue, a DataLoader worker) moves the buffer into shared memory once,
as torch moves any tensor (from then on the receiver's writes reach the sender). Never
by the file's name: the receiver must get the values the sender holds, and the sender's
in-place writes are in its private copy only (the file may also have been replaced).
The mapping is therefore our own (libc's ``mmap``), viewed by ``torch.frombuffer``:
``torch.from_file(shared=False)`` makes a storage that torch takes for shared but has
no descriptor to send, so its pickle failed in the queue's feeder thread (EBADF) and
the receiver waited for ever (tensordict 0.15.3 fails the same way).
"""
from __future__ import annotations

import ctypes
import json
import math
import os
from typing import Any

import torch

from shared_td import platform
from shared_td.containers.consolidated_file import LAZY, LENGTH, RESERVED, STACK, TENSORDICT
from shared_td.containers.consolidated_layout import Layout
from shared_td.containers.lazy import LazyStackedTensorDict
from shared_td.containers.nontensor import NonTensorData, NonTensorStack
from shared_td.containers.tensorclass import tensorclass_for_type_string
from shared_td.containers.tensordict import TensorDict
from shared_td.errors import FormatError
from shared_td.finalizers import Finalizer
from shared_td.keys import key_repr
from shared_td.persist.format import dtype_from_name
from shared_td.storage import files
from shared_td.storage.fd_mapping import map_error


def from_consolidated(filename: Any) -> Any:
    """The tree of a file written by ``consolidate(filename=...)`` (by shared_td or
    tensordict 0.15.3): tensordict's ``from_consolidated`` (see
    ``TensorDict.from_consolidated``). A symlink is followed (the caller names the file,
    as for tensordict). A FIFO, directory or device is refused without blocking.

    Example:
        >>> import tempfile, torch
        >>> from shared_td import TensorDict, from_consolidated
        >>> with tempfile.TemporaryDirectory() as d:
        ...     _ = TensorDict(a=torch.ones(2), b="text").consolidate(filename=f"{d}/td.bin")
        ...     loaded = from_consolidated(f"{d}/td.bin")
        ...     loaded["a"].tolist(), loaded["b"], loaded.is_consolidated()
        ([1.0, 1.0], 'text', True)
    """
    path = os.path.abspath(os.fspath(filename))
    # O_NONBLOCK: a FIFO in the file's place opens at once, and fstat refuses it
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        kind = files.file_kind(st.st_mode)
        if kind is not None:
            raise FormatError(path, f"{kind}, not a consolidated file (a regular file).")
        size = st.st_size
        if size < LENGTH + 2:
            raise FormatError(path, f"{size} bytes: too short for a consolidated file (its JSON "
                                    "metadata and their length come last). Truncated?")
        length = int.from_bytes(_pread(fd, LENGTH, size - LENGTH), "little", signed=True)
        if not 2 <= length <= size - LENGTH:
            raise FormatError(path, f"its last 8 bytes give a metadata length of {length}, which "
                                    f"does not fit in its {size} bytes: truncated, or not written "
                                    "by consolidate(filename=).")
        data_size = size - LENGTH - length
        # the JSON starts with "{": a file cut inside its data ends with a data value, read
        # as a length of up to the file's size; one byte tells before that much is read
        # (a short one is read whole: its errors say more)
        if length > _PEEK_ABOVE and _pread(fd, 1, data_size) != b"{":
            raise FormatError(path, f"its metadata is not valid JSON: its last 8 bytes give a length "
                                    f"of {length}, but the byte at {data_size}, where that JSON would "
                                    "start, is not '{': truncated, or not written by consolidate(filename=).")
        try:
            meta = json.loads(_pread(fd, length, data_size))
        except (ValueError, RecursionError) as error:  # (UnicodeDecodeError is a ValueError)
            raise FormatError(path, f"its metadata is not valid JSON ({error}).") from None
        if not isinstance(meta, dict):
            raise FormatError(path, f"its metadata is a JSON {type(meta).__name__}, not an object.")
        if data_size:
            buffer = _map_private(fd, data_size, path)
        else:
            buffer = torch.empty(0, dtype=torch.uint8)
    finally:
        os.close(fd)
    return _Reader(path, buffer).tree(meta)


def _map_private(fd: int, nbytes: int, path: str) -> torch.Tensor:
    """The first ``nbytes`` of the file ``fd``, mapped copy-on-write, as a byte tensor
    that pickles (and moves to shared memory) as any plain tensor (see the module's
    opening). The mapping lives as long as the tensor's storage (torch.frombuffer holds
    the ctypes array; the array's finalizer unmaps); no descriptor is kept (Python's
    mmap.mmap would keep one per loaded tree)."""
    try:
        address = platform.map_private_bytes(fd, nbytes)
    except OSError as error:
        raise map_error(error.errno, fd, nbytes, False, f"file {path}") from None
    array = (ctypes.c_uint8 * nbytes).from_address(address)
    # not at exit: an exit handler that runs later may still read the tree (the
    # process's end unmaps it anyway)
    Finalizer(array, platform.unmap_bytes, address, nbytes).atexit = False
    return torch.frombuffer(array, dtype=torch.uint8)


_PEEK_ABOVE = 4096  # a metadata length above which its first byte is checked first


def _pread(fd: int, count: int, offset: int) -> bytes:
    chunks, done = [], 0
    while done < count:
        chunk = os.pread(fd, count - done, offset + done)
        if not chunk:
            break  # the file shrank since fstat: the caller's checks see short data
        chunks.append(chunk)
        done += len(chunk)
    return b"".join(chunks)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_size(value: Any) -> bool:
    """A batch size torch can hold: a list of counts below 2**63."""
    return isinstance(value, list) and all(_is_count(dim) and dim < 2**63 for dim in value)


class _Reader:
    """Builds the tree of one file's metadata over ``buffer`` (its data, mapped)."""

    def __init__(self, path: str, buffer: torch.Tensor):
        self.path, self.buffer = path, buffer
        self.layout = Layout(buffer)
        self.views: list[torch.Tensor] = []
        self.entries: list[tuple] = []

    def fail(self, where: tuple, reason: str) -> FormatError:
        place = f"the node {key_repr(where)}" if where else "the root"
        return FormatError(self.path, f"metadata of {place}: {reason}")

    def tree(self, meta: dict) -> Any:
        root = self.node(meta, ())
        self.layout.record(self.views, entries=self.entries)
        return root

    def node(self, meta: Any, where: tuple) -> Any:
        if not isinstance(meta, dict):
            raise self.fail(where, f"a JSON {type(meta).__name__}, not an object.")
        parts = [meta.get(name, {}) for name in ("non_tensors", "leaves", "cls_metadata")]
        if not all(isinstance(part, dict) for part in parts):
            raise self.fail(where, "'non_tensors', 'leaves' and 'cls_metadata' must be objects.")
        non_tensors, leaves, cls_metadata = parts
        # "size" is dropped as tensordict's reader drops it (our writer refuses it as a key)
        children = {k: v for k, v in meta.items() if k not in RESERVED}
        cls = meta.get("cls")
        try:
            if cls in (LAZY, STACK):
                node = self.stack(cls, non_tensors, children, cls_metadata, where)
            elif cls == TENSORDICT or (isinstance(cls, str) and cls.startswith("<class '")):
                node = self.tensordict(cls, non_tensors, leaves, children, cls_metadata, where)
            else:
                raise self.fail(where, f"unknown class {cls!r}.")
        except FormatError:
            raise
        except KeyError as error:  # a tensorclass that is not defined here
            raise FormatError(self.path, error.args[0]) from None
        except (TypeError, ValueError, RuntimeError, IndexError, OverflowError) as error:
            raise self.fail(where, f"cannot be rebuilt: {error}") from None
        if cls_metadata.get("is_locked") is True:
            node.lock_()
        return node

    def tensordict(self, cls: str, non_tensors: dict, leaves: dict, children: dict,
                   cls_metadata: dict, where: tuple) -> Any:
        twice = (non_tensors.keys() & leaves.keys()) | ((non_tensors.keys() | leaves.keys()) & children.keys())
        if twice:
            raise self.fail(where, f"the key {sorted(twice)[0]!r:.80} is listed twice (as a leaf, a "
                                   "non-tensor or a nested node): which one is meant?")
        entries: dict[str, Any] = {}  # in tensordict's order: non-tensors, leaves, nested
        for key, spec in non_tensors.items():
            entries[key] = self.non_tensor(spec, where + (key,))
        for key, spec in leaves.items():
            entries[key] = self.leaf(spec, where + (key,))
        for key, child in children.items():
            entries[key] = self.node(child, where + (key,))
        names = cls_metadata.get("names")
        if isinstance(names, list) and all(n is None for n in names):
            names = None
        batch_size = cls_metadata.get("batch_size", [])
        if not _is_size(batch_size):
            raise self.fail(where, f"batch_size {batch_size!r:.80} is not a list of counts below 2**63.")
        device = cls_metadata.get("device")
        try:
            td = TensorDict(entries, batch_size=batch_size, device=device, names=names)
        except AssertionError as error:  # (torch's answer to a CUDA device in a CPU-only build)
            raise self.fail(where, f"device {device!r:.80} cannot be used here: {error}") from None
        td.__dict__["_consolidated"] = self.layout
        if cls == TENSORDICT:
            return td
        return tensorclass_for_type_string(cls)._from_tensordict(td)

    def stack(self, cls: str, non_tensors: dict, children: dict, cls_metadata: dict, where: tuple) -> Any:
        count = len(non_tensors) + len(children)
        if set(non_tensors) | set(children) != {str(i) for i in range(count)}:
            raise self.fail(where, f"the members of a {cls} must be '0' to '{count - 1}'.")
        members = [self.non_tensor(non_tensors[str(i)], where + (i,)) if str(i) in non_tensors
                   else self.node(children[str(i)], where + (i,)) for i in range(count)]
        stack_dim = cls_metadata.get("stack_dim", 0)
        if not _is_count(stack_dim):
            raise self.fail(where, f"stack_dim {stack_dim!r} is not a dim.")
        if cls == STACK:
            return NonTensorStack(*members, stack_dim=stack_dim) if members else NonTensorStack.from_list([])
        name = cls_metadata.get("stack_dim_name")
        if name is not None and not isinstance(name, str):
            raise self.fail(where, f"stack_dim_name {name!r:.80} is not a name (a string or null).")
        stack = LazyStackedTensorDict(*members, stack_dim=stack_dim, stack_dim_name=name)
        stack.__dict__["_consolidated"] = self.layout
        return stack

    def non_tensor(self, spec: Any, where: tuple) -> NonTensorData:
        if not (isinstance(spec, list) and len(spec) == 3):
            raise self.fail(where, f"a non-tensor value must be [value, batch_size, device], not {spec!r:.80}.")
        value, batch_size, device = spec
        if not _is_size(batch_size):
            raise self.fail(where, f"batch_size {batch_size!r:.80} is not a list of counts below 2**63.")
        try:
            return NonTensorData(value, batch_size=batch_size, device=device)
        except AssertionError as error:  # (as in tensordict())
            raise self.fail(where, f"device {device!r:.80} cannot be used here: {error}") from None

    def leaf(self, spec: Any, where: tuple) -> torch.Tensor:
        if not (isinstance(spec, list) and len(spec) in (5, 6)):
            raise self.fail(where, f"a leaf must be [dtype, shape, start, stop, pad], not {spec!r:.80}.")
        if len(spec) == 6:
            raise self.fail(where, "a nested (jagged) tensor, which shared_td does not load.")
        dtype = dtype_from_name(spec[0], where=self.path, field=f"leaves {key_repr(where)}")
        shape, start, stop, pad = spec[1:]
        if not (isinstance(shape, list) and all(map(_is_count, shape))) or not all(map(_is_count, (start, stop, pad))):
            raise self.fail(where, f"shape {shape!r:.80}, start, stop and pad must be counts.")
        nbytes = math.prod(shape) * dtype.itemsize
        data_size = self.buffer.numel()
        if stop > data_size or start + nbytes > stop:
            raise self.fail(where, f"its {nbytes} bytes at [{start}:{stop}] lie outside the "
                                   f"{data_size} bytes of data: truncated or damaged.")
        if start % dtype.itemsize:
            raise self.fail(where, f"offset {start} is not a multiple of the size of {dtype}.")
        view = self.buffer[start:start + nbytes].view(dtype).view(shape)
        self.views.append(view)
        self.entries.append((dtype, tuple(shape), start))
        return view
