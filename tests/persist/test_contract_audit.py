"""Defects found by auditing the memmap_ contract (the seed page TensorDictBase.memmap_)
against tensordict 0.15.3, each tested where it was found:

* ``return_early=True``: the tree is locked while the background write runs, as
  tensordict's is (an entry added or removed meanwhile was silently lost or brought
  back when the written leaves were put in), and a failed write puts every lock back;
  an unpicklable non-tensor value is an error of the call itself, naming its key (it
  came out of ``result()`` without the key).
* a rewrite into the tensordict's own directory whose leaves view files that the same
  write overwrites (two keys' memory-mapped tensors swapped, then
  ``memmap_(copy_existing=True)``) read those files after they were overwritten: a
  leaf above the staging size silently got the other key's new bytes.
* ``memmap_()`` into the tensordict's own directory kept every leaf whose path matched,
  even when the file there was no longer the one it maps (the directory removed, or
  replaced by another process's atomic rewrite): the new meta.json named missing files,
  or the other version's files under this tensordict's shapes (tensordict 0.15.3 does
  the same).
* a lazy stack written over a save of a longer one: the old save's last members stayed
  and were loaded as members of the new stack (or made the load fail inside a
  TensorDict), by shared_td and tensordict 0.15.3 alike.
"""
from __future__ import annotations

import multiprocessing
import shutil
import threading

import pytest
import torch

from tests.persist.persist_helpers import dir_state, tree_state
from tests.processes import finish

from shared_td import LazyStackedTensorDict, LockedTensorDictError, NonTensorData, TensorDict, tensorclass
from shared_td.persist import api
from shared_td.storage.files import Directory

# Every wait of these tests is bounded by this many seconds.
WAIT_S = 30


@tensorclass
class Step:
    obs: torch.Tensor
    label: str


def _td() -> TensorDict:
    # a tensordict locked on its own (memory-mapped already) inside an unlocked tree:
    # a failed write must leave it locked, with its own locked parents only
    own = TensorDict(c=torch.ones(2), batch_size=[2]).memmap_()
    return TensorDict(a=torch.ones(2, 3), n=TensorDict(b=torch.zeros(2), batch_size=[2]), own=own,
                      batch_size=[2])


MAKERS = {
    "tensordict": _td,
    "lazy": lambda: LazyStackedTensorDict(TensorDict(a=torch.ones(3), batch_size=[3]),
                                          TensorDict(a=torch.zeros(3), b=torch.ones(3), batch_size=[3])),
    "tensorclass": lambda: Step(obs=torch.ones(2, 3), label="x", batch_size=[2]),
}


def _inner(obj):
    return obj._tensordict if hasattr(obj, "_tensordict") and not isinstance(obj._tensordict, dict) else obj


def _state(obj):
    """tree_state of ``obj`` (of each member of a lazy stack: reading a lazy stack's key
    stacks a new tensor each time, so its leaves have no identity to compare)."""
    inner = _inner(obj)
    if isinstance(inner, LazyStackedTensorDict):
        return [tree_state(member) for member in inner.tensordicts]
    return tree_state(inner)


def _lock_graph(obj) -> list:
    """Per node of ``obj``: its class, lock flag and the ids of its locked parents."""
    found, pending = [], [_inner(obj)]
    while pending:
        node = pending.pop()
        found.append((type(node).__name__, id(node), node._is_locked, sorted(node._lock_parents)))
        pending.extend(_inner(child) for child in node._collection_children())
    return found


