"""Archives (``save("x.tdz")``, pack_memmap, unpack_memmap, load_memmap of a zip):
round trips, mapping in place, compression, damage, atomicity under real failures.

Interop with tensordict 0.15.3 is in tests/interop/test_archive_interop.py.
"""
from __future__ import annotations

import json
import multiprocessing
import os
import pickle
import random
import signal
import stat
import struct
import subprocess
import threading
import time
import zipfile

import pytest
import torch

from tests.persist import archive_children as kids
from tests.persist.archive_children import inside, maps_of, saved_archive
from tests.persist import atomic_children
from tests.persist.persist_helpers import dir_state
from tests.processes import WAIT, finish, small_tmpfs

import shared_td
from shared_td import (
    FormatError, LazyStackedTensorDict, NonTensorData, ReadOnlyError, TensorDict,
    is_memmap_archive, load_memmap, pack_memmap, tensorclass, unpack_memmap,
)
from shared_td.errors import AtomicWriteError, StorageFullError
from shared_td.persist import archive_write

FORK = multiprocessing.get_context("fork")
SPAWN = multiprocessing.get_context("spawn")
DTYPES = [
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.uint16, torch.uint32, torch.uint64, torch.float16, torch.bfloat16,
    torch.float32, torch.float64, torch.complex32, torch.complex64, torch.complex128,
] + [getattr(torch, name) for name in dir(torch) if name.startswith("float8_")]
COMPRESSIONS = ["stored", "deflate", "bzip2", "lzma", zipfile.ZIP_DEFLATED]


@tensorclass
class Step:
    obs: torch.Tensor
    label: str


def tree() -> TensorDict:
    return TensorDict(
        a=torch.arange(12, dtype=torch.float32).reshape(3, 4),
        nested=TensorDict(b=torch.arange(3, dtype=torch.int64), deeper=TensorDict(c=torch.ones(3, 2), batch_size=[3]),
                          batch_size=[3]),
        text="hello",
        empty=torch.zeros(3, 0),
        stack=LazyStackedTensorDict(*[TensorDict(x=torch.full((2,), float(i))) for i in range(3)]),
        batch_size=[3],
    )


def same(loaded, expected) -> None:
    assert set(loaded.keys(True, True)) == set(expected.keys(True, True))
    for key in expected.keys(True, True):
        want, got = expected.get(key), loaded.get(key)
        if isinstance(want, torch.Tensor):
            assert got.dtype == want.dtype and got.shape == want.shape, key
            assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), key
        else:
            assert got == want, key


def listing(directory) -> list[str]:
    return sorted(os.listdir(directory))


# ------------------------------------------------------------------ round trips
@pytest.mark.parametrize("how", ["suffix", "archive=True", "shared_td.save"])
def test_round_trip_of_a_nested_tree(tmp_path, how):
    td = tree()
    if how == "suffix":
        path, out = tmp_path / "t.tdz", td.save(tmp_path / "t.tdz")
    elif how == "archive=True":
        path, out = tmp_path / "t.zip", td.memmap(tmp_path / "t.zip", archive=True)
    else:
        path, out = tmp_path / "t.tdz", shared_td.save(td, tmp_path / "t.tdz")
    assert os.path.isfile(path) and is_memmap_archive(path)
    assert listing(tmp_path) == sorted([path.name, f".{path.name}.lock"])  # nothing else left
    same(out, td)
    assert out.is_locked
    loaded = TensorDict.load_memmap(path)
    same(loaded, td)
    assert isinstance(loaded.get("stack"), LazyStackedTensorDict)
    assert loaded.batch_size == td.batch_size


def test_archive_false_with_a_tdz_suffix_writes_a_directory(tmp_path):
    tree().save(tmp_path / "d.tdz", archive=False)
    assert os.path.isdir(tmp_path / "d.tdz")


def test_every_dtype_and_empty_tensors(tmp_path):
    leaves = {str(dtype).split(".")[1]: torch.arange(6).reshape(2, 3).to(dtype) for dtype in DTYPES}
    leaves["scalar"] = torch.tensor(3.5)
    leaves["none"] = torch.empty(0, dtype=torch.int16)
    td = TensorDict(leaves, [])
    td.save(tmp_path / "d.tdz")
    loaded = load_memmap(tmp_path / "d.tdz")
    same(loaded, td)
    for key, value in loaded.items():
        if value.numel():
            # aligned: every leaf is a view of the one mapping (no copy)
            assert value._byte_offset() % 64 == 0, key


