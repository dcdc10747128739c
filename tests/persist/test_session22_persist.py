"""Session 22: what killed writers leave (a leaf file set aside, a shared value's files),
and a lazy stack's lost members found by verify."""
from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import signal
import zipfile
import time

import pytest
import torch

from tests.cli.cli_helpers import dead_pid, run_json

import shared_td
from shared_td import TensorDict
from shared_td.errors import FormatError
from shared_td.persist import leftovers

FORK = multiprocessing.get_context("fork")


def _killed_in(target, *args) -> int:
    """Run ``target(ready, *args)`` in a forked child; once it sets ``ready`` (it then
    blocks), SIGKILL it. Returns its pid (dead and reaped)."""
    ready = FORK.Event()
    child = FORK.Process(target=target, args=(ready, *args))
    child.start()
    try:
        deadline = time.monotonic() + 30
        while not ready.wait(0.05):  # (a child that failed before it got there: at once)
            assert child.is_alive() and time.monotonic() < deadline, \
                f"the child never reached the point it is killed at (exit code {child.exitcode})"
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.join(30)
    assert child.exitcode == -signal.SIGKILL
    return child.pid


def _block(ready):
    def blocked(*args, **kwargs):
        ready.set()
        time.sleep(60)  # killed long before
    return blocked


# ------------------------------------------------------------- a leaf file set aside
def _write_view_into_own_directory(ready, prefix, stop_at):
    from shared_td.storage import files
    # "aside": right after the old a.memmap is renamed aside, before the new one is made;
    # "new file": the new a.memmap made, its bytes not written yet
    setattr(files, "reserve_file" if stop_at == "aside" else "pwrite_all", _block(ready))
    td = TensorDict.load_memmap(prefix)
    td[1:3].memmap_(prefix)


