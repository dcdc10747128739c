"""Audit 15 fixes, side by side with tensordict 0.15.3: flatten/unflatten in place of a
tree holding one nested tensordict under two keys, update() with clashing dim names,
all(dim)/any(dim) of lazy stacks, the errors of a refused resize and of a dim of a 0-d
tensordict, an empty lazy stack in a named parent, repeat/repeat_interleave of
non-tensor entries, from_dict(batch_size=, batch_dims=) and permute of the leading dims.

Where tensordict fails halfway (it leaves a changed tree behind), shared_td succeeds or
raises with nothing changed, and only shared_td is tested.
"""
from __future__ import annotations

import pytest
import torch

import shared_td
from tests.reference import LIBS, dim_names, needs_tensordict, tensordict

# ---------------------------------------------------------------- flatten/unflatten in place
def _aliased(lib=shared_td):
    sub = lib.TensorDict(x=torch.arange(12.0).view(3, 4), batch_size=[3, 4], names=["t", "e"])
    td = lib.TensorDict(a=torch.zeros(3, 4, 2), s1=sub, batch_size=[3, 4])
    td["s2"] = sub
    td["deep"] = lib.TensorDict(s=sub, batch_size=[3, 4])  # the same one, one level down
    return td, sub


def test_flatten_in_place_changes_a_nested_tensordict_held_twice_once():
    # Before: sub was flattened once per key: the second time raised (end_dim=1 out of
    # range) with td's batch size [3, 4] and its entries [12] (tensordict: the same).
    td, sub = _aliased()
    assert td.flatten(inplace=True) is td
    assert td.batch_size == torch.Size([12]) and td["a"].shape == torch.Size([12, 2])
    assert td["s1"] is sub and td["s2"] is sub and td["deep", "s"] is sub
    assert sub.batch_size == torch.Size([12]) and sub["x"].tolist() == list(range(12))
    assert td["deep"].batch_size == torch.Size([12])


def test_unflatten_in_place_changes_a_nested_tensordict_held_twice_once():
    td, sub = _aliased()
    td.flatten(inplace=True)
    td.unflatten(0, (3, 4), inplace=True)
    assert td.batch_size == sub.batch_size == td["deep"].batch_size == torch.Size([3, 4])
    assert sub["x"].shape == torch.Size([3, 4]) and td["a"].shape == torch.Size([3, 4, 2])
    assert dim_names(sub) is None  # (flatten unnamed the flattened dims)


def test_flatten_in_place_refused_deep_down_changes_nothing(unchanged):
    td, _ = _aliased()
    td["deep", "l"] = shared_td.lazy_stack([shared_td.TensorDict(batch_size=[4]) for _ in range(3)])
    with unchanged(td), pytest.raises(NotImplementedError, match="LazyStackedTensorDict"):
        td.flatten(inplace=True)


# ---------------------------------------------------------------- update: dim names in the plan
def test_update_with_a_child_named_otherwise_changes_nothing(unchanged):
    # Before: "x" was added, then "c" refused (tensordict: the same half-write).
    td = shared_td.TensorDict(batch_size=[3], names=["t"])
    child = shared_td.TensorDict(a=torch.zeros(3), batch_size=[3], names=["other"])
    with unchanged(td), pytest.raises(RuntimeError, match="'c'"):
        td.update({"x": torch.zeros(3), "c": child})


def test_update_with_two_children_named_otherwise_changes_nothing(unchanged):
    # Before: the first child was added and named the parent; the second was refused.
    td = shared_td.TensorDict(sub=shared_td.TensorDict(batch_size=[3]), batch_size=[3])
    one = shared_td.TensorDict(batch_size=[3], names=["a"])
    two = shared_td.TensorDict(batch_size=[3], names=["b"])
    with unchanged(td), pytest.raises(RuntimeError, match="'c2'"):
        td.update({"c1": one, "sub": {"c2": two}})


