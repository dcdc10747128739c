"""save/dumps, load_memmap, load, load_memmap_ on TensorDict: round trips (incl. what
tensordict 0.15.3 loses, §12), damaged directories, pickle and symlink safety."""
from __future__ import annotations

import os
import pickle
import shutil

import numpy as np
import pytest
import torch

from tests.persist.persist_helpers import (
    DTYPES, MemoryMappedTensor, NonTensorData, NonTensorStack, TensorDict, assert_all_memmap,
    assert_same_values, bits, dir_state, make_td, tree_state, values_state,
)

from shared_td.storage.files import FileTooShortError


@pytest.fixture
def saved(tmp_path):
    """A saved make_td() (with batch dim names) and the path it is in."""
    td = make_td()
    td.names = ["batch"]
    td.save(tmp_path / "s")
    return td, tmp_path / "s"


# ----------------------------------------------------------------- save / dumps
@pytest.mark.parametrize("method", ["save", "dumps"])
def test_save_writes_a_memmapped_copy(tmp_path, method):
    td = make_td()
    state = tree_state(td)
    copy = getattr(td, method)(tmp_path)
    assert copy is not td and tree_state(td) == state
    assert_all_memmap(copy, tmp_path)
    assert (tmp_path / "meta.json").is_file()
    assert_same_values(TensorDict.load_memmap(tmp_path), td)


# ----------------------------------------------------------------- load_memmap
@pytest.mark.parametrize("device", [None, "cpu", torch.device("cpu")])
def test_load_memmap_round_trip(saved, device):
    td, path = saved
    loaded = TensorDict.load_memmap(path, device=device)
    assert type(loaded) is TensorDict
    assert_same_values(loaded, td)
    assert loaded.batch_size == td.batch_size and loaded.device == torch.device("cpu")
    assert loaded.names == ["batch"]  # tensordict 0.15.3 loses the names
    assert not loaded.is_locked and not loaded.is_memmap()  # as tensordict: call memmap_()
    for key in loaded.keys(True, True):
        value = loaded.get(key)
        if isinstance(value, torch.Tensor) and value.numel():
            assert isinstance(value, MemoryMappedTensor)
            assert value.filename.startswith(str(path) + os.sep)
    assert loaded.get("task").batch_size == td.batch_size
    assert loaded.get(("nested", "deeper", "note")).data == "deep"
    assert loaded.get("stack").tolist() == ["s0", "s1", "s2"]
    # the leaves map the files: a write reaches the file
    loaded["float32"].fill_(9.0)
    with open(path / "float32.memmap", "rb") as handle:
        assert handle.read() == bits(torch.full((3, 2), 9.0))
    # memmap_() without prefix makes it a memmap td of that directory, no copy
    leaf = loaded["int64"]
    loaded.memmap_()
    assert loaded.is_memmap() and loaded.saved_path == path and loaded["int64"] is leaf


def test_load_is_load_memmap(saved):
    td, path = saved
    assert_same_values(TensorDict.load(path), td)
    assert_same_values(TensorDict.load(path, None), td)


def test_load_dispatches_on_the_recorded_type(saved):
    td, path = saved
    assert type(NonTensorStack.load_memmap(path)) is TensorDict
    assert type(NonTensorData.load(path)) is TensorDict
    stack = TensorDict.load_memmap(path / "stack")
    assert type(stack) is NonTensorStack and stack.tolist() == ["s0", "s1", "s2"]
    data = TensorDict.load_memmap(path / "task")
    assert type(data) is NonTensorData and data.data == "walk"
    sub = NonTensorData.load_memmap(path / "nested")
    assert type(sub) is TensorDict and sub.batch_size == td.batch_size
    assert_same_values(sub, td["nested"])


@pytest.mark.parametrize("name", ["float8_e4m3fn", "float8_e5m2", "bfloat16", "uint64", "complex128", "bool"])
def test_every_dtype_round_trips(saved, name):
    td, path = saved
    loaded = TensorDict.load_memmap(path)
    assert loaded[name].dtype == DTYPES[name]
    assert bits(loaded[name]) == bits(td[name])


