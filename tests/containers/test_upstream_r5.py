"""Fifth pass over tensordict's own tests (session 18's regression pass), each finding as
the same code run on shared_td and on tensordict 0.15.3: the tests that passed on shared_td
in an earlier pass and failed again after later changes (new_* of a tree holding a
tensorclass), then differences that pass found: comparing (a tensorclass's None fields
against the None entries of its ``to_dict()``; non-tensor entries of other batch sizes),
``lazy[idx] = source`` with a source batch size that broadcasts to the rows, and the
batch-size errors (their words, a lazy stack's batch_size setter)."""
from __future__ import annotations

import re
from typing import Any

import pytest
import torch

import shared_td
from tests.reference import LIBS, tensordict

# ----------------------------------------- new_* of a tensorclass, alone or nested
def _episode(lib, batch_size=(4, 3)):
    @lib.tensorclass
    class Episode:
        obs: torch.Tensor
        inner: Any
        label: str

    inner = Episode(obs=torch.ones(batch_size), inner=None, label=None, batch_size=batch_size)
    return Episode(obs=torch.ones(batch_size), inner=inner, label="run-1", batch_size=batch_size)


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("method, args, fill", [
    ("new_zeros", (2, 5), 0.0), ("new_ones", (2, 5), 1.0), ("new_full", ([2, 5], 7.0), 7.0),
    ("new_empty", (2, 5), None),
])
def test_new_tensors_of_a_tree_holding_a_tensorclass(lib, method, args, fill):
    # (the nested tensorclass raised AttributeError: a tensorclass has no _map_entries)
    td = lib.TensorDict(a=torch.ones(4, 3, 2), ep=_episode(lib), batch_size=[4, 3])
    out = getattr(td, method)(*args)
    assert out.batch_size == torch.Size([2, 5])
    ep = out["ep"]
    assert type(ep).__name__ == "Episode" and type(ep.inner).__name__ == "Episode"
    assert ep.batch_size == ep.inner.batch_size == torch.Size([2, 5])
    assert ep.obs.shape == ep.inner.obs.shape == (2, 5)
    assert ep.label == "run-1"  # a tensorclass's Python field is kept
    if fill is not None:
        assert (ep.obs == fill).all() and (out["a"] == fill).all()


@pytest.mark.parametrize("lib", LIBS)
def test_new_zeros_of_a_tensorclass_alone(lib):
    ep = _episode(lib).new_zeros(2)
    assert type(ep).__name__ == "Episode" and ep.batch_size == torch.Size([2])
    assert ep.obs.tolist() == [0.0, 0.0] and ep.inner.obs.tolist() == [0.0, 0.0]
    assert ep.label == "run-1"


# ------------------- comparing a tree holding a tensorclass with its to_dict / from_dict
def _tree(lib):
    return lib.TensorDict(a=torch.ones(2), ep=_episode(lib, [2]), batch_size=[2])


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("build, order", [
    ("dict", "tree-first"), ("TensorDict", "tree-first"), ("TensorDict", "copy-first"),
    ("from_dict", "tree-first"), ("from_dict", "copy-first"),
])
def test_a_tensorclass_none_field_equals_the_none_of_its_dict(lib, build, order):
    # (the None fields ("inner", "label" of the inner episode), absent from the
    # tensorclass and None entries of the copy, made a KeyError: different keys)
    tree = _tree(lib)
    copy = {"dict": lambda d: d, "TensorDict": lambda d: lib.TensorDict(d, batch_size=[2]),
            "from_dict": lambda d: lib.TensorDict.from_dict(d, auto_batch_size=False)}[build](tree.to_dict())
    assert (tree == copy).all() if order == "tree-first" else (copy == tree).all()
    changed = tree.to_dict()
    changed["ep"]["obs"] = torch.zeros(2)
    assert not (tree == changed).all()


