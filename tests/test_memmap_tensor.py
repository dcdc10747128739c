"""MemoryMappedTensor in one process: constructors, dtypes, files, views, pickling."""

import copy
import gc
import multiprocessing.reduction
import os
import pickle
import warnings

import numpy as np
import pytest
import torch

from tests.leakcheck import this_process_in_shm

import shared_td.memmap_tensor as memmap_tensor
from shared_td.memmap_tensor import MemoryMappedTensor
from shared_td.memmap_tensor.tensor import maps_file_at
from shared_td.storage.anonymous import Segment
from shared_td.storage.files import FileTooShortError

pytestmark = pytest.mark.timeout(60)


def _usable(dtype):
    try:
        with warnings.catch_warnings():  # complex32 and quantized dtypes warn
            warnings.simplefilter("ignore")
            torch.empty(2, dtype=dtype).copy_(torch.empty(2, dtype=dtype))
        return True
    except (RuntimeError, TypeError):
        return False


# Every dtype a plain CPU tensor can hold and copy (quantized and sub-byte dtypes cannot)
DTYPES = sorted(
    {v for v in vars(torch).values() if isinstance(v, torch.dtype) and _usable(v)},
    key=str,
)


def test_dtype_list_is_complete():
    expected = {
        torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
        torch.uint16, torch.uint32, torch.uint64, torch.float16, torch.bfloat16,
        torch.float32, torch.float64, torch.complex32, torch.complex64, torch.complex128,
        torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz,
    }
    assert expected <= set(DTYPES)


def raw_bytes(tensor):
    return bytes(tensor.as_subclass(torch.Tensor).contiguous().reshape(-1)
                 .view(torch.uint8).numpy())


def random_tensor(dtype, shape=(3, 5)):
    numel = torch.Size(shape).numel()
    data = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8)
    if dtype == torch.bool:
        data = data % 2
    return data.view(dtype).reshape(shape)


def fd_count():
    gc.collect()  # garbage of earlier tests must not close descriptors between two counts
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture
def anonymous_and_file(tmp_path):
    """A function making an anonymous and a file-backed MMT from the same tensor."""
    def make(tensor, name="t.memmap"):
        return [MemoryMappedTensor.from_tensor(tensor),
                MemoryMappedTensor.from_tensor(tensor, filename=tmp_path / name)]
    return make


# ----------------------------------------------------------------------- dtypes

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("where", ["anonymous", "file"])
def test_every_dtype_round_trips(tmp_path, dtype, where):
    source = random_tensor(dtype)
    filename = tmp_path / "x.memmap" if where == "file" else None
    tensor = MemoryMappedTensor.from_tensor(source, filename=filename)
    assert tensor.dtype == dtype and tensor.shape == source.shape
    assert raw_bytes(tensor) == raw_bytes(source)
    received = pickle.loads(pickle.dumps(tensor[1:][1]))
    assert raw_bytes(received) == raw_bytes(source[2])
    if filename is not None:
        assert filename.read_bytes() == raw_bytes(source)
        mapped = MemoryMappedTensor.from_filename(filename, dtype, source.shape)
        assert raw_bytes(mapped) == raw_bytes(source)
    empty = MemoryMappedTensor.empty(2, 2, dtype=dtype)
    assert empty.dtype == dtype and raw_bytes(empty) == bytes(2 * 2 * dtype.itemsize)


# ----------------------------------------------------------------- constructors