@pytest.mark.parametrize("lib", LIBS)
def test_update_with_a_named_child_names_an_unnamed_parent(lib):
    td = lib.TensorDict(sub=lib.TensorDict(batch_size=[3]), batch_size=[3])
    td.update({"x": torch.zeros(3), "c": lib.TensorDict(batch_size=[3], names=["a"])})
    assert dim_names(td) == dim_names(td["sub"]) == ["a"]


# ---------------------------------------------------------------- all(dim)/any(dim), lazy
@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("op", ["all", "any"])
def test_lazy_reduced_along_a_dim_its_members_name_otherwise(lib, op):
    lazy = lib.LazyStackedTensorDict(
        lib.TensorDict(a=torch.ones(3, 4, dtype=torch.bool), batch_size=[3, 4], names=["x", "y"]),
        lib.TensorDict(a=torch.ones(3, 4, dtype=torch.bool), batch_size=[3, 4], names=["u", "v"]))
    out = getattr(lazy, op)(1)
    assert out.batch_size == torch.Size([2, 4]) and dim_names(out) is None
    assert out["a"].all()


@pytest.mark.parametrize("lib", LIBS)
def test_lazy_all_and_any_of_members_of_other_shapes(lib):
    lazy = lib.lazy_stack([lib.TensorDict(a=torch.ones(2)), lib.TensorDict(a=torch.tensor([1.0, 0.0, 1.0]))])
    assert (lazy.all(), lazy.any()) == (False, True)


# ---------------------------------------------------------------- errors
@pytest.mark.parametrize("lib", LIBS)
def test_a_refused_resize_on_set_names_the_nested_entry(lib):
    # Before: "the value has shape [] but the tensordict has batch_size [3]" (d unnamed).
    td = lib.TensorDict(a=torch.zeros(3, 4), batch_size=[3])
    child = lib.TensorDict(b=torch.zeros(3, 4), d=lib.TensorDict(e=torch.zeros(2), batch_size=[2]), batch_size=[])
    with pytest.raises(RuntimeError, match=r"\bd\b"):
        td["c"] = child
    assert "c" not in td.keys() and child.batch_size == torch.Size([])
    if lib is shared_td:
        with pytest.raises(RuntimeError, match="key 'c'.*key 'd' has shape"):
            td["c"] = child


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("call, error", [
    (lambda td: td.all(0), RuntimeError), (lambda td: td.any(-1), RuntimeError),
    (lambda td: td.transpose(0, 0), ValueError),
], ids=["all", "any", "transpose"])
def test_a_dim_of_a_0d_tensordict_is_refused(lib, call, error):
    with pytest.raises(error):
        call(lib.TensorDict(a=torch.zeros(2), batch_size=[]))


@pytest.mark.parametrize("call", [lambda td: td.all(0), lambda td: td.transpose(0, 0)], ids=["all", "transpose"])
def test_the_error_of_a_dim_of_a_0d_tensordict_says_it_has_none(call):
    # Before: "expected 0 <= dim <= -1".
    with pytest.raises(IndexError, match="has no batch dims") as error:
        call(shared_td.TensorDict(a=torch.zeros(2), batch_size=[]))
    assert "<= -1" not in str(error.value)


# ---------------------------------------------------------------- empty lazy stack, named parent
@pytest.mark.parametrize("lib", LIBS)
def test_an_empty_lazy_stack_takes_a_named_parents_names(lib):
    # Before: [None, 's'] (the name of the members' dim was lost: there is no member).
    parent = lib.TensorDict(a=torch.zeros(3, 0), batch_size=[3, 0], names=["x", "s"])
    parent["l"] = lib.LazyStackedTensorDict(stack_dim=1, batch_size=[3])
    assert parent["l"].names == ["x", "s"]


