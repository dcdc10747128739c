"""Consolidated saves between shared_td and tensordict 0.15.3, both ways.

``consolidate(filename=)`` files (the leaves' bytes, then the JSON metadata, then its
length as int64) written by one library and read by the other's ``from_consolidated``;
consolidated trees saved as directories (``memmap_``) and as ``.tdz`` archives and loaded
by the other library.
"""
from __future__ import annotations

import json

import pytest
import torch

from tests.interop.test_interop import (
    BATCH_SIZES, DIRECTIONS, DTYPES, JSON_VALUES, LIBS, assert_same, lazy_stack, load, nested_td,
    set_non_tensor, stack_of,
)
from tests.reference import needs_tensordict

pytestmark = needs_tensordict


def from_consolidated(lib_name, path):
    return LIBS[lib_name].TensorDict.from_consolidated(path)


def same(loaded, expected):
    """assert_same, but keys in any order: the file keeps non-tensors, leaves and nested
    collections apart (tensordict's readers give them in that order)."""
    assert_same(loaded, expected, ordered=False)


def file_metadata(path) -> dict:
    raw = path.read_bytes()
    length = int.from_bytes(raw[-8:], "little")
    return json.loads(raw[-8 - length:-8])


@pytest.mark.parametrize("batch", BATCH_SIZES)
@pytest.mark.parametrize("writer,reader", DIRECTIONS)
def test_nested_consolidated_file(tmp_path, writer, reader, batch):
    source = nested_td(writer, batch, names=["n%d" % i for i in range(len(batch))] or None)
    set_non_tensor(writer, source, "note", "hello")
    path = tmp_path / "td.bin"
    source.consolidate(filename=path)
    loaded = from_consolidated(reader, path)
    same(loaded, source)
    assert list(loaded.names or []) == list(source.names or [])  # (for batch [], tensordict says [], shared_td None)
    assert loaded["level1", "level2", "wide"].batch_size == torch.Size(list(batch) + [2])
    assert loaded.is_consolidated() and not loaded.is_locked


@pytest.mark.parametrize("writer,reader", DIRECTIONS)
def test_every_dtype(tmp_path, writer, reader):
    data = {str(dtype).split(".")[1]: (torch.arange(5) * 37 % 120).to(dtype) for dtype in DTYPES}
    data["empty"] = torch.zeros(0, 3)
    source = LIBS[writer].TensorDict(data, [])
    source.consolidate(filename=tmp_path / "td.bin")
    same(from_consolidated(reader, tmp_path / "td.bin"), source)


@pytest.mark.parametrize("writer,reader", DIRECTIONS)
def test_non_tensor_values_are_json(tmp_path, writer, reader):
    source = LIBS[writer].TensorDict({"x": torch.zeros(2, 1), "sub": {}}, [2])
    for key, value in JSON_VALUES.items():
        set_non_tensor(writer, source, key, value)
    set_non_tensor(writer, source.get("sub"), "deep", "text")
    source["words"] = stack_of(writer, ["a", "b"])
    source.consolidate(filename=tmp_path / "td.bin")
    meta = file_metadata(tmp_path / "td.bin")
    assert meta["non_tensors"]["str"] == ["walk", [2], None]  # JSON values, no pickle
    loaded = from_consolidated(reader, tmp_path / "td.bin")
    same(loaded, source)
    for key, value in JSON_VALUES.items():
        assert loaded[key] == value


@pytest.mark.parametrize("stack_dim", [0, 1])
@pytest.mark.parametrize("writer,reader", DIRECTIONS)
def test_lazy_stack(tmp_path, writer, reader, stack_dim):
    source = LIBS[writer].TensorDict({"stack": lazy_stack(writer, stack_dim), "y": torch.ones(())}, [])
    source.consolidate(filename=tmp_path / "td.bin")
    same(from_consolidated(reader, tmp_path / "td.bin"), source)


def test_same_metadata_as_tensordict(tmp_path):
    """The JSON describes the same tree (classes, batch sizes, names, shapes, dtypes,
    non-tensor values); offsets may differ (each library places the bytes its way)."""
    def strip_offsets(meta):
        meta = dict(meta)
        meta["leaves"] = {k: v[:2] for k, v in meta["leaves"].items()}
        return {k: strip_offsets(v) if isinstance(v, dict) and "cls" in v else v for k, v in meta.items()}

    metas = {}
    for name in LIBS:
        source = nested_td(name, [3], names=["t"])
        set_non_tensor(name, source, "note", "hello")
        source.consolidate(filename=tmp_path / f"{name}.bin")
        metas[name] = strip_offsets(file_metadata(tmp_path / f"{name}.bin"))
    assert metas["shared_td"] == metas["tensordict"]


@pytest.mark.parametrize("writer,reader", DIRECTIONS)
def test_consolidated_tree_saved_as_directory(tmp_path, writer, reader):
    source = nested_td(writer, [3])
    set_non_tensor(writer, source, "note", "hello")
    consolidated = source.consolidate()
    consolidated.memmap_(tmp_path / "td")
    assert_same(load(reader, tmp_path / "td"), source)