def test_shape_forms_and_fill_values(tmp_path):
    assert MemoryMappedTensor.zeros(2, 3).shape == (2, 3)
    assert MemoryMappedTensor.zeros((2, 3)).shape == (2, 3)
    assert MemoryMappedTensor.zeros(torch.Size([2, 3])).shape == (2, 3)
    assert MemoryMappedTensor.zeros(shape=[2, 3]).shape == (2, 3)
    assert MemoryMappedTensor.zeros(()).shape == ()
    assert MemoryMappedTensor.zeros(np.int64(2), torch.tensor(3)).shape == (2, 3)
    assert MemoryMappedTensor.zeros(np.int64(2)).shape == (2,)
    assert MemoryMappedTensor.zeros(torch.tensor([2, 3])).shape == (2, 3)
    assert MemoryMappedTensor.zeros(2).dtype == torch.get_default_dtype()
    assert MemoryMappedTensor.ones(2, dtype=torch.int32).tolist() == [1, 1]
    assert MemoryMappedTensor.full((2,), fill_value=2.5).tolist() == [2.5, 2.5]
    full = MemoryMappedTensor.full(2, fill_value=7, dtype=torch.int64, filename=tmp_path / "f")
    assert full.tolist() == [7, 7] and full.filename == str(tmp_path / "f")
    like = torch.ones(2, 2, dtype=torch.float64)
    for result, value in [
        (MemoryMappedTensor.zeros_like(like), 0.0),
        (MemoryMappedTensor.ones_like(like), 1.0),
        (MemoryMappedTensor.full_like(like, 4.0), 4.0),
        (MemoryMappedTensor.empty_like(like), 0.0),  # a new segment is zero-filled
    ]:
        assert isinstance(result, MemoryMappedTensor) and result.dtype == torch.float64
        assert result.shape == (2, 2) and result.eq(value).all()
    with pytest.raises(TypeError, match="shape"):
        MemoryMappedTensor.zeros()
    with pytest.raises(TypeError):
        MemoryMappedTensor.zeros(2, shape=(2,))
    with pytest.raises(RuntimeError, match="Only CPU tensors are supported."):
        MemoryMappedTensor.ones(2, device="meta")


def test_fill_constructors_on_reused_file_overwrite_old_bytes(tmp_path):
    path = tmp_path / "x.memmap"
    MemoryMappedTensor.full(3, fill_value=5.0, filename=path)
    assert MemoryMappedTensor.zeros(3, filename=path, existsok=True).tolist() == [0.0] * 3
    MemoryMappedTensor.full(3, fill_value=5.0, filename=path, existsok=True)
    # empty keeps what the file holds (tensordict does the same)
    assert MemoryMappedTensor.empty(3, filename=path, existsok=True).tolist() == [5.0] * 3


def test_constructor_dispatch(tmp_path):
    path = tmp_path / "x.memmap"
    source = torch.arange(4.0)
    copied = MemoryMappedTensor(source)
    assert isinstance(copied, MemoryMappedTensor) and copied.tolist() == source.tolist()
    copied.fill_(0)
    assert source.tolist() == [0.0, 1.0, 2.0, 3.0]  # a copy, in anonymous memory
    on_file = MemoryMappedTensor(source, filename=path, index=slice(1, 3))
    assert on_file.tolist() == [1.0, 2.0] and on_file.filename == str(path)
    mapped = MemoryMappedTensor(str(path), dtype=torch.float32, shape=(4,))
    assert mapped.tolist() == source.tolist()
    assert MemoryMappedTensor([1, 2]).tolist() == [1, 2]
    assert MemoryMappedTensor(copied) is copied
    with pytest.raises(ValueError, match="cpu"):
        MemoryMappedTensor(source, device="meta")
    with pytest.raises(TypeError, match="dtype"):
        MemoryMappedTensor(source, filename=tmp_path / "y", dtype=torch.int64)
    with pytest.raises(TypeError, match="Duplicated"):
        MemoryMappedTensor(str(path), filename=path, dtype=torch.float32, shape=(4,))
    with pytest.raises(TypeError, match="required"):
        MemoryMappedTensor(str(path))


# ------------------------------------------------------------------ from_tensor

def test_from_tensor_identity_and_copies(tmp_path, monkeypatch):
    anonymous = MemoryMappedTensor.from_tensor(torch.arange(3))
    assert MemoryMappedTensor.from_tensor(anonymous) is anonymous
    path = tmp_path / "a.memmap"
    on_file = MemoryMappedTensor.from_tensor(anonymous, filename=path)
    assert MemoryMappedTensor.from_tensor(on_file, filename=str(path)) is on_file
    # a relative spelling of the same file is the same file
    monkeypatch.chdir(tmp_path)
    assert MemoryMappedTensor.from_tensor(on_file, filename="a.memmap") is on_file
    with pytest.raises(RuntimeError, match="copy_existing"):
        MemoryMappedTensor.from_tensor(on_file, filename=tmp_path / "b.memmap")
    assert not (tmp_path / "b.memmap").exists()
    other = MemoryMappedTensor.from_tensor(on_file, filename=tmp_path / "b.memmap",
                                           copy_existing=True)
    other.fill_(9)
    assert on_file.tolist() == [0, 1, 2]
    to_memory = MemoryMappedTensor.from_tensor(on_file)  # file -> anonymous copy
    to_memory.fill_(5)
    assert on_file.tolist() == [0, 1, 2]
    with pytest.raises(RuntimeError, match="no file associated"):
        to_memory.filename


