"""Pieces of a memory-mapped or shared NonTensorStack, beside tensordict 0.15.3: a row
(or slice, reshape...) holds copies of the stack's values, so an in-place write into it
is refused instead of being lost silently; writes through the stack keep working.
Found by a run of tensordict's own test_nontensor.py against shared_td."""
from __future__ import annotations

import pytest
import torch

import shared_td
from tests.reference import LIBS

REFUSED = "Cannot update a leaf NonTensorDataBase from a memmaped parent NonTensorStack"


def memmapped_stack(lib, path):
    """A 3x2 NonTensorStack of [[0, 1]] * 3, memory-mapped at ``path``."""
    row = torch.stack([lib.NonTensorData(data=0), lib.NonTensorData(data=1)], 0)
    stack = torch.stack([row] * 3).clone()
    stack.memmap_(path)
    return stack


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("piece", ["element", "row"])
@pytest.mark.parametrize("how", ["update_", "update-inplace"])
def test_in_place_write_into_a_piece_of_a_memmapped_stack_is_refused(lib, piece, how, tmp_path):
    stack = memmapped_stack(lib, tmp_path)
    target = stack[0, 0] if piece == "element" else stack[0]
    with pytest.raises(RuntimeError, match=REFUSED):
        if how == "update_":
            target.update_(lib.NonTensorData(data=5))
        else:
            target.update(lib.NonTensorData(data=5), inplace=True)
    assert stack.tolist() == [[0, 1]] * 3
    assert lib.TensorDict.load_memmap(tmp_path).tolist() == [[0, 1]] * 3


@pytest.mark.parametrize("lib", LIBS)
def test_writes_through_the_memmapped_stack_reach_its_files(lib, tmp_path):
    stack = memmapped_stack(lib, tmp_path)
    stack[0, 0] = lib.NonTensorData(data=99)
    stack.update_at_(lib.NonTensorData(data=98), (0, 1))
    assert stack.tolist() == [[99, 98], [0, 1], [0, 1]]
    assert lib.TensorDict.load_memmap(tmp_path).tolist() == [[99, 98], [0, 1], [0, 1]]


@pytest.mark.parametrize("lib", LIBS)
def test_a_piece_of_a_stack_that_is_not_stored_can_be_written(lib):
    row = torch.stack([lib.NonTensorData(data=0), lib.NonTensorData(data=1)], 0)
    stack = torch.stack([row] * 3).clone()
    element = stack[0, 0]
    element.update_(lib.NonTensorData(data=5))
    assert element.data == 5


def test_a_piece_of_a_shared_stack_refuses_in_place_writes():
    # (tensordict 0.15.3 writes through here; shared_td's piece is a copy, and refuses)
    td = shared_td.TensorDict(task=shared_td.NonTensorStack("walk", "run"), batch_size=[2])
    td.share_memory_()
    with pytest.raises(RuntimeError, match=r"copy.*stack\[index\] = value"):
        td.get("task")[0].update_(shared_td.NonTensorData("jump"))
    with pytest.raises(RuntimeError, match=REFUSED):
        td[1].set_("task", "jump")
    td[1] = shared_td.TensorDict(task="jump")  # through the stack: written
    assert td["task"] == ["walk", "jump"]


def test_a_copy_of_a_piece_can_be_written():
    td = shared_td.TensorDict(task=shared_td.NonTensorStack("walk", "run"), batch_size=[2])
    td.share_memory_()
    own = td.get("task")[0].clone()
    own.update_(shared_td.NonTensorData("jump"))
    assert own.data == "jump"
    assert td["task"] == ["walk", "run"]


def test_an_indexed_write_into_rows_of_a_shared_tensordict_is_refused_whole():
    # its tensors are views (they would be written) but its task values copies (lost)
    td = shared_td.TensorDict(obs=torch.zeros(2), task=shared_td.NonTensorStack("walk", "run"),
                              batch_size=[2])
    td.share_memory_()
    rows = td[0:2]
    with pytest.raises(RuntimeError, match=REFUSED):
        rows[0] = shared_td.TensorDict(obs=torch.tensor(7.0), task="jump")
    assert td["obs"].tolist() == [0.0, 0.0]
    assert td["task"] == ["walk", "run"]


def test_writing_the_value_a_row_holds_is_not_refused(tmp_path):
    td = shared_td.TensorDict(obs=torch.zeros(2), task=shared_td.NonTensorStack("walk", "run"),
                              batch_size=[2])
    td.memmap_(tmp_path)
    row = td[0:1].unlock_()
    row[0] = shared_td.TensorDict(obs=torch.tensor(7.0), task="walk")
    assert td["obs"].tolist() == [7.0, 0.0]