def test_tensorclass_and_non_tensor_data(tmp_path):
    step = Step(obs=torch.ones(2, 3), label="go", batch_size=[2])
    step.save(tmp_path / "s.tdz")
    assert is_memmap_archive(tmp_path / "s.tdz")
    loaded = Step.load_memmap(tmp_path / "s.tdz")
    assert type(loaded) is Step and loaded.label == "go" and torch.equal(loaded.obs, step.obs)
    nt = NonTensorData(data={"any": [1, 2]}, batch_size=[])
    nt.save(tmp_path / "n.tdz")
    loaded = load_memmap(tmp_path / "n.tdz")
    assert loaded.data == {"any": [1, 2]}


def test_pickled_non_tensor_values_need_allow_pickle(tmp_path):
    td = TensorDict(obj=NonTensorData(data={1, 2}, batch_size=[]), batch_size=[])
    out = td.save(tmp_path / "p.tdz")  # the writer itself loads what it wrote
    assert out["obj"] == {1, 2}
    with pytest.raises(RuntimeError, match="allow_pickle"):
        load_memmap(tmp_path / "p.tdz")
    assert load_memmap(tmp_path / "p.tdz", allow_pickle=True)["obj"] == {1, 2}


def test_subpath_and_threads(tmp_path):
    td = tree()
    td.save(tmp_path / "t.tdz")
    nested = load_memmap(tmp_path / "t.tdz", subpath=("nested", "deeper"))
    assert torch.equal(nested["c"], torch.ones(3, 2))
    same(load_memmap(tmp_path / "t.tdz", num_threads=3), td)


def test_memmap_of_a_memmapped_tree_copies_it(tmp_path):
    mapped = tree().memmap(tmp_path / "dir")
    same(mapped.save(tmp_path / "t.tdz"), tree())
    assert os.path.isdir(tmp_path / "dir")  # the source save is untouched


# ------------------------------------------------------------------ mapped in place
def test_leaves_are_views_of_one_mapping_of_the_archive(tmp_path):
    path = tmp_path / "t.tdz"
    tree().save(path)
    loaded = load_memmap(path)
    ranges = maps_of(path)
    assert ranges, "the archive is not mapped"
    for key in ["a", ("nested", "b"), ("nested", "deeper", "c")]:
        assert inside(loaded.get(key), ranges), key


def test_default_load_refuses_writes_and_keeps_the_file(tmp_path):
    path = tmp_path / "t.tdz"
    tree().save(path)
    before = path.read_bytes()
    loaded = load_memmap(path)
    with pytest.raises(ReadOnlyError, match="t.tdz.*mode='r\\+'"):
        loaded["a"].add_(1)
    with pytest.raises(ReadOnlyError):
        loaded["a"][0] = 5
    with pytest.raises(ReadOnlyError, match="mode='r'"):
        load_memmap(path, mode="r")["a"].fill_(1)
    assert path.read_bytes() == before


def test_mode_r_plus_writes_reach_the_file_and_other_processes(tmp_path):
    path = tmp_path / "t.tdz"
    tree().save(path)
    loaded = load_memmap(path, mode="r+")
    loaded["a"][1] = 42.0
    assert torch.equal(load_memmap(path)["a"][1], torch.full((4,), 42.0))
    offset = loaded["a"]._byte_offset()
    raw = path.read_bytes()[offset + 16: offset + 32]  # row 1 of the 3x4 float32
    assert struct.unpack("<4f", raw) == (42.0,) * 4
    # a leaf pickled to a spawned child views the same bytes: its writes are seen here
    child = SPAWN.Process(target=kids.write_through_pickled_leaf, args=(loaded["nested", "b"], 7))
    child.start()
    assert finish(child) == 0
    assert loaded["nested", "b"].tolist() == [7, 7, 7]


def test_read_only_leaf_pickles_to_a_child_as_a_reference(tmp_path):
    path = tmp_path / "t.tdz"
    tree().save(path)
    queue = SPAWN.Queue()
    child = SPAWN.Process(target=kids.read_pickled_leaf, args=(load_memmap(path)["a"][2], queue))
    child.start()
    assert queue.get(timeout=WAIT) == [8.0, 9.0, 10.0, 11.0]
    assert finish(child) == 0


