"""memmap_/memmap/memmap_like/save with atomic=True (the `atomic` paragraph and the Raises
list of the seed page TensorDictBase.memmap_): the whole-directory replacement, every
error leaving prefix byte-for-byte as it was, failures in the middle of a write, the
writer lock, the swap without a missing window, and loads racing rewrites.
Crashes (SIGKILL) and many-process stress are in test_atomic_stress.py.
"""
from __future__ import annotations

import json
import multiprocessing
import os
import re
import threading
import time

import filelock
import pytest
import torch

from tests.persist import atomic_children as kids
from tests.persist.persist_helpers import (
    MemoryMappedTensor, NonTensorData, NonTensorStack, TensorDict, assert_all_memmap,
    bits, dir_state, make_td, tree_state, values_state,
)

import shared_td
from shared_td import LazyStackedTensorDict, is_tensorclass, load_memmap, tensorclass
from shared_td.persist import api, atomic, loader
from shared_td.storage import files

pytestmark = pytest.mark.timeout(60)
FORK = multiprocessing.get_context("fork")


@tensorclass
class Pair:
    x: torch.Tensor
    label: str


MAKERS = {
    "tensordict": make_td,
    "lazy": lambda: LazyStackedTensorDict(make_td(seed=1), make_td(seed=2)),
    "tensorclass": lambda: Pair(x=torch.arange(6.0).reshape(3, 2), label="pair", batch_size=[3]),
    "non_tensor_data": lambda: NonTensorData("hello"),  # a root loads with batch_size [] (as tensordict)
    "non_tensor_stack": lambda: NonTensorStack("a", "b", "c"),
}


def content(obj):
    """Comparable content of any class (values of a tree, else the non-tensor list)."""
    if isinstance(obj, (NonTensorData, NonTensorStack)):
        return type(obj).__name__, obj.tolist()
    if is_tensorclass(obj):
        return type(obj).__name__, values_state(obj._tensordict)
    return type(obj).__name__, values_state(obj)


def tensors_of(obj):
    inner = obj._tensordict if is_tensorclass(obj) else obj
    if isinstance(inner, (NonTensorData, NonTensorStack)):
        return []
    if isinstance(inner, LazyStackedTensorDict):
        return [tensor for member in inner.tensordicts for tensor in tensors_of(member)]
    return [inner.get(k) for k in inner.keys(True, True) if isinstance(inner.get(k), torch.Tensor)]


def old_save(prefix) -> None:
    """A saved tensordict at prefix plus files it did not write (which must go)."""
    make_td(seed=7).memmap(prefix)
    (prefix / "junk.bin").write_bytes(b"junk")
    (prefix / "junkdir").mkdir()


def beside(tmp_path, name="p"):
    return sorted(os.listdir(tmp_path)), kids.leftovers(tmp_path / name)


# ----------------------------------------------------------------- success
@pytest.mark.parametrize("method", ["memmap_", "memmap", "memmap_like", "save"])
@pytest.mark.parametrize("kind", list(MAKERS))
def test_every_class_replaces_prefix_as_a_whole(tmp_path, kind, method):
    prefix = tmp_path / "p"
    old_save(prefix)
    obj = MAKERS[kind]()
    expected = content(obj)
    if method == "save":
        result = shared_td.save(obj, prefix, atomic=True)
    else:
        result = getattr(obj, method)(prefix, atomic=True)
    assert (result is obj) == (method == "memmap_")
    assert not (prefix / "junk.bin").exists() and not (prefix / "junkdir").exists()
    loaded = load_memmap(prefix)
    if method == "memmap_like":
        assert type(loaded) is type(obj)
        assert all(not t.any() for t in tensors_of(loaded))
    else:
        assert content(loaded) == expected == content(result)
    for tensor in tensors_of(result):  # every leaf maps the file at prefix, not the staging one
        assert isinstance(tensor, MemoryMappedTensor)
        if tensor.numel():
            assert tensor.filename.startswith(str(prefix) + os.sep), tensor.filename
    inner = result._tensordict if kind == "tensorclass" else result
    assert inner.saved_path in (prefix, prefix / "_tensordict")
    assert beside(tmp_path) == ([".p.lock", "p"], [])


