"""append_memmap: rows appended to a save along its first batch dim, side by side with
tensordict 0.15.3's (which reads what shared_td appends, and appends to shared_td's
saves), refused before anything changes when they do not fit, and one step under
SIGKILLs at random moments and concurrent appenders (real forked processes)."""
from __future__ import annotations

import errno
import multiprocessing
import os
import random
import re
import resource
import signal
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest
import torch

import shared_td
from shared_td import (LazyStackedTensorDict, NonTensorData, NonTensorStack, TensorDict, append_memmap, load_memmap,
                       tensorclass)
from shared_td.persist import atomic
from tests.persist.persist_helpers import dir_state
from tests.reference import needs_tensordict, tensordict

FORK = multiprocessing.get_context("fork")
JOIN = 60


@tensorclass
class Step:
    x: torch.Tensor
    label: str


def _tree(rows: int, first: int = 0) -> TensorDict:
    """``rows`` rows whose every leaf holds its row's number (from ``first``)."""
    numbers = torch.arange(first, first + rows)
    return TensorDict(
        a=numbers.float()[:, None].expand(rows, 2).clone(), s="text",
        n=TensorDict(b=numbers.clone(), m=TensorDict(c=numbers.double()[:, None, None].expand(rows, 4, 1).clone(),
                                                    batch_size=[rows, 4]), batch_size=[rows]),
        step=Step(x=numbers.float(), label="walk", batch_size=[rows]), batch_size=[rows])


def _state(directory) -> dict:
    """dir_state without the writer lock files (which stay, as beside atomic writes)."""
    return {path: value for path, value in dir_state(directory).items() if not path.endswith(".lock")}


def _check_rows(td, rows: int) -> None:
    """Every level has ``rows`` rows and every leaf row i holds i."""
    assert td.batch_size == torch.Size([rows]) and td["n", "m"].batch_size == torch.Size([rows, 4])
    expected = torch.arange(rows)
    for key, leaf in td.items(True, True):
        if isinstance(leaf, torch.Tensor):
            assert leaf.shape[0] == rows and bool((leaf.reshape(rows, -1) == expected[:, None]).all()), key
    assert td["s"] == "text" and td["step"].label == "walk"


def test_rows_are_appended_at_every_level(tmp_path):
    prefix = tmp_path / "replay"
    _tree(3).memmap(prefix)
    append_memmap(prefix, _tree(2, first=3))
    _check_rows(load_memmap(prefix), 5)
    append_memmap(prefix, _tree(0, first=5))  # no row: nothing to do
    append_memmap(str(prefix), _tree(4, first=5))
    _check_rows(load_memmap(prefix), 9)
    assert sorted(os.listdir(tmp_path)) == [".replay.lock", "replay"]  # no staging directory left


def test_a_reader_keeps_the_rows_it_mapped_and_its_memory_mapped_tree_stays_valid(tmp_path):
    prefix = tmp_path / "replay"
    mapped = _tree(3).memmap(prefix)
    reader = load_memmap(prefix)
    append_memmap(prefix, _tree(2, first=3))
    _check_rows(reader, 3)  # the old version's rows, the same files
    mapped["a"][0] = 7.0  # the memory-mapped tree writes into the (same) file
    assert load_memmap(prefix)["a"][0].tolist() == [7.0, 7.0]