def test_memmap_like_archive_is_zeros_and_writable(tmp_path):
    path = tmp_path / "like.tdz"
    like = tree().memmap_like(path)
    assert (like["a"] == 0).all() and like["text"] == "hello"
    like["a"][0] = 3.0
    assert load_memmap(path)["a"][0].tolist() == [3.0] * 4


def test_mode_r_plus_refuses_an_archive_on_a_read_only_file_system(tmp_path):
    with small_tmpfs(tmp_path / "ro") as mounted:
        path = mounted / "t.tdz"
        TensorDict(a=torch.arange(3.0)).save(path)
        subprocess.run(["mount", "-o", "remount,ro", str(mounted)], check=True)
        with pytest.raises(PermissionError, match="t.tdz with mode='r\\+': it is on a read-only file system"):
            load_memmap(path, mode="r+")
        assert load_memmap(path)["a"].tolist() == [0.0, 1.0, 2.0]


# ------------------------------------------------------------------ compression
@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_each_compression(tmp_path, compression):
    path = tmp_path / "c.tdz"
    td = TensorDict(a=torch.zeros(1000), b=torch.arange(10, dtype=torch.int16), batch_size=[])
    same(td.save(path, compression=compression), td)
    with zipfile.ZipFile(path) as zf:
        kinds = {info.filename: info.compress_type for info in zf.infolist()}
    expected = archive_write.check_compression(compression)
    assert kinds["a.memmap"] == expected and kinds["meta.json"] == zipfile.ZIP_STORED
    loaded = load_memmap(path)
    same(loaded, td)
    if expected != zipfile.ZIP_STORED:
        assert not inside(loaded["a"], maps_of(path))  # decompressed in memory
        assert path.stat().st_size < 1000
        with pytest.raises(FormatError, match="'a.memmap'.*compressed.*mode='r\\+'"):
            load_memmap(path, mode="r+")


@pytest.mark.parametrize("bad", ["gzip", "zstd", 99, 1.5])
def test_unknown_compression_writes_nothing(tmp_path, bad):
    tree().save(tmp_path / "dir")
    with pytest.raises(ValueError, match="Unknown compression.*'stored', 'deflate'"):
        tree().save(tmp_path / "c.tdz", compression=bad)
    with pytest.raises(ValueError, match="Unknown compression"):
        pack_memmap(tmp_path / "dir", compression=bad)
    assert listing(tmp_path) == ["dir"]


def test_compression_without_an_archive_is_refused(tmp_path):
    with pytest.raises(ValueError, match="compression is only for an archive"):
        tree().memmap(tmp_path / "dir", compression="deflate")
    assert listing(tmp_path) == []


# ------------------------------------------------------------------ atomic
def test_an_exception_mid_way_leaves_the_old_archive(tmp_path, monkeypatch):
    path = saved_archive(tmp_path)
    before = path.read_bytes()
    calls = []

    def failing(zf, name, size, chunks, compress_type):
        calls.append(name)
        if len(calls) == 3:
            raise KeyboardInterrupt("stop")
        return real(zf, name, size, chunks, compress_type)

    real = archive_write._write_member
    monkeypatch.setattr(archive_write, "_write_member", failing)
    with pytest.raises(KeyboardInterrupt):
        tree().save(path)
    assert path.read_bytes() == before
    assert listing(tmp_path) == [".t.tdz.lock", "t.tdz"]


def test_file_size_limit_leaves_the_old_archive(tmp_path):
    path = tmp_path / "big.tdz"
    atomic_children.build(1, 1).save(path)
    before = path.read_bytes()
    out = tmp_path / "out.json"
    child = FORK.Process(target=kids.save_under_file_size_limit, args=(str(path), 2, 4, 2 << 20, str(out)))
    child.start()
    assert finish(child) == 0
    result = json.loads(out.read_text())
    assert result["error"] == StorageFullError.__name__, result
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == [".big.tdz.lock", "big.tdz", "out.json"]


