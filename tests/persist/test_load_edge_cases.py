"""Loads at their edges: load_memmap_ into a memory-mapped tensordict from an archive or
with mode="r", a wrong ``out=``, an unknown class at an archive's root, a FIFO or an
archive appearing during the load, and non-tensor values that cannot be pickled.

Compared with tensordict 0.15.3 side by side where it behaves well (skipped otherwise).
"""
from __future__ import annotations

import json
import os
import threading
import zipfile

import pytest
import torch

import shared_td
from shared_td import NonTensorData, TensorDict
from shared_td.errors import FormatError, ReadOnlyError
from shared_td.persist import loader
from tests.reference import needs_tensordict, tensordict

# ------------------------------------------------------------- load_memmap_ in place
SOURCES = {"archive": ("s.tdz", None), "dir, mode='r'": ("s", "r"),
           "archive, mode='r'": ("s.tdz", "r"), "dir": ("s", None)}


def _load_in_place(lib, tmp_path, source):
    """A memory-mapped {a, c} loaded in place from a save of {a, b}."""
    name, mode = SOURCES[source]
    saved = lib.TensorDict(a=torch.arange(3.0), b=torch.ones(3), batch_size=[3])
    saved.memmap(tmp_path / "s")
    saved.memmap(tmp_path / "s.tdz")
    mine = lib.TensorDict(a=torch.zeros(3), c=torch.zeros(3), batch_size=[3]).memmap_(tmp_path / "mine")
    assert mine.load_memmap_(tmp_path / name, mode=mode) is mine
    return mine


def _state(td):
    return sorted(td.keys()), td["a"].tolist(), td.is_memmap(), td.is_locked


@pytest.mark.parametrize("source", SOURCES)
def test_load_memmap_in_place_into_a_memmapped_td(tmp_path, source):
    # An archive or mode="r" has no directory to memory-map self into: self is left
    # unlocked and no longer memory-mapped (it used to fail after changing self's keys).
    mine = _load_in_place(shared_td, tmp_path, source)
    remapped = source == "dir"
    assert _state(mine) == (["a", "b"], [0.0, 1.0, 2.0], remapped, remapped)
    assert shared_td.is_memmap_archive(tmp_path / "s.tdz")  # the archive is left intact
    if remapped:
        assert mine.saved_path == tmp_path / "s"


@needs_tensordict
@pytest.mark.parametrize("source", SOURCES)
def test_load_memmap_in_place_equals_tensordict(tmp_path, source):
    ours = _load_in_place(shared_td, tmp_path / "ours", source)
    theirs = _load_in_place(tensordict, tmp_path / "theirs", source)
    assert _state(ours) == _state(theirs)


def test_load_memmap_in_place_failure_leaves_self_as_it_was(tmp_path, monkeypatch):
    # A memory-mapped self cannot be memory-mapped again into the loaded directory (as
    # when its files are read-only): the error says so and self keeps keys, lock, flags.
    TensorDict(a=torch.arange(3.0), b=torch.ones(3), batch_size=[3]).memmap(tmp_path / "s")
    mine = TensorDict(a=torch.zeros(3), c=torch.zeros(3), batch_size=[3]).memmap_(tmp_path / "mine")
    before = mine["a"]

    def refuse(self, *args, **kwargs):
        raise ReadOnlyError("Key ('a',) cannot be memory-mapped to its own file: read-only")

    monkeypatch.setattr(TensorDict, "memmap_", refuse)
    with pytest.raises(ReadOnlyError, match="mode='r'"):
        mine.load_memmap_(tmp_path / "s")
    assert _state(mine) == (["a", "c"], [0.0, 0.0, 0.0], True, True) and mine["a"] is before


# ------------------------------------------------------------------- load_memmap(out=)
@pytest.mark.parametrize("out", [{"a": torch.ones(2)}, [1, 2], "td"])
def test_module_load_memmap_refuses_an_out_that_is_not_a_tensordict(tmp_path, out):
    TensorDict(a=torch.zeros(2)).memmap(tmp_path / "s")
    for load in (shared_td.load_memmap, shared_td.load, TensorDict.load_memmap):
        with pytest.raises(TypeError, match=r"load_memmap\(out=\) takes a TensorDict"):
            load(tmp_path / "s", out=out)


# --------------------------------------------------- an unknown class at an archive's root
def _archive_of_unknown_class(path):
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("meta.json", json.dumps(
            {"_type": "<class 'mymod.Klass'>", "shape": [2], "device": "cpu"}))


def test_unknown_class_at_an_archive_root_names_the_archive(tmp_path):
    path = tmp_path / "bad.tdz"
    _archive_of_unknown_class(path)
    with pytest.raises(FormatError, match="no known tensordict class") as caught:
        shared_td.load_memmap(path)
    assert caught.value.path == str(path)  # not its parent directory


def test_unknown_class_in_a_directory_names_the_directory(tmp_path):
    path = tmp_path / "bad"
    path.mkdir()
    (path / "meta.json").write_text(json.dumps({"_type": "<class 'mymod.Klass'>", "shape": [2]}))
    with pytest.raises(FormatError, match="mymod.Klass.*no known tensordict class") as caught:
        shared_td.load_memmap(path)
    assert caught.value.path == str(path)


