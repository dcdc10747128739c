"""memmap_, memmap and memmap_like on TensorDict (the seed page TensorDictBase.memmap_
and §3, §5, §12 of the memmap spec), without atomic= and share_non_tensor=."""
from __future__ import annotations

import os
import pickle
import threading

import pytest
import torch

from tests.persist.persist_helpers import (
    DTYPES, MemoryMappedTensor, TensorDict, assert_all_memmap,
    assert_same_values, bits, dir_state, make_td, tree_state, values_state,
)

import shared_td.storage.files as files
from shared_td.persist import writer
from shared_td.persist.future import TensorDictFuture
from shared_td.storage.anonymous import Segment


def read(path) -> bytes:
    with open(path, "rb") as handle:
        return handle.read()


# ----------------------------------------------------------------- post-conditions
def test_memmap_returns_self_and_replaces_every_leaf(tmp_path):
    td = make_td()
    td.names = ["batch"]
    before = values_state(td)
    ptrs = {k: td.get(k).data_ptr() for k in td.keys(True, True) if isinstance(td.get(k), torch.Tensor)}
    assert td.memmap_(tmp_path) is td
    assert_all_memmap(td, tmp_path)
    assert td.device == torch.device("cpu") and td["nested"].device == torch.device("cpu")
    assert td.saved_path == tmp_path and td["nested", "deeper"].saved_path == tmp_path / "nested" / "deeper"
    assert not td.is_shared()
    assert values_state(td) == before
    assert td.names == ["batch"]
    for key, ptr in ptrs.items():
        if td.get(key).numel():
            assert td.get(key).data_ptr() != ptr, key
    # each leaf file holds exactly the leaf's raw C-order bytes
    for name in DTYPES:
        assert read(tmp_path / f"{name}.memmap") == bits(td[name]), name
    assert read(tmp_path / "nested" / "deeper" / "y.memmap") == bits(td["nested", "deeper", "y"])
    assert not (tmp_path / "empty.memmap").exists()  # zero-element leaves have no file


def test_memmap_locks_but_allows_in_place_writes_to_reach_the_files(tmp_path):
    td = TensorDict({"a": torch.zeros(4, 3), "n": {"b": torch.zeros(4, dtype=torch.int64)}}, [4])
    td.memmap_(tmp_path)
    with pytest.raises(RuntimeError, match="locked"):
        td["new"] = torch.zeros(4)
    with pytest.raises(RuntimeError, match="locked"):
        td.set("a", torch.ones(4, 3))  # replacing an entry
    with pytest.raises(RuntimeError, match="locked"):
        del td["a"]
    a_file, b_file = tmp_path / "a.memmap", tmp_path / "n" / "b.memmap"

    def floats():
        return torch.frombuffer(bytearray(read(a_file)), dtype=torch.float32).reshape(4, 3)

    td.set_("a", torch.full((4, 3), 1.0))
    assert torch.equal(floats(), torch.full((4, 3), 1.0))
    td.update_({"a": torch.full((4, 3), 2.0), "n": {"b": torch.arange(4)}})
    assert torch.equal(floats(), torch.full((4, 3), 2.0))
    assert torch.frombuffer(bytearray(read(b_file)), dtype=torch.int64).tolist() == [0, 1, 2, 3]
    td[1] = TensorDict({"a": torch.full((3,), 7.0), "n": {"b": torch.tensor(9)}}, [])
    td["a"][2, 0] = -1.0
    expected = torch.full((4, 3), 2.0)
    expected[1] = 7.0
    expected[2, 0] = -1.0
    assert torch.equal(floats(), expected)
    assert torch.frombuffer(bytearray(read(b_file)), dtype=torch.int64).tolist() == [0, 9, 2, 3]
    # and a fresh load sees the same
    assert torch.equal(TensorDict.load_memmap(tmp_path)["a"], expected)


