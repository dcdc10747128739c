"""Dense TensorDict behaviours found by running tensordict's own method tests against
shared_td (round 3), side by side with tensordict 0.15.3: comparing with a value of
another type, writing rows from a tensordict of the rows' last dims, ``update(clone=)``,
``reshape(size=)``, the dict methods ``clear``/``popitem``, ``create_nested``,
``to_lazystack``, ``copy_at_``, ``torch.masked_select``, ``set_at_`` of an array, and
keys added inside ``with td.flatten_keys(sep) as flat:``."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import shared_td
from tests.reference import LIBS, dim_names

def grid(lib):
    return lib.TensorDict(
        {"a": torch.ones(4, 3, 5), "nested": {"x": torch.ones(4, 3)}}, batch_size=[4, 3]
    )


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("other", ["z", None, [0, 0], np.zeros(2)], ids=["str", "none", "list", "array"])
def test_compare_with_another_type(lib, other):
    # tensordict compares leaf by leaf only with a tensordict, a tensor or a number
    td = lib.TensorDict(a=torch.zeros(2), batch_size=[2])
    assert (td == other) is False
    assert (td != other) is True
    assert not td == other
    assert (td == 0).all() and (td != 1.5).all()


@pytest.mark.parametrize("lib", LIBS)
def test_bool_message(lib):
    with pytest.raises(RuntimeError, match="Converting a tensordict to boolean value is not permitted"):
        bool(grid(lib))


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize(
    "index,src_batch,fits",
    [
        ((slice(0, 1),), [3], True),  # td[:1] = td[0]: expanded along the leading dim
        ((slice(0, 2),), [3], True),
        ((slice(0, 2), 0), [], False),  # (tensordict does not expand a 0-dim source)
        ((slice(0, 2),), [1, 3], False),  # a batch of 1 is not repeated
        ((slice(0, 2),), [3, 3], False),
        ((0,), [1, 3], False),
    ],
)
def test_rows_written_from_their_last_dims(lib, index, src_batch, fits):
    td = grid(lib)
    src = lib.TensorDict(
        {"a": torch.zeros(*src_batch, 5), "nested": {"x": torch.zeros(src_batch)}}, batch_size=src_batch
    )
    if not fits:
        with pytest.raises(RuntimeError, match="differs from the source batch size"):
            td[index] = src
        assert (td == 1).all()
        return
    td[index] = src
    assert (td[index] == 0).all()
    assert td["a"].sum() == 60 - td["a"][index].numel()


@pytest.mark.parametrize("lib", LIBS)
def test_rows_written_from_entries_that_fit(lib):
    # a source whose entries start with the rows' batch size is taken with that size
    td = grid(lib)
    src = lib.TensorDict({"a": torch.zeros(2, 3, 5), "nested": {"x": torch.zeros(2, 3)}}, batch_size=[])
    td[:2] = src
    assert (td[:2] == 0).all() and (td[2:] == 1).all()
    assert src.batch_size == ()  # (a shallow copy took the rows' batch size)


@pytest.mark.parametrize("lib", LIBS)
def test_update_clone(lib):
    src = lib.TensorDict(a=torch.zeros(2), nested={"b": torch.zeros(2)}, batch_size=[2])
    for args, kwargs in (((), {"clone": True}), ((True,), {})):
        td = lib.TensorDict(batch_size=[2]).update(src, *args, **kwargs)
        assert td["a"] is not src["a"] and td["nested", "b"] is not src["nested", "b"]
        assert (td == src).all()
    assert lib.TensorDict(batch_size=[2]).update(src)["a"] is src["a"]
    lazy = lib.lazy_stack([lib.TensorDict(a=torch.ones(3)) for _ in range(2)])
    lazy.update(lib.TensorDict(x=torch.ones(2, 3), batch_size=[2]), clone=True)
    assert lazy["x"].shape == (2, 3)


@pytest.mark.parametrize("lib", LIBS)
def test_reshape_size_keyword(lib):
    td = grid(lib)
    assert td.reshape(size=(-1,)).batch_size == (12,)
    assert td.reshape(size=td.shape).batch_size == (4, 3)
    assert td.view(size=(2, 6)).batch_size == (2, 6)
    lazy = lib.lazy_stack([td[0], td[1]])
    assert lazy.reshape(size=(-1,)).batch_size == (6,)


@pytest.mark.parametrize("lib", LIBS)
def test_dict_methods(lib):
    td = lib.TensorDict(a=torch.zeros(2), b=torch.ones(2), batch_size=[2])
    key, value = td.popitem()
    assert key == "b" and (value == 1).all() and list(td.keys()) == ["a"]
    td.lock_()
    with pytest.raises(RuntimeError, match="Cannot modify locked TensorDict"):
        td.clear()
    with pytest.raises(RuntimeError, match="Cannot modify locked TensorDict"):
        td.popitem()
    td.unlock_()
    assert td.clear() is td and td.is_empty()
    with pytest.raises(KeyError):
        td.popitem()
    assert td.ndimension() == 1


@pytest.mark.parametrize("lib", LIBS)
def test_create_nested_and_entry_class(lib):
    td = lib.TensorDict(a=torch.zeros(2, 3), batch_size=[2, 3], names=["x", "y"])
    assert td.create_nested(("s", "t")) is td
    assert td["s", "t"].batch_size == (2, 3) and td["s"].names == ["x", "y"]
    assert td.entry_class("a") is torch.Tensor
    assert td.entry_class(("s", "t")) is type(td)
    with td.lock_(), pytest.raises(RuntimeError):
        td.create_nested("root")
    lazy = lib.lazy_stack([lib.TensorDict(a=torch.zeros(3), batch_size=[3]) for _ in range(2)])
    lazy.create_nested("q")
    assert lazy["q"].batch_size == (2, 3)
    assert lazy.entry_class("q") is type(lazy)


@pytest.mark.parametrize("lib", LIBS)
def test_to_lazystack(lib):
    td = grid(lib)
    lazy = td.to_lazystack(1)
    assert isinstance(lazy, lib.LazyStackedTensorDict)
    assert lazy.stack_dim == 1 and lazy.batch_size == td.batch_size
    assert (lazy == td).all()
    assert lazy.to_lazystack(1) is lazy
    named = lib.TensorDict(a=torch.zeros(2, 3), batch_size=[2, 3], names=["x", "y"])
    # shared_td keeps every name; tensordict 0.15.3 drops the stack dim's
    expected = ["x", "y"] if lib is shared_td else ["x", None]
    assert named.to_lazystack(1).names == expected


@pytest.mark.parametrize("lib", LIBS)
def test_copy_at_and_masked_select(lib):
    td = grid(lib)
    td.copy_at_(lib.TensorDict({"a": torch.zeros(3, 5), "nested": {"x": torch.zeros(3)}}, [3]), 1, fast=False)
    assert (td[1] == 0).all() and (td[0] == 1).all()
    mask = torch.tensor([True, False, True, False])
    picked = torch.masked_select(td, mask)
    assert picked.batch_size == (2, 3) and (picked == td[mask]).all()


@pytest.mark.parametrize("lib", LIBS)
def test_set_at_array(lib):
    td = lib.TensorDict(k=torch.zeros(4, 3, 5, dtype=torch.float64), batch_size=[4, 3])
    td.set_at_("k", np.full(5, 42.0), (2, 2))
    assert (td["k"][2, 2] == 42).all() and td["k"].sum() == 42 * 5


@pytest.mark.parametrize("lib", LIBS)
def test_set_missing_key_message(lib):
    with pytest.raises(KeyError, match=r"key.*smartypants.*not found in "):
        grid(lib).set_("smartypants", torch.zeros(4, 3))


@pytest.mark.parametrize("lib", LIBS)
def test_transpose_out_of_range_message(lib):
    with pytest.raises(ValueError, match="dim0 and dim1 must be within the range of the number of dimensions"):
        grid(lib).transpose(-5, -6)


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("stacked", [False, True])
def test_keys_added_in_flatten_keys_block(lib, stacked):
    td = grid(lib)
    if stacked:
        td = lib.lazy_stack([td[0], td[1]], 0)
    with td.flatten_keys(",") as flat:
        with flat.unflatten_keys(",") as restored:
            assert (restored == td).all()
            restored["new", "data"] = torch.zeros(restored.shape)
        assert (flat["new,data"] == 0).all()
        flat["other,leaf"] = torch.ones(flat.shape)
    assert (td["new", "data"] == 0).all() and (td["other", "leaf"] == 1).all()
    # a locked tensordict is left as it is
    locked = grid(lib).lock_()
    with locked.flatten_keys(",") as flat:
        assert dim_names(flat) is None
    assert sorted(locked.keys(True, True), key=str) == [("nested", "x"), "a"]


def test_flattened_tensordict_still_pickles():
    import pickle

    flat = grid(shared_td).flatten_keys()
    assert (pickle.loads(pickle.dumps(flat)) == flat).all()


@pytest.mark.parametrize("lib", LIBS)
def test_stack_and_cat_tensors(lib):
    td = lib.TensorDict(a=torch.zeros(2, 3), b=torch.ones(2, 3), batch_size=[2])
    td.stack_tensors("a", "b", out_key="ab", dim=-1, keep_entries=True)
    assert td["ab"].shape == (2, 3, 2) and "a" in td
    td.cat_tensors("a", "b", out_key=("n", "c"), dim=1)
    assert td["n", "c"].shape == (2, 6) and "a" not in td and "b" not in td
    with td.lock_(), pytest.raises(RuntimeError):
        td.stack_tensors("ab", "ab", out_key="x")
    assert "ab" in td


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("stacked", [False, True])
def test_new_tensordicts_and_repeats(lib, stacked):
    td = grid(lib)
    td["a"] = torch.arange(60.0).reshape(4, 3, 5)
    if stacked:
        td = lib.lazy_stack([td[0], td[1]], 0)
    batch = td.batch_size
    for made, fill in ((td.new_zeros(2, 5), 0), (td.new_ones([2, 5]), 1), (td.new_full((2, 5), 7), 7)):
        assert made.batch_size == (2, 5) and made["a"].shape == (2, 5, 5) and (made == fill).all()
    assert td.new_empty(0).batch_size == (0,) and td.new_zeros(2, dtype=torch.int16)["a"].dtype == torch.int16
    assert (td.repeat(2, 1) == torch.cat([td] * 2, 0)).all()
    assert (td.repeat(1, 2) == torch.cat([td] * 2, 1)).all()
    for dim in (0, 1, -1):
        out = td.repeat_interleave(2, dim=dim)
        assert out.batch_size == torch.empty(batch).repeat_interleave(2, dim=dim).shape
        assert torch.equal(out["a"], td["a"].repeat_interleave(2, dim=dim % 2))
    assert td.repeat_interleave(3).batch_size == (batch.numel() * 3,)
    counts = torch.arange(batch[0]) + 1
    assert td.repeat_interleave(counts, dim=0).batch_size == (int(counts.sum()), batch[1])


@pytest.mark.parametrize("lib", LIBS)
def test_expand_as(lib):
    td0 = lib.TensorDict({"a": torch.ones(3, 1, 4), "b": {"c": torch.ones(3, 2, 1, 4)}}, batch_size=[3])
    td1 = lib.TensorDict({"a": torch.zeros(2, 3, 5, 4), "b": {"c": torch.zeros(2, 3, 2, 6, 4)}}, batch_size=[2, 3])
    expanded = td0.expand_as(td1)
    assert expanded.batch_size == (2, 3) and (expanded == 1).all()
    assert expanded["b", "c"].shape == (2, 3, 2, 6, 4)


@pytest.mark.parametrize("lib", LIBS)
def test_consolidated_storage(lib):
    td = lib.TensorDict({"a": torch.ones(2), "b": {"c": torch.ones(2, 3)}}, batch_size=[2])
    td_c = td.consolidate()
    storage = td_c._consolidated["storage"]
    storage *= 0  # the one buffer the leaves view
    assert (td_c == 0).all() and (td == 1).all()


@pytest.mark.parametrize("lib", LIBS)
def test_batch_mismatch_message(lib):
    with pytest.raises(RuntimeError, match="batch dimension mismatch"):
        lib.TensorDict({"x": torch.zeros(3), "bad": torch.zeros(2, 4)}, [3])


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("index", [np.True_, (slice(None), np.False_)], ids=["true", "false"])
def test_numpy_bool_index_message(lib, index):
    td = lib.TensorDict({"a": torch.zeros(3, 4)}, [3, 4])
    with pytest.raises(IndexError, match="NumPy bool"):
        td[index]
    with pytest.raises(IndexError, match="NumPy bool"):
        td[index] = 1.0
    assert (td["a"] == 0).all()


@pytest.mark.parametrize("lib", LIBS)
def test_flatten_and_unflatten_key_collisions(lib):
    td = lib.TensorDict({"a,b,c": torch.zeros(3), "a": {"b": {"c": torch.zeros(3)}}}, [])
    with pytest.raises(KeyError, match="Flattening keys in tensordict causes keys"):
        td.flatten_keys(",")
    with pytest.raises(KeyError, match=r"Unflattening key\(s\) in tensordict will override"):
        td.unflatten_keys(",")
    under_a_leaf = lib.TensorDict({"a,b,c,d": torch.zeros(3), "a": {"b": {"c": torch.zeros(3)}}}, [])
    with pytest.raises(KeyError, match=r"Unflattening key\(s\) in tensordict will override"):
        under_a_leaf.unflatten_keys(",")
    beside = lib.TensorDict({"a,b": torch.zeros(3), "a,c": torch.ones(3), "x": torch.zeros(3)}, [])
    assert set(beside.unflatten_keys(",").keys(True, True)) == {("a", "b"), ("a", "c"), "x"}
