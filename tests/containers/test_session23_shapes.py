"""Session 23, side by side with tensordict 0.15.3 (divergences a differential fuzzer
found): ``torch.stack`` of lazy stacks copies (the result shares nothing with the
inputs), an index that selects no member of a lazy stack keeps empty nested tensordicts
and tensorclasses, split/chunk of an empty batch dim give torch's number of pieces, and
expand/reshape/view to a 0-d batch size work (so does a broadcast write of 0-d lazy
members)."""
from __future__ import annotations

import pytest
import torch

import shared_td
from tests.reference import LIBS, tensordict

@shared_td.tensorclass
class OursPoint:
    x: torch.Tensor
    label: str = None


if tensordict is not None:
    @tensordict.tensorclass
    class TheirsPoint:
        x: torch.Tensor
        label: str = None


def point_class(L):
    return OursPoint if L is shared_td else TheirsPoint


def member(L, value=0.0):
    return L.TensorDict({"c": torch.full((2,), value)}, [2])


def two_member_stack(L, first=0.0, second=0.0):
    return L.lazy_stack([member(L, first), member(L, second)])


# ---------------------------------------------------------------- A1: stacks of lazy stacks copy
@pytest.mark.parametrize("L", LIBS)
@pytest.mark.parametrize("how", ["torch.stack", "stack", "maybe_dense_stack"])
def test_stack_of_lazy_stacks_shares_nothing_with_the_inputs(L, how):
    stack = torch.stack if how == "torch.stack" else getattr(L, how)
    a = L.lazy_stack([member(L)])
    out = stack([a, a.clone()], 0)
    out["c"] += 1  # a write into the result
    out["new"] = torch.zeros(2, 1, 2)  # a new key in the result
    assert a["c"].tolist() == [[0.0, 0.0]]
    assert sorted(a.keys()) == ["c"]


@pytest.mark.parametrize("L", LIBS)
def test_stack_of_one_lazy_stack_twice_writes_each_row_once(L):
    x = two_member_stack(L)
    out = torch.stack([x, x], 0)
    out[0] = out[0].apply(lambda t: t + 1)
    assert out["c"].sum(dim=(1, 2)).tolist() == [4.0, 0.0]
    assert x["c"].sum().item() == 0.0


@pytest.mark.parametrize("L", LIBS)
@pytest.mark.parametrize("dim", [0, 1, 2, -1])
def test_stack_of_lazy_stacks_has_the_values_of_torch_stack(L, dim):
    a, b = two_member_stack(L, 1.0, 2.0), two_member_stack(L, 3.0, 4.0)
    out = torch.stack([a, b], dim)
    assert torch.equal(out["c"], torch.stack([a["c"], b["c"]], dim))
    assert type(out).__name__ == "LazyStackedTensorDict"
    assert all(type(m).__name__ == "TensorDict" for m in out.tensordicts)  # new dense members


def test_stack_of_lazy_stacks_along_other_stack_dims_is_a_copy_with_their_values():
    # (shared_td only: with stack dims and member counts that differ, tensordict 0.15.3
    # returns a lazy stack of the items themselves, sharing them)
    rows = [shared_td.TensorDict({"c": torch.arange(3.0) + 10 * i}, [3]) for i in range(2)]
    a = shared_td.lazy_stack(rows, 0)  # batch [2, 3], stack dim 0
    b = shared_td.lazy_stack([r.clone() for r in shared_td.lazy_stack(rows, 0).unbind(1)], 1)  # stack dim 1
    out = torch.stack([a, b], 0)
    assert torch.equal(out["c"], torch.stack([a["c"], b["c"]], 0))
    out["c"] += 1
    assert torch.equal(a["c"], torch.stack([r["c"] for r in rows])) and rows[0]["c"][0].item() == 0.0


@pytest.mark.parametrize("L", LIBS)
@pytest.mark.parametrize("order", ["lazy first", "dense first"])
def test_stack_of_lazy_and_dense_items_is_dense(L, order):
    items = [two_member_stack(L, 1.0, 2.0), torch.stack([member(L, 3.0), member(L, 4.0)])]
    items = items if order == "lazy first" else items[::-1]
    out = torch.stack(items, 1)
    assert type(out).__name__ == "TensorDict"
    assert torch.equal(out["c"], torch.stack([item["c"] for item in items], 1))
    out["c"] += 1
    assert items[0]["c"].sum().item() in (6.0, 14.0)  # unchanged


@pytest.mark.parametrize("L", LIBS)
def test_stack_of_tensordicts_holding_lazy_stacks_shares_nothing(L):
    inner = two_member_stack(L)
    outer = L.TensorDict({"n": inner}, [2])
    out = torch.stack([outer, outer.clone()], 0)
    out["n", "c"] += 1
    assert inner["c"].sum().item() == 0.0


