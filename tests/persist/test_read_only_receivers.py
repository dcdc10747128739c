"""ro52, as the user nobody (root writes read-only files): a read-only directory under an
in-place rewrite is an error naming the file, the cause and the fix (a bare "Permission
denied" naming a temporary before); a file-backed leaf unpickled after its file was made
read-only maps read-only, as a load does, and a write to it says why (its unpickle failed
with a MappingError before)."""
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import textwrap

import pytest

CODE = """
import os, pickle, subprocess, sys, numpy as np, torch, shared_td
from shared_td import TensorDict
p = {base!r} + "/save"
w = p + "-warm"  # lazy imports first (as root the interpreter may be unreadable to nobody)
TensorDict(a=torch.ones(2), batch_size=[2]).memmap_(w)
TensorDict(a=torch.ones(2), batch_size=[2]).memmap_(w, existsok=True)
try:
    pickle.loads(pickle.dumps(TensorDict(a=torch.ones(2), batch_size=[2]).memmap_(w + "2")))
except Exception:
    pass
def check():
    ok = True
    # 1: a nested directory the rewrite cannot create its meta.json temporary in
    TensorDict(a=torch.ones(4), n=TensorDict(b=torch.ones(4), batch_size=[4]), batch_size=[4]).memmap_(p)
    os.chmod(os.path.join(p, "n"), 0o555)
    try:
        TensorDict(a=torch.full((4,), 2.0), n=TensorDict(b=torch.full((4,), 2.0), batch_size=[4]),
                   batch_size=[4]).memmap_(p, existsok=True)
        msg = "no error"
    except PermissionError as e:
        msg = str(e)
    first = np.fromfile(os.path.join(p, "a.memmap"), dtype=np.float32).tolist()
    print(msg, first, flush=True)
    ok &= "n/meta.json" in msg and "writable" in msg and "atomic=True" in msg and first == [1.0] * 4
    os.chmod(os.path.join(p, "n"), 0o755)
    # 2: a leaf pickled while writable, unpickled once its file is read-only
    t = shared_td.load_memmap(p)["a"]
    os.chmod(os.path.join(p, "a.memmap"), 0o444)
    blob = pickle.dumps(t)
    del t
    import gc; gc.collect()  # (this process's cached mapping would be reused)
    received = pickle.loads(blob)
    readable = received.tolist() == [1.0] * 4
    try:
        received.add_(1); msg2 = "no error"
    except shared_td.ReadOnlyError as e:
        msg2 = str(e)
    print(readable, msg2, flush=True)
    ok &= readable and "a.memmap" in msg2 and "permission to write" in msg2
    return ok
if os.getuid() != 0:
    raise SystemExit(0 if check() else 1)
pid = os.fork()  # root writes read-only files and directories: the user nobody does not
if pid == 0:
    try:
        os.setgid(65534); os.setgroups([]); os.setuid(65534)
    except OSError:
        os._exit(77)
    os._exit(0 if check() else 1)
_, st = os.waitpid(pid, 0)
raise SystemExit(os.waitstatus_to_exitcode(st))
"""


def test_read_only_directory_and_unpickled_read_only_file_messages():
    base = pathlib.Path(tempfile.mkdtemp())  # (pytest's tmp_path may lie under a root-only 0700 directory)
    os.chmod(base, 0o777)
    try:
        done = subprocess.run([sys.executable, "-c", CODE.format(base=str(base))], timeout=120,
                              capture_output=True, text=True)
    finally:
        for root, dirs, _ in os.walk(base):
            for d in dirs:
                os.chmod(os.path.join(root, d), 0o755)
        shutil.rmtree(base)
    if done.returncode == 77:
        pytest.skip("cannot drop to the user nobody")
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