def test_reserved_key_names_round_trip(tmp_path):
    from shared_td.persist import format as fmt

    reserved = sorted(fmt.NODE_FIELDS)  # shape, device, _type, _names, ...
    assert {"shape", "device", "_type"} <= set(reserved)
    td = TensorDict({name: torch.full((2,), float(i)) for i, name in enumerate(reserved)}, [2])
    td["nested"] = {"shape": torch.ones(2, 3), "_type": {"device": torch.zeros(2)}}
    td["device_str"] = "x"
    td.memmap_(tmp_path)
    loaded = TensorDict.load_memmap(tmp_path)
    assert loaded.batch_size == torch.Size([2])
    assert set(loaded.keys(True, True)) == set(td.keys(True, True))
    for key in td.keys(True, True):
        assert values_state(loaded)[key] == values_state(td)[key], key


def test_empty_and_zero_dim_leaves_round_trip(tmp_path):
    td = TensorDict({"e": torch.zeros(2, 0, 3), "s": torch.tensor([1, 2]), "x": torch.zeros(0, dtype=torch.int8)}, [])
    td.memmap_(tmp_path)
    loaded = TensorDict.load_memmap(tmp_path)
    assert_same_values(loaded, td)
    assert loaded.batch_size == torch.Size([])


def test_non_tensor_entries_round_trip(tmp_path):
    td = TensorDict({"a": torch.zeros(2)}, [2])
    td["s"] = "text"
    td["s2"] = "more"
    td.set("st", NonTensorStack("u", "v"))
    td.memmap_(tmp_path)
    assert td["s"] == "text" and td.get("st").tolist() == ["u", "v"]
    loaded = TensorDict.load_memmap(tmp_path)
    assert loaded["s"] == "text" and loaded.get("st").tolist() == ["u", "v"]
    assert loaded.get("s").batch_size == torch.Size([2]) and loaded["s2"] == "more"


# ----------------------------------------------------------------- load_memmap_
def test_load_memmap_into_a_td_replaces_its_entries(saved):
    td, path = saved
    # As installed tensordict 0.15.3 does: self's entries become those on disk.
    target = TensorDict({"extra": torch.arange(3), "float32": torch.zeros(3, 2)}, [3])
    assert target.load_memmap_(path) is target
    assert "extra" not in target.keys()
    assert bits(target["float32"]) == bits(td["float32"])
    assert set(td.keys(True, True)) == set(target.keys(True, True))
    assert not target.is_locked


def test_load_memmap_into_a_memmapped_td_stays_memmapped(tmp_path):
    path = tmp_path / "p"
    TensorDict({"a": torch.ones(2), "n": {"b": torch.ones(2)}}, [2]).memmap_(path)
    td = TensorDict.load_memmap(path).memmap_()
    TensorDict({"a": torch.full((2,), 5.0), "n": {"b": torch.ones(2), "c": torch.ones(2)}}, [2]).memmap(
        tmp_path / "q"
    )
    shutil.rmtree(path)
    shutil.copytree(tmp_path / "q", path)
    td.load_memmap_(path)
    assert td.is_memmap() and td.is_locked and td.saved_path == path
    assert td["a"].tolist() == [5.0, 5.0] and ("n", "c") in td.keys(True)


# ----------------------------------------------------------------- damaged directories
def test_alike_nodes_are_told_apart(tmp_path):
    """Nodes whose meta.json bytes are the same (a load checks such bytes once) still
    load their own leaves, give their own values, and name their own file in errors."""
    from shared_td import FormatError

    td = TensorDict({name: {"x": torch.full((2,), float(i)), "c": {"y": torch.zeros(2)},
                            "note": NonTensorData(["a", "list"])} for i, name in enumerate("ab")}, [2])
    td.save(tmp_path / "s")
    assert (tmp_path / "s/a/meta.json").read_bytes() == (tmp_path / "s/b/meta.json").read_bytes()
    loaded = TensorDict.load_memmap(tmp_path / "s")
    assert loaded["a", "x"].tolist() == [0.0, 0.0] and loaded["b", "x"].tolist() == [1.0, 1.0]
    assert loaded["a", "note"] == ["a", "list"] and loaded["a", "note"] is not loaded["b", "note"]
    # b's child no longer fits b's batch size: the error names b's meta.json, not a's
    meta = tmp_path / "s/b/c/meta.json"
    meta.write_text(meta.read_text().replace('"shape": [2]', '"shape": [3]'))  # its batch and y's
    (tmp_path / "s/b/c/y.memmap").write_bytes(bytes(12))
    with pytest.raises(FormatError) as info:
        TensorDict.load_memmap(tmp_path / "s")
    assert info.value.path == str(tmp_path / "s/b/meta.json"), info.value


