"""Session 22: what killed writers leave (a view's leaves staged in its parent's own
directory, a shared value's files), and a lazy stack's lost members found by verify."""
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
from shared_td.persist import format as fmt
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


def _temporaries(pid, *directories) -> list[str]:
    """The paths of writer ``pid``'s temporaries in ``directories``, as gc lists them."""
    return [os.path.join(d, n) for d in directories for n in sorted(os.listdir(d))
            if fmt.temporary_writer_pid(n) == pid]


def _parent(prefix):
    return TensorDict(a=torch.arange(4.0), b=torch.arange(4.0) * 10, batch_size=[4]).memmap_(prefix)


PARENT = {"a": [0.0, 1.0, 2.0, 3.0], "b": [0.0, 10.0, 20.0, 30.0]}
VIEW = {"a": [1.0, 2.0], "b": [10.0, 20.0]}


def _loaded(prefix) -> dict:
    return {k: v.tolist() for k, v in TensorDict.load_memmap(prefix).items()}


# ------------------------------------- a view written into its parent's own directory
def _view_blocked(ready, prefix, stop_at):
    from shared_td.persist import writer
    from shared_td.storage import files
    module, name, nth, after = {
        "a staged, empty": (files, "pwrite_all", 1, False),
        "b staging": (files, "reserve_file", 2, False),  # a's new bytes staged, b's file not made
        "before the commit": (writer, "put_node_in_place", 1, False),  # all staged, nothing renamed
        "committed": (writer, "put_node_in_place", 1, True),  # renamed, meta.json too
    }[stop_at]
    real, calls = getattr(module, name), []

    def blocks(*args, **kwargs):
        calls.append(1)
        if len(calls) == nth and not after:
            _block(ready)()
        result = real(*args, **kwargs)
        if len(calls) == nth:
            _block(ready)()
        return result

    setattr(module, name, blocks)
    TensorDict.load_memmap(prefix)[1:3].memmap_(prefix)


@pytest.mark.parametrize("stop_at", ["a staged, empty", "b staging", "before the commit", "committed"])
def test_a_view_writer_killed_leaves_only_temporaries_gc_removes(tmp_path, stop_at):
    # before: the old a.memmap was renamed aside (.a.memmap.viewed-PID-N-INO) and a new
    # a.memmap made at once; gc guessed whether to put it back (three audits of data loss)
    prefix = str(tmp_path / "t")
    _parent(prefix)
    pid = _killed_in(_view_blocked, prefix, stop_at)
    committed = stop_at == "committed"
    staged = _temporaries(pid, prefix)
    assert not any(".viewed-" in n for n in os.listdir(prefix))
    if committed:
        assert staged == []
    else:  # its meta.json temporary (staged before any leaf), and the leaves staged so far
        names = [os.path.basename(p) for p in staged]
        assert any(n.startswith(f"meta.json.{pid}.") for n in names)
        assert any(n.startswith(f".a.memmap.shared_td.{pid}.") for n in names)
        assert any(n.startswith(f".b.memmap.shared_td.{pid}.") for n in names) == (stop_at == "before the commit")
    # the save loads as before the write (or the view's, committed) even before gc
    assert _loaded(prefix) == (VIEW if committed else PARENT)
    assert shared_td.gc(prefix, dry_run=True) == staged
    assert _temporaries(pid, prefix) == staged  # a dry run removes nothing
    assert shared_td.gc(prefix) == staged
    assert sorted(os.listdir(prefix)) == ["a.memmap", "b.memmap", "meta.json"]
    assert _loaded(prefix) == (VIEW if committed else PARENT)
    assert shared_td.gc(prefix) == []


