"""make_memmap, make_memmap_from_tensor, make_memmap_from_storage and memmap_refresh_ on
a memory-mapped TensorDict (§3.5 of the memmap spec)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from tests.persist.persist_helpers import (
    MemoryMappedTensor, TensorDict, assert_all_memmap, bits, dir_state, tree_state,
)

from shared_td import BatchSizeMismatchError

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def mtd(tmp_path):
    """A memory-mapped td with a leaf and a sub-td, in tmp_path/p."""
    td = TensorDict({"a": torch.arange(3.0), "sub": {"b": torch.ones(3, 2)}}, [3])
    return td.memmap_(tmp_path / "p")


def meta(path) -> dict:
    return json.loads((path / "meta.json").read_text())


def read(path) -> bytes:
    return path.read_bytes()


# ----------------------------------------------------------------- make_memmap
def test_make_memmap_adds_a_zero_leaf_recorded_on_disk(mtd):
    path = mtd.saved_path
    out = mtd.make_memmap("new", [3, 4], dtype=torch.int16)
    assert isinstance(out, MemoryMappedTensor) and mtd["new"] is out
    assert out.dtype == torch.int16 and out.shape == (3, 4) and not out.any()
    assert out.filename == str(path / "new.memmap")
    assert mtd.is_locked and mtd.is_memmap()
    assert meta(path)["new"] == {"device": "cpu", "shape": [3, 4], "dtype": "torch.int16", "is_nested": False}
    out[1] = 7  # writes through the returned tensor reach the file
    assert read(path / "new.memmap") == bits(out)
    loaded = TensorDict.load_memmap(path)
    assert loaded["new"].tolist() == out.tolist() and loaded["new"].dtype == torch.int16
    assert set(loaded.keys()) == {"a", "sub", "new"}


def test_make_memmap_default_dtype(mtd):
    assert mtd.make_memmap("f", [3]).dtype == torch.get_default_dtype()


def test_make_memmap_nested_key_creates_sub_tensordicts(mtd):
    path = mtd.saved_path
    out = mtd.make_memmap(("n1", ("n2", "leaf")), [3, 2], dtype=torch.float64)
    assert mtd["n1", "n2", "leaf"] is out
    assert out.filename == str(path / "n1" / "n2" / "leaf.memmap")
    assert_all_memmap(mtd, path)
    assert mtd["n1"].batch_size == (3,) and mtd["n1", "n2"].saved_path == path / "n1" / "n2"
    assert meta(path)["n1"] == {"type": "TensorDict"} and meta(path / "n1")["n2"] == {"type": "TensorDict"}
    assert "leaf" in meta(path / "n1" / "n2")
    # an existing sub-td gets the leaf
    mtd.make_memmap(("sub", "c"), [3])
    assert "c" in meta(path / "sub") and "b" in meta(path / "sub")
    loaded = TensorDict.load_memmap(path)
    assert loaded["n1", "n2", "leaf"].shape == (3, 2) and loaded["sub", "c"].shape == (3,)
    with pytest.raises(RuntimeError, match="locked"):
        mtd["n1"]["other"] = torch.zeros(3)


def test_make_memmap_encodes_keys_inside_the_prefix(mtd, tmp_path):
    mtd.make_memmap(("..", "../x"), [3])
    assert (mtd.saved_path / "%2E%2E" / "..%2Fx.memmap").is_file()
    assert sorted(os.listdir(tmp_path)) == ["p"]
    assert TensorDict.load_memmap(mtd.saved_path)["..", "../x"].shape == (3,)


@pytest.mark.parametrize("key", ["a", ("sub", "b"), "sub", ("sub",)])
def test_make_memmap_duplicate_key(mtd, key):
    state, disk = tree_state(mtd), dir_state(mtd.saved_path)
    for make in (
        lambda: mtd.make_memmap(key, [3]),
        lambda: mtd.make_memmap_from_tensor(key, torch.zeros(3)),
        lambda: mtd.make_memmap_from_storage(key, mtd["a"].untyped_storage(), [3], dtype=torch.float32),
    ):
        with pytest.raises(RuntimeError, match="already exists"):
            make()
    assert tree_state(mtd) == state and dir_state(mtd.saved_path) == disk


def test_make_memmap_needs_a_memmapped_td(tmp_path):
    td = TensorDict({"a": torch.zeros(3)}, [3])
    for make in (
        lambda: td.make_memmap("x", [3]),
        lambda: td.make_memmap_from_tensor("x", torch.zeros(3)),
        lambda: td.make_memmap_from_storage("x", torch.UntypedStorage(12), [3], dtype=torch.float32),
    ):
        with pytest.raises(RuntimeError, match="memory-mapped"):
            make()
    assert list(td.keys()) == ["a"]
    unlocked = TensorDict({"a": torch.zeros(3)}, [3]).memmap_(tmp_path).unlock_()
    with pytest.raises(RuntimeError, match="memory-mapped"):
        unlocked.make_memmap("x", [3])
    assert not (tmp_path / "x.memmap").exists()


def test_make_memmap_wrong_batch_shape_leaves_nothing(mtd):
    state, disk = tree_state(mtd), dir_state(mtd.saved_path)
    with pytest.raises(BatchSizeMismatchError, match="batch size"):
        mtd.make_memmap("bad", [2, 3])
    with pytest.raises(BatchSizeMismatchError, match="batch size"):
        mtd.make_memmap(("new", "bad"), [4])
    with pytest.raises(BatchSizeMismatchError, match="batch size"):
        mtd.make_memmap_from_tensor("bad", torch.zeros(5))
    assert tree_state(mtd) == state and dir_state(mtd.saved_path) == disk


def test_make_memmap_through_a_leaf_is_a_key_error(mtd):
    state, disk = tree_state(mtd), dir_state(mtd.saved_path)
    with pytest.raises(KeyError, match="not a tensordict"):
        mtd.make_memmap(("a", "b"), [3])
    assert tree_state(mtd) == state and dir_state(mtd.saved_path) == disk


def test_make_memmap_in_anonymous_memory():
    td = TensorDict({"a": torch.zeros(3)}, [3]).memmap_()
    out = td.make_memmap(("n", "x"), [3, 2])
    assert td["n", "x"] is out and isinstance(out, MemoryMappedTensor)
    with pytest.raises(RuntimeError, match="no file"):
        out.filename
    assert_all_memmap(td)
    assert td["n"].saved_path is None


# ----------------------------------------------------------------- make_memmap_from_tensor
def test_make_memmap_from_tensor_copies(mtd, tmp_path):
    path = mtd.saved_path
    source = torch.arange(6, dtype=torch.int32).reshape(3, 2)
    out = mtd.make_memmap_from_tensor(("n", "t"), source)
    assert mtd["n", "t"] is out and out.filename == str(path / "n" / "t.memmap")
    assert torch.equal(out, source) and out.data_ptr() != source.data_ptr()
    assert read(path / "n" / "t.memmap") == bits(source)
    zeros = mtd.make_memmap_from_tensor("z", source, copy_data=False)
    assert zeros.shape == source.shape and zeros.dtype == source.dtype and not zeros.any()
    # a source mapped to another file is copied; its file is untouched
    other = TensorDict({"s": torch.arange(3.0)}, [3]).memmap_(tmp_path / "other")
    before = read(tmp_path / "other" / "s.memmap")
    copied = mtd.make_memmap_from_tensor("s", other["s"])
    copied.fill_(-1.0)
    assert copied.filename == str(path / "s.memmap") and read(tmp_path / "other" / "s.memmap") == before
    loaded = TensorDict.load_memmap(path)
    assert torch.equal(loaded["n", "t"], source) and loaded["s"].tolist() == [-1.0] * 3
    assert mtd.is_locked


def test_make_memmap_from_tensor_existsok(mtd):
    path = mtd.saved_path
    (path / "stale.memmap").write_bytes(b"\x01" * 12)
    state = tree_state(mtd)
    with pytest.raises(RuntimeError, match="already exists"):
        mtd.make_memmap_from_tensor("stale", torch.zeros(3), existsok=False)
    assert tree_state(mtd) == state and "stale" not in meta(path)
    assert read(path / "stale.memmap") == b"\x01" * 12
    out = mtd.make_memmap_from_tensor("stale", torch.full((3,), 2.0))  # existsok=True by default
    assert read(path / "stale.memmap") == bits(out) and out.tolist() == [2.0] * 3


def test_make_memmap_over_a_stale_file_reads_zeros(mtd):
    (mtd.saved_path / "old.memmap").write_bytes(b"\xff" * 64)
    assert not mtd.make_memmap("old", [3], dtype=torch.int32).any()


# ----------------------------------------------------------------- make_memmap_from_storage
def test_make_memmap_from_storage(mtd):
    path = mtd.saved_path
    base = MemoryMappedTensor.from_tensor(torch.arange(6.0), filename=path / "st.memmap")
    out = mtd.make_memmap_from_storage("st", base.untyped_storage(), [3, 2], dtype=torch.float32)
    assert mtd["st"] is out and out.tolist() == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]
    out[0, 0] = 10.0  # the same storage: the base sees it
    assert base[0] == 10.0
    assert meta(path)["st"]["shape"] == [3, 2]
    assert TensorDict.load_memmap(path)["st"].tolist() == out.tolist()
    # nested key
    sub = MemoryMappedTensor.from_tensor(torch.ones(3), filename=path / "sub" / "s2.memmap")
    mtd.make_memmap_from_storage(("sub", "s2"), sub.untyped_storage(), [3], dtype=torch.float32)
    assert TensorDict.load_memmap(path)["sub", "s2"].tolist() == [1.0] * 3


def test_make_memmap_from_storage_of_another_file_is_refused(mtd, tmp_path):
    other = TensorDict({"o": torch.arange(6.0)}, [6]).memmap_(tmp_path / "other")
    state, disk = tree_state(mtd), dir_state(mtd.saved_path)
    with pytest.raises(RuntimeError, match="differs"):
        mtd.make_memmap_from_storage("o", other["o"].untyped_storage(), [3, 2], dtype=torch.float32)
    # a storage without any file cannot be recorded in the directory
    # (tensordict 0.15.3 warns and records an entry that the next load drops)
    with pytest.raises((RuntimeError, ValueError), match="file"):
        mtd.make_memmap_from_storage("x", torch.UntypedStorage(24), [3, 2], dtype=torch.float32)
    assert tree_state(mtd) == state and dir_state(mtd.saved_path) == disk


# ----------------------------------------------------------------- memmap_refresh_
_CHILD = textwrap.dedent(
    """
    import sys, torch
    from shared_td import TensorDict
    td = TensorDict.load_memmap(sys.argv[1]).memmap_()
    td.make_memmap("from_child", [3, 2], dtype=torch.int64).fill_(42)
    td.make_memmap(("deep", "x"), [3]).fill_(1.5)
    td["a"].fill_(-7.0)
    """
)


def test_memmap_refresh_sees_keys_added_by_another_process(mtd):
    path = mtd.saved_path
    leaf = mtd["a"]
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-c", _CHILD, str(path)], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "from_child" not in mtd.keys()
    assert mtd["a"].tolist() == [-7.0] * 3  # the same file: the child's write is seen
    assert mtd.memmap_refresh_() is mtd
    assert mtd["from_child"].tolist() == [[42, 42]] * 3 and mtd["deep", "x"].tolist() == [1.5] * 3
    assert mtd.is_memmap() and mtd.is_locked and mtd.saved_path == path
    assert_all_memmap(mtd, path)
    assert mtd["a"].filename == leaf.filename and ("sub", "b") in mtd.keys(True)


def test_memmap_refresh_needs_a_saved_memmapped_td(tmp_path):
    anonymous = TensorDict({"a": torch.zeros(3)}, [3]).memmap_()
    plain = TensorDict({"a": torch.zeros(3)}, [3])
    unlocked = TensorDict({"a": torch.zeros(3)}, [3]).memmap_(tmp_path).unlock_()
    for td in (anonymous, plain, unlocked):
        state = tree_state(td)
        with pytest.raises(RuntimeError, match="Cannot refresh"):
            td.memmap_refresh_()
        assert tree_state(td) == state