def test_from_tensor_rejections():
    with pytest.raises(TypeError, match="torch.Tensor"):
        MemoryMappedTensor.from_tensor(np.zeros(3))
    with pytest.raises(RuntimeError, match="requires_grad"):
        MemoryMappedTensor.from_tensor(torch.zeros(3, requires_grad=True))
    with pytest.raises(NotImplementedError):
        MemoryMappedTensor.from_tensor(torch.zeros(3).to_sparse())


@pytest.mark.parametrize("where", ["anonymous", "file"])
def test_from_tensor_copy_data_shape_and_layouts(tmp_path, where, monkeypatch):
    def name(tag):
        return None if where == "anonymous" else tmp_path / f"{tag}.memmap"

    source = torch.arange(6.0).reshape(2, 3)
    blank = MemoryMappedTensor.from_tensor(source, filename=name("a"), copy_data=False)
    assert blank.shape == (2, 3) and blank.eq(0).all()
    broadcast = MemoryMappedTensor.from_tensor(torch.arange(3.0), shape=(2, 3),
                                               filename=name("b"))
    assert broadcast.tolist() == [[0.0, 1.0, 2.0]] * 2
    transposed = MemoryMappedTensor.from_tensor(source.T, filename=name("c"))
    assert transposed.tolist() == source.T.tolist() and transposed.is_contiguous()
    conjugated = MemoryMappedTensor.from_tensor(torch.tensor([1 + 2j]).conj(), filename=name("d"))
    assert conjugated.tolist() == [1 - 2j]
    # big non-contiguous inputs are copied through the mapping, not made contiguous
    monkeypatch.setattr(memmap_tensor.tensor, "_CONTIGUOUS_COPY_LIMIT", 0)
    expanded = MemoryMappedTensor.from_tensor(torch.tensor(4.0).expand(3, 2), filename=name("e"))
    assert expanded.eq(4.0).all() and expanded.stride() == (2, 1)


@pytest.mark.parametrize("where", ["anonymous", "file"])
def test_zero_elements_need_no_storage(tmp_path, where):
    path = tmp_path / "empty.memmap"
    before = fd_count()
    filename = path if where == "file" else None
    for tensor in [MemoryMappedTensor.from_tensor(torch.zeros(0, 3), filename=filename),
                   MemoryMappedTensor.zeros(2, 0, dtype=torch.complex64, filename=filename,
                                            existsok=True)]:
        assert isinstance(tensor, MemoryMappedTensor) and tensor.numel() == 0
        received = pickle.loads(pickle.dumps(tensor))
        assert received.shape == tensor.shape and received.dtype == tensor.dtype
        if where == "file":
            assert tensor.filename == received.filename == str(path)
        else:
            with pytest.raises(RuntimeError, match="no file associated"):
                received.filename
    assert not path.exists()  # tensordict does not create files for empty leaves either
    assert fd_count() == before
    mapped = MemoryMappedTensor.from_filename(path, torch.float32, (0,))
    assert mapped.shape == (0,) and mapped.filename == str(path)


# ------------------------------------------------------------ files and errors

def test_filename_is_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tensor = MemoryMappedTensor.zeros(2, filename="rel.memmap")
    assert tensor.filename == str(tmp_path / "rel.memmap")
    assert tensor[0].filename == tensor.filename
    assert maps_file_at(tensor._backing, "rel.memmap")
    assert not maps_file_at(tensor._backing, tmp_path / "other.memmap")
    assert not maps_file_at(MemoryMappedTensor.zeros(2)._backing, "rel.memmap")


def test_existsok_and_files_only_grow(tmp_path):
    path = tmp_path / "x.memmap"
    path.write_bytes(b"\xff" * 40)
    with pytest.raises(RuntimeError, match=f"The file {path} already exists."):
        MemoryMappedTensor.from_tensor(torch.zeros(2), filename=path)
    assert path.read_bytes() == b"\xff" * 40
    tensor = MemoryMappedTensor.from_tensor(torch.zeros(2), filename=path, existsok=True)
    tensor[1] = 1.0
    assert path.stat().st_size == 40  # a longer file is never truncated
    assert path.read_bytes()[:8] == raw_bytes(torch.tensor([0.0, 1.0]))
    assert path.read_bytes()[8:] == b"\xff" * 32
    grown = MemoryMappedTensor.from_tensor(torch.ones(20), filename=path, existsok=True)
    assert path.stat().st_size == 80 and grown.eq(1).all()