@needs_tensordict
def test_interop_with_tensordict_both_ways(tmp_path):
    plain = lambda lib, rows, first: lib.TensorDict(  # noqa: E731
        a=torch.arange(first, first + rows).float()[:, None].expand(rows, 3).clone(), s="x",
        n=lib.TensorDict(b=torch.arange(first, first + rows), batch_size=[rows]), batch_size=[rows])
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    plain(shared_td, 2, 0).memmap(ours)
    append_memmap(ours, plain(shared_td, 3, 2))
    loaded = tensordict.load_memmap(ours)
    assert loaded.batch_size == torch.Size([5]) and loaded["n", "b"].tolist() == [0, 1, 2, 3, 4]
    tensordict.append_memmap(ours, plain(tensordict, 1, 5))
    assert load_memmap(ours)["a"][:, 0].tolist() == [0, 1, 2, 3, 4, 5]
    plain(tensordict, 2, 0).memmap(theirs)
    append_memmap(theirs, plain(shared_td, 2, 2))
    assert tensordict.load_memmap(theirs)["n", "b"].tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("rows, message", [
    (lambda: _tree(2).exclude("s"), r"at the root lack the keys \['s'\]"),
    (lambda: _tree(2).set("extra", torch.zeros(2)), r"hold \['extra'\], which the save lacks"),
    (lambda: _tree(2).apply(lambda x: x.to(torch.int32)), r"'a' is torch.float32 .* torch.int32"),
    (lambda: _tree(2).set("a", torch.zeros(2, 3)), r"'a' .* shape past the first dimension"),
    (lambda: _tree(2).set("s", "other"), r"'s' holds 'text' for every row .* 'other'"),
    (lambda: _tree(2).set(("step", "label"), "run"), r"holds 'walk' for every row"),
    (lambda: shared_td.lazy_stack([_tree(1), _tree(1)], 1), "batch size"),  # (rows of a lazy stack: made dense)
    (lambda: TensorDict(a=torch.zeros(2, 2)), "batch size"),
])
def test_rows_that_do_not_fit_are_refused_before_anything_changes(tmp_path, rows, message):
    prefix = tmp_path / "replay"
    _tree(3).memmap(prefix)
    before = _state(tmp_path)
    with pytest.raises(ValueError, match=message):
        append_memmap(prefix, rows())
    assert _state(tmp_path) == before


@pytest.mark.parametrize("saved, message", [
    (lambda: shared_td.lazy_stack([_tree(1), _tree(1)]), "a lazy stack, which cannot grow"),
    (lambda: TensorDict(t=NonTensorStack("a", "b"), batch_size=[2]), "'t' of the save is a NonTensorStack"),
    (lambda: TensorDict(x=torch.zeros(())), "no batch dimension"),
])
def test_what_cannot_grow_is_refused(tmp_path, saved, message):
    prefix = tmp_path / "saved"
    saved().memmap(prefix)
    before = _state(tmp_path)
    with pytest.raises(ValueError, match=message):
        append_memmap(prefix, saved())
    assert _state(tmp_path) == before


def test_a_prefix_that_is_no_save_is_refused(tmp_path):
    _tree(2).memmap(tmp_path / "run.tdz")
    (tmp_path / "photos").mkdir()
    (tmp_path / "photos" / "a.jpg").write_bytes(b"x")
    before = _state(tmp_path)
    with pytest.raises(ValueError, match="an archive cannot grow"):
        append_memmap(tmp_path / "run.tdz", _tree(1))
    with pytest.raises(ValueError, match="is not a saved tensordict"):
        append_memmap(tmp_path / "photos", _tree(1))
    with pytest.raises(ValueError, match="is not a directory"):
        append_memmap(tmp_path / "missing", _tree(1))
    assert _state(tmp_path) == before


def test_a_symlinked_prefix_appends_to_its_target_and_keeps_the_link(tmp_path):
    _tree(2).memmap(tmp_path / "real")
    os.symlink(tmp_path / "real", tmp_path / "link")
    append_memmap(tmp_path / "link", _tree(1, first=2))
    assert os.path.islink(tmp_path / "link")
    _check_rows(load_memmap(tmp_path / "real"), 3)


def test_a_filesystem_without_hard_links_changes_nothing(tmp_path, monkeypatch):
    prefix = tmp_path / "replay"
    _tree(3).memmap(prefix)
    before = _state(tmp_path)

    def refuse(*args, **kwargs):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", refuse)
    with pytest.raises(OSError, match="could not be linked: Operation not permitted. Nothing changed"):
        append_memmap(prefix, _tree(2, first=3))
    assert _state(tmp_path) == before  # (the staging directory removed)