@pytest.mark.parametrize("stop_at", ["aside", "new file"])
def test_leaf_file_set_aside_by_a_killed_writer_is_put_back_or_removed(tmp_path, stop_at):
    prefix = str(tmp_path / "t")
    TensorDict(a=torch.arange(4.0), batch_size=[4]).memmap_(prefix)
    pid = _killed_in(_write_view_into_own_directory, prefix, stop_at)
    aside = os.path.join(prefix, f".a.memmap.viewed-{pid}-0")
    assert os.path.isfile(aside)
    assert os.path.exists(os.path.join(prefix, "a.memmap")) == (stop_at == "new file")

    # (and the meta.json it staged before any leaf, a temporary gc always knew)
    staged = os.path.join(prefix, next(n for n in os.listdir(prefix) if n.startswith(f"meta.json.{pid}.")))
    assert shared_td.gc(prefix, dry_run=True) == [aside, staged]
    assert os.path.isfile(aside)  # a dry run acts on nothing
    assert shared_td.gc(prefix) == [aside, staged]
    assert sorted(os.listdir(prefix)) == ["a.memmap", "meta.json"]
    if stop_at == "aside":  # the only copy of the old bytes: back under its own name
        assert TensorDict.load_memmap(prefix)["a"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert shared_td.gc(prefix) == []


def test_shared_td_gc_cli_puts_back_a_set_aside_leaf_file(tmp_path):
    prefix = tmp_path / "data" / "t"
    TensorDict(a=torch.arange(4.0), batch_size=[4]).memmap_(prefix)  # (no lock file beside it)
    pid = dead_pid()
    (prefix / "a.memmap").rename(prefix / f".a.memmap.viewed-{pid}-0")
    code, document = run_json("gc", "--dry-run", tmp_path)
    assert code == 0 and document["removed"] == [str(prefix / f".a.memmap.viewed-{pid}-0")]
    assert not (prefix / "a.memmap").exists()
    code, document = run_json("gc", tmp_path)
    assert code == 0 and document["removed"] == [str(prefix / f".a.memmap.viewed-{pid}-0")]
    assert TensorDict.load_memmap(prefix)["a"].tolist() == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.parametrize("own_file", [True, False])
def test_name_only_set_aside_leftover(tmp_path, own_file):
    prefix = tmp_path / "t"
    TensorDict(a=torch.arange(4.0), nested=TensorDict(b=torch.ones(2)), batch_size=[]).memmap_(prefix)
    pid = dead_pid()
    aside = prefix / "nested" / f".b.memmap.viewed-{pid}-3"
    aside.write_bytes(b"old bytes")
    if not own_file:
        (prefix / "nested" / "b.memmap").unlink()
    assert shared_td.gc(str(prefix)) == [str(aside)]
    assert not aside.exists()
    assert (prefix / "nested" / "b.memmap").read_bytes() == (
        torch.ones(2).numpy().tobytes() if own_file else b"old bytes")


def test_what_only_looks_like_a_set_aside_file_is_left(tmp_path):
    prefix = tmp_path / "t"
    pid = dead_pid()
    # a user's keys: files end with .memmap, a nested key is a directory
    td = TensorDict({f".a.memmap.viewed-{pid}-0": torch.ones(2),
                     f".c.memmap.viewed-{pid}-1": TensorDict(x=torch.zeros(1))})
    td.memmap_(prefix)
    (prefix / f".b.memmap.viewed-{os.getpid()}-0").write_bytes(b"ours")  # a live writer's (this one)
    (prefix / f"b.memmap.viewed-{pid}-0").write_bytes(b"")  # not hidden
    (prefix / f".b.memmap.viewed-{pid}-01").write_bytes(b"")  # not a number we write
    (prefix / f".b.json.viewed-{pid}-0").write_bytes(b"")  # not a leaf file
    before = sorted(os.listdir(prefix))
    assert shared_td.gc(str(prefix)) == []
    assert sorted(os.listdir(prefix)) == before
    loaded = TensorDict.load_memmap(prefix)
    assert loaded[f".a.memmap.viewed-{pid}-0"].tolist() == [1.0, 1.0]
    assert leftovers.find_stale_temporaries(str(prefix)) == []


def test_set_aside_names_parse_whole_names_only():
    from shared_td.persist.set_aside import parse_set_aside_name

    assert parse_set_aside_name(".a.memmap.viewed-42-0") == ("a.memmap", 42)
    assert parse_set_aside_name(".x.y.shape.memmap.viewed-42-17") == ("x.y.shape.memmap", 42)
    for look_alike in [".a.memmap.viewed-42-0.memmap", "a.memmap.viewed-42-0", ".a.memmap.viewed-042-0",
                       ".a.memmap.viewed-42-", ".a.viewed-42-0", "..memmap.viewed-42-0x", ".a.memmap.viewed-0-0"]:
        assert parse_set_aside_name(look_alike) is None, look_alike


# ------------------------------------------- a shared value's files, then its cell
def _set_shared_value_and_block(ready, td):
    from shared_td.persist import node_rewrite
    real = node_rewrite.rewrite_node

    def rewritten_then_blocked(*args, **kwargs):
        real(*args, **kwargs)  # the files hold the new value; the cell is set next
        _block(ready)()

    node_rewrite.rewrite_node = rewritten_then_blocked
    td.set_("s", "new")


def test_writer_killed_between_a_shared_values_files_and_its_cell(tmp_path):
    """What _store documents: the files are ahead (as a killed tensor write's bytes),
    the cell still holds what every sharing process read, and the next write of the
    entry (the lock of the killed writer gone with it) makes them agree."""
    prefix = str(tmp_path / "p")
    td = TensorDict(s=shared_td.NonTensorData("old"), a=torch.zeros(2)).memmap_(prefix, share_non_tensor=True)
    assert td._tensordict["s"]._shared_value is not None
    _killed_in(_set_shared_value_and_block, td)
    assert td["s"] == "old"  # the cell: what sharing processes read
    assert TensorDict.load_memmap(prefix)["s"] == "new"  # the files: the killed write's value
    assert shared_td.gc(prefix) == []  # the files are whole: nothing left over
    td.set_("s", "next")
    assert td["s"] == "next" and TensorDict.load_memmap(prefix)["s"] == "next"


# ------------------------------------------------- a lazy stack's lost members, verified
def _stack_of_4(prefix, writer, count):
    lib = pytest.importorskip("tensordict") if writer == "tensordict" else shared_td
    lib.LazyStackedTensorDict(*[lib.TensorDict(a=torch.full((2,), float(i)), batch_size=[2])
                                for i in range(4)]).memmap_(prefix)
    if writer == "shared_td" and not count:  # as tensordict (or an older shared_td) saves it
        meta_path = os.path.join(prefix, "meta.json")
        with open(meta_path) as f:
            meta = json.load(f)
        del meta["_shared_td_members"]
        with open(meta_path, "w") as f:
            json.dump(meta, f)


@pytest.mark.parametrize("writer, count", [("shared_td", True), ("shared_td", False), ("tensordict", False)])
@pytest.mark.parametrize("lost", [(2,), (1, 2)])
def test_verify_names_the_first_lost_member_of_a_lazy_stack(tmp_path, writer, count, lost):
    # looking one index ahead, verify passed members 0 and 3 as a stack of 1 (load refused it)
    prefix = str(tmp_path / "l")
    _stack_of_4(prefix, writer, count)
    for index in lost:
        shutil.rmtree(os.path.join(prefix, str(index)))
    code, document = run_json("verify", prefix)
    assert code == 1
    messages = [problem["message"] for problem in document["problems"] if problem["severity"] == "error"]
    assert any(f"member {lost[0]} of" in message and "missing" in message for message in messages), messages
    with pytest.raises(FormatError, match=f"member {lost[0]} of"):
        shared_td.LazyStackedTensorDict.load_memmap(prefix)


def test_verify_names_the_first_lost_member_of_a_lazy_stack_in_an_archive(tmp_path):
    prefix, archive = str(tmp_path / "l"), str(tmp_path / "l.tdz")
    _stack_of_4(prefix, "shared_td", False)
    shared_td.pack_memmap(prefix, archive)
    with zipfile.ZipFile(archive) as source, zipfile.ZipFile(tmp_path / "lost.tdz", "w") as target:
        for info in source.infolist():  # members 1 and 2 lost
            if info.filename.split("/")[0] not in ("1", "2"):
                target.writestr(info, source.read(info))
    code, document = run_json("verify", tmp_path / "lost.tdz")
    assert code == 1
    assert any("member 1 of" in problem["message"] for problem in document["problems"]), document["problems"]
