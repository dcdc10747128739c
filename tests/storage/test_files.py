"""shared_td.storage.files: creating, writing, mapping and size-checking files."""

import errno
import gc
import os
import pickle

import pytest
import torch

from shared_td.storage import files
from shared_td.storage.files import (
    FileBacking,
    StorageFullError,
    create_file,
    map_fd,
    open_file_backing,
    pwrite_all,
    tensor_bytes,
)

pytestmark = pytest.mark.timeout(60)


def fd_count():
    gc.collect()  # garbage of earlier tests must not close descriptors between two counts
    return len(os.listdir("/proc/self/fd"))


def test_tensor_bytes_of_any_layout():
    assert bytes(tensor_bytes(torch.tensor(1, dtype=torch.int16))) == b"\x01\x00"
    matrix = torch.arange(4, dtype=torch.uint8).reshape(2, 2)
    assert bytes(tensor_bytes(matrix.T)) == bytes([0, 2, 1, 3])
    assert bytes(tensor_bytes(torch.tensor([True, False]))) == b"\x01\x00"
    conj = bytes(tensor_bytes(torch.tensor([1 + 1j], dtype=torch.complex64).conj()))
    assert conj == bytes(tensor_bytes(torch.tensor([1 - 1j], dtype=torch.complex64)))
    assert len(tensor_bytes(torch.zeros(0))) == 0


def test_pwrite_all_loops_over_short_writes(tmp_path, monkeypatch):
    real_pwrite = os.pwrite
    calls = []

    def one_byte_at_a_time(fd, data, offset):
        calls.append(offset)
        return real_pwrite(fd, bytes(data[:1]), offset)

    monkeypatch.setattr(os, "pwrite", one_byte_at_a_time)
    path = tmp_path / "x"
    with open(path, "wb") as f:
        pwrite_all(f.fileno(), b"abcdef", 2)
    assert path.read_bytes() == b"\x00\x00abcdef" and calls == [2, 3, 4, 5, 6, 7]


def test_pwrite_enospc_is_a_storage_full_error_naming_the_size(tmp_path, monkeypatch):
    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    with open(tmp_path / "x", "wb") as f:
        with pytest.raises(StorageFullError, match="Could not reserve 2048 bytes") as info:
            pwrite_all(f.fileno(), bytes(2048), 0, where="file x")
    assert info.value.errno == errno.ENOSPC and isinstance(info.value, OSError)


def test_create_file_exclusive_reserved_and_grow_only(tmp_path):
    path = str(tmp_path / "x")
    backing, created = create_file(path, 100)
    assert created and os.path.getsize(path) == 100
    # posix_fallocate reserved the blocks: a full disk cannot surprise a later write
    assert os.stat(path).st_blocks * 512 >= 100
    assert backing.nbytes == 100 and backing.storage.nbytes() == 100 and backing.shared
    with pytest.raises(RuntimeError, match=f"The file {path} already exists."):
        create_file(path, 10)
    _, created = create_file(path, 10, existsok=True, data=b"z" * 10)
    assert not created and os.path.getsize(path) == 100  # never truncated
    create_file(path, 200, existsok=True)
    assert os.path.getsize(path) == 200  # grown
    with open(path, "rb") as f:
        assert f.read(11) == b"z" * 10 + b"\x00"


def test_create_file_zero_bytes_creates_nothing(tmp_path):
    path = str(tmp_path / "empty")
    assert create_file(path, 0) == (None, False)
    assert not os.path.lexists(path)
    open(path, "wb").close()
    with pytest.raises(RuntimeError, match="already exists"):
        create_file(path, 0)
    assert create_file(path, 0, existsok=True) == (None, False)


def test_create_file_refuses_symlinks(tmp_path):
    target = tmp_path / "target"
    target.write_bytes(b"keep")
    link = tmp_path / "link"
    link.symlink_to(target)
    for nbytes in (0, 8):
        for existsok in (False, True):
            with pytest.raises(RuntimeError, match=f"through symlink {link}"):
                create_file(str(link), nbytes, existsok=existsok, data=None)
    assert target.read_bytes() == b"keep"


def test_reserve_refuses_a_symlink_at_the_name(tmp_path):
    # the existing name is re-opened with O_NOFOLLOW relative to its directory: a file
    # replaced by a link is refused, never followed
    target = tmp_path / "target"
    target.write_bytes(b"keep")
    (tmp_path / "x").symlink_to(target)
    with files.Directory.open(str(tmp_path)) as directory:
        for existsok in (False, True):
            with pytest.raises(RuntimeError, match=f"through symlink {tmp_path / 'x'}"):
                files.reserve_file(directory, "x", existsok=existsok)
    assert target.read_bytes() == b"keep"


def test_create_file_missing_directory(tmp_path):
    with pytest.raises(RuntimeError, match="No such file or directory: .*missing"):
        create_file(str(tmp_path / "missing" / "x"), 8)


def test_fallocate_enospc_is_a_storage_full_error(tmp_path, monkeypatch):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    before = fd_count()
    with pytest.raises(StorageFullError, match=r"1048576 bytes \(1.0 MiB\) for file"):
        create_file(str(tmp_path / "x"), 2**20)
    assert fd_count() == before


def test_fallocate_unsupported_falls_back_to_growing(tmp_path, monkeypatch):
    def unsupported(fd, offset, length):
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(os, "posix_fallocate", unsupported)
    backing, _ = create_file(str(tmp_path / "x"), 64)
    assert backing.nbytes == 64 and os.path.getsize(tmp_path / "x") == 64


def test_open_file_backing_caches_by_inode_and_size(tmp_path):
    path = str(tmp_path / "x")
    with open(path, "wb") as f:
        f.write(bytes(16))
    first = open_file_backing(path)
    assert open_file_backing(path) is first
    assert pickle.loads(pickle.dumps(first)) is first
    assert open_file_backing(path, shared=False) is not first  # private: never shared
    with open(path, "ab") as f:
        f.write(bytes(16))
    grown = open_file_backing(path)
    assert grown is not first and grown.nbytes == 32
    # a file replaced by rename is a new file, with a new mapping
    with open(path + ".new", "wb") as f:
        f.write(b"\x01" * 32)
    os.replace(path + ".new", path)
    replaced = open_file_backing(path)
    assert replaced is not grown and replaced.storage[0] == 1 and grown.storage[0] == 0


def test_open_file_backing_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing"):
        open_file_backing(str(tmp_path / "missing"))
    assert not (tmp_path / "missing").exists()
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    backing = open_file_backing(str(empty))
    assert backing.nbytes == 0 and backing.storage is None


def test_mapping_shares_bytes_and_closes_descriptors(tmp_path):
    path = tmp_path / "x"
    path.write_bytes(bytes(8))
    before = fd_count()
    backings = []
    for _ in range(20):
        fd = os.open(path, os.O_RDWR)
        backings.append(FileBacking(str(path), map_fd(fd, 8), 8, True))
        os.close(fd)
    assert fd_count() == before
    backings[0].storage[3] = 7
    assert backings[-1].storage[3] == 7 and path.read_bytes()[3] == 7