def test_bytes_left_by_an_append_cut_short_are_overwritten(tmp_path):
    prefix = tmp_path / "replay"
    _tree(3).memmap(prefix)
    leaf = prefix / "n" / "b.memmap"
    with open(leaf, "ab") as file:
        file.write(b"\xff" * 100)  # past the declared 24 bytes, as a killed append leaves them
    _check_rows(load_memmap(prefix), 3)
    append_memmap(prefix, _tree(1, first=3))
    _check_rows(load_memmap(prefix), 4)
    assert os.path.getsize(leaf) == 4 * 8


@pytest.mark.parametrize("saved, rows", [
    (lambda: TensorDict(a=torch.zeros(0, 2), batch_size=[0]),
     lambda: TensorDict(a=torch.arange(4.).reshape(2, 2), batch_size=[2])),
    (lambda: TensorDict(a=torch.zeros(3, 0), b=torch.zeros(3), batch_size=[3]),
     lambda: TensorDict(a=torch.zeros(2, 0), b=torch.ones(2), batch_size=[2])),
], ids=["no row saved", "no element per row"])
def test_leaves_without_a_file_grow(tmp_path, saved, rows):
    """Neither library writes a file for an empty leaf: the append makes one (it raised
    'The MemoryMappedTensor has no file associated')."""
    saved().memmap(tmp_path / "s")
    append_memmap(tmp_path / "s", rows())
    assert (load_memmap(tmp_path / "s") == torch.cat([saved(), rows()])).all()
    if tensordict is not None:
        assert tensordict.load_memmap(tmp_path / "s")["b" if "b" in saved().keys() else "a"].shape[0] == \
            saved().batch_size[0] + rows().batch_size[0]


def test_rows_of_a_lazy_stack_are_appended_and_what_is_no_tensordict_is_a_type_error(tmp_path):
    TensorDict(a=torch.zeros(3), batch_size=[3]).memmap(tmp_path / "s")
    append_memmap(tmp_path / "s", LazyStackedTensorDict.lazy_stack([TensorDict(a=torch.ones(())) for _ in range(2)]))
    assert load_memmap(tmp_path / "s")["a"].tolist() == [0, 0, 0, 1, 1]
    for rows in ({"a": torch.ones(2)}, torch.ones(2)):
        with pytest.raises(TypeError, match="rows are a TensorDict, a lazy stack or a tensorclass instance"):
            append_memmap(tmp_path / "s", rows)


@needs_tensordict
def test_rows_of_tensordicts_own_class_are_named_with_its_module(tmp_path):
    TensorDict(a=torch.zeros(3), batch_size=[3]).memmap(tmp_path / "s")
    with pytest.raises(TypeError, match=r"of shared_td, not a tensordict\.\S*TensorDict"):
        append_memmap(tmp_path / "s", tensordict.TensorDict(a=torch.ones(2), batch_size=[2]))


def test_a_nested_level_of_a_save_is_refused(tmp_path):
    _tree(2).memmap(tmp_path / "s")
    before = _state(tmp_path)
    with pytest.raises(ValueError, match="lies inside the save"):
        append_memmap(tmp_path / "s" / "n", _tree(1)["n"])
    assert _state(tmp_path) == before and not os.path.exists(tmp_path / "s" / ".n.lock")


def test_a_failed_append_leaves_no_bytes_past_the_declared_size(tmp_path):
    """A full disk (RLIMIT_FSIZE, in a fresh interpreter): the rows written into the saved
    leaf files (the same inodes as the staging directory's links) are cut off again."""
    prefix = tmp_path / "s"
    TensorDict(a=torch.zeros(3, 1000), batch_size=[3]).memmap(prefix)
    script = ("import torch, shared_td\n"
              "try:\n"
              f"    shared_td.append_memmap({str(prefix)!r}, shared_td.TensorDict(a=torch.ones(50, 1000), batch_size=[50]))\n"
              "except OSError:\n"
              "    raise SystemExit(0)\n"
              "raise SystemExit(1)\n")

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))

    done = subprocess.run([sys.executable, "-c", script], preexec_fn=limit, timeout=120)
    assert done.returncode == 0
    assert os.path.getsize(prefix / "a.memmap") == 12000
    assert load_memmap(prefix).batch_size == torch.Size([3])
    assert sorted(os.listdir(tmp_path)) == [".s.lock", "s"]


