"""Findings of the session-18 memmap_ audit (helpers/audit18-memmap-report.md).

1. A failed write removes only what it made: never a prefix (or files in it) that
   another writer made meanwhile; a second memmap_ of a tree whose return_early write
   is still running waits for it; a failed earlier write never undoes the lock of a
   later one.
2. A return_early write still running when the program ends completes (or says on
   stderr that it failed).
3. An atomic rewrite of a read-only save removes the old version; gc removes a dead
   writer's read-only leftovers.
4. A rewrite into a read-only existing directory fails before any leaf file changes;
   a meta-device or sparse leaf is refused naming its key.

Read-only cases run in a child process without capabilities (``setpriv``) when the
tests run as root, as permission bits do not apply to root otherwise.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

import shared_td.persist.api as api
from shared_td import TensorDict
from shared_td.containers.locking import lock_until_restored
from shared_td.storage import files

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# Prepended to a script run without capabilities: where permission bits still do not
# apply to it, it prints the skip (read by _json_child) instead of running.
_UNLESS_PERMISSIONS_APPLY = """
import json as _json, os as _os, shutil as _shutil, sys as _sys, tempfile as _tempfile
_probe = _tempfile.mkdtemp()
_os.chmod(_probe, 0o555)
try:
    open(_os.path.join(_probe, "x"), "w").close()
    print(_json.dumps({"skip": "permission bits do not apply to this process"}))
    _sys.exit(0)
except PermissionError:
    pass
finally:
    _os.chmod(_probe, 0o755)
    _shutil.rmtree(_probe, ignore_errors=True)
"""


def _child(script: str, *, drop_capabilities: bool = False, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``script`` in a new interpreter (the repository importable); as root with
    ``drop_capabilities``, without capabilities (skipped where that is not possible,
    or where permission bits do not apply even then)."""
    script = textwrap.dedent(script)
    if drop_capabilities:
        script = _UNLESS_PERMISSIONS_APPLY + script
    command = [sys.executable, "-c", script]
    if drop_capabilities and os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("running as root and setpriv is not available to drop capabilities")
        command = [setpriv, "--bounding-set=-all", "--inh-caps=-all", *command]
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)


def _json_child(script: str, **kwargs) -> dict:
    done = _child(script, **kwargs)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if result.get("skip"):
        pytest.skip(result["skip"])
    return result


# ------------------------------------------------------------------- 1: clean-up, waits
def _early_then_plain(cls, prefix: str) -> dict:
    td = cls({f"k{i}": torch.full((1 << 18,), float(i)) for i in range(4)}, batch_size=[])
    future = td.memmap_(prefix, num_threads=2, return_early=True)
    td.memmap_(prefix)
    future.result()  # (tensordict's takes no timeout)
    loaded = cls.load_memmap(prefix)
    return {
        "locked": td.is_locked, "memmap": td.is_memmap(),
        "files": sorted(os.listdir(prefix)),
        "values": {key: float(loaded[key].max()) for key in sorted(loaded.keys())},
        "leaf file": os.path.exists(td["k0"].filename),
    }


def test_memmap_while_a_return_early_write_runs_ends_with_a_complete_save(tmp_path, monkeypatch):
    """The second memmap_ waits for the first: both write, the save is complete (tensordict
    0.15.3 too); before, the first write's clean-up removed the second's save."""
    written = threading.Event()
    real = files.pwrite_all

    def slow_in_the_pool(fd, data, offset, where=""):
        if threading.current_thread() is not threading.main_thread() and not written.is_set():
            written.set()
            time.sleep(0.3)  # the first write is still running while the second one starts
        return real(fd, data, offset, where=where)

    monkeypatch.setattr(files, "pwrite_all", slow_in_the_pool)
    ours = _early_then_plain(TensorDict, str(tmp_path / "st"))
    assert written.is_set()
    expected = {f"k{i}": float(i) for i in range(4)}
    assert ours == {"locked": True, "memmap": True, "leaf file": True, "values": expected,
                    "files": ["k0.memmap", "k1.memmap", "k2.memmap", "k3.memmap", "meta.json"]}
    tensordict = pytest.importorskip("tensordict")
    theirs = _early_then_plain(tensordict.TensorDict, str(tmp_path / "td"))
    assert theirs == ours


