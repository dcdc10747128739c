"""`shared-td gc`: removes dead atomic writers' temporary directories and lock files no
process holds, under a directory; never a running writer's, never anything else."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.cli.cli_helpers import dead_pid, run_cli, run_json, run_main

import shared_td
from shared_td.persist import atomic, leftovers, lock_probe

HOLD_LOCK = (
    "import filelock, sys\n"
    "lock = filelock.FileLock(sys.argv[1]); lock.acquire()\n"
    "print('locked', flush=True); sys.stdin.read()\n"
)


@pytest.fixture
def lock_holder():
    """Start a process that holds a lock file until the test ends."""
    holders = []

    def hold(path) -> subprocess.Popen:
        holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(path)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        holders.append(holder)
        assert holder.stdout.readline() == "locked\n"
        return holder

    yield hold
    for holder in holders:
        holder.stdin.close()
        holder.wait(timeout=60)


def _save(prefix) -> None:
    shared_td.TensorDict(x=torch.arange(3.0)).memmap_(str(prefix), atomic=True)


def _crashed_writer_leftovers(parent, name: str, pid: int) -> list[str]:
    """What a writer killed while writing leaves: a staging directory with a partial tree."""
    staging = parent / f".{name}.shared_td-new-{pid}-0123456789ab"
    (staging / "nested").mkdir(parents=True)
    (staging / "x.memmap").write_bytes(b"\0" * 12)
    return [str(staging)]


def _listing(root) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, n), root)
                  for d, dirs, files in os.walk(root) for n in dirs + files)


@pytest.fixture
def scene(tmp_path, lock_holder):
    """A data directory with leftovers of a crashed writer, stale and held locks, and
    things that must stay. Returns (root, what gc must remove, what it must keep)."""
    root = tmp_path / "data"
    (root / "runs").mkdir(parents=True)
    dead = dead_pid()
    gone = []
    _save(root / "buffer")  # leaves .buffer.lock behind, held by nobody
    gone += _crashed_writer_leftovers(root, "buffer", dead) + [str(root / ".buffer.lock")]
    _save(root / "runs" / "deep")
    gone += _crashed_writer_leftovers(root / "runs", "deep", dead) + [str(root / "runs" / ".deep.lock")]
    # a running writer of "busy": its lock is held, its staging directory is alive
    _save(root / "busy")
    holder = lock_holder(root / ".busy.lock")
    kept = [".busy.lock", f".busy.shared_td-new-{holder.pid}-0123456789ab"]
    kept += [os.path.relpath(p, root) for p in _crashed_writer_leftovers(root, "busy", dead)]
    (root / kept[1]).mkdir()
    # not ours: another program's lock file, a name of our pattern whose pid is no number
    (root / ".other.lock").write_text("")
    (root / ".buffer.shared_td-new-notapid-x").mkdir()
    kept += [".other.lock", ".buffer.shared_td-new-notapid-x", "buffer", "busy"]
    return root, gone, kept


def test_dry_run_lists_and_removes_nothing(scene):
    root, gone, kept = scene
    before = _listing(root)
    code, out, err = run_main("gc", "--dry-run", root)
    assert (code, err) == (0, "")
    assert _listing(root) == before
    lines = out.splitlines()
    assert sorted(line.split()[2] for line in lines if line.startswith("would remove")) == sorted(gone)
    assert f"skipped {root / 'busy'}: a running writer holds its lock {root / '.busy.lock'}" in lines
    assert lines[-1] == f"4 leftovers to remove under {root}, 1 prefix in use"


def test_removes_dead_writers_leftovers_and_unheld_locks_only(scene):
    root, gone, kept = scene
    code, document = run_json("gc", "--dry-run", root)
    assert code == 0 and sorted(document["removed"]) == sorted(gone)
    done = run_cli("gc", root)
    assert done.returncode == 0 and done.stderr == ""
    assert sorted(line.split()[1] for line in done.stdout.splitlines()
                  if line.startswith("removed ")) == sorted(gone)
    for path in gone:
        assert not os.path.lexists(path)
    for name in kept:
        assert os.path.lexists(root / name), name
    assert shared_td.load_memmap(str(root / "buffer"))["x"].tolist() == [0.0, 1.0, 2.0]
    assert shared_td.load_memmap(str(root / "runs" / "deep"))["x"].tolist() == [0.0, 1.0, 2.0]
    code, document = run_json("gc", root)  # nothing left to do
    assert (code, document["removed"], document["skipped"]) == (0, [], [str(root / "busy")])


def test_a_writer_killed_between_the_two_renames_gets_its_prefix_back(tmp_path):
    _save(tmp_path / "p")
    moved = tmp_path / f".p.shared_td-old-{dead_pid()}-k2j5x_9a"
    moved.mkdir()
    os.rename(tmp_path / "p", moved / "tree")  # the fallback's first rename, then SIGKILL
    code, out, _ = run_main("gc", tmp_path)
    assert code == 0 and f"removed  {moved}  (temporary directory of dead writer pid" in out
    assert sorted(os.listdir(tmp_path)) == ["p"]
    assert shared_td.load_memmap(str(tmp_path / "p"))["x"].tolist() == [0.0, 1.0, 2.0]


def test_path_may_be_the_saved_tensordict_itself(tmp_path):
    _save(tmp_path / "p")
    leftovers = _crashed_writer_leftovers(tmp_path, "p", dead_pid())
    code, document = run_json("gc", tmp_path / "p")
    assert code == 0 and sorted(document["removed"]) == sorted(leftovers + [str(tmp_path / ".p.lock")])
    assert os.listdir(tmp_path) == ["p"]


def test_a_tensordict_save_with_a_crashed_shared_td_rewrite(tmp_path):
    tensordict = pytest.importorskip("tensordict")
    tensordict.TensorDict(x=torch.arange(3.0)).memmap_(str(tmp_path / "theirs"))
    leftovers = _crashed_writer_leftovers(tmp_path, "theirs", dead_pid())
    code, document = run_json("gc", tmp_path)
    assert code == 0 and document["removed"] == leftovers
    assert os.listdir(tmp_path) == ["theirs"]
    assert tensordict.TensorDict.load_memmap(str(tmp_path / "theirs"))["x"].tolist() == [0.0, 1.0, 2.0]


def test_temporary_files_of_a_killed_in_place_writer(tmp_path):
    # a writer killed while it rewrote the metadata of an existing save in place leaves
    # meta.json.<pid>.<thread>.tmp files, at any depth of the tree
    prefix = tmp_path / "data" / "buffer"
    shared_td.TensorDict(x=torch.arange(3.0), n={"y": torch.zeros(3)}, batch_size=[3]).memmap_(str(prefix))
    dead = dead_pid()
    gone = [prefix / f"meta.json.{dead}.140.tmp", prefix / "n" / f"meta.json.{dead}.141.tmp"]
    kept = [prefix / f"meta.json.{os.getpid()}.142.tmp",  # a live writer's: never touched
            prefix / "notes.tmp", prefix / "n" / f"meta.json.{dead}.tmp"]  # not our pattern
    for path in gone + kept:
        path.write_bytes(b"{")
    expected = sorted(map(str, gone))
    code, document = run_json("gc", "--dry-run", tmp_path / "data")
    assert code == 0 and sorted(document["removed"]) == expected
    assert all(path.exists() for path in gone)
    code, out, _ = run_main("gc", tmp_path / "data")
    assert code == 0 and f"removed  {gone[0]}  (temporary file of dead writer pid {dead})" in out
    assert not any(path.exists() for path in gone) and all(path.exists() for path in kept)
    assert not (tmp_path / "data" / ".buffer.lock").exists()  # the lock gc took is not left
    assert shared_td.load_memmap(str(prefix))["n", "y"].tolist() == [0.0] * 3
    # the library function does the same for one prefix
    gone[0].write_bytes(b"{")
    assert shared_td.gc(str(prefix), dry_run=True) == [str(gone[0])]
    assert shared_td.gc(str(prefix)) == [str(gone[0])] and not gone[0].exists()


def test_the_library_function_dry_run_and_remove_lock(tmp_path, lock_holder):
    _save(tmp_path / "p")
    leftovers = _crashed_writer_leftovers(tmp_path, "p", dead_pid())
    lock = str(tmp_path / ".p.lock")
    assert shared_td.gc(tmp_path / "p", dry_run=True) == leftovers
    assert shared_td.gc(tmp_path / "p", dry_run=True, remove_lock=True) == leftovers + [lock]
    assert sorted(os.listdir(tmp_path)) == sorted([".p.lock", "p", os.path.basename(leftovers[0])])
    holder = lock_holder(lock)
    assert lock_probe.lock_is_held(lock)
    assert shared_td.gc(tmp_path / "p", dry_run=True, remove_lock=True) == leftovers
    with pytest.raises(TimeoutError):
        shared_td.gc(tmp_path / "p", timeout=0, remove_lock=True)
    holder.stdin.close()
    holder.wait(timeout=60)
    assert not lock_probe.lock_is_held(lock)
    assert shared_td.gc(tmp_path / "p", timeout=0, remove_lock=True) == leftovers + [lock]
    assert os.listdir(tmp_path) == ["p"]
    # with nothing to remove, gc takes no lock: no lock file is made (a read-only directory works)
    assert shared_td.gc(tmp_path / "p") == [] and os.listdir(tmp_path) == ["p"]


def test_a_removed_lock_file_is_recreated_by_the_next_writer(tmp_path):
    _save(tmp_path / "p")
    assert lock_probe.remove_unheld_lock(str(tmp_path / ".p.lock"))
    with atomic.acquired(str(tmp_path / "p")):  # recreated by the next writer
        assert lock_probe.lock_is_held(str(tmp_path / ".p.lock"))
        assert not lock_probe.remove_unheld_lock(str(tmp_path / ".p.lock"))
    _save(tmp_path / "p")


def test_a_writer_whose_lock_file_was_removed_under_it_locks_the_new_one(tmp_path):
    # The race gc's lock removal could open: a writer opens the lock file, gc unlinks
    # it, the writer's flock then succeeds on the deleted file while a second writer
    # creates and locks a new one. The first writer must notice and lock the new file.
    prefix = str(tmp_path / "p")
    _save(prefix)
    writer = atomic.acquired(prefix, timeout=10)
    original, attempts = writer.lock.acquire, []

    def acquire_then_lose_the_file(*args, **kwargs):
        result = original(*args, **kwargs)
        attempts.append(os.fstat(writer.lock._context.lock_file_fd).st_ino)
        if len(attempts) == 1:
            os.unlink(atomic.lock_path(prefix))  # as if gc removed it just before our flock
        return result

    writer.lock.acquire = acquire_then_lose_the_file
    with writer:
        assert len(attempts) == 2  # (the inode number may be reused: not compared)
        assert os.path.samestat(os.fstat(writer.lock._context.lock_file_fd),
                                os.stat(atomic.lock_path(prefix)))
        assert lock_probe.lock_is_held(atomic.lock_path(prefix))


def test_a_leftover_that_cannot_be_removed_is_reported_as_failed(tmp_path, monkeypatch):
    dead = dead_pid()
    for name in ("a", "b"):
        _save(tmp_path / name)
        _crashed_writer_leftovers(tmp_path, name, dead)
    stuck, remove = str(tmp_path / f".a.shared_td-new-{dead}-0123456789ab"), leftovers.remove_tree

    def refusing(path):
        if path == stuck:
            raise PermissionError(13, "Permission denied (injected)", path)
        remove(path)

    monkeypatch.setattr(leftovers, "remove_tree", refusing)
    code, out, err = run_main("gc", tmp_path)
    lines = out.splitlines()
    assert (code, err) == (1, "") and os.path.isdir(stuck)
    assert not os.path.lexists(tmp_path / f".b.shared_td-new-{dead}-0123456789ab")
    assert [line.split()[1] for line in lines if line.startswith("removed ")] == [
        str(tmp_path / f".b.shared_td-new-{dead}-0123456789ab"), str(tmp_path / ".b.lock")]
    [failed] = [line for line in lines if line.startswith("failed ")]
    assert failed.startswith(f"failed  {tmp_path / 'a'}: ") and stuck in failed and "injected" in failed
    assert lines[-1] == f"2 leftovers removed under {tmp_path}, 1 prefix failed"


def test_errors(tmp_path):
    (tmp_path / "file").write_text("")
    for target in [tmp_path / "missing", tmp_path / "file"]:
        code, out, err = run_main("gc", target)
        assert (code, out) == (1, "") and len(err.splitlines()) == 1 and "Traceback" not in err
    code, out, err = run_main("gc", "--wait", "-1", tmp_path)
    # checked by the parser (a usage error, with the usage line): see test_cli_audit.py
    assert code == 2 and err.endswith(
        "shared-td gc: error: argument --wait: must be a finite number of seconds, 0 or more, got '-1'\n")
