"""A Ctrl-C landing right after a call that takes a resource returns, before the try that
gives it back (inject43). Deterministic: the call is made to raise KeyboardInterrupt
after it returned, as a SIGINT handled there would."""
import gc
import os
import subprocess
import sys

import filelock
import pytest
import torch

import shared_td
from shared_td.containers import consolidation, memmap_methods
from shared_td.persist import writer_lock


def _then_ctrl_c(real):
    def call(*args, **kwargs):
        real(*args, **kwargs)
        raise KeyboardInterrupt
    return call


def _fds():
    gc.collect()
    return len(os.listdir("/proc/self/fd"))


def test_memmap_interrupted_as_it_locks_the_tree_puts_the_lock_back(tmp_path, monkeypatch):
    td = shared_td.TensorDict(a=torch.ones(3), batch_size=[3])
    monkeypatch.setattr(memmap_methods, "lock_until_restored", _then_ctrl_c(memmap_methods.lock_until_restored))
    with pytest.raises(KeyboardInterrupt):
        td.memmap_(str(tmp_path / "p"))
    assert not td.is_locked
    td["b"] = torch.zeros(3)


@pytest.mark.parametrize("where", ["copy_jobs", "lock_until_restored"])
def test_consolidate_to_a_file_interrupted_before_its_copies_leaves_nothing(tmp_path, monkeypatch, where):
    td = shared_td.TensorDict(a=torch.ones(3), b=torch.zeros(2, 2), batch_size=[])
    before = _fds()
    monkeypatch.setattr(consolidation, where, _then_ctrl_c(getattr(consolidation, where)))
    with pytest.raises(KeyboardInterrupt):
        if where == "copy_jobs":
            td.consolidate(filename=str(tmp_path / "c.bin"))
        else:
            td.consolidate(filename=str(tmp_path / "c.bin"), num_threads=2, return_early=True, inplace=True)
    monkeypatch.undo()
    assert os.listdir(tmp_path) == []  # (before: .c.bin.shared_td-new-<pid>-<id>)
    assert _fds() == before
    assert not td.is_locked


def test_writer_lock_interrupted_as_it_is_taken_is_not_left_held(tmp_path, monkeypatch):
    class Interrupted(filelock.FileLock):
        def acquire(self, *args, **kwargs):
            super().acquire(*args, **kwargs)
            raise KeyboardInterrupt

    prefix = str(tmp_path / "p")
    monkeypatch.setattr(writer_lock.filelock, "FileLock", Interrupted)
    with pytest.raises(KeyboardInterrupt) as kept:  # (the exception still held, as in a handler)
        with writer_lock.acquired(prefix):
            pass
    monkeypatch.undo()
    code = ("import sys; from shared_td.persist import writer_lock as wl\n"
            "try:\n    wl.acquired(sys.argv[1], timeout=0.3).__enter__(); print('free')\n"
            "except TimeoutError: print('held')")
    out = subprocess.run([sys.executable, "-c", code, prefix], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "free", (out.stdout, out.stderr[-500:], kept)


def test_a_ctrl_c_as_a_new_prefix_s_parent_is_closed_leaves_no_descriptor(tmp_path, monkeypatch):
    from shared_td.storage import files
    real_exit, calls = files.Directory.__exit__, []

    def first_exit_then_ctrl_c(self, *exc):
        real_exit(self, *exc)
        calls.append(1)
        if len(calls) == 1:  # (the first: _make_root's ``with above:``, the new prefix's parent)
            raise KeyboardInterrupt

    td = shared_td.TensorDict(a=torch.ones(3), batch_size=[3])
    before = _fds()
    monkeypatch.setattr(files.Directory, "__exit__", first_exit_then_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        td.memmap_(str(tmp_path / "new"))
    monkeypatch.undo()
    assert _fds() == before
    assert not (tmp_path / "new").exists()


def test_a_ctrl_c_as_the_tree_is_being_locked_for_memmap_puts_every_lock_back(tmp_path, monkeypatch):
    from shared_td.containers import locking
    real, calls = locking._mark, []

    def ctrl_c_at_the_second_node(node, token):  # (raised as _mark starts: nothing of it done)
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        real(node, token)

    td = shared_td.TensorDict(a=torch.ones(3), n=shared_td.TensorDict(b=torch.ones(3), batch_size=[3]),
                              batch_size=[3])
    monkeypatch.setattr(locking, "_mark", ctrl_c_at_the_second_node)
    with pytest.raises(KeyboardInterrupt):
        td.memmap_(str(tmp_path / "p"))
    monkeypatch.undo()
    assert not td.is_locked and not td["n"].is_locked


def test_a_ctrl_c_while_consolidate_s_new_file_is_mapped_leaves_nothing(tmp_path, monkeypatch):
    from shared_td.containers import consolidated_copy
    td = shared_td.TensorDict(a=torch.ones(3), batch_size=[])
    before = _fds()

    def ctrl_c(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(consolidated_copy.MemoryMappedTensor, "_from_backing", ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        td.consolidate(filename=str(tmp_path / "c.bin"))
    monkeypatch.undo()
    assert os.listdir(tmp_path) == [] and _fds() == before
