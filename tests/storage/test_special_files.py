"""Mapping a file by path (unpickling a file-backed tensor, MemoryMappedTensor.from_filename)
maps a regular file only, and writing over something else names it.

Someone who can write a save directory may put a symlink, a FIFO or a directory where a
leaf file was, between the pickling of a tensor and its unpickling in a receiver. The
loader refuses them (tests/persist/test_load_untrusted.py); so does the receiver: a
symlink is never followed (its writes would go into the file it names), and nothing is
opened before it is known to be a regular file (a FIFO would block the receiver for
ever). A user's own path may run through links: from_filename follows them once and
records the resolved path, and a save under a symlinked prefix still pickles.
"""
from __future__ import annotations

import errno
import json
import os
import pickle
import re
import subprocess
import sys

import pytest
import torch

from shared_td import FileReplacedError, MemoryMappedTensor, TensorDict, load_memmap

pytestmark = pytest.mark.timeout(120)

BOUND = 60  # seconds: the spawned receiver (a fresh interpreter, importing torch) must be done by then


def _save(path, mode=None):
    """A saved directory with one 8-byte leaf ``obs``, and that leaf as the receiver of a
    pickle gets it: from the memmap itself, or loaded with ``mode``."""
    td = TensorDict(obs=torch.zeros(8, dtype=torch.uint8), batch_size=[8]).memmap(path)
    return td["obs"] if mode is None else load_memmap(path, mode=mode)["obs"]


def _victim(path, data=b"KEEP=1\nOK\n"):
    path.write_bytes(data[:8])
    return path


def _put(kind, leaf, victim=None):
    """Replace the file ``leaf`` by ``kind``: a symlink to ``victim``, a FIFO, a directory."""
    os.unlink(leaf)
    if kind == "symlink":
        os.symlink(victim, leaf)
    elif kind == "FIFO":
        os.mkfifo(leaf)
    else:
        os.mkdir(leaf)


# ------------------------------------------------------- unpickling in this process
# (a FIFO in place of a read-only leaf blocked the unpickling: in the spawned receiver below)
@pytest.mark.parametrize("kind, mode", [("symlink", None), ("symlink", "r"), ("FIFO", None),
                                        ("directory", None), ("directory", "r")])
def test_an_unpickled_leaf_refuses_what_was_put_in_place_of_its_file(tmp_path, kind, mode):
    leaf = _save(tmp_path / "buf", mode)
    message = pickle.dumps(leaf)
    victim = _victim(tmp_path / "victim_config.txt")
    path = str(tmp_path / "buf" / "obs.memmap")
    _put(kind, path, victim)
    with pytest.raises(FileReplacedError, match=re.escape(f"is now a {kind}, not a regular file: {path}")):
        pickle.loads(message)
    assert victim.read_bytes() == b"KEEP=1\nO"
    with pytest.raises((RuntimeError, ValueError)):  # the loader refuses them too
        load_memmap(tmp_path / "buf")


def test_a_symlink_does_not_lead_to_this_processs_own_mapping_of_its_target(tmp_path):
    # the receiver maps the link's target already (shared, the same size): the inode
    # cache must not hand that mapping out for the link
    victim = _victim(tmp_path / "victim.memmap")
    mine = MemoryMappedTensor.from_filename(victim, torch.uint8, (8,))
    message = pickle.dumps(_save(tmp_path / "buf"))
    _put("symlink", str(tmp_path / "buf" / "obs.memmap"), victim)
    with pytest.raises(FileReplacedError, match="is now a symlink"):
        pickle.loads(message)
    assert bytes(mine.numpy()) == b"KEEP=1\nO" == victim.read_bytes()