@pytest.mark.parametrize("lib", LIBS)
def test_a_none_entry_against_a_missing_key_is_still_a_key_error(lib):
    # (only a tensorclass's None field is excused; two tensordicts still must have the same keys)
    plain = lib.TensorDict(a=torch.ones(2), batch_size=[2])
    with pytest.raises(KeyError):
        plain == lib.TensorDict(a=torch.ones(2), n=None, batch_size=[2])


@pytest.mark.parametrize("lib", LIBS)
def test_non_tensor_data_of_other_batch_sizes_compare_their_values(lib):
    # (a NonTensorData of batch [] against one of batch [2] raised torch's expand error)
    one, two = lib.NonTensorData("x", batch_size=[]), lib.NonTensorData("x", batch_size=[2])
    assert (one == two).shape == () and bool(one == two)
    assert (two == one).tolist() == [True, True]
    assert (two == lib.NonTensorData("y", batch_size=[])).tolist() == [False, False]


# --------------------- lazy[idx] = source: a source batch size that broadcasts to the rows
def _lazy(lib, member_batch):
    return lib.LazyStackedTensorDict(
        *[lib.TensorDict(a=torch.full(member_batch, float(i)), batch_size=member_batch) for i in range(2)],
        stack_dim=0)


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("member_batch, index, source_batch, expected", [
    ((3,), slice(None), [1, 3], [[5.0] * 3] * 2),
    ((3,), slice(None), [2, 1], [[5.0] * 3] * 2),
    ((3,), slice(None), [1], [[5.0] * 3] * 2),
    ((3,), (slice(None), slice(0, 2)), [2, 1], [[5.0, 5.0, 0.0], [5.0, 5.0, 1.0]]),
    ((3,), 0, [1], [[5.0] * 3, [1.0] * 3]),
    ((3,), torch.tensor([True, False]), [1, 1], [[5.0] * 3, [1.0] * 3]),
    ((3,), False, [1, 3], [[0.0] * 3, [1.0] * 3]),  # no rows: nothing written
    ((), torch.tensor(False), [1, 2], [0.0, 1.0]),
    ((), slice(None), [1], [5.0, 5.0]),
])
def test_lazy_setitem_broadcasts_the_source_batch_size(lib, member_batch, index, source_batch, expected):
    # (only a source of batch size [] was broadcast; these raised BatchSizeMismatchError)
    lazy = _lazy(lib, member_batch)
    lazy[index] = lib.TensorDict(a=torch.full(source_batch, 5.0), batch_size=source_batch)
    assert lazy["a"].tolist() == expected


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("index, source_batch", [
    (slice(None), [3, 3]), (torch.tensor([False, False]), [7]), (False, [1, 2]),
])
def test_lazy_setitem_refuses_a_source_that_does_not_broadcast(lib, index, source_batch):
    lazy = _lazy(lib, (3,))
    with pytest.raises(RuntimeError):
        lazy[index] = lib.TensorDict(a=torch.full(source_batch, 5.0), batch_size=source_batch)
    assert lazy["a"].tolist() == [[0.0] * 3, [1.0] * 3]


@pytest.mark.parametrize("lib", LIBS)
def test_dense_setitem_still_refuses_a_broadcasting_source(lib):
    # (tensordict's TensorDict does not broadcast so; its lazy stack does)
    td = lib.TensorDict(a=torch.zeros(2, 3), batch_size=[2, 3])
    with pytest.raises(RuntimeError):
        td[:] = lib.TensorDict(a=torch.full((1, 3), 5.0), batch_size=[1, 3])


# ------------ batch-size errors that code written for tensordict matches on (its words)
@pytest.mark.parametrize("lib", LIBS)
def test_resetting_batch_size_names_the_leaf_as_tensordict_does(lib):
    td = lib.TensorDict(a=torch.zeros(3, 4, 5, 6), batch_size=[3, 4])
    with pytest.raises(RuntimeError, match=re.escape(
            "the Tensor a has shape torch.Size([3, 4, 5, 6]) which is incompatible with the batch-size "
            "torch.Size([3, 5]).")):
        td.batch_size = [3, 5]
    assert td.batch_size == torch.Size([3, 4])


