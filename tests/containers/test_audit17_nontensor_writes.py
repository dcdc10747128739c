"""A write into a shared or memory-mapped non-tensor entry that cannot be stored fails
before any entry is written (audit 17): a value that cannot be pickled (a lambda, a
lock) is refused when the write is planned, naming the entry; a full disk or memory,
which no plan can see, fails in the entry's store, which runs before every tensor write,
and leaves the entry's values in memory as they are in its files.

tensordict 0.15.3 half-writes in all these cases (the tensors before the entry written,
a memory-mapped stack's values changed in memory but not in its files); its behaviour is
not asserted. Where shared_td and tensordict agree (an entry in memory takes any
object, a new non-tensor key), they are compared side by side.
"""
from __future__ import annotations

import contextlib
import resource
import signal
import threading

import pytest
import torch

import shared_td
from shared_td.errors import StorageFullError
from tests.reference import LIBS

BAD = {"lambda": lambda: 1, "lock": threading.Lock()}


def _buffer(mode, path, n=4, texts=None, share_non_tensor=False):
    """``a``, a NonTensorStack ``s`` (of ``texts``, else "x"), a NonTensorData ``t``,
    ``z``: in memory, shared (share_memory_()) or memory-mapped at ``path``."""
    td = shared_td.TensorDict(
        a=torch.zeros(n), s=shared_td.NonTensorStack(*(texts or ["x"] * n)), t=shared_td.NonTensorData("x", batch_size=[n]),
        z=torch.zeros(n), batch_size=[n])
    if mode == "shared":
        td.share_memory_()
    elif mode == "memmap":
        td.memmap_(path, share_non_tensor=share_non_tensor)
    return td


def _assert_unchanged(td, mode, path, n=4, texts=None):
    texts = texts or ["x"] * n
    assert td["a"].tolist() == [0.0] * n and td["z"].tolist() == [0.0] * n
    assert td["s"] == texts and td["t"] == "x"
    if mode == "memmap":
        back = shared_td.TensorDict.load_memmap(path)
        assert back["s"] == texts and back["t"] == "x" and back["a"].tolist() == [0.0] * n


@pytest.mark.parametrize("mode", ["shared", "memmap"])
@pytest.mark.parametrize("bad", list(BAD))
@pytest.mark.parametrize("index", ["rows", "one"])
def test_a_value_that_cannot_be_pickled_fails_before_any_entry_is_written(mode, bad, index, tmp_path):
    td = _buffer(mode, tmp_path)
    if index == "rows":
        idx, src = torch.tensor([1, 2]), shared_td.TensorDict(
            a=torch.ones(2), s=shared_td.NonTensorStack("ok", BAD[bad]), z=torch.ones(2), batch_size=[2])
    else:
        idx, src = 1, shared_td.TensorDict(a=torch.ones(()), s=shared_td.NonTensorData(BAD[bad]), z=torch.ones(()))
    with pytest.raises(TypeError, match="into the non-tensor entry 's'.*Nothing was written"):
        td[idx] = src
    _assert_unchanged(td, mode, tmp_path)


@pytest.mark.parametrize("mode", ["shared", "memmap"])
@pytest.mark.parametrize("op", ["update_", "update-inplace", "update_at_", "set_at_-nested"])
def test_update_paths_check_the_value_before_any_entry_is_written(mode, op, tmp_path):
    td = _buffer(mode, tmp_path)
    bad = BAD["lambda"]
    with pytest.raises(TypeError, match="non-tensor entry .*cannot be pickled"):
        if op == "update_":
            td.update_({"a": torch.ones(4), "t": bad, "z": torch.ones(4)})
        elif op == "update-inplace":
            td.update({"a": torch.ones(4), "t": bad, "z": torch.ones(4)}, inplace=True)
        elif op == "update_at_":
            td.update_at_({"a": torch.ones(2), "s": shared_td.NonTensorStack("ok", bad), "z": torch.ones(2)},
                          slice(0, 2))
        else:  # a nested tensordict written at rows: its entries planned together
            outer = shared_td.TensorDict(n=td, batch_size=[4])
            outer.set_at_("n", shared_td.TensorDict(
                a=torch.ones(2), s=shared_td.NonTensorStack("ok", bad), z=torch.ones(2), batch_size=[2]), slice(0, 2))
    _assert_unchanged(td, mode, tmp_path)


@pytest.mark.parametrize("lib", LIBS)
def test_an_entry_in_memory_takes_any_object(lib):
    td = lib.TensorDict(a=torch.zeros(3), s=lib.NonTensorStack("x", "x", "x"), batch_size=[3])
    lock = threading.Lock()
    td[torch.tensor([0, 2])] = lib.TensorDict(a=torch.ones(2), s=lib.NonTensorStack("ok", lock), batch_size=[2])
    assert td["a"].tolist() == [1.0, 0.0, 1.0]
    assert td[0]["s"] == "ok" and td[1]["s"] == "x" and td[2]["s"] is lock