def test_symlinks_are_refused_and_target_untouched(tmp_path):
    target = tmp_path / "target.bin"
    target.write_bytes(b"keep")
    link = tmp_path / "link.memmap"
    link.symlink_to(target)
    for existsok in (False, True):
        with pytest.raises(RuntimeError, match="Refusing to write memory-mapped tensor "
                                               f"through symlink {link}"):
            MemoryMappedTensor.from_tensor(torch.zeros(4), filename=link, existsok=existsok)
        with pytest.raises(RuntimeError, match="symlink"):
            MemoryMappedTensor.zeros(0, filename=link, existsok=existsok)
    assert target.read_bytes() == b"keep"
    dangling = tmp_path / "dangling.memmap"
    dangling.symlink_to(tmp_path / "nowhere")
    with pytest.raises(RuntimeError, match="symlink"):
        MemoryMappedTensor.zeros(4, filename=dangling, existsok=True)
    assert not (tmp_path / "nowhere").exists()


def test_missing_directory_is_a_runtime_error(tmp_path):
    with pytest.raises(RuntimeError, match="No such file or directory"):
        MemoryMappedTensor.zeros(2, filename=tmp_path / "missing" / "x.memmap")


def test_from_filename_errors_and_longer_files(tmp_path):
    missing = tmp_path / "missing.memmap"
    with pytest.raises(FileNotFoundError, match="missing.memmap"):
        MemoryMappedTensor.from_filename(missing, torch.float32, (4,))
    assert not missing.exists()
    short = tmp_path / "short.memmap"
    short.write_bytes(bytes(12))
    with pytest.raises(FileTooShortError, match=r"short.memmap holds 12 bytes.* needs 16"):
        MemoryMappedTensor.from_filename(short, torch.float32, (4,))
    assert isinstance(FileTooShortError("x"), ValueError)
    long = tmp_path / "long.memmap"
    long.write_bytes(raw_bytes(torch.arange(10, dtype=torch.int32)))
    tensor = MemoryMappedTensor.from_filename(long, torch.int32, (2, 2), index=1)
    assert tensor.tolist() == [2, 3]
    tensor.fill_(-1)
    assert long.stat().st_size == 40
    assert MemoryMappedTensor.from_filename(long, torch.int32, (10,)).tolist() == \
        [0, 1, -1, -1, 4, 5, 6, 7, 8, 9]
    with pytest.raises(ValueError, match="mode"):
        MemoryMappedTensor.from_filename(long, torch.int32, (2,), mode="w")


def test_read_only_files_map_copy_on_write(tmp_path, monkeypatch):
    path = tmp_path / "ro.memmap"
    MemoryMappedTensor.full(3, fill_value=1.0, filename=path)
    private = MemoryMappedTensor.from_filename(path, torch.float32, (3,), mode="r")
    private.fill_(5.0)
    assert path.read_bytes() == raw_bytes(torch.ones(3))
    # a copy-on-write tensor is not its file: from_tensor does not return it as is
    with pytest.raises(RuntimeError, match="already exists"):
        MemoryMappedTensor.from_tensor(private, filename=path)
    # tests may run as root, for whom every file is writable: simulate a read-only one
    monkeypatch.setattr(os, "access", lambda *args, **kwargs: False)
    with pytest.raises(PermissionError, match="not writable"):
        MemoryMappedTensor.from_filename(path, torch.float32, (3,), mode="r+")
    default = MemoryMappedTensor.from_filename(path, torch.float32, (3,))
    default.fill_(7.0)
    assert path.read_bytes() == raw_bytes(torch.ones(3))


def test_file_descriptors_are_closed_after_mapping(tmp_path):
    MemoryMappedTensor.zeros(1, filename=tmp_path / "warmup")
    before = fd_count()
    tensors = [MemoryMappedTensor.from_tensor(torch.full((100,), float(i)),
                                              filename=tmp_path / f"{i}.memmap")
               for i in range(50)]
    tensors += [MemoryMappedTensor.from_filename(tmp_path / f"{i}.memmap", torch.float32,
                                                 (100,)) for i in range(50)]
    assert fd_count() == before
    assert tensors[60].eq(10.0).all()


