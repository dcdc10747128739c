"""Writes that fail for a limit of the process, in child processes with real rlimits.

* A failed ``memmap_(prefix)`` removes the directories it made: the prefix and the
  missing parents it made one by one (the README promises "the files and directories
  the write created are removed"); it left them when opening the new prefix failed
  (out of descriptors) and always left the parents (tensordict 0.15.3 leaves all).
* Out of descriptors (``RLIMIT_NOFILE``), the errors name that limit and the fix,
  also atomic=True's (an ``os.dup`` error that named nothing).
* A file grown past ``RLIMIT_FSIZE`` (``EFBIG``) is a StorageFullError naming that
  limit (``ulimit -f``), not the room left (``--shm-size``).
* An anonymous segment that ``RLIMIT_AS`` cannot map is refused before its memory is
  reserved (it reserved, and zeroed, all of it first).
"""
from __future__ import annotations

import multiprocessing
import os
import resource
import signal

import pytest
import torch

from tests.processes import WAIT, finish

import shared_td

pytestmark = pytest.mark.timeout(60)


def in_child(target, *args):
    """``target(*args)`` in a fork child (where it may lower its limits): what it
    returned, or ``(error type name, message)`` of what it raised."""
    context = multiprocessing.get_context("fork")
    receiver, sender = context.Pipe(duplex=False)

    def run():
        # (a fork child must not use the OpenMP threads of its parent: a big tensor op of
        # a process whose parent ran parallel ops before the fork can hang in libgomp)
        torch.set_num_threads(1)
        try:
            sender.send(("returned", target(*args)))
        except BaseException as error:  # (the test shows it)
            sender.send((type(error).__name__, str(error)))

    process = context.Process(target=run)
    process.start()
    try:
        assert receiver.poll(WAIT), "the child said nothing"
        return receiver.recv()
    finally:
        assert finish(process) == 0


def left_under(directory) -> list[str]:
    return sorted(os.path.relpath(os.path.join(top, name), directory)
                  for top, dirs, files in os.walk(directory) for name in dirs + files)


def one_descriptor_free(free: int = 1) -> list[int]:
    """Lower RLIMIT_NOFILE and take every descriptor but ``free``; returns those taken."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 32, hard))
    taken = []
    try:
        while True:
            taken.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        for _ in range(free):
            os.close(taken.pop())
    return taken


BIG = torch.zeros(1 << 20)  # 4 MiB, made here: the children only write it


def _write_past_fsize(name: str, prefix: str | None):
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # (else the signal kills the process)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    lib = pytest.importorskip("tensordict") if name == "tensordict" else shared_td
    lib.TensorDict({"x": BIG}, batch_size=[]).memmap_(prefix)


@pytest.mark.parametrize("name", ["shared_td", "tensordict"])
def test_a_file_past_rlimit_fsize_leaves_no_directory_and_names_the_limit(name, tmp_path):
    if name == "tensordict":
        pytest.importorskip("tensordict")  # (imported here: the fork child has it then)
    prefix = tmp_path / "a" / "b" / "prefix"  # a/ and a/b/ are made by the write
    kind, message = in_child(_write_past_fsize, name, str(prefix))
    if name == "tensordict":  # tensordict 0.15.3: torch's error, and it leaves them all
        assert kind == "RuntimeError" and "a/b/prefix/x.memmap" in left_under(tmp_path)
        return
    assert kind == "StorageFullError", message
    assert "RLIMIT_FSIZE" in message and "ulimit -f" in message and "--shm-size" not in message
    assert left_under(tmp_path) == []


def test_an_anonymous_segment_past_rlimit_fsize_names_the_limit():
    kind, message = in_child(_write_past_fsize, "shared_td", None)  # (a memfd is a file too)
    assert kind == "StorageFullError" and "RLIMIT_FSIZE" in message and "--shm-size" not in message


def _write_with_one_descriptor_free(prefix: str, atomic: bool, free: int):
    tree = shared_td.TensorDict({"x": torch.zeros(2)}, batch_size=[2])
    taken = one_descriptor_free(free)
    try:
        tree.memmap_(prefix, atomic=atomic)
    finally:
        for fd in taken:
            os.close(fd)


def test_a_new_prefix_that_cannot_be_opened_is_removed(tmp_path):
    kind, message = in_child(_write_with_one_descriptor_free, str(tmp_path / "new" / "prefix"), False, 1)
    assert kind == "OSError" and "Too many open files" in message, message
    assert "RLIMIT_NOFILE" in message and "ulimit -n" in message
    assert left_under(tmp_path) == []  # not new/ nor new/prefix/


def test_an_atomic_write_out_of_descriptors_names_the_limit(tmp_path):
    shared_td.TensorDict({"x": torch.zeros(2)}, batch_size=[2]).memmap_(str(tmp_path / "ok"))
    before = left_under(tmp_path)
    kind, message = in_child(_write_with_one_descriptor_free, str(tmp_path / "ok"), True, 2)
    assert kind == "OSError" and "RLIMIT_NOFILE" in message and "ulimit -n" in message, message
    assert str(tmp_path / "ok") in message
    assert [name for name in left_under(tmp_path) if not name.endswith(".lock")] == before


def _create_under_rlimit_as(nbytes: int):
    from shared_td.storage import anonymous

    def reserve(*args):  # (never reached: had it been, the memory would be reserved here)
        raise AssertionError("the memory was reserved before the mapping was tried")

    anonymous.create_memfd = reserve
    with open("/proc/self/status") as status:
        in_use = int(status.read().split("VmSize:")[1].split()[0]) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (in_use + (64 << 20), resource.RLIM_INFINITY))
    anonymous.Segment.create(nbytes)


def test_a_segment_that_rlimit_as_refuses_reserves_nothing_first():
    kind, message = in_child(_create_under_rlimit_as, 1 << 30)
    assert kind == "MappingError", message
    assert "RLIMIT_AS" in message and "anonymous shared-memory segment" in message


@pytest.mark.parametrize("when", ["before it is opened", "once it is opened"])
def test_parents_removed_by_a_failed_writer_meanwhile_are_made_again(when, tmp_path, monkeypatch):
    """Two writers make the same missing parents; one fails and removes the (empty)
    parents it made while the other has found them: the other makes them again, no
    FileNotFoundError (before: 8 of 40 racing runs failed so)."""
    from shared_td.persist import writer

    parents = [tmp_path / "x" / "y" / "z", tmp_path / "x" / "y", tmp_path / "x"]
    os.makedirs(parents[0])  # made by the writer that is about to fail
    real_open = writer.Directory.open
    removed = []

    def open_directory(path, *args, **kwargs):
        if path != str(parents[0]) or removed:
            return real_open(path, *args, **kwargs)
        if when == "once it is opened":
            opened = real_open(path, *args, **kwargs)
        removed.extend(str(each) for each in parents)
        for each in parents:  # the failed writer's clean-up (_remove_made)
            os.rmdir(each)
        return opened if when == "once it is opened" else real_open(path, *args, **kwargs)

    monkeypatch.setattr(writer.Directory, "open", staticmethod(open_directory))
    td = shared_td.TensorDict({"a": torch.ones(3)}, batch_size=[]).memmap_(str(parents[0] / "B"))
    assert removed and td["a"].tolist() == [1.0] * 3
    assert shared_td.load_memmap(str(parents[0] / "B"))["a"].tolist() == [1.0] * 3
