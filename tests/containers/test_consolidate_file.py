"""consolidate(filename=) files and from_consolidated: format, atomic writes, damage.

Interop with tensordict 0.15.3 is in tests/interop/test_consolidated_interop.py; these
tests need shared_td alone.
"""
from __future__ import annotations

import json
import multiprocessing
import os
import stat
import pickle
import random
import threading

import pytest
import torch

import shared_td
from shared_td import FormatError, NonTensorStack, TensorDict, from_consolidated, tensorclass
from tests.containers.consolidate_children import consolidate_forever
from tests.processes import WAIT, finish


@tensorclass
class Step:
    obs: torch.Tensor
    label: str


def _tree():
    td = TensorDict({"a": torch.arange(6.0).reshape(3, 2), "i": torch.arange(3, dtype=torch.int16),
                     "n": {"b": torch.ones(3, dtype=torch.bool), "s": "text"}}, [3], names=["t"])
    td["words"] = NonTensorStack("x", "y", "z")
    td["step"] = Step(obs=torch.zeros(3, 4, dtype=torch.float64), label="go", batch_size=[3])
    return td


def _split(path):
    raw = path.read_bytes()
    length = int.from_bytes(raw[-8:], "little")
    return raw[:-8 - length], json.loads(raw[-8 - length:-8])


def _write(path, data: bytes, meta) -> None:
    text = meta if isinstance(meta, bytes) else json.dumps(meta).encode()
    path.write_bytes(data + text + len(text).to_bytes(8, "little"))


def _ours(path) -> list[str]:
    return sorted(os.listdir(path.parent))


# ----------------------------------------------------------------------------- format
def test_file_is_data_then_json_then_length(tmp_path):
    path = tmp_path / "td.bin"
    _tree().consolidate(filename=path)
    data, meta = _split(path)
    assert meta["cls"] == "TensorDict" and meta["cls_metadata"]["names"] == ["t"]
    dtype, shape, start, stop, pad = meta["leaves"]["i"]
    assert (dtype, shape) == ("torch.int16", [3])
    assert torch.frombuffer(bytearray(data[start:stop]), dtype=torch.int16).tolist() == [0, 1, 2]
    assert meta["n"]["non_tensors"]["s"] == ["text", [3], None]
    assert meta["words"]["cls"] == "NonTensorStack" and meta["step"]["cls"] == str(Step)


def test_round_trip_and_views_of_one_copy_on_write_mapping(tmp_path):
    path = tmp_path / "td.bin"
    source = _tree()
    source.consolidate(filename=path)
    for loaded in (from_consolidated(path), TensorDict.from_consolidated(path), Step.from_consolidated(path)):
        assert type(loaded) is TensorDict and loaded.is_consolidated() and not loaded.is_locked
        assert (loaded == source).all() and loaded.names == ["t"]
        assert type(loaded["step"]) is Step and loaded["step"].label == "go"
        assert loaded["words"] == ["x", "y", "z"]
        assert len({v.untyped_storage().data_ptr() for v in loaded.values(True, True)}) == 1
        loaded["a"][0, 0] = 99.0  # copy-on-write, as tensordict: the file keeps its bytes
    assert from_consolidated(path)["a"][0, 0] == 0.0
    again = pickle.loads(pickle.dumps(loaded))  # a pickle carries the bytes (private writes too)
    assert again.is_consolidated() and again["a"][0, 0] == 99.0 and (again["n"] == loaded["n"]).all()


def test_tensorclass_root(tmp_path):
    Step(obs=torch.ones(2, 1, dtype=torch.float64), label="x", batch_size=[2]).consolidate(filename=tmp_path / "s.bin")
    loaded = Step.from_consolidated(tmp_path / "s.bin")
    assert type(loaded) is Step and loaded.label == "x" and loaded.obs.sum() == 2


def test_written_leaves_reach_the_file(tmp_path):
    path = tmp_path / "td.bin"
    out = _tree().consolidate(filename=path)
    out["a"][1, 1] = -5.0
    assert from_consolidated(path)["a"][1, 1] == -5.0


def test_non_json_value_refused_before_anything_is_written(tmp_path):
    path = tmp_path / "td.bin"
    with pytest.raises(TypeError, match=r"'n', 'o'\).*JSON"):
        TensorDict(x=torch.zeros(1), n={"o": object()}).consolidate(filename=path)
    assert _ours(path) == []


