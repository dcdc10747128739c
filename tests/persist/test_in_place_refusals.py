"""A rewrite of an existing save in place (``existsok=True``, no ``atomic=True``) refuses
a leaf's place that cannot take its bytes (a directory, a FIFO, a file this process may
not write) before the first old leaf file is overwritten: found by the write itself, it
failed with the earlier leaves' files already holding the new bytes under the old
meta.json (limits19)."""
import os

import numpy as np
import pytest
import torch

import shared_td
from shared_td import TensorDict
from tests.processes import run_as_nobody


def _save(prefix) -> None:
    TensorDict(a=torch.ones(4), b=torch.ones(4), batch_size=[4]).memmap_(prefix)


def _new():
    return TensorDict(a=torch.full((4,), 2.0), b=torch.full((4,), 2.0), batch_size=[4])


def _first_leaf(prefix) -> list:
    return np.fromfile(os.path.join(prefix, "a.memmap"), dtype=np.float32).tolist()


@pytest.mark.parametrize("like", [False, True])
def test_a_directory_where_a_later_leaf_goes(tmp_path, like):
    prefix = tmp_path / "save"
    _save(prefix)
    os.remove(prefix / "b.memmap")
    os.mkdir(prefix / "b.memmap")
    write = _new().memmap_like if like else _new().memmap_
    with pytest.raises(IsADirectoryError, match=r"key 'b' to .*save/b\.memmap: it is a directory"):
        write(prefix, existsok=True)
    assert _first_leaf(prefix) == [1.0] * 4


def test_a_fifo_where_a_later_leaf_goes(tmp_path):
    prefix = tmp_path / "save"
    _save(prefix)
    os.remove(prefix / "b.memmap")
    os.mkfifo(prefix / "b.memmap")
    with pytest.raises(OSError, match=r"b\.memmap: it is a FIFO"):
        _new().memmap_(prefix, existsok=True)
    assert _first_leaf(prefix) == [1.0] * 4


def test_an_empty_leaf_over_a_directory_is_no_error(tmp_path):
    prefix = tmp_path / "save"
    TensorDict(a=torch.ones(4), b=torch.ones(4, 0), batch_size=[4]).memmap_(prefix)
    os.mkdir(prefix / "b.memmap")  # (an empty leaf has no file: nothing is written there)
    TensorDict(a=torch.full((4,), 2.0), b=torch.ones(4, 0), batch_size=[4]).memmap_(prefix, existsok=True)
    assert shared_td.load_memmap(prefix)["a"].tolist() == [2.0] * 4


def test_a_read_only_file_where_a_later_leaf_goes():
    run_as_nobody("""
        import numpy as np, torch, shared_td
        from shared_td import TensorDict

        def warm(base):
            w = os.path.join(base, "warm")
            TensorDict(a=torch.ones(2), batch_size=[2]).memmap_(w)
            TensorDict(a=torch.ones(2), batch_size=[2]).memmap_(w, existsok=True)

        def check(base):
            p = os.path.join(base, "save")
            TensorDict(a=torch.ones(4), b=torch.ones(4), batch_size=[4]).memmap_(p)
            os.chmod(os.path.join(p, "b.memmap"), 0o444)
            new = TensorDict(a=torch.full((4,), 2.0), b=torch.full((4,), 2.0), batch_size=[4])
            try:
                new.memmap_(p, existsok=True); msg = "no error"
            except PermissionError as e:
                msg = str(e)
            first = np.fromfile(os.path.join(p, "a.memmap"), dtype=np.float32).tolist()
            print(msg, first, flush=True)
            ok = "b.memmap" in msg and "atomic=True" in msg and first == [1.0] * 4
            new.memmap_(p, existsok=True, atomic=True)  # the fix the message names
            return ok and shared_td.load_memmap(p)["b"].tolist() == [2.0] * 4
    """)