def test_sigkill_at_random_moments_leaves_a_whole_archive(tmp_path):
    path, rng, mib = tmp_path / "k.tdz", random.Random(4321), 8
    atomic_children.build(1, mib).save(path)
    seen = {1}
    for round_ in range(5):
        ready = FORK.Event()
        child = FORK.Process(target=kids.save_forever, args=(str(path), 100 * (round_ + 1), mib, ready))
        child.start()
        assert ready.wait(WAIT)
        time.sleep(rng.uniform(0, 0.3))
        os.kill(child.pid, signal.SIGKILL)
        finish(child)
        version = atomic_children.check(load_memmap(path), mib)  # whole: old or a new one
        seen.add(version)
        removed = shared_td.gc(path)
        assert all(os.path.basename(p).startswith(".k.tdz.shared_td-new-") for p in removed)
        assert sorted(os.listdir(tmp_path)) == [".k.tdz.lock", "k.tdz"]
    assert len(seen) >= 2  # some writes did complete


def test_sigkill_mid_write_leaves_the_old_archive_and_a_temporary_for_gc(tmp_path):
    path, mib = tmp_path / "k.tdz", 1
    atomic_children.build(1, mib).save(path)
    before = path.read_bytes()
    ready = FORK.Event()
    child = FORK.Process(target=kids.save_blocked_mid_write, args=(str(path), 2, mib, ready))
    child.start()
    assert ready.wait(WAIT)
    os.kill(child.pid, signal.SIGKILL)
    finish(child)
    assert path.read_bytes() == before
    leftover = [e for e in os.listdir(tmp_path) if e.startswith(".k.tdz.shared_td-new-")]
    assert len(leftover) == 1
    from shared_td.cli.gc_cmd import prefixes_under

    assert prefixes_under(str(tmp_path)) == [str(path)]
    assert shared_td.gc(path) == [str(tmp_path / leftover[0])]
    assert atomic_children.check(load_memmap(path), mib) == 1
    assert listing(tmp_path) == [".k.tdz.lock", "k.tdz"]


def test_gc_cli_finds_a_dead_archive_writers_directory(tmp_path):
    from shared_td.cli.gc_cmd import prefixes_under

    path = saved_archive(tmp_path)
    leftover = tmp_path / ".t.tdz.shared_td-new-999999999-0123456789ab"
    (leftover / "tree").mkdir(parents=True)
    assert prefixes_under(str(tmp_path)) == [str(path)]
    assert shared_td.gc(path) == [str(leftover)]
    assert listing(tmp_path) == [".t.tdz.lock", "t.tdz"]


def test_existsok_false_and_a_directory_target(tmp_path):
    path = saved_archive(tmp_path)
    with pytest.raises(RuntimeError, match="already exists"):
        tree().memmap(path, existsok=False)
    (tmp_path / "dir.tdz").mkdir()
    with pytest.raises(IsADirectoryError, match="dir.tdz"):
        tree().save(tmp_path / "dir.tdz", archive=True)