def test_a_value_that_is_not_json_is_the_runtime_error_tensordict_raises_with_advice_that_works(tmp_path):
    """It was a bare TypeError (tensordict's RuntimeError handlers missed it) and advised
    memmap(..., allow_pickle=True), a parameter memmap does not have."""
    td = TensorDict(x=torch.zeros(2), r=b"bytes", batch_size=[2])
    with pytest.raises(shared_td.UnstorableValueError, match=r"'r'.*memmap\(prefix\).*allow_pickle=True") as caught:
        td.consolidate(filename=tmp_path / "td.bin")
    assert isinstance(caught.value, RuntimeError) and isinstance(caught.value, TypeError)
    td.memmap(tmp_path / "saved")  # the advice, followed
    assert shared_td.load_memmap(tmp_path / "saved", allow_pickle=True)["r"] == b"bytes"


# every name the reader takes for a field rather than a nested collection ("size":
# tensordict's reader drops it at every node, so a collection there was silently lost)
@pytest.mark.parametrize("name", ["cls", "non_tensors", "leaves", "cls_metadata", "size"])
def test_nested_key_named_like_a_metadata_field_refused(tmp_path, name):
    with pytest.raises(ValueError, match=f"'{name}'.*Rename"):
        TensorDict({name: {"x": torch.zeros(1)}, "b": torch.ones(1)}).consolidate(filename=tmp_path / "td.bin")
    with pytest.raises(ValueError, match=rf"\('n', '{name}'\).*Rename"):  # at any depth, any kind
        TensorDict(n={name: NonTensorStack("p", "q")}).consolidate(filename=tmp_path / "td.bin")
    assert _ours(tmp_path / "td.bin") == []
    TensorDict({name: torch.ones(1)}).consolidate(filename=tmp_path / "td.bin")  # a leaf may be
    assert from_consolidated(tmp_path / "td.bin")[name].tolist() == [1.0]


# ----------------------------------------------------------------------------- NonTensorStack
@pytest.mark.parametrize("values", [([1, 2], [3, 4]), ([1, 2], [3]), ([], [])])
def test_stack_of_list_values_keeps_its_batch_size(tmp_path, values):
    """Values that are lists were taken for a dim: (2, 2) came back, or (ragged) a file
    that could not be read. The nesting follows the batch dims, as tensordict writes it."""
    path = tmp_path / "td.bin"
    td = TensorDict(s=NonTensorStack(*[shared_td.NonTensorData(v) for v in values]), batch_size=[2])
    td.consolidate(filename=path)
    assert _split(path)[1]["s"]["non_tensors"]["1"] == [values[1], [], None]
    loaded = from_consolidated(path)._tensordict["s"]
    assert loaded.batch_size == torch.Size([2]) and loaded.tolist() == list(values)


def test_stack_with_dims_is_a_stack_of_stacks(tmp_path):
    path = tmp_path / "td.bin"
    row = lambda *values: NonTensorStack(*[shared_td.NonTensorData(v) for v in values])
    grid = NonTensorStack(row(["a"], ["b", "c"]), row(["d"], ["e"]))  # 2 x 2 of lists
    td = TensorDict(s=grid, e=NonTensorStack.from_list([[], []]), batch_size=[2])
    td.consolidate(filename=path)
    meta = _split(path)[1]["s"]
    assert meta["non_tensors"] == {} and meta["1"]["non_tensors"]["0"] == [["d"], [], None]
    loaded = from_consolidated(path)
    assert loaded._tensordict["s"].batch_size == torch.Size([2, 2])
    assert loaded["s"] == grid.tolist() == [[["a"], ["b", "c"]], [["d"], ["e"]]]
    assert loaded._tensordict["e"].batch_size == torch.Size([2, 0])


def test_stack_without_dims_is_written_as_its_value(tmp_path):
    """A 0-d NonTensorStack (one value) has no stack in the format: its value was
    iterated as if it were a row (a str came back as its letters)."""
    TensorDict(s=NonTensorStack.from_list("word")).consolidate(filename=tmp_path / "td.bin")
    assert from_consolidated(tmp_path / "td.bin")["s"] == "word"