# ------------------------------------------------------- what the path is when opened
def test_a_fifo_is_named_a_fifo_without_blocking(tmp_path):
    fifo = tmp_path / "x.tdz"
    os.mkfifo(fifo)
    with pytest.raises(NotADirectoryError, match="is a FIFO"):
        shared_td.load_memmap(fifo)  # a blocking open would hang here: no writer comes


def test_a_plain_file_is_named_a_file(tmp_path):
    (tmp_path / "f").write_text("not a zip")
    with pytest.raises(NotADirectoryError, match="is a file, not a saved tensordict"):
        shared_td.load_memmap(tmp_path / "f")


def test_an_archive_appearing_after_a_look_is_loaded(tmp_path, monkeypatch):
    # A writer renames the archive in between a reader's look at the path (missing)
    # and its open: what was opened decides, so the valid archive loads.
    TensorDict(a=torch.ones(4)).memmap(tmp_path / "x.tdz")
    real_isfile = os.path.isfile
    monkeypatch.setattr(os.path, "isfile", lambda p: False if str(p).endswith(".tdz") else real_isfile(p))
    assert shared_td.load_memmap(tmp_path / "x.tdz")["a"].tolist() == [1.0] * 4


def test_an_archive_replaced_between_two_opens_is_opened_again(tmp_path, monkeypatch):
    # The path is opened once to see what it is, then the archive opens it by name: if
    # another archive was renamed in between, that newer one is loaded (never a mix).
    path = tmp_path / "x.tdz"
    TensorDict(a=torch.ones(2)).memmap(path)
    TensorDict(a=torch.full((2,), 7.0)).memmap(tmp_path / "new.tdz")
    real, calls = loader.Archive, []

    def archive_after_a_swap(*args, **kwargs):
        if not calls:
            os.rename(tmp_path / "new.tdz", path)
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(loader, "Archive", archive_after_a_swap)
    assert shared_td.load_memmap(path)["a"].tolist() == [7.0, 7.0]
    assert len(calls) == 2


# ----------------------------------------------- non-tensor values that cannot be pickled
def _with_a_lock():
    return TensorDict(x=torch.zeros(2), nested=TensorDict(s=NonTensorData(threading.Lock())))


@pytest.mark.parametrize("call", ["memmap_(prefix)", "memmap(prefix)", "memmap(archive)",
                                  "memmap_(share_non_tensor=True)",
                                  "memmap_(prefix, share_non_tensor=True)"])
def test_an_unpicklable_value_is_named_by_its_full_key(tmp_path, call):
    td = _with_a_lock()
    x = td["x"]
    prefix = tmp_path / ("p.tdz" if "archive" in call else "p")
    calls = {
        "memmap_(prefix)": lambda: td.memmap_(prefix),
        "memmap(prefix)": lambda: td.memmap(prefix),
        "memmap(archive)": lambda: td.memmap(prefix),
        "memmap_(share_non_tensor=True)": lambda: td.memmap_(share_non_tensor=True),
        "memmap_(prefix, share_non_tensor=True)": lambda: td.memmap_(prefix, share_non_tensor=True),
    }
    with pytest.raises(TypeError, match=r"\('nested', 's'\).*cannot be pickled.*Remove it .* or replace it"):
        calls[call]()
    assert not os.path.lexists(prefix)  # nothing left on disk
    assert td["x"] is x and not td.is_memmap() and not td.is_locked  # nor in self


def test_an_unpicklable_value_in_a_later_node_changes_no_earlier_one():
    # share_non_tensor=True shares the values node by node after the leaves are
    # written: a value that cannot be shared must be refused before the first node.
    td = TensorDict(n1=TensorDict(x=torch.zeros(2), batch_size=[2]),
                    n2=TensorDict(s=NonTensorData(threading.Lock()), batch_size=[2]), batch_size=[2])
    x = td["n1", "x"]
    with pytest.raises(TypeError, match=r"\('n2', 's'\)"):
        td.memmap_(share_non_tensor=True)
    assert td["n1", "x"] is x and not td["n1"].is_memmap()


def test_a_json_value_beside_is_not_blamed(tmp_path):
    # only the entry that pickle fails on is named; other TypeErrors pass unchanged
    td = TensorDict(ok=NonTensorData("text"), bad=NonTensorData(threading.Lock()))
    with pytest.raises(TypeError, match=r"entry 'bad'"):
        td.memmap(tmp_path / "p")
    with pytest.raises(TypeError, match="prefix must be a path") as caught:
        td.memmap(object())  # a TypeError of its own, with an unpicklable value present
    assert "cannot be pickled" not in str(caught.value)


def test_an_unpicklable_value_saved_on_its_own_is_named_so(tmp_path):
    value = NonTensorData(threading.Lock())
    with pytest.raises(TypeError, match="this non-tensor value holds a lock.*Replace it"):
        value.memmap(tmp_path / "p")
    assert not os.path.lexists(tmp_path / "p")


def test_share_memory_names_the_full_key_and_shares_nothing():
    import threading

    td = shared_td.TensorDict(a="text", nested={"s": threading.Lock()}, x=torch.zeros(2))
    with pytest.raises(TypeError, match=r"share_memory_\(\): the non-tensor entry \('nested', 's'\)"):
        td.share_memory_()
    # checked first: nothing was shared before the entry at fault
    assert not td.is_shared() and not td["x"].is_shared() and td.get("a")._shared_value is None
