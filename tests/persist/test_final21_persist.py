"""Final audit of the persist commits (session 21): a view's set_ of a memory-mapped
NonTensorData, a copy's failed coordinator hand-over, the gap check of saves without a
member count, one value at two places, a shared value as the root, a view written into
its parent's directory, a blank SHARED_TD_LOCK_TIMEOUT."""
from __future__ import annotations

import errno
import json
import os
import shutil

import pytest
import torch

import shared_td.storage.shared_value as shared_value
from shared_td import LazyStackedTensorDict, NonTensorData, NonTensorStack, TensorDict
from shared_td.errors import FormatError
from shared_td.persist import writer_lock
from shared_td.storage import files

VIEWS = {
    "row": lambda td: td[1],
    "slice": lambda td: td[1:3],
    "reshape": lambda td: td.reshape(2, 2),
    "copy": lambda td: td.copy(),
}


def _memmapped(lib, prefix):
    td = lib.TensorDict(a=torch.zeros(4), s=lib.NonTensorData("whole", batch_size=[4]), batch_size=[4])
    return td.memmap_(prefix)


@pytest.mark.parametrize("how", ["set_", "update_"])
@pytest.mark.parametrize("view", sorted(VIEWS))
def test_view_write_of_a_memory_mapped_value_reaches_entry_and_files(tmp_path, view, how):
    # it returned normally and was lost to the parent and the files (a private copy)
    import shared_td

    td = _memmapped(shared_td, tmp_path / "t")
    made = VIEWS[view](td)
    if how == "set_":
        made.set_("s", "NEW")
    else:
        made.update_({"s": "NEW"})
    assert made["s"] == "NEW" and td["s"] == "NEW"
    assert TensorDict.load_memmap(tmp_path / "t")["s"] == "NEW"
    assert td[2]["s"] == "NEW"  # a view made later reads it too


def test_row_set_of_a_memory_mapped_value_against_tensordict(tmp_path):
    tensordict = pytest.importorskip("tensordict")
    import shared_td

    for lib, name in ((shared_td, "st"), (tensordict, "td")):
        td = _memmapped(lib, tmp_path / name)
        td[1].set_("s", "ROW")
        # tensordict writes the files (its parent's memory keeps "whole"); so do we, and the parent
        assert lib.TensorDict.load_memmap(tmp_path / name)["s"] == "ROW"
    assert td["s"] == "whole"  # (tensordict's parent: not written, as the audit found)


def test_plain_value_view_stays_a_private_copy():
    td = TensorDict(a=torch.zeros(4), s=NonTensorData("whole", batch_size=[4]), batch_size=[4])
    row = td[1]
    row.set_("s", "ROW")
    assert row["s"] == "ROW" and td["s"] == "whole"  # (unchanged: neither shared nor mapped)


@pytest.fixture
def gone_coordinator():
    before = shared_value._ADOPTER

    def fail(slabs):
        raise ConnectionError(f"coordinator gone (injected), {len(slabs)} slabs")

    shared_value.set_slab_adopter(fail)
    try:
        yield
    finally:
        shared_value.set_slab_adopter(before)


@pytest.mark.parametrize("call", ["memmap", "memmap_like"])
def test_copy_with_share_non_tensor_and_failed_handover_writes_nothing(tmp_path, call, gone_coordinator):
    # it raised ConnectionError but left a complete, loadable save
    td = TensorDict(a=torch.zeros(2), s="u", batch_size=[2])
    prefix = tmp_path / call
    with pytest.raises(ConnectionError, match="coordinator gone"):
        getattr(td, call)(prefix, share_non_tensor=True)
    assert not prefix.exists()
    assert td._tensordict["s"]._shared_value is None and not td.is_memmap()  # the source untouched


@pytest.mark.parametrize("call", ["memmap", "memmap_like"])
def test_copy_with_share_non_tensor_shares_the_copys_values(tmp_path, call):
    td = TensorDict(a=torch.zeros(2), s="u", batch_size=[2])
    out = getattr(td, call)(tmp_path / call, share_non_tensor=True)
    entry = out._tensordict["s"]
    assert entry._shared_value is not None and entry is not td._tensordict["s"]
    assert td._tensordict["s"]._shared_value is None
    out.set_("s", "v")
    assert td["s"] == "u" and TensorDict.load_memmap(tmp_path / call)["s"] == "v"


def _stack_without_count(prefix, lost):
    LazyStackedTensorDict(*[TensorDict(a=torch.full((2,), float(i)), batch_size=[2])
                            for i in range(5)]).memmap_(prefix)
    meta_path = os.path.join(prefix, "meta.json")
    with open(meta_path) as f:
        meta = json.load(f)
    del meta["_shared_td_members"]  # as tensordict (or an older shared_td) saves it
    with open(meta_path, "w") as f:
        json.dump(meta, f)
    for index in lost:
        shutil.rmtree(os.path.join(prefix, str(index)))


@pytest.mark.parametrize("lost, later", [((1, 2), 3), ((1, 2, 3), 4), ((1,), 2)])
def test_gap_of_several_members_without_count_is_refused(tmp_path, lost, later):
    # looking one index ahead, members 1 and 2 lost loaded 1 member silently
    _stack_without_count(tmp_path / "l", lost)
    with pytest.raises(FormatError, match=f"member 1 of this lazy stack is missing.*member {later} is there"):
        LazyStackedTensorDict.load_memmap(tmp_path / "l")