@pytest.mark.parametrize("rows,where", [([b"x", "y"], r"\('s', 0\)"),
                                        ([["a", "b"], ["c", {1, 2}]], r"\('s', 1, 1\)")])
def test_value_in_a_stack_that_is_not_json_refused_naming_it_and_nothing_written(tmp_path, rows, where):
    """It was the bare TypeError of json.dumps, naming no key."""
    path = tmp_path / "td.bin"
    TensorDict(a=torch.ones(2)).consolidate(filename=path)
    before = path.read_bytes()
    td = TensorDict(a=torch.zeros(2), s=NonTensorStack.from_list(rows), batch_size=[2])
    with pytest.raises(shared_td.UnstorableValueError, match=where + r".*memmap\(prefix\).*allow_pickle=True"):
        td.consolidate(filename=path)
    assert path.read_bytes() == before and _ours(path) == ["td.bin"]
    td.memmap(tmp_path / "saved")  # the advice, followed
    assert shared_td.load_memmap(tmp_path / "saved", allow_pickle=True)["s"] == rows


# ----------------------------------------------------------------------------- dtypes
@pytest.mark.parametrize("dtype", [torch.float4_e2m1fn_x2, torch.bits8, torch.bits16])
def test_dtype_the_reader_cannot_read_refused_before_anything_is_written(tmp_path, dtype):
    """float4 and bits leaves were written, and from_consolidated refused the file."""
    path = tmp_path / "td.bin"
    TensorDict(a=torch.ones(2)).consolidate(filename=path)
    before = path.read_bytes()
    leaf = torch.arange(4, dtype=torch.uint8).view(dtype)
    with pytest.raises(TypeError, match=rf"\('n', 'x'\) is {dtype}.*view\(torch.uint8\)"):
        TensorDict(a=torch.ones(2), n={"x": leaf}).consolidate(filename=path)
    assert path.read_bytes() == before and _ours(path) == ["td.bin"]
    TensorDict(x=leaf.view(torch.uint8)).consolidate(filename=path)  # the advice, followed
    assert from_consolidated(path)["x"].view(dtype).view(torch.uint8).tolist() == [0, 1, 2, 3]
    assert TensorDict(x=leaf).consolidate()["x"].dtype == dtype  # in memory: any dtype


def test_empty_tree_writes_metadata_only(tmp_path):
    TensorDict(s="only text").consolidate(filename=tmp_path / "e.bin")
    assert from_consolidated(tmp_path / "e.bin")["s"] == "only text"


# ----------------------------------------------------------------------------- rewrites
def test_new_file_renamed_in_place_old_mappings_keep_their_data(tmp_path):
    path = tmp_path / "td.bin"
    first = TensorDict(a=torch.full((1000,), 1.0)).consolidate(filename=path)
    inode = path.stat().st_ino
    second = TensorDict(a=torch.full((10,), 2.0)).consolidate(filename=path)
    assert path.stat().st_ino != inode and _ours(path) == ["td.bin"]  # no leftover
    assert (first["a"] == 1.0).all() and (second["a"] == 2.0).all()
    assert (from_consolidated(path)["a"] == 2.0).all()


def test_consolidating_again_into_its_own_file_writes_a_new_one(tmp_path):
    path = tmp_path / "td.bin"
    out = TensorDict(a=torch.zeros(3, 2), b={"c": torch.ones(3)}, batch_size=[3]).consolidate(filename=path)
    inode = path.stat().st_ino
    assert out.consolidate(filename=path) is out and path.stat().st_ino == inode  # unchanged: as it is
    out.names = ["time"]
    renamed = out.consolidate(filename=path)  # the mapped file is never written: a new one
    assert renamed is not out and renamed.names == ["time"] and path.stat().st_ino != inode
    assert from_consolidated(path).names == ["time"] and _ours(path) == ["td.bin"]
    out = renamed
    # the name now holds another file: that file is not touched, a new one is written
    TensorDict(z=torch.zeros(1)).consolidate(filename=path)
    again = out.consolidate(filename=path)
    assert again is not out and list(from_consolidated(path).keys()) == ["a", "b"]


def test_loaded_tree_consolidated_into_the_file_it_came_from(tmp_path):
    path = tmp_path / "td.bin"
    _tree().consolidate(filename=path)
    loaded = from_consolidated(path)
    loaded["i"][2] = 42
    loaded.consolidate(filename=path)
    assert from_consolidated(path)["i"].tolist() == [0, 1, 42]


