"""Audit 18, MemoryMappedTensor: anonymous memory bigger than RAM refused before any
allocation, tensors naming the path they were opened by (not the one first mapped), one
element with a non-unit stride, failed creates leave no file, a shrunk own file noticed,
aten overloads refused on read-only tensors, ``full(-0.0)``, and ``from_storage`` that
never grows the caller's storage. Side by side with tensordict 0.15.3 where it makes
sense."""
from __future__ import annotations

import errno
import io
import os
import pickle
from multiprocessing.reduction import ForkingPickler

import pytest
import torch

from shared_td import MemoryMappedTensor, TensorDict, memory_check, platform
from shared_td.errors import FileReplacedError, ReadOnlyError, StorageFullError
from shared_td.memmap_tensor import tensor as tensor_module
from shared_td.storage import files
from shared_td.storage.anonymous import Segment
from shared_td.storage.shared_value import SharedValue


def _reference():
    return pytest.importorskip("tensordict").MemoryMappedTensor


def _open_fds() -> set:
    return set(os.listdir("/proc/self/fd"))


def _more_than_the_memory() -> int:
    """More bytes than MemAvailable + SwapFree (so than any cgroup's room too), by 1 TiB."""
    with open("/proc/meminfo") as source:
        fields = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in source}
    return fields["MemAvailable"] + fields.get("SwapFree", 0) + (1 << 40)


# ------------------------------------------------ 1. anonymous memory bigger than RAM


@pytest.fixture
def recorded_fallocate(monkeypatch):
    """posix_fallocate replaced by a recorder that allocates nothing (a real call of the
    sizes below would fill memory until the OOM killer ends some process)."""
    calls = []

    def record(fd, offset, nbytes):
        calls.append(nbytes)
        raise OSError(errno.ENOSPC, "recorded, not allocated")

    monkeypatch.setattr(os, "posix_fallocate", record)
    return calls


def test_a_segment_bigger_than_the_memory_is_refused_before_any_allocation(recorded_fallocate):
    ask = _more_than_the_memory()
    before = _open_fds()
    with pytest.raises(StorageFullError, match=rf"{ask} bytes.*available \(MemAvailable \d+ \+ SwapFree \d+"):
        Segment.create(ask)
    assert recorded_fallocate == []
    assert _open_fds() == before