# ------------------------------------------------------- anonymous memory

def test_many_leaves_in_one_segment_cost_one_fd():
    shm_before = this_process_in_shm()
    before = fd_count()
    segment = Segment.create(50 * 64)
    leaves = [MemoryMappedTensor._from_backing(segment, 64 * i, torch.float64, (2, 4))
              for i in range(50)]
    for i, leaf in enumerate(leaves):
        leaf.fill_(i)
    received = pickle.loads(pickle.dumps(leaves))
    assert fd_count() <= before + 1
    assert all(r._backing is segment for r in received)
    assert [int(r[0, 0]) for r in received] == list(range(50))
    assert this_process_in_shm() == shm_before
    with pytest.raises(ValueError, match="multiple"):
        MemoryMappedTensor._from_backing(segment, 3, torch.float32, (1,))
    with pytest.raises(ValueError, match="needs 3208 bytes"):
        MemoryMappedTensor._from_backing(segment, 3200, torch.float64, (1,))


def test_anonymous_tensors_never_touch_dev_shm():
    shm_before = this_process_in_shm()
    tensors = [MemoryMappedTensor.zeros(1000) for _ in range(5)]
    pickle.loads(pickle.dumps(tensors))
    assert this_process_in_shm() == shm_before


# ------------------------------------------------------------ views and ops

def test_views_keep_backing_copies_do_not(anonymous_and_file):
    for tensor in anonymous_and_file(torch.arange(24.0).reshape(2, 3, 4)):
        for view in [tensor[0], tensor[:, 1], tensor[..., 2], tensor[None], tensor[0, 1, 2],
                     tensor[1][1:][0], *tensor.unbind(1), *tensor.split(1),
                     *tensor.chunk(2, dim=2), *torch.split(tensor, 2, dim=2), *tensor]:
            assert isinstance(view, MemoryMappedTensor)
            assert view._backing is tensor._backing
        for copied in [tensor[[0, 1]], tensor[tensor > 3], tensor + 1, tensor.clone()]:
            assert type(copied) is torch.Tensor
        assert tensor.fill_(1.0) is tensor and tensor.zero_() is tensor
        assert tensor.copy_(torch.ones(2, 3, 4)) is tensor
        tensor[1, 2] = 7.0
        assert tensor.sum() == 2 * 3 * 4 - 4 + 28
        assert repr(tensor[0, 0]) == "MemoryMappedTensor([1., 1., 1., 1.])"


def test_setitem_reaches_the_file(tmp_path):
    path = tmp_path / "x.memmap"
    tensor = MemoryMappedTensor.zeros(4, dtype=torch.int32, filename=path)
    tensor[1:3] = torch.tensor([5, 6], dtype=torch.int32)
    assert path.read_bytes() == raw_bytes(torch.tensor([0, 5, 6, 0], dtype=torch.int32))


# ----------------------------------------------------------------- pickling

@pytest.mark.parametrize("dumps", [pickle.dumps,
                                   multiprocessing.reduction.ForkingPickler.dumps])
def test_view_of_view_pickles_to_the_right_elements(anonymous_and_file, dumps):
    for tensor in anonymous_and_file(torch.arange(10.0)):
        view = tensor[2:5][1]
        received = pickle.loads(dumps(view))
        assert isinstance(received, MemoryMappedTensor)
        assert received.item() == 3.0
        received.fill_(-1.0)
        assert tensor[3].item() == -1.0 and tensor.sum() == 45 - 3 - 1
        strided = pickle.loads(dumps(tensor[::2]))
        assert strided.tolist() == tensor[::2].tolist()
        assert len(dumps(tensor)) < 500  # a reference, never the data


def test_unpickling_checks_the_file(tmp_path):
    path = tmp_path / "x.memmap"
    blob = pickle.dumps(MemoryMappedTensor.zeros(4, filename=path)[1:])
    os.truncate(path, 8)
    with pytest.raises(FileTooShortError, match="x.memmap holds 8 bytes"):
        pickle.loads(blob)
    os.unlink(path)
    with pytest.raises(FileNotFoundError, match="x.memmap"):
        pickle.loads(blob)
    assert not path.exists()


