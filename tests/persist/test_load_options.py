"""Legacy (robust_key=False) names and the options of load_memmap / load_memmap_.

Each behaviour is compared with tensordict 0.15.3 side by side when it is installed
(those cases skip otherwise, as tests/interop does).
"""
from __future__ import annotations

import os

import pytest
import torch

from tests.persist.persist_helpers import TensorDict, assert_same_values, dir_state

from tests.reference import needs_tensordict, tensordict


def files(path) -> set[str]:
    return {os.path.relpath(os.path.join(root, name), path)
            for root, _, names in os.walk(path) for name in names}


# ------------------------------------------------- robust_key=False: the names Linux allows
# One file name on Linux: anything but '/' and NUL; '.', '..' and '' only as leaves (where
# '.memmap' is appended).
LINUX_NAMES = ["x:y", "c:d", "a\\b", "C:\\tmp", 'q"<>|?*', "tab\there"]


def legacy_td(lib):
    data = {k: torch.full((2,), float(i)) for i, k in enumerate(LINUX_NAMES + [".", "..", ""])}
    data["d:ir"] = {"in\\side": torch.ones(2)}
    return lib.TensorDict(data, [2])


def test_legacy_names_are_written_raw_on_linux(tmp_path):
    td = legacy_td(__import__("shared_td"))
    td.memmap_(tmp_path / "p", robust_key=False)
    assert files(tmp_path / "p") == {
        "meta.json", "x:y.memmap", "c:d.memmap", "a\\b.memmap", "C:\\tmp.memmap",
        'q"<>|?*.memmap', "tab\there.memmap", "..memmap", "...memmap", ".memmap",
        "d:ir/meta.json", "d:ir/in\\side.memmap",
    }
    assert_same_values(TensorDict.load_memmap(tmp_path / "p", robust_key=False), td)
    assert_same_values(TensorDict.load_memmap(tmp_path / "p"), td)  # raw names are found


@pytest.mark.parametrize("key", ["a/b", "../x", "/abs", "nul\x00byte"])
@pytest.mark.parametrize("as_collection", [False, True])
def test_legacy_refuses_what_is_not_one_name(tmp_path, key, as_collection):
    value = TensorDict({"leaf": torch.ones(2)}, [2]) if as_collection else torch.ones(2)
    td = TensorDict({"ok": torch.zeros(2), key: value}, [2])
    with pytest.raises(ValueError, match="robust_key=True") as info:
        td.memmap_(tmp_path / "p", robust_key=False)
    assert repr(key) in str(info.value)
    assert dir_state(tmp_path) == {}


@pytest.mark.parametrize("key", [".", "..", ""])
def test_legacy_refuses_dot_names_as_directories(tmp_path, key):
    td = TensorDict({key: TensorDict({"leaf": torch.ones(2)}, [2])}, [2])
    with pytest.raises(ValueError, match="robust_key=True"):
        td.memmap_(tmp_path / "p", robust_key=False)
    assert dir_state(tmp_path) == {}


@needs_tensordict
def test_legacy_names_equal_tensordict(tmp_path):
    import shared_td
    legacy_td(shared_td).memmap(tmp_path / "ours", robust_key=False)
    theirs = legacy_td(tensordict)
    del theirs["."], theirs[".."], theirs[""]  # tensordict would write these wrongly
    theirs.memmap(tmp_path / "theirs", robust_key=False)
    assert files(tmp_path / "theirs") <= files(tmp_path / "ours")
    assert files(tmp_path / "ours") - files(tmp_path / "theirs") == {
        "..memmap", "...memmap", ".memmap"}
    back = tensordict.TensorDict.load_memmap(tmp_path / "ours", robust_key=False)
    assert back["x:y"].tolist() == [0.0, 0.0] and back["d:ir", "in\\side"].tolist() == [1.0, 1.0]
    mine = TensorDict.load_memmap(tmp_path / "theirs", robust_key=False)
    assert_same_values(mine, theirs)


# ------------------------------------------------------------------ load_memmap options
import shutil  # noqa: E402
import tempfile  # noqa: E402

from tests.persist.read_only_children import load_with_modes_as_nobody  # noqa: E402
from tests.persist.test_load_untrusted import in_child  # noqa: E402

from shared_td import ReadOnlyError, load_memmap  # noqa: E402
from shared_td.memmap_tensor import MemoryMappedTensor, ReadOnlyMemoryMappedTensor  # noqa: E402


def saved_tree(lib, path):
    td = lib.TensorDict({"a": torch.arange(3.0), "n": {"b": torch.ones(3, 2),
                         "m": {"c": torch.zeros(3, dtype=torch.int64)}}}, [3])
    td.memmap(path)
    return path


