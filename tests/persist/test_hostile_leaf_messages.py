"""Errors over hostile leaves name the key and the saved file (limits19): a directory
where memmap_like writes a leaf in place, a read-only leaf file that append_memmap grows
(it named the staged copy's temporary path, gone once the call returned)."""
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import textwrap

import pytest
import torch

from shared_td import TensorDict


def test_memmap_like_in_place_over_a_directory_names_key_and_path(tmp_path):
    p = tmp_path / "save"
    TensorDict(a=torch.ones(4, 3), batch_size=[4]).memmap_(p)
    os.remove(p / "a.memmap")
    os.mkdir(p / "a.memmap")
    with pytest.raises(IsADirectoryError, match=r"key 'a' to .*save/a\.memmap: it is a directory"):
        TensorDict(a=torch.ones(4, 3), batch_size=[4]).memmap_like(p, existsok=True)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root, to drop to the user nobody (root writes read-only files)")
def test_append_to_a_read_only_leaf_names_the_saved_file_not_a_temporary():
    base = pathlib.Path(tempfile.mkdtemp())  # (pytest's tmp_path lies under a root-only 0700 directory)
    os.chmod(base, 0o777)
    code = textwrap.dedent(f"""
        import os, torch, shared_td
        from shared_td import TensorDict
        p = {str(base / 'save')!r}
        w = p + "-warm"  # lazy imports done as root (the interpreter may be unreadable to nobody)
        TensorDict(a=torch.ones(2), batch_size=[2]).memmap_(w)
        shared_td.append_memmap(w, shared_td.load_memmap(w)[:1])
        pid = os.fork()
        if pid == 0:
            os.setgid(65534); os.setgroups([]); os.setuid(65534)
            td = TensorDict(a=torch.ones(4, 3), batch_size=[4]); td.memmap_(p)
            os.chmod(os.path.join(p, "a.memmap"), 0o444)
            try:
                shared_td.append_memmap(p, td[:2]); msg = "no error"
            except PermissionError as e:
                msg = str(e)
            ok = (os.path.join(p, "a.memmap") in msg) and "shared_td-new" not in msg
            ok = ok and shared_td.load_memmap(p).shape == (4,)  # nothing changed
            print(msg, flush=True)
            os._exit(0 if ok else 1)
        _, st = os.waitpid(pid, 0)
        raise SystemExit(os.waitstatus_to_exitcode(st))
    """)
    try:
        done = subprocess.run([sys.executable, "-c", code], timeout=120, capture_output=True, text=True)
    finally:
        shutil.rmtree(base)
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
