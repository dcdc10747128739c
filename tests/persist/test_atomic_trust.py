"""What atomic=True may touch: only a save (never a directory that merely has a
meta.json), its staging directory even when descriptors run out, a symlinked prefix's
target (never the link), permissions kept, lock files never followed.
"""
from __future__ import annotations

import json
import multiprocessing
import os
import pathlib
import shutil
import stat
import tempfile

import pytest
import torch

from tests.persist import atomic_children as kids
from tests.persist.persist_helpers import dir_state, make_td
from tests.processes import finish

import shared_td
from shared_td import load_memmap
from shared_td.persist import atomic, leftovers
from shared_td.persist import format as fmt

pytestmark = pytest.mark.timeout(60)
FORK = multiprocessing.get_context("fork")


def in_child(target, *args, tmp_path) -> dict:
    """Run ``target(*args, out)`` in a forked child; what it reported."""
    out = tmp_path / f"report-{len(os.listdir(tmp_path))}.json"
    child = FORK.Process(target=target, args=(*args, out))
    child.start()
    assert finish(child) == 0
    return json.loads(out.read_text())


# ----------------------------------------------------------- item 2: only a save is replaced
NOT_SAVES = {
    "any_json": (b'{"name": "x"}', "no _type"),
    "a_list": (b"[1, 2]", "a JSON list"),
    "broken_json": (b'{"shape": ', "not valid JSON"),
    "td_without_shape": (b'{"_type": "<class \'tensordict._td.TensorDict\'>", "device": "cpu"}', "'shape'"),
    "lazy_without_stack_dim": (b'{"_type": "<class \'tensordict._lazy.LazyStackedTensorDict\'>"}', "'stack_dim'"),
    "stack_without_data": (b'{"_type": "<class \'tensordict.tensorclass.NonTensorStack\'>", "stack_dim": 0}', "'data'"),
    "non_tensor_data_without_data": (b'{"_type": "<class \'tensordict.tensorclass.NonTensorData\'>"}', "'data'"),
    "tensorclass_without_tensordict": (b'{"_type": "<class \'mine.Config\'>"}', "_tensordict"),
    "unknown_type": (b'{"_type": "config-v2"}', "'config-v2'"),
}


@pytest.mark.parametrize("case", list(NOT_SAVES))
def test_a_directory_that_is_not_a_save_is_never_replaced(tmp_path, case):
    meta, why = NOT_SAVES[case]
    prefix = tmp_path / "p"
    (prefix / "photos" / "2024").mkdir(parents=True)
    (prefix / "photos" / "2024" / "a.jpg").write_bytes(b"jpeg")
    (prefix / "notes.txt").write_text("mine")
    (prefix / "meta.json").write_bytes(meta)
    before = dir_state(tmp_path)
    for method in ("memmap_", "memmap"):
        with pytest.raises(RuntimeError) as raised:
            getattr(make_td(), method)(prefix, atomic=True)
        message = str(raised.value)
        assert str(prefix) in message and "not a saved tensordict" in message and why in message
        assert "notes.txt" in message and "photos" in message  # what is there
        after = dir_state(tmp_path)
        after.pop(".p.lock", None)
        assert after == before


def test_a_meta_json_that_is_a_symlink_or_directory_is_not_a_save(tmp_path):
    good = tmp_path / "good"
    make_td().memmap(good)
    for name, make in [("link", lambda p: os.symlink(good / "meta.json", p / "meta.json")),
                       ("dir", lambda p: (p / "meta.json").mkdir())]:
        prefix = tmp_path / name
        prefix.mkdir()
        make(prefix)
        before = dir_state(prefix)
        with pytest.raises(RuntimeError, match="not a saved tensordict"):
            make_td().memmap(prefix, atomic=True)
        assert dir_state(prefix) == before


@pytest.mark.parametrize("kind", ["tensordict", "lazy", "tensorclass", "non_tensor_data",
                                  "non_tensor_pickled", "non_tensor_stack"])