def test_writes_into_missing_and_empty_prefix_with_threads(tmp_path):
    big = torch.arange(2 << 20, dtype=torch.float32)  # 8 MiB: split over the threads
    td = TensorDict(big=big, small={"x": torch.ones(3)})
    td.memmap_(tmp_path / "new" / "p", atomic=True, num_threads=3)
    assert_all_memmap(td, tmp_path / "new" / "p")
    (tmp_path / "empty").mkdir()
    copy = TensorDict(big=big).memmap(tmp_path / "empty", atomic=True, num_threads=4, existsok=False)
    assert bits(load_memmap(tmp_path / "empty")["big"]) == bits(big) == bits(copy["big"])
    assert copy["big"].filename == str(tmp_path / "empty" / "big.memmap")


@pytest.mark.parametrize("prefix_arg", ["same", "none"])
def test_resave_in_place_at_its_own_prefix(tmp_path, prefix_arg):
    prefix = tmp_path / "p"
    td = TensorDict(a=torch.zeros(4), n={"b": torch.zeros(2, dtype=torch.int64)}, batch_size=[])
    td.memmap_(prefix, atomic=True)
    (prefix / "junk").write_bytes(b"x")
    td["a"].add_(5)  # an updated buffer, mapped at prefix
    state = dir_state(prefix)
    arg = prefix if prefix_arg == "same" else None
    with pytest.raises(RuntimeError, match="copy_existing=True"):
        td.memmap_(arg, atomic=True)
    assert dir_state(prefix) == state and kids.leftovers(prefix) == []
    td.memmap_(arg, copy_existing=True, atomic=True)
    assert_all_memmap(td, prefix)
    assert td.saved_path == prefix and td["n"].saved_path == prefix / "n"
    assert td["a"].filename == str(prefix / "a.memmap") and not (prefix / "junk").exists()
    td["a"][1] = -1.0  # writes reach the new file at prefix
    assert (prefix / "a.memmap").read_bytes() == bits(torch.tensor([5.0, -1.0, 5.0, 5.0]))
    assert load_memmap(prefix)["a"].tolist() == [5.0, -1.0, 5.0, 5.0]
    assert beside(tmp_path) == ([".p.lock", "p"], [])


# ----------------------------------------------------------------- errors
def _error_case(case, tmp_path, monkeypatch):
    """(tensordict, prefix, kwargs, exception, match) for one error of the Raises list."""
    prefix = tmp_path / "p"
    td, kwargs = make_td(), {}
    if case in ("existsok", "return_early", "windows", "copy_existing"):
        old_save(prefix)
    if case == "existsok":
        kwargs = {"existsok": False}
        return td, prefix, kwargs, RuntimeError, "existsok=False"
    if case == "not_saved":
        prefix.mkdir()
        (prefix / "precious.txt").write_text("not ours")
        return td, prefix, kwargs, RuntimeError, "meta.json"
    if case == "file":
        prefix.write_bytes(b"a file")
        return td, prefix, kwargs, NotADirectoryError, "is a file"
    if case == "no_prefix":
        return td, None, kwargs, ValueError, "needs a directory"
    if case == "return_early":
        return td, prefix, {"num_threads": 2, "return_early": True}, NotImplementedError, "return_early"
    td = TensorDict(a=torch.ones(3)).memmap_(tmp_path / "elsewhere")  # case copy_existing
    return td, prefix, kwargs, RuntimeError, "copy_existing=True"


@pytest.mark.parametrize("method", ["memmap_", "memmap"])
@pytest.mark.parametrize(
    "case", ["existsok", "not_saved", "file", "no_prefix", "return_early", "copy_existing"]
)
def test_errors_leave_prefix_untouched(tmp_path, monkeypatch, case, method):
    td, prefix, kwargs, error, match = _error_case(case, tmp_path, monkeypatch)
    before, tree = dir_state(tmp_path), tree_state(td)
    with pytest.raises(error, match=match):
        getattr(td, method)(prefix, atomic=True, **kwargs)
    monkeypatch.undo()
    after = dir_state(tmp_path)
    if case == "copy_existing":  # raised while planning, under the lock: the lock file stays
        assert after.pop(".p.lock") == b""
    assert after == before
    assert tree_state(td) == tree


