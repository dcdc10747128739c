"""A row of a memory-mapped tensordict, read beside tensordict 0.15.3's.

``buf[i]`` (and any basic index) of a memory-mapped, locked tensordict is the replay
buffer's row read, a fast path: these tests pin what it gives, leaf by leaf and node by
node, against the same read of the same data in tensordict 0.15.3, so that the fast path
cannot drift from it (each leaf a MemoryMappedTensor view of its file, the same
attributes, torch ops on it giving what they give in tensordict).
"""
from __future__ import annotations

import os
import pickle
import warnings

import pytest
import torch

from tests.interop import test_interop
from tests.reference import needs_tensordict

import shared_td  # noqa: E402

pytestmark = needs_tensordict
tensordict = test_interop.LIBS["tensordict"]
LIBS = {"shared_td": shared_td, "tensordict": tensordict}  # ours first: (ours, theirs) below
ROWS = 6
LEAVES = [("obs",), ("action",), ("done",), ("next", "obs"), ("next", "deeper", "x")]
INDICES = [3, -1, slice(1, 4), slice(None, None, 2), (Ellipsis,), None, (slice(1, 5), None)]


def replay_buffer(lib, prefix):
    """The same buffer in ``lib``: rows x [obs 3, action 2, done, next/obs 3, and a node
    with a longer batch size], memory-mapped under ``prefix``."""
    arange = torch.arange(ROWS * 6.0)
    td = lib.TensorDict(
        {
            "obs": arange[: ROWS * 3].reshape(ROWS, 3),
            "action": arange[: ROWS * 2].reshape(ROWS, 2) * 10,
            "done": torch.arange(ROWS) % 2 == 0,
            "next": {"obs": arange[: ROWS * 3].reshape(ROWS, 3) + 100},
        },
        batch_size=[ROWS],
    )
    td["next", "deeper"] = lib.TensorDict(x=torch.arange(ROWS * 2).reshape(ROWS, 2), batch_size=[ROWS, 2])
    return td.memmap_(prefix)


@pytest.fixture
def buffers(tmp_path):
    return {name: replay_buffer(lib, tmp_path / name) for name, lib in LIBS.items()}


def leaf_facts(leaf, prefix) -> dict:
    """What a user can see of a row leaf (tensordict's parent_shape warns: deprecated)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        parent_shape = leaf.parent_shape
    return {
        "class": type(leaf).__name__,
        "file": os.path.relpath(leaf.filename, prefix),
        "parent_shape": parent_shape,
        "shape": leaf.shape, "stride": leaf.stride(), "offset": leaf.storage_offset(),
        "dtype": leaf.dtype, "values": leaf.tolist(), "device": leaf.device,
        "is_view": leaf._is_view(), "contiguous": leaf.is_contiguous(),
        "requires_grad": leaf.requires_grad, "grad_fn": leaf.grad_fn,
        "op result": type(leaf + 1).__name__,
        "clone": type(leaf.clone()).__name__,
        "in-place result": type(leaf.copy_(leaf.clone())).__name__,
        "view of view": type(leaf[..., :1]).__name__ if leaf.dim() else None,
    }


def node_facts(node, flags: bool) -> dict:
    """``flags``: with the lock and memmap flags, which tensordict keeps for an int index
    only (ours keeps them for every view: tests/containers/test_indexing.py pins it)."""
    facts = {"class": type(node).__name__, "batch_size": node.batch_size, "device": node.device,
             "keys": sorted(node.keys())}
    if flags:
        facts.update(locked=node.is_locked, memmap=node.is_memmap())
    return facts


@pytest.mark.parametrize("index", INDICES)
def test_row_leaves_and_nodes_are_those_of_tensordict(tmp_path, buffers, index):
    rows = {name: buf[index] for name, buf in buffers.items()}
    for path in [(), ("next",), ("next", "deeper")]:
        ours, theirs = (rows[name].get(path) if path else rows[name] for name in LIBS)
        flags = isinstance(index, int)
        assert node_facts(ours, flags) == node_facts(theirs, flags), path
        assert ours.is_locked and ours.is_memmap(), path
    for key in LEAVES:
        ours, theirs = (leaf_facts(rows[name].get(key), tmp_path / name) for name in LIBS)
        assert ours == theirs, key
        assert isinstance(rows["shared_td"].get(key), shared_td.MemoryMappedTensor)


@pytest.mark.parametrize("index", INDICES)
def test_row_leaves_write_through_to_the_buffer_as_in_tensordict(buffers, index):
    for buf in buffers.values():
        row = buf[index]
        for key in LEAVES:
            row.get(key).fill_(False if key == ("done",) else -7)
        for key in LEAVES:
            assert (buf.get(key)[index] == (False if key == ("done",) else -7)).all(), key
    ours, theirs = buffers["shared_td"], buffers["tensordict"]
    for key in LEAVES:
        assert torch.equal(ours.get(key).as_subclass(torch.Tensor), theirs.get(key).as_subclass(torch.Tensor)), key


def test_a_row_leaf_pickles_by_reference_and_keeps_its_attributes(buffers):
    buf = buffers["shared_td"]
    leaf = buf[4]["next", "obs"]
    copy = pickle.loads(pickle.dumps(leaf))
    assert type(copy) is shared_td.MemoryMappedTensor and copy.filename == leaf.filename
    assert copy.parent_shape == leaf.parent_shape == buf["next", "obs"].shape
    copy.fill_(5.0)  # the same bytes: the buffer sees it
    assert buf["next", "obs"][4].tolist() == [5.0, 5.0, 5.0]


def test_a_row_read_leaves_the_buffer_leaves_as_they_were(buffers):
    # the row leaves are new tensors: making them MemoryMappedTensors changes no other
    buf = buffers["shared_td"]
    before = {key: (type(buf.get(key)), buf.get(key).shape, buf.get(key).__dict__.copy()) for key in LEAVES}
    rows = [buf[i] for i in range(ROWS)]
    assert all(row["obs"] is not buf["obs"] for row in rows)
    assert {key: (type(buf.get(key)), buf.get(key).shape, buf.get(key).__dict__) for key in LEAVES} == before
