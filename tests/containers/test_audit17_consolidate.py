"""consolidate() and from_consolidated findings of the session-17 audit, side by side
with tensordict 0.15.3 where it makes sense: a tree loaded by ``from_consolidated``
goes through multiprocessing (a Queue, DataLoader workers); consolidating a tree into
its own file again never leaves a file that neither library reads; pickled shared and
file-backed trees arrive unlocked; ``to("cpu")`` of a consolidated CPU tree keeps it
consolidated and locked; damaged metadata is a FormatError naming the field."""
from __future__ import annotations

import multiprocessing
import os
import queue
from multiprocessing.reduction import ForkingPickler

import pytest
import torch
from torch.utils.data import DataLoader

import shared_td
from shared_td import TensorDict, from_consolidated
from tests.containers import audit17_consol_children as kids

tensordict = pytest.importorskip("tensordict")


# ------------------------------------------------ a loaded tree through multiprocessing
def _written(path) -> str:
    TensorDict({"a": torch.arange(4.0), "b": {"c": torch.ones(2)}}, []).consolidate(filename=str(path))
    return str(path)


def test_loaded_tree_through_a_queue_to_a_spawn_child(tmp_path):
    # before: the queue's feeder thread failed to pickle the copy-on-write mapping
    # (EBADF: torch took it for shared memory without a descriptor) and the child
    # waited for ever; tensordict 0.15.3 fails the same way
    loaded = from_consolidated(_written(tmp_path / "td.bin"))
    ctx = multiprocessing.get_context("spawn")
    inbox, answers = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=kids.receive_and_report, args=(inbox, answers))
    child.start()
    try:
        inbox.put(loaded)
        try:
            got = answers.get(timeout=30)
        except queue.Empty:
            pytest.fail("the child never received the loaded tree")
        assert got == ([0.0, 1.0, 2.0, 3.0], [1.0, 1.0], True)
        assert answers.get(timeout=30) == "written"
        # the buffer went to shared memory, as any tensor does: the child's write is seen
        assert loaded["a"][0].item() == 77.0
        # and the file is untouched (the mapping is copy-on-write)
        assert from_consolidated(tmp_path / "td.bin")["a"][0].item() == 0.0
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
            child.join()
    assert child.exitcode == 0


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_dataloader_workers_return_loaded_trees(tmp_path, method):
    # before: the worker's pickle of the tree failed in its queue's feeder thread and a
    # worker aborted (SIGABRT) or the loader waited for ever
    loader = DataLoader(kids.LoadedFiles(_written(tmp_path / "td.bin"), 4), batch_size=None,
                        num_workers=2, timeout=30, multiprocessing_context=method)
    got = [(td["a"].tolist(), td["b", "c"].tolist(), td.is_consolidated()) for td in loader]
    assert got == [([i + 0.0, i + 1.0, i + 2.0, i + 3.0], [1.0, 1.0], True) for i in range(4)]


def test_loaded_tree_pickles_its_bytes(tmp_path):
    import pickle

    loaded = from_consolidated(_written(tmp_path / "td.bin"))
    loaded["a"][1] = 5.0  # in this process only (copy-on-write)
    back = pickle.loads(pickle.dumps(loaded))
    assert back["a"].tolist() == [0.0, 5.0, 2.0, 3.0] and back.is_consolidated()
    assert from_consolidated(tmp_path / "td.bin")["a"].tolist() == [0.0, 1.0, 2.0, 3.0]


# ------------------------------------------------ consolidating into its own file again
def _loads_in_both(path) -> tuple[list, list]:
    ours = from_consolidated(path)
    theirs = tensordict.TensorDict.from_consolidated(str(path))
    assert ours["n", "b"].tolist() == theirs["n", "b"].tolist() == [1.0, 1.0]
    return sorted(len(key) for key in ours.keys()), sorted(len(key) for key in theirs.keys())