@pytest.mark.parametrize("lib", LIBS)
def test_setting_a_value_of_other_leading_dims_says_both_shapes(lib):
    td = lib.TensorDict(a=torch.zeros(3, 4, 5), batch_size=[3, 4, 5])
    with pytest.raises(RuntimeError, match=re.escape(
            "batch dimension mismatch, got self.batch_size=torch.Size([3, 4, 5]) and "
            "value.shape=torch.Size([3, 4, 2])")):
        td.set("d", torch.zeros(3, 4, 2))
    assert "d" not in td.keys()


@pytest.mark.parametrize("lib", LIBS)
def test_too_many_indices_says_so_as_torch_does(lib):
    td = lib.TensorDict(a=torch.zeros(3), batch_size=[3])
    with pytest.raises(IndexError, match=re.escape("too many indices for tensor of dimension 1")):
        td[:, 0]


@pytest.mark.parametrize("lib", LIBS)
def test_a_lazy_stack_batch_size_can_be_set_to_itself_only(lib):
    # (another size raised AttributeError: the property had no setter)
    lazy = lib.lazy_stack([lib.TensorDict(a=torch.zeros(3), batch_size=[3]) for _ in range(2)])
    lazy.batch_size = [2, 3]
    assert lazy.batch_size == torch.Size([2, 3])
    with pytest.raises(RuntimeError, match="Modifying the batch size of a lazy representation"):
        lazy.batch_size = [2]
    assert lazy.batch_size == torch.Size([2, 3])
    lazy.to_tensordict().batch_size = [2]  # (what the message says to do)


# --------------------- stack(..., out=): the non-tensor entries of out are replaced
def _stack_out(lib, how, values, out_value, locked=False):
    items = [lib.TensorDict(a=torch.full((3,), float(i)), tag=v, batch_size=[3]) for i, v in enumerate(values)]
    out = lib.TensorDict(a=torch.zeros(2, 3), tag=lib.NonTensorData(out_value, batch_size=[2, 3]), batch_size=[2, 3])
    if locked:
        out.lock_()
    storage = out["a"].data_ptr()
    if how == "torch.stack":
        result = torch.stack(items, 0, out=out)
    else:
        result = lib.LazyStackedTensorDict.lazy_stack(items, 0, out=out)
    assert result is out and out["a"].data_ptr() == storage  # the tensors written in place
    return out


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("how", ["torch.stack", "lazy_stack"])
@pytest.mark.parametrize("values", [("walk", "walk"), ("run", "run"), ("walk", "run")])
def test_stack_into_out_replaces_its_non_tensor_entries(lib, how, values):
    # (a NonTensorStack cannot be written in place into out's NonTensorData: this raised
    # ValueError, before which the tensors were written)
    out = _stack_out(lib, how, values, "walk")
    assert out["a"][:, 0].tolist() == [0.0, 1.0]
    assert [row[0] for row in out["tag"]] == list(values)


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("how", ["torch.stack", "lazy_stack"])
def test_stack_into_a_locked_out_with_non_tensor_entries_is_refused_before_writing(lib, how):
    with pytest.raises(RuntimeError, match="Cannot modify locked TensorDict"):
        _stack_out(lib, how, ("walk", "walk"), "walk", locked=True)


def test_stack_into_a_locked_out_writes_nothing_when_refused():
    # (shared_td only: tensordict 0.15.3 writes the tensors before it raises)
    lib = shared_td
    items = [lib.TensorDict(a=torch.ones(3), tag="run", batch_size=[3]) for _ in range(2)]
    out = lib.TensorDict(a=torch.zeros(2, 3), tag=lib.NonTensorData("walk", batch_size=[2, 3]),
                         batch_size=[2, 3]).lock_()
    with pytest.raises(RuntimeError):
        torch.stack(items, 0, out=out)
    assert (out["a"] == 0).all() and out["tag"] == "walk"