@pytest.mark.parametrize("writer", ["shared_td", "tensordict"])
def test_every_kind_of_save_of_either_library_is_replaced(tmp_path, kind, writer):
    lib = pytest.importorskip("tensordict") if writer == "tensordict" else shared_td

    @lib.tensorclass
    class Pair:
        x: torch.Tensor

    makers = {
        "tensordict": lambda: lib.TensorDict(a=torch.zeros(2), n={"b": torch.ones(2)}, batch_size=[2]),
        "lazy": lambda: lib.LazyStackedTensorDict(lib.TensorDict(a=torch.zeros(2)), lib.TensorDict(a=torch.zeros(3))),
        "tensorclass": lambda: Pair(x=torch.zeros(2), batch_size=[2]),
        "non_tensor_data": lambda: lib.NonTensorData("hi"),
        "non_tensor_pickled": lambda: lib.NonTensorData({1j}),
        "non_tensor_stack": lambda: lib.NonTensorStack("a", "b"),
    }
    prefix = tmp_path / "p"
    makers[kind]().memmap(prefix)
    kids.build(4).memmap_(prefix, atomic=True)
    assert kids.check(load_memmap(prefix)) == 4


def test_verify_and_inspect_say_the_same_as_atomic(tmp_path):
    from shared_td.cli import main  # the command line sits above persist: imported here

    prefix = tmp_path / "p"
    prefix.mkdir()
    (prefix / "meta.json").write_text('{"name": "x"}')
    (prefix / "notes.txt").write_text("mine")
    with pytest.raises(RuntimeError) as raised:
        make_td().memmap(prefix, atomic=True)
    why = fmt.not_a_save(str(prefix))
    assert why is not None and why in str(raised.value)
    for command in ("verify", "inspect"):
        code = main([command, str(prefix)])
        assert code == 1
    from tests.cli.cli_helpers import run_main

    for command in ("verify", "inspect"):
        code, out, err = run_main(command, prefix)
        assert (code, out) == (1, "") and why in err and str(prefix) in err, err


# ------------------------------------------------ item 4: clean-up without descriptors
@pytest.mark.parametrize("spare", range(0, 7))
def test_a_write_out_of_descriptors_leaves_no_staging_directory(tmp_path, spare):
    prefix = tmp_path / "p"
    kids.build(1).memmap_(prefix, atomic=True)
    found = in_child(kids.write_at_descriptor_limit, str(prefix), spare, tmp_path=tmp_path)
    assert found["leftovers"] == [], found  # not even the running writer's own
    if found["error"] is not None:
        assert "Too many open files" in found["error"] or "EMFILE" in found["error"], found
    assert kids.check(load_memmap(prefix)) in (1, 9)


def test_a_failed_clean_up_is_reported_on_the_error(tmp_path, monkeypatch):
    prefix = tmp_path / "p"
    kids.build(1).memmap_(prefix, atomic=True)

    def refuse(path):
        raise PermissionError(13, "Permission denied (injected)", path)

    monkeypatch.setattr(atomic, "remove_tree", refuse)
    td = kids.build(2)
    td["bad"] = shared_td.NonTensorData(lambda x: x)  # fails while writing the metadata
    with pytest.raises(Exception, match="(?i)pickle|lambda") as raised:
        td.memmap(prefix, atomic=True)
    [staging] = kids.leftovers(prefix)
    notes = getattr(raised.value, "__notes__", [])
    assert any(staging in note and "injected" in note for note in notes), notes
    monkeypatch.undo()
    atomic.remove_tree(str(tmp_path / staging))  # left for the test to remove


def test_remove_tree_never_follows_a_symlink(tmp_path):
    outside = tmp_path / "outside"
    (outside / "keep").mkdir(parents=True)
    tree = tmp_path / "tree"
    (tree / "d0" / "d1").mkdir(parents=True)
    (tree / "d0" / "d1" / "f").write_bytes(b"x")
    os.symlink(outside, tree / "d0" / "link")
    os.symlink(outside / "keep", tree / "d0" / "d1" / "link")
    atomic.remove_tree(str(tree))
    assert not os.path.lexists(tree) and (outside / "keep").is_dir()
    link = tmp_path / "alink"
    os.symlink(outside, link)
    atomic.remove_tree(str(link))  # a symlink is unlinked, its target kept
    assert not os.path.lexists(link) and (outside / "keep").is_dir()


