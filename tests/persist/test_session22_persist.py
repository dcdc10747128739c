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


def _aside(directory, leaf, pid, n=0, *, committed=False) -> str:
    """The name writer ``pid`` gives the file ``leaf`` of ``directory`` it sets aside (its
    ``n``-th), with the inode of the node's meta.json then: the present one (nothing
    committed since), or another (``committed``)."""
    ino = os.stat(os.path.join(directory, "meta.json")).st_ino
    return f".{leaf}.viewed-{pid}-{n}-{ino + 1 if committed else ino}"


def _found(directory, leaf, pid) -> str:
    """The path of the one file writer ``pid`` set aside for ``leaf`` in ``directory``."""
    [name] = [n for n in os.listdir(directory) if n.startswith(f".{leaf}.viewed-{pid}-")]
    return os.path.join(directory, name)


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
    aside = _found(prefix, "a.memmap", pid)
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
    aside = prefix / _aside(prefix, "a.memmap", pid)
    (prefix / "a.memmap").rename(aside)
    staged = prefix / f"meta.json.{pid}.7.tmp"  # (its commit never happened)
    staged.write_bytes(b"{}")
    gone = [str(aside), str(staged)]
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
    aside = prefix / "nested" / _aside(prefix / "nested", "b.memmap", pid, 3, committed=committed)
    aside.write_bytes(b"old bytes")
    staged = prefix / "nested" / f"meta.json.{pid}.1.tmp"
    if not committed:
        staged.write_bytes(b"{}")
    if not own_file:
        (prefix / "nested" / "b.memmap").unlink()
    if committed and not own_file:  # no name to put it back as: the only copy of bytes there, left
        with pytest.raises(OSError, match="is missing although meta.json changed") as caught:
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
    td = TensorDict({f".a.memmap.viewed-{pid}-0-5": torch.ones(2),
                     f".c.memmap.viewed-{pid}-1-5": TensorDict(x=torch.zeros(1))})
    td.memmap_(prefix)
    (prefix / f".b.memmap.viewed-{pid}-0").write_bytes(b"")  # no meta.json inode in it
    (prefix / f"b.memmap.viewed-{pid}-0-5").write_bytes(b"")  # not hidden
    (prefix / f".b.memmap.viewed-{pid}-01-5").write_bytes(b"")  # not a number we write
    (prefix / f".b.json.viewed-{pid}-0-5").write_bytes(b"")  # not a leaf file
    before = sorted(os.listdir(prefix))
    assert shared_td.gc(str(prefix)) == []
    assert sorted(os.listdir(prefix)) == before
    loaded = TensorDict.load_memmap(prefix)
    assert loaded[f".a.memmap.viewed-{pid}-0-5"].tolist() == [1.0, 1.0]
    assert leftovers.find_stale_temporaries(str(prefix)) == []


def test_set_aside_names_parse_whole_names_only():
    from shared_td.persist.set_aside import parse_set_aside_name

    assert parse_set_aside_name(".a.memmap.viewed-42-0-0") == ("a.memmap", 42, 0)
    assert parse_set_aside_name(".x.y.shape.memmap.viewed-42-17-99") == ("x.y.shape.memmap", 42, 99)
    for look_alike in [".a.memmap.viewed-42-0-1.memmap", "a.memmap.viewed-42-0-1", ".a.memmap.viewed-042-0-1",
                       ".a.memmap.viewed-42--1", ".a.viewed-42-0-1", "..memmap.viewed-42-0-1x",
                       ".a.memmap.viewed-0-0-1", ".a.memmap.viewed-42-0", ".a.memmap.viewed-42-0-01",
                       ".a.memmap.viewed-42-0-"]:
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
    asides = {_found(prefix, "a.memmap", pid), _found(prefix, "b.memmap", pid)}
    assert any(n.startswith(f"meta.json.{pid}.") for n in names) == (killed != "committed")
    removed = shared_td.gc(prefix)
    assert set(removed) >= asides
    assert sorted(os.listdir(prefix)) == ["a.memmap", "b.memmap", "meta.json"]
    loaded = {k: v.tolist() for k, v in TensorDict.load_memmap(prefix).items()}
    if killed == "committed":  # the view's save, whole
        assert loaded == {"a": [1.0, 2.0], "b": [10.0, 20.0]}
    else:  # the parent's, as before the write
        assert loaded == {"a": [0.0, 1.0, 2.0, 3.0], "b": [0.0, 10.0, 20.0, 30.0]}