def test_stack_into_an_out_with_a_locked_nested_node_writes_nothing_when_refused():
    # the locked node holding the replaced entry may be nested in an unlocked out
    lib = shared_td
    items = [lib.TensorDict(a=torch.ones(3), n=lib.TensorDict(tag="run", batch_size=[3]), batch_size=[3])
             for _ in range(2)]
    out = lib.TensorDict(a=torch.zeros(2, 3), n=lib.TensorDict(tag=lib.NonTensorData("walk", batch_size=[2, 3]),
                                                               batch_size=[2, 3]), batch_size=[2, 3])
    out["n"].lock_()
    with pytest.raises(RuntimeError, match="Cannot modify locked TensorDict"):
        torch.stack(items, 0, out=out)
    assert (out["a"] == 0).all() and out["n", "tag"] == "walk"


@pytest.mark.parametrize("lib", LIBS)
def test_cat_into_out_still_writes_a_non_tensor_entry_in_place(lib):
    # (torch.cat's out= writes the entry, as tensordict's does: one same value fits)
    items = [lib.TensorDict(a=torch.full((2,), float(i)), tag="walk", batch_size=[2]) for i in range(2)]
    out = lib.TensorDict(a=torch.zeros(4), tag=lib.NonTensorData("walk", batch_size=[4]), batch_size=[4]).lock_()
    assert torch.cat(items, 0, out=out) is out
    assert out["a"].tolist() == [0.0, 0.0, 1.0, 1.0] and out["tag"] == "walk"


# ------------------ maybe_dense_stack: dense where the keys agree, lazy only below
def _kinds(value):
    return {key: type(value.get(key)).__name__ for key in value.keys()}


@pytest.mark.parametrize("lib", LIBS)
def test_maybe_dense_stack_is_dense_above_nested_tensordicts_that_differ(lib):
    # (a lazy stack came back at the top as soon as some nested key differed)
    TD = lib.TensorDict
    items = [TD(step=torch.tensor(1), obs=TD(pixels=torch.zeros(2))), TD(step=torch.tensor(2), obs=TD(depth=torch.zeros(2)))]
    out = lib.LazyStackedTensorDict.maybe_dense_stack(items)
    assert type(out).__name__ == "TensorDict" and out.batch_size == torch.Size([2])
    assert _kinds(out) == {"step": "Tensor", "obs": "LazyStackedTensorDict"}
    assert out["step"].tolist() == [1, 2]
    assert out["obs"].tensordicts[0]["pixels"].shape == (2,)


@pytest.mark.parametrize("lib", LIBS)
def test_maybe_dense_stack_goes_lazy_at_the_depth_where_they_differ(lib):
    TD = lib.TensorDict
    items = [TD(x=1, b=TD(c=1, e=TD(f=1))), TD(x=1, b=TD(c=1, e=TD(g=1)))]
    out = lib.LazyStackedTensorDict.maybe_dense_stack(items)
    assert type(out).__name__ == type(out["b"]).__name__ == "TensorDict"
    assert type(out["b"].get("e")).__name__ == "LazyStackedTensorDict"
    # nested shapes that differ: lazy there, dense above
    items = [TD(x=1, b=TD(c=torch.zeros(3))), TD(x=1, b=TD(c=torch.zeros(4)))]
    out = lib.LazyStackedTensorDict.maybe_dense_stack(items)
    assert _kinds(out) == {"x": "Tensor", "b": "LazyStackedTensorDict"}


