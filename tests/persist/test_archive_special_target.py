"""An archive write never replaces a FIFO, socket or device at its path (or at a symlink's target)."""
import os
import stat

import pytest
import torch

import shared_td


@pytest.mark.parametrize("through_link", [False, True])
def test_archive_write_refuses_a_fifo_target_and_leaves_it(tmp_path, through_link):
    fifo = tmp_path / "f.tdz"
    os.mkfifo(fifo)
    path = fifo
    if through_link:
        path = tmp_path / "link.tdz"
        os.symlink(fifo, path)
    td = shared_td.TensorDict(a=torch.ones(3), batch_size=[3])
    with pytest.raises(OSError, match="FIFO"):
        td.memmap(str(path), existsok=True)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    td.memmap(str(tmp_path / "sv"))
    with pytest.raises(OSError, match="FIFO"):
        shared_td.pack_memmap(str(tmp_path / "sv"), str(path))
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


def test_existsok_false_on_a_fifo_is_tensordicts_runtime_error(tmp_path):
    fifo = tmp_path / "f.tdz"
    os.mkfifo(fifo)
    with pytest.raises(RuntimeError, match="already exists"):
        shared_td.TensorDict(a=torch.ones(3), batch_size=[3]).memmap(str(fifo), existsok=False)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