def _exitcode(target, *args, timeout: float = 60) -> int:
    """Run ``target(*args)`` in a fork child (bounded) and return its exit code."""
    ctx = multiprocessing.get_context("fork")
    child = ctx.Process(target=target, args=args)
    child.start()
    child.join(timeout=timeout)
    if child.is_alive():
        child.kill()
        child.join()
        pytest.fail(f"{target.__name__} did not finish")
    return child.exitcode


@pytest.mark.parametrize("key_length", [100, 20_000])
def test_rewrite_under_a_file_size_limit_leaves_a_readable_file(tmp_path, key_length):
    # before: the longer metadata were written over the old ones in place; the file-size
    # limit (as a full disk) cut that write short and neither library read the file.
    # Now a new file is written beside it: 100 more bytes fit under the limit (the new
    # tree), 20000 do not (the limit refuses the new file: the old tree)
    path = tmp_path / "td.bin"
    TensorDict({"a": torch.arange(4.0), "n": {"b": torch.ones(2)}}, []).consolidate(filename=path)
    _exitcode(kids.consolidate_limited, str(path), key_length, 1000)
    ours, theirs = _loads_in_both(path)
    assert ours == theirs == ([1, 1] if key_length > 1000 else [1, key_length])
    assert [name for name in (p.name for p in tmp_path.iterdir())] == ["td.bin"]


def test_rewrite_killed_at_random_moments_leaves_a_readable_file(tmp_path):
    import random

    path = tmp_path / "td.bin"
    TensorDict({"a": torch.arange(4.0), "n": {"b": torch.ones(2)}}, []).consolidate(filename=path)
    ctx = multiprocessing.get_context("fork")
    for _ in range(4):
        ready = ctx.Event()
        child = ctx.Process(target=kids.rewrite_forever, args=(str(path), ready))
        child.start()
        try:
            assert ready.wait(timeout=30)
            child.join(timeout=random.uniform(0.0, 0.05))
        finally:
            child.kill()
            child.join(timeout=30)
        ours, theirs = _loads_in_both(path)
        assert ours == theirs


def test_consolidating_again_never_changes_the_mapped_file(tmp_path):
    # before: the new metadata went into the mapped file and ftruncate cut it (by pages:
    # every process mapping it whole got SIGBUS reading there)
    path = tmp_path / "td.bin"
    c = kids._big_tree(TensorDict, torch).consolidate(filename=path)
    fd = os.open(path, os.O_RDONLY)
    try:
        size, content = os.fstat(fd).st_size, os.pread(fd, 10**7, 0)
        c.unlock_()
        c.batch_size = [3]
        again = c.consolidate(filename=path)
        assert (os.fstat(fd).st_size, os.pread(fd, 10**7, 0)) == (size, content)
    finally:
        os.close(fd)
    assert from_consolidated(path).batch_size == tensordict.TensorDict.from_consolidated(str(path)).batch_size == (3,)
    assert again is not c and again.is_consolidated() and again.is_locked and again.batch_size == (3,)
    assert c["key_number_0000"].sum().item() == 66.0  # the old tree reads its old file
    assert [p.name for p in tmp_path.iterdir()] == ["td.bin"]


def test_owner_reads_its_whole_leaf_storage_after_consolidating_again(tmp_path):
    # before: the owner itself died of SIGBUS (exit code -7)
    assert _exitcode(kids.owner_reads_after_rewrite, str(tmp_path / "td.bin")) == 0


def test_tensordict_reader_of_the_file_pickles_after_it_is_consolidated_again(tmp_path):
    # tensordict 0.15.3's from_consolidated maps the whole file; its pickle reads all of
    # it. Before: SIGBUS in that process (exit code -7) once the file was cut
    path = tmp_path / "td.bin"
    c = kids._big_tree(TensorDict, torch).consolidate(filename=path)
    ctx = multiprocessing.get_context("fork")
    ready, go = ctx.Event(), ctx.Event()
    child = ctx.Process(target=kids.tensordict_maps_then_pickles, args=(str(path), ready, go))
    child.start()
    try:
        assert ready.wait(timeout=30)
        c.unlock_()
        c.batch_size = [3]
        c.consolidate(filename=path)
        go.set()
        child.join(timeout=30)
    finally:
        if child.is_alive():
            child.kill()
            child.join()
    assert child.exitcode == 0