def test_unpickling_in_process_shares_one_mapping(anonymous_and_file):
    for tensor in anonymous_and_file(torch.arange(4.0)):
        received = pickle.loads(pickle.dumps(tensor))
        assert received.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr()
        assert copy.copy(tensor)._backing is tensor._backing


def test_deepcopy_is_an_independent_anonymous_copy(anonymous_and_file):
    for tensor in anonymous_and_file(torch.arange(4.0)):
        duplicate = copy.deepcopy(tensor)
        assert isinstance(duplicate, MemoryMappedTensor)
        duplicate.fill_(0)
        assert tensor.tolist() == [0.0, 1.0, 2.0, 3.0]
        with pytest.raises(RuntimeError, match="no file"):
            duplicate.filename


def test_tensors_without_backing_refuse_to_pickle():
    bare = torch.ones(2).as_subclass(MemoryMappedTensor)
    with pytest.raises(RuntimeError, match="Could not find handler or filename"):
        pickle.dumps(bare)
    swapped = MemoryMappedTensor.zeros(2)
    swapped.set_(torch.ones(2).untyped_storage())
    with pytest.raises(RuntimeError, match="no longer views"):
        pickle.dumps(swapped)


# -------------------------------------------------------------- from_storage

def test_from_storage(tmp_path):
    path = tmp_path / "x.memmap"
    made = MemoryMappedTensor.from_tensor(torch.arange(6.0), filename=path)
    storage = torch.UntypedStorage.from_file(str(path), shared=True, nbytes=24)
    tensor = MemoryMappedTensor.from_storage(storage, dtype=torch.float32, shape=(2, 3))
    assert tensor.filename == str(path) and tensor[1].tolist() == [3.0, 4.0, 5.0]
    received = pickle.loads(pickle.dumps(tensor[1]))
    received.fill_(0.0)
    assert tensor[1].tolist() == [0.0, 0.0, 0.0]
    with pytest.raises(RuntimeError, match="differs"):
        MemoryMappedTensor.from_storage(storage, filename=tmp_path / "other")
    assert MemoryMappedTensor.from_storage(storage).dtype == torch.int64  # as tensordict
    typed = torch.arange(3, dtype=torch.int16).untyped_storage()
    plain = MemoryMappedTensor.from_storage(typed, dtype=torch.int16, index=slice(1, None))
    assert plain.tolist() == [1, 2]
    with pytest.raises(RuntimeError, match="Could not find handler or filename"):
        pickle.dumps(plain)
    with pytest.raises(ValueError, match="not mapped from a file"):
        MemoryMappedTensor.from_storage(typed, filename=tmp_path / "y")
    segment = Segment.create(16)
    on_segment = MemoryMappedTensor.from_storage(segment.storage, dtype=torch.int32,
                                                 handler=segment)
    assert pickle.loads(pickle.dumps(on_segment))._backing is segment
    # storages of existing MMTs are recognised without a handler
    again = MemoryMappedTensor.from_storage(made.untyped_storage(), dtype=torch.float32)
    assert again._backing is made._backing and again.filename == str(path)
    assert MemoryMappedTensor.from_storage(on_segment.untyped_storage())._backing is segment
    with pytest.raises(ValueError, match="cpu"):
        MemoryMappedTensor.from_storage(typed, device="meta")


# ------------------------------------------------ from_handler and parent_shape (issue item 9)
from tests.reference import needs_tensordict as _needs_tensordict  # noqa: E402
from tests.reference import tensordict as _tensordict  # noqa: E402


def test_handler_of_an_anonymous_tensor_is_its_segment():
    t = MemoryMappedTensor.zeros(4, 3)
    assert isinstance(t._handler, Segment) and t._handler is t[1:]._handler
    assert t._handler.nbytes >= t.nbytes


@pytest.mark.parametrize("index, shape", [(None, (4, 3)), (1, (3,)), (slice(0, 2), (2, 3)),
                                          ((slice(None), 2), (4,))])
def test_from_handler_shares_the_segment(index, shape):
    t = MemoryMappedTensor.zeros(4, 3)
    u = MemoryMappedTensor.from_handler(t._handler, torch.float32, torch.Size([4, 3]), index=index)
    assert type(u) is MemoryMappedTensor and u.shape == shape and u._handler is t._handler
    u.fill_(7.0)
    expected = torch.zeros(4, 3)
    expected[index if index is not None else slice(None)] = 7.0
    assert torch.equal(t.as_subclass(torch.Tensor), expected)
    assert u.parent_shape == (4, 3)
    v = pickle.loads(pickle.dumps(u))  # pickles by reference, as any anonymous MMT
    assert v._handler is t._handler and torch.equal(v, u) and v.parent_shape == (4, 3)