def test_an_anonymous_tensor_bigger_than_the_memory_is_refused(recorded_fallocate):
    with pytest.raises(StorageFullError, match="Not enough memory"):
        MemoryMappedTensor.empty(_more_than_the_memory() // 4, dtype=torch.float32)
    assert recorded_fallocate == []


def test_memory_taken_while_reserving_stops_it_and_frees_what_was_reserved(monkeypatch):
    monkeypatch.setattr(memory_check, "_CHECKED_SIZE", 4096, raising=False)
    monkeypatch.setattr(platform, "_ALLOCATE_CHUNK", 4096, raising=False)
    rooms = iter([1 << 30, 1 << 30, 4096])  # the third check finds the memory gone
    monkeypatch.setattr(memory_check, "memory_room", lambda: (next(rooms), "MemAvailable (test)"), raising=False)
    reserved = []
    real = os.posix_fallocate
    monkeypatch.setattr(os, "posix_fallocate", lambda fd, offset, n: (reserved.append(n), real(fd, offset, n)))
    before = _open_fds()
    with pytest.raises(StorageFullError, match="8192 bytes"):
        Segment.create(4 * 4096)
    assert reserved == [4096, 4096]  # two chunks, then refused: the memfd closed (freed)
    assert _open_fds() == before


def test_small_and_fitting_segments_are_made_as_before():
    seg = Segment.create(1 << 24)  # checked, and fits
    assert seg.nbytes == 1 << 24 and os.fstat(seg.fd).st_size == 1 << 24


# --------------------------------------------------------- 2. the path asked for


def test_from_filename_of_a_moved_file_records_the_new_path(tmp_path):
    a_path, c_path = str(tmp_path / "a.memmap"), str(tmp_path / "c.memmap")
    a = MemoryMappedTensor.from_tensor(torch.arange(4.0), filename=a_path)  # keeps its mapping
    os.rename(a_path, c_path)
    c = MemoryMappedTensor.from_filename(c_path, torch.float32, (4,))
    assert c.filename == c_path and a.filename == a_path
    c[0] = 7.0
    assert a[0] == 7.0  # one mapping still
    assert MemoryMappedTensor.from_tensor(c, filename=c_path) is c
    # a new file at the old name: c pickles as c's path, never the new a's
    MemoryMappedTensor.from_tensor(torch.full((4,), 99.0), filename=a_path)
    received = pickle.loads(pickle.dumps(c))
    assert received.filename == c_path and received.tolist() == [7.0, 1.0, 2.0, 3.0]
    link = str(tmp_path / "h.memmap")
    os.link(c_path, link)
    assert MemoryMappedTensor.from_filename(link, torch.float32, (4,)).filename == link


def test_a_receiver_writes_into_the_file_the_sender_opened(tmp_path):
    a_path, c_path = str(tmp_path / "a.memmap"), str(tmp_path / "c.memmap")
    a = MemoryMappedTensor.from_tensor(torch.arange(4.0), filename=a_path)
    os.rename(a_path, c_path)
    c = MemoryMappedTensor.from_filename(c_path, torch.float32, (4,))
    MemoryMappedTensor.from_tensor(torch.full((4,), 99.0), filename=a_path)
    sent = pickle.dumps(c)
    pid = os.fork()  # a receiver (its cache inherited: it maps by the path pickled)
    if pid == 0:
        try:
            pickle.loads(sent).fill_(-1)
        finally:
            os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    assert c.tolist() == [-1.0] * 4 and a.tolist() == [-1.0] * 4
    assert MemoryMappedTensor.from_filename(a_path, torch.float32, (4,)).tolist() == [99.0] * 4


def test_load_memmap_of_a_moved_save_names_the_new_prefix(tmp_path):
    first, moved = str(tmp_path / "A"), str(tmp_path / "B")
    td = TensorDict({"a": torch.arange(4.0)}, [4]).memmap_(first)  # keeps the mapping
    os.rename(first, moved)
    loaded = TensorDict.load_memmap(moved)
    assert loaded["a"].filename == os.path.join(moved, "a.memmap")
    TensorDict({"a": torch.zeros(4)}, [4]).memmap_(first)  # a new save at the old prefix
    loaded.memmap_(moved, existsok=True)  # its own prefix: no copy refused
    assert loaded["a"].filename == os.path.join(moved, "a.memmap")
    assert td["a"].tolist() == [0.0, 1.0, 2.0, 3.0]


# ---------------------------------------------- 3. one element, a non-unit stride


def _one_element_inputs():
    return {"column of a batch of one": torch.arange(6.0).view(1, 6)[:, 2],
            "imag of a conj": torch.tensor([1 + 2j]).conj().imag}


@pytest.mark.parametrize("name", list(_one_element_inputs()))
@pytest.mark.parametrize("to_file", [False, True])
def test_one_element_with_a_non_unit_stride(tmp_path, name, to_file):
    x = _one_element_inputs()[name]
    assert x.stride(0) != 1
    filename = str(tmp_path / "x.memmap") if to_file else None
    ours = MemoryMappedTensor.from_tensor(x, filename=filename)
    assert ours.tolist() == x.tolist()
    theirs = _reference().from_tensor(x, filename=str(tmp_path / "y.memmap") if to_file else None)
    assert theirs.tolist() == ours.tolist()


def test_one_element_with_a_non_unit_stride_saves_to_an_archive(tmp_path):
    x = _one_element_inputs()["imag of a conj"]
    TensorDict({"a": x}, []).save(str(tmp_path / "x.tdz"))
    assert TensorDict.load(str(tmp_path / "x.tdz"))["a"].tolist() == [-2.0]


# ------------------------------------------------ 4. a failed create leaves no file


@pytest.mark.parametrize("shape", [(2,), (-1,), (3, -2)])
def test_a_shape_that_cannot_be_filled_leaves_no_file(tmp_path, shape):
    path = tmp_path / "x.memmap"
    with pytest.raises((RuntimeError, ValueError)):
        MemoryMappedTensor.from_tensor(torch.ones(3), shape=shape, filename=path)
    assert not path.exists()
    with pytest.raises((RuntimeError, ValueError)):  # tensordict refuses them too
        _reference().from_tensor(torch.ones(3), shape=shape, filename=str(tmp_path / "y.memmap"))
    assert MemoryMappedTensor.from_tensor(torch.ones(3), filename=path).tolist() == [1.0] * 3


def test_a_shape_that_broadcasts_is_still_written(tmp_path):
    t = MemoryMappedTensor.from_tensor(torch.tensor([1.0, 2.0]), shape=(3, 2), filename=tmp_path / "x")
    assert t.tolist() == [[1.0, 2.0]] * 3


@pytest.mark.parametrize("anonymous", [False, True])
def test_more_bytes_than_a_file_can_hold_is_a_value_error_naming_them(tmp_path, anonymous):
    path = None if anonymous else tmp_path / "x.memmap"
    with pytest.raises(ValueError, match=r"torch.int64 tensor of shape \(2305843009213693952,\) needs 18446744073709551616 bytes"):
        MemoryMappedTensor.empty(2**61, dtype=torch.int64, filename=path)
    assert anonymous or not path.exists()


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
def test_a_quantized_tensor_is_refused_before_any_file(tmp_path):
    q = torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.qint8)
    with pytest.raises(NotImplementedError, match="quantized"):
        MemoryMappedTensor.from_tensor(q, filename=tmp_path / "x.memmap")
    assert not (tmp_path / "x.memmap").exists()
    with pytest.raises(NotImplementedError):
        _reference().from_tensor(q, filename=str(tmp_path / "y.memmap"))