def test_failed_write_keeps_what_another_writer_put_in_its_new_prefix(tmp_path, monkeypatch):
    """The prefix (and a nested directory) this write made holds a file of another
    writer when the write fails: only this write's files and empty directories go."""
    prefix = tmp_path / "p"
    real = files.pwrite_all

    def failing(fd, data, offset, where=""):
        if "boom" in where:
            (prefix / "theirs.txt").write_text("another writer's")
            (prefix / "n" / "theirs.txt").write_text("another writer's")
            raise OSError(5, "Input/output error (injected)")
        return real(fd, data, offset, where=where)

    monkeypatch.setattr(files, "pwrite_all", failing)
    td = TensorDict(a=torch.ones(3), n=TensorDict(b=torch.ones(2), c=TensorDict(d=torch.ones(2))),
                    z=TensorDict(boom=torch.ones(2)))
    with pytest.raises(OSError, match="injected") as caught:
        td.memmap_(prefix)
    assert sorted(os.listdir(prefix)) == ["n", "theirs.txt"]
    assert sorted(os.listdir(prefix / "n")) == ["theirs.txt"]
    assert not td.is_locked and not td.is_memmap()
    assert any(str(prefix) in note for note in caught.value.__notes__)  # why the prefix stays


def test_prefix_made_by_another_process_after_planning_is_left_alone(tmp_path, monkeypatch):
    """Another process saves at the (new) prefix between this write's plan and its
    write: this write is refused before it writes anything, and the other save stays."""
    prefix = str(tmp_path / "p")
    real = api.write_tree

    def another_process_saves_first(*args, **kwargs):
        done = _child(f"""
            import torch
            from shared_td import TensorDict
            TensorDict(a=torch.full((3,), 7.0), theirs=torch.ones(1)).memmap({prefix!r})
        """, timeout=60)
        assert done.returncode == 0, done.stderr
        return real(*args, **kwargs)

    monkeypatch.setattr(api, "write_tree", another_process_saves_first)
    td = TensorDict(a=torch.zeros(3))
    with pytest.raises(FileExistsError, match="did not exist when this write was planned") as caught:
        td.memmap_(prefix)
    assert prefix in str(caught.value) and "atomic=True" in str(caught.value)
    loaded = TensorDict.load_memmap(prefix)
    assert loaded["a"].tolist() == [7.0] * 3 and loaded["theirs"].tolist() == [1.0]
    assert not td.is_locked and not td.is_memmap()


def test_failed_earlier_write_does_not_undo_a_later_lock():
    td, restorers = TensorDict(a=torch.ones(2), n=TensorDict(b=torch.ones(2))), []
    lock_until_restored(td, restorers)
    lock_until_restored(td, [])  # a later write that succeeded: never restored
    restorers[0]()  # the earlier write failed after it
    assert td.is_locked and td["n"].is_locked
    # in order (the later one restored first), each puts back what it found
    other, restorers = TensorDict(a=torch.ones(2), n=TensorDict(b=torch.ones(2))), []
    lock_until_restored(other, restorers)
    lock_until_restored(other, restorers)
    first, second = restorers
    second()
    assert other.is_locked
    first()
    assert not other.is_locked and not other["n"].is_locked