# ---------------------------------------------------------------- repeat, repeat_interleave
def _with_non_tensors(lib):
    return lib.TensorDict(
        a=torch.arange(4).view(2, 2),
        s=lib.NonTensorStack(lib.NonTensorStack("a", "b"), lib.NonTensorStack("c", "d")),
        n=lib.NonTensorData("z", batch_size=[2, 2]),
        sub=lib.TensorDict(s=lib.NonTensorStack(lib.NonTensorStack("e", "f"), lib.NonTensorStack("g", "h")),
                           batch_size=[2, 2]),
        wide=lib.TensorDict(x=torch.arange(20).view(2, 2, 5), batch_size=[2, 2, 5]),
        batch_size=[2, 2], names=["i", "j"])


def _summary(td):
    return (td.batch_size, td["a"].tolist(), td.get("s").tolist(), td["n"], td.get(("sub", "s")).tolist(),
            td["wide"].batch_size, td["wide", "x"].tolist())


REPEATS = pytest.mark.parametrize("call", [
    lambda td: td.repeat(2, 1), lambda td: td.repeat(1, 3),
    lambda td: td.repeat_interleave(2, dim=1), lambda td: td.repeat_interleave(torch.tensor([1, 2]), dim=0),
    lambda td: td.repeat_interleave(2),
], ids=["repeat0", "repeat1", "interleave1", "interleave_tensor", "interleave_flat"])


@REPEATS
def test_repeat_moves_the_values_of_non_tensor_entries(call):
    # Before: BatchSizeMismatchError for the NonTensorStack entries.
    out = call(_with_non_tensors(shared_td))
    for key in ("s", ("sub", "s"), "n"):
        assert out.get(key).batch_size == out.batch_size
    assert out["wide"].batch_size == torch.Size([*out.batch_size, 5])


@needs_tensordict
@REPEATS
def test_repeat_of_non_tensor_entries_as_tensordict(call):
    ours, theirs = call(_with_non_tensors(shared_td)), call(_with_non_tensors(tensordict))
    assert _summary(ours) == _summary(theirs)
    assert dim_names(ours) == dim_names(theirs)


def test_repeat_adds_leading_dims_to_non_tensor_entries():
    # (tensordict refuses more counts than batch dims; torch and shared_td add dims)
    td = shared_td.TensorDict(a=torch.arange(2), s=shared_td.NonTensorStack("x", "y"), batch_size=[2])
    out = td.repeat(2, 2)
    assert out.batch_size == out.get("s").batch_size == torch.Size([2, 4])
    assert out.get("s").tolist() == [["x", "y", "x", "y"]] * 2


# ---------------------------------------------------------------- from_dict
@pytest.mark.parametrize("lib", LIBS)
def test_from_dict_refuses_batch_size_and_batch_dims(lib):
    with pytest.raises(ValueError):
        lib.TensorDict.from_dict({"a": torch.zeros(3, 4)}, batch_size=[3], batch_dims=1)


# ---------------------------------------------------------------- permute of the leading dims
@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("dims", [(1, 0), (-2, 0), (0, 1), (0,), (2, 0, 1)])
def test_permute_of_the_leading_batch_dims(lib, dims):
    # Before: ValueError unless every batch dim was given.
    td = lib.TensorDict(a=torch.arange(120).view(2, 3, 4, 5), batch_size=[2, 3, 4], names=["x", "y", "z"])
    out = td.permute(*dims)
    order = [d % 3 for d in dims] + list(range(len(dims), 3))
    assert out.batch_size == torch.Size([td.batch_size[d] for d in order])
    assert torch.equal(out["a"], td["a"].permute(*order, 3))
    assert out.names == [td.names[d] for d in order]


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("dims", [(2, 0), (1,), (0, 0)])
def test_permute_refuses_dims_that_are_not_the_leading_ones(lib, dims):
    td = lib.TensorDict(a=torch.zeros(2, 3, 4), batch_size=[2, 3, 4])
    with pytest.raises(ValueError):
        td.permute(*dims)