@pytest.mark.parametrize("data", [False, True])
def test_a_create_that_fails_after_the_file_was_made_removes_it(tmp_path, monkeypatch, data):
    path = tmp_path / "x.memmap"

    def fail(*args, **kwargs):
        raise OSError(errno.ENOMEM, "a mapping refused (test)")

    monkeypatch.setattr(files, "backing_from_fd", fail)
    with pytest.raises(OSError, match="test"):
        if data:
            MemoryMappedTensor.from_tensor(torch.ones(3), filename=path)
        else:
            MemoryMappedTensor.zeros(3, filename=path)
    assert not path.exists()
    monkeypatch.undo()
    assert MemoryMappedTensor.zeros(3, filename=path).tolist() == [0.0] * 3  # the retry works


def test_a_half_written_file_is_removed(tmp_path, monkeypatch):
    path = tmp_path / "x.memmap"
    real = files.pwrite_all

    def half(fd, data, offset, *, where):
        real(fd, memoryview(data)[:4], offset, where=where)
        raise StorageFullError(errno.ENOSPC, "disk full (test)")

    monkeypatch.setattr(files, "pwrite_all", half)
    with pytest.raises(StorageFullError):
        MemoryMappedTensor.from_tensor(torch.ones(3), filename=path)
    assert not path.exists()


def test_a_failed_create_leaves_a_file_put_there_since(tmp_path, monkeypatch):
    path = tmp_path / "x.memmap"

    def replaced_then_fail(*args, **kwargs):
        (tmp_path / "other").write_bytes(b"theirs")
        os.replace(tmp_path / "other", path)  # someone else's file at the name now
        raise OSError(errno.ENOMEM, "a mapping refused (test)")

    monkeypatch.setattr(files, "backing_from_fd", replaced_then_fail)
    with pytest.raises(OSError, match="test"):
        MemoryMappedTensor.zeros(3, filename=path)
    assert path.read_bytes() == b"theirs"