def test_failed_copy_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "td.bin"
    TensorDict(a=torch.ones(4)).consolidate(filename=path)
    before = path.read_bytes()

    def fail(jobs, threads):
        raise OSError(28, "No space left on device (simulated)")

    monkeypatch.setattr(shared_td.containers.consolidation, "run_copies", fail)
    with pytest.raises(OSError, match="simulated"):
        TensorDict(a=torch.zeros(8)).consolidate(filename=path)
    assert path.read_bytes() == before and _ours(path) == ["td.bin"]


def test_symlink_and_directory_at_the_name_refused(tmp_path):
    target = tmp_path / "real.bin"
    TensorDict(a=torch.ones(2)).consolidate(filename=target)
    os.symlink(target, tmp_path / "link.bin")
    with pytest.raises(RuntimeError, match="symlink"):
        TensorDict(a=torch.zeros(2)).consolidate(filename=tmp_path / "link.bin")
    assert from_consolidated(tmp_path / "link.bin")["a"].tolist() == [1.0, 1.0]  # reading follows it
    (tmp_path / "dir.bin").mkdir()
    with pytest.raises(RuntimeError, match="directory"):
        TensorDict(a=torch.zeros(2)).consolidate(filename=tmp_path / "dir.bin")


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_writer_killed_at_random_moments_leaves_a_complete_file(tmp_path, method):
    """SIGKILL a process that consolidates into one path again and again: the path holds
    one whole file of one generation every time."""
    path = tmp_path / "td.bin"
    ctx = multiprocessing.get_context(method)
    rounds = 12 if os.environ.get("SHARED_TD_STRESS") != "1" else 200
    for _ in range(rounds // (4 if method == "spawn" else 1)):
        started = ctx.Event()
        child = ctx.Process(target=consolidate_forever, args=(str(path), started))
        child.start()
        assert started.wait(WAIT)
        threading.Event().wait(random.uniform(0, 0.05))
        child.kill()
        finish(child)
        loaded = from_consolidated(path)
        generation = loaded["n", "b"][0].item()
        assert (loaded["a"] == float(generation)).all() and (loaded["n", "b"] == generation).all()
    leftovers = [name for name in _ours(path) if name != "td.bin"]
    assert all(name.startswith(".td.bin.shared_td-new-") for name in leftovers)
    # what the killed writers left, gc removes (it found none of it before: the files
    # were named .td.bin.consolidating-*, a name gc did not know)
    removed = shared_td.gc(path)
    assert sorted(os.path.basename(p) for p in removed) == leftovers
    assert [name for name in _ours(path) if not name.endswith(".lock")] == ["td.bin"]
    assert from_consolidated(path)["n", "b"].numel() > 0


# ----------------------------------------------------------------------------- damage
def test_every_truncation_is_a_clear_error(tmp_path):
    path = tmp_path / "td.bin"
    _tree().consolidate(filename=path)
    raw = path.read_bytes()
    cut = tmp_path / "cut.bin"
    for size in range(len(raw)):
        cut.write_bytes(raw[:size])
        with pytest.raises(FormatError, match=str(cut)):
            from_consolidated(cut)


@pytest.mark.parametrize("length", [-1, 0, 1, 1 << 40, -(1 << 62)])
def test_bad_length(tmp_path, length):
    path = tmp_path / "td.bin"
    path.write_bytes(b"\0" * 64 + b"{}" + length.to_bytes(8, "little", signed=True))
    with pytest.raises(FormatError, match="metadata length"):
        from_consolidated(path)


@pytest.mark.parametrize("text,match", [
    (b"{not json", "not valid JSON"), (b"\xff\xfe{}", "not valid JSON"), (b"[1, 2]", "JSON list, not an object"),
    (b"[" * 100_000 + b"]" * 100_000, "not valid JSON"),
])
def test_garbage_json(tmp_path, text, match):
    _write(tmp_path / "td.bin", b"\0" * 8, text)
    with pytest.raises(FormatError, match=match):
        from_consolidated(tmp_path / "td.bin")


def _leaf_file(tmp_path, leaf, cls="TensorDict", extra=None):
    meta = {"cls": cls, "non_tensors": {}, "leaves": {"x": leaf},
            "cls_metadata": {"device": None, "names": [], "batch_size": [], "is_locked": False}}
    meta.update(extra or {})
    _write(tmp_path / "td.bin", bytes(range(64)), meta)
    return tmp_path / "td.bin"


@pytest.mark.parametrize("leaf,match", [
    (["torch.float32", [4], 0, 16, 0], None),
    (["torch.float32", [4], 60, 76, 0], "outside"),
    (["torch.float32", [100], 0, 400, 0], "outside"),
    (["torch.float32", [4], 0, 8, 0], "outside"),
    (["torch.float32", [1 << 60, 1 << 60], 0, 16, 0], "outside"),
    (["torch.float32", [4], -4, 12, 0], "counts"),
    (["torch.float32", [-1], 0, 16, 0], "counts"),
    (["torch.float32", "4", 0, 16, 0], "counts"),
    (["torch.float32", [1], 2, 6, 0], "multiple"),
    (["torch.nope", [1], 0, 4, 0], "unknown dtype"),
    (["torch.float32", [1], 0], r"\[dtype, shape"),
    ("x", r"\[dtype, shape"),
    (["torch.float32", [1], 0, 4, 0, 1], "jagged"),
])
def test_leaf_offsets_shapes_dtypes_checked(tmp_path, leaf, match):
    path = _leaf_file(tmp_path, leaf)
    if match is None:
        assert from_consolidated(path)["x"].shape == (4,)
        return
    with pytest.raises(FormatError, match=match):
        from_consolidated(path)


@pytest.mark.parametrize("extra,match", [
    ({"cls": "Unknown"}, "unknown class"),
    ({"cls": "<class 'nowhere.Missing'>"}, "No tensorclass"),
    ({"leaves": []}, "must be objects"),
    ({"child": 3}, "JSON int"),
    ({"cls_metadata": {"batch_size": [5]}}, "cannot be rebuilt"),
    ({"non_tensors": {"v": ["a", [], None, 4]}}, r"\[value, batch_size"),
    ({"child": {"cls": "NonTensorStack", "non_tensors": {"0": ["a", [], None], "2": ["b", [], None]}}}, "'0' to '1'"),
])
def test_tree_checked(tmp_path, extra, match):
    path = _leaf_file(tmp_path, ["torch.float32", [4], 0, 16, 0], extra=extra)
    with pytest.raises(FormatError, match=match):
        from_consolidated(path)


def test_random_damage_is_an_error_or_a_tree(tmp_path):
    path = tmp_path / "td.bin"
    _tree().consolidate(filename=path)
    raw = bytearray(path.read_bytes())
    rng = random.Random(12)
    for _ in range(300):
        damaged = bytearray(raw)
        for _ in range(rng.randint(1, 4)):
            damaged[rng.randrange(len(damaged))] = rng.randrange(256)
        path.write_bytes(bytes(damaged))
        try:
            from_consolidated(path)
        except FormatError as error:
            assert str(path) in str(error)


def test_fifo_and_directory_refused_without_blocking(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "dir").mkdir()
    errors = []

    def read_both():
        for name in ("fifo", "dir"):
            try:
                from_consolidated(tmp_path / name)
            except FormatError as error:
                errors.append(str(error))

    reader = threading.Thread(target=read_both, daemon=True)
    reader.start()
    reader.join(WAIT)
    assert not reader.is_alive(), "from_consolidated blocked on a FIFO"
    assert "a FIFO" in errors[0] and "a directory" in errors[1]


def test_locked_in_the_file_is_locked(tmp_path):
    path = _leaf_file(tmp_path, ["torch.float32", [4], 0, 16, 0])
    meta = _split(path)[1]
    meta["cls_metadata"]["is_locked"] = True
    _write(path, bytes(range(64)), meta)
    assert from_consolidated(path).is_locked


def test_a_file_written_again_keeps_its_permissions(tmp_path):
    # the new file is renamed over the old one: it had the umask's mode (0o644 from 0o640)
    path = tmp_path / "td.bin"
    TensorDict(a=torch.zeros(2)).consolidate(filename=path)
    os.chmod(path, 0o640)
    TensorDict(a=torch.ones(2)).consolidate(filename=path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o640
    assert TensorDict.from_consolidated(path)["a"].tolist() == [1.0, 1.0]