def test_an_unpicklable_non_tensor_value_leaves_prefix_as_it_was(tmp_path):
    prefix = tmp_path / "p"
    old_save(prefix)
    before = dir_state(prefix)
    td = make_td()
    td["fn"] = NonTensorData(lambda x: x)
    for method in ("memmap", "memmap_"):
        with pytest.raises(Exception, match="(?i)pickle|lambda"):
            getattr(td, method)(prefix, atomic=True, copy_existing=True)
        assert dir_state(prefix) == before
        assert beside(tmp_path) == ([".p.lock", "p"], [])


@pytest.mark.parametrize("num_threads", [0, 3])
def test_a_failing_file_write_leaves_prefix_as_it_was(tmp_path, monkeypatch, num_threads):
    prefix = tmp_path / "p"
    old_save(prefix)
    before = dir_state(prefix)
    pwrite, calls = files.pwrite_all, []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 4:
            raise OSError(28, "No space left on device (injected)")
        return pwrite(*args, **kwargs)

    monkeypatch.setattr(files, "pwrite_all", failing)
    td = make_td()
    td["big"] = torch.ones(3, 1 << 18)
    tree = tree_state(td)
    with pytest.raises(OSError, match="injected"):
        td.memmap(prefix, atomic=True, num_threads=num_threads)
    assert len(calls) >= 4
    assert dir_state(prefix) == before and tree_state(td) == tree
    assert beside(tmp_path) == ([".p.lock", "p"], [])
    monkeypatch.undo()
    td.memmap_(prefix, atomic=True, num_threads=num_threads)  # the retry succeeds
    assert values_state(load_memmap(prefix)) == values_state(td)


# ----------------------------------------------------------------- lock
def test_the_lock_is_beside_prefix_and_held_during_the_swap(tmp_path, monkeypatch):
    prefix = tmp_path / "p"
    swap, seen = atomic.swap_into_place, []

    def checking(staging, target):
        with pytest.raises(filelock.Timeout):
            filelock.FileLock(tmp_path / ".p.lock", timeout=0).acquire()
        seen.append((os.path.dirname(staging), target))
        swap(staging, target)

    monkeypatch.setattr(atomic, "swap_into_place", checking)
    kids.build(1).memmap_(prefix, atomic=True)
    kids.build(2).memmap_(prefix, atomic=True)
    assert seen == [(str(tmp_path), str(prefix))] * 2
    assert atomic.lock_path(prefix) == str(tmp_path / ".p.lock")
    assert not any("lock" in name for name in os.listdir(prefix))


def test_a_held_lock_times_out_with_the_lock_file_named(tmp_path, monkeypatch):
    prefix = tmp_path / "p"
    kids.build(1).memmap_(prefix, atomic=True)
    before = dir_state(tmp_path)
    monkeypatch.setenv("SHARED_TD_LOCK_TIMEOUT", "0.2")
    with filelock.FileLock(tmp_path / ".p.lock"):
        start = time.monotonic()
        with pytest.raises(TimeoutError, match=re.escape(str(tmp_path / ".p.lock"))):
            kids.build(2).memmap_(prefix, atomic=True)
        with pytest.raises(TimeoutError, match="SHARED_TD_LOCK_TIMEOUT"):
            shared_td.gc(prefix)
        assert time.monotonic() - start < 10
    assert dir_state(tmp_path) == before
    assert kids.check(load_memmap(prefix)) == 1