def _two_writers_files(prefix, pids):
    os.rename(os.path.join(prefix, "a.memmap"), os.path.join(prefix, _aside(prefix, "a.memmap", pids[0])))
    with open(os.path.join(prefix, _aside(prefix, "a.memmap", pids[1])), "wb") as f:
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
    own, first = os.path.join(prefix, "a.memmap"), os.path.join(prefix, _aside(prefix, "a.memmap", pid))
    os.rename(own, first)
    {"directory": os.mkdir, "fifo": os.mkfifo, "symlink": lambda p: os.symlink(first, p)}[what](own)
    for committed in (True, False):  # removed (committed) or put back (not): neither
        aside = os.path.join(prefix, _aside(prefix, "a.memmap", pid, committed=committed))
        os.rename(first, aside)
        first = aside
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
    aside = os.path.join(prefix, _aside(prefix, "a.memmap", pid))
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
        with pytest.raises(TimeoutError, match="running writer holds") as caught:
            shared_td.gc(prefix, dry_run=True)  # (as gc says it: skipped)
        assert caught.value.removed == []
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
        shutil.copyfile(_found(prefix, "a.memmap", os.getpid()), os.path.join(prefix, name))
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
    for name in (f".a.memmap.viewed-{pid}-0-1", f"meta.json.{pid}.1.tmp"):
        (tmp_path / "notes" / name).write_bytes(b"mine")
    before = sorted(os.listdir(tmp_path / "notes"))
    code, document = run_json("gc", tmp_path)
    assert code == 0 and document["removed"] == [] and document["failed"] == []
    assert sorted(os.listdir(tmp_path / "notes")) == before


# ------------------------- round c: put back only over the meta.json it was set aside from
def _killed_before_its_commit(ready, prefix):
    from shared_td.storage import files
    files.pwrite_all = _block(ready)  # a.memmap set aside, the new one made, no byte in it
    TensorDict.load_memmap(prefix)[1:3].memmap_(prefix)


@pytest.mark.parametrize("length", [4, 6])
def test_gc_never_puts_a_dead_writers_file_back_over_a_later_save(tmp_path, length):
    # before: A's staged meta.json temporary said "never committed": gc put A's old bytes
    # back over the a.memmap of B's later save (stale data, or a file too short to load)
    prefix = str(tmp_path / "t")
    TensorDict(a=torch.arange(4.0), batch_size=[4]).memmap_(prefix)
    pid = _killed_in(_killed_before_its_commit, prefix)
    aside = _found(prefix, "a.memmap", pid)
    TensorDict(a=torch.full((length,), 7.0), batch_size=[length]).memmap_(prefix)  # B, committed
    staged = [os.path.join(prefix, n) for n in sorted(os.listdir(prefix)) if n.startswith(f"meta.json.{pid}.")]
    assert shared_td.gc(prefix, dry_run=True) == [aside, *staged]
    assert shared_td.gc(prefix) == [aside, *staged]
    assert TensorDict.load_memmap(prefix)["a"].tolist() == [7.0] * length
    assert sorted(os.listdir(prefix)) == ["a.memmap", "meta.json"]


def test_a_free_lock_is_a_dead_writer_whatever_its_pid(tmp_path):
    # before: its pid reused by a live process, gc and its dry run said nothing at all
    # while the save did not load (the new, empty a.memmap under the old meta.json)
    prefix = str(tmp_path / "t")
    TensorDict(a=torch.arange(4.0), batch_size=[4]).memmap_(prefix)
    pid, live = _killed_in(_killed_before_its_commit, prefix), os.getppid()
    for name in os.listdir(prefix):
        if str(pid) in name:
            os.rename(os.path.join(prefix, name), os.path.join(prefix, name.replace(str(pid), str(live))))
    found = shared_td.gc(prefix, dry_run=True)
    assert len(found) == 2 and shared_td.gc(prefix) == found
    assert TensorDict.load_memmap(prefix)["a"].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_a_dry_run_says_what_gc_would_leave(tmp_path):
    # before: the dry run listed nothing and exited 0; gc then failed on those files
    prefix = str(tmp_path / "t")
    TensorDict(a=torch.arange(4.0), batch_size=[4]).memmap_(prefix)
    _two_writers_files(prefix, (900000, 1000000))
    with pytest.raises(OSError, match="each set a file aside for a.memmap") as caught:
        shared_td.gc(prefix, dry_run=True)
    assert caught.value.removed == []
    code, document = run_json("gc", "--dry-run", tmp_path)
    assert code == 1 and [f["prefix"] for f in document["failed"]] == [prefix]


def _nested_view_blocked(ready, prefix, stop):
    from shared_td.persist import writer
    from shared_td.storage import files
    module, name = (files, "pwrite_all") if stop == "leaf" else (writer, "put_node_in_place")
    real, calls = getattr(module, name), []

    def second_blocks(*args, **kwargs):  # the 2nd leaf's bytes, or the root's commit (sub's done)
        calls.append(1)
        if len(calls) == 2:
            _block(ready)()
        return real(*args, **kwargs)

    setattr(module, name, second_blocks)
    TensorDict.load_memmap(prefix)[1:3].memmap_(prefix)


