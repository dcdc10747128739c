"""Archive writes against other processes and refusals: memmap("x.tdz") returns what
this call wrote (never a later writer's tree, whose pickles it would trust), existsok=False
holds under the writer lock, a full disk names the bytes the archive needs, and a name
zip cannot hold is refused, naming its key, before anything is written.
"""
from __future__ import annotations

import json
import multiprocessing
import os
import re
import resource
import signal
import traceback

import pytest
import torch

from tests.persist import archive_children as kids
from tests.persist.atomic_children import build, report
from tests.processes import finish

import shared_td
from shared_td import NonTensorData, TensorDict, load_memmap
from shared_td.errors import StorageFullError
from shared_td.persist import api, archive_write

pytestmark = pytest.mark.timeout(120)
FORK = multiprocessing.get_context("fork")
RACE_WAIT = 3  # seconds the racing writer is given; it finishes in well under one unless locked out


# the forked writer undoes the test's monkeypatching, which it inherits
_UNPATCHED = {(api, "load_written_archive"): api.load_written_archive, (archive_write, "write_archive"): archive_write.write_archive}


def _save_other(path, existsok) -> None:
    """Another writer: a=2.0 and a value only a pickle holds (a set)."""
    torch.set_num_threads(1)
    for (module, name), value in _UNPATCHED.items():
        setattr(module, name, value)
    TensorDict(a=torch.full((3,), 2.0), evil=NonTensorData({1, 2})).memmap(path, existsok=existsok)


def _race(path, existsok=True):
    """Start the other writer and give it RACE_WAIT seconds; the process, to finish later."""
    child = FORK.Process(target=_save_other, args=(str(path), existsok))
    child.start()
    child.join(RACE_WAIT)
    return child


def test_memmap_to_an_archive_returns_what_this_call_wrote(tmp_path, monkeypatch):
    """Another process saves while this call loads its result: it waits for the lock,
    and this call returns its own tree (not the other's, nor its pickles)."""
    path, raced = tmp_path / "x.tdz", []
    load = api.load_written_archive

    def load_while_another_saves(*args, **kwargs):
        raced.append(_race(path))
        return load(*args, **kwargs)

    monkeypatch.setattr(api, "load_written_archive", load_while_another_saves)
    out = TensorDict(a=torch.full((3,), 1.0)).memmap(path)
    assert sorted(out.keys()) == ["a"] and out["a"].tolist() == [1.0] * 3
    assert finish(raced[0]) == 0  # then it saved, after this call let go of the lock
    assert load_memmap(path, allow_pickle=True)["a"].tolist() == [2.0] * 3


def test_existsok_false_is_checked_again_under_the_lock(tmp_path, monkeypatch):
    """Another process saves between the early check and the lock: refused, its archive kept."""
    path, raced = tmp_path / "x.tdz", []
    write = archive_write.write_archive

    def write_after_another_saved(*args, **kwargs):
        raced.append(_race(path, existsok=False))
        assert finish(raced[0]) == 0
        return write(*args, **kwargs)

    monkeypatch.setattr(archive_write, "write_archive", write_after_another_saved)
    with pytest.raises(RuntimeError, match=f"A file already exists at {re.escape(str(path))}.*existsok=True"):
        TensorDict(a=torch.full((3,), 1.0)).memmap(path, existsok=False)
    assert load_memmap(path, allow_pickle=True)["a"].tolist() == [2.0] * 3
    assert sorted(os.listdir(tmp_path)) == [".x.tdz.lock", "x.tdz"]


# ------------------------------------------------------------------ a full disk
def _pack_under_file_size_limit(prefix, archive, limit, out) -> None:
    torch.set_num_threads(1)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
    try:
        shared_td.pack_memmap(prefix, archive)
    except BaseException as error:
        report(out, error=type(error).__name__, text=str(error), trace=traceback.format_exc())
        return
    report(out, error=None, text="")


def _reserved(text: str) -> int:
    return int(re.search(r"Could not reserve (\d+) bytes", text)[1])


@pytest.mark.parametrize("how", ["save", "pack"])
def test_a_full_disk_names_the_bytes_the_archive_needs(tmp_path, how):
    """RLIMIT_FSIZE of 2 MiB against four 1 MiB leaves: the error names all their bytes
    (it named the 224 written before the first payload)."""
    source, path, out = tmp_path / "src", tmp_path / "big.tdz", tmp_path / "out.json"
    build(1, 4).memmap(source)
    members = sum(os.path.getsize(os.path.join(d, f)) for d, _, names in os.walk(source) for f in names)
    if how == "save":
        args, target = (str(path), 2, 4, 2 << 20, str(out)), kids.save_under_file_size_limit
    else:
        args, target = (str(source), str(path), 2 << 20, str(out)), _pack_under_file_size_limit
    child = FORK.Process(target=target, args=args)
    child.start()
    assert finish(child) == 0
    result = json.loads(out.read_text())
    assert result["error"] == StorageFullError.__name__, result
    assert _reserved(result["text"]) == members, result["text"]  # the same tree, the same files
    assert f"for the archive {path}" in result["text"]
    assert sorted(os.listdir(tmp_path)) == [".big.tdz.lock", "out.json", "src"]


# ------------------------------------------------------------------ names zip cannot hold
@pytest.mark.parametrize("key", ["\udcff", ("nested", "b\udc80d")])
def test_a_key_utf8_cannot_encode_is_refused_naming_it_before_anything_is_written(tmp_path, key):
    td = TensorDict({"ok": torch.ones(2)}, batch_size=[2])
    td[key] = torch.ones(2)
    with pytest.raises(ValueError, match="lone surrogate") as raised:
        td.memmap(tmp_path / "x.tdz")
    assert f"The key {key!r} cannot be saved in an archive" in str(raised.value)
    assert os.listdir(tmp_path) == []  # not even a lock file
    td.memmap(tmp_path / "x")  # a directory save holds it (a file name is bytes)
    assert load_memmap(tmp_path / "x")[key].tolist() == [1.0, 1.0]
