"""Three gaps of the memmap_ contract (audit of session 21, findings 2 to 4):

* ``memmap_(share_non_tensor=True)`` whose coordinator hand-over fails (the coordinator
  gone) leaves nothing half converted: the hand-over comes before any byte is written;
* a nested tensordict in torch shared memory (``share_memory_()`` of a child, a lazy
  stack's member) is refused by ``memmap_()``, as tensordict 0.15.3 refuses it;
* one container at two places of a tree is refused by ``memmap_(prefix)`` before
  anything is written (each place would get its own files, and a write through one
  would not reach the other's); ``memmap()`` writes a copy per place, as tensordict.
"""
from __future__ import annotations

import os

import pytest
import torch

import shared_td
from shared_td.storage import shared_value
from tests.persist.persist_helpers import dir_state
from tests.reference import needs_tensordict, tensordict


def _libraries():
    libs = [pytest.param(shared_td, id="shared_td")]
    if tensordict is not None:
        libs.append(pytest.param(tensordict, id="tensordict", marks=needs_tensordict))
    return libs


# ---------------------------------------------------------------- 2. the hand-over fails

def _gone(cells):
    raise ConnectionError("the shared_td coordinator is gone (test)")


def _tree():
    return shared_td.TensorDict(a=torch.zeros(3), s="hello", n={"t": "x", "b": torch.ones(3)},
                                batch_size=[3])


def _values(td):
    return [td._tensordict["s"], td._tensordict["n"]._tensordict["t"]]


def _states(td):  # (what sharing and memmap_ set; _last_op is the lock's own record)
    return [{k: v for k, v in vars(value).items() if k != "_last_op"} for value in _values(td)]


@pytest.mark.parametrize("where", ["new", "existing", "atomic", "return_early", "anonymous"])
def test_a_failed_hand_over_leaves_the_tree_and_the_files_as_they_were(where, tmp_path, monkeypatch):
    # before: the leaves were adopted and the files written, then the hand-over failed:
    # unlocked, is_memmap True, leaves replaced, the prefix full of files
    prefix = tmp_path / "p"
    if where == "existing":
        shared_td.TensorDict(a=torch.full((3,), 5.0), batch_size=[3]).memmap(prefix)
    before_files = dir_state(prefix)
    td = _tree()
    a0, b0, states = td["a"], td["n", "b"], _states(td)
    monkeypatch.setattr(shared_value, "_ADOPTER", _gone)
    kwargs = {"atomic": True} if where == "atomic" else \
        {"return_early": True, "num_threads": 2} if where == "return_early" else {}
    with pytest.raises(ConnectionError, match="gone"):
        td.memmap_(None if where == "anonymous" else prefix, share_non_tensor=True, **kwargs)
    assert td["a"] is a0 and td["n", "b"] is b0
    assert not td.is_locked and not td.is_memmap() and not td["n"].is_memmap()
    assert _states(td) == states  # not shared, not marked
    assert all(v._shared_value is None for v in _values(td))
    assert dir_state(prefix) == before_files
    monkeypatch.undo()
    td.memmap_(tmp_path / "q", share_non_tensor=True)  # (a working coordinator: written)
    assert td.is_memmap() and td._tensordict["s"]._shared_value is not None


def test_a_write_failing_after_the_values_were_shared_unshares_them(tmp_path):
    # the values are shared before the write; a write that fails then puts them back
    prefix = tmp_path / "p"
    os.makedirs(prefix / "a.memmap")  # a directory where the leaf file goes
    td = _tree()
    with pytest.raises(OSError):
        td.memmap_(prefix, share_non_tensor=True)
    assert all(v._shared_value is None and not v.is_memmap() for v in _values(td))
    assert not td.is_locked and not td.is_memmap()


# ---------------------------------------------------------------- 3. a shared nested node

def _shared_child(lib):
    td = lib.TensorDict(a=torch.zeros(3), n={"b": torch.zeros(3)}, batch_size=[3])
    td["n"].share_memory_()
    return td


