"""Each leaf of a mapping that holds several (the segment of an anonymous ``memmap_()``,
an attached tree, an archive) has a storage of its own bytes (shared_td.storage.slices).

Before, every leaf viewed the one storage of its mapping: torch pickles and saves a plain
tensor with the whole storage it views, so a plain view of one leaf (``reshape``,
``view``, the leaves of ``td.reshape(...)``) pickled every leaf of the tree, and
``torch.save`` of two views of different dtypes failed. tensordict 0.15.3, with a
storage per leaf, pickles each leaf's own bytes.
"""
from __future__ import annotations

import io
import multiprocessing
import pickle

import pytest
import torch

import shared_td
from shared_td import MemoryMappedTensor
from tests.processes import WAIT, finish
from tests.reference import needs_tensordict, tensordict

LEAF_BYTES = 4 * 4096 * 4  # a float32 leaf of shape [4, 4096]


def wide_tree(lib, n=8):
    """``n`` float leaves and one bool leaf, each of its own bytes."""
    return lib.TensorDict({**{f"k{i}": torch.full((4, 4096), float(i)) for i in range(n)},
                           "done": torch.tensor([True, False, True, False])}, [4])


def tree_of(how, coord, tmp_path=None):
    """The wide tree, its leaves in one segment (``memmap_``), one archive file
    (``archive``) or a segment published and attached (``attach``)."""
    if how == "memmap_":
        return wide_tree(shared_td).memmap_()
    if how == "archive":
        wide_tree(shared_td).memmap(tmp_path / "t.tdz")
        return shared_td.TensorDict.load_memmap(tmp_path / "t.tdz")
    coord.publish("wide", wide_tree(shared_td))
    return coord.attach("wide")


def saved_and_loaded(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False), buffer.getbuffer().nbytes


@pytest.mark.parametrize("how", ["memmap_", "archive", "attach"])
def test_a_plain_view_of_a_leaf_pickles_its_own_bytes_only(how, tmp_path):
    """pickle.dumps of ``leaf.view(-1)`` (a plain tensor) of a tree of 8 such leaves:
    its own 64 KiB, not the tree's 512 KiB (before: the whole segment or file)."""
    with shared_td.Coordinator() as coord:
        td = tree_of(how, coord, tmp_path)
        view = td["k3"].view(-1).as_subclass(torch.Tensor)  # (an archive's leaves are read-only ones)
        blob = pickle.dumps(view)
        assert len(blob) < 1.1 * LEAF_BYTES
        assert torch.equal(pickle.loads(blob), torch.full((4 * 4096,), 3.0))
        # the leaf is still the tree's memory, and still pickles by reference
        assert td["k3"].data_ptr() == view.data_ptr()
        assert len(pickle.dumps(td["k3"])) < 2000


@pytest.mark.parametrize("how", ["memmap_", "attach"])
def test_torch_save_of_a_reshaped_tree_of_several_dtypes(how, tmp_path):
    """torch.save of ``td.reshape(...)`` (plain views of float and bool leaves of one
    segment) works and writes about the tree's bytes once (before: "Cannot save multiple
    tensors or storages that view the same data as different types")."""
    with shared_td.Coordinator() as coord:
        td = tree_of(how, coord, tmp_path)
        reshaped = td.reshape(2, 2)
        assert type(reshaped["done"]) is torch.Tensor
        back, nbytes = saved_and_loaded(reshaped)
        assert nbytes < 1.1 * 8 * LEAF_BYTES + 20000
        assert torch.equal(back["done"], torch.tensor([[True, False], [True, False]]))
        assert torch.equal(back["k7"], torch.full((2, 2, 4096), 7.0))
        blob = pickle.dumps(reshaped)  # (before: each leaf the whole segment, 9x the tree)
        assert len(blob) < 1.1 * 8 * LEAF_BYTES + 20000


@needs_tensordict
def test_same_as_tensordict_side_by_side():
    """The same plain views pickle to about the same size in both libraries."""
    sizes = {}
    for lib in (shared_td, tensordict):
        td = wide_tree(lib).memmap_()
        sizes[lib.__name__] = len(pickle.dumps(td.reshape(2, 2)))
        saved_and_loaded({"a": td["k0"].view(-1), "b": td["done"].view(2, 2)})
    assert sizes["shared_td"] < 1.05 * sizes["tensordict"]


def write_through(view, value: float) -> None:
    view.fill_(value)


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_plain_view_sent_to_a_child_is_the_same_memory(method):
    """A plain view of a leaf (its storage a slice of the segment) sent through
    multiprocessing is a view of the same memory in the child, at the right place:
    the child's write reaches this leaf only."""
    td = wide_tree(shared_td).memmap_()
    context = multiprocessing.get_context(method)
    process = context.Process(target=write_through, args=(td["k5"].view(-1), 42.0))
    process.start()
    assert finish(process, WAIT) == 0
    assert torch.equal(td["k5"], torch.full((4, 4096), 42.0))
    assert torch.equal(td["k4"], torch.full((4, 4096), 4.0)) and torch.equal(td["k6"], torch.full((4, 4096), 6.0))


def test_from_storage_of_a_leaf_storage_is_that_leaf():
    """``MemoryMappedTensor.from_storage(leaf.untyped_storage())`` views that leaf (at
    its place in the segment) and pickles by reference to it."""
    td = wide_tree(shared_td).memmap_()
    again = MemoryMappedTensor.from_storage(td["k2"].untyped_storage(), dtype=torch.float32, shape=(4, 4096))
    assert again.data_ptr() == td["k2"].data_ptr() and again._handler is td["k2"]._handler
    assert torch.equal(pickle.loads(pickle.dumps(again)), torch.full((4, 4096), 2.0))


@pytest.mark.parametrize("how", ["memmap_", "attach"])
def test_share_memory_keeps_leaves_and_their_views_in_the_segment(how, tmp_path):
    """A leaf's storage is a slice of the segment, which torch says is not shared: its
    ``share_memory_()`` (and a tree's, over plain views of it) would copy it into new
    memory that no other process maps. A leaf says it is shared and stays; a tree of
    plain views (``reshape``) keeps viewing the segment."""
    with shared_td.Coordinator() as coord:
        td = tree_of(how, coord, tmp_path)
        leaf = td["k1"]
        address = leaf.data_ptr()
        assert leaf.is_shared() and leaf.share_memory_() is leaf and leaf.data_ptr() == address
        reshaped = td.reshape(2, 2).unlock_()
        address = reshaped["k2"].data_ptr()
        reshaped.share_memory_()
        assert reshaped["k2"].data_ptr() == address == td["k2"].data_ptr()
        reshaped["k2"].fill_(-1.0)
        assert (td["k2"] == -1.0).all()
