"""A save on a read-only file system, or with files this process may not write, loads
read-only (issue "Trust", item 9): its leaves are ReadOnlyMemoryMappedTensors over
private mappings, every write through shared_td or torch raises a ReadOnlyError naming
the file, why, and what to do, and nothing reaches the files. Views stay read-only (also
in forked and spawned children), clone() gives writable tensors, and memmap_() never
keeps a private mapping as if it were memory-mapped."""
from __future__ import annotations

import copy
import multiprocessing
import os
import pickle
import shutil
import subprocess
import tempfile

import pytest
import torch

from tests.persist.persist_helpers import bits, dir_state, make_td
from tests.processes import WAIT, finish
from tests.persist.read_only_children import load_and_write_as_nobody, reference_tensor, write_received
from tests.persist.test_load_untrusted import in_child, verify_json

from shared_td import MemoryMappedTensor, ReadOnlyError, TensorDict, lazy_stack
from shared_td.memmap_tensor import ReadOnlyMemoryMappedTensor

FS_REASON = "read-only file system"


@pytest.fixture
def read_only_mount(tmp_path):
    """(source, mount point): a read-only bind mount of source (skipped if not allowed)."""
    source, point = tmp_path / "src", tmp_path / "ro"
    source.mkdir()
    point.mkdir()
    done = subprocess.run(["mount", "--bind", str(source), str(point)], capture_output=True)
    if done.returncode:
        pytest.skip(f"cannot bind-mount (needs root / CAP_SYS_ADMIN): {done.stderr.decode().strip()}")
    try:
        done = subprocess.run(["mount", "-o", "remount,ro,bind", str(point)], capture_output=True)
        if done.returncode:
            pytest.skip(f"cannot remount read-only: {done.stderr.decode().strip()}")
        yield source, point
    finally:
        subprocess.run(["umount", "-l", str(point)], check=True, timeout=30)


def small_td() -> TensorDict:
    return TensorDict(
        {"a": reference_tensor(), "nested": {"b": torch.arange(3, dtype=torch.int64)}},
        batch_size=[3],
    )


@pytest.fixture
def loaded(read_only_mount):
    """(loaded tensordict, the saved directory as written, its state): a small save
    loaded from the read-only mount."""
    source, point = read_only_mount
    small_td().memmap(source / "s")
    return TensorDict.load_memmap(point / "s"), source / "s", dir_state(source / "s")


def assert_refused(error, path_part: str) -> None:
    message = str(error.value)
    assert path_part in message and FS_REASON in message and ".clone()" in message, message


# ----------------------------------------------------------------- loading read-only
def test_a_save_on_a_read_only_file_system_loads(read_only_mount):
    source, point = read_only_mount
    td = make_td()
    td.save(source / "s")
    with pytest.raises(OSError):  # it is read-only indeed
        open(point / "s" / "float32.memmap", "r+b")
    loaded = TensorDict.load_memmap(point / "s")
    for key in ("float32", "int64", "bfloat16"):
        assert bits(loaded[key]) == bits(td[key])
    leaf = loaded["float32"]
    assert type(leaf) is ReadOnlyMemoryMappedTensor and not leaf._backing.shared
    with pytest.raises(ReadOnlyError) as error:
        leaf.fill_(5.0)
    assert_refused(error, str(point / "s" / "float32.memmap"))
    assert bits(leaf) == bits(td["float32"])  # not even this process's copy changed
    assert (source / "s" / "float32.memmap").read_bytes()[: leaf.nbytes] == bits(td["float32"])
    code, document = verify_json(point / "s")
    assert (code, document["problems"]) == (0, [])


@pytest.fixture
def world_readable():
    """A directory that user nobody can reach (pytest's tmp_path is root-only)."""
    top = tempfile.mkdtemp(prefix="shared_td_ro_")
    os.chmod(top, 0o755)
    yield top
    shutil.rmtree(top)