# --------------------------------------------------------------- 2: at interpreter exit
def test_return_early_write_running_at_exit_completes(tmp_path):
    """The program ends without result(): memmap_ and memmap complete (as in tensordict
    0.15.3); a write that fails then says so on stderr."""
    done = _child(f"""
        import time, torch
        from shared_td import TensorDict
        from shared_td.storage import files
        try:  # imported first: every write below is still running when the program ends
            import tensordict
        except ImportError:
            tensordict = None
        real = files.pwrite_all
        def failing(fd, data, offset, where=""):
            time.sleep(0.1)  # the writes are still running when the program ends
            if "fails" in where:
                time.sleep(0.4)
                raise OSError(5, "Input/output error (injected)")
            return real(fd, data, offset, where=where)
        files.pwrite_all = failing
        td = TensorDict({{f"k{{i}}": torch.full((1 << 20,), float(i)) for i in range(8)}})
        if tensordict is not None:  # the reference, side by side
            reference = tensordict.TensorDict({{key: value.clone() for key, value in td.items()}})
            reference.memmap_({str(tmp_path / "tensordict")!r}, num_threads=4, return_early=True)
        # started last, one after the other: the program ends while they sleep in their writes
        inplace = td.clone().memmap_({str(tmp_path / "inplace")!r}, num_threads=4, return_early=True)
        copy = td.memmap({str(tmp_path / "copy")!r}, num_threads=4, return_early=True)
        failed = TensorDict(fails=torch.ones(1 << 20)).memmap_({str(tmp_path / "failed")!r},
                                                               num_threads=4, return_early=True)
    """)
    assert done.returncode == 0, done.stderr
    expected = {f"k{i}": float(i) for i in range(8)}
    for name in ("inplace", "copy", "tensordict"):
        if name == "tensordict" and not os.path.exists(tmp_path / name):
            continue  # tensordict is not installed
        loaded = TensorDict.load_memmap(tmp_path / name)
        assert {key: float(loaded[key].max()) for key in loaded.keys()} == expected
    assert not os.path.exists(tmp_path / "failed")
    assert "failed" in done.stderr and "injected" in done.stderr
    assert str(tmp_path / "failed") in done.stderr


# ------------------------------------------------------------- 3: read-only old versions
def test_atomic_rewrite_and_gc_remove_read_only_old_versions(tmp_path):
    result = _json_child(f"""
        import json, os, subprocess, sys, warnings, torch
        import shared_td
        from shared_td import TensorDict
        base = {str(tmp_path)!r}
        p = os.path.join(base, "p")
        TensorDict(a=torch.full((3,), 1.0), n=TensorDict(b=torch.ones(2))).memmap(p)
        os.chmod(os.path.join(p, "n"), 0o555)
        os.chmod(p, 0o555)
        out = {{}}
        def rewrite(value):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                TensorDict(a=torch.full((3,), value), n=TensorDict(b=torch.ones(2))).memmap_(p, atomic=True)
            return [str(w.message) for w in caught]
        out["exchange"] = rewrite(2.0)
        out["again"] = rewrite(3.0)  # the new version had the old one's mode: read-only too
        # a dead writer's read-only staging directory
        child = subprocess.Popen([sys.executable, "-c", "pass"]); child.wait()
        dead = os.path.join(base, f".p.shared_td-new-{{child.pid}}-0123456789ab")
        os.makedirs(os.path.join(dead, "n"))
        open(os.path.join(dead, "n", "b.memmap"), "w").close()
        os.chmod(os.path.join(dead, "n"), 0o500)
        os.chmod(dead, 0o555)
        out["gc"] = [os.path.basename(path) for path in shared_td.gc(p)]
        out["entries"] = sorted(os.listdir(base))
        out["a"] = TensorDict.load_memmap(p)["a"].tolist()
        os.chmod(p, 0o755); os.chmod(os.path.join(p, "n"), 0o755)
        print(json.dumps(out))
    """, drop_capabilities=True)
    assert result["exchange"] == [] and result["again"] == []
    assert result["gc"] == [f".p.shared_td-new-{_only_pid(result)}-0123456789ab"]
    assert result["entries"] == [".p.lock", "p"]
    assert result["a"] == [3.0] * 3


def _only_pid(result: dict) -> str:
    return result["gc"][0].split("-new-")[1].split("-")[0]