def test_append_memmap_keeps_the_grown_files_when_an_error_comes_after_the_swap(tmp_path, monkeypatch):
    d = str(tmp_path / "save")
    TensorDict(a=torch.arange(3.0), batch_size=[3]).memmap(d)

    def busy(path):
        raise OSError(16, "busy")

    monkeypatch.setattr(atomic, "remove_tree", busy)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(RuntimeWarning):
            shared_td.append_memmap(d, TensorDict(a=torch.tensor([7.0, 8.0]), batch_size=[2]))
    monkeypatch.undo()
    assert shared_td.load_memmap(d)["a"].tolist() == [0.0, 1.0, 2.0, 7.0, 8.0]


def test_append_memmap_to_a_save_written_inside_another_saves_directory(tmp_path):
    TensorDict(a=torch.zeros(2), batch_size=[2]).memmap(str(tmp_path / "run"))
    TensorDict(b=torch.ones(3), batch_size=[3]).memmap(str(tmp_path / "run" / "extra"))
    shared_td.append_memmap(str(tmp_path / "run" / "extra"), TensorDict(b=torch.full((2,), 5.0), batch_size=[2]))
    assert shared_td.load_memmap(str(tmp_path / "run" / "extra"))["b"].tolist() == [1.0, 1.0, 1.0, 5.0, 5.0]


def test_append_memmap_still_refuses_a_nested_level(tmp_path):
    TensorDict(n=TensorDict(c=torch.zeros(2), batch_size=[2]), batch_size=[2]).memmap(str(tmp_path / "run"))
    with pytest.raises(ValueError, match="nested levels"):
        shared_td.append_memmap(str(tmp_path / "run" / "n"), TensorDict(c=torch.ones(1), batch_size=[1]))


# fuzz round 9
@shared_td.tensorclass
class _Obs:
    obs: torch.Tensor
    info: str


def test_lazy_rows_with_a_tensorclass_entry_are_appended(tmp_path):
    prefix = tmp_path / "s"
    td = shared_td.TensorDict(
        {"a": torch.zeros(2), "n": shared_td.TensorDict({"tc": _Obs(obs=torch.zeros(2, 3), info="u", batch_size=[2])}, [2]),
         "tc": _Obs(obs=torch.zeros(2), info="u", batch_size=[2])}, [2])
    td.memmap(prefix)
    more = td.clone()
    more["a"] += 1
    more["tc"].obs += 2
    shared_td.append_memmap(prefix, shared_td.lazy_stack(list(more.unbind(0)), dim=0))
    out = shared_td.load_memmap(prefix)
    assert out.batch_size == torch.Size([4])
    assert isinstance(out["tc"], _Obs) and isinstance(out["n", "tc"], _Obs)
    assert out["a"].tolist() == [0, 0, 1, 1]
    assert out["tc"].obs.tolist() == [0, 0, 2, 2]
    assert out["n", "tc"].obs.shape == (4, 3)
    assert out["tc"].info == "u"


@pytest.mark.parametrize("rows", [{"a": torch.zeros(1)}, 3, None])
def test_rows_that_are_no_tensordict_are_a_type_error_before_the_save_is_read(tmp_path, rows):
    prefix = tmp_path / "s"
    shared_td.lazy_stack([shared_td.TensorDict(a=torch.zeros(2)), shared_td.TensorDict(a=torch.ones(2))]).memmap(prefix)
    with pytest.raises(TypeError, match="rows"):
        shared_td.append_memmap(prefix, rows)
    assert shared_td.load_memmap(prefix).batch_size == torch.Size([2])


def test_a_prefix_that_is_no_directory_is_still_a_value_error_first(tmp_path):
    with pytest.raises(ValueError):
        shared_td.append_memmap(tmp_path / "missing", {"a": 1})


# the final review
@pytest.mark.parametrize("value, stacked", [([1, 2], True), ([1, 2], False), (np.array([1, 2]), False),
                                            ("x", True)])
