"""Helpers of the persistence tests (tests/persist): sample trees and state snapshots.

Imported by the test modules as ``tests.persist.persist_helpers`` (see tests/conftest.py).
"""
from __future__ import annotations

import os

import torch

from shared_td import MemoryMappedTensor, NonTensorData, NonTensorStack, TensorDict, is_non_tensor

# Every CPU dtype a leaf can have, by a name usable as a key.
DTYPES = {
    "bool": torch.bool,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "uint16": torch.uint16,
    "uint32": torch.uint32,
    "uint64": torch.uint64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
    "complex64": torch.complex64,
    "complex128": torch.complex128,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}


def sample(dtype: torch.dtype, shape, seed: int = 0) -> torch.Tensor:
    """Distinct, non-zero-ish values of ``dtype`` (deterministic)."""
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen) > 0.5
    if dtype.is_complex:
        real = torch.randn(shape, generator=gen, dtype=torch.float64)
        return torch.complex(real, real + 1).to(dtype)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=gen) * 4).to(dtype)
    high = 100 if dtype in (torch.int8, torch.uint8) else 10_000
    return torch.randint(1, high, shape, generator=gen).to(dtype)


def make_td(batch=(3,), seed: int = 0) -> TensorDict:
    """A nested TensorDict with every dtype, non-tensor data, a stack and an empty leaf."""
    leaves = {name: sample(dtype, (*batch, 2), seed + i) for i, (name, dtype) in enumerate(DTYPES.items())}
    td = TensorDict(
        {
            **leaves,
            "nested": {
                "x": sample(torch.float32, (*batch, 4), seed + 50),
                "deeper": {"y": sample(torch.int64, batch, seed + 51), "note": "deep"},
                "label": "inner",
            },
            "task": "walk",
            "stack": NonTensorStack(*[f"s{i}" for i in range(batch[0])]),
            "empty": torch.zeros(*batch, 0),
        },
        batch_size=list(batch),
    )
    return td


def bits(tensor: torch.Tensor) -> bytes:
    """The raw bytes of a tensor (comparable for every dtype, incl. float8 and NaN)."""
    flat = tensor.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes()


def values_state(td) -> dict:
    """key -> (dtype, shape, bytes) for tensors, ("nt", type, list) for non-tensors."""
    state = {}
    for key in td.keys(include_nested=True, leaves_only=True):
        value = td.get(key)
        if isinstance(value, torch.Tensor):
            state[key] = (value.dtype, tuple(value.shape), bits(value))
        else:
            state[key] = ("nt", type(value).__name__, value.tolist())
    return state


def tree_state(td) -> dict:
    """Everything a failed call must leave as it was: leaf objects (by identity),
    values, and per node the lock/memmap/shared flags, device, batch size and names."""
    state = {"values": values_state(td), "leaf_ids": {}, "nodes": {}}
    nodes = [((), td)]
    while nodes:
        path, node = nodes.pop()
        state["nodes"][path] = (
            type(node).__name__, node.is_locked, node.is_memmap(), node.is_shared(),
            node.device, tuple(node.batch_size), node.names,
        )
        if is_non_tensor(node):
            continue
        for key in node.keys():
            value = node.get(key)
            if isinstance(value, torch.Tensor):
                state["leaf_ids"][path + (key,)] = (id(value), type(value).__name__)
            else:
                state["leaf_ids"][path + (key,)] = id(value)
                nodes.append((path + (key,), value))
    return state


def dir_state(root) -> dict:
    """relative path -> file bytes / "<dir>" / "-> target" (symlinks), for a whole tree.

    A missing ``root`` gives ``{}``.
    """
    root = os.fspath(root)
    state = {}
    if not os.path.lexists(root):
        return state
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root)
            if os.path.islink(path):
                state[rel] = "-> " + os.readlink(path)
            elif os.path.isdir(path):
                state[rel] = "<dir>"
            elif not os.path.isfile(path):  # a FIFO or socket: never opened (would wait)
                state[rel] = "<special>"
            else:
                with open(path, "rb") as handle:
                    state[rel] = handle.read()
    return state


def assert_all_memmap(td, prefix=None) -> None:
    """Every leaf is an MMT (in ``prefix`` when given), every node memmap + locked."""
    assert td.is_memmap() and td.is_locked
    for key in td.keys(include_nested=True):
        value = td.get(key)
        if isinstance(value, torch.Tensor):
            assert isinstance(value, MemoryMappedTensor), (key, type(value))
            if prefix is not None and value.numel():
                assert value.filename.startswith(os.fspath(prefix) + os.sep), (key, value.filename)
        elif not is_non_tensor(value):
            assert value.is_memmap() and value.is_locked, key


def assert_same_values(a, b) -> None:
    """Same keys (in order), dtypes, shapes and bytes, same non-tensor values."""
    sa, sb = values_state(a), values_state(b)
    assert list(sa) == list(sb)
    for key in sa:
        assert sa[key] == sb[key], key


__all__ = [
    "DTYPES", "MemoryMappedTensor", "NonTensorData", "NonTensorStack", "TensorDict",
    "assert_all_memmap", "assert_same_values", "bits", "dir_state", "make_td", "sample",
    "tree_state", "values_state",
]