def test_a_nested_view_writer_killed_at_its_second_leaf(tmp_path):
    prefix = str(tmp_path / "t")
    sub = TensorDict(b=torch.arange(4.0) * 10, batch_size=[4])
    TensorDict(a=torch.arange(4.0), sub=sub, batch_size=[4]).memmap_(prefix)
    pid = _killed_in(_view_blocked, prefix, "b staging")  # (sub's b: a's bytes staged in the root)
    staged = _temporaries(pid, prefix, os.path.join(prefix, "sub"))
    assert len(staged) == 3  # the root's a and meta.json, sub's meta.json: b's file not made yet
    assert shared_td.gc(prefix) == staged
    loaded = TensorDict.load_memmap(prefix)
    assert loaded["a"].tolist() == PARENT["a"] and loaded["sub", "b"].tolist() == PARENT["b"]
    assert sorted(os.listdir(os.path.join(prefix, "sub"))) == ["b.memmap", "meta.json"]


@pytest.mark.parametrize("num_threads", [0, 2])
def test_a_view_written_into_its_parents_directory_maps_its_new_files(tmp_path, num_threads):
    from shared_td.storage.mapping import FILE_ATTRIBUTE
    prefix = str(tmp_path / "t")
    width = 1 << 18  # the view's leaf 2 MiB: written by the pool with num_threads=2
    parent = TensorDict(a=torch.arange(4.0 * width).reshape(4, width), b=torch.arange(4.0) * 10,
                        batch_size=[4]).memmap_(prefix)
    old = os.stat(os.path.join(prefix, "a.memmap")).st_ino
    written = parent[1:3].memmap_(prefix, num_threads=num_threads)
    assert sorted(os.listdir(prefix)) == ["a.memmap", "b.memmap", "meta.json"]
    new = os.stat(os.path.join(prefix, "a.memmap")).st_ino
    assert new != old
    for key in ("a", "b"):
        assert written[key].filename == os.path.join(prefix, f"{key}.memmap")
    assert getattr(written["a"].untyped_storage(), FILE_ATTRIBUTE)[5][1] == new  # the file named NAME now
    assert parent["a"][:, 0].tolist() == [0.0, width, 2.0 * width, 3.0 * width]  # its old inode, kept
    assert parent["b"].tolist() == PARENT["b"]
    loaded = TensorDict.load_memmap(prefix)
    assert torch.equal(loaded["a"], written["a"]) and loaded["b"].tolist() == VIEW["b"]
    written["b"][0] = 99.0  # one file: what the result writes, a load reads
    assert TensorDict.load_memmap(prefix)["b"].tolist() == [99.0, 20.0]
    assert parent["b"].tolist() == PARENT["b"]


@pytest.mark.parametrize("failing", [1, 2])
def test_a_failed_view_write_leaves_the_parents_save_as_it_was(tmp_path, monkeypatch, failing):
    from shared_td.storage import files
    prefix = str(tmp_path / "t")
    parent = _parent(prefix)
    real, calls = files.pwrite_all, []

    def full(*args, **kwargs):  # the disk full at the failing-th leaf
        calls.append(1)
        if len(calls) == failing:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(files, "pwrite_all", full)
    with pytest.raises(OSError, match="No space left"):
        parent[1:3].memmap_(prefix)
    monkeypatch.undo()
    assert sorted(os.listdir(prefix)) == ["a.memmap", "b.memmap", "meta.json"]  # the staged files gone
    assert {k: v.tolist() for k, v in parent.items()} == PARENT
    assert _loaded(prefix) == PARENT
    assert shared_td.gc(prefix) == []


def _view_waits(ready, go, prefix):
    from shared_td.persist import writer
    real = writer.put_node_in_place

    def waits(*args, **kwargs):  # everything staged, nothing renamed yet
        ready.set()
        assert go.wait(30)
        return real(*args, **kwargs)

    writer.put_node_in_place = waits
    TensorDict.load_memmap(prefix)[1:3].memmap_(prefix)


