"""A copy-on-write tensor (``load_memmap(mode="r")``) whose file was replaced on disk
(an atomic rewrite of the same prefix) is never received as the new file: pickled before
or after the rewrite, its receiver (a real fork or spawn child, or this process) raises
FileReplacedError (a plain view's sender does already). An unreplaced file is still
received, mapping the same bytes.

tensordict 0.15.3 has no atomic rewrite of a prefix (its memmap_ overwrites the files in
place), so there is no replaced file to compare with there.
"""
from __future__ import annotations

import multiprocessing
import pickle
from multiprocessing.reduction import ForkingPickler

import pytest
import torch

import shared_td
from shared_td.errors import FileReplacedError
from tests.processes import WAIT, finish


def _save(prefix, value: float) -> None:
    shared_td.TensorDict(a=torch.full((3,), value)).memmap_(str(prefix), existsok=True, atomic=True)


def _unpickle_each(conn) -> None:
    for _ in range(2):
        blob = conn.recv_bytes()
        try:
            conn.send(("ok", pickle.loads(blob)["a"].tolist()))
        except Exception as err:  # reported to the test
            conn.send((type(err).__name__, str(err)))
    conn.close()


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_private_tensor_pickled_before_its_file_was_replaced_is_refused_by_the_receiver(method, tmp_path):
    replaced, kept = tmp_path / "replaced", tmp_path / "kept"
    _save(replaced, 1.0)
    _save(kept, 2.0)
    loaded = shared_td.TensorDict.load_memmap(str(replaced), mode="r")
    other = shared_td.TensorDict.load_memmap(str(kept), mode="r")
    blobs = [pickle.dumps(loaded), bytes(ForkingPickler.dumps(other))]
    _save(replaced, 5.0)  # atomic rewrite: a new file at the same path
    context = multiprocessing.get_context(method)
    ours, theirs = context.Pipe()
    child = context.Process(target=_unpickle_each, args=(theirs,))
    child.start()
    theirs.close()
    answers = []
    for blob in blobs:
        ours.send_bytes(blob)
        assert ours.poll(WAIT), "the child answered nothing"
        answers.append(ours.recv())
    assert finish(child) == 0
    (kind, message), unreplaced = answers
    assert kind == "FileReplacedError", message
    assert str(replaced / "a.memmap") in message and "Load the file again" in message
    assert unreplaced == ("ok", [2.0, 2.0, 2.0])
    assert loaded["a"].tolist() == [1.0] * 3  # the sender still holds the old bytes


@pytest.mark.parametrize("dumps", [pickle.dumps, ForkingPickler.dumps])
def test_a_private_tensor_pickled_after_its_file_was_replaced_is_refused(dumps, tmp_path):
    _save(tmp_path / "t", 1.0)
    loaded = shared_td.TensorDict.load_memmap(str(tmp_path / "t"), mode="r")
    assert pickle.loads(dumps(loaded))["a"].tolist() == [1.0] * 3  # unreplaced: received
    _save(tmp_path / "t", 5.0)
    for sent in (loaded, loaded["a"], loaded["a"][1:]):  # the tree, a leaf, a view of it
        with pytest.raises(FileReplacedError, match=r"replaced since it was loaded .*a\.memmap.*Load the file again"):
            pickle.loads(dumps(sent))  # (this process maps the old file privately: not reused)
    if dumps is ForkingPickler.dumps:  # a plain view is refused by its sender already
        with pytest.raises(FileReplacedError, match=r"a\.memmap"):
            dumps(loaded["a"].view(3))