def test_stack_without_count_ends_at_its_last_member(tmp_path):
    _stack_without_count(tmp_path / "l", (3, 4))
    (tmp_path / "l" / "x9").mkdir()  # (not a member's name)
    (tmp_path / "l" / "07").mkdir()
    assert len(LazyStackedTensorDict.load_memmap(tmp_path / "l").tensordicts) == 3


def test_one_value_at_two_places_is_refused_before_any_write(tmp_path):
    # adopted at both, it recorded one directory: a set_ rewrote one place's files only
    value = NonTensorData("x")
    td = TensorDict(a=value, n=TensorDict(b=value))
    with pytest.raises(RuntimeError, match=r"same NonTensorData is at \('a',\) and at \('n', 'b'\)"):
        td.memmap_(tmp_path / "t")
    assert not (tmp_path / "t").exists() and not td.is_memmap()
    td.memmap(tmp_path / "copy")  # a copy: each place its own, as before
    td.memmap_()  # anonymous memory: the two places stay one object


@pytest.mark.parametrize("make", [lambda: NonTensorData("x"), lambda: NonTensorStack("a", "b")])
def test_shared_value_as_root_is_memory_mapped(tmp_path, make):
    # refused ("mutually exclusive") though accepted nested, and by tensordict
    root = make().share_memory_()
    root.memmap_(tmp_path / "v")
    assert root.is_memmap()
    assert TensorDict.load_memmap(tmp_path / "v").tolist() == root.tolist()


def test_shared_value_as_root_against_tensordict(tmp_path):
    tensordict = pytest.importorskip("tensordict")
    tensordict.NonTensorData("x").share_memory_().memmap_(tmp_path / "td")
    NonTensorData("x").share_memory_().memmap_(tmp_path / "st")
    assert TensorDict.load_memmap(tmp_path / "td").data == "x"


@pytest.mark.parametrize("view, values", [
    (lambda td: td[1], 1.0),
    (lambda td: td[1:3], [1.0, 2.0]),
    (lambda td: td[::2], [0.0, 2.0]),
])
def test_view_written_into_its_parents_directory_keeps_the_parents_bytes(tmp_path, view, values):
    # the leaf, a view of the very file, was written over its first bytes: td read [1, 1, 2, 3]
    td = TensorDict(a=torch.arange(4.), batch_size=[4]).memmap_(tmp_path / "t")
    view(td).memmap_(tmp_path / "t")
    assert td["a"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert TensorDict.load_memmap(tmp_path / "t")["a"].tolist() == values  # (tensordict: [0, 1])
    assert sorted(os.listdir(tmp_path / "t")) == ["a.memmap", "meta.json"]  # the old file set aside is gone


def test_a_failed_write_of_a_view_into_its_parents_directory_keeps_the_save(tmp_path, monkeypatch):
    """The old file is set aside, not unlinked, and put back when the write fails (last
    audit of 0b84365: a failed write left a meta.json naming a missing file)."""
    td = TensorDict(a=torch.arange(4.), batch_size=[4]).memmap_(tmp_path / "t")

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(files, "pwrite_all", full)
    with pytest.raises(OSError):
        td[1:3].memmap_(tmp_path / "t")
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path / "t")) == ["a.memmap", "meta.json"]
    assert TensorDict.load_memmap(tmp_path / "t")["a"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert td["a"].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_view_written_into_its_parents_directory_against_tensordict(tmp_path):
    tensordict = pytest.importorskip("tensordict")
    td = tensordict.TensorDict(a=torch.arange(4.), batch_size=[4]).memmap_(tmp_path / "t")
    td[1:3].memmap_(tmp_path / "t")
    assert td["a"].tolist() == [0.0, 1.0, 2.0, 3.0]  # as ours, above


@pytest.mark.parametrize("value", ["", "  ", "\t"])
def test_blank_lock_timeout_is_unset(monkeypatch, value):
    monkeypatch.setenv(writer_lock.LOCK_TIMEOUT_VARIABLE, value)
    assert writer_lock.lock_timeout() == writer_lock.DEFAULT_LOCK_TIMEOUT


@pytest.mark.parametrize("view", ["row", "copy"])
def test_view_saved_on_its_own_writes_its_own_files(tmp_path, view):
    # a view that reads its entry's value: once saved elsewhere, its set_ is its own
    td = _memmapped(__import__("shared_td"), tmp_path / "p")
    made = VIEWS[view](td)
    made.memmap_(tmp_path / "q", copy_existing=True)
    made.set_("s", "Z")
    assert td["s"] == "whole" and TensorDict.load_memmap(tmp_path / "p")["s"] == "whole"
    assert made["s"] == "Z" and TensorDict.load_memmap(tmp_path / "q")["s"] == "Z"


def test_a_row_saved_with_shared_values_writes_its_own_save(tmp_path):
    """A row of a memory-mapped value, saved on its own with share_non_tensor=True (or
    share_memory_()), writes its own cell and files, never the parent's (last audit of
    0b84365: it rewrote the parent's files through the entry it was made from)."""
    td = TensorDict(a=torch.zeros(3), s=NonTensorData("whole"), batch_size=[3]).memmap_(tmp_path / "p")
    row = td[1]
    row.memmap_(tmp_path / "q", share_non_tensor=True, copy_existing=True)
    row.set_("s", "X")
    assert (td["s"], TensorDict.load_memmap(tmp_path / "p")["s"]) == ("whole", "whole")
    assert TensorDict.load_memmap(tmp_path / "q")["s"] == "X"
    other = td[2].unlock_().share_memory_()
    other.set_("s", "Y")
    assert (td["s"], TensorDict.load_memmap(tmp_path / "p")["s"]) == ("whole", "whole")
