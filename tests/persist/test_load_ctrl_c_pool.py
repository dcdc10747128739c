"""review54: a Ctrl-C during a threaded load: no leaf job of the pool runs once its node's
directory descriptor is closed (before: 12 of 16 did, on a closed or reused descriptor)."""
import os
import signal
import threading
import time

import pytest
import torch

import shared_td
from shared_td.persist import loader as loader_mod


def test_ctrl_c_in_threaded_load_leaves_no_job_on_a_closed_directory(tmp_path, monkeypatch):
    td = shared_td.TensorDict(sub=shared_td.TensorDict({f"k{i}": torch.zeros(4) for i in range(16)}, []),
                              batch_size=[])
    td.memmap_(tmp_path / "td")
    stale = []
    original = loader_mod.Loader._load_leaf

    def slow_leaf(self, directory, leaf):
        time.sleep(0.2)
        try:
            same = os.fstat(directory.fd).st_ino == os.stat(directory.path).st_ino
        except OSError:
            same = False
        if not same:
            stale.append(leaf.key)
        return original(self, directory, leaf)

    monkeypatch.setattr(loader_mod.Loader, "_load_leaf", slow_leaf)
    timer = threading.Timer(0.3, signal.pthread_kill, (threading.get_ident(), signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            shared_td.load_memmap(tmp_path / "td", num_threads=4)
    finally:
        timer.cancel()
    assert stale == []