def test_remove_tree_needs_two_descriptors_at_any_depth(tmp_path):
    tree = tmp_path / "tree"
    deep = tree.joinpath(*[f"d{i}" for i in range(30)])  # shutil.rmtree: 2 per level
    deep.mkdir(parents=True)
    for directory in [tree, deep.parent, deep]:
        (directory / "f").write_bytes(b"x")
        (directory / "e").mkdir()
    found = in_child(kids.remove_at_descriptor_limit, str(tree), 2, tmp_path=tmp_path)
    assert found == {"error": None, "exists": False}


# ------------------------------------------------------------- item 4: symlinked prefix
def test_a_symlinked_prefix_rewrites_its_target_and_stays_a_link(tmp_path):
    real = tmp_path / "disk" / "buffer"
    kids.build(1).memmap(real)
    (tmp_path / "data").mkdir()
    link = tmp_path / "data" / "buffer"
    os.symlink(real, link)
    td = kids.build(2).memmap_(link, atomic=True)
    assert os.path.islink(link) and os.readlink(link) == str(real)
    assert kids.check(load_memmap(real)) == 2 and kids.check(load_memmap(link)) == 2
    assert td["a"].filename == str(real / "a.memmap")
    assert sorted(os.listdir(tmp_path / "data")) == ["buffer"]  # nothing beside the link
    assert sorted(os.listdir(tmp_path / "disk")) == [".buffer.lock", "buffer"]
    assert shared_td.gc(link) == [] and shared_td.gc(real) == []


def test_gc_removes_what_it_reports_beside_a_symlinked_prefix(tmp_path):
    """An older writer swapped the link itself away (leaving it at a staging name);
    gc removes that link (not its target) and says so, truthfully."""
    real = tmp_path / "real"
    kids.build(1).memmap(real)
    link = tmp_path / "link"
    os.symlink(real, link)
    dead = FORK.Process(target=os._exit, args=(0,))
    dead.start()
    dead.join(30)
    stale = tmp_path / f".link.shared_td-new-{dead.pid}-0123456789ab"
    os.symlink(real, stale)
    assert shared_td.gc(link, dry_run=True) == [str(stale)]
    assert shared_td.gc(link) == [str(stale)]
    assert not os.path.lexists(stale) and kids.check(load_memmap(real)) == 1


def test_gc_raises_when_it_cannot_remove_a_leftover(tmp_path, monkeypatch):
    prefix = tmp_path / "p"
    kids.build(1).memmap(prefix)
    dead = FORK.Process(target=os._exit, args=(0,))
    dead.start()
    dead.join(30)
    leftover = tmp_path / f".p.shared_td-new-{dead.pid}-0123456789ab"
    (leftover / "sub").mkdir(parents=True)

    def refuse(path):
        raise PermissionError(13, "Permission denied (injected)", path)

    monkeypatch.setattr(leftovers, "remove_tree", refuse)  # the sweep of gc
    with pytest.raises(OSError, match=f"{leftover}.*injected"):
        shared_td.gc(prefix)
    assert leftover.is_dir()


def test_a_dangling_symlinked_prefix_is_refused(tmp_path):
    link = tmp_path / "p"
    os.symlink(tmp_path / "nowhere", link)
    with pytest.raises(FileNotFoundError, match="symlink"):
        make_td().memmap(link, atomic=True)
    assert sorted(os.listdir(tmp_path)) == ["p"] and os.path.islink(link)