def test_a_leaf_under_a_symlinked_prefix_still_pickles(tmp_path):
    # the user's own prefix may be a link (a data disk, /tmp on some systems): only the
    # leaf file itself must not be one
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "link")
    TensorDict(obs=torch.arange(4), batch_size=[4]).memmap(tmp_path / "link" / "buf")
    leaves = {}
    for mode in (None, "r"):  # "r": a private mapping, made anew by the unpickling
        leaf = leaves[mode] = load_memmap(tmp_path / "link" / "buf", mode=mode)["obs"]
        again = pickle.loads(pickle.dumps(leaf))
        assert again.filename == str(tmp_path / "link" / "buf" / "obs.memmap")
        assert again.tolist() == [0, 1, 2, 3]
    TensorDict(obs=torch.ones(4, dtype=torch.int64), batch_size=[4]).memmap(
        tmp_path / "link" / "buf", existsok=True, atomic=True)
    # a shared leaf maps what the prefix holds now; a private one is a copy of the file it loaded
    assert pickle.loads(pickle.dumps(leaves[None])).tolist() == [1, 1, 1, 1]
    with pytest.raises(FileReplacedError, match="obs.memmap"):
        pickle.loads(pickle.dumps(leaves["r"]))


# ------------------------------------------------ a receiver in a fresh process
_RECEIVER = r"""
import json, pickle, signal, sys
import torch
from shared_td import MemoryMappedTensor

def blocked(*_):
    raise TimeoutError("blocked")

signal.signal(signal.SIGALRM, blocked)
for label, message, fifo in json.loads(sys.stdin.read()):
    signal.alarm(5)  # each case bounded: a blocked open is interrupted, and reported
    try:
        if fifo:
            got = MemoryMappedTensor.from_filename(fifo, torch.uint8, (8,), mode="r")
        else:
            got = pickle.loads(bytes.fromhex(message))
            got[:] = ord("X")  # the receiver's ordinary writes into its buffer
        outcome = ["returned", got.filename]
    except BaseException as error:
        outcome = [type(error).__name__, str(error)]
    signal.alarm(0)
    print(json.dumps([label] + outcome), flush=True)
"""


def test_a_receiver_process_maps_no_link_and_never_blocks_on_a_fifo(tmp_path):
    """The audit's scenario: a writable leaf whose file became a symlink to another
    file, a read-only leaf (``load_memmap(mode="r")``) whose file became a FIFO, and
    ``from_filename(fifo, mode="r")``, in a spawned receiver."""
    written = pickle.dumps(_save(tmp_path / "w"))
    read_only = pickle.dumps(_save(tmp_path / "r", mode="r"))
    victim = _victim(tmp_path / "victim_config.txt")
    _put("symlink", str(tmp_path / "w" / "obs.memmap"), victim)
    _put("FIFO", str(tmp_path / "r" / "obs.memmap"))
    os.mkfifo(tmp_path / "fifo.memmap")
    cases = [["symlink", written.hex(), None], ["FIFO", read_only.hex(), None],
             ["from_filename", None, str(tmp_path / "fifo.memmap")]]
    try:
        done = subprocess.run([sys.executable, "-c", _RECEIVER], input=json.dumps(cases),
                              capture_output=True, text=True, timeout=BOUND)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the receiver did not finish within {BOUND} s")
    outcomes = {line[0]: line[1:] for line in map(json.loads, done.stdout.splitlines())}
    assert set(outcomes) == {"symlink", "FIFO", "from_filename"}, done.stderr[-2000:]
    assert victim.read_bytes() == b"KEEP=1\nO"
    for label, kind, path in [("symlink", "symlink", tmp_path / "w" / "obs.memmap"),
                              ("FIFO", "FIFO", tmp_path / "r" / "obs.memmap")]:
        name, text = outcomes[label]
        assert name == "FileReplacedError" and f"is now a {kind}, not a regular file: {path}" in text
    name, text = outcomes["from_filename"]
    assert name == "OSError" and f"Cannot map {tmp_path / 'fifo.memmap'}: it is a FIFO" in text


# ------------------------------------------------------------------ from_filename
# (from_filename(fifo, mode="r") blocked: in the spawned receiver above)
@pytest.mark.parametrize("kind, mode", [("FIFO", None), ("FIFO", "r+"), ("directory", None),
                                        ("directory", "r"), ("directory", "r+")])