def test_short_leaf_file_is_a_clear_error(saved):
    td, path = saved
    os.truncate(path / "nested" / "x.memmap", 5)
    with pytest.raises(FileTooShortError, match="x.memmap") as info:
        TensorDict.load_memmap(path)
    assert isinstance(info.value, (ValueError, RuntimeError))
    assert os.path.getsize(path / "nested" / "x.memmap") == 5  # nothing was grown or created


def test_missing_leaf_file_is_an_error_naming_the_key(saved):
    td, path = saved
    os.unlink(path / "nested" / "deeper" / "y.memmap")
    with pytest.raises(FileNotFoundError, match="'y'"):
        TensorDict.load_memmap(path)
    assert not (path / "nested" / "deeper" / "y.memmap").exists()  # not re-created as zeros


def test_missing_child_directory_is_an_error_naming_the_key(saved):
    td, path = saved
    shutil.rmtree(path / "nested")
    disk = dir_state(path)
    with pytest.raises(FileNotFoundError, match="'nested'"):
        TensorDict.load_memmap(path)
    assert dir_state(path) == disk


def test_longer_leaf_file_is_accepted(saved):
    td, path = saved
    with open(path / "int16.memmap", "ab") as handle:
        handle.write(b"\n\x00trailing")
    loaded = TensorDict.load_memmap(path)
    assert bits(loaded["int16"]) == bits(td["int16"])


def test_unknown_dtype_is_an_error_naming_the_file(saved):
    td, path = saved
    meta = (path / "meta.json").read_text().replace('"torch.int32"', '"torch.int33"')
    (path / "meta.json").write_text(meta)
    disk = dir_state(path)
    with pytest.raises(ValueError, match="int33") as info:
        TensorDict.load_memmap(path)
    assert "meta.json" in str(info.value)
    assert dir_state(path) == disk