# ------------------------------------------------------------- 4: fail before any byte
def test_rewrite_into_read_only_directory_changes_no_leaf(tmp_path):
    result = _json_child(f"""
        import json, os, sys, torch
        from shared_td import TensorDict
        base = {str(tmp_path)!r}
        out = {{}}
        for read_only in ("root", "nested"):
            p = os.path.join(base, read_only)
            TensorDict(a=torch.full((3,), 1.0), n=TensorDict(b=torch.full((2,), 1.0))).memmap(p)
            os.chmod(p if read_only == "root" else os.path.join(p, "n"), 0o555)
            td = TensorDict(a=torch.full((3,), 2.0), n=TensorDict(b=torch.full((2,), 2.0)))
            try:
                td.memmap_(p)
                out[read_only] = "no error"
            except PermissionError as error:
                out[read_only] = "PermissionError"
            loaded = TensorDict.load_memmap(p)
            out[read_only + " leaves"] = [loaded["a"].tolist(), loaded["n", "b"].tolist()]
            out[read_only + " locked"] = td.is_locked
            os.chmod(p, 0o755); os.chmod(os.path.join(p, "n"), 0o755)
            out[read_only + " files"] = sorted(os.listdir(p)) + sorted(os.listdir(os.path.join(p, "n")))
        print(json.dumps(out))
    """, drop_capabilities=True)
    for read_only in ("root", "nested"):
        assert result[read_only] == "PermissionError"
        assert result[read_only + " leaves"] == [[1.0] * 3, [1.0] * 2]  # not one byte changed
        assert result[read_only + " locked"] is False
        assert result[read_only + " files"] == ["a.memmap", "meta.json", "n", "b.memmap", "meta.json"]


@pytest.mark.parametrize("kwargs", [{}, {"num_threads": 2, "return_early": True}, {"atomic": True}])
@pytest.mark.parametrize("bad, error", [
    (lambda: torch.zeros(2, device="meta"), NotImplementedError),
    (lambda: torch.zeros(2).to_sparse(), RuntimeError),
])
def test_meta_and_sparse_leaves_are_refused_naming_the_key(tmp_path, bad, error, kwargs):
    """Same error types as tensordict 0.15.3 (NotImplementedError, RuntimeError), but
    naming the key, raised by the call before anything is written."""
    td = TensorDict(a=torch.zeros(3), z=TensorDict(m=bad()))
    prefix = tmp_path / "p"
    with pytest.raises(error, match=r"Key \('z', 'm'\)"):
        td.memmap_(prefix, **kwargs)
    assert not prefix.exists() and not td.is_locked
    tensordict = pytest.importorskip("tensordict")
    with pytest.raises(error):
        tensordict.TensorDict(a=torch.zeros(3), z=tensordict.TensorDict(m=bad())).memmap_(tmp_path / "td")


def hold_background_writes(monkeypatch) -> threading.Event:
    """Hold every file write of a worker thread (a return_early or num_threads write)
    until the returned event is set (within 30 s); the calling thread's writes go on."""
    release = threading.Event()
    real = files.pwrite_all

    def held(fd, data, offset, where=""):
        if threading.current_thread() is not threading.main_thread():
            release.wait(30)
        return real(fd, data, offset, where=where)

    monkeypatch.setattr(files, "pwrite_all", held)
    return release


def test_wait_for_a_return_early_write_is_bounded(tmp_path, monkeypatch):
    """A write that would wait longer than SHARED_TD_LOCK_TIMEOUT for an earlier
    return_early write of the same directory raises, naming both and the fix."""
    release = hold_background_writes(monkeypatch)
    monkeypatch.setenv("SHARED_TD_LOCK_TIMEOUT", "0.1")
    prefix = tmp_path / "p"
    future = TensorDict(a=torch.ones(1 << 18)).memmap_(prefix, num_threads=2, return_early=True)
    try:
        other = TensorDict(b=torch.ones(3))
        with pytest.raises(TimeoutError, match=r"(?s)memmap to .*future\.result\(\)") as caught:
            other.memmap_(prefix)
        assert str(prefix) in str(caught.value)
        assert not other.is_locked and not other.is_memmap()
    finally:
        release.set()
    assert future.result(timeout=30)["a"].filename.startswith(str(prefix))
    assert sorted(os.listdir(prefix)) == ["a.memmap", "meta.json"]