def test_rows_holding_the_saved_non_tensor_value_are_appended(tmp_path, value, stacked):
    prefix = tmp_path / "replay"
    TensorDict(obs=torch.zeros(3), tag=NonTensorData(value, batch_size=[3]), batch_size=[3]).memmap(prefix)
    if stacked:  # (a NonTensorStack of that value in each row: tolist() nests a list value)
        rows = torch.stack([TensorDict(obs=torch.ones(()), tag=NonTensorData(value)) for _ in range(2)])
    else:
        rows = TensorDict(obs=torch.ones(2), tag=NonTensorData(value, batch_size=[2]), batch_size=[2])
    append_memmap(prefix, rows, allow_pickle=True)
    out = load_memmap(prefix, allow_pickle=True)
    assert out.batch_size == torch.Size([5]) and out["obs"].tolist() == [0, 0, 0, 1, 1]


# ------------------------------------------------------------ real processes
def _append_forever(prefix: str, first: int) -> None:  # a forked child: killed by the test
    rows = first
    while True:
        append_memmap(prefix, _tree(64, first=rows))
        rows += 64


def _saved_rows(prefix) -> int:
    td = load_memmap(prefix)
    _check_rows(td, td.batch_size[0])
    return td.batch_size[0]


def test_sigkill_at_random_moments_leaves_the_old_or_the_new_save(tmp_path):
    prefix, rng = tmp_path / "replay", random.Random(2024)
    _tree(64).memmap(prefix)
    rows, grew, rounds = 64, 0, 0
    while rounds < 8 or (not grew and rounds < 30):  # (on a slow machine, until one append landed)
        rounds += 1
        child = FORK.Process(target=_append_forever, args=(str(prefix), rows))
        child.start()
        time.sleep(rng.uniform(0.05, 0.4))
        child.kill()
        child.join(JOIN)
        assert child.exitcode == -9
        now = _saved_rows(prefix)  # every level the same number of rows, each row its own
        assert now >= rows and (now - rows) % 64 == 0
        grew += now > rows
        rows = now
    append_memmap(prefix, _tree(64, first=rows))  # sweeps what the killed appends left beside it
    assert _saved_rows(prefix) == rows + 64
    assert sorted(os.listdir(tmp_path)) == [".replay.lock", "replay"]
    assert grew  # (the kills did not all come before a first append)


def _append_rows(prefix: str, values: list) -> None:  # a forked child
    for value in values:
        rows = _tree(1)
        rows.apply_(lambda leaf: leaf.fill_(value))
        append_memmap(prefix, rows)


def test_concurrent_appenders_each_land_every_row_once(tmp_path):
    prefix = tmp_path / "replay"
    _tree(1).memmap(prefix)
    children = [FORK.Process(target=_append_rows, args=(str(prefix), list(range(first, 40, 2))))
                for first in (1, 2)]
    for child in children:
        child.start()
    for child in children:
        child.join(JOIN)
        assert child.exitcode == 0
    values = load_memmap(prefix)["n", "b"].tolist()
    assert sorted(values) == list(range(40))  # every row once, none torn or lost


def _append_blocked_at(prefix: str, point: str, ready) -> None:  # a forked child: killed at ``point``
    import shared_td.persist.append as append_module

    def block(original):
        def blocked(*args, **kwargs):
            if point != "after first grow" or blocked.calls:
                ready.set()
                time.sleep(JOIN)
            blocked.calls += 1
            return original(*args, **kwargs)

        blocked.calls = 0
        return blocked

    if point == "swap":
        append_module.atomic.swap_into_place = block(append_module.atomic.swap_into_place)
    elif point == "mirror":
        append_module._link = block(append_module._link)
    else:
        append_module._grow = block(append_module._grow)
    append_memmap(prefix, _tree(64, first=64))