# ---------------------------------------------------------------- item 10: permissions
def _modes(root) -> dict:
    """relative path -> (kind, mode bits) of everything under root, root included."""
    found = {".": ("d", stat.S_IMODE(os.lstat(root).st_mode))}
    for directory, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = os.path.join(directory, name)
            kind = "d" if name in dirnames else "f"
            found[os.path.relpath(path, root)] = (kind, stat.S_IMODE(os.lstat(path).st_mode))
    return found


def _save_under_umask(prefix, atomic_write):
    def action():
        kids.build(3).memmap(prefix, atomic=atomic_write)
        lock = os.path.join(os.path.dirname(prefix), ".p.lock")
        return {"tree": _modes(prefix),
                "lock": stat.S_IMODE(os.lstat(lock).st_mode) if os.path.exists(lock) else None}
    return action


@pytest.mark.parametrize("atomic_write", [False, True])
@pytest.mark.parametrize("umask", [0o002, 0o027])
def test_a_new_save_gets_the_modes_of_a_plain_makedirs_and_open(tmp_path, atomic_write, umask):
    prefix = str(tmp_path / "p")
    found = in_child(kids.with_umask, umask, _save_under_umask(prefix, atomic_write), tmp_path=tmp_path)
    assert found["error"] is None, found["error"]
    expected = {"d": 0o777 & ~umask, "f": 0o666 & ~umask}
    wrong = {path: oct(mode) for path, (kind, mode) in found["result"]["tree"].items() if mode != expected[kind]}
    assert wrong == {}
    if atomic_write:
        assert found["result"]["lock"] == 0o666 & ~umask


def test_an_atomic_rewrite_keeps_mode_group_and_setgid(tmp_path):
    prefix = tmp_path / "p"
    kids.build(1).memmap(prefix)
    group = 65534 if os.getgid() != 65534 else 1
    os.chown(prefix, -1, group)
    os.chmod(prefix, 0o2750)
    kids.build(2).memmap(prefix, atomic=True)
    info = os.stat(prefix)
    assert (oct(stat.S_IMODE(info.st_mode)), info.st_gid) == (oct(0o2750), group)
    nested = os.stat(prefix / "nested")  # a sub-directory: as a plain makedirs inside it
    assert nested.st_gid == group and nested.st_mode & stat.S_ISGID


def _read_as_nobody():
    """What another user reads of the save "p" in the current directory."""
    with open(os.path.join("p", "meta.json")) as meta:
        names = sorted(json.load(meta))
    with open(os.path.join("p", "a.memmap"), "rb") as leaf:
        first = torch.frombuffer(bytearray(leaf.read(4)), dtype=torch.float32).item()
    return [sorted(os.listdir("p")), names, first]


def test_an_atomic_rewrite_keeps_a_read_only_mode(tmp_path):
    prefix = tmp_path / "p"
    kids.build(1).memmap(prefix)
    os.chmod(prefix, 0o555)  # set only once the new version is written: it is written
    kids.build(2).memmap(prefix, atomic=True)
    assert oct(stat.S_IMODE(os.stat(prefix).st_mode)) == oct(0o555)
    assert kids.check(load_memmap(prefix)) == 2


def test_a_group_that_cannot_be_given_stops_the_rewrite_before_it_starts(tmp_path, monkeypatch):
    prefix = tmp_path / "p"
    kids.build(1).memmap(prefix)
    os.chown(prefix, -1, 65534 if os.getgid() != 65534 else 1)
    before = dir_state(tmp_path)

    def not_a_member(fd, uid, gid):  # what the kernel says to a non-member (we are root)
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "fchown", not_a_member)
    with pytest.raises(PermissionError, match=f"{prefix} belongs to group"):
        kids.build(2).memmap(prefix, atomic=True)
    after = dir_state(tmp_path)
    after.pop(".p.lock")
    assert after == before and kids.leftovers(prefix) == []


