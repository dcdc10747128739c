"""Loading a saved directory: read meta.json, map leaf files, rebuild the containers.

Every file is resolved relative to the node directory opened first.  Unlike tensordict,
a missing or short leaf file is an error naming the key (never a silently dropped key or
a SIGBUS), symlinked leaf files and child directories are refused, and pickled
non-tensor data is only read with ``allow_pickle=True`` (refused before unpickling).
"""
from __future__ import annotations

import os
import pickle
import stat
from typing import Any

import torch

from shared_td.keys import encode_key, is_safe_legacy_name
from shared_td.memmap_tensor import MemoryMappedTensor
from shared_td.persist import format as fmt


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


class Loader:
    """Loads one saved tree; ``robust_key`` picks the file names tried first."""

    def __init__(self, *, robust_key: bool = True, allow_pickle: bool = False):
        self.robust_key = True if robust_key is None else robust_key
        self.allow_pickle = check_allow_pickle(allow_pickle)

    def load(self, directory: str, batch_size: torch.Size | None = None) -> Any:
        directory = os.path.abspath(os.fspath(directory))
        if not os.path.isdir(directory):
            if os.path.exists(directory):
                raise NotADirectoryError(f"{directory} is a file, not a saved tensordict directory.")
            raise FileNotFoundError(f"No saved tensordict at {directory}: no such directory.")
        meta = fmt.read_json(os.path.join(directory, fmt.META))
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

    # ------------------------------------------------------------------ node kinds
    def _load_tensordict(self, directory: str, meta: dict) -> Any:
        from shared_td.containers.tensordict import TensorDict

        batch_size = torch.Size(meta.get("shape", []))
        entries = {k: v for k, v in meta.items() if isinstance(v, dict) and k not in fmt.NODE_FIELDS}
        entries.update(meta.get(fmt.RESERVED_ENTRIES, {}))
        values = {}
        for key, entry in entries.items():
            if "type" in entry:
                path = self._resolve(directory, key, leaf=False)
                values[key] = self.load(path, batch_size)
            elif "dtype" in entry and "shape" in entry:
                values[key] = self._load_leaf(directory, key, entry)
        device = meta.get("device")
        td = TensorDict._new_unsafe(
            values, batch_size, None if device in (None, "None") else torch.device(device)
        )
        if meta.get("_names") is not None:
            td.names = meta["_names"]
        for key, value in values.items():
            if getattr(value, "_is_non_tensor", False) and value.batch_size != batch_size:
                values[key] = value._with_batch_size(batch_size, key)
        td._memmap_prefix = directory
        return td

    def _load_leaf(self, directory: str, key: str, entry: dict) -> torch.Tensor:
        where = f"key {key!r} in {os.path.join(directory, fmt.META)}"
        if entry.get("is_nested"):
            raise NotImplementedError(f"{where}: nested tensors cannot be loaded yet.")
        dtype = fmt.dtype_from_name(entry["dtype"], where=where)
        shape = torch.Size(entry["shape"])
        path = self._resolve(directory, key, leaf=True, must_exist=shape.numel() > 0)
        if shape.numel() == 0:
            return MemoryMappedTensor.empty(shape, dtype=dtype)
        try:
            return MemoryMappedTensor.from_filename(path, dtype, shape)
        except FileNotFoundError:
            raise FileNotFoundError(f"The file of {where} is missing: {path}.") from None

    def _load_lazy(self, directory: str, meta: dict) -> Any:
        from shared_td.containers.lazy import LazyStackedTensorDict

        members = []
        while True:
            path = os.path.join(directory, str(len(members)))
            if not os.path.isdir(path):
                break
            self._refuse_symlink(path)
            members.append(self.load(path))
        if not members:
            raise fmt.FormatError(f"{directory} holds a lazy stack without members (no 0/ directory).")
        lazy = LazyStackedTensorDict(*members, stack_dim=meta.get("stack_dim", 0))
        lazy._memmap_prefix = directory
        return lazy

    def _load_non_tensor_data(self, directory: str, meta: dict, batch_size) -> Any:
        from shared_td.containers.nontensor import NonTensorData

        if "data" in meta:
            data = meta["data"]
        else:
            data = self._unpickle(os.path.join(directory, fmt.OTHER_PICKLE))["data"]
        value = NonTensorData(data, batch_size=batch_size or [])
        value._memmap_prefix = directory
        return value

    def _load_non_tensor_stack(self, directory: str, meta: dict) -> Any:
        from shared_td.containers.nontensor import NonTensorStack

        data = meta.get("data")
        if data == fmt.STACK_PICKLE:
            data = self._unpickle(os.path.join(directory, fmt.STACK_PICKLE))
        stack = NonTensorStack.from_list(data)
        stack._memmap_prefix = directory
        return stack

    def _load_tensorclass(self, directory: str, meta: dict, type_str: Any) -> Any:
        from shared_td.containers.tensorclass import tensorclass_for_type_string

        try:
            cls = tensorclass_for_type_string(type_str)
        except (KeyError, TypeError):
            raise RuntimeError(
                f"{os.path.join(directory, fmt.META)} holds a {type_str!r}, which is no known "
                "tensordict class: import the module that defines that tensorclass first."
            ) from None
        inner_path = os.path.join(directory, fmt.TENSORCLASS_CHILD)
        if not os.path.isdir(inner_path):
            raise fmt.FormatError(f"The _tensordict directory seems to be missing in {directory}.")
        self._refuse_symlink(inner_path)
        instance = cls._from_tensordict(self.load(inner_path))
        return instance

    # ------------------------------------------------------------------ files
    def _resolve(self, directory: str, key: str, *, leaf: bool, must_exist: bool = True) -> str:
        """The path of ``key``: its robust name, else its legacy (raw) name if safe."""
        suffix = fmt.LEAF_SUFFIX if leaf else ""
        candidates = []
        if self.robust_key:
            candidates.append(encode_key(key) + suffix)
        if is_safe_legacy_name(key, directory=not leaf) and key + suffix not in candidates:
            candidates.append(key + suffix)
        for name in candidates:
            path = os.path.join(directory, name)
            try:
                mode = os.lstat(path).st_mode
            except FileNotFoundError:
                continue
            if stat.S_ISLNK(mode):
                raise RuntimeError(f"Refusing to load through symlink {path}.")
            return path
        if not must_exist:
            return os.path.join(directory, candidates[0]) if candidates else directory
        kind = "file" if leaf else "directory"
        raise FileNotFoundError(
            f"The {kind} of key {key!r} listed in {os.path.join(directory, fmt.META)} is "
            f"missing (looked for {candidates}): the save is incomplete or was moved."
        )

    @staticmethod
    def _refuse_symlink(path: str) -> None:
        if os.path.islink(path):
            raise RuntimeError(f"Refusing to load through symlink {path}.")

    def _unpickle(self, path: str) -> Any:
        if not self.allow_pickle:
            raise RuntimeError(
                f"Refusing to load pickled non-tensor data from {path}: unpickling can run "
                "arbitrary code. Pass allow_pickle=True if you trust this directory."
            )
        self._refuse_symlink(path)
        with open(path, "rb") as handle:
            return pickle.load(handle)
