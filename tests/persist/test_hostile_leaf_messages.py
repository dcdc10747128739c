"""Errors over hostile leaves name the key and the saved file (limits19): a directory
where memmap_like writes a leaf in place, a read-only leaf file that append_memmap grows
(it named the staged copy's temporary path, gone once the call returned)."""
import os

import pytest
import torch

from shared_td import TensorDict
from tests.processes import run_as_nobody


def test_memmap_like_in_place_over_a_directory_names_key_and_path(tmp_path):
    p = tmp_path / "save"
    TensorDict(a=torch.ones(4, 3), batch_size=[4]).memmap_(p)
    os.remove(p / "a.memmap")
    os.mkdir(p / "a.memmap")
    with pytest.raises(IsADirectoryError, match=r"key 'a' to .*save/a\.memmap: it is a directory"):
        TensorDict(a=torch.ones(4, 3), batch_size=[4]).memmap_like(p, existsok=True)


def test_append_to_a_read_only_leaf_names_the_saved_file_not_a_temporary():
    run_as_nobody("""
        import torch, shared_td
        from shared_td import TensorDict

        def warm(base):
            w = os.path.join(base, "warm")
            TensorDict(a=torch.ones(2), batch_size=[2]).memmap_(w)
            shared_td.append_memmap(w, shared_td.load_memmap(w)[:1])

        def check(base):
            p = os.path.join(base, "save")
            td = TensorDict(a=torch.ones(4, 3), batch_size=[4]); td.memmap_(p)
            os.chmod(os.path.join(p, "a.memmap"), 0o444)
            try:
                shared_td.append_memmap(p, td[:2]); msg = "no error"
            except PermissionError as e:
                msg = str(e)
            print(msg, flush=True)
            ok = (os.path.join(p, "a.memmap") in msg) and "shared_td-new" not in msg
            return ok and shared_td.load_memmap(p).shape == (4,)  # nothing changed
    """)