def _lazy_with_a_shared_member(lib):
    one = lib.TensorDict(a=torch.zeros(3), batch_size=[3])
    two = lib.TensorDict(a=torch.zeros(3), batch_size=[3]).share_memory_()
    return lib.LazyStackedTensorDict(one, two, stack_dim=0)


@pytest.mark.parametrize("lib", _libraries())
@pytest.mark.parametrize("make", [_shared_child, _lazy_with_a_shared_member])
@pytest.mark.parametrize("anonymous", [False, True])
def test_memmap__refuses_a_nested_node_in_shared_memory(lib, make, anonymous, tmp_path):
    # before: the shared child was memory-mapped in place silently (processes that had
    # received it no longer saw its writes); a lazy stack raised "shared status mismatch"
    td = make(lib)
    prefix = tmp_path / "p"
    with pytest.raises(RuntimeError, match="memmap and shared memory are mutually exclusive"):
        td.memmap_(None if anonymous else prefix)
    if lib is shared_td:  # (tensordict has made the prefix by then)
        assert not os.path.exists(prefix)
        with pytest.raises(RuntimeError, match=r"\('(n|1)',\).*memmap\(\)"):
            td.memmap_(prefix)
        copy = td.memmap(tmp_path / "copy")  # a memory-mapped copy is fine
        assert copy.is_memmap()


# ---------------------------------------------------------------- 4. one container, two places

def _two_keys(lib, sub):
    return lib.TensorDict(x=sub, y=sub, batch_size=[3])


def _stacked_twice(lib, sub):
    return lib.LazyStackedTensorDict(sub, sub, stack_dim=0)


@pytest.mark.parametrize("lib", _libraries())
@pytest.mark.parametrize("make", [_two_keys, _stacked_twice])
def test_memmap__refuses_one_container_at_two_places(lib, make, tmp_path):
    # before: written twice, the tree's leaves mapping the second place's files only: a
    # write through the first place did not reach the first place's files
    sub = lib.TensorDict(a=torch.zeros(3), batch_size=[3])
    td = make(lib, sub)
    with pytest.raises(RuntimeError):  # (tensordict: its own "already has a file" error)
        td.memmap_(tmp_path / "p")
    if lib is shared_td:
        assert not os.path.exists(tmp_path / "p")  # refused before anything is written
        assert not sub.is_memmap() and not td.is_locked
        with pytest.raises(RuntimeError, match=r"\('(x|0)',\) and at \('(y|1)',\).*clone\(\)"):
            td.memmap_(tmp_path / "p")


def test_memmap__refuses_a_tensorclass_at_two_keys(tmp_path):
    @shared_td.tensorclass
    class Pair:
        a: torch.Tensor

    pair = Pair(a=torch.zeros(2), batch_size=[2])
    td = shared_td.TensorDict(x=pair, y=pair, batch_size=[2])
    with pytest.raises(RuntimeError, match=r"same Pair is at \('x',\) and at \('y',\)"):
        td.memmap_(tmp_path / "p")


@pytest.mark.parametrize("lib", _libraries())
@pytest.mark.parametrize("make", [_two_keys, _stacked_twice])
def test_memmap_copies_and_anonymous_memmap__of_an_aliased_tree(lib, make, tmp_path):
    # memmap() writes a copy per place (as tensordict 0.15.3); memmap_() with no prefix
    # (anonymous memory, no save to split) keeps the one object at both places
    sub = lib.TensorDict(a=torch.zeros(3), batch_size=[3])
    copy = make(lib, sub).memmap(tmp_path / "p")
    first, second = (copy["x"], copy["y"]) if make is _two_keys else copy.tensordicts
    assert first is not second
    first["a"][0] = 7.0
    assert second["a"].tolist() == [0.0, 0.0, 0.0] and not sub.is_memmap()
    td = make(lib, sub)
    td.memmap_()
    first, second = (td["x"], td["y"]) if make is _two_keys else td.tensordicts
    assert first is second is sub and sub.is_memmap()