def test_other_users_keep_access_after_an_atomic_rewrite(tmp_path):
    os.chmod(tmp_path, 0o755)  # nobody works in it (its ancestors it need not reach)
    prefix = tmp_path / "p"
    kids.build(1).memmap(prefix)
    os.chmod(prefix, 0o755)
    found = in_child(kids.as_nobody, _read_as_nobody, str(tmp_path), tmp_path=tmp_path)
    assert found["error"] is None and found["result"][2] == 1.0, found
    kids.build(2).memmap(prefix, atomic=True)
    found = in_child(kids.as_nobody, _read_as_nobody, str(tmp_path), tmp_path=tmp_path)
    assert found["error"] is None and found["result"][2] == 2.0, found


# -------------------------------------------------------------- item 10: lock files
def test_a_symlink_planted_at_the_lock_file_is_never_followed(tmp_path):
    prefix = tmp_path / "p"
    kids.build(1).memmap(prefix)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    os.symlink(victim, tmp_path / ".p.lock")
    before = dir_state(prefix)
    with pytest.raises(OSError, match=f"{tmp_path / '.p.lock'}.*symlink"):
        kids.build(2).memmap(prefix, atomic=True)
    with pytest.raises(OSError, match="symlink"):
        shared_td.gc(prefix)
    assert victim.read_bytes() == b"precious" and dir_state(prefix) == before
    assert os.path.islink(tmp_path / ".p.lock")


# ------------------------------------------------- leftovers: our exact names only
def _dead_pid() -> int:
    dead = FORK.Process(target=os._exit, args=(0,))
    dead.start()
    assert finish(dead) == 0
    return dead.pid


def _look_alikes(parent, pid: int) -> list[str]:
    """A user's saves, file and directories named like a dead writer's temporaries of
    prefix ``p`` (pid ``pid``) but not as our writers name them: none is ever ours."""
    names = [f".p.shared_td-new-{pid}-mydata", f".p.shared_td-old-{pid}-keepme",
             f".p.shared_td-new-{pid}-0123456789ab-copy", f".p.shared_td-new-{pid}-0123456789AB",
             f".p.shared_td-old-{pid}-k2j5x_9a"]  # an exact -old- name holding a save, not "tree"
    for name in names:
        kids.build(7).memmap(parent / name)
    (parent / f".p.shared_td-new-{pid}-notes").write_bytes(b"mine")
    return names + [f".p.shared_td-new-{pid}-notes"]


def test_look_alikes_of_temporary_names_are_never_removed(tmp_path):
    """A writer SIGKILLed between the fallback's two renames leaves a staging and a
    retired directory (prefix missing): gc removes exactly those and puts the old version
    back; the look-alikes, also of a dead pid, stay through gc and atomic writes."""
    prefix = tmp_path / "p"
    kids.build(1).memmap_(prefix, atomic=True)
    ready = FORK.Event()
    child = FORK.Process(target=kids.blocking_writer, args=(str(prefix), 2, 0, "renames", ready))
    child.start()
    assert ready.wait(30)
    child.kill()
    assert finish(child) == -9
    real = sorted(kids.leftovers(prefix))
    assert [n.split("-")[1] for n in real] == ["new", "old"] and not prefix.exists()
    ours = _look_alikes(tmp_path, child.pid) + _look_alikes(tmp_path, _dead_pid())
    before = {name: dir_state(tmp_path / name) if (tmp_path / name).is_dir() else (tmp_path / name).read_bytes()
              for name in ours}

    def unchanged() -> bool:
        return all((dir_state(tmp_path / n) if (tmp_path / n).is_dir() else (tmp_path / n).read_bytes()) == state
                   for n, state in before.items())

    assert sorted(shared_td.gc(prefix, dry_run=True)) == [str(tmp_path / n) for n in real]
    assert sorted(shared_td.gc(prefix)) == [str(tmp_path / n) for n in real]
    assert kids.check(load_memmap(prefix)) == 1 and unchanged()
    kids.build(3).memmap_(prefix, atomic=True)
    kids.build(4).memmap(tmp_path / "p.tdz")  # an archive writer sweeps beside p.tdz only
    assert unchanged() and kids.check(load_memmap(prefix)) == 3
    assert sorted(set(kids.leftovers(prefix)) - set(ours)) == []
    for name in ours:  # still loadable saves, except the user's file
        if (tmp_path / name).is_dir():
            assert kids.check(load_memmap(tmp_path / name)) == 7