@pytest.mark.parametrize("stop", ["leaf", "between commits"])
def test_a_tree_half_committed_is_left_whole(tmp_path, stop):
    # before: killed between sub's commit and the root's, gc removed sub's set-aside file
    # and put the root's back: neither version of the tree was left whole
    prefix = str(tmp_path / "t")
    sub = TensorDict(b=torch.arange(4.0) * 10, batch_size=[4])
    TensorDict(a=torch.arange(4.0), sub=sub, batch_size=[4]).memmap_(prefix)
    pid = _killed_in(_nested_view_blocked, prefix, stop)
    before = {d: sorted(os.listdir(d)) for d in (prefix, os.path.join(prefix, "sub"))}
    if stop == "leaf":  # nothing committed: both go back, the old tree whole
        assert len(shared_td.gc(prefix)) == 4
        loaded = TensorDict.load_memmap(prefix)
        assert loaded["a"].tolist() == [0.0, 1.0, 2.0, 3.0] and loaded["sub", "b"].tolist()[-1] == 30.0
        return
    for gc in (lambda: shared_td.gc(prefix, dry_run=True), lambda: shared_td.gc(prefix),
               lambda: shared_td.gc(os.path.join(prefix, "sub"))):  # (a gc of sub alone looks above)
        with pytest.raises(OSError, match=f"half-committed tree: writer pid {pid}") as caught:
            gc()
        assert caught.value.removed == []
        assert {d: sorted(n for n in os.listdir(d) if n != ".sub.lock") for d in before} == before  # (gc's lock)


# ------------------------------------------- the writer's lock: scoped, shared, not forked
def test_an_ordinary_write_holds_no_lock_others_wait_for(tmp_path, monkeypatch):
    # before: a memmap_ into an existing save held its root's flock for the whole write:
    # another writer, or make_memmap, waited NODE_LOCK_S then TimeoutError "stalled"
    import threading
    from shared_td.persist import node_rewrite
    from shared_td.storage import files
    monkeypatch.setattr(node_rewrite, "NODE_LOCK_S", 0.3)
    prefix = str(tmp_path / "t")
    saved = TensorDict(a=torch.arange(4.0), batch_size=[4]).memmap_(prefix)
    real, started, go = files.pwrite_all, threading.Event(), threading.Event()

    def slow(*args, **kwargs):
        if threading.current_thread() is not threading.main_thread():
            started.set()
            assert go.wait(10)
        return real(*args, **kwargs)

    monkeypatch.setattr(files, "pwrite_all", slow)
    failures = []
    thread = threading.Thread(target=lambda: _record(failures, TensorDict(a=torch.ones(4), batch_size=[4]).memmap_,
                                                     prefix))
    thread.start()
    try:
        assert started.wait(10)
        saved.make_memmap("new", shape=[4])  # (no wait)
        TensorDict(a=torch.full((4,), 2.0), batch_size=[4]).memmap_(prefix)  # last writer wins, no wait
    finally:
        go.set()
        thread.join(10)
    assert failures == []


def _record(failures, call, *args):
    try:
        call(*args)
    except Exception as error:  # noqa: BLE001 (the test's assertion shows it)
        failures.append(error)


def _wait_for(running, stop):
    running.set()  # (its fork hooks have run)
    stop.wait(10)


def test_a_worker_forked_during_a_write_does_not_hold_its_lock(tmp_path, monkeypatch):
    # before: the child held the root directory's descriptor, so its flock, for its life:
    # gc called the save busy, other writers waited then failed, long after the write
    import threading
    import warnings
    from shared_td.persist import set_aside
    from shared_td.storage import files
    prefix = str(tmp_path / "t")
    TensorDict(a=torch.arange(4.0), batch_size=[4]).memmap_(prefix)
    real, started, go = files.pwrite_all, threading.Event(), threading.Event()

    def slow(*args, **kwargs):
        started.set()
        assert go.wait(10)
        return real(*args, **kwargs)

    monkeypatch.setattr(files, "pwrite_all", slow)
    failures = []
    thread = threading.Thread(target=lambda: _record(failures, TensorDict.load_memmap(prefix)[1:3].memmap_, prefix))
    thread.start()
    worker, running, stop = None, FORK.Event(), FORK.Event()
    try:
        assert started.wait(10)
        with set_aside.locked_chain(prefix, prefix) as free:
            assert not free  # the writer's, while a file is set aside
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # (fork with a thread running: the point)
            worker = FORK.Process(target=_wait_for, args=(running, stop))
            worker.start()
        assert running.wait(10)
        go.set()
        thread.join(10)
        assert failures == [] and worker.is_alive()
        with set_aside.locked_chain(prefix, prefix) as free:
            assert free
    finally:
        go.set()
        stop.set()
        if worker is not None:
            worker.join(10)
    assert TensorDict.load_memmap(prefix)["a"].tolist() == [1.0, 2.0]