@pytest.mark.parametrize("lib", LIBS)
def test_maybe_dense_stack_stays_lazy_when_keys_differ_at_the_top(lib):
    TD = lib.TensorDict
    out = lib.LazyStackedTensorDict.maybe_dense_stack([TD(x=1, y=2), TD(x=1, z=2)])
    assert type(out).__name__ == "LazyStackedTensorDict"
    out = lib.LazyStackedTensorDict.maybe_dense_stack([TD(x=torch.zeros(3), b=TD(c=1)), TD(x=torch.zeros(4), b=TD(d=1))])
    assert type(out).__name__ == "LazyStackedTensorDict"


@pytest.mark.parametrize("lib", LIBS)
def test_maybe_dense_stack_names_along_a_later_dim(lib):
    TD = lib.TensorDict
    items = [TD(x=torch.zeros(2), b=TD(c=torch.zeros(2), batch_size=[2]), batch_size=[2], names=["n"]),
             TD(x=torch.zeros(2), b=TD(d=torch.zeros(2), batch_size=[2]), batch_size=[2], names=["n"])]
    out = lib.LazyStackedTensorDict.maybe_dense_stack(items, 1)
    assert type(out).__name__ == "TensorDict" and out.batch_size == torch.Size([2, 2])
    assert out.names == ["n", None] and out.get("b").names == ["n", None]


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("how", ["torch.stack", "lazy_stack"])
def test_stack_into_out_holding_a_tensorclass_with_a_text_field(lib, how):
    # (the text field inside the nested tensorclass raised ValueError, as above)
    first = lib.TensorDict(a=torch.zeros(3), ep=_episode(lib, [3]), batch_size=[3])
    second = first.clone()
    second["a"] += 1
    out = first.unsqueeze(0).expand(2, 3).clone()
    storage = out["ep"].obs.data_ptr()
    stacker = torch.stack if how == "torch.stack" else lib.LazyStackedTensorDict.lazy_stack
    assert stacker([first, second], 0, out=out) is out
    assert out["a"][:, 0].tolist() == [0.0, 1.0] and out["ep"].obs.data_ptr() == storage


@pytest.mark.parametrize("write", [
    lambda td: td.set("b", torch.zeros(2)),
    lambda td: td.__delitem__("a"),
    lambda td: td.rename_key_("a", "c"),
    lambda td: td.update({"b": torch.zeros(2)}),
], ids=["set", "del", "rename", "update"])
def test_a_locked_write_is_refused_with_tensordicts_first_sentence(write):
    # code written for tensordict matches its sentence (its own tests do, with match=)
    sentence = "Cannot modify locked TensorDict. For in-place modification, consider using the `set_()` method"
    libraries = [shared_td] + ([tensordict] if tensordict is not None else [])
    for lib in libraries:
        td = lib.TensorDict(a=torch.zeros(2), batch_size=[2]).lock_()
        with pytest.raises(RuntimeError) as raised:
            write(td)
        assert str(raised.value).startswith(sentence), (lib.__name__, str(raised.value))


@pytest.mark.parametrize("dim", [0, 1, -1, -2])
def test_maybe_dense_stack_with_a_negative_dim_stacks_nested_tensordicts_at_the_same_dim(dim):
    # a negative dim counts from the items' batch; a nested tensordict's batch is longer
    def items(lib):
        return [lib.TensorDict({"x": torch.full((3,), float(i)),
                                "n": lib.TensorDict({key: torch.full((3, 4), float(i))}, [3, 4])}, [3])
                for i, key in enumerate("pq")]

    libraries = [shared_td] + ([tensordict] if tensordict is not None else [])
    for lib in libraries:
        stacked = lib.maybe_dense_stack(items(lib), dim)
        expected = [2, 3] if dim in (0, -2) else [3, 2]
        assert list(stacked.batch_size) == expected, lib.__name__
        assert list(stacked["n"].batch_size[:2]) == expected, lib.__name__
        row = stacked[1] if dim in (0, -2) else stacked[:, 1]
        assert bool((row["n", "q"] == 1).all()) and bool((row["x"] == 1).all()), lib.__name__
