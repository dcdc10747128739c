"""Loading a saved directory: read meta.json, map leaf files, rebuild the containers.

Every file is opened relative to the directory opened first (``dir_fd``), so a load
that races an atomic rewrite (a swap of the whole directory) reads one version only; if
that version is deleted under it, the load starts again on the new one.  Unlike
tensordict, a missing or short leaf file is an error naming the key (never a silently
dropped key or a SIGBUS), symlinked leaf files and child directories are refused, and
pickled non-tensor data is only read with ``allow_pickle=True`` (refused before
unpickling).
"""
from __future__ import annotations

import json
import os
import pickle
import time
from typing import Any

import torch

from shared_td.memmap_tensor import MemoryMappedTensor
from shared_td.persist import format as fmt
from shared_td.storage import files
from shared_td.storage.files import Directory, FileTooShortError

#: How long a load keeps restarting while atomic writers replace the directory under it.
RETRY_SECONDS = 60.0


def check_allow_pickle(allow_pickle: Any) -> bool:
    """``allow_pickle`` must be True, False or None (None means False)."""
    if allow_pickle is None:
        return False
    if type(allow_pickle) is not bool:
        raise TypeError(
            f"allow_pickle must be True, False or None, got {allow_pickle!r} of type "
            f"{type(allow_pickle).__name__}."
        )
    return allow_pickle