def test_from_handler_reinterprets_and_checks_size():
    t = MemoryMappedTensor.from_tensor(torch.arange(6, dtype=torch.int32))
    as_float = MemoryMappedTensor.from_handler(t._handler, torch.float32, [2, 3])
    assert as_float.as_subclass(torch.Tensor).view(torch.int32).flatten().tolist() == list(range(6))
    leading = MemoryMappedTensor.from_handler(t._handler, torch.int32, (2,))  # a prefix
    assert leading.tolist() == [0, 1]
    with pytest.raises(FileTooShortError, match="needs"):
        MemoryMappedTensor.from_handler(t._handler, torch.int64, (6,))


@pytest.mark.parametrize("bad, error", [(None, TypeError), ("/tmp/x", TypeError),
                                        (torch.zeros(2).untyped_storage(), TypeError)])
def test_from_handler_refuses_what_is_not_a_handler(bad, error):
    with pytest.raises(error, match="from_handler"):
        MemoryMappedTensor.from_handler(bad, torch.float32, (2,))


def test_from_handler_refuses_a_nested_shape():
    t = MemoryMappedTensor.zeros(6)
    with pytest.raises(NotImplementedError, match="nested"):
        MemoryMappedTensor.from_handler(t._handler, torch.float32, torch.tensor([[2], [4]]))


def test_from_handler_of_a_file_backing(tmp_path):
    t = MemoryMappedTensor.from_tensor(torch.arange(4.0), filename=tmp_path / "x.memmap")
    u = MemoryMappedTensor.from_handler(t._handler, torch.float32, (4,), index=slice(2, None))
    assert u.filename == t.filename and u.tolist() == [2.0, 3.0]


def test_parent_shape_is_the_shape_built():
    t = MemoryMappedTensor.empty(4, 3)
    assert t.parent_shape == (4, 3) and t[1:].parent_shape == (4, 3)
    assert t[0].parent_shape == (4, 3) and t.unbind(1)[0].parent_shape == (4, 3)
    assert MemoryMappedTensor.from_tensor(torch.ones(2)).parent_shape == (2,)
    assert MemoryMappedTensor.empty(0, 3).parent_shape == (0, 3)


def test_parent_shape_of_a_file_tensor(tmp_path):
    path = tmp_path / "x.memmap"
    MemoryMappedTensor.from_tensor(torch.arange(12.0), filename=path)
    t = MemoryMappedTensor.from_filename(path, torch.float32, (3, 4), index=1)
    assert t.shape == (4,) and t.parent_shape == (3, 4)
    assert pickle.loads(pickle.dumps(t[1:])).parent_shape == (3, 4)


@_needs_tensordict
@pytest.mark.parametrize("index", [None, 1, slice(0, 2)])
def test_from_handler_and_parent_shape_equal_tensordict(index):
    theirs_cls = _tensordict.MemoryMappedTensor
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # deprecated in 0.15
        theirs = theirs_cls.empty((4, 3))
        theirs.copy_(torch.arange(12.0).view(4, 3))
        theirs_view = theirs_cls.from_handler(theirs._handler, torch.float32, (4, 3), index=index)
        expected = (theirs_view.shape, theirs_view.parent_shape, theirs_view.tolist(),
                    theirs[1:].parent_shape)
    ours = MemoryMappedTensor.empty((4, 3))
    ours.copy_(torch.arange(12.0).view(4, 3))
    view = MemoryMappedTensor.from_handler(ours._handler, torch.float32, (4, 3), index=index)
    assert (view.shape, view.parent_shape, view.tolist(), ours[1:].parent_shape) == expected


def test_parent_shape_of_read_only_views(tmp_path):
    from shared_td.storage import files
    path = tmp_path / "x.memmap"
    MemoryMappedTensor.from_tensor(torch.arange(12.0), filename=path)
    backing = files.open_file_backing(str(path), shared=False, read_only="it is a test")
    t = MemoryMappedTensor._from_backing(backing, 0, torch.float32, (3, 4))
    assert type(t[1]).__name__ == "ReadOnlyMemoryMappedTensor" and t[1].parent_shape == (3, 4)
