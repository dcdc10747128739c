"""A load_memmap running while another process set_s a memory-mapped non-tensor
value (a JSON value, then a pickled one, and back) returns a whole value, never
FileNotFoundError '.../other.pickle'.

The rewrite (persist/node_rewrite.py -> node_commit.put_node_in_place) renames the new
meta.json in, then unlinks the side file the new value no longer needs: a load that read
the old meta.json (naming other.pickle) and opens other.pickle after that unlink found it
gone (crash52). The loader now reads such a node again from its new meta.json."""
from __future__ import annotations

import gc
import os
import signal
import time

import pytest
import torch

import shared_td
from shared_td import NonTensorData, TensorDict

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("share", [True, False])
def test_a_load_racing_a_non_tensor_rewrite_gets_a_whole_value(tmp_path, share):
    prefix = str(tmp_path / "save")
    td = TensorDict(a=torch.zeros(3), s=NonTensorData("init"), batch_size=[3])
    td = td.memmap_(prefix, share_non_tensor=True) if share else td.memmap_(prefix)
    pid = os.fork()
    if pid == 0:  # the writer: str (in meta.json) and bytes (in other.pickle) in turn, until killed
        gc.disable()  # (no collection of the test runner's objects in a fork child)
        try:
            i = 0
            while True:
                td.set_("s", f"v{i}" if i % 2 else f"v{i}".encode())
                i += 1
        finally:
            os._exit(1)
    errors, loads = [], 0
    try:
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            try:
                value = shared_td.load_memmap(prefix, allow_pickle=True)["s"]
            except FileNotFoundError as error:
                errors.append(str(error))
                continue
            assert value == "init" or value[:1] in ("v", b"v"), value
            loads += 1
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    assert loads > 100
    assert errors == [], f"{len(errors)} of {loads + len(errors)} loads failed: {errors[:2]}"


def test_a_missing_side_file_is_still_an_error(tmp_path):
    prefix = str(tmp_path / "save")
    TensorDict(s=NonTensorData(b"bytes: pickled"), batch_size=[]).memmap_(prefix)
    os.unlink(os.path.join(prefix, "s", "other.pickle"))
    t0 = time.monotonic()
    with pytest.raises(FileNotFoundError, match="other.pickle"):
        shared_td.load_memmap(prefix, allow_pickle=True)
    assert time.monotonic() - t0 < 5