def test_permute_of_the_leading_dims_of_a_non_tensor_stack():
    # (tensordict 0.15.3 raises an IndexError; a TensorDict's permute takes them)
    stack = shared_td.NonTensorStack(*[shared_td.NonTensorStack(*[shared_td.NonTensorStack(*"ab") for _ in range(3)])
                                       for _ in range(2)])
    stack[1, 2, 0] = "z"
    out = stack.permute(1, 0)
    assert out.batch_size == torch.Size([3, 2, 2]) and out[2, 1, 0] == "z"


@pytest.mark.parametrize("lib", LIBS)
def test_permute_of_the_leading_dims_of_a_lazy_stack(lib):
    members = [lib.TensorDict(a=torch.arange(6.0).reshape(2, 3) + 10 * i, batch_size=[2, 3]) for i in range(4)]
    lazy = lib.lazy_stack(members, 0)  # batch [4, 2, 3]
    out = lazy.permute(1, 0)
    assert out.batch_size == torch.Size([2, 4, 3])
    assert torch.equal(out["a"], lazy["a"].permute(1, 0, 2))


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("op", ["repeat", "repeat_interleave"])
def test_repeat_of_a_locked_tensordict_is_locked(lib, op):
    td = lib.TensorDict(a=torch.zeros(3, 2), batch_size=[3]).lock_()
    assert getattr(td, op)(2).is_locked


@pytest.mark.parametrize("lib", LIBS)
def test_expand_as_a_tensor_expands_to_its_shape(lib):
    td = lib.TensorDict(a=torch.arange(3.0), batch_size=[3])
    out = td.expand_as(torch.zeros(2, 3))
    assert out.batch_size == torch.Size([2, 3]) and torch.equal(out["a"], torch.arange(3.0).expand(2, 3))


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("size", [(2,), (2, 5)], ids=["one-dim", "two-dims"])
def test_new_zeros_of_a_tree_with_text_nested_dims_and_names(lib, size):
    # before: a NonTensorStack entry raised BatchSizeMismatchError, a nested tensordict
    # lost its own dims past ours, and the names were dropped
    td = lib.TensorDict(a=torch.ones(3, 2), s=lib.NonTensorStack("a", "b", "c"),
                        n=lib.TensorDict(c=torch.ones(3, 4), batch_size=[3, 4]), batch_size=[3], names=["x"])
    out = td.new_zeros(*size)
    assert out.batch_size == torch.Size(size) and dim_names(out) == [None] * (len(size) - 1) + ["x"]
    assert out["a"].shape == torch.Size([*size, 2]) and not out["a"].any()
    assert out["n"].batch_size == torch.Size([*size, 4]) and out["n", "c"].shape == torch.Size([*size, 4])
    assert out.get("s").batch_size == torch.Size(size)


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("op", ["repeat", "repeat_interleave"])
def test_repeat_of_a_tensorclass_keeps_its_class(lib, op):
    @lib.tensorclass
    class Step:
        x: torch.Tensor

    out = getattr(Step(x=torch.arange(3.0), batch_size=[3]), op)(2)
    assert type(out) is Step and out.batch_size == torch.Size([6])


@pytest.mark.parametrize("lib", LIBS)
def test_a_flatten_keys_block_that_raises_writes_nothing_back(lib):
    td = lib.TensorDict(a=lib.TensorDict(b=torch.zeros(3), batch_size=[3]), batch_size=[3])
    with pytest.raises(ValueError, match="stop"):
        with td.flatten_keys(".") as flat:
            flat["x.y"] = torch.ones(3)
            raise ValueError("stop")
    assert ("x", "y") not in td.keys(include_nested=True)


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("kind", ["dense", "lazy"])
def test_permute_takes_its_dims_as_a_keyword_too(lib, kind):
    td = lib.TensorDict(a=torch.arange(6.0).reshape(2, 3), batch_size=[2, 3], names=["x", "y"])
    if kind == "lazy":
        td = lib.lazy_stack(list(td.unbind(0)), 0)
    out = td.permute(dims=[1, 0])
    assert out.batch_size == torch.Size([3, 2]) and torch.equal(out["a"], td["a"].permute(1, 0))