def test_gc_leaves_a_live_writers_staged_files(tmp_path):
    prefix = str(tmp_path / "t")
    mine = _parent(prefix)
    ready, go = FORK.Event(), FORK.Event()
    writer = FORK.Process(target=_view_waits, args=(ready, go, prefix))
    writer.start()
    try:
        assert ready.wait(30)
        before = sorted(os.listdir(prefix))
        assert len(_temporaries(writer.pid, prefix)) == 3  # its pid runs: not a leftover
        assert shared_td.gc(prefix, dry_run=True) == [] and shared_td.gc(prefix) == []
        code, document = run_json("gc", tmp_path)
        assert code == 0 and document["removed"] == []
        assert sorted(os.listdir(prefix)) == before
        assert _loaded(prefix) == PARENT
    finally:
        go.set()
        writer.join(30)
    assert writer.exitcode == 0
    assert {k: v.tolist() for k, v in mine.items()} == PARENT  # the parent's bytes kept
    assert _loaded(prefix) == VIEW
    assert sorted(os.listdir(prefix)) == ["a.memmap", "b.memmap", "meta.json"]


def test_a_dead_writers_temporaries_under_a_reused_pid_are_left_harmless(tmp_path):
    # (its pid now a live process's: gc cannot tell, leaves them, and the save loads)
    prefix = str(tmp_path / "t")
    _parent(prefix)
    pid, live = _killed_in(_view_blocked, prefix, "before the commit"), os.getppid()
    for path in _temporaries(pid, prefix):
        os.rename(path, path.replace(f".{pid}.", f".{live}."))
    assert shared_td.gc(prefix) == []
    assert len(_temporaries(live, prefix)) == 3 and _loaded(prefix) == PARENT


def test_shared_td_gc_cli_removes_a_dead_writers_staged_leaf(tmp_path):
    prefix = tmp_path / "data" / "t"
    _parent(prefix)  # (no lock file beside it)
    pid = dead_pid()
    gone = [prefix / f".a.memmap.shared_td.{pid}.7.tmp", prefix / f"meta.json.{pid}.7.tmp"]
    for path in gone:
        path.write_bytes(b"\xff" * 8)
    gone = [str(path) for path in gone]
    code, document = run_json("gc", "--dry-run", tmp_path)
    assert code == 0 and document["removed"] == gone
    code, document = run_json("gc", tmp_path)
    assert code == 0 and document["removed"] == gone
    assert _loaded(prefix) == PARENT and sorted(os.listdir(prefix)) == ["a.memmap", "b.memmap", "meta.json"]


def test_two_dead_writers_staged_leaves_for_one_name_are_both_removed(tmp_path):
    prefix = str(tmp_path / "t")
    _parent(prefix)
    pids = (900000, 1000000)
    assert not any(shared_td.platform.pid_alive(pid) for pid in pids)
    for pid in pids:
        for name in (f".a.memmap.shared_td.{pid}.1.tmp", f"meta.json.{pid}.1.tmp"):
            with open(os.path.join(prefix, name), "wb") as f:
                f.write(b"\xff" * 16)
    assert len(shared_td.gc(prefix)) == 4
    assert _loaded(prefix) == PARENT and sorted(os.listdir(prefix)) == ["a.memmap", "b.memmap", "meta.json"]


@pytest.mark.parametrize("length", [4, 6])
def test_a_dead_writers_staged_leaf_never_touches_a_later_save(tmp_path, length):
    prefix = str(tmp_path / "t")
    _parent(prefix)
    pid = _killed_in(_view_blocked, prefix, "before the commit")
    staged = _temporaries(pid, prefix)
    later = TensorDict(a=torch.full((length,), 7.0), b=torch.full((length,), 8.0), batch_size=[length])
    later.memmap_(prefix)  # a later save, committed
    assert shared_td.gc(prefix) == staged
    assert _loaded(prefix) == {"a": [7.0] * length, "b": [8.0] * length}
    assert sorted(os.listdir(prefix)) == ["a.memmap", "b.memmap", "meta.json"]