def test_the_new_archive_keeps_the_old_ones_mode(tmp_path):
    path = saved_archive(tmp_path)
    os.chmod(path, 0o640)
    tree().save(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o640


# ------------------------------------------------------------------ pack / unpack
def test_pack_and_unpack(tmp_path):
    td = tree()
    td.save(tmp_path / "d")
    packed = pack_memmap(tmp_path / "d")
    assert packed == str(tmp_path / "d.tdz")
    same(load_memmap(packed), td)
    out = unpack_memmap(packed, tmp_path / "u")
    assert dir_state(out) == dir_state(tmp_path / "d")
    same(load_memmap(out), td)
    # over an existing save: replaced as a whole
    TensorDict(other=torch.ones(1)).save(tmp_path / "u2")
    same(load_memmap(unpack_memmap(packed, tmp_path / "u2")), td)
    custom = pack_memmap(tmp_path / "d", tmp_path / "elsewhere.zip", compression="lzma")
    same(load_memmap(custom), td)


def test_unpack_into_a_directory_that_is_not_a_save_refuses(tmp_path):
    packed = saved_archive(tmp_path)
    (tmp_path / "photos").mkdir()
    (tmp_path / "photos" / "cat.jpg").write_bytes(b"meow")
    with pytest.raises(AtomicWriteError, match="not a saved tensordict"):
        unpack_memmap(packed, tmp_path / "photos")
    assert dir_state(tmp_path / "photos") == {"cat.jpg": b"meow"}


def test_pack_refuses_what_is_not_a_save_and_a_target_inside(tmp_path):
    (tmp_path / "other").mkdir()
    with pytest.raises(ValueError, match="not a saved tensordict"):
        pack_memmap(tmp_path / "other")
    tree().save(tmp_path / "d")
    with pytest.raises(ValueError, match="outside"):
        pack_memmap(tmp_path / "d", tmp_path / "d" / "x.tdz")


def test_pack_refuses_a_symlink_inside_the_save(tmp_path):
    tree().save(tmp_path / "d")
    (tmp_path / "secret").write_bytes(b"s" * 48)
    os.unlink(tmp_path / "d" / "a.memmap")
    os.symlink(tmp_path / "secret", tmp_path / "d" / "a.memmap")
    with pytest.raises(RuntimeError, match="symlink"):
        pack_memmap(tmp_path / "d")
    assert not os.path.exists(tmp_path / "d.tdz")


# ------------------------------------------------------------------ is_memmap_archive
def test_is_memmap_archive(tmp_path):
    path = saved_archive(tmp_path)
    assert is_memmap_archive(path) and is_memmap_archive(str(path))
    assert not is_memmap_archive(tmp_path / "missing")
    assert not is_memmap_archive(tmp_path)
    tree().save(tmp_path / "dir")
    assert not is_memmap_archive(tmp_path / "dir")
    (tmp_path / "plain").write_bytes(b"not a zip at all")
    assert not is_memmap_archive(tmp_path / "plain")
    with zipfile.ZipFile(tmp_path / "other.zip", "w") as zf:
        zf.writestr("readme.txt", "hi")
        zf.writestr("sub/meta.json", "{}")
    assert not is_memmap_archive(tmp_path / "other.zip")
    with zipfile.ZipFile(tmp_path / "fake.zip", "w") as zf:
        zf.writestr("meta.json", json.dumps({"name": "holidays"}))
    assert not is_memmap_archive(tmp_path / "fake.zip")
    with pytest.raises(NotADirectoryError, match="not a saved tensordict directory nor an archive"):
        load_memmap(tmp_path / "plain")


def test_is_memmap_archive_of_a_fifo_does_not_block(tmp_path):
    fifo = tmp_path / "fifo.tdz"
    os.mkfifo(fifo)
    result = []
    worker = threading.Thread(target=lambda: result.append(is_memmap_archive(fifo)), daemon=True)
    worker.start()
    worker.join(WAIT)
    assert result == [False]
    with pytest.raises((FormatError, NotADirectoryError)):
        load_memmap(fifo)


def test_saving_over_the_archive_a_tree_was_loaded_from(tmp_path):
    path = saved_archive(tmp_path)
    loaded = load_memmap(path)
    loaded.unlock_()
    loaded["extra"] = torch.full((2,), 9.0)
    loaded.save(path)  # reads the old archive's mapping while it writes the new one
    again = load_memmap(path)
    assert torch.equal(again["a"], torch.arange(4.0)) and again["extra"].tolist() == [9.0, 9.0]
    assert torch.equal(loaded["a"], torch.arange(4.0))  # the old mapping still reads


def test_a_symlinked_target_replaces_the_file_it_points_to(tmp_path):
    real = saved_archive(tmp_path, "real.tdz")
    os.symlink(real, tmp_path / "link.tdz")
    TensorDict(a=torch.ones(2)).save(tmp_path / "link.tdz")
    assert os.path.islink(tmp_path / "link.tdz")
    assert load_memmap(real)["a"].tolist() == [1.0, 1.0]


def test_an_unpicklable_value_writes_nothing(tmp_path):
    td = TensorDict(a=torch.ones(2), f=NonTensorData(data=lambda: 1, batch_size=[]), batch_size=[])
    with pytest.raises(Exception):
        td.save(tmp_path / "u.tdz")
    assert not os.path.exists(tmp_path / "u.tdz")
    assert [e for e in os.listdir(tmp_path) if "shared_td-new" in e] == []


def test_memmap_in_place_to_a_tdz_name_writes_a_directory_as_tensordict(tmp_path):
    td = TensorDict(a=torch.ones(2))
    td.memmap_(tmp_path / "d.tdz")  # memmap_ has no archive option in tensordict 0.15.3
    assert os.path.isdir(tmp_path / "d.tdz") and td.is_memmap()
    with pytest.raises(ValueError, match="memmap_ cannot write an archive"):
        from shared_td.persist import api
        api.memmap(TensorDict(a=torch.ones(2)), tmp_path / "e.tdz", inplace=True, archive=True)
    assert not os.path.exists(tmp_path / "e.tdz")


def test_loads_and_failed_loads_leave_no_descriptor_open(tmp_path):
    path = saved_archive(tmp_path)
    bad = tmp_path / "bad.tdz"
    bad.write_bytes(path.read_bytes()[:-10])
    load_memmap(path)  # warm up (imports, caches)
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(5):
        kept = load_memmap(path, num_threads=2)
        with pytest.raises(FormatError):
            load_memmap(bad)
        assert is_memmap_archive(path) and not is_memmap_archive(bad)
    assert len(os.listdir("/proc/self/fd")) == before
    assert torch.equal(kept["a"], torch.arange(4.0))


def _replaced_in_a_child(data: bytes) -> tuple[str, str]:
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=kids.unpickle_and_report, args=(data, queue))
    child.start()
    try:
        return queue.get(timeout=WAIT)
    finally:
        assert finish(child) == 0