def test_read_only_files_load_read_only(world_readable):
    """Files nobody may not write (0444) in directories it may write: the load is
    read-only, a write and a memmap_() into the save's own files are refused, and the
    files keep their bytes."""
    if os.getuid() != 0:
        pytest.skip("needs root, to drop to user nobody in a child (root ignores file modes)")
    path = os.path.join(world_readable, "s")
    small_td().memmap(path)
    for directory, _, names in os.walk(path):
        os.chmod(directory, 0o777)
        for name in names:
            os.chmod(os.path.join(directory, name), 0o444)
    before = dir_state(path)
    outcome = in_child(load_and_write_as_nobody, path)
    assert outcome[0] == "returned", outcome
    kind, shared, messages, values, is_memmap = outcome[1]
    assert (kind, shared, values) == ("ReadOnlyMemoryMappedTensor", False, reference_tensor().tolist())
    leaf_file = os.path.join(path, "a.memmap")
    assert all(m is not None and leaf_file in m and "no permission to write" in m for m in messages), messages
    assert "new prefix" in messages[1]
    assert dir_state(path) == before


# ----------------------------------------------------------------- every write path
WRITES = {
    "set_": lambda td: td.set_("a", torch.ones(3, 2)),
    "setitem same structure (fast lane)": lambda td: td.__setitem__(0, td[1].clone()),
    "setitem dict": lambda td: td.__setitem__(0, {"a": torch.ones(2)}),
    "setitem number": lambda td: td.__setitem__(slice(1, None), 0),
    "update_": lambda td: td.update_({"a": torch.ones(3, 2)}),
    "update inplace": lambda td: td.update({"a": torch.ones(3, 2)}, inplace=True),
    "apply inplace": lambda td: td.apply(lambda x: x + 1, inplace=True),
    "copy_": lambda td: td.copy_(td.clone()),
    "fill_": lambda td: td.fill_("a", 1.0),
    "zero_": lambda td: td.zero_(),
    "nested leaf add_": lambda td: td["nested", "b"].add_(1),
    "leaf setitem": lambda td: td["a"].__setitem__(0, 1.0),
    "leaf iadd": lambda td: td["a"].__iadd__(1),
    "leaf copy_": lambda td: td["a"].copy_(torch.ones(3, 2)),
    "torch out=": lambda td: torch.mul(td["a"], 2, out=td["a"]),
    "torch function in-place": lambda td: torch.relu_(td["a"]),
    "foreach": lambda td: torch._foreach_add_([td["a"]], 1.0),
    "index_put_": lambda td: td["a"].index_put_((torch.tensor([0]),), torch.ones(2)),
    "data setter": lambda td: setattr(td["a"], "data", torch.ones(3, 2)),
    "row view fill_": lambda td: td[0]["a"].fill_(3.0),
    "lazy stack zero_": lambda td: lazy_stack([td[0], td[1]]).zero_(),
    "memmap_ to own prefix": lambda td: td.memmap_(),
}


@pytest.mark.parametrize("write", list(WRITES))
def test_every_write_is_refused_naming_the_file(loaded, write):
    td, saved, state = loaded
    with pytest.raises(ReadOnlyError) as error:
        WRITES[write](td)
    assert_refused(error, str(td._memmap_prefix))
    assert td["a"].tolist() == reference_tensor().tolist()
    assert td["nested", "b"].tolist() == [0, 1, 2]
    assert dir_state(saved) == state


@pytest.mark.parametrize("fast_lane", [True, False])
def test_a_row_write_into_a_mixed_tree_writes_nothing(loaded, fast_lane):
    """A writable leaf listed before a read-only one is not written either."""
    td, _, _ = loaded
    mixed = TensorDict({"w": torch.zeros(3), "a": td["a"]}, batch_size=[3])
    row = {"w": torch.ones(()), "a": torch.ones(2)}
    with pytest.raises(ReadOnlyError):
        mixed[0] = TensorDict(row, batch_size=[]) if fast_lane else row
    assert mixed["w"].tolist() == [0.0, 0.0, 0.0]


# ----------------------------------------------------------------- views, copies
VIEWS = {
    "int index": lambda t: t[0],
    "slice": lambda t: t[1:],
    "view": lambda t: t.view(-1),
    "reshape": lambda t: t.reshape(-1),
    "transpose": lambda t: t.t(),
    "unbind method": lambda t: t.unbind(0)[1],
    "torch.unbind": lambda t: torch.unbind(t)[1],
    "split": lambda t: t.split(1)[0],
    "narrow": lambda t: t.narrow(0, 1, 1),
    "expand": lambda t: t.expand(2, 3, 2),
    "detach": lambda t: t.detach(),
    "data": lambda t: t.data,
    "view of a view": lambda t: t[1:].view(-1)[2:],
}


