"""An index that lies in one of the written tensordict's own leaves, and the leaves that
torch or autograd refuse to write in place (session-21 RL audit, findings 1 and 4).

The RL reset ``env[env["done"]] = reset`` indexes with the buffer's own "done" leaf; a
stored "next row" column gives ``buf[buf["nxt"][:2]] = batch``. The index is read whole
before anything is written (a copy of the part in a leaf's memory), so every entry is
written at the rows the index gave before the write, whatever the order of the entries
(tensordict 0.15.3 half-writes the batch and raises torch's overlap error). A leaf whose
strides changed in place since the cached row-write plan was made, a leaf that requires
grad and an inference tensor are refused before anything is written, naming the entry
(tensordict 0.15.3 writes the entries before it first).
"""
from __future__ import annotations

import pytest
import torch

import shared_td
from shared_td import LazyStackedTensorDict, TensorDict

tensordict = pytest.importorskip("tensordict")

LIBS = [shared_td, tensordict]


def _env(lib, memmap: bool = False, done_first: bool = False):
    entries = {"obs": torch.arange(4.0), "done": torch.tensor([True, False, True, False])}
    if done_first:
        entries = {"done": entries["done"], "obs": entries["obs"]}
    env = lib.TensorDict(entries, batch_size=[4])
    return env.memmap_() if memmap else env


def _reset(lib):
    return lib.TensorDict(obs=torch.full((2,), -1.0), done=torch.zeros(2, dtype=torch.bool), batch_size=[2])


def _try(write) -> str:
    try:
        write()
    except RuntimeError as error:
        return str(error)
    return "ok"


# ------------------------------------------------------ finding 1: the index in a leaf
@pytest.mark.parametrize("memmap", [False, True], ids=["plain", "memmap"])
@pytest.mark.parametrize("warm", [False, True], ids=["fresh", "plan-cached"])
@pytest.mark.parametrize("done_first", [False, True], ids=["obs-first", "done-first"])
def test_done_mask_of_the_buffer_itself_resets_every_entry(memmap, warm, done_first):
    env = _env(shared_td, memmap, done_first)
    if warm:  # the fast lane's plan made by an earlier write of the same structure
        env[torch.tensor([1])] = _reset(shared_td)[:1]
        env["obs"][1], env["done"][1] = 1.0, False
    env[env["done"]] = _reset(shared_td)
    assert env["obs"].tolist() == [-1.0, 1.0, -1.0, 3.0]
    assert env["done"].tolist() == [False] * 4


def test_tensordict_half_writes_the_done_mask_reset():
    env = _env(tensordict)
    assert "some elements of the input tensor" in _try(lambda: env.__setitem__(env["done"], _reset(tensordict)))
    assert env["obs"].tolist() == [-1.0, 1.0, -1.0, 3.0]  # obs written, done not
    assert env["done"].tolist() == [True, False, True, False]


@pytest.mark.parametrize("lib", LIBS, ids=["shared_td", "tensordict"])
def test_a_number_through_the_own_mask_reaches_every_entry_in_any_order(lib):
    env = _env(lib, done_first=True)  # done is written first: the mask would be all False for obs
    env[env["done"]] = 0
    assert env["done"].tolist() == [False] * 4
    # shared_td reads the mask before the write; tensordict reads it again for obs
    assert env["obs"].tolist() == ([0.0, 1.0, 0.0, 3.0] if lib is shared_td else [0.0, 1.0, 2.0, 3.0])