def test_a_reader_never_fails_while_the_file_is_consolidated_again(tmp_path):
    import time

    # before: about 1 load in 100 raised a FormatError (the metadata half-written, or
    # the file cut under the read)
    path = tmp_path / "td.bin"
    owner = TensorDict({"a": torch.arange(4.0)}, []).consolidate(filename=path)
    ctx = multiprocessing.get_context("fork")
    answers = ctx.Queue()
    child = ctx.Process(target=kids.read_in_a_loop, args=(str(path), 1.0, answers))
    child.start()
    try:
        step, until = 0, time.monotonic() + 30
        while child.is_alive() and time.monotonic() < until:
            owner.unlock_()
            owner.batch_size = [4] if step % 2 == 0 else []
            owner = owner.consolidate(filename=path)
            step += 1
        loads, errors, failed = answers.get(timeout=30)
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
            child.join()
    assert loads > 20 and step > 20 and failed == 0, errors


@pytest.mark.parametrize("lib", ["tensordict", "shared_td"])
def test_consolidating_again_returns_the_tree_of_the_file(tmp_path, lib):
    module = tensordict if lib == "tensordict" else shared_td
    path = str(tmp_path / "td.bin")
    c = module.TensorDict({"a": torch.arange(4.0), "n": {"b": torch.ones(4)}}, []).consolidate(filename=path)
    assert c.consolidate(filename=path) is c  # the file holds it: as it is (both)
    c.batch_size = [4]  # (a locked tree's batch size may change; tensordict's unlock_()
    # would end its consolidation)
    again = c.consolidate(filename=path)
    # tensordict rewrites the mapped file and returns c; ours writes a new file and
    # returns a new tree over it (c keeps the old file)
    assert (again is c) == (lib == "tensordict")
    assert again.is_consolidated() and again.batch_size == (4,) and again.is_locked
    assert from_consolidated(path).batch_size == (4,)
    # inplace=True on the locked tree: c itself (both), its leaves views of the file
    again.batch_size = []
    assert again.consolidate(filename=path, inplace=True) is again
    assert again.is_locked and again.is_consolidated()
    again["n", "b"][0] = 7.0
    if lib == "shared_td":  # (tensordict's leaves are no views of its file's shared mapping)
        assert from_consolidated(path)["n", "b"].tolist() == [7.0, 1.0, 1.0, 1.0]
    assert from_consolidated(path).batch_size == tensordict.TensorDict.from_consolidated(path).batch_size == ()


# ------------------------------------------------ locks of pickled shared and file trees
def _consolidated(lib, kind, tmp_path):
    td = lib.TensorDict({"a": torch.arange(3.0), "b": {"c": torch.zeros(2)}}, [])
    if kind == "share_memory":
        return td.consolidate(share_memory=True)
    return td.consolidate(filename=str(tmp_path / f"{lib.__name__}.bin"))


@pytest.mark.parametrize("kind", ["share_memory", "filename"])
def test_pickled_shared_and_file_trees_arrive_unlocked(tmp_path, kind):
    import pickle

    # before: they arrived locked, root and nested (tensordict 0.15.3: unlocked)
    for lib in (tensordict, shared_td):
        source = _consolidated(lib, kind, tmp_path)
        assert source.is_locked and source["b"].is_locked
        back = pickle.loads(pickle.dumps(source))
        assert (back.is_locked, back["b"].is_locked, back.is_consolidated()) == (False, False, True), lib
        if lib is not tensordict or kind == "share_memory":  # (tensordict's file tree: EBADF)
            queued = ForkingPickler.loads(ForkingPickler.dumps(source))  # as a Queue sends it
            assert (queued.is_locked, queued["b"].is_locked) == (False, False), lib
        back["new"] = torch.ones(())  # a receiver may add keys at once
        assert source.is_locked  # the sender's tree stays locked
    back["a"][0] = 5.0  # ours: by reference, the same memory
    assert source["a"][0].item() == 5.0