def test_unlock_clears_memmap_and_saved_path(tmp_path):
    td = make_td().memmap_(tmp_path)
    td.unlock_()
    assert not td.is_locked and not td.is_memmap() and not td["nested"].is_memmap()
    with pytest.raises(AttributeError, match="saved path"):
        td.saved_path
    assert isinstance(td["float32"], MemoryMappedTensor)  # leaves still write to disk
    td["float32"].fill_(3.0)
    assert read(tmp_path / "float32.memmap") == bits(torch.full((3, 2), 3.0))
    with td.unlock_():
        assert not td.is_locked
        td["extra"] = torch.zeros(3)
    # it was unlocked before the block: it stays so (as in tensordict 0.15.3)
    assert not td.is_locked and "extra" in td.keys()
    # memmap_() again restores the memmap state without copying
    del td["extra"]
    leaf = td["float32"]
    td.memmap_()
    assert td.is_memmap() and td.is_locked and td["float32"] is leaf


# ----------------------------------------------------------------- prefix=None
def test_prefix_none_is_anonymous_shared_memory():
    td = make_td()
    before = values_state(td)
    td.memmap_()
    assert_all_memmap(td)
    assert td.saved_path is None
    assert values_state(td) == before
    for key in td.keys(True, True):
        value = td.get(key)
        if isinstance(value, torch.Tensor):
            with pytest.raises(RuntimeError, match="no file"):
                value.filename
    # memmap_() again keeps the very same anonymous leaves
    leaves = {k: td.get(k) for k in DTYPES}
    td.memmap_()
    assert all(td.get(k) is v for k, v in leaves.items())


def test_prefix_none_reuses_own_directory(tmp_path):
    td = make_td().memmap_(tmp_path)
    leaves = {k: td.get(k) for k in td.keys(True, True) if isinstance(td.get(k), torch.Tensor)}
    files_before = sorted(dir_state(tmp_path))
    assert td.memmap_() is td
    assert td.saved_path == tmp_path
    assert all(td.get(k) is v for k, v in leaves.items())
    assert sorted(dir_state(tmp_path)) == files_before


def test_anonymous_memmap_of_many_leaves_costs_few_descriptors():
    td = TensorDict({f"k{i}": torch.full((2,), float(i)) for i in range(1000)}, [2])
    fds = len(os.listdir("/proc/self/fd"))
    td.memmap_()
    assert len(os.listdir("/proc/self/fd")) - fds <= 2
    assert td["k999"].tolist() == [999.0, 999.0] and isinstance(td["k999"], MemoryMappedTensor)


def test_memmap_converts_device_none_to_cpu(tmp_path):
    td = TensorDict({"a": torch.zeros(2)}, [2])
    assert td.device is None
    td.memmap_(tmp_path)
    assert td.device == torch.device("cpu")