@pytest.mark.parametrize("lib", LIBS)
def test_a_new_non_tensor_key_is_added_then_filled(lib):
    td = lib.TensorDict(a=torch.zeros(3), s=lib.NonTensorStack("x", "x", "x"), batch_size=[3])
    td[torch.tensor([0, 2])] = lib.TensorDict(
        a=torch.ones(2), s=lib.NonTensorStack("p", "q"), new=lib.NonTensorStack("m", "n"), batch_size=[2])
    assert td["a"].tolist() == [1.0, 0.0, 1.0]
    assert [td[i]["s"] for i in range(3)] == ["p", "x", "q"]
    assert [td[i]["new"] for i in range(3)] == ["m", None, "n"]


@contextlib.contextmanager
def _file_size_limit(nbytes):
    """Files (and memfds) may not grow past ``nbytes`` in this block: a full disk or
    memory. SIGXFSZ ignored, so that the write fails with EFBIG."""
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, old_limit[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)


@pytest.mark.parametrize("mode", ["memmap", "memmap-shared", "shared"])
def test_a_full_disk_or_memory_fails_before_any_tensor_is_written(mode, tmp_path):
    """The stack's store (meta.json ~ 64 x 200 bytes, or its shared cell, which puts
    the new values beside the live ones) cannot grow past 8 KiB: it fails, with the
    tensors before and after it unwritten and the stack's values in memory those of
    its files."""
    texts = [f"{i:03d}" + "x" * 200 for i in range(64)]  # (distinct: pickle would share one)
    td = _buffer("shared" if mode == "shared" else "memmap", tmp_path, n=64, texts=texts,
                 share_non_tensor=mode == "memmap-shared")
    src = shared_td.TensorDict(a=torch.ones(2), s=shared_td.NonTensorStack("new1", "new2"), z=torch.ones(2),
                               batch_size=[2])
    with pytest.raises(StorageFullError), _file_size_limit(8192):
        td[torch.tensor([1, 2])] = src
    _assert_unchanged(td, "shared" if mode == "shared" else "memmap", tmp_path, n=64, texts=texts)


def test_the_files_are_put_back_when_the_shared_cell_refuses_the_values(tmp_path, monkeypatch):
    """memmap_(share_non_tensor=True): the files are rewritten first; should the cell
    then fail (a full memory), they get the old values back."""
    td = _buffer("memmap", tmp_path, share_non_tensor=True)
    cell = td.get("s")._shared_value

    def full(value):
        raise StorageFullError("no memory left for a shared non-tensor value")

    monkeypatch.setattr(cell, "set", full)
    with pytest.raises(StorageFullError):
        td[torch.tensor([1, 2])] = shared_td.TensorDict(
            a=torch.ones(2), s=shared_td.NonTensorStack("new1", "new2"), z=torch.ones(2), batch_size=[2])
    _assert_unchanged(td, "memmap", tmp_path)


@pytest.mark.parametrize("mode", ["shared", "memmap"])
def test_a_storable_value_is_written_everywhere(mode, tmp_path):
    """(the plan-time check lets picklable non-JSON values through: a set, a tuple of floats)"""
    td = _buffer(mode, tmp_path)
    td[torch.tensor([1, 2])] = shared_td.TensorDict(
        a=torch.ones(2), s=shared_td.NonTensorStack({1, 2}, (0.5, float("nan"))), z=torch.ones(2), batch_size=[2])
    td.update_({"t": frozenset({3})})
    assert td["a"].tolist() == [0.0, 1.0, 1.0, 0.0] and td["z"].tolist() == [0.0, 1.0, 1.0, 0.0]
    assert td[1]["s"] == {1, 2} and td["t"] == frozenset({3})
    if mode == "memmap":
        back = shared_td.TensorDict.load_memmap(tmp_path, allow_pickle=True)
        assert back[1]["s"] == {1, 2} and back["t"] == frozenset({3}) and back["a"].tolist() == [0.0, 1.0, 1.0, 0.0]


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("index", [slice(None), Ellipsis, None, (slice(None), slice(None))],
                         ids=[":", "...", "None", "(:, :)"])
def test_one_value_written_over_every_element_of_an_entry_in_memory_makes_it_a_stack(lib, index):
    """As tensordict 0.15.3 (an entry shared or memory-mapped cannot become a stack: the
    value is written there, README)."""
    td = lib.TensorDict(a=torch.zeros(4, 3), batch_size=[4, 3])
    td.set_non_tensor("text", "old")
    value = td[index].apply(lambda x: torch.full_like(x, -1))
    value.set_non_tensor("text", "new")
    td[index] = value
    assert type(td.get("text")).__name__ == "NonTensorStack"
    assert td[0, 0]["text"] == "new" and td[3, 2]["text"] == "new"