def test_what_only_looks_like_a_staged_leaf_is_left(tmp_path):
    prefix = tmp_path / "t"
    pid = dead_pid()
    # a user's keys: files end with .memmap, a nested key is a directory
    td = TensorDict({f".a.memmap.shared_td.{pid}.1.tmp": torch.ones(2),
                     f".c.memmap.shared_td.{pid}.1.tmp": TensorDict(x=torch.zeros(1))})
    td.memmap_(prefix)
    (prefix / f"b.memmap.{pid}.1.tmp").write_bytes(b"")  # not hidden, not tagged
    (prefix / f".b.json.shared_td.{pid}.1.tmp").write_bytes(b"")  # not a leaf file's
    (prefix / f".b.memmap.shared_td.{pid}.1.tmp.bak").write_bytes(b"")  # not the whole name
    os.mkfifo(prefix / f".d.memmap.shared_td.{pid}.1.tmp")  # not a regular file
    os.symlink("meta.json", prefix / f".e.memmap.shared_td.{pid}.1.tmp")
    before = sorted(os.listdir(prefix))
    assert shared_td.gc(str(prefix)) == []
    assert sorted(os.listdir(prefix)) == before
    assert TensorDict.load_memmap(prefix)[f".a.memmap.shared_td.{pid}.1.tmp"].tolist() == [1.0, 1.0]
    assert leftovers.find_stale_temporaries(str(prefix)) == []


def test_staged_leaf_names_parse_whole_names_only():
    assert fmt.temporary_writer_pid(fmt.staged_leaf_name("a.memmap")) == os.getpid()
    assert fmt.temporary_writer_pid(".a.memmap.shared_td.42.7.tmp") == 42
    assert fmt.temporary_writer_pid(".x.y.shape.memmap.shared_td.42.7.tmp") == 42
    for look_alike in ["a.memmap.shared_td.42.7.tmp", ".a.shared_td.42.7.tmp", "..memmap.shared_td.42.7.tmp",
                       ".a.memmap.shared_td.42.7.tmp.memmap", ".a.memmap.shared_td.42.tmp",
                       ".a.memmap.shared_td.x.7.tmp", ".a.memmap.42.7.tmp", "a.memmap.42.7.tmp"]:
        assert fmt.temporary_writer_pid(look_alike) is None, look_alike


def test_gc_cli_leaves_look_alike_names_outside_any_save(tmp_path):
    pid = dead_pid()
    (tmp_path / "notes").mkdir()
    for name in (f".a.memmap.shared_td.{pid}.1.tmp", f"meta.json.{pid}.1.tmp"):
        (tmp_path / "notes" / name).write_bytes(b"mine")
    before = sorted(os.listdir(tmp_path / "notes"))
    code, document = run_json("gc", tmp_path)
    assert code == 0 and document["removed"] == [] and document["failed"] == []
    assert sorted(os.listdir(tmp_path / "notes")) == before


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


# ------------------------------------------- an ordinary write holds no lock
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


def test_a_directory_where_a_view_stages_its_leaf_is_a_clear_error(tmp_path):
    """A directory left under this process's staged name (a reused pid and thread id): an
    error naming the key, the full path and the fix (it was a bare IsADirectoryError with a
    relative name), and the save keeps its bytes."""
    prefix = str(tmp_path / "t")
    TensorDict(a=torch.arange(4.0), batch_size=[4]).memmap_(prefix)
    os.mkdir(os.path.join(prefix, fmt.staged_leaf_name("a.memmap")))
    with pytest.raises(IsADirectoryError, match=r"key 'a'.*" + str(tmp_path) + r".*Remove it and write again"):
        TensorDict.load_memmap(prefix)[1:].memmap_(prefix)
    assert TensorDict.load_memmap(prefix)["a"].tolist() == [0.0, 1.0, 2.0, 3.0]