@pytest.mark.parametrize("mode", [None, "r+"])
def test_a_pickle_of_a_replaced_archive_is_refused_on_this_machine(tmp_path, mode):
    # an archive's leaf pickles as the archive's path and its offset in it: a new save
    # renamed over that path made the receiver map the new file at the old offsets,
    # reading other bytes (and, with mode="r+", writing into the new zip's headers)
    path = tmp_path / "t.tdz"
    shared_td.TensorDict(a=torch.zeros(4), batch_size=[4]).memmap(path)
    old = shared_td.load_memmap(path, mode=mode)
    shared_td.TensorDict({"0": torch.full((4, 16), 7.0), "a": torch.full((4,), 5.0)},
                         batch_size=[4]).memmap(path, existsok=True)
    assert old["a"].tolist() == [0.0] * 4
    data = pickle.dumps(old)
    if mode is None:  # a read-only copy-on-write mapping is this process's alone: mapped again
        with pytest.raises(shared_td.FileReplacedError, match=str(path)):
            pickle.loads(data)
    else:  # this process's shared mapping of the old file
        assert pickle.loads(data)["a"].tolist() == [0.0] * 4
    kind, said = _replaced_in_a_child(data)
    assert kind == "FileReplacedError" and str(path) in said, (kind, said)
    assert shared_td.load_memmap(path)["a"].tolist() == [5.0] * 4


def test_a_pickle_of_a_replaced_consolidated_file_is_refused_on_this_machine(tmp_path):
    path = tmp_path / "td.bin"
    old = shared_td.TensorDict(a=torch.zeros(4)).consolidate(filename=path)
    shared_td.TensorDict(a=torch.full((4,), 7.0)).consolidate(filename=path)
    data = pickle.dumps(old)
    assert pickle.loads(data)["a"].tolist() == [0.0] * 4  # this process's mapping of the old file
    kind, said = _replaced_in_a_child(data)
    assert kind == "FileReplacedError" and str(path) in said, (kind, said)


def test_a_pickle_of_a_directory_save_maps_what_the_prefix_holds(tmp_path):
    # one leaf per file: an atomic rewrite of the prefix gives later receivers its new
    # values (as a published prefix promises: tests/coordinator/test_attach_reuse.py)
    path = tmp_path / "t"
    old = shared_td.TensorDict(a=torch.zeros(4), batch_size=[4]).memmap(path)
    shared_td.TensorDict(a=torch.full((4,), 5.0), batch_size=[4]).memmap(path, existsok=True, atomic=True)
    assert _replaced_in_a_child(pickle.dumps(old)) == ("read", [5.0] * 4)


def test_a_pickled_file_from_another_machine_is_mapped_by_its_path(tmp_path):
    # device and inode numbers name files only within one boot of one machine: a pickle
    # made elsewhere (a shared file system) maps what the path holds here
    from shared_td.storage.files import open_file_backing

    path = tmp_path / "t"
    shared_td.TensorDict(a=torch.ones(2)).memmap(path)
    leaf = os.path.join(path, "a.memmap")
    assert open_file_backing(leaf, True, None, (1, 1), "another boot").nbytes == 8
    with pytest.raises(shared_td.FileReplacedError):
        open_file_backing(leaf, True, None, (1, 1), files_boot_id())


def files_boot_id():
    from shared_td.storage.files import boot_id

    return boot_id()
