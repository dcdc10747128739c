"""More differences from tensordict 0.15.3, now gone; each case runs the same code on
shared_td and on tensordict and compares what comes out:

1. comparing a tensordict with a tensor that has dims (``td == mask``, ``<``, ``!=``)
   lines the tensor up with the batch dims, as tensordict does (torch alone lines it up
   with each leaf's last dims: ``td == torch.tensor([0., 1., 0.])`` of batch [3] compared
   each row of a [3, 4] leaf with the whole tensor and raised);
"""
from __future__ import annotations

import operator
import pickle

import pytest
import torch

import shared_td
from tests.reference import needs_tensordict, outcome, side_by_side

pytestmark = needs_tensordict


# ------------------------------------------------------------------ 1. td op tensor

def _tree(lib):
    return lib.TensorDict(a=torch.arange(12.).reshape(3, 4) % 3, b=torch.tensor([0., 1., 2.]),
                          n=lib.TensorDict(c=torch.ones(3, 2, 5), batch_size=[3, 2]), batch_size=[3])


@pytest.mark.parametrize("op", [operator.eq, operator.ne, operator.lt, operator.ge])
@pytest.mark.parametrize("shape", [(3,), (1,), (3, 1), (2, 3), (2, 1), (4,), (3, 4)])
def test_a_tensor_with_dims_lines_up_with_the_batch_dims(op, shape):
    other = torch.arange(float(torch.Size(shape).numel())).reshape(shape) % 2

    def scenario(lib):
        result = op(_tree(lib), other)
        return (list(result.batch_size), list(result["n"].batch_size),
                {key: value.tolist() for key, value in result.items(True, True)})

    side_by_side(scenario)


def test_a_row_mask_compares_row_by_row():
    td = shared_td.TensorDict(a=torch.zeros(3, 4), s="text", batch_size=[3])
    same = td == torch.tensor([0., 1., 0.])
    assert same["a"].tolist() == [[True] * 4, [False] * 4, [True] * 4]
    assert not same.all() and (td == torch.zeros(3)).all()  # the text entry is left out, as with a scalar


def test_a_tensor_that_does_not_line_up_names_both_shapes():
    td = shared_td.TensorDict(a=torch.zeros(3, 4), batch_size=[3])
    with pytest.raises(shared_td.BatchSizeMismatchError, match=r"batch size \[3\] with a tensor of shape \[4\]"):
        td == torch.zeros(4)


def test_a_lazy_stack_compares_with_a_tensor_of_its_batch_shape():
    def scenario(lib):
        stack = lib.lazy_stack([lib.TensorDict(a=torch.full((4,), float(i)), batch_size=[]) for i in range(3)])
        result = stack == torch.tensor([0., 5., 2.])
        return list(result.batch_size), result["a"].tolist()

    side_by_side(scenario)


# ------------------------------------------------------------------ 2. unpickled consolidated

def _consolidated(lib):
    return lib.TensorDict(a=torch.zeros(2), n={"b": torch.ones(2), "m": {"c": torch.arange(2)}}, s="text",
                          stack=lib.lazy_stack([lib.TensorDict(z=torch.zeros(2)) for _ in range(3)])).consolidate()


def test_an_unpickled_consolidated_tensordict_is_unlocked():
    def scenario(lib):
        again = pickle.loads(pickle.dumps(_consolidated(lib)))
        locks = [again.is_locked, again["n"].is_locked, again["n", "m"].is_locked, again["stack"].is_locked]
        again["n", "new"] = torch.zeros(2)  # a receiver adds keys at once
        return locks, sorted(again["n"].keys())

    side_by_side(scenario)


def test_a_node_locked_on_its_own_in_an_unlocked_consolidated_tree_stays_locked():
    def scenario(lib):
        out = _consolidated(lib).unlock_()
        out["n"].lock_()
        again = pickle.loads(pickle.dumps(out))
        return again.is_locked, again["n"].is_locked, again["n", "m"].is_locked

    side_by_side(scenario)


# ------------------------------------------------------------------ 3. tensorclass clear()

def test_clear_of_a_tensorclass_empties_its_fields():
    def scenario(lib):
        @lib.tensorclass
        class Step:
            obs: torch.Tensor
            label: str = "a"

        step = Step(obs=torch.zeros(3), label="t", batch_size=[3])
        same = step.clear() is step
        locked = Step(obs=torch.zeros(3), label="t", batch_size=[3]).lock_()
        refused = outcome(locked.clear)
        return same, step.obs, step.label, step.is_empty(), refused, locked.obs.tolist()

    side_by_side(scenario)


# ------------------------------------------------------------------ 4. make_memmap of a lazy stack

def test_make_memmap_of_a_lazy_stack_is_refused_as_tensordict_refuses_it(tmp_path):
    def scenario(lib):
        stack = lib.LazyStackedTensorDict(lib.TensorDict(a=torch.zeros(2)), lib.TensorDict(a=torch.ones(2)),
                                          stack_dim=0)
        stack.memmap_(tmp_path / lib.__name__)
        with pytest.raises(RuntimeError, match="Cannot call `make_memmap` on a LazyStackedTensorDict"):
            stack.make_memmap("x", (2,))
        return sorted(stack.keys())

    side_by_side(scenario)