def read_meta(directory: Directory) -> dict:
    """The meta.json of ``directory`` as a dict; a clear error if missing or not JSON."""
    where = directory.join(fmt.META)
    try:
        document = json.loads(directory.read(fmt.META).decode("utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"No saved tensordict at {directory.path!r}: {fmt.META} is missing.") from None
    except (ValueError, UnicodeDecodeError) as error:
        raise fmt.FormatError(f"{where} is not valid JSON: {error}") from None
    if not isinstance(document, dict):
        raise fmt.FormatError(f"{where} holds a {type(document).__name__}, not a JSON object.")
    return document


class Loader:
    """Loads one saved tree; ``robust_key`` picks the file names tried first."""

    def __init__(self, *, robust_key: bool = True, allow_pickle: bool = False):
        self.robust_key = True if robust_key is None else robust_key
        self.allow_pickle = check_allow_pickle(allow_pickle)
        self._opened: tuple | None = None  # (root directory, its path) of the current load

    def load(self, directory: str) -> Any:
        """Load the tree at ``directory``, restarting if an atomic writer replaced it."""
        path = os.path.abspath(os.fspath(directory))
        deadline = time.monotonic() + RETRY_SECONDS
        while True:
            root = self._open_root(path)
            self._opened = (root, path)
            try:
                return self._load(root, None)
            except (FileNotFoundError, fmt.FormatError, FileTooShortError):
                if not _replaced(root, path) or time.monotonic() > deadline:
                    raise
            finally:
                root.close()

    @staticmethod
    def _open_root(path: str) -> Directory:
        for _ in range(1000):  # the two-renames fallback leaves the path missing briefly
            try:
                return Directory.open(path, action="load")
            except NotADirectoryError:
                raise NotADirectoryError(f"{path} is a file, not a saved tensordict directory.") from None
            except FileNotFoundError:
                if not os.path.lexists(os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.lock")):
                    break
                time.sleep(0.001)
        raise FileNotFoundError(f"No saved tensordict at {path}: no such directory.")

    def _load(self, directory: Directory, batch_size: torch.Size | None) -> Any:
        meta = read_meta(directory)
        type_str = meta.get("_type")
        if type_str == fmt.TENSORDICT_TYPE:
            return self._load_tensordict(directory, meta)
        if type_str == fmt.LAZY_STACK_TYPE:
            return self._load_lazy(directory, meta)
        if type_str == fmt.NON_TENSOR_DATA_TYPE:
            return self._load_non_tensor_data(directory, meta, batch_size)
        if type_str == fmt.NON_TENSOR_STACK_TYPE:
            return self._load_non_tensor_stack(directory, meta)
        return self._load_tensorclass(directory, meta, type_str)

    def _load_child(self, directory: Directory, name: str, batch_size=None) -> Any:
        child = directory.child(name)
        try:
            return self._load(child, batch_size)
        finally:
            child.close()

    # ------------------------------------------------------------------ node kinds
    def _load_tensordict(self, directory: Directory, meta: dict) -> Any:
        from shared_td.containers.tensordict import TensorDict

        batch_size = torch.Size(meta.get("shape", []))
        entries = fmt.node_entries(meta)
        values = {}
        for key, entry in entries.items():
            if "type" in entry:
                name = self._resolve(directory, key, leaf=False)
                value = self._load_child(directory, name, batch_size)
                if getattr(value, "_is_non_tensor", False) and value.batch_size != batch_size:
                    value = value._with_batch_size(batch_size, key)
                values[key] = value
            elif "dtype" in entry and "shape" in entry:
                values[key] = self._load_leaf(directory, key, entry)
        device = meta.get("device")
        td = TensorDict._new_unsafe(
            values, batch_size, None if device in (None, "None") else torch.device(device)
        )
        if meta.get("_names") is not None:
            td.names = meta["_names"]
        td._memmap_prefix = directory.path
        return td

    def _load_leaf(self, directory: Directory, key: str, entry: dict) -> torch.Tensor:
        if entry.get("is_nested"):
            raise NotImplementedError(f"{self._where(directory, key)}: nested tensors cannot be loaded yet.")
        dtype = fmt.DTYPE_BY_NAME.get(entry["dtype"]) or fmt.dtype_from_name(
            entry["dtype"], where=self._where(directory, key)
        )
        shape = torch.Size(entry["shape"])
        if shape.numel() == 0:  # zero-element leaves have no file
            return MemoryMappedTensor.empty(shape, dtype=dtype)
        name, fd, shared = self._open_leaf(directory, key)
        path = f"{directory.path}/{name}"
        try:
            backing = files.backing_from_fd(path, fd, shared=shared)
        finally:
            os.close(fd)
        return MemoryMappedTensor._from_backing(backing, 0, dtype, shape)

    def _load_lazy(self, directory: Directory, meta: dict) -> Any:
        from shared_td.containers.lazy import LazyStackedTensorDict

        members = []
        while directory.exists(str(len(members))):
            members.append(self._load_child(directory, str(len(members))))
        # the first missing member ends the stack: if the tree was swapped out meanwhile,
        # that member may have been deleted with the old version, so start again
        if self._opened is not None and _replaced(*self._opened):
            raise FileNotFoundError(f"{directory.path} was replaced while it was loaded.")
        if not members:
            raise fmt.FormatError(f"{directory.path} holds a lazy stack without members (no 0/ directory).")
        lazy = LazyStackedTensorDict(*members, stack_dim=meta.get("stack_dim", 0))
        lazy._memmap_prefix = directory.path
        return lazy

    def _load_non_tensor_data(self, directory: Directory, meta: dict, batch_size) -> Any:
        from shared_td.containers.nontensor import NonTensorData

        if "data" in meta:
            data = meta["data"]
        else:
            data = self._unpickle(directory, fmt.OTHER_PICKLE)["data"]
        value = NonTensorData(data, batch_size=batch_size or [])
        value._memmap_prefix = directory.path
        return value

    def _load_non_tensor_stack(self, directory: Directory, meta: dict) -> Any:
        from shared_td.containers.nontensor import NonTensorStack

        data = meta.get("data")
        if data == fmt.STACK_PICKLE:
            data = self._unpickle(directory, fmt.STACK_PICKLE)
        stack = NonTensorStack.from_list(data)
        stack._memmap_prefix = directory.path
        return stack

    def _load_tensorclass(self, directory: Directory, meta: dict, type_str: Any) -> Any:
        from shared_td.containers.tensorclass import tensorclass_for_type_string

        try:
            cls = tensorclass_for_type_string(type_str)
        except (KeyError, TypeError):
            raise RuntimeError(
                f"{os.path.join(directory.path, fmt.META)} holds a {type_str!r}, which is no "
                "known tensordict class: import the module that defines that tensorclass first."
            ) from None
        if not directory.exists(fmt.TENSORCLASS_CHILD):
            raise fmt.FormatError(f"The _tensordict directory seems to be missing in {directory.path}.")
        return cls._from_tensordict(self._load_child(directory, fmt.TENSORCLASS_CHILD))

    # ------------------------------------------------------------------ files
    def _candidates(self, key: str, *, leaf: bool) -> list[str]:
        """File names of ``key``: its robust name, then its legacy (raw) name if safe."""
        return fmt.file_names(key, leaf=leaf, robust_key=self.robust_key)

    def _open_leaf(self, directory: Directory, key: str) -> tuple[str, int, bool]:
        """Open the file of leaf ``key``: ``(name, fd, shared)``.

        A read-only file is opened read-only and mapped copy-on-write (shared=False).
        """
        names = self._candidates(key, leaf=True)
        for name in names:
            try:
                return name, directory.open_file(name, os.O_RDWR), True
            except FileNotFoundError:
                continue
            except PermissionError:
                return name, directory.open_file(name, os.O_RDONLY), False
        raise self._missing(directory, key, names, "file")

    def _resolve(self, directory: Directory, key: str, *, leaf: bool) -> str:
        """The existing file name of ``key`` (see ``_candidates``)."""
        names = self._candidates(key, leaf=leaf)
        for name in names:
            if directory.exists(name):
                return name
        raise self._missing(directory, key, names, "file" if leaf else "directory")

    def _missing(self, directory: Directory, key: str, names: list, kind: str) -> FileNotFoundError:
        return FileNotFoundError(
            f"The {kind} of {self._where(directory, key)} is missing (looked for {names}): "
            "the save is incomplete or was moved."
        )

    @staticmethod
    def _where(directory: Directory, key: str) -> str:
        return f"key {key!r} listed in {directory.path}/{fmt.META}"

    def _unpickle(self, directory: Directory, name: str) -> Any:
        path = os.path.join(directory.path, name)
        if not self.allow_pickle:
            raise RuntimeError(
                f"Refusing to load pickled non-tensor data from {path}: unpickling can run "
                "arbitrary code. Pass allow_pickle=True if you trust this directory."
            )
        return pickle.loads(directory.read(name))


def _replaced(root: Directory, path: str) -> bool:
    """True if ``path`` no longer names the directory ``root`` opened (a swap happened)."""
    try:
        current = os.stat(path)
    except FileNotFoundError:
        return True
    opened = os.fstat(root.fd)
    return (current.st_dev, current.st_ino) != (opened.st_dev, opened.st_ino)