@pytest.mark.parametrize("L", LIBS)
def test_stack_out_of_lazy_stacks_is_written(L):
    out = torch.stack([two_member_stack(L), two_member_stack(L)], 0)
    result = torch.stack([two_member_stack(L, 1.0, 2.0), two_member_stack(L, 3.0, 4.0)], 0, out=out)
    assert result is out
    assert out["c"][:, :, 0].tolist() == [[1.0, 2.0], [3.0, 4.0]]


@pytest.mark.parametrize("L", LIBS)
def test_torch_stack_of_lazy_stacks_whose_elements_differ_raises(L):
    ragged = L.lazy_stack([member(L), L.TensorDict({"c": torch.zeros(2, 3)}, [2])])
    with pytest.raises(RuntimeError):
        torch.stack([ragged, ragged[[1, 0]]], 0)
    with pytest.raises(RuntimeError):  # member keys that differ
        torch.stack([L.lazy_stack([member(L), L.TensorDict({"c": torch.zeros(2), "d": torch.zeros(2)}, [2])]),
                     L.lazy_stack([L.TensorDict({"c": torch.zeros(2), "d": torch.zeros(2)}, [2]), member(L)])], 0)


@pytest.mark.parametrize("L", LIBS)
def test_maybe_dense_stack_of_lazy_stacks_whose_elements_differ_stays_lazy(L):
    with_d = L.TensorDict({"c": torch.zeros(2), "d": torch.zeros(2)}, [2])
    out = L.maybe_dense_stack([L.lazy_stack([member(L), with_d]), L.lazy_stack([with_d.clone(), member(L)])], 0)
    assert type(out).__name__ == "LazyStackedTensorDict" and out.batch_size == torch.Size([2, 2, 2])
    assert [sorted(m.keys()) for m in out.tensordicts[0].tensordicts] == [["c"], ["c", "d"]]


def test_lazy_stack_of_lazy_stacks_still_shares_them():
    a = two_member_stack(shared_td)
    out = shared_td.lazy_stack([a, a.clone()], 0)
    assert out.tensordicts[0] is a  # by design: lazy_stack keeps its items


# ---------------------------------------------------------------- A7/A8: an empty selection keeps structure
def no_member_indexes(n):
    return [slice(n, None), torch.zeros(n, dtype=torch.bool)]


def tree(value):
    """Class names, batch sizes and keys, node by node."""
    out = {"class": type(value).__name__, "batch": list(value.batch_size)}
    for key in value.keys():
        entry = value.get(key)
        if isinstance(entry, torch.Tensor):
            out[key] = list(entry.shape)
        elif type(entry).__name__.startswith("NonTensor"):
            out[key] = ("non-tensor", list(entry.batch_size))
        else:
            out[key] = tree(entry)
    return out


@pytest.mark.parametrize("L", LIBS)
@pytest.mark.parametrize("which", [0, 1], ids=["slice", "all-False mask"])
def test_no_member_selection_keeps_nested_tensordicts_without_leaves(L, which):
    lz = L.lazy_stack([L.TensorDict({"a": L.TensorDict(), "b": L.TensorDict({"e": L.TensorDict()}),
                                     "c": torch.zeros(3)}) for _ in range(2)])
    got = tree(lz[no_member_indexes(2)[which]])
    assert got == {"class": "TensorDict", "batch": [0], "c": [0, 3],
                   "a": {"class": "TensorDict", "batch": [0]},
                   "b": {"class": "TensorDict", "batch": [0], "e": {"class": "TensorDict", "batch": [0]}}}


@pytest.mark.parametrize("L", LIBS)
def test_no_member_selection_keeps_the_extra_batch_dims_of_nested_tensordicts(L):
    one = L.TensorDict({"a": L.TensorDict({"x": torch.zeros(3, 4), "e": L.TensorDict({}, [3, 4])}, [3])})
    got = tree(L.lazy_stack([one, one.clone()])[torch.zeros(2, dtype=torch.bool)])
    assert got["a"] == {"class": "TensorDict", "batch": [0, 3], "x": [0, 3, 4],
                        "e": {"class": "TensorDict", "batch": [0, 3, 4]}}


@pytest.mark.parametrize("L", LIBS)
@pytest.mark.parametrize("which", [0, 1], ids=["slice", "all-False mask"])
def test_no_member_selection_keeps_a_nested_tensorclass(L, which):
    point = point_class(L)(x=torch.zeros(2), label="p", batch_size=[])
    lz = L.lazy_stack([L.TensorDict({"b": point.clone(), "t": torch.ones(())}) for _ in range(2)])
    got = lz[no_member_indexes(2)[which]].get("b")
    assert isinstance(got, point_class(L))
    assert got.batch_size == torch.Size([0]) and got.x.shape == torch.Size([0, 2])


# ---------------------------------------------------------------- A11: split / chunk of an empty dim
@pytest.mark.parametrize("L", LIBS)
@pytest.mark.parametrize("op, arg", [("split", 2), ("split", 1), ("split", [0, 0]), ("chunk", 1),
                                     ("chunk", 2), ("chunk", 3)])
