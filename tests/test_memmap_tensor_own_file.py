"""``MemoryMappedTensor.from_tensor(t, filename=<t's own path>)`` after that file was
replaced or deleted: t's values go to the file at the path (never a silent return of
the stale t, whose memory is a file no longer there)."""
from __future__ import annotations

import os

import pytest
import torch

from shared_td import MemoryMappedTensor, TensorDict


def _replace(path, values: torch.Tensor) -> None:
    """Put a new file (a new inode) at ``path``, as another process's rewrite does."""
    fresh = str(path) + ".new"
    MemoryMappedTensor.from_tensor(values, filename=fresh)
    os.replace(fresh, path)


def test_own_unchanged_file_returns_the_tensor_itself(tmp_path):
    t = MemoryMappedTensor.from_tensor(torch.arange(4.0), filename=tmp_path / "x.memmap")
    assert MemoryMappedTensor.from_tensor(t, filename=tmp_path / "x.memmap") is t
    assert MemoryMappedTensor.from_tensor(t, filename=os.fsencode(tmp_path / "x.memmap")) is t


def test_a_replaced_file_is_refused_without_existsok_naming_the_fix(tmp_path):
    path = tmp_path / "x.memmap"
    t = MemoryMappedTensor.from_tensor(torch.arange(4.0), filename=path)
    _replace(path, torch.full((4,), 9.0))
    with pytest.raises(RuntimeError, match=r"no longer the file this tensor maps.*existsok=True.*from_filename"):
        MemoryMappedTensor.from_tensor(t, filename=path)
    assert MemoryMappedTensor.from_filename(path, torch.float32, (4,)).tolist() == [9.0] * 4


def test_a_replaced_file_is_written_with_existsok(tmp_path):
    path = tmp_path / "x.memmap"
    t = MemoryMappedTensor.from_tensor(torch.arange(4.0), filename=path)
    _replace(path, torch.full((4,), 9.0))
    result = MemoryMappedTensor.from_tensor(t, filename=path, existsok=True)
    assert result is not t and result.filename == str(path)
    assert MemoryMappedTensor.from_filename(path, torch.float32, (4,)).tolist() == [0.0, 1.0, 2.0, 3.0]
    result[0] = 7.0  # the result maps the file at the path now
    assert MemoryMappedTensor.from_filename(path, torch.float32, (4,))[0].item() == 7.0


def test_a_deleted_file_is_written_again(tmp_path):
    path = tmp_path / "x.memmap"
    t = MemoryMappedTensor.from_tensor(torch.arange(4.0), filename=path)
    os.unlink(path)
    result = MemoryMappedTensor.from_tensor(t, filename=path)
    assert result is not t and os.path.isfile(path)
    assert MemoryMappedTensor.from_filename(path, torch.float32, (4,)).tolist() == [0.0, 1.0, 2.0, 3.0]


def test_an_empty_tensor_of_its_own_path_is_returned(tmp_path):
    """An empty leaf maps no file (none is made): nothing can be stale."""
    t = MemoryMappedTensor.from_tensor(torch.zeros(0), filename=tmp_path / "e.memmap")
    assert MemoryMappedTensor.from_tensor(t, filename=tmp_path / "e.memmap") is t


def test_memmap_into_its_own_replaced_directory_writes_the_values(tmp_path):
    """The tree-level twin (memmap_ already wrote again); kept side by side."""
    td = TensorDict(a=torch.arange(3.0), batch_size=[3]).memmap_(tmp_path)
    _replace(tmp_path / "a.memmap", torch.full((3,), 9.0))
    td.unlock_()
    td.memmap_(tmp_path)
    assert MemoryMappedTensor.from_filename(tmp_path / "a.memmap", torch.float32, (3,)).tolist() == [0.0, 1.0, 2.0]