def test_an_existing_file_reused_is_not_removed_on_failure(tmp_path, monkeypatch):
    path = tmp_path / "x.memmap"
    path.write_bytes(b"\0" * 12)
    monkeypatch.setattr(files, "backing_from_fd", lambda *a, **k: (_ for _ in ()).throw(OSError("test")))
    with pytest.raises(OSError, match="test"):
        MemoryMappedTensor.zeros(3, filename=path, existsok=True)
    assert path.exists()


# ------------------------------------------------------- 5. a shrunk own file


def test_from_tensor_of_a_shrunk_own_file_is_refused(tmp_path):
    path = str(tmp_path / "x.memmap")
    t = MemoryMappedTensor.from_tensor(torch.arange(8192, dtype=torch.int64), filename=path)
    os.truncate(path, 4096)  # another process shrinks it: reading t's tail is a SIGBUS
    with pytest.raises(RuntimeError, match="no longer the file this tensor maps"):
        MemoryMappedTensor.from_tensor(t, filename=path)


# ------------------------------------------ 6. aten overloads on read-only tensors


def _read_only(tmp_path):
    path = str(tmp_path / "x.memmap")
    MemoryMappedTensor.from_tensor(torch.zeros(4), filename=path)
    backing = files.open_file_backing(path, shared=False, read_only="it is a test")
    return MemoryMappedTensor._from_backing(backing, 0, torch.float32, (4,))


@pytest.mark.parametrize("write", [
    lambda t: torch.ops.aten.add_.Tensor(t, torch.ones(4)),
    lambda t: torch.ops.aten.fill_.Scalar(t, 3.0),
    lambda t: torch.ops.aten.mul_.Scalar(t[1:], 2),
    lambda t: torch.ops.aten.add.out(torch.ones(4), torch.ones(4), out=t),
    lambda t: torch.ops.aten._foreach_add_.Scalar([t], 1.0),
], ids=["add_.Tensor", "fill_.Scalar", "mul_.Scalar of a view", "add.out", "_foreach_add_.Scalar"])
def test_aten_overload_writes_into_a_read_only_tensor_are_refused(tmp_path, write):
    t = _read_only(tmp_path)
    with pytest.raises(ReadOnlyError, match="it is a test"):
        write(t)
    assert t.tolist() == [0.0] * 4


def test_aten_overloads_that_do_not_write_still_run_on_read_only(tmp_path):
    t = _read_only(tmp_path)
    assert torch.ops.aten.add.Tensor(t, torch.ones(4)).tolist() == [1.0] * 4
    assert torch.ops.aten.add_.Tensor(torch.zeros(4), t).tolist() == [0.0] * 4  # t only read


# ---------------------------------------------------------------- 7. full(-0.0)


@pytest.mark.parametrize("to_file", [False, True])
def test_full_of_negative_zero_keeps_the_sign(tmp_path, to_file):
    filename = tmp_path / "x.memmap" if to_file else None
    ours = MemoryMappedTensor.full((3,), fill_value=-0.0, filename=filename)
    theirs = _reference().full((3,), fill_value=-0.0)
    assert ours.signbit().tolist() == theirs.signbit().tolist() == [True] * 3
    assert MemoryMappedTensor.full((2,), fill_value=complex(0.0, -0.0), dtype=torch.complex64).imag.signbit().all()
    assert not MemoryMappedTensor.full((2,), fill_value=0.0).signbit().any()


# ------------------------------------------------ from_storage bigger than storage


def test_from_storage_never_grows_the_callers_storage():
    base = torch.zeros(4)
    storage = base.untyped_storage()
    pointer = storage.data_ptr()
    with pytest.raises(RuntimeError, match=r"shape '\[1000\]' is invalid for input of size 4"):
        MemoryMappedTensor.from_storage(storage, shape=(1000,), dtype=torch.float32)
    assert storage.nbytes() == 16 and storage.data_ptr() == pointer
    with pytest.raises(RuntimeError, match=r"shape '\[1000\]' is invalid"):
        _reference().from_storage(storage, shape=(1000,), dtype=torch.float32)
    assert MemoryMappedTensor.from_storage(storage, shape=(2, 2), dtype=torch.float32).shape == (2, 2)


