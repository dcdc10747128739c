"""Issue 13 (attach <= 2x its floor): the checks of a first attach, kept while it got cheaper.

A process that attaches a published version for the first time builds each anonymous
leaf from the published layout (segment, dtype, shape, strides, byte offset). However
those leaves are made, a leaf that does not fit its segment (past its end, misaligned,
an overflowing shape or stride, a negative offset or stride) or whose dtype is not a
torch dtype is refused before any tensor is made over it (no view that could fault on
first access), with an error that names the published name and the leaf's key. Each
case here publishes a real tensordict, then republishes its pickle through the manager
with one leaf's reference changed, as a buggy or hostile publisher could.

A zero-element leaf that is a view of a segment (``t[0:0]`` of a published leaf) has no
bytes to map: it is attached as an empty tensor, as a plain pickle rebuilds it.
"""
from __future__ import annotations

import gc
import pickle

import pytest
import torch

import shared_td
from shared_td import MemoryMappedTensor
from shared_td.coordinator import published
from shared_td.errors import FileTooShortError

_BIG = 1 << 62


def _republish_with(coord, name: str, td, key: tuple, change) -> None:
    """Publish ``td`` as ``name``, then publish again its pickle with the reference of
    leaf ``key`` (``(segment, dtype, shape, stride, byte offset, parent shape)``)
    replaced by ``change(reference)``."""
    coord.publish(name, td)
    blob, references = published.pickle_by_reference(td)
    tree, leaves = pickle.loads(blob)  # its segments are this process's own objects
    target = td[key]
    [index] = [i for i, leaf in enumerate(leaves) if leaf[4] == target._byte_offset()]
    leaves[index] = change(leaves[index])
    coord._call("publish", name, pickle.dumps((tree, leaves)), references, published.layout_of(td))


def _tree():
    return shared_td.TensorDict(a=torch.zeros(4), b={"c": torch.zeros(2, 3)}, d=torch.zeros(8, dtype=torch.int64))


def _with(reference, *, dtype=None, shape=None, stride=None, offset=None):
    backing, old_dtype, old_shape, old_stride, old_offset, parent = reference
    return (backing, old_dtype if dtype is None else dtype, old_shape if shape is None else shape,
            old_stride if stride is None else stride, old_offset if offset is None else offset, parent)