@pytest.fixture
def held_write(monkeypatch):
    """The background write of return_early waits for ``release`` (then fails if
    ``fail`` is set): a pending future the test can look at. Writes made by the
    test's own thread are not held."""
    release, started = threading.Event(), threading.Event()
    state = {"fail": False}
    real = api.write_tree

    def held(*args, **kwargs):
        if threading.current_thread() is threading.main_thread():
            return real(*args, **kwargs)  # a write that does not return early
        started.set()
        assert release.wait(WAIT_S), "the test never released the write"
        if state["fail"]:
            raise OSError(28, "injected failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(api, "write_tree", held)
    return release, started, state


@pytest.mark.parametrize("case", sorted(MAKERS))
def test_return_early_locks_the_tree_while_writing(case, tmp_path, held_write):
    release, started, _ = held_write
    obj = MAKERS[case]()
    keys = sorted(obj.keys())
    future = obj.memmap_(tmp_path / "p", num_threads=2, return_early=True)
    try:
        assert started.wait(WAIT_S)
        assert not future.done() and obj.is_locked
        leaf = "obs" if case == "tensorclass" else "a"
        with pytest.raises(LockedTensorDictError):  # replaced: the new tensor would be lost
            obj.set(leaf, torch.full_like(obj.get(leaf), 7.0))
        with pytest.raises(LockedTensorDictError):  # removed: it would come back
            obj.del_(leaf)
        if case != "tensorclass":  # (a tensorclass has no room for a new key)
            with pytest.raises(LockedTensorDictError):  # added: it would be lost
                obj.set("late", torch.ones(obj.batch_size))
    finally:
        release.set()
    assert future.result(timeout=WAIT_S) is obj
    assert sorted(obj.keys()) == keys and obj.is_memmap() and obj.is_locked


@pytest.mark.parametrize("case", sorted(MAKERS))
def test_failed_return_early_write_puts_the_locks_back(case, tmp_path, held_write):
    release, _, state = held_write
    state["fail"] = True
    obj = MAKERS[case]()
    before, graph = _state(obj), _lock_graph(obj)
    future = obj.memmap_(tmp_path / "p", num_threads=2, return_early=True)
    release.set()
    with pytest.raises(OSError, match="injected failure"):
        future.result(timeout=WAIT_S)
    assert _state(obj) == before and _lock_graph(obj) == graph
    assert dir_state(tmp_path / "p") == {}


def test_return_early_error_at_the_call_puts_the_locks_back(tmp_path):
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "a.memmap").write_bytes(b"old")
    td = _td()
    before, graph = tree_state(td), _lock_graph(td)
    with pytest.raises(RuntimeError, match="already exists"):
        td.memmap_(tmp_path / "p", num_threads=2, return_early=True, existsok=False)
    assert tree_state(td) == before and _lock_graph(td) == graph


def test_return_early_names_an_unpicklable_value_at_the_call(tmp_path):
    td = TensorDict(a=torch.ones(2), n=TensorDict(fn=NonTensorData(lambda x: x, batch_size=[2]), batch_size=[2]),
                    batch_size=[2])
    before = tree_state(td)
    # pickle raises a PicklingError or an AttributeError for a lambda, by Python version
    with pytest.raises(Exception, match=r"memmap_: the non-tensor entry \('n', 'fn'\)"):
        td.memmap_(tmp_path / "p", num_threads=2, return_early=True)
    assert tree_state(td) == before
    assert dir_state(tmp_path / "p") == {}


# elements: 1 000 (staged with the small leaves), 100 000 and 2**20 (written one by one;
# the largest by the pool with num_threads=2)
@pytest.mark.parametrize("numel", [1000, 100_000, 1 << 20])
@pytest.mark.parametrize("num_threads", [0, 2])
@pytest.mark.parametrize("source", ["memmapped", "plain_view", "read_only"])
def test_rewrite_of_swapped_leaves_keeps_each_value(tmp_path, numel, num_threads, source):
    prefix = tmp_path / "p"
    TensorDict(a=torch.zeros(numel), n=TensorDict(b=torch.ones(numel), batch_size=[]),
               batch_size=[]).memmap_(prefix)
    loaded = TensorDict.load_memmap(prefix, mode="r" if source == "read_only" else None)
    a, b = loaded["a"], loaded["n", "b"]
    if source == "plain_view":  # views of the mappings that are not MemoryMappedTensors
        a, b = a.as_subclass(torch.Tensor), b.as_subclass(torch.Tensor)
    swapped = TensorDict(a=b, n=TensorDict(b=a, batch_size=[]), batch_size=[])
    swapped.memmap_(prefix, copy_existing=True, num_threads=num_threads)
    for td in (swapped, TensorDict.load_memmap(prefix)):
        assert torch.equal(td["a"], torch.ones(numel)), "a read b's file after a was written into it"
        assert torch.equal(td["n", "b"], torch.zeros(numel)), "b read a's file after b was written into it"