def test_missing_directory_and_meta(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        TensorDict.load_memmap(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="meta.json"):
        TensorDict.load_memmap(tmp_path)
    assert dir_state(tmp_path) == {}  # nothing was created


# ----------------------------------------------------------------- pickle safety
class _Marker:
    """Unpickling this creates ``path`` (proof that pickle ran)."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _save_pickled(path, which=("obj", "stack")):
    td = TensorDict({"a": torch.ones(2)}, [2])
    # complex numbers are not JSON: they are pickled
    td["obj"] = NonTensorData(3 + 4j if "obj" in which else "json", batch_size=[2])
    td["stack"] = NonTensorStack(1 + 1j, 2 + 2j) if "stack" in which else NonTensorStack("u", "v")
    td.memmap_(path)
    assert (path / "obj" / "other.pickle").is_file() == ("obj" in which)
    assert (path / "stack" / "pickle.pkl").is_file() == ("stack" in which)
    return td


@pytest.fixture
def pickled(tmp_path):
    """A save with a pickled NonTensorData and a pickled NonTensorStack."""
    return _save_pickled(tmp_path / "s"), tmp_path / "s"


@pytest.mark.parametrize("rigged", ["obj/other.pickle", "stack/pickle.pkl"])
@pytest.mark.parametrize("allow_pickle", [False, None])
def test_pickle_is_refused_before_unpickling(tmp_path, rigged, allow_pickle):
    path = tmp_path / "s"
    td = _save_pickled(path, which=(rigged.split("/")[0],))
    marker = tmp_path / "marker"
    (path / rigged).write_bytes(pickle.dumps(_Marker(marker)))
    disk = dir_state(path)
    kwargs = {} if allow_pickle is None else {"allow_pickle": allow_pickle}
    with pytest.raises(RuntimeError, match="allow_pickle") as info:
        TensorDict.load_memmap(path, **kwargs)
    assert str(path / rigged) in str(info.value)
    assert not marker.exists(), "the pickle was run before being refused"
    target = TensorDict({"z": torch.zeros(2)}, [2])
    with pytest.raises(RuntimeError, match="allow_pickle"):
        target.load_memmap_(path, **kwargs)
    assert list(target.keys()) == ["z"]
    with pytest.raises(RuntimeError, match="allow_pickle"):
        td.memmap_refresh_(**kwargs)
    assert not marker.exists()
    assert dir_state(path) == disk
    with pytest.raises(Exception):  # True does run it (the rigged value is no valid data)
        TensorDict.load_memmap(path, allow_pickle=True)
    assert marker.exists()


def test_pickle_loads_with_allow_pickle_true(pickled):
    td, path = pickled
    loaded = TensorDict.load_memmap(path, allow_pickle=True)
    assert loaded["obj"] == 3 + 4j and loaded.get("stack").tolist() == [1 + 1j, 2 + 2j]
    target = TensorDict(batch_size=[2]).load_memmap_(path, allow_pickle=True)
    assert target["obj"] == 3 + 4j
    assert td.memmap_refresh_(allow_pickle=True) is td


@pytest.mark.parametrize("bad", [0, 1, np.bool_(True), np.bool_(False), "yes", 1.0])
def test_allow_pickle_must_be_a_bool(pickled, bad):
    td, path = pickled
    state, disk = tree_state(td), dir_state(path)
    with pytest.raises(TypeError, match="allow_pickle"):
        TensorDict.load_memmap(path, allow_pickle=bad)
    target = TensorDict({"z": torch.zeros(2)}, [2])
    with pytest.raises(TypeError, match="allow_pickle"):
        target.load_memmap_(path, allow_pickle=bad)
    with pytest.raises(TypeError, match="allow_pickle"):
        td.memmap_refresh_(allow_pickle=bad)
    assert list(target.keys()) == ["z"] and tree_state(td) == state and dir_state(path) == disk


def test_json_resave_removes_a_stale_pickle(pickled):
    td, path = pickled
    TensorDict({"a": torch.ones(2), "obj": "json now", "stack": NonTensorStack("u", "v")}, [2]).memmap_(path)
    assert not (path / "obj" / "other.pickle").exists() and not (path / "stack" / "pickle.pkl").exists()
    loaded = TensorDict.load_memmap(path)
    assert loaded["obj"] == "json now" and loaded.get("stack").tolist() == ["u", "v"]


# ----------------------------------------------------------------- symlinks on load
def test_symlinked_leaf_file_is_refused(saved, tmp_path):
    td, path = saved
    elsewhere = tmp_path / "elsewhere.bin"
    shutil.move(path / "float32.memmap", elsewhere)
    os.symlink(elsewhere, path / "float32.memmap")
    before, disk = elsewhere.read_bytes(), dir_state(path)
    with pytest.raises(RuntimeError, match="symlink") as info:
        TensorDict.load_memmap(path)
    assert "float32.memmap" in str(info.value)
    assert elsewhere.read_bytes() == before and dir_state(path) == disk
    target = TensorDict({"z": torch.zeros(3)}, [3])
    with pytest.raises(RuntimeError, match="symlink"):
        target.load_memmap_(path)
    assert list(target.keys()) == ["z"]


def test_symlinked_child_directory_is_refused(saved, tmp_path):
    td, path = saved
    shutil.move(path / "nested", tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", path / "nested")
    disk, outside = dir_state(path), dir_state(tmp_path / "elsewhere")
    with pytest.raises(RuntimeError, match="symlink") as info:
        TensorDict.load_memmap(path)
    assert "nested" in str(info.value)
    assert dir_state(path) == disk and dir_state(tmp_path / "elsewhere") == outside


def test_legacy_unsafe_names_are_not_followed(tmp_path):
    # robust save of "../x" is "..%2Fx.memmap"; a raw "../x.memmap" must not be read
    path = tmp_path / "p"
    TensorDict({"../x": torch.ones(2)}, [2]).memmap_(path)
    os.rename(path / "..%2Fx.memmap", tmp_path / "x.memmap")
    disk = dir_state(tmp_path)
    with pytest.raises(FileNotFoundError, match="'../x'"):
        TensorDict.load_memmap(path)
    assert dir_state(tmp_path) == disk