@pytest.mark.parametrize("view", list(VIEWS))
def test_views_stay_read_only(loaded, view):
    td, saved, state = loaded
    result = VIEWS[view](td["a"])
    assert type(result) is ReadOnlyMemoryMappedTensor
    with pytest.raises(ReadOnlyError):
        result.fill_(8.0)
    with pytest.raises(ReadOnlyError):
        result[...] = 8.0
    assert td["a"].tolist() == reference_tensor().tolist()
    assert dir_state(saved) == state


def test_copies_are_writable(loaded):
    td, saved, state = loaded
    leaf = td["a"]
    copies = [leaf.clone(), leaf + 0, leaf[[0, 2]], leaf.to(torch.float64), td.clone()["a"],
              td.contiguous()["a"]]
    for result in copies:
        assert type(result) is torch.Tensor, type(result)
        result.fill_(4.0)
    deep = copy.deepcopy(leaf)
    assert type(deep) is MemoryMappedTensor
    deep.fill_(4.0)
    cloned = td.clone()
    cloned.zero_()
    cloned[0] = td[1]  # a read-only tensordict may be the source of a write
    cloned["a"][1] = leaf[2]
    assert cloned["a"].tolist() == [[2.0, 3.0], [4.0, 5.0], [0.0, 0.0]]
    assert torch.zeros(3, 2).copy_(leaf).tolist() == reference_tensor().tolist()
    assert leaf.tolist() == reference_tensor().tolist()
    assert dir_state(saved) == state


def test_numpy_view_is_read_only(loaded):
    td, _, _ = loaded
    array = td["a"].numpy()
    assert not array.flags.writeable
    with pytest.raises(ValueError):
        array[0, 0] = 1.0


# ----------------------------------------------------------------- pickling
def test_pickling_keeps_it_read_only(loaded):
    td, _, _ = loaded
    leaf = pickle.loads(pickle.dumps(td["a"][1:]))
    assert type(leaf) is ReadOnlyMemoryMappedTensor and leaf.tolist() == [[2.0, 3.0], [4.0, 5.0]]
    with pytest.raises(ReadOnlyError):
        leaf.add_(1)
    again = pickle.loads(pickle.dumps(td))
    assert type(again["nested", "b"]) is ReadOnlyMemoryMappedTensor


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_child_that_receives_it_cannot_write_either(loaded, method):
    td, saved, state = loaded
    context = multiprocessing.get_context(method)
    inbox, results = context.Queue(), context.Queue()
    child = context.Process(target=write_received, args=(inbox, results), daemon=True)
    child.start()
    inbox.put((td, td["a"][1]))
    outcome = results.get(timeout=WAIT)
    assert finish(child) == 0
    assert outcome[:2] == ["ReadOnlyMemoryMappedTensor", "ReadOnlyMemoryMappedTensor"]
    for what, message in outcome[2:5]:
        assert what == "refused" and str(td["a"].filename) in message and FS_REASON in message
    assert outcome[5] == reference_tensor().tolist()
    assert dir_state(saved) == state


# ----------------------------------------------------------------- memmap_ of a private mapping
def test_memmap_to_a_new_prefix_copies_read_only_leaves(loaded, tmp_path):
    td, saved, state = loaded
    td.memmap_(tmp_path / "new")
    leaf = td["a"]
    assert td.is_memmap() and type(leaf) is MemoryMappedTensor and leaf._backing.shared
    assert leaf.filename == str(tmp_path / "new" / "a.memmap")
    leaf.fill_(6.0)  # reaches the new file
    assert TensorDict.load_memmap(tmp_path / "new")["a"].tolist() == [[6.0, 6.0]] * 3
    assert dir_state(saved) == state


def test_memmap_to_its_own_file_writes_a_copy_on_write_leaf(tmp_path):
    """A leaf mapped copy-on-write (mode="r") of a writable file, written in this
    process: memmap_ into that file writes its bytes there, and maps it shared."""
    small_td().memmap(tmp_path / "s")
    leaf = MemoryMappedTensor.from_filename(tmp_path / "s" / "a.memmap", torch.float32, (3, 2), mode="r")
    leaf.fill_(3.0)  # private: only this process sees it
    td = TensorDict({"a": leaf}, batch_size=[3])
    td.memmap_(tmp_path / "s")
    assert td["a"]._backing.shared
    assert TensorDict.load_memmap(tmp_path / "s")["a"].tolist() == [[3.0, 3.0]] * 3
    td["a"][0] = 1.0  # and later writes reach the file
    assert TensorDict.load_memmap(tmp_path / "s")["a"][0].tolist() == [1.0, 1.0]
