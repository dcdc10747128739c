"""The sweep of ``shared_td-coord-new-XXXXXXXX`` directories: a maker (make_private_dir)
SIGKILLed between its mkdtemp and its rename left one for ever; the sweep now removes
it once nobody holds it and it is older than NEW_DIR_GRACE_S, and never a live maker's,
a fresh one or a name it did not make. Each test lists only its own tmp_path."""
from __future__ import annotations

import multiprocessing
import os
import signal
import time

import pytest

from tests.processes import WAIT, finish

from shared_td import platform
from shared_td.coordinator import server

pytestmark = pytest.mark.timeout(120)
FORK = multiprocessing.get_context("fork")
OLD = 2 * server.NEW_DIR_GRACE_S  # seconds: made this long ago, it is abandoned


def new_dirs(root) -> list[str]:
    """The ``new-`` directories under the test's own ``root``."""
    return sorted(str(root / name) for name in os.listdir(root) if server.NEW_DIR_PATTERN.match(name))


def age(path, seconds: float = OLD) -> None:
    """Make ``path`` look made ``seconds`` ago (its mtime, as if its maker died then)."""
    then = time.time() - seconds
    os.utime(path, (then, then), follow_symlinks=False)


def _kill_self(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)


def make_and_die_at(root: str, point: str) -> None:
    """make_private_dir(root), SIGKILLed at ``point``: "flock" (after the mkdtemp, before
    the flock) or "rename" (holding the flock, before the rename)."""
    if point == "flock":
        server.platform.try_flock = _kill_self
    else:
        os.rename = _kill_self  # (this process's os module: it is a forked child)
    server.make_private_dir(root)
    os._exit(3)  # not reached: the kill came first


def make_and_stop_before_rename(root: str, ready) -> None:
    """make_private_dir(root), stopped with the flock held, before the rename (a live
    maker); ``ready`` is set there. Ends after WAIT seconds if nobody kills it."""
    def stopped(*args, **kwargs):
        ready.set()
        time.sleep(WAIT)
        os._exit(4)

    os.rename = stopped
    server.make_private_dir(root)


def make_after_a_stall(root: str, stalled, resume, out) -> None:
    """make_private_dir(root) stalled between its mkdtemp and its flock until ``resume``
    (``stalled`` set there); writes the directory it returned and whether it holds it."""
    real, calls = server.platform.try_flock, []

    def slow_flock(fd):
        calls.append(fd)
        if len(calls) == 1:  # the first directory's flock only
            stalled.set()
            if not resume.wait(WAIT):
                os._exit(5)
        return real(fd)

    server.platform.try_flock = slow_flock
    directory, fd = server.make_private_dir(root)
    probe = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    held = not platform.try_flock(probe)  # another open file: fails while fd holds it
    os.close(probe)
    with open(out, "w") as report:
        report.write(f"{directory}\n{held}\n")
    os.rmdir(directory)
    os.close(fd)
    os._exit(0)


@pytest.mark.parametrize("point", ["flock", "rename"])
def test_a_maker_killed_before_its_rename_leaves_a_dir_the_sweep_removes_once_old(tmp_path, point):
    maker = FORK.Process(target=make_and_die_at, args=(str(tmp_path), point))
    maker.start()
    assert finish(maker) == -signal.SIGKILL
    [left] = new_dirs(tmp_path)
    assert os.listdir(tmp_path) == [os.path.basename(left)]  # made, never renamed
    # fresh: it could be a live maker's between its mkdtemp and its flock
    assert server.sweep_dead_dirs(str(tmp_path)) == [] and os.path.isdir(left)
    age(left)
    assert server.sweep_dead_dirs(str(tmp_path)) == [left]
    assert os.listdir(tmp_path) == []


def test_a_live_makers_dir_and_a_fresh_one_are_left_alone(tmp_path):
    ready = FORK.Event()
    maker = FORK.Process(target=make_and_stop_before_rename, args=(str(tmp_path), ready))
    maker.start()
    try:
        assert ready.wait(WAIT), "the maker never reached its rename"
        [locked] = new_dirs(tmp_path)
        age(locked)  # old, but locked: its maker lives
        fresh = str(tmp_path / "shared_td-coord-new-fresh000")  # unlocked, but young
        os.mkdir(fresh)
        assert server.sweep_dead_dirs(str(tmp_path)) == []
        assert os.path.isdir(locked) and os.path.isdir(fresh)
    finally:
        maker.kill()
        assert finish(maker) == -signal.SIGKILL
    # the kernel dropped the dead maker's lock: only its directory goes
    assert server.sweep_dead_dirs(str(tmp_path)) == [locked]
    assert new_dirs(tmp_path) == [fresh]


def test_the_sweep_touches_no_other_name_and_nothing_it_did_not_make(tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir()
    kept = [str(tmp_path / name) for name in (
        "shared_td-coord-new-abc1234",     # 7 characters: not mkdtemp's
        "shared_td-coord-new-abcd12345",   # 9
        "shared_td-coord-new-ABCD1234",    # not mkdtemp's alphabet
        "shared_td-coord-new-abcd1234.x",
        "shared_td-coord-new-abcd-234",
        "xshared_td-coord-new-abcd1234",
    )]
    for path in kept:
        os.mkdir(path)
    not_ours = str(tmp_path / "shared_td-coord-new-full0000")  # ours are empty until renamed
    os.mkdir(not_ours)
    with open(os.path.join(not_ours, "data"), "w") as file:
        file.write("a user's")
    a_file = str(tmp_path / "shared_td-coord-new-file0000")
    with open(a_file, "w") as file:
        file.write("not a directory")
    link = str(tmp_path / "shared_td-coord-new-link0000")
    os.symlink(target, link)
    everything = kept + [not_ours, a_file, link, str(target)]
    for path in everything:
        age(path)
    assert server.sweep_dead_dirs(str(tmp_path)) == []
    assert all(os.path.lexists(path) for path in everything)
    assert os.path.isfile(os.path.join(not_ours, "data")) and os.path.islink(link)


@pytest.mark.parametrize("sweeper", ["removed", "holds"])
def test_a_maker_stalled_past_the_grace_makes_another_dir(tmp_path, sweeper):
    """A maker stopped longer than NEW_DIR_GRACE_S between its mkdtemp and its flock:
    the sweep takes that directory (it removed it, or holds it while removing it), and
    the maker, resumed, leaves it and returns another, locked, directory."""
    stalled, resume = FORK.Event(), FORK.Event()
    out = str(tmp_path / "report")
    root = tmp_path / "root"
    root.mkdir()
    maker = FORK.Process(target=make_after_a_stall, args=(str(root), stalled, resume, out))
    maker.start()
    try:
        assert stalled.wait(WAIT), "the maker never reached its flock"
        [taken] = new_dirs(root)
        age(taken)
        if sweeper == "removed":
            assert server.sweep_dead_dirs(str(root)) == [taken]
            resume.set()
            assert finish(maker) == 0
        else:  # a sweeper between its flock and its rmdir
            fd = os.open(taken, os.O_RDONLY | os.O_DIRECTORY)
            try:
                assert platform.try_flock(fd)
                resume.set()
                assert finish(maker) == 0
            finally:
                os.close(fd)
            assert server.sweep_dead_dirs(str(root)) == [taken]
    finally:
        resume.set()
        finish(maker)
    with open(out) as report:
        directory, held = report.read().split()
    assert server.DIR_PATTERN.match(os.path.basename(directory)) and directory != taken
    assert held == "True"
    assert os.listdir(root) == []  # the maker removed its own directory, the sweep the other