# (id, change of the reference of leaf ("b", "c"), the error class, what its message says)
_BAD_LEAVES = [
    ("past the end", lambda r: _with(r, offset=r[0].nbytes), FileTooShortError, r"needs \d+ bytes"),
    ("misaligned", lambda r: _with(r, offset=r[4] + 2), ValueError, "not a multiple of the 4-byte size"),
    ("overflowing shape", lambda r: _with(r, shape=(_BIG, _BIG), stride=(_BIG, 1)), FileTooShortError,
     r"needs \d+ bytes"),
    ("one huge stride", lambda r: _with(r, stride=(_BIG, 1)), FileTooShortError, r"needs \d+ bytes"),
    ("wider dtype past the end", lambda r: _with(r, dtype=torch.float64, offset=r[0].nbytes - 16),
     FileTooShortError, r"needs \d+ bytes"),
    ("negative offset", lambda r: _with(r, offset=-8), ValueError, "negative"),
    ("negative stride", lambda r: _with(r, stride=(-3, 1)), ValueError, "negative"),
    ("negative size", lambda r: _with(r, shape=(-2, 3)), ValueError, "negative"),
    ("not a dtype", lambda r: _with(r, dtype="float32"), TypeError, "dtype"),
    ("stride of another rank", lambda r: _with(r, stride=(3,)), ValueError, "stride"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("change, error, message", [case[1:] for case in _BAD_LEAVES],
                         ids=[case[0] for case in _BAD_LEAVES])
def test_a_leaf_that_does_not_fit_its_segment_is_refused_naming_it(change, error, message):
    with shared_td.Coordinator() as coord:
        td = _tree()
        _republish_with(coord, "w", td, ("b", "c"), change)
        for _attempt in range(2):  # nothing of a refused version is kept for the next attach
            with pytest.raises(error, match=message) as info:
                coord.attach("w")
            text = str(info.value)
            assert "'w'" in text and "('b', 'c')" in text, text
        # the version before it, still held, and the next one attach as usual
        coord.publish("w", td)
        assert coord.attach("w")["b", "c"].shape == (2, 3)


# (id, new byte offset of the last leaf, from the segment's size and the leaf's offset)
_BAD_OFFSETS = [
    ("past the end", lambda nbytes, offset: nbytes - 8),
    ("misaligned", lambda nbytes, offset: offset + 2),
    ("negative", lambda nbytes, offset: -16),
    ("far past the end", lambda nbytes, offset: 1 << 62),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("new_offset", [case[1] for case in _BAD_OFFSETS], ids=[case[0] for case in _BAD_OFFSETS])
def test_a_leaf_of_a_layout_met_before_is_checked_too(new_offset):
    # the leaves share one layout (dtype, shape, strides), checked once per version:
    # the offset of each one is still checked against its segment
    with shared_td.Coordinator() as coord:
        td = shared_td.TensorDict({f"k{i}": torch.zeros(4) for i in range(5)})
        coord.publish("w", td)
        blob, references = published.pickle_by_reference(td)
        tree, leaves = pickle.loads(blob)
        last = max(range(len(leaves)), key=lambda i: leaves[i][4])
        key = next(k for k in td.keys() if td[k]._byte_offset() == leaves[last][4])
        backing, dtype, shape, stride, offset, parent = leaves[last]
        leaves[last] = (backing, dtype, shape, stride, new_offset(backing.nbytes, offset), parent)
        coord._call("publish", "w", pickle.dumps((tree, leaves)), references, published.layout_of(td))
        with pytest.raises(ValueError, match=f"'{key}' is refused") as info:
            coord.attach("w")
        assert "'w'" in str(info.value)


@pytest.mark.timeout(60)
def test_leaves_of_several_dtypes_in_one_segment_are_each_their_own_view():
    with shared_td.Coordinator() as coord:
        td = shared_td.TensorDict(
            f=torch.arange(6.0).reshape(2, 3), i=torch.arange(5), h=torch.ones(3, dtype=torch.float16),
            b=torch.tensor([True, False]), t=torch.arange(12.0).reshape(3, 4).t())
        coord.publish("mixed", td)
        for _attempt in range(2):  # parsed, then built again from the parsed version
            view = coord.attach("mixed")
            for key in ["f", "i", "h", "b", "t"]:
                mine, theirs = td[key], view[key]
                assert type(theirs) is MemoryMappedTensor and theirs._backing is mine._backing
                assert (theirs.dtype, theirs.shape, theirs.stride()) == (mine.dtype, mine.shape, mine.stride())
                assert theirs.data_ptr() == mine.data_ptr() and torch.equal(theirs, mine)
            view["i"][2] = 40
            assert td["i"][2] == 40


@pytest.mark.timeout(60)
def test_a_zero_element_view_of_a_segment_attaches_as_an_empty_leaf():
    with shared_td.Coordinator() as coord:
        full = MemoryMappedTensor.zeros(4, 3)
        td = shared_td.TensorDict(x=full, none=full[0:0], cols=full[:, 3:])
        assert td["none"]._backing is full._backing  # a view of the segment, no bytes
        coord.publish("e", td)
        for _attempt in range(2):
            view = coord.attach("e")
            assert view["none"].shape == (0, 3) and view["cols"].shape == (4, 0)
            assert type(view["none"]) is MemoryMappedTensor and view["x"].data_ptr() == full.data_ptr()
            # as a plain pickle rebuilds it: pickled again, still empty
            assert pickle.loads(pickle.dumps(view["none"])).shape == (0, 3)
        del view
        gc.collect()