def _fake_cgroup(tmp_path, names, limit, usage, stat):
    for name, value in zip(names, (limit, usage, stat)):
        (tmp_path / name).write_text(value)
    return str(tmp_path)


@pytest.mark.parametrize("names, prefix", [
    (("memory.max", "memory.current", "memory.stat"), ""),  # cgroup v2
    (("memory.limit_in_bytes", "memory.usage_in_bytes", "memory.stat"), "total_"),  # v1
])
def test_the_room_under_a_cgroup_limit_counts_its_file_cache_as_free(tmp_path, names, prefix):
    stat = f"anon 5\n{prefix}active_file 100\n{prefix}inactive_file 50\n"
    directory = _fake_cgroup(tmp_path, names, "1000000\n", "600000\n", stat)
    assert memory_check._cgroup_level(directory, names[0], names[1], prefix) == 1000000 - 600000 + 150
    unlimited = "max\n" if prefix == "" else f"{2**63 - 4096}\n"
    directory = _fake_cgroup(tmp_path, names, unlimited, "600000\n", stat)
    assert memory_check._cgroup_level(directory, names[0], names[1], prefix) is None


def test_a_tighter_cgroup_limit_is_the_room_and_is_named(monkeypatch, recorded_fallocate):
    monkeypatch.setattr(memory_check, "_cgroup_room", lambda swap_free=0: (1 << 25, "the memory limit of cgroup /test"))
    assert memory_check.memory_room()[0] == 1 << 25
    with pytest.raises(StorageFullError, match="cgroup /test"):
        Segment.create(1 << 26)
    assert recorded_fallocate == []


# ------------------------------------------------ second round: from_storage of a moved file


def test_from_storage_of_a_moved_file_records_its_name_now(tmp_path):
    a, c = str(tmp_path / "a.memmap"), str(tmp_path / "c.memmap")
    first = MemoryMappedTensor.from_tensor(torch.zeros(4), filename=a)  # (alive: its mapping is reused)
    os.rename(a, c)
    opened = MemoryMappedTensor.from_filename(c, dtype=torch.float32, shape=(4,))
    viewed = MemoryMappedTensor.from_storage(opened.untyped_storage(), dtype=torch.float32)
    assert viewed.filename == c
    named = MemoryMappedTensor.from_storage(opened.untyped_storage(), dtype=torch.float32, filename=c)
    assert named.filename == c
    MemoryMappedTensor.from_tensor(torch.ones(4), filename=a)  # another file at the old name
    received = pickle.loads(pickle.dumps(viewed))
    received.fill_(-1.0)
    assert opened.tolist() == first.tolist() == [-1.0] * 4  # the file it maps, not the new one at a
    assert MemoryMappedTensor.from_filename(a, dtype=torch.float32, shape=(4,)).tolist() == [1.0] * 4
    # tensordict records the name it was opened by too
    ref = _reference()
    theirs = ref.from_filename(c, dtype=torch.float32, shape=(4,))
    assert ref.from_storage(theirs.untyped_storage(), dtype=torch.float32).filename == c


def test_from_storage_with_no_name_of_the_moved_file_asks_for_filename(tmp_path):
    a, c = str(tmp_path / "a.memmap"), str(tmp_path / "c.memmap")
    first = MemoryMappedTensor.from_tensor(torch.zeros(4), filename=a)
    os.rename(a, c)
    MemoryMappedTensor.from_tensor(torch.ones(4), filename=a)  # another file at the old name
    with pytest.raises(FileReplacedError, match="pass filename="):
        MemoryMappedTensor.from_storage(first.untyped_storage(), dtype=torch.float32)
    with pytest.raises(RuntimeError, match="differs"):
        MemoryMappedTensor.from_storage(first.untyped_storage(), dtype=torch.float32, filename=a)
    named = MemoryMappedTensor.from_storage(first.untyped_storage(), dtype=torch.float32, filename=c)
    assert named.filename == c
    pickle.loads(pickle.dumps(named)).fill_(2.0)
    assert first.tolist() == [2.0] * 4