@pytest.mark.parametrize("shape, dim", [((0,), 0), ((3, 0), 1), ((0, 2), 0)])
def test_split_and_chunk_of_an_empty_batch_dim_give_torch_pieces(L, op, arg, shape, dim):
    leaf = torch.zeros(*shape, 5)
    td = L.TensorDict({"a": leaf}, list(shape))
    expected = [tuple(piece.shape[:-1]) for piece in getattr(leaf, op)(arg, dim)]
    assert [tuple(piece.batch_size) for piece in getattr(td, op)(arg, dim)] == expected
    assert [tuple(piece.batch_size) for piece in getattr(torch, op)(td, arg, dim)] == expected


def test_split_of_an_empty_dim_of_a_lazy_stack_gives_one_piece():
    lz = shared_td.lazy_stack([shared_td.TensorDict({"a": torch.zeros(0, 2)}, [0])] * 2)
    assert [tuple(p.batch_size) for p in lz.split(2, 1)] == [(2, 0)]
    assert [tuple(p.batch_size) for p in lz.chunk(2, 1)] == [(2, 0), (2, 0)]


# ---------------------------------------------------------------- B1: 0-d expand / reshape / view
@pytest.mark.parametrize("L", LIBS)
@pytest.mark.parametrize("op", ["expand", "reshape", "view"])
@pytest.mark.parametrize("args", [(), ((),), (torch.Size([]),)])
def test_zero_dim_tensordict_to_its_own_empty_batch_size(L, op, args):
    if op != "expand" and not args:
        pytest.skip("reshape() and view() need a shape")
    td = L.TensorDict({"c": torch.zeros(()), "n": L.TensorDict({"d": torch.ones(2)})})
    out = getattr(td, op)(*args)
    assert out.batch_size == torch.Size([]) and out["n", "d"].tolist() == [1.0, 1.0]


@pytest.mark.parametrize("L", LIBS)
def test_expand_still_adds_leading_dims(L):
    td = L.TensorDict({"c": torch.zeros(()), "r": torch.arange(3.0)})
    assert td.expand(2)["r"].shape == torch.Size([2, 3])
    assert td.expand(torch.Size([2, 1])).batch_size == torch.Size([2, 1])


@pytest.mark.parametrize("L", LIBS)
def test_lazy_write_of_zero_dim_members_through_a_repeated_index(L):
    lz = L.lazy_stack([L.TensorDict({"c": torch.zeros(())})])
    lz[[0, 0]] = L.lazy_stack([L.TensorDict({"c": torch.ones(())})])
    assert lz["c"].tolist() == [1.0]


def test_stack_of_lazy_stacks_keeps_their_dim_names():
    # (README: torch.stack of lazy stacks keeps the stack dim's name; tensordict drops it)
    a = shared_td.lazy_stack([shared_td.TensorDict({"c": torch.zeros(2)}, [2], names=["x"])] * 2,
                             stack_dim_name="s")
    assert torch.stack([a, a.clone()], 0).names == [None, "s", "x"]
    assert torch.stack([a, a.clone()], 2).names == ["s", "x", None]


@pytest.mark.parametrize("L", LIBS)
@pytest.mark.parametrize("reshape", [lambda lz: lz.reshape(-1), lambda lz: lz.view(0, 2), lambda lz: lz.flatten(),
                                     lambda lz: lz.reshape(0, 5)], ids=["reshape-1", "view", "flatten", "reshape0x5"])
def test_a_reshape_of_a_lazy_stack_with_no_element_keeps_its_entries(L, reshape):
    """A lazy stack whose batch holds a 0, reshaped (view, flatten): an empty TensorDict
    with the entries every member has, as an index that keeps no member gives (it was a
    lazy stack with no key, silently; found by the fuzzer's second round)."""
    lz = L.lazy_stack([L.TensorDict(a=torch.zeros(0, 2), n=L.TensorDict(b=torch.zeros(0), batch_size=[0]), s="x",
                                    batch_size=[0]) for _ in range(2)])
    out = reshape(lz)
    assert sorted(map(str, out.keys(True))) == ["('n', 'b')", "a", "n", "s"]
    assert out["a"].shape == (*out.batch_size, 2) and out["n", "b"].shape == out.batch_size


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("reps", [1, 2])
def test_repeat_keeps_a_ragged_lazy_stack_that_the_members_of_a_lazy_stack_hold(lib, nested, reps):
    # shared_td asked the outer stack for the stacked leaf to find ragged ones, which for a
    # stack held by its members raised "Failed to stack tensors" instead
    def ragged():
        return lib.lazy_stack([lib.TensorDict({"a": torch.zeros(n)}, batch_size=[]) for n in (2, 3)], 0)

    outer = lib.lazy_stack([lib.TensorDict({"rg": ragged()}, batch_size=[]) for _ in range(2)], 0)
    root = lib.TensorDict({"rgn": outer}, batch_size=[2]) if nested else outer
    out = root.repeat(reps)
    node = out["rgn"] if nested else out
    assert tuple(node.batch_size) == (2 * reps,)
    assert [tuple(m["a"].shape) for m in node[-1]["rg"].tensordicts] == [(2,), (3,)]