def test_load_memmap_signature_equals_tensordict():
    import inspect
    ours = inspect.signature(TensorDict.load_memmap)
    assert list(ours.parameters) == ["prefix", "device", "non_blocking", "out", "robust_key",
                                     "subpath", "mode", "num_threads", "allow_pickle"]
    assert list(inspect.signature(load_memmap).parameters) == list(ours.parameters)
    assert "mode" in inspect.signature(TensorDict.load_memmap_).parameters
    if tensordict is not None:
        theirs = inspect.signature(tensordict.TensorDict.load_memmap)
        assert [(p.name, p.kind) for p in ours.parameters.values()] == [
            (p.name, p.kind) for p in theirs.parameters.values()]


@pytest.mark.parametrize("subpath, keys", [
    ("n", {"b", ("m", "c")}), (("n", "m"), {"c"}), (("n", ("m",)), {"c"})])
def test_subpath_loads_one_nested_tensordict(tmp_path, subpath, keys):
    path = saved_tree(__import__("shared_td"), tmp_path / "p")
    sub = TensorDict.load_memmap(path, subpath=subpath)
    assert set(sub.keys(True, True)) == keys and sub.batch_size == (3,)
    whole = TensorDict.load_memmap(path)
    assert_same_values(sub, whole[subpath])
    assert isinstance(next(iter(sub.values(True, True))), MemoryMappedTensor)


@pytest.mark.parametrize("subpath, words", [
    ("a", "a tensor"), ("zz", "no key"), ("..", "no key"), (("n", ".."), "no key"),
    ("n/m", "('n', 'm')"), (("n", "m", "c"), "a tensor")])
def test_subpath_refuses_what_is_not_a_saved_tensordict(tmp_path, subpath, words):
    path = saved_tree(__import__("shared_td"), tmp_path / "p")
    os.makedirs(tmp_path / "zz")  # a directory beside the save is never reached
    (tmp_path / "zz" / "meta.json").write_text("{}")
    with pytest.raises(ValueError, match="subpath") as info:
        TensorDict.load_memmap(path, subpath=subpath)
    assert words in str(info.value)


def test_subpath_in_a_robust_name_is_found(tmp_path):
    td = TensorDict({"a/b": {"..": {"x": torch.ones(2)}}}, [2])
    td.memmap(tmp_path / "p")
    assert TensorDict.load_memmap(tmp_path / "p", subpath=("a/b", ".."))["x"].tolist() == [1.0, 1.0]


@needs_tensordict
@pytest.mark.parametrize("subpath", ["n", ("n", "m")])
def test_subpath_equals_tensordict(tmp_path, subpath):
    path = saved_tree(tensordict, tmp_path / "p")
    theirs = tensordict.TensorDict.load_memmap(path, subpath=subpath)
    ours = TensorDict.load_memmap(path, subpath=subpath)
    assert {k: v.tolist() for k, v in ours.items(True, True)} == {
        k: v.tolist() for k, v in theirs.items(True, True)}


def test_mode_r_gives_read_only_leaves(tmp_path):
    path = saved_tree(__import__("shared_td"), tmp_path / "p")
    td = TensorDict.load_memmap(path, mode="r")
    for key, leaf in td.items(True, True):
        assert type(leaf) is ReadOnlyMemoryMappedTensor and not leaf._backing.shared, key
    with pytest.raises(ReadOnlyError, match="opened with mode='r'") as info:
        td["n", "b"][0] = 5
    assert "b.memmap" in str(info.value)
    with pytest.raises(ReadOnlyError):
        td["a"].add_(1)
    assert TensorDict.load_memmap(path)["a"].tolist() == [0.0, 1.0, 2.0]  # the file is intact
    assert td["a"].tolist() == [0.0, 1.0, 2.0]


@pytest.mark.parametrize("mode", [None, "r+"])
def test_mode_r_plus_writes_reach_the_file(tmp_path, mode):
    path = saved_tree(__import__("shared_td"), tmp_path / "p")
    td = TensorDict.load_memmap(path, mode=mode)
    assert type(td["a"]) is MemoryMappedTensor
    td["a"][0] = 7
    assert TensorDict.load_memmap(path)["a"].tolist() == [7.0, 1.0, 2.0]


def test_mode_r_plus_refuses_a_file_it_may_not_write():
    if os.getuid() != 0:
        pytest.skip("needs root, to drop to user nobody in a child (root ignores file modes)")
    top = tempfile.mkdtemp(prefix="shared_td_lo_")  # pytest's tmp_path is root-only
    try:
        os.chmod(top, 0o755)
        path = saved_tree(__import__("shared_td"), os.path.join(top, "p"))
        os.chmod(os.path.join(path, "a.memmap"), 0o444)
        outcome = in_child(load_with_modes_as_nobody, path)
    finally:
        shutil.rmtree(top)
    assert outcome[0] == "returned", outcome
    plain, error, message = outcome[1]
    assert (plain, error) == ("ReadOnlyMemoryMappedTensor", "PermissionError")
    assert os.path.join(path, "a.memmap") in message and "mode='r+'" in message


@pytest.mark.parametrize("mode", ["w", "w+", "c", "R", 1])
def test_mode_other_values_are_refused(tmp_path, mode):
    path = saved_tree(__import__("shared_td"), tmp_path / "p")
    with pytest.raises(ValueError, match="'r', 'r\\+' or None"):
        TensorDict.load_memmap(path, mode=mode)