@pytest.mark.parametrize("writer,reader", DIRECTIONS)
def test_consolidated_tree_saved_as_archive(tmp_path, writer, reader):
    source = nested_td(writer, [2, 3])
    set_non_tensor(writer, source, "note", "hello")
    source.consolidate().save(tmp_path / "td.tdz")
    assert_same(load(reader, tmp_path / "td.tdz"), source)


@pytest.mark.parametrize("writer,reader", DIRECTIONS)
def test_loaded_consolidated_file_saved_again(tmp_path, writer, reader):
    """What one library loads from the other's file, it saves as a directory and as a
    consolidated file that the first library reads back."""
    source = nested_td(writer, [3])
    source.consolidate(filename=tmp_path / "a.bin")
    loaded = from_consolidated(reader, tmp_path / "a.bin")
    loaded.memmap(tmp_path / "dir")
    same(load(writer, tmp_path / "dir"), source)
    loaded.contiguous().consolidate(filename=tmp_path / "b.bin")
    same(from_consolidated(writer, tmp_path / "b.bin"), source)


@pytest.mark.parametrize("reader", list(LIBS))
def test_in_place_writes_do_not_reach_the_file(tmp_path, reader):
    """tensordict maps the file copy-on-write: a write into a loaded leaf stays in the
    process (as documented by tensordict's from_consolidated)."""
    LIBS["tensordict"].TensorDict(a=torch.zeros(4)).consolidate(filename=tmp_path / "td.bin")
    loaded = from_consolidated(reader, tmp_path / "td.bin")
    loaded["a"][1] = 5.0
    assert loaded["a"].tolist() == [0.0, 5.0, 0.0, 0.0]
    assert from_consolidated(reader, tmp_path / "td.bin")["a"].tolist() == [0.0] * 4


def test_pickle_of_a_tensordict_file_whose_data_end_inside_an_element(tmp_path):
    """tensordict pads leaves to 8 bytes: 24 bytes of data are not a whole number of
    complex128; the loaded tree still pickles (as one buffer) and unpickles."""
    import pickle

    source = LIBS["tensordict"].TensorDict(z=torch.tensor([1 + 2j], dtype=torch.complex128),
                                           b=torch.tensor([3], dtype=torch.int8))
    source.consolidate(filename=tmp_path / "td.bin")
    loaded = from_consolidated("shared_td", tmp_path / "td.bin")
    again = pickle.loads(pickle.dumps(loaded))
    assert again.is_consolidated()
    same(again, source)


@pytest.mark.parametrize("lib_name", sorted(LIBS))
def test_a_value_that_is_not_json_is_a_runtime_error_in_both(lib_name, tmp_path):
    """What tensordict raises for a non-tensor value its file cannot hold, shared_td
    raises too (a TypeError before: ``except RuntimeError`` written for tensordict missed it)."""
    td = LIBS[lib_name].TensorDict(x=torch.zeros(2), r=b"bytes", batch_size=[2])
    with pytest.raises(RuntimeError):
        td.consolidate(filename=tmp_path / "td.bin")


def list_valued_stacks(lib_name):
    """A stack whose values are lists (ragged, then equal-length: not a dim) and a 2-D
    stack of list values, as each library builds them."""
    lib = LIBS[lib_name]

    def row(*values):
        return lib.NonTensorStack(*[lib.NonTensorData(v) for v in values])

    return lib.TensorDict(ragged=row([1, 2], [3]), even=row([1, 2], [3, 4]),
                          grid=lib.NonTensorStack(row(["a"], ["b", "c"]), row(["d"], ["e"])),
                          batch_size=[2])


@pytest.mark.parametrize("writer,reader", DIRECTIONS)
def test_stack_of_list_values(tmp_path, writer, reader):
    """shared_td wrote list values as one more dim: (2, 2) came back, or a file that
    could not be read."""
    source = list_valued_stacks(writer)
    source.consolidate(filename=tmp_path / "td.bin")
    same(from_consolidated(reader, tmp_path / "td.bin"), source)


@pytest.mark.parametrize("locked", [False, True])
def test_same_stack_metadata_as_tensordict(tmp_path, locked):
    metas = {}
    for name in LIBS:
        td = list_valued_stacks(name)
        (td.lock_() if locked else td).consolidate(filename=tmp_path / f"{name}.bin")
        metas[name] = file_metadata(tmp_path / f"{name}.bin")
    assert metas["shared_td"] == metas["tensordict"]


def test_a_nested_collection_named_size_is_lost_by_tensordict_refused_by_shared_td(tmp_path):
    """Why shared_td refuses it: tensordict's reader drops "size" at every node."""
    td = LIBS["tensordict"].TensorDict(size={"a": torch.ones(2)}, b=torch.zeros(1))
    td.consolidate(filename=tmp_path / "td.bin")
    assert list(from_consolidated("tensordict", tmp_path / "td.bin").keys()) == ["b"]
    with pytest.raises(ValueError, match="'size'.*Rename"):
        LIBS["shared_td"].TensorDict(size={"a": torch.ones(2)}).consolidate(filename=tmp_path / "ours.bin")
