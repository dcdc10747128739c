"""A view of a memory-mapped tree (a row, a slice, split, unbind, view, unsqueeze,
squeeze, permute, ``td[None]``, a tensorclass row, a nested node of a row) is not
memory-mapped in its parent's directory, as in tensordict 0.15.3: ``saved_path`` is
None, ``memmap_()``/``memmap()`` with no prefix copy it into anonymous memory,
``memmap_refresh_`` raises, ``memmap_(atomic=True)`` has no directory to write to.
Before, a view took its parent's directory, and ``memmap_()`` wrote the view's shape
into the parent's meta.json and its bytes over the start of the parent's files."""
from __future__ import annotations

import json
import os

import pytest
import torch

import shared_td
from shared_td.containers.tensorclass import tensorclass
from tests.reference import needs_tensordict, tensordict


def _libraries():
    libs = [pytest.param(shared_td, id="shared_td")]
    if tensordict is not None:
        libs.append(pytest.param(tensordict, id="tensordict", marks=needs_tensordict))
    return libs


@tensorclass
class Row:
    a: torch.Tensor


if tensordict is not None:
    @tensordict.tensorclass
    class TdRow:
        a: torch.Tensor

# name -> (tensorclass?, the view of a tree of batch [4]: a = arange(4), n.b of shape [4, 2])
VIEWS = {
    "row": (False, lambda t: t[1]),
    "slice": (False, lambda t: t[1:3]),
    "split": (False, lambda t: t.split(2)[1]),
    "unbind": (False, lambda t: t.unbind(0)[2]),
    "view": (False, lambda t: t.view(2, 2)),
    "unsqueeze": (False, lambda t: t.unsqueeze(0)),
    "squeeze": (False, lambda t: t.unsqueeze(-1).squeeze(-1)),
    "permute": (False, lambda t: t.view(2, 2).permute(1, 0)),
    "none_index": (False, lambda t: t[None]),
    "nested_of_row": (False, lambda t: t[1]["n"]),
    "row_of_nested": (False, lambda t: t["n"][1]),
    "tensorclass_row": (True, lambda t: t[1]),
}


def _tree(lib, is_tc: bool, path):
    if is_tc:
        cls = Row if lib is shared_td else TdRow
        return cls(a=torch.arange(4.0), batch_size=[4]).memmap_(path)
    return lib.TensorDict(a=torch.arange(4.0), n={"b": torch.arange(8.0).reshape(4, 2)},
                          batch_size=[4]).memmap_(path)


def _metas(path) -> dict:
    return {d: open(os.path.join(d, "meta.json")).read()
            for d, _, names in os.walk(path) if "meta.json" in names}


def _check_parent_unchanged(lib, tree, path, metas):
    assert _metas(path) == metas  # no meta.json rewritten with the view's shape
    back = type(tree).load_memmap(path)
    assert list(back.batch_size) == [4] and back.get("a").tolist() == [0.0, 1.0, 2.0, 3.0]
    assert tree.get("a").tolist() == [0.0, 1.0, 2.0, 3.0]  # the live tree: nothing written over it


@pytest.mark.parametrize("lib", _libraries())
@pytest.mark.parametrize("name", list(VIEWS))
def test_memmap__of_a_view_copies_it_and_leaves_the_parent_save(lib, name, tmp_path):
    is_tc, make_view = VIEWS[name]
    tree = _tree(lib, is_tc, tmp_path)
    metas = _metas(tmp_path)
    view = make_view(tree)
    expected = view.get("a").clone() if "a" in view.keys() else None
    if lib is shared_td or view.is_memmap():  # (tensordict's td[1:3] is not: unlocked)
        assert view.is_memmap()  # the flag stays, as tensordict keeps it, but no directory
        assert view.saved_path is None
    assert view.memmap_() is view
    _check_parent_unchanged(lib, tree, tmp_path, metas)
    assert view.saved_path is None  # copied into anonymous memory: no directory
    if expected is not None:
        assert torch.equal(view.get("a"), expected)
        with pytest.raises(RuntimeError, match="no file associated"):
            view.get("a").filename


@pytest.mark.parametrize("lib", _libraries())
@pytest.mark.parametrize("name", ["row", "split", "view", "nested_of_row", "tensorclass_row"])
def test_memmap_copy_of_a_view_writes_nothing_into_the_parent(lib, name, tmp_path):
    is_tc, make_view = VIEWS[name]
    tree = _tree(lib, is_tc, tmp_path)
    metas = _metas(tmp_path)
    copy = make_view(tree).memmap()
    _check_parent_unchanged(lib, tree, tmp_path, metas)
    assert copy.saved_path is None


@pytest.mark.parametrize("lib", _libraries())
@pytest.mark.parametrize("name", ["row", "slice", "unbind", "unsqueeze", "tensorclass_row"])
def test_memmap_refresh__of_a_view_raises(lib, name, tmp_path):
    is_tc, make_view = VIEWS[name]
    tree = _tree(lib, is_tc, tmp_path)
    view = make_view(tree)
    with pytest.raises(RuntimeError, match="Cannot refresh"):
        view.memmap_refresh_()
    assert list(view.batch_size) != [4] or name == "unsqueeze"  # (not reloaded as the tree)


@pytest.mark.parametrize("name", ["row", "slice", "permute", "tensorclass_row"])
def test_atomic_memmap__of_a_view_needs_a_prefix(name, tmp_path):
    # shared_td only (tensordict has no atomic=True): the page's ValueError; before, the
    # row replaced the whole save and the parent's leaves mapped deleted files
    is_tc, make_view = VIEWS[name]
    tree = _tree(shared_td, is_tc, tmp_path)
    metas = _metas(tmp_path)
    with pytest.raises(ValueError, match="needs a directory"):
        make_view(tree).memmap_(atomic=True, copy_existing=True)
    _check_parent_unchanged(shared_td, tree, tmp_path, metas)
    tree.get("a")[2] = 42.0  # the parent's leaves still map the save's files
    assert type(tree).load_memmap(tmp_path).get("a").tolist() == [0.0, 1.0, 42.0, 3.0]


@pytest.mark.parametrize("lib", _libraries())
def test_make_memmap_on_a_row_leaves_the_parent_meta(lib, tmp_path):
    tree = _tree(lib, False, tmp_path)
    metas = _metas(tmp_path)
    row = tree[1]
    row.make_memmap("new", shape=[3])
    assert _metas(tmp_path) == metas
    assert "new" not in json.load(open(tmp_path / "meta.json"))


def test_a_locked_row_keeps_the_attribute_order_and_has_no_directory(tmp_path):
    # the replay hot path: a row of a locked memory-mapped buffer is locked, memory-
    # mapped (flag) and has no directory; its attributes are those _new_unsafe sets
    buf = shared_td.TensorDict(obs=torch.zeros(5, 3), nxt={"r": torch.zeros(5)},
                               batch_size=[5]).memmap_(tmp_path)
    row = buf[2]
    fresh = shared_td.TensorDict._new_unsafe({}, torch.Size([]))
    assert list(vars(row))[: len(vars(fresh))] == list(vars(fresh))
    assert row.is_locked and row.is_memmap() and row.saved_path is None
    assert row["nxt"].is_locked and row["nxt"].saved_path is None