# ------------------------------------------------ second round: a failed fill leaves no file


@pytest.mark.parametrize("fill_value, dtype", [(300, torch.uint8), ("x", torch.float32),
                                               (1.5 + 2j, torch.int64)])
def test_a_fill_value_the_dtype_cannot_hold_leaves_no_file(tmp_path, fill_value, dtype):
    kinds = []
    for cls, path in ((MemoryMappedTensor, tmp_path / "ours.memmap"), (_reference(), tmp_path / "theirs.memmap")):
        with pytest.raises((RuntimeError, TypeError)) as raised:
            cls.full(3, fill_value=fill_value, dtype=dtype, filename=path)
        kinds.append(type(raised.value))
        assert not path.exists()
        assert cls.full(3, fill_value=3, dtype=torch.uint8, filename=path).tolist() == [3] * 3  # a retry
    assert kinds[0] is kinds[1]  # the same exception as tensordict's


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
def test_full_of_a_quantized_dtype_is_refused_as_before(tmp_path):
    with pytest.raises(NotImplementedError, match="quantized"):
        MemoryMappedTensor.full(3, fill_value=1, dtype=torch.qint8, filename=tmp_path / "x.memmap")
    assert not (tmp_path / "x.memmap").exists()


def _failing(monkeypatch, name, then=None):
    def fail(self, *args, **kwargs):
        if then is not None:
            then()
        raise RuntimeError(f"{name} failed (test)")
    monkeypatch.setattr(MemoryMappedTensor, name, fail)


@pytest.mark.parametrize("make", ["full", "copy"])
def test_a_fill_or_copy_that_fails_after_the_file_was_made_removes_it(tmp_path, monkeypatch, make):
    path = tmp_path / "x.memmap"
    if make == "full":
        _failing(monkeypatch, "fill_")
        call = lambda: MemoryMappedTensor.full(3, fill_value=2.0, filename=path)  # noqa: E731
    else:  # a non-contiguous input copied through the mapping
        monkeypatch.setattr(tensor_module, "_CONTIGUOUS_COPY_LIMIT", 0)
        _failing(monkeypatch, "copy_")
        call = lambda: MemoryMappedTensor.from_tensor(torch.ones(6)[::2], filename=path)  # noqa: E731
    with pytest.raises(RuntimeError, match="failed \\(test\\)"):
        call()
    assert not path.exists()
    monkeypatch.undo()
    assert call().tolist() in ([2.0] * 3, [1.0] * 3)  # the retry works


def test_a_failed_fill_keeps_a_file_put_there_since_and_a_reused_one(tmp_path, monkeypatch):
    path = tmp_path / "x.memmap"

    def replace():
        (tmp_path / "other").write_bytes(b"theirs")
        os.replace(tmp_path / "other", path)

    _failing(monkeypatch, "fill_", replace)
    with pytest.raises(RuntimeError, match="test"):
        MemoryMappedTensor.full(3, fill_value=2.0, filename=path)
    assert path.read_bytes() == b"theirs"
    reused = tmp_path / "reused.memmap"
    reused.write_bytes(b"\0" * 12)
    _failing(monkeypatch, "fill_")
    with pytest.raises(RuntimeError, match="test"):
        MemoryMappedTensor.full(3, fill_value=2.0, filename=reused, existsok=True)
    assert reused.exists()


# ------------------------------------------------ second round: a cgroup's swap room

_G = 1 << 30


def _fake_level(tmp_path, files_and_values):
    for name, value in files_and_values.items():
        (tmp_path / name).write_text(value)
    return str(tmp_path)