@pytest.mark.parametrize("point", ["mirror", "after first grow", "swap"])
def test_sigkill_at_each_step_leaves_the_old_save(tmp_path, point):
    """Killed while linking, between two leaves grown, or just before the swap: the save
    holds its old rows at every level (the leaves may hold bytes past them)."""
    prefix = tmp_path / "replay"
    _tree(64).memmap(prefix)
    ready = FORK.Event()
    child = FORK.Process(target=_append_blocked_at, args=(str(prefix), point, ready))
    child.start()
    assert ready.wait(JOIN)
    child.kill()
    child.join(JOIN)
    assert _saved_rows(prefix) == 64
    assert any(name.startswith(".replay.shared_td-new-") for name in os.listdir(tmp_path))  # its staging
    shared_td.gc(prefix)
    assert sorted(os.listdir(tmp_path)) == [".replay.lock", "replay"]
    append_memmap(prefix, _tree(64, first=64))
    assert _saved_rows(prefix) == 128


def _damage_truncated(leaf):
    os.truncate(leaf, 4)


def _damage_symlink(leaf):
    os.replace(leaf, leaf + ".moved")
    os.symlink(os.path.basename(leaf) + ".moved", leaf)


def _damage_fifo(leaf):
    os.remove(leaf)
    os.mkfifo(leaf)


@pytest.mark.parametrize("damage, message", [
    (_damage_truncated, "holds 4 bytes and its meta.json declares 96: the save is damaged"),
    (_damage_symlink, "is not a regular file"),
    (_damage_fifo, "is not a regular file"),
    (os.remove, "the save lacks the file of the entry ('n', 'm', 'c')"),
])
def test_a_damaged_leaf_file_is_refused_by_its_key_before_anything_changes(tmp_path, damage, message):
    # The save's leaves are checked from their meta.json and files without mapping them:
    # one that is too short, not a regular file or missing is a FormatError naming its key,
    # as a load's (a grown short file would have put the rows at the wrong place).
    prefix = tmp_path / "replay"
    _tree(3).memmap(prefix)
    leaf = str(prefix / "n" / "m" / "c.memmap")
    damage(leaf)
    before = _state(prefix)
    with pytest.raises(shared_td.FormatError, match=re.escape(message)):  # (a ValueError and a RuntimeError)
        append_memmap(prefix, _tree(2, first=3))
    assert _state(prefix) == before


def test_append_memmap_maps_no_leaf_of_the_save(tmp_path, monkeypatch):
    # Only the save's structure is read to check the rows: mapping (and unmapping) every
    # leaf was half the time of an append of one row to a tree of 100 leaves.
    prefix = tmp_path / "replay"
    _tree(3).memmap(prefix)
    mapped = []
    real = shared_td.persist.loader.Loader._map_leaf
    monkeypatch.setattr(shared_td.persist.loader.Loader, "_map_leaf",
                        lambda self, *args: mapped.append(args) or real(self, *args))
    append_memmap(prefix, _tree(2, first=3))
    assert mapped == []
    monkeypatch.undo()
    _check_rows(load_memmap(prefix), 5)


def test_a_leaf_file_cut_by_a_writer_that_takes_no_lock_during_the_append_is_refused(tmp_path, monkeypatch):
    # Checked before the staging directory is made, the size is checked again where the
    # rows are written: a shorter file grown at its declared size would leave a hole of
    # zeros before the rows, taken for rows by the next load.
    from shared_td.persist import append as append_module
    prefix = tmp_path / "replay"
    _tree(3).memmap(prefix)
    leaf = prefix / "n" / "m" / "c.memmap"
    real = append_module._mirror

    def mirror_then_cut(*args):
        real(*args)
        os.truncate(leaf, 8)

    monkeypatch.setattr(append_module, "_mirror", mirror_then_cut)
    with pytest.raises(ValueError, match="holds 8 bytes, fewer than the 96 its meta.json declares: the save "
                                         "changed during the append"):
        append_memmap(prefix, _tree(2, first=3))
    assert os.path.getsize(leaf) == 8 and os.path.getsize(prefix / "a.memmap") == 3 * 2 * 4
    assert sorted(os.listdir(tmp_path)) == [".replay.lock", "replay"]


def _two_level_rows(rows, first=0):
    n = torch.arange(first, first + rows).float()
    return TensorDict(a=n.clone(), n=TensorDict(c=n.clone(), batch_size=[rows]), batch_size=[rows])