def test_memmap_into_a_nested_tensordicts_directory_keeps_each_value(tmp_path):
    # the root's leaf "b" goes to n/b.memmap, the very file that n's own "b" maps
    numel = 1 << 18
    td = TensorDict(b=torch.full((numel,), 1.0), n=TensorDict(b=torch.full((numel,), 2.0), batch_size=[]),
                    batch_size=[]).memmap_(tmp_path / "p")
    td.memmap_(tmp_path / "p" / "n", copy_existing=True)
    for tree in (td, TensorDict.load_memmap(tmp_path / "p" / "n")):
        assert torch.equal(tree["b"], torch.full((numel,), 1.0))
        assert torch.equal(tree["n", "b"], torch.full((numel,), 2.0))


def _rewrite_atomically(prefix: str) -> None:
    """Child: another program's atomic rewrite of ``prefix``, with another layout."""
    torch.set_num_threads(1)
    TensorDict(a=torch.zeros(2), other=torch.zeros(5), batch_size=[]).memmap_(prefix, atomic=True)


@pytest.mark.parametrize("how", ["removed", "replaced_by_another_process"])
def test_memmap_into_own_directory_rewrites_files_no_longer_there(tmp_path, how):
    prefix = tmp_path / "p"
    td = TensorDict(a=torch.arange(4.0), big=torch.full((2, 1 << 16), 3.0),
                    n=TensorDict(b=torch.ones(3), batch_size=[]), batch_size=[]).memmap_(prefix)
    if how == "removed":
        shutil.rmtree(prefix)
    else:
        child = multiprocessing.get_context("fork").Process(target=_rewrite_atomically, args=(str(prefix),))
        child.start()
        assert finish(child) == 0
    td.unlock_()
    td.memmap_()  # into its own directory, as it is now
    assert td.saved_path == prefix and td.is_memmap()
    loaded = TensorDict.load_memmap(prefix)
    # (the other version's file "other.memmap" stays, named by no meta.json: memmap_
    # overwrites, only atomic=True replaces a directory as a whole)
    assert set(loaded.keys(True, True)) == set(td.keys(True, True))
    assert loaded["a"].tolist() == [0.0, 1.0, 2.0, 3.0] and loaded["n", "b"].tolist() == [1.0] * 3
    assert torch.equal(loaded["big"], torch.full((2, 1 << 16), 3.0))
    # and the tensordict's leaves are the files at its saved path again
    td["a"][0] = 9.0
    assert TensorDict.load_memmap(prefix)["a"][0].item() == 9.0


def test_memmap_into_own_directory_keeps_leaves_still_there(tmp_path):
    td = TensorDict(a=torch.arange(4.0), n=TensorDict(b=torch.ones(3), batch_size=[]), batch_size=[])
    td.memmap_(tmp_path / "p")
    leaves = {key: td.get(key) for key in td.keys(True, True)}
    td.unlock_()
    td.memmap_()
    assert all(td.get(key) is leaf for key, leaf in leaves.items())


def _stack(length: int, value: float) -> LazyStackedTensorDict:
    return LazyStackedTensorDict(*[TensorDict(x=torch.full((2,), value), batch_size=[2]) for _ in range(length)])


@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("num_threads", [0, 2])
def test_shorter_lazy_stack_over_a_longer_one_loads_as_written(tmp_path, nested, num_threads):
    import tensordict

    def wrap(stack):
        return TensorDict(s=stack, batch_size=stack.batch_size[:1]) if nested else stack

    prefix = tmp_path / "p"
    wrap(_stack(4, 1.0)).memmap_(prefix)
    written = wrap(_stack(2, 2.0))
    written.memmap_(prefix, num_threads=num_threads)
    stack_dir = prefix / "s" if nested else prefix
    assert sorted(p.name for p in stack_dir.iterdir()) == ["0", "1", "meta.json"]
    for loaded in (TensorDict.load_memmap(prefix), tensordict.TensorDict.load_memmap(prefix)):
        stack = loaded["s"] if nested else loaded
        assert stack.batch_size == (2, 2) and stack["x"].tolist() == [[2.0, 2.0]] * 2


def test_stale_member_that_cannot_be_removed_is_an_error(tmp_path, monkeypatch):
    prefix = tmp_path / "p"
    _stack(3, 1.0).memmap_(prefix)

    def refuse(self, name):
        raise PermissionError(1, "Operation not permitted", self.join(name))

    monkeypatch.setattr(Directory, "remove_tree", refuse)
    shorter = _stack(2, 2.0)
    before = _state(shorter)
    with pytest.raises(OSError, match=r"could not be removed: .*p/2 .*extra lazy-stack member"):
        shorter.memmap_(prefix)
    assert _state(shorter) == before and not shorter.is_locked