@pytest.mark.parametrize("swap_files, swap_room", [
    ({}, 16 * _G),  # no swap accounting: the system's swap
    ({"memory.swap.max": "max\n", "memory.swap.current": "0\n"}, 16 * _G),
    ({"memory.swap.max": f"{2 * _G}\n", "memory.swap.current": f"{_G // 2}\n"}, 3 * _G // 2),
    ({"memory.swap.max": "0\n", "memory.swap.current": "0\n"}, 0),
    ({"memory.swap.max": f"{64 * _G}\n", "memory.swap.current": "0\n"}, 16 * _G),  # capped
])
def test_a_cgroup_v2_counts_its_swap_room(tmp_path, swap_files, swap_room):
    directory = _fake_level(tmp_path, {"memory.max": f"{4 * _G}\n", "memory.current": f"{_G}\n",
                                       "memory.stat": "anon 1\nactive_file 0\ninactive_file 0\n",
                                       **swap_files})
    found = memory_check._cgroup_level(directory, "memory.max", "memory.current", "", swap_free=16 * _G)
    assert found == 3 * _G + swap_room


def test_a_cgroup_v1_counts_its_memsw_room_less_the_memory_part(tmp_path):
    directory = _fake_level(tmp_path, {
        "memory.limit_in_bytes": f"{4 * _G}\n", "memory.usage_in_bytes": f"{_G}\n",
        "memory.stat": "total_active_file 0\ntotal_inactive_file 0\n",
        "memory.memsw.limit_in_bytes": f"{6 * _G}\n",
        "memory.memsw.usage_in_bytes": f"{3 * _G // 2}\n"})  # 1 GiB of memory, 0.5 of swap
    found = memory_check._cgroup_level(directory, "memory.limit_in_bytes", "memory.usage_in_bytes", "total_",
                                   swap_free=16 * _G)
    assert found == 3 * _G + 3 * _G // 2  # memsw room 4.5 GiB: 3 of memory, 1.5 of swap


def test_a_segment_that_fits_in_a_cgroups_swap_is_not_refused(monkeypatch):
    fake = {"/proc/meminfo": f"MemAvailable: {40 * _G // 1024} kB\nSwapFree: {16 * _G // 1024} kB\n",
            "/proc/self/cgroup": "0::/test\n",
            "/sys/fs/cgroup/test/memory.max": str(4 * _G), "/sys/fs/cgroup/test/memory.current": str(_G),
            "/sys/fs/cgroup/test/memory.swap.max": "max",
            "/sys/fs/cgroup/test/memory.stat": "anon 1\n"}

    def fake_open(path, *args, **kwargs):
        if path in fake:
            return io.StringIO(fake[path])
        raise FileNotFoundError(path)

    monkeypatch.setattr(memory_check, "open", fake_open, raising=False)
    memory_check.check_memory_room(5 * _G)  # 3 GiB of memory left under the limit, 16 of swap
    with pytest.raises(OSError, match="cgroup /sys/fs/cgroup/test"):
        memory_check.check_memory_room(20 * _G)


# ------------------------------------------------ second round: shared values


def test_a_failed_forking_pickle_of_a_shared_value_leaks_no_descriptor():
    ForkingPickler.dumps(SharedValue.create(0))  # the resource sharer started once
    cell = SharedValue.create(1)

    def failed():
        raise TimeoutError("hand-over to the coordinator timed out (test)")

    before = _open_fds()
    cell.slab.handing_over(failed)
    with pytest.raises(TimeoutError):
        ForkingPickler.dumps(cell)
    assert _open_fds() == before


def test_a_shared_value_grows_only_with_room_in_the_memory(monkeypatch):
    cell = SharedValue.create(0)
    size = os.fstat(cell.fd).st_size
    monkeypatch.setattr(memory_check, "_CHECKED_SIZE", 4096)
    monkeypatch.setattr(memory_check, "memory_room", lambda: (8192, "MemAvailable (test)"))
    with pytest.raises(StorageFullError, match="Not enough memory"):
        cell.set(b"x" * 100_000)
    assert cell.get() == 0 and os.fstat(cell.fd).st_size == size
    cell.set(b"y" * 2000)  # a small growth is not checked
    assert cell.get() == b"y" * 2000