def test_a_leaf_file_shared_with_another_save_is_grown_as_a_copy(tmp_path):
    # rows grew each leaf file in place: a file with another name (a `cp -al` snapshot)
    # grew too, and the snapshot's next append cut the save's rows off again; such a
    # file is now copied into the new version, so the other names keep their bytes
    main, snapshot = tmp_path / "main", tmp_path / "snapshot"
    _two_level_rows(3).memmap(main)
    subprocess.run(["cp", "-al", str(main), str(snapshot)], check=True, timeout=60)
    append_memmap(main, _two_level_rows(2, first=3))
    append_memmap(snapshot, _two_level_rows(1, first=7))
    assert load_memmap(main)["n", "c"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert load_memmap(snapshot)["a"].tolist() == [0.0, 1.0, 2.0, 7.0]
    assert os.stat(main / "a.memmap").st_nlink == 1 and os.path.getsize(snapshot / "a.memmap") == 4 * 4


def test_two_keys_on_one_inode_each_grow_their_own_copy(tmp_path):
    # (else key a's new rows were b's: both keys read [0, 0, 0, 2])
    prefix = tmp_path / "save"
    TensorDict(a=torch.zeros(3), b=torch.zeros(3), batch_size=[3]).memmap(prefix)
    os.remove(prefix / "b.memmap")
    os.link(prefix / "a.memmap", prefix / "b.memmap")
    append_memmap(prefix, TensorDict(a=torch.ones(1), b=torch.full((1,), 2.0), batch_size=[1]))
    loaded = load_memmap(prefix)
    assert loaded["a"].tolist() == [0.0, 0.0, 0.0, 1.0] and loaded["b"].tolist() == [0.0, 0.0, 0.0, 2.0]


def test_an_append_after_one_whose_old_version_could_not_be_removed(tmp_path, monkeypatch):
    # the retired version (a leftover of this live process, which gc keeps) shares every
    # leaf file: the next append in this process was refused ("has 2 names") until it exited
    prefix = tmp_path / "replay"
    TensorDict(obs=torch.zeros(3, 2), batch_size=[3]).memmap(prefix)
    real = atomic.remove_tree

    def failing_once(path, *args, **kwargs):
        monkeypatch.setattr(atomic, "remove_tree", real)
        raise PermissionError(errno.EACCES, "Permission denied", path)

    monkeypatch.setattr(atomic, "remove_tree", failing_once)
    with pytest.warns(RuntimeWarning, match="could not be removed"):
        append_memmap(prefix, TensorDict(obs=torch.ones(1, 2), batch_size=[1]))
    append_memmap(prefix, TensorDict(obs=torch.full((1, 2), 2.0), batch_size=[1]))
    assert load_memmap(prefix)["obs"][:, 0].tolist() == [0.0, 0.0, 0.0, 1.0, 2.0]
    retired = [e for e in os.listdir(tmp_path) if "shared_td-" in e]
    assert len(retired) == 1 and load_memmap(tmp_path / retired[0])["obs"].shape == (3, 2)


def test_a_nested_level_swapped_for_a_symlink_during_the_append_writes_no_file_outside(tmp_path, monkeypatch):
    # the staging directory mirrors what is there when it is made: a level turned into a
    # symlink after the load (which refuses one) must not lead the rows (or the cut of a
    # failed append) into a file outside the save
    from shared_td.persist import append as append_module
    prefix, victim = tmp_path / "save", tmp_path / "victim"
    _two_level_rows(3).memmap(prefix)
    victim.mkdir()
    (victim / "c.memmap").write_bytes(b"precious " * 10)
    real = append_module._mirror

    def swap_then_mirror(source, staging, rows):  # another process, between the check and the links
        os.rename(prefix / "n", tmp_path / "n.moved")
        os.symlink(victim, prefix / "n")
        real(source, staging, rows)

    monkeypatch.setattr(append_module, "_mirror", swap_then_mirror)
    with pytest.raises(RuntimeError, match="Refusing to append rows through symlink"):
        append_memmap(prefix, _two_level_rows(2, first=3))
    assert (victim / "c.memmap").read_bytes() == b"precious " * 10
    assert sorted(os.listdir(tmp_path)) == [".save.lock", "n.moved", "save", "victim"]