def test_parse_leftover_name_takes_only_whole_names_of_our_writers():
    pid = os.getpid()
    assert atomic.parse_leftover_name(atomic.temporary_name("x")) == ("x", pid)
    assert atomic.parse_leftover_name(f".x.shared_td-new-{pid}-0123456789ab") == ("x", pid)
    assert atomic.parse_leftover_name(f".x.shared_td-old-{pid}-k2j5x_9a") == ("x", pid)
    for look_alike in ("mydata", "0123456789ab-1", "0123456789a", "0123456789abc", "k2j5x_9a"):
        assert atomic.parse_leftover_name(f".x.shared_td-new-{pid}-{look_alike}") is None, look_alike
    for look_alike in ("keepme", "k2j5x_9a.bak", "k2j5x_9ab"):
        assert atomic.parse_leftover_name(f".x.shared_td-old-{pid}-{look_alike}") is None, look_alike


# ------------------------------------------------- a read-only parent directory
def _gc_and_write(name: str):
    """As an unprivileged user in a directory it may not write: gc, then an atomic
    write and an archive save of ``name``; what each returned or raised."""
    import shared_td as std

    def outcome(action):
        try:
            return ["ok", action()]
        except Exception as error:  # the report names the type and the message
            return [type(error).__name__, str(error)]

    return {
        "gc": outcome(lambda: std.gc(name)),
        "lock": os.path.lexists(f".{name}.lock"),
        "atomic": outcome(lambda: kids.build(2).memmap_(name, atomic=True) and None),
        "archive": outcome(lambda: kids.build(2).memmap(name + ".tdz") and None),
    }


@pytest.mark.parametrize("lock", ["none", "writable", "root's"])
def test_a_read_only_parent_gc_succeeds_and_writes_say_what_to_fix(tmp_path, lock):
    """Run as the user nobody (root ignores file modes), in a directory owned by root."""
    if os.geteuid() != 0:
        pytest.skip("needs root, to run the check as the user nobody in a directory it may not write")
    # gc and the writers use absolute paths: nobody must reach the directory, and
    # pytest's own are below a 0o700 one
    place = tempfile.mkdtemp(prefix="shared_td-read-only-", dir="/tmp")
    try:
        os.chmod(place, 0o755)
        _check_read_only_parent(pathlib.Path(place), lock, tmp_path)
    finally:
        shutil.rmtree(place)


def _check_read_only_parent(place, lock, tmp_path):
    kids.build(1).memmap(place / "p")
    kids.build(1).memmap(place / "p.tdz")  # made its lock file, root's, 0o644
    if lock == "none":
        os.unlink(place / ".p.tdz.lock")
    else:  # made by earlier writes while the directory was writable
        kids.build(1).memmap_(place / "p", atomic=True)
    if lock == "writable":
        os.chmod(place / ".p.lock", 0o666)
        os.chmod(place / ".p.tdz.lock", 0o666)
    before = sorted(os.listdir(place))
    found = in_child(kids.as_nobody, _gc_and_write_p, str(place), tmp_path=tmp_path)
    assert found["error"] is None, found
    result = found["result"]
    assert result["lock"] == (lock != "none"), result
    if lock == "root's":  # gc takes an existing lock: one it may not open is named, with the fix
        assert result["gc"][0] == "PermissionError" and "make it writable" in result["gc"][1], result
    else:
        assert result["gc"] == ["ok", []], result
    for what in ("atomic", "archive"):
        kind, message = result[what]
        assert kind == "PermissionError", result
        if lock == "root's":
            assert f"Cannot lock {place}/.p" in message and "make it writable" in message, message
        else:
            assert f"its directory {place} is not writable" in message and "must be writable" in message
    assert sorted(os.listdir(place)) == before
    assert kids.check(load_memmap(place / "p")) == 1


def _gc_and_write_p():
    return _gc_and_write("p")