@pytest.mark.parametrize("memmap", [False, True], ids=["plain", "memmap"])
@pytest.mark.parametrize("warm", [False, True], ids=["fresh", "plan-cached"])
def test_index_that_is_a_slice_of_a_stored_column(memmap, warm):
    buf = TensorDict(obs=torch.zeros(6), nxt=torch.tensor([5, 4, 3, 2, 1, 0]), batch_size=[6])
    if memmap:
        buf.memmap_()
    if warm:
        buf[torch.tensor([5])] = TensorDict(obs=torch.zeros(1), nxt=torch.tensor([0]), batch_size=[1])
    buf[buf["nxt"][:2]] = TensorDict(obs=torch.full((2,), 7.0), nxt=torch.tensor([9, 9]), batch_size=[2])
    assert buf["obs"].tolist() == [0.0, 0.0, 0.0, 0.0, 7.0, 7.0]
    assert buf["nxt"].tolist() == [5, 4, 3, 2, 9, 9]


def test_index_in_a_nested_leaf_and_a_source_with_a_new_key():
    # the general write (a new key): the index lies in a nested tensordict's leaf
    env = TensorDict(obs=torch.arange(4.0), sub={"done": torch.tensor([True, False, True, False])}, batch_size=[4])
    env[env["sub", "done"]] = TensorDict(obs=torch.zeros(2), sub={"done": torch.zeros(2, dtype=torch.bool)},
                                         extra=torch.ones(2), batch_size=[2])
    assert env["obs"].tolist() == [0.0, 1.0, 0.0, 3.0]
    assert env["sub", "done"].tolist() == [False] * 4
    assert env["extra"].tolist() == [1.0, 0.0, 1.0, 0.0]


@pytest.mark.parametrize("source", ["td", "dict"])
def test_update_at_with_the_own_done_mask(source):
    env = _env(shared_td, done_first=True)
    value = _reset(shared_td) if source == "td" else {"obs": torch.full((2,), -1.0),
                                                      "done": torch.zeros(2, dtype=torch.bool)}
    env.update_at_(value, env["done"])
    assert env["obs"].tolist() == [-1.0, 1.0, -1.0, 3.0]
    assert env["done"].tolist() == [False] * 4


def test_set_at_with_an_index_in_the_entry():
    td = TensorDict(a=torch.arange(4), b=torch.zeros(4, 2), batch_size=[4])
    td.set_at_("a", torch.tensor([7, 7]), td["a"][:2])  # rows 0 and 1, read before the write
    assert td["a"].tolist() == [7, 7, 2, 3]


def test_lazy_stack_member_leaf_as_index_of_the_nested_stack():
    inner = LazyStackedTensorDict.lazy_stack([TensorDict(x=torch.zeros(2), batch_size=[2]) for _ in range(2)], 0)
    td = TensorDict(lazy=inner, done=torch.tensor([True, False]), batch_size=[2])
    td[td["done"]] = 5
    assert td["done"].tolist() == [True, False]  # (5 is True)
    assert td["lazy", "x"].tolist() == [[5.0, 5.0], [0.0, 0.0]]


def test_a_fresh_index_is_not_copied():
    # the fast lane copies only an index in a leaf's memory (nothing else costs a copy)
    from shared_td.containers import index_writes, row_writes

    buf = TensorDict(obs=torch.zeros(6), batch_size=[6])
    idx = torch.tensor([1, 2])
    assert index_writes.own_index((idx,), buf)[0] is idx
    buf[idx] = TensorDict(obs=torch.ones(2), batch_size=[2])
    plan = buf._row_write_plan
    assert row_writes._own_index(plan, (idx,))[0] is idx
    mask = buf["obs"] > 0  # (a new tensor)
    assert index_writes.own_index((mask,), buf)[0] is mask
    view = buf["obs"][:2]
    assert row_writes._own_index(plan, (view,))[0] is not view
    assert index_writes.own_index((view,), buf)[0] is not view