def test_load_memmap_in_place_mode(tmp_path):
    path = saved_tree(__import__("shared_td"), tmp_path / "p")
    target = TensorDict({}, [])
    assert target.load_memmap_(path, mode="r") is target
    assert type(target["n", "m", "c"]) is ReadOnlyMemoryMappedTensor
    with pytest.raises(ReadOnlyError):
        target["a"].zero_()


@pytest.mark.parametrize("num_threads", [0, 1, 4])
def test_num_threads_maps_the_same(tmp_path, monkeypatch, num_threads):
    import threading
    from shared_td.persist.loader import Loader
    td = TensorDict({f"k{i}": torch.full((3,), float(i)) for i in range(20)}, [3])
    td["n"] = {f"j{i}": torch.full((3, 2), -float(i)) for i in range(10)}
    td.memmap(tmp_path / "p")
    mapped_by = set()
    real = Loader._load_leaf

    def spy(self, directory, leaf):
        mapped_by.add(threading.current_thread().name)
        return real(self, directory, leaf)

    monkeypatch.setattr(Loader, "_load_leaf", spy)
    loaded = TensorDict.load_memmap(tmp_path / "p", num_threads=num_threads)
    assert_same_values(loaded, td)
    if num_threads:  # mapped on the pool only
        assert mapped_by and all(name.startswith("shared_td-load") for name in mapped_by)
    else:
        assert mapped_by == {threading.current_thread().name}
    assert all(isinstance(v, MemoryMappedTensor) for v in loaded.values(True, True))


def test_num_threads_error_names_the_key_and_leaves_no_thread(tmp_path):
    import threading
    td = TensorDict({f"k{i}": torch.full((3,), float(i)) for i in range(20)}, [3])
    td.memmap(tmp_path / "p")
    os.truncate(tmp_path / "p" / "k7.memmap", 4)
    before = threading.active_count()
    with pytest.raises(Exception, match="k7"):
        TensorDict.load_memmap(tmp_path / "p", num_threads=4)
    assert threading.active_count() == before


@pytest.mark.parametrize("bad", [1.5, "2", True])  # (-1 is 0, as in tensordict: test_audit19_small)
def test_num_threads_must_be_a_count(tmp_path, bad):
    path = saved_tree(__import__("shared_td"), tmp_path / "p")
    with pytest.raises((TypeError, ValueError), match="num_threads"):
        TensorDict.load_memmap(path, num_threads=bad)


def test_out_loads_in_place(tmp_path):
    path = saved_tree(__import__("shared_td"), tmp_path / "p")
    inner = TensorDict({"b": torch.zeros(3, 2)}, [3])
    out = TensorDict({"a": torch.full((3,), -1.0), "n": inner, "extra": torch.zeros(3)}, [3])
    assert TensorDict.load_memmap(path, out=out) is out
    assert out["n"] is inner  # nested tensordicts of out are kept and filled in place
    assert set(out.keys(True, True)) == {"a", ("n", "b"), ("n", "m", "c")}  # as on disk
    assert type(out["a"]) is MemoryMappedTensor
    out["a"][0] = 9
    assert TensorDict.load_memmap(path)["a"].tolist() == [9.0, 1.0, 2.0]
    assert load_memmap(path, out=TensorDict({}, [3]), subpath="n")["m", "c"].dtype == torch.int64


def test_out_with_mode_r(tmp_path):
    path = saved_tree(__import__("shared_td"), tmp_path / "p")
    out = TensorDict({}, [3])
    TensorDict.load_memmap(path, out=out, mode="r")
    assert type(out["n", "b"]) is ReadOnlyMemoryMappedTensor


@pytest.mark.parametrize("case", ["batch", "locked", "not a tensordict"])
def test_out_refused_before_it_changes(tmp_path, case):
    path = saved_tree(__import__("shared_td"), tmp_path / "p")
    out = TensorDict({"a": torch.full((5,), -1.0)}, [5])
    if case == "locked":
        out = TensorDict({"a": torch.full((3,), -1.0)}, [3]).lock_()
    if case == "not a tensordict":
        out = {"a": torch.zeros(3)}
    before = {k: v.clone() for k, v in out.items()}
    with pytest.raises((RuntimeError, TypeError), match="out"):
        TensorDict.load_memmap(path, out=out)
    assert set(out.keys()) == set(before) and all((out[k] == v).all() for k, v in before.items())


@needs_tensordict
def test_out_equals_tensordict(tmp_path):
    path = saved_tree(tensordict, tmp_path / "p")
    theirs = tensordict.TensorDict({"extra": torch.zeros(3)}, [3])
    tensordict.TensorDict.load_memmap(path, out=theirs)
    ours = TensorDict({"extra": torch.zeros(3)}, [3])
    TensorDict.load_memmap(path, out=ours)
    assert {k: v.tolist() for k, v in ours.items(True, True)} == {
        k: v.tolist() for k, v in theirs.items(True, True)}