def test_unlocked_shared_tree_keeps_a_nested_lock_of_its_own(tmp_path):
    import pickle

    source = _consolidated(shared_td, "share_memory", tmp_path)
    source.unlock_()
    source["b"].lock_()
    back = pickle.loads(pickle.dumps(source))
    assert (back.is_locked, back["b"].is_locked) == (False, True)


# ------------------------------------------------ to() the device it is on
@pytest.mark.parametrize("kind", ["plain", "share_memory"])
def test_to_cpu_of_a_consolidated_cpu_tree_stays_consolidated(kind):
    # before: a per-leaf copy, neither consolidated nor locked (tensordict 0.15.3: a new
    # tree over the same storage, consolidated and locked)
    for lib in (tensordict, shared_td):
        td = lib.TensorDict({"a": torch.arange(3.0), "n": {"b": torch.ones(2)}}, [])
        source = td.consolidate(share_memory=kind == "share_memory")
        moved = source.to("cpu")
        assert moved is not source, lib
        assert (moved.is_consolidated(), moved.is_locked, moved.device) == (True, True, torch.device("cpu")), lib
        assert moved["a"].data_ptr() == source["a"].data_ptr(), lib


# ------------------------------------------------ damaged metadata: FormatError, named
def _crafted(path, meta: dict, data: bytes = bytes(64)) -> str:
    import json

    blob = json.dumps(meta).encode()
    path.write_bytes(data + blob + len(blob).to_bytes(8, "little"))
    return str(path)


def _root(leaves=None, non_tensors=None, **metadata) -> dict:
    cls_metadata = {"device": None, "names": None, "batch_size": [], "is_locked": False}
    cls_metadata.update(metadata)
    return {"cls": "TensorDict", "non_tensors": non_tensors or {}, "leaves": leaves or {},
            "cls_metadata": cls_metadata}


_LEAF = ["torch.float32", [2], 0, 8, 0]


@pytest.mark.parametrize("meta, field", [
    # before: a raw AssertionError (a CPU build of torch asked for CUDA)
    pytest.param(_root({"a": _LEAF}, device="cuda:7", batch_size=[2]), "device 'cuda:7'", id="cuda-device"),
    # before: a ValueError from torch.Size, or accepted and failing later
    pytest.param(_root(batch_size=[2**70]), "batch_size", id="huge-batch"),
    pytest.param(_root(non_tensors={"x": [1, [2**70], None]}), "batch_size", id="huge-non-tensor-batch"),
    # before: one of the two silently won
    pytest.param(_root({"a": _LEAF}, non_tensors={"a": [1, [], None]}), "'a' is listed twice", id="leaf-and-non-tensor"),
    pytest.param(dict(_root({"a": _LEAF}), a=_root()), "'a' is listed twice", id="leaf-and-nested"),
])
def test_damaged_metadata_is_a_format_error_naming_the_field(tmp_path, meta, field):
    if "cuda" in field and torch.cuda.is_available():
        pytest.skip("CUDA is there: whether a file naming cuda:7 loads depends on the GPUs present (checked without CUDA)")
    from shared_td.errors import FormatError

    path = _crafted(tmp_path / "bad.bin", meta)
    with pytest.raises(FormatError, match=field) as caught:
        from_consolidated(path)
    assert path in str(caught.value)


def test_file_cut_inside_its_data_is_refused_before_reading_a_huge_length(tmp_path, monkeypatch):
    import shared_td.containers.consolidated_load as load

    path = tmp_path / "cut.bin"
    with open(path, "wb") as f:  # 1 MB of data ending in an int64 value (the file was cut there)
        f.seek(2**20 - 8)
        f.write((2**20 - 4096).to_bytes(8, "little"))
    reads = []
    real = load._pread
    monkeypatch.setattr(load, "_pread", lambda fd, count, offset: reads.append(count) or real(fd, count, offset))
    from shared_td.errors import FormatError

    with pytest.raises(FormatError, match="not '{'"):
        from_consolidated(path)
    assert max(reads) <= 8  # before: it read the 1 MB "metadata" first