def test_from_filename_refuses_what_is_not_a_regular_file(tmp_path, kind, mode):
    path = tmp_path / "x.memmap"
    (os.mkfifo if kind == "FIFO" else os.mkdir)(path)
    expected = IsADirectoryError if kind == "directory" else OSError
    with pytest.raises(expected, match=re.escape(f"Cannot map {path}: it is a {kind}, not a regular file")) as caught:
        MemoryMappedTensor.from_filename(path, torch.uint8, (4,), mode=mode)
    assert caught.value.errno == (errno.EISDIR if kind == "directory" else errno.ENODEV)


def test_from_filename_of_a_directory_beside_tensordict(tmp_path):
    tensordict = pytest.importorskip("tensordict")
    os.mkdir(tmp_path / "d")
    for mode in (None, "r"):
        with pytest.raises(RuntimeError):  # tensordict 0.15.3: torch's raw RuntimeError
            tensordict.MemoryMappedTensor.from_filename(tmp_path / "d", torch.uint8, (4,), mode=mode)
        with pytest.raises(IsADirectoryError, match=re.escape(str(tmp_path / "d"))):
            MemoryMappedTensor.from_filename(tmp_path / "d", torch.uint8, (4,), mode=mode)


def test_from_filename_records_the_resolved_path(tmp_path):
    tensordict = pytest.importorskip("tensordict")
    (tmp_path / "real").mkdir()
    real = tmp_path / "real" / "x.memmap"
    MemoryMappedTensor.from_tensor(torch.arange(4), filename=real)
    os.symlink(tmp_path / "real", tmp_path / "dirlink")
    os.symlink(real, tmp_path / "filelink.memmap")
    for given in (tmp_path / "dirlink" / "x.memmap", tmp_path / "filelink.memmap"):
        for mode in ("r", None):
            ours = MemoryMappedTensor.from_filename(given, torch.int64, (4,), mode=mode)
            theirs = tensordict.MemoryMappedTensor.from_filename(given, torch.int64, (4,), mode=mode)
            assert ours.tolist() == theirs.tolist() == [0, 1, 2, 3]
            assert ours.filename == str(real)  # tensordict: the path as given
            assert pickle.loads(pickle.dumps(ours)).filename == str(real)
            # the path the user gave still names the tensor's own file
            assert os.path.realpath(given) == ours.filename
        # (mode=None, shared: its own file, so nothing to write)
        assert MemoryMappedTensor.from_tensor(ours, filename=given) is ours
        assert MemoryMappedTensor.from_filename(given, torch.int64, (0,)).filename == str(real)


# ----------------------------------------------------------- writing over a FIFO
def test_an_in_place_rewrite_over_a_fifo_leaf_names_it(tmp_path):
    prefix = tmp_path / "buf"
    TensorDict(x=torch.zeros(4)).memmap(prefix)
    _put("FIFO", str(prefix / "x.memmap"))
    with pytest.raises(OSError, match=re.escape(f"Cannot write file {prefix / 'x.memmap'}: it is a FIFO")) as caught:
        TensorDict(x=torch.ones(1 << 10)).memmap(prefix)
    assert caught.value.errno == errno.EINVAL  # refused when opened, before any write
    TensorDict(x=torch.ones(4)).memmap(prefix, atomic=True)  # a new directory: written
    assert load_memmap(prefix)["x"].tolist() == [1.0] * 4


@pytest.mark.parametrize("how", ["from_tensor", "empty"])
def test_a_file_tensor_over_an_existing_fifo_names_it(tmp_path, how):
    path = tmp_path / "x.memmap"
    os.mkfifo(path)
    with pytest.raises(OSError, match=re.escape(f"Cannot write file {path}: it is a FIFO, not a regular file")) as caught:
        if how == "from_tensor":  # its bytes are written with pwrite
            MemoryMappedTensor.from_tensor(torch.ones(4), filename=path, existsok=True)
        else:  # its room is reserved
            MemoryMappedTensor.empty(4, filename=path, existsok=True)
    assert caught.value.errno == errno.EINVAL