def test_threads_rewriting_one_prefix_are_serialised(tmp_path):
    prefix, errors, results = tmp_path / "p", [], []

    def write(thread):
        for i in range(4):
            version = thread * 100 + i
            try:
                results.append((version, kids.build(version).memmap_(prefix, atomic=True)))
            except BaseException as error:  # noqa: BLE001
                errors.append(repr(error))

    threads = [threading.Thread(target=write, args=(t,)) for t in range(1, 5)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert errors == [] and len(results) == 16
    for version, td in results:  # each result holds its own version, named at prefix
        assert kids.check(td) == version and td["a"].filename == str(prefix / "a.memmap")
    assert kids.check(load_memmap(prefix)) in {t * 100 + 3 for t in range(1, 5)}
    assert beside(tmp_path) == ([".p.lock", "p"], [])


def test_leaves_are_renamed_before_another_writer_may_swap(tmp_path, monkeypatch):
    """The leaves are told their new names while the lock is held: afterwards the
    prefix may already hold another writer's files, which must not be taken for ours."""
    prefix, relocate, other = tmp_path / "p", api._relocate, []

    def racing(*args):
        if not other:
            other.append(threading.Thread(target=lambda: kids.build(2).memmap_(prefix, atomic=True)))
            other[0].start()
            other[0].join(0.5)  # finishes here only if our lock is already released
        relocate(*args)

    monkeypatch.setattr(api, "_relocate", racing)
    first = kids.build(1).memmap_(prefix, atomic=True)
    other[0].join(30)
    assert kids.check(first) == 1
    assert kids.check(load_memmap(prefix)) == 2


# ----------------------------------------------------------------- swap
def test_prefix_never_goes_missing_during_rewrites(tmp_path):
    prefix = tmp_path / "p"
    kids.build(0).memmap_(prefix, atomic=True)
    stop, out = FORK.Event(), tmp_path / "watch.json"
    watcher = FORK.Process(target=kids.watch, args=(str(prefix), stop, out))
    watcher.start()
    try:
        for version in range(1, 41):
            kids.build(version).memmap_(prefix, atomic=True)
    finally:
        stop.set()
        watcher.join(20)
    result = json.loads(out.read_text())
    assert result["checks"] > 0 and result["missing"] == 0, result


def test_without_exchange_two_renames_are_used(tmp_path, monkeypatch):
    prefix = tmp_path / "p"
    old_save(prefix)
    monkeypatch.setattr(atomic, "rename_exchange", lambda first, second: False)
    td = kids.build(3)
    td.memmap_(prefix, atomic=True)
    assert kids.check(load_memmap(prefix)) == 3 and not (prefix / "junk.bin").exists()
    assert td["a"].filename == str(prefix / "a.memmap")
    assert beside(tmp_path) == ([".p.lock", "p"], [])


def test_a_load_racing_a_rewrite_returns_one_complete_version(tmp_path, monkeypatch):
    """The old tree is deleted while a load reads it (between two members of a lazy
    stack): the load starts again on the new version instead of a shorter stack."""
    prefix = tmp_path / "p"
    kids.build(1).memmap_(prefix, atomic=True)
    load_child, fired = loader.Loader._load_child, []

    def rewriting(self, directory, name, *args):
        value = load_child(self, directory, name, *args)
        if name == "0" and not fired:
            fired.append(name)
            kids.build(2).memmap_(prefix, atomic=True)
        return value

    monkeypatch.setattr(loader.Loader, "_load_child", rewriting)
    assert kids.check(load_memmap(prefix)) == 2 and fired


def test_gc_removes_only_dead_writers_leftovers_of_that_prefix(tmp_path):
    prefix = tmp_path / "p"
    kids.build(1).memmap_(prefix, atomic=True)
    dead = FORK.Process(target=os._exit, args=(0,))
    dead.start()
    dead.join()
    names = {
        f".p.shared_td-new-{dead.pid}-0123456789ab": True, f".p.shared_td-old-{dead.pid}-k2j5x_9a": True,
        f".p.shared_td-new-{os.getpid()}-89abcdef0123": False,  # a live writer's
        f".q.shared_td-new-{dead.pid}-cdef01234567": False,  # another prefix's
        ".p.shared_td-new-notapid-mno": False, "p2": False,
    }
    for name in names:  # a retired (-old-) directory holds the moved-away tree only
        (tmp_path / name / ("tree" if "-old-" in name else "sub")).mkdir(parents=True)
    removed = shared_td.gc(str(prefix))
    assert sorted(removed) == sorted(str(tmp_path / n) for n, gone in names.items() if gone)
    assert sorted(os.listdir(tmp_path)) == sorted([".p.lock", "p"] + [n for n, g in names.items() if not g])
    assert shared_td.gc(prefix) == [] and kids.check(load_memmap(prefix)) == 1