# ----------------------------------------------------------------- copy_existing
def test_leaf_mapped_elsewhere_needs_copy_existing(tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    td = make_td().memmap_(first)
    state, disk = tree_state(td), dir_state(first)
    with pytest.raises(RuntimeError, match="copy_existing"):
        td.memmap_(second)
    assert tree_state(td) == state and dir_state(first) == disk
    assert dir_state(second) == {}  # nothing was written there
    assert td.memmap_(second, copy_existing=True) is td
    assert_all_memmap(td, second)
    assert td.saved_path == second
    assert_same_values(td, TensorDict.load_memmap(first))
    td["float32"].fill_(11.0)  # the copy is independent of the source file
    assert dir_state(first) == disk
    assert read(second / "float32.memmap") == bits(torch.full((3, 2), 11.0))


def test_memmap_copy_of_file_backed_leaves_into_anonymous_memory(tmp_path):
    source = TensorDict({"a": torch.arange(4.0)}, [4]).memmap_(tmp_path)
    plain = TensorDict({"a": source["a"]}, [4])  # a td holding another td's file leaf
    plain.memmap_()
    with pytest.raises(RuntimeError, match="no file"):
        plain["a"].filename
    plain["a"].fill_(0.0)
    assert source["a"].tolist() == [0.0, 1.0, 2.0, 3.0]


# ----------------------------------------------------------------- threads
@pytest.fixture
def big_td():
    # two leaves above the 1 MiB threshold (written by the pool), and small ones
    big = torch.arange((2 << 20) // 4 + 3, dtype=torch.int32)
    return TensorDict({"big": big, "n": {"big2": big.double()}, "small": {"s": torch.arange(5.0)},
                       "txt": "x"}, [])


def test_num_threads_give_identical_files(tmp_path, big_td, monkeypatch):
    calls = []
    real = files.pwrite_all

    def spy(fd, data, offset, **kwargs):
        calls.append((memoryview(data).nbytes, threading.current_thread() is threading.main_thread()))
        return real(fd, data, offset, **kwargs)

    monkeypatch.setattr(files, "pwrite_all", spy)
    reference = None
    for n in (0, 1, 2, 4):
        calls.clear()
        out = big_td.clone().memmap_(tmp_path / str(n), num_threads=n)
        assert_all_memmap(out, tmp_path / str(n))
        assert torch.equal(out["big"], big_td["big"])
        disk = {k: v for k, v in dir_state(tmp_path / str(n)).items()}
        reference = disk if reference is None else reference
        assert disk == reference, n
        # each leaf is one write (never split); big ones go to the pool when there is one
        big_calls = sorted(c for c in calls if c[0] > 1000)
        assert [size for size, _ in big_calls] == [big_td["big"].numel() * 4, big_td["n", "big2"].numel() * 8]
        assert all(in_main == (n <= 1) for _, in_main in big_calls)
        assert all(in_main for size, in_main in calls if size <= 1000)


def test_return_early_gives_a_future(tmp_path, big_td):
    td = big_td.clone()
    future = td.memmap_(tmp_path, num_threads=2, return_early=True)
    assert isinstance(future, TensorDictFuture)
    assert future.result() is td
    assert future.done() and future.exception() is None
    assert_all_memmap(td, tmp_path)
    copy = big_td.memmap(tmp_path / "copy", num_threads=2, return_early=True).result()
    assert_same_values(copy, td)


@pytest.mark.parametrize("num_threads", [0, 1])
def test_return_early_without_threads_returns_self(tmp_path, num_threads):
    td = make_td()
    assert td.memmap_(tmp_path, num_threads=num_threads, return_early=True) is td
    assert td.is_memmap()


# ----------------------------------------------------------------- existsok
def test_existsok_false_refuses_an_existing_leaf_file_and_writes_nothing(tmp_path):
    TensorDict({"b": torch.ones(3)}, [3]).memmap_(tmp_path)
    disk = dir_state(tmp_path)
    td = TensorDict({"a": torch.zeros(3), "b": torch.zeros(3), "n": {"c": torch.zeros(3)}}, [3])
    state = tree_state(td)
    with pytest.raises(RuntimeError, match="already exists"):
        td.memmap_(tmp_path, existsok=False)
    assert dir_state(tmp_path) == disk  # a.memmap and n/ were not created first
    assert tree_state(td) == state and not td.is_locked and not td.is_memmap()
    with pytest.raises(RuntimeError, match="already exists"):
        td.memmap(tmp_path, existsok=False)
    assert dir_state(tmp_path) == disk
    td.memmap_(tmp_path, existsok=True)  # the default overwrites
    assert read(tmp_path / "b.memmap") == bits(torch.zeros(3))


def test_existsok_false_into_a_new_directory(tmp_path):
    td = make_td().memmap_(tmp_path / "d", existsok=False)
    assert_all_memmap(td, tmp_path / "d")


# ----------------------------------------------------------------- robust_key
@pytest.mark.parametrize("robust_key", [True, None])
def test_robust_key_percent_encodes(tmp_path, robust_key):
    prefix = tmp_path / "p"
    td = TensorDict({"a/b": torch.ones(2), "..": {"x": torch.zeros(2)}, ".": {"y/z": torch.ones(2)},
                     "sp ace%": torch.zeros(2)}, [2])
    td.memmap_(prefix, robust_key=robust_key)
    assert sorted(os.listdir(tmp_path)) == ["p"]  # nothing outside the prefix
    assert (prefix / "a%2Fb.memmap").is_file()
    assert (prefix / "%2E%2E" / "x.memmap").is_file()
    assert (prefix / "%2E" / "y%2Fz.memmap").is_file()
    assert (prefix / "sp%20ace%25.memmap").is_file()
    loaded = TensorDict.load_memmap(prefix)
    assert_same_values(loaded, td)


_UNSAFE = ["../x", "a/b", "/abs", "nul\x00"]  # a\\b or x:y are names on Linux


# '..' and '.' are unsafe only as directories: as leaves they are the files
# '...memmap' and '..memmap', inside the prefix
@pytest.mark.parametrize("key, as_collection", [(key, False) for key in _UNSAFE]
                         + [(key, True) for key in _UNSAFE + ["..", "."]])
def test_robust_key_false_refuses_unsafe_keys(tmp_path, key, as_collection):
    value = TensorDict({"leaf": torch.ones(2)}, [2]) if as_collection else torch.ones(2)
    prefix = tmp_path / "p"
    prefix.mkdir()
    td = TensorDict({"ok": torch.zeros(2), key: value}, [2])
    state = tree_state(td)
    with pytest.raises(ValueError, match="robust_key"):
        td.memmap_(prefix, robust_key=False)
    assert sorted(os.listdir(tmp_path)) == ["p"] and dir_state(prefix) == {}
    assert tree_state(td) == state
    td.memmap_(prefix)  # robust keys write it inside
    assert sorted(os.listdir(tmp_path)) == ["p"]


def test_robust_key_false_uses_raw_names(tmp_path):
    td = TensorDict({"plain": torch.ones(2), "sp ace": torch.ones(2), "sub": {"x;y": torch.zeros(2)}}, [2])
    td.memmap_(tmp_path, robust_key=False)
    assert sorted(dir_state(tmp_path)) == sorted(
        ["meta.json", "plain.memmap", "sp ace.memmap", "sub", "sub/meta.json", "sub/x;y.memmap"]
    )
    assert_same_values(TensorDict.load_memmap(tmp_path, robust_key=False), td)
    assert_same_values(TensorDict.load_memmap(tmp_path), td)  # legacy names are found


# ----------------------------------------------------------------- shared memory
def test_shared_memory_td_cannot_be_memmapped_in_place(tmp_path):
    td = make_td().share_memory_()
    state = tree_state(td)
    with pytest.raises(RuntimeError, match="mutually exclusive"):
        td.memmap_(tmp_path)
    with pytest.raises(RuntimeError, match="mutually exclusive"):
        td.memmap_()
    assert tree_state(td) == state and td.is_shared()
    assert dir_state(tmp_path) == {}
    copy = td.memmap(tmp_path)
    assert_all_memmap(copy, tmp_path)
    assert_same_values(copy, td)
    assert tree_state(td) == state


# ----------------------------------------------------------------- memmap()
@pytest.mark.parametrize("anonymous", [False, True])
def test_memmap_returns_a_new_copy_and_leaves_source_alone(tmp_path, anonymous):
    td = make_td()
    state = tree_state(td)
    copy = td.memmap() if anonymous else td.memmap(tmp_path)
    assert copy is not td
    assert tree_state(td) == state  # same leaf objects, not locked, not memmap
    assert not any(isinstance(td.get(k), MemoryMappedTensor) for k in td.keys(True, True))
    assert_all_memmap(copy, None if anonymous else tmp_path)
    assert copy.saved_path == (None if anonymous else tmp_path)
    assert_same_values(copy, td)
    copy["float32"].fill_(0.0)
    assert values_state(td) == state["values"]


def test_memmap_of_a_memmapped_td_without_prefix_shares_its_leaves(tmp_path):
    td = make_td().memmap_(tmp_path)
    copy = td.memmap()
    assert copy is not td and copy["float32"] is td["float32"]


# ----------------------------------------------------------------- memmap_like()
def test_memmap_like_has_the_layout_and_zeros(tmp_path):
    td = make_td()
    state = tree_state(td)
    like = td.memmap_like(tmp_path)
    assert tree_state(td) == state
    assert_all_memmap(like, tmp_path)
    assert list(like.keys(True, True)) == list(td.keys(True, True))
    for key in td.keys(True, True):
        value = td.get(key)
        if isinstance(value, torch.Tensor):
            got = like.get(key)
            assert got.dtype == value.dtype and got.shape == value.shape, key
            assert set(bits(got)) <= {0}, key
    assert like["task"] == "walk" and like.get("stack").tolist() == ["s0", "s1", "s2"]
    assert_same_values(TensorDict.load_memmap(tmp_path), like)


def test_memmap_like_over_existing_data_gives_zeros_and_keeps_old_mappings(tmp_path):
    td = make_td()
    saved = td.memmap(tmp_path)
    old_values = values_state(saved)
    like = td.memmap_like(tmp_path)
    assert all(set(bits(like.get(k))) <= {0} for k in DTYPES)
    assert values_state(saved) == old_values  # the old files' mappings keep their data
    assert all(set(bits(t)) <= {0} for t in TensorDict.load_memmap(tmp_path).values() if isinstance(t, torch.Tensor))
    # prefix=None on a memory-mapped td: anonymous memory, never its own files
    before = dir_state(tmp_path)
    like2 = saved.memmap_like()
    like2["float32"].fill_(5.0)
    assert values_state(saved) == old_values
    assert like2.saved_path is None and dir_state(tmp_path) == before


# ----------------------------------------------------------------- failures
def _fail_after(n, monkeypatch, target=files, name="pwrite_all"):
    real = getattr(target, name)
    calls = []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) > n:
            raise OSError(28, "injected failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(target, name, flaky)
    return calls


@pytest.mark.parametrize("existing", [False, True])
def test_failure_midway_leaves_td_and_disk_as_they_were(tmp_path, monkeypatch, existing):
    prefix = tmp_path / "p"
    if existing:  # a directory holding an older save with other keys
        TensorDict({"old": torch.ones(2), "n": {"o": torch.ones(2)}}, [2]).memmap_(prefix)
    disk = dir_state(prefix)
    td = TensorDict({"a": torch.ones(2), "n": {"b": torch.ones(2), "c": torch.ones(2)}, "d": torch.ones(2),
                     "t": "text"}, [2])
    state = tree_state(td)
    _fail_after(2, monkeypatch)
    with pytest.raises(OSError, match="injected failure"):
        td.memmap_(prefix)
    assert tree_state(td) == state and not td.is_locked and not td.is_memmap()
    assert dir_state(prefix) == disk
    assert os.path.exists(prefix) == existing


@pytest.mark.parametrize("big", [False, True])
def test_failure_in_anonymous_memmap_leaves_td_as_it_was(monkeypatch, big):
    td = make_td()
    if big:  # a leaf over the packing size: written by a pwrite of its own
        td["big"] = torch.randn(3, 1 << 15)
        _fail_after(0, monkeypatch, Segment, "write")
    else:  # the small leaves: all copied into the segment at once
        _fail_after(0, monkeypatch, writer, "copy_all")
    state = tree_state(td)
    with pytest.raises(OSError, match="injected failure"):
        td.memmap_()
    assert tree_state(td) == state


def test_failure_in_threads_is_raised_by_the_future(tmp_path, monkeypatch, big_td):
    prefix = tmp_path / "p"
    state = tree_state(big_td)
    _fail_after(1, monkeypatch)
    future = big_td.memmap_(prefix, num_threads=2, return_early=True)
    with pytest.raises(OSError, match="injected failure"):
        future.result()
    assert isinstance(future.exception(), OSError)
    assert tree_state(big_td) == state
    assert dir_state(prefix) == {}


@pytest.mark.parametrize("existing", [False, True])
@pytest.mark.parametrize("fail_at", [0, 1, 2])
def test_failure_while_writing_metadata_removes_the_new_files(tmp_path, monkeypatch, fail_at, existing):
    from shared_td.persist import nodes

    prefix = tmp_path / "p"
    if existing:  # an older save with other keys, in the same directories
        TensorDict({"old": torch.ones(2), "n": {"o": torch.ones(2), "m": {"p": torch.ones(2)}}}, [2]).memmap_(prefix)
    disk = dir_state(prefix)
    td = TensorDict({"a": torch.ones(2), "n": {"b": torch.ones(2), "m": {"c": torch.ones(2)}}}, [2])
    state = tree_state(td)
    _fail_after(fail_at, monkeypatch, nodes, "node_document")  # meta.json of m, n, root
    with pytest.raises(OSError, match="injected failure"):
        td.memmap_(prefix)
    assert tree_state(td) == state
    assert dir_state(prefix) == disk, "a failed memmap_ left files behind or changed a meta.json"


# ----------------------------------------------------------------- symlinks / outside
def test_write_refuses_symlinked_child_directory(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    prefix = tmp_path / "p"
    prefix.mkdir()
    os.symlink(outside, prefix / "n")
    td = TensorDict({"a": torch.ones(2), "n": {"b": torch.ones(2)}}, [2])
    state = tree_state(td)
    with pytest.raises(RuntimeError, match="symlink"):
        td.memmap_(prefix)
    assert dir_state(outside) == {} and sorted(dir_state(prefix)) == ["n"]
    assert tree_state(td) == state


def test_write_refuses_symlinked_leaf_file(tmp_path):
    target = tmp_path / "target.bin"
    target.write_bytes(b"precious")
    prefix = tmp_path / "p"
    prefix.mkdir()
    os.symlink(target, prefix / "a.memmap")
    td = TensorDict({"a": torch.ones(2)}, [2])
    state = tree_state(td)
    for call in (td.memmap_, td.memmap, td.memmap_like):
        with pytest.raises(RuntimeError, match="symlink"):
            call(prefix)
    assert target.read_bytes() == b"precious"
    assert tree_state(td) == state and sorted(dir_state(prefix)) == ["a.memmap"]


def test_hostile_keys_never_write_outside_the_prefix(tmp_path):
    prefix = tmp_path / "a" / "p"
    keys = ["..", ".", "", "../x", "/etc", "..\\y", "a/../../z", "%2E%2E"]
    td = TensorDict({k: {k: torch.ones(1), "leaf": torch.ones(1)} for k in keys}, [1])
    for k in keys:
        td[k + "_leaf"] = torch.ones(1)
    td.memmap_(prefix)
    assert sorted(os.listdir(tmp_path)) == ["a"] and sorted(os.listdir(tmp_path / "a")) == ["p"]
    for rel in dir_state(prefix):
        assert os.path.realpath(prefix / rel).startswith(str(prefix) + os.sep), rel
    assert_same_values(TensorDict.load_memmap(prefix), td)


def test_unpicklable_non_tensor_fails_before_any_meta_json(tmp_path):
    prefix = tmp_path / "p"
    TensorDict({"old": torch.ones(2), "n": {"o": torch.ones(2)}}, [2]).memmap_(prefix)
    disk = dir_state(prefix)
    td = TensorDict({"a": torch.ones(2), "n": {"b": torch.ones(2)}}, [2])
    td["f"] = lambda x: x  # not JSON, and pickle cannot serialise a lambda
    state = tree_state(td)
    with pytest.raises(Exception, match="pickle"):
        td.memmap_(prefix)
    assert tree_state(td) == state
    assert dir_state(prefix) == disk


def test_io_failure_while_replacing_meta_json_leaves_no_meta_naming_removed_files(tmp_path, monkeypatch):
    from shared_td.persist import format as fmt

    prefix = tmp_path / "p"
    TensorDict({"old": torch.ones(2), "n": {"o": torch.ones(2), "m": {"p": torch.ones(2)}}}, [2]).memmap_(prefix)
    disk = dir_state(prefix)
    td = TensorDict({"a": torch.ones(2), "n": {"b": torch.ones(2), "m": {"c": torch.ones(2)}}}, [2])
    _fail_after(1, monkeypatch, fmt, "write_temporary")  # n/m/meta.json staged, n's fails
    with pytest.raises(OSError, match="injected failure"):
        td.memmap_(prefix)
    assert not td.is_memmap() and not td.is_locked
    assert dir_state(prefix) == disk, (
        "a disk error while replacing the meta.json files of an existing save left "
        "n/m/meta.json naming c.memmap, which the cleanup removed: the meta.json files "
        "should be staged (temporary files) and renamed only once all are written"
    )


@pytest.mark.parametrize("view", ["slice", "transpose", "step"])
def test_view_of_the_target_file_is_written_not_kept(tmp_path, view):
    base = TensorDict({"a": torch.arange(12.0).reshape(4, 3)}, [4]).memmap_(tmp_path)
    leaf = {"slice": lambda t: t[2:], "transpose": lambda t: t.t()[:, :2], "step": lambda t: t[::2]}[view](base["a"])
    expected = leaf.clone()
    td = TensorDict({"a": leaf}, [expected.shape[0]])
    td.memmap_(tmp_path)
    assert torch.equal(td["a"], expected)
    assert torch.equal(TensorDict.load_memmap(tmp_path)["a"], expected), "the file does not hold the view"


@pytest.mark.parametrize("names", [("meta.json", None), ("a", "a.memmap")])
def test_colliding_file_names_are_refused_before_writing(tmp_path, names):
    leaf_key, dir_key = names
    td = TensorDict({dir_key or leaf_key: {"x": torch.ones(2)}}, [2])
    if dir_key:
        td[leaf_key] = torch.ones(2)
    state = tree_state(td)
    with pytest.raises(ValueError, match="rename one of them"):
        td.memmap_(tmp_path / "p")
    assert tree_state(td) == state and dir_state(tmp_path) == {}


def test_prefix_that_is_a_file(tmp_path):
    (tmp_path / "f").write_bytes(b"data")
    td = TensorDict({"a": torch.ones(2)}, [2])
    state = tree_state(td)
    with pytest.raises(NotADirectoryError):
        td.memmap_(tmp_path / "f")
    assert tree_state(td) == state and dir_state(tmp_path) == {"f": b"data"}


def test_memmap_like_anonymous_and_names():
    td = TensorDict({"a": torch.ones(2, 3)}, [2], names=["b"])
    like = td.memmap_like()
    assert like.saved_path is None and like.names == ["b"] and not like["a"].any()
    assert td.memmap().names == ["b"] and td["a"].all()


@pytest.mark.parametrize("to_files", [False, True])
def test_small_leaves_copied_together_keep_values_and_stay_independent(tmp_path, to_files):
    # the small leaves are copied by one call (strided, conjugate, negative views, runs
    # of dtypes of one size side by side); each result is a tensor of its own: writing
    # one in place bumps no other's version counter (autograd would refuse a backward)
    sources = {"t": torch.arange(12.0).reshape(3, 4).t(), "i": torch.arange(4, dtype=torch.int32),
               "f": torch.randn(4), "c": torch.randn(4, dtype=torch.complex64).conj(),
               "n": torch.randn(4)._neg_view(), "b": torch.tensor([True, False, True, True]),
               "s": torch.tensor(3.0), "h": torch.arange(5, dtype=torch.float16)}
    td = TensorDict({**sources, "nested": {"f": torch.randn(4)}})
    expected = {k: v.resolve_conj().resolve_neg().clone() for k, v in td.items(True, True)}
    out = td.memmap_(tmp_path / "p" if to_files else None)
    for key, value in expected.items():
        leaf = out.get(key)
        assert torch.equal(leaf, value) and leaf.is_contiguous() and not leaf.is_conj(), key
    versions = {key: out.get(key)._version for key in expected}
    out["f"].add_(1)
    assert all(out.get(key)._version == versions[key] for key in expected if key != "f")


def test_alike_nodes_share_no_metadata_that_differs(tmp_path):
    # meta.json is built once for nodes that are alike; each node still records its own
    # batch size, names, entry shapes, dtypes and child types
    td = TensorDict({
        "a": TensorDict({"x": torch.zeros(2, 3)}, [2]),
        "b": TensorDict({"x": torch.zeros(2, 3)}, [2, 3]),
        # (a name of a dim that is not the parent's: a child naming the parent's dim
        # names the parent and every other child, as in tensordict)
        "c": TensorDict({"x": torch.zeros(2, 3)}, [2, 3], names=[None, "time"]),
        "d": TensorDict({"x": torch.zeros(2, 3, dtype=torch.int8)}, [2]),
        "e": TensorDict({"x": torch.zeros(2, 4)}, [2]),
        "f": TensorDict({"x": TensorDict({}, [2])}, [2]),
        "g": TensorDict({"x": torch.zeros(2, 3)}, [2]),
    }, [2])
    td.memmap_(tmp_path / "p")
    back = TensorDict.load_memmap(tmp_path / "p")
    for key in "abcdefg":
        assert back[key].batch_size == td[key].batch_size and back[key].names == td[key].names, key
        if key != "f":
            assert back[key, "x"].shape == td[key, "x"].shape and back[key, "x"].dtype == td[key, "x"].dtype, key
    assert isinstance(back["f", "x"], TensorDict)
    metas = {key: (tmp_path / "p" / key / "meta.json").read_bytes() for key in "abcdefg"}
    assert metas["a"] == metas["g"] and len(set(metas.values())) == 6


# share_memory_() of a tree with a memory-mapped nested tensordict is refused before any
# value is put in a cell (the tree's values were all put in one slab first, so entries
# that read is_shared() False, the mapped node's own among them, stayed tied to a shared
# cell: a pickled copy's write reached the tree; triage24)
def _tree(tmp_path, depth):
    mapped = TensorDict({"t": torch.zeros(2), "s": "walk"}, [2]).memmap_(tmp_path)
    node = mapped if depth == 1 else TensorDict({"deeper": mapped, "v": "mid"}, [2])
    td = TensorDict({"a": "first", "inner": node, "z": "last"}, [])
    keys = ["a", "z", ("inner", "s") if depth == 1 else ("inner", "deeper", "s")]
    return td, keys + ([("inner", "v")] if depth == 2 else [])


@pytest.mark.parametrize("depth", [1, 2])
def test_a_refused_share_memory_ties_no_unshared_value_to_a_cell(tmp_path, depth):
    td, keys = _tree(tmp_path, depth)
    with pytest.raises(RuntimeError, match="mutually exclusive"):
        td.share_memory_()
    unshared = [k for k in keys if not td.get(k).is_shared()]
    before = {k: td.get(k).data for k in unshared}
    copy = pickle.loads(pickle.dumps(td))
    for k in unshared:
        copy.set_(k, "changed")
    assert {k: td.get(k).data for k in unshared} == before


@pytest.mark.parametrize("depth", [1, 2])
def test_a_refused_share_memory_shares_nothing(tmp_path, depth):
    # (tensordict 0.15.3 leaves the entries before the mapped node shared)
    td, keys = _tree(tmp_path, depth)
    with pytest.raises(RuntimeError, match="mutually exclusive"):
        td.share_memory_()
    assert [k for k in keys if td.get(k).is_shared()] == [] and not td.is_locked
