"""Session 22: what killed writers leave (a leaf file set aside, a shared value's files),
and a lazy stack's lost members found by verify."""
from __future__ import annotations

import errno
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
    # never committed (its meta.json staged still): the old file goes back over the new
    # one, which the old meta.json does not describe (it was removed: the save lost it)
    assert TensorDict.load_memmap(prefix)["a"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert shared_td.gc(prefix) == []


def test_shared_td_gc_cli_puts_back_a_set_aside_leaf_file(tmp_path):
    prefix = tmp_path / "data" / "t"
    TensorDict(a=torch.arange(4.0), batch_size=[4]).memmap_(prefix)  # (no lock file beside it)
    pid = dead_pid()
    (prefix / "a.memmap").rename(prefix / f".a.memmap.viewed-{pid}-0")
    staged = prefix / f"meta.json.{pid}.7.tmp"  # (its commit never happened)
    staged.write_bytes(b"{}")
    gone = [str(prefix / f".a.memmap.viewed-{pid}-0"), str(staged)]
    code, document = run_json("gc", "--dry-run", tmp_path)
    assert code == 0 and document["removed"] == gone
    assert not (prefix / "a.memmap").exists()
    code, document = run_json("gc", tmp_path)
    assert code == 0 and document["removed"] == gone
    assert TensorDict.load_memmap(prefix)["a"].tolist() == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.parametrize("committed", [True, False])
@pytest.mark.parametrize("own_file", [True, False])
def test_name_only_set_aside_leftover(tmp_path, own_file, committed):
    prefix = tmp_path / "t"
    TensorDict(a=torch.arange(4.0), nested=TensorDict(b=torch.ones(2)), batch_size=[]).memmap_(prefix)
    pid = dead_pid()
    aside = prefix / "nested" / f".b.memmap.viewed-{pid}-3"
    aside.write_bytes(b"old bytes")
    staged = prefix / "nested" / f"meta.json.{pid}.1.tmp"
    if not committed:
        staged.write_bytes(b"{}")
    if not own_file:
        (prefix / "nested" / "b.memmap").unlink()
    if committed and not own_file:  # no name to put it back as: the only copy of bytes there, left
        with pytest.raises(OSError, match="is missing although the writer committed") as caught:
            shared_td.gc(str(prefix))
        assert caught.value.removed == [] and aside.read_bytes() == b"old bytes"
        return
    assert shared_td.gc(str(prefix)) == [str(aside)] + ([] if committed else [str(staged)])
    assert not aside.exists() and not staged.exists()
    assert (prefix / "nested" / "b.memmap").read_bytes() == (
        torch.ones(2).numpy().tobytes() if committed else b"old bytes")


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


# ----------------------------------- gc of set-aside files: decided per node directory
def _second_leaf_set_aside(ready, prefix):
    from shared_td.storage import files
    real, calls = files.reserve_file, []

    def reserve(*args, **kwargs):  # the 2nd: a.memmap rewritten, b.memmap set aside, no new b
        calls.append(1)
        if len(calls) == 2:
            _block(ready)()
        return real(*args, **kwargs)

    files.reserve_file = reserve
    TensorDict.load_memmap(prefix)[1:3].memmap_(prefix)


def _committed_then_blocked(ready, prefix):
    from shared_td.persist import writer
    real = writer.put_node_in_place

    def committed(*args, **kwargs):  # meta.json renamed into place; the old files not yet removed
        real(*args, **kwargs)
        _block(ready)()

    writer.put_node_in_place = committed
    TensorDict.load_memmap(prefix)[1:3].memmap_(prefix)


@pytest.mark.parametrize("killed", ["second leaf set aside", "committed"])
def test_gc_after_a_real_kill_loads_the_save(tmp_path, killed):
    # before: gc removed a.memmap's set-aside file (the only copy of what the uncommitted
    # meta.json describes) while it put b's back: the save no longer loaded
    prefix = str(tmp_path / "t")
    TensorDict(a=torch.arange(4.0), b=torch.arange(4.0) * 10, batch_size=[4]).memmap_(prefix)
    pid = _killed_in(_second_leaf_set_aside if killed != "committed" else _committed_then_blocked, prefix)
    names = sorted(os.listdir(prefix))
    assert f".a.memmap.viewed-{pid}-0" in names and f".b.memmap.viewed-{pid}-1" in names
    assert any(n.startswith(f"meta.json.{pid}.") for n in names) == (killed != "committed")
    removed = shared_td.gc(prefix)
    assert {os.path.basename(p) for p in removed} >= {f".a.memmap.viewed-{pid}-0", f".b.memmap.viewed-{pid}-1"}
    assert sorted(os.listdir(prefix)) == ["a.memmap", "b.memmap", "meta.json"]
    loaded = {k: v.tolist() for k, v in TensorDict.load_memmap(prefix).items()}
    if killed == "committed":  # the view's save, whole
        assert loaded == {"a": [1.0, 2.0], "b": [10.0, 20.0]}
    else:  # the parent's, as before the write
        assert loaded == {"a": [0.0, 1.0, 2.0, 3.0], "b": [0.0, 10.0, 20.0, 30.0]}


def _two_writers_files(prefix, pids):
    os.rename(os.path.join(prefix, "a.memmap"), os.path.join(prefix, f".a.memmap.viewed-{pids[0]}-0"))
    with open(os.path.join(prefix, f".a.memmap.viewed-{pids[1]}-0"), "wb") as f:
        f.write(b"\xff" * 16)
    for pid in pids:
        with open(os.path.join(prefix, f"meta.json.{pid}.1.tmp"), "wb") as f:
            f.write(b"{}")


def test_two_dead_writers_files_for_one_name_are_left_and_reported(tmp_path):
    # before: the first by string order ("1000000" < "900000") went back, the other was removed
    prefix = str(tmp_path / "t")
    TensorDict(a=torch.arange(4.0), batch_size=[4]).memmap_(prefix)
    pids = (900000, 1000000)
    assert not any(shared_td.platform.pid_alive(pid) for pid in pids)
    _two_writers_files(prefix, pids)
    before = sorted(os.listdir(prefix))
    with pytest.raises(OSError, match="each set a file aside for a.memmap") as caught:
        shared_td.gc(prefix)
    assert caught.value.removed == [] and sorted(os.listdir(prefix)) == before
    code, document = run_json("gc", tmp_path)
    assert code == 1 and document["removed"] == []
    assert [f["prefix"] for f in document["failed"]] == [prefix]
    assert sorted(os.listdir(prefix)) == before


@pytest.mark.parametrize("what", ["directory", "fifo", "symlink"])
def test_a_set_aside_file_is_never_dropped_while_its_name_is_no_regular_file(tmp_path, what):
    prefix = str(tmp_path / "t")
    TensorDict(a=torch.arange(4.0), batch_size=[4]).memmap_(prefix)
    pid = dead_pid()
    own, aside = os.path.join(prefix, "a.memmap"), os.path.join(prefix, f".a.memmap.viewed-{pid}-0")
    os.rename(own, aside)
    {"directory": os.mkdir, "fifo": os.mkfifo, "symlink": lambda p: os.symlink(aside, p)}[what](own)
    for committed in (True, False):  # removed (committed) or put back (not): neither
        staged = os.path.join(prefix, f"meta.json.{pid}.1.tmp")
        if not committed:
            with open(staged, "wb") as f:
                f.write(b"{}")
        with pytest.raises(OSError, match="is not a regular file"):
            shared_td.gc(prefix)
        assert os.path.isfile(aside) and os.path.lexists(own)
        assert os.path.exists(staged) == (not committed)


def test_no_hard_links_leaves_the_file_and_says_how(tmp_path, monkeypatch):
    prefix = str(tmp_path / "t")
    TensorDict(a=torch.arange(4.0), batch_size=[4]).memmap_(prefix)
    pid = dead_pid()
    aside = os.path.join(prefix, f".a.memmap.viewed-{pid}-0")
    os.rename(os.path.join(prefix, "a.memmap"), aside)
    with open(os.path.join(prefix, f"meta.json.{pid}.1.tmp"), "wb") as f:
        f.write(b"{}")

    def no_link(*args, **kwargs):
        raise OSError(errno.EPERM, "no hard links")

    monkeypatch.setattr(os, "link", no_link)
    with pytest.raises(OSError, match="mv -n"):
        shared_td.gc(prefix)
    assert os.path.isfile(aside) and not os.path.lexists(os.path.join(prefix, "a.memmap"))


# ------------------------------------- a live writer (another pid namespace) left alone
def _live_writer(ready, go, prefix):
    from shared_td.storage import files
    real = files.reserve_file

    def reserve(*args, **kwargs):  # a.memmap set aside, the new file not made yet
        ready.set()
        assert go.wait(30)
        return real(*args, **kwargs)

    files.reserve_file = reserve
    TensorDict.load_memmap(prefix)[1:3].memmap_(prefix)


def test_gc_leaves_a_live_writer_whose_pid_looks_dead(tmp_path, monkeypatch):
    # before: its pid dead here (another pid namespace), gc put the old file back and
    # dropped its staged meta.json; the writer then wrote the view's bytes into the
    # parent's own file (this process's mapping changed) and failed at its commit
    prefix = str(tmp_path / "t")
    mine = TensorDict(a=torch.arange(4.0), batch_size=[4]).memmap_(prefix)
    ready, go = FORK.Event(), FORK.Event()
    writer = FORK.Process(target=_live_writer, args=(ready, go, prefix))
    writer.start()
    try:
        assert ready.wait(30)
        from shared_td.persist import set_aside
        monkeypatch.setattr(set_aside, "pid_alive", lambda pid: False)  # as seen from another namespace
        before = sorted(os.listdir(prefix))
        assert any(".viewed-" in n for n in before) and "a.memmap" not in before
        assert shared_td.gc(prefix, dry_run=True) == []
        with pytest.raises(TimeoutError, match="running writer holds") as caught:
            shared_td.gc(prefix)
        assert caught.value.removed == [] and sorted(os.listdir(prefix)) == before
        code, document = run_json("gc", tmp_path)
        assert code == 0 and document["removed"] == [] and document["skipped"] == [prefix]
    finally:
        go.set()
        writer.join(30)
    assert writer.exitcode == 0
    assert mine["a"].tolist() == [0.0, 1.0, 2.0, 3.0]  # the parent's bytes kept
    assert TensorDict.load_memmap(prefix)["a"].tolist() == [1.0, 2.0]
    assert sorted(os.listdir(prefix)) == ["a.memmap", "meta.json"]


def test_a_file_reappearing_after_the_set_aside_is_not_written_into(tmp_path, monkeypatch):
    prefix = str(tmp_path / "t")
    mine = TensorDict(a=torch.arange(4.0), batch_size=[4]).memmap_(prefix)
    from shared_td.storage import files
    real = files.reserve_file

    def reappearing(directory, name, **kwargs):  # (as gc put a copy back once)
        shutil.copyfile(os.path.join(prefix, f".a.memmap.viewed-{os.getpid()}-0"), os.path.join(prefix, name))
        return real(directory, name, **kwargs)

    monkeypatch.setattr(files, "reserve_file", reappearing)
    with pytest.raises(RuntimeError, match="already exists"):
        TensorDict.load_memmap(prefix)[1:3].memmap_(prefix)
    monkeypatch.undo()
    assert mine["a"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert TensorDict.load_memmap(prefix)["a"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert sorted(os.listdir(prefix)) == ["a.memmap", "meta.json"]


# ------------------------------------------------- member names of unbounded length
def test_a_member_name_of_thousands_of_digits_in_an_archive(tmp_path):
    # before: int() of the 5000-digit name, a raw ValueError (Python's 4300-digit limit)
    prefix, archive, bad = str(tmp_path / "l"), str(tmp_path / "l.tdz"), str(tmp_path / "bad.tdz")
    _stack_of_4(prefix, "shared_td", False)
    shared_td.pack_memmap(prefix, archive)
    with zipfile.ZipFile(archive) as source, zipfile.ZipFile(bad, "w") as target:
        for info in source.infolist():  # member 1 lost
            if info.filename.split("/")[0] != "1":
                target.writestr(info, source.read(info))
        target.writestr("9" * 5000 + "/", b"")
    with pytest.raises(FormatError, match="member 1 of"):
        shared_td.LazyStackedTensorDict.load_memmap(bad)
    code, document = run_json("verify", bad)
    assert code == 1
    assert any("member 1 of" in problem["message"] for problem in document["problems"]), document["problems"]


def test_verify_of_a_node_it_cannot_list_still_looks_at_the_next_member(tmp_path, monkeypatch):
    # before: a node that could not be listed had no names at all: member 1 lost, member 2
    # there, verify saw a stack of 1 (no error) where the loader refuses it
    prefix = str(tmp_path / "l")
    _stack_of_4(prefix, "shared_td", False)
    shutil.rmtree(os.path.join(prefix, "1"))
    listdir = os.listdir

    def unlistable(path=".", *args):  # (root reads every directory: EACCES modelled)
        if isinstance(path, int):
            raise PermissionError(errno.EACCES, "Permission denied")
        return listdir(path, *args)

    monkeypatch.setattr(os, "listdir", unlistable)
    code, document = run_json("verify", prefix)
    assert code == 1
    assert any("member 1 of" in problem["message"] for problem in document["problems"]), document["problems"]


def test_gc_cli_leaves_look_alike_names_outside_any_save(tmp_path):
    # before: a directory without a meta.json was taken for a save: its files renamed
    pid = dead_pid()
    (tmp_path / "notes").mkdir()
    for name in (f".a.memmap.viewed-{pid}-0", f"meta.json.{pid}.1.tmp"):
        (tmp_path / "notes" / name).write_bytes(b"mine")
    before = sorted(os.listdir(tmp_path / "notes"))
    code, document = run_json("gc", tmp_path)
    assert code == 0 and document["removed"] == [] and document["failed"] == []
    assert sorted(os.listdir(tmp_path / "notes")) == before