# -------------------------------------------- finding 4: strides, grad, inference
@pytest.mark.parametrize("lib", LIBS, ids=["shared_td", "tensordict"])
def test_leaf_expanded_in_place_after_the_plan_is_refused_first(lib):
    td = lib.TensorDict(a=torch.zeros(6), b=torch.zeros(6), batch_size=[6])
    td[0:2] = lib.TensorDict(a=torch.ones(2), b=torch.ones(2), batch_size=[2])  # the plan is made
    td["b"].as_strided_((6,), (0,))  # same pointer, shape and dtype; now expanded
    td["a"].zero_()
    error = _try(lambda: td.__setitem__(slice(2, 4), lib.TensorDict(a=torch.full((2,), 5.0),
                                                                      b=torch.full((2,), 5.0), batch_size=[2])))
    if lib is shared_td:
        assert error.startswith("Cannot write entry 'b'") and "expanded" in error, error
        assert td["a"].tolist() == [0.0] * 6
    else:  # tensordict 0.15.3 writes a, then torch refuses b
        assert "more than one element" in error and td["a"].tolist() == [0.0, 0.0, 5.0, 5.0, 0.0, 0.0]


def test_leaf_restrided_in_place_is_planned_again():
    td = TensorDict(a=torch.zeros(3, 2), batch_size=[3])
    td[0] = TensorDict(a=torch.ones(2), batch_size=[])
    td["a"].as_strided_((3, 2), (1, 3))  # a transposed view of the same memory, in place
    td[1] = TensorDict(a=torch.tensor([4.0, 5.0]), batch_size=[])
    assert td["a"][1].tolist() == [4.0, 5.0]


@pytest.mark.parametrize("warm", [False, True], ids=["fresh", "plan-cached"])
@pytest.mark.parametrize("index", [slice(2, 4), torch.tensor([2, 3])], ids=["slice", "tensor"])
def test_leaf_that_requires_grad_is_refused_before_anything_is_written(warm, index):
    td = TensorDict(a=torch.zeros(6), w=torch.zeros(6), batch_size=[6])
    if warm:
        td[0:2] = TensorDict(a=torch.ones(2), w=torch.ones(2), batch_size=[2])
        td["a"].zero_()
    td["w"].requires_grad_(True)
    step = TensorDict(a=torch.full((2,), 5.0), w=torch.full((2,), 5.0), batch_size=[2])
    error = _try(lambda: td.__setitem__(index, step))
    assert error.startswith("Cannot write entry 'w'") and "requires grad" in error, error
    assert error.endswith("Nothing was written.") and td["a"].tolist() == [0.0] * 6
    assert "requires grad" in _try(lambda: td.__setitem__(index, 1.0)) and td["a"].tolist() == [0.0] * 6
    with torch.no_grad():  # allowed there, as torch allows it
        td[index] = step
    assert td["a"].tolist() == [0.0, 0.0, 5.0, 5.0, 0.0, 0.0]


def test_tensordict_half_writes_before_a_leaf_that_requires_grad():
    td = tensordict.TensorDict(a=torch.zeros(6), w=torch.zeros(6, requires_grad=True), batch_size=[6])
    error = _try(lambda: td.__setitem__(slice(2, 4), tensordict.TensorDict(
        a=torch.full((2,), 5.0), w=torch.full((2,), 5.0), batch_size=[2])))
    assert "requires grad" in error and td["a"].tolist() == [0.0, 0.0, 5.0, 5.0, 0.0, 0.0]


@pytest.mark.parametrize("warm", [False, True], ids=["fresh", "plan-cached"])
def test_inference_tensor_outside_inference_mode_is_refused_first(warm):
    with torch.inference_mode():
        frozen = torch.zeros(4)
    td = TensorDict(a=torch.zeros(4), z=frozen, batch_size=[4])
    step = TensorDict(a=torch.ones(2), z=torch.ones(2), batch_size=[2])
    if warm:
        with torch.inference_mode():
            td[0:2] = step  # the plan is made (and the write allowed) in inference mode
        td["a"].zero_()
    error = _try(lambda: td.__setitem__(slice(2, 4), step))
    assert error.startswith("Cannot write entry 'z'") and "inference" in error, error
    assert td["a"].tolist() == [0.0] * 4
