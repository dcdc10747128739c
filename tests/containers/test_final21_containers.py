"""Final audit of session 21 (containers), side by side with tensordict 0.15.3 where it
makes sense: a lazy stack extended by its own members, sparse leaves and tensor-indexed
writes, device resets of a non-tensor, the torch-function and flatten_keys errors, the
record of a lazy stack's tensorclass members, apply with a nested lazy stack and update's
keywords."""
from __future__ import annotations

import gc
import json
import os
import pickle
import weakref

import pytest
import torch

import shared_td
from shared_td.containers.node_kinds import _members_as_given
from tests.reference import LIBS

@shared_td.tensorclass
class Pt:  # (module level: a pickle finds it)
    x: torch.Tensor


def _pair(lib):
    TD = lib.TensorDict
    return lib.LazyStackedTensorDict(TD(a=torch.zeros(2), batch_size=[2]), TD(a=torch.ones(2), batch_size=[2]))


# ---------------------------------------------------------------- (2) extend by its own members
@pytest.mark.timeout(10)
@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("source", ["members", "stack"])
def test_extend_by_its_own_members_ends(lib, source):
    # before: extend iterated the member list it grew, so lazy.extend(lazy.tensordicts) never ended
    lazy = _pair(lib)
    lazy.extend(lazy.tensordicts if source == "members" else lazy)
    assert len(lazy.tensordicts) == 4
    assert lazy["a"][:, 0].tolist() == [0.0, 1.0, 0.0, 1.0]


@pytest.mark.parametrize("bad", ["batch", "type"])
def test_extend_checks_every_item_before_adding_any(bad):
    lazy = _pair(shared_td)
    item = shared_td.TensorDict(a=torch.zeros(3), batch_size=[3]) if bad == "batch" else 5
    with pytest.raises((ValueError, TypeError)):
        lazy.extend([shared_td.TensorDict(a=torch.zeros(2), batch_size=[2]), item])
    assert len(lazy.tensordicts) == 2


# ---------------------------------------------------------------- (3) sparse leaf, tensor-indexed write
@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("layout", ["coo", "csr"])
@pytest.mark.parametrize("write", ["set_at_", "update_at_", "setitem"])
def test_a_sparse_leaf_does_not_break_tensor_indexed_writes_to_other_keys(lib, layout, write):
    # before: own_index read the storage of every leaf of the tree: NotImplementedError
    # "Cannot access storage of SparseTensorImpl"
    sparse = torch.eye(4).to_sparse() if layout == "coo" else torch.eye(4).to_sparse_csr()
    td = lib.TensorDict(a=torch.zeros(4), s=sparse, batch_size=[4])
    index = torch.tensor([0, 1])
    if write == "set_at_":
        td.set_at_("a", torch.ones(2), index)
    elif write == "update_at_":
        td.update_at_({"a": torch.ones(2)}, index)
    else:
        td.get("a")[index] = 1.0
    assert td["a"].tolist() == [1.0, 1.0, 0.0, 0.0]


def test_an_index_in_the_written_leaf_is_still_read_first():
    env = shared_td.TensorDict(done=torch.tensor([True, False]), obs=torch.ones(2), batch_size=[2])
    env.update_at_({"done": torch.tensor([False]), "obs": torch.zeros(1)}, env["done"])
    assert env["done"].tolist() == [False, False] and env["obs"].tolist() == [0.0, 1.0]
    env["done"][0] = True
    env.set_at_("done", torch.tensor([False]), env["done"])
    assert env["done"].tolist() == [False, False]


# ---------------------------------------------------------------- (4) device resets of a non-tensor
@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("kind", ["data", "stack"])
@pytest.mark.parametrize("reset", ["clear_device_", "auto_device_"])
def test_device_resets_of_a_non_tensor_container(lib, kind, reset):
    # before: AttributeError 'NonTensorData' object has no attribute '_tensordict'
    value = lib.NonTensorData("x", device="cpu") if kind == "data" else lib.NonTensorStack("x", "y").to("cpu")
    assert getattr(value, reset)() is value
    assert value.device is None


# ---------------------------------------------------------------- (7) minor items
@pytest.mark.parametrize("func", [torch.eq, torch.isclose, torch.allclose])
def test_unsupported_torch_function_names_tensordict_only_where_it_has_it(func):
    td = shared_td.TensorDict(a=torch.ones(2), batch_size=[2])
    with pytest.raises(TypeError) as error:
        func(td, td)
    assert "not supported by shared_td" in str(error.value) and "tensordict 0.15.3 has it" not in str(error.value)


def test_unsupported_torch_function_that_tensordict_has():
    from shared_td.containers.unsupported_options import unsupported_torch_function

    assert "(tensordict 0.15.3 has it)" in str(unsupported_torch_function(torch.sigmoid, shared_td.TensorDict))
    assert "(tensordict 0.15.3 has it)" not in str(unsupported_torch_function(torch.numel, shared_td.TensorDict))


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("inplace", [False, True])
def test_lazy_flatten_keys_takes_is_leaf(lib, inplace):
    # before: "LazyShapeOps.flatten_keys() got an unexpected keyword argument 'is_leaf'"
    TD = lib.TensorDict
    lazy = lib.LazyStackedTensorDict(*[TD(a=torch.zeros(2), n={"b": torch.zeros(2)}, batch_size=[2])
                                       for _ in range(2)])
    out = lazy.flatten_keys("/", inplace=inplace, is_leaf=lambda cls: True)
    assert sorted(out.keys()) == ["a", "n"]
    assert sorted(lazy.flatten_keys().keys()) == ["a", "n.b"]


# ---------------------------------------------------------------- (P5) tensorclass members
def _pt(value):
    return Pt(x=torch.full((2,), float(value)), batch_size=[2])


def _given(lazy):
    return [type(member).__name__ for member in _members_as_given(lazy)]


def test_members_added_as_tensorclasses_are_saved_as_such(tmp_path):
    # before: only the constructor's tensorclasses were recorded: append/insert/extend
    # saved theirs as TensorDict, clone/pickle/slicing every member
    lazy = shared_td.LazyStackedTensorDict(_pt(0), shared_td.TensorDict(x=torch.ones(2), batch_size=[2]))
    lazy.append(_pt(2))
    lazy.insert(0, _pt(3))
    lazy.extend([_pt(4)])
    expected = ["Pt", "Pt", "TensorDict", "Pt", "Pt"]
    assert _given(lazy) == expected
    assert _given(lazy.clone()) == expected
    assert _given(pickle.loads(pickle.dumps(lazy))) == expected
    assert _given(lazy[1:3]) == expected[1:3]
    lazy.memmap(tmp_path / "l")
    saved = [json.loads((tmp_path / "l" / str(i) / "meta.json").read_text())["_type"] for i in range(5)]
    assert [kind.rstrip("'>").split(".")[-1] for kind in saved] == expected


def test_a_removed_tensorclass_member_is_not_kept_alive():
    big = Pt(x=torch.zeros(2, 1000), batch_size=[2])
    member = weakref.ref(big._tensordict)
    lazy = shared_td.LazyStackedTensorDict(_pt(0), big)
    del big
    lazy.tensordicts.pop(1)
    gc.collect()
    assert member() is None
    assert _given(lazy) == ["Pt"]


def test_a_member_changed_to_a_tensordict_saved_again_leaves_no_stale_fields(tmp_path):
    prefix = str(tmp_path / "l")
    lazy = shared_td.LazyStackedTensorDict(_pt(0), _pt(1))
    lazy.memmap_(prefix)
    assert os.path.isdir(os.path.join(prefix, "0", "_tensordict"))
    lazy.unlock_()
    lazy.tensordicts[0] = shared_td.TensorDict(x=torch.full((2,), 9.0), batch_size=[2])
    lazy.memmap_(prefix)
    # before: 0/_tensordict/ (the old tensorclass's fields) stayed beside the new leaves
    assert not os.path.exists(os.path.join(prefix, "0", "_tensordict"))
    assert os.path.isdir(os.path.join(prefix, "1", "_tensordict"))
    loaded = shared_td.LazyStackedTensorDict.load_memmap(prefix)
    assert loaded.tensordicts[0]["x"].tolist() == [9.0, 9.0]


# ---------------------------------------------------------------- (5) apply with a nested lazy stack
def _nested_lazy(lib):
    TD = lib.TensorDict
    return TD(l=lib.LazyStackedTensorDict(TD(a=torch.ones(2), batch_size=[2]), TD(a=torch.zeros(2), batch_size=[2])),
              c=torch.ones(2, 2), batch_size=[2, 2])


@pytest.mark.parametrize("lib", LIBS)
def test_apply_default_reaches_a_nested_lazy_stack(lib):
    # before: AttributeError 'int' object has no attribute 'unbind'
    out = _nested_lazy(lib).apply(lambda x, y: x + y, lib.TensorDict(c=torch.ones(2, 2), batch_size=[2, 2]), default=7)
    assert out["l", "a"].tolist() == [[8.0, 8.0], [7.0, 7.0]] and out["c"].tolist() == [[2.0, 2.0]] * 2


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("filter_empty, kept", [(None, False), (True, False), (False, True)])
def test_apply_filter_empty_of_an_emptied_nested_lazy_stack(lib, filter_empty, kept):
    # before: the emptied lazy stack was always kept
    out = _nested_lazy(lib).apply(lambda x: None if x.sum() < 3 else x, filter_empty=filter_empty)
    assert sorted(out.keys()) == (["c", "l"] if kept else ["c"])


@pytest.mark.parametrize("lib", LIBS)
def test_apply_keeps_an_empty_nested_lazy_stack_unless_filter_empty(lib):
    TD = lib.TensorDict
    td = TD(l=lib.LazyStackedTensorDict(TD(batch_size=[2]), TD(batch_size=[2])), c=torch.ones(2, 2), batch_size=[2, 2])
    assert sorted(td.apply(lambda x: x).keys()) == ["c", "l"]
    assert sorted(td.apply(lambda x: x, filter_empty=True).keys()) == ["c"]


# ---------------------------------------------------------------- (6) update's keywords
def _base(lib):
    return lib.TensorDict(a=torch.zeros(2), n={"b": torch.zeros(2)}, batch_size=[2])


def _keys(td):
    return sorted(map(str, td.keys(True, True)))


@pytest.mark.parametrize("lib", LIBS)
def test_update_keywords_are_merged_after_a_tensordict(lib):
    # before: the keyword n replaced the whole n of the tensordict given
    other = lib.TensorDict(n={"q": torch.ones(2)}, batch_size=[2])
    out = _base(lib).update(other, n={"r": torch.ones(2)})
    assert _keys(out) == ["('n', 'b')", "('n', 'q')", "('n', 'r')", "a"]


@pytest.mark.parametrize("lib", LIBS)
def test_update_keyword_replaces_the_entry_of_a_dict(lib):
    out = _base(lib).update({"n": {"q": torch.ones(2)}}, n={"r": torch.ones(2)})
    assert _keys(out) == ["('n', 'b')", "('n', 'r')", "a"]


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("lazy", [False, True], ids=["dense", "lazy"])
def test_update_other_keyword_is_an_entry(lib, lazy):
    # before: other= bound the positional parameter ("iteration over a 0-d tensor")
    td = lib.LazyStackedTensorDict(_base(lib), _base(lib)) if lazy else _base(lib)
    value = torch.ones(2, 2) if lazy else torch.ones(2)
    assert "other" in td.update(other=value).keys()


# ------------------------------------------------ last audit of a41884b
@pytest.mark.parametrize("lib", ["shared_td", "tensordict"])
def test_update_keywords_keep_a_tensordict_others_structure(lib):
    """update(other_td, **entries): the entries are written after other, which keeps its
    nested batch sizes and names and a lazy stack's exclusive keys (a dict of its items
    lost them)."""
    mod = pytest.importorskip(lib)
    td = mod.TensorDict(batch_size=[3])
    other = mod.TensorDict(n=mod.TensorDict(q=torch.zeros(3, 2), batch_size=[3, 2], names=["a", "b"]), batch_size=[3])
    td.update(other, n={"r": torch.ones(3, 2)})
    assert td["n"].batch_size == torch.Size([3, 2]) and td["n"].names == ["a", "b"]
    assert sorted(td["n"].keys()) == ["q", "r"]
    members = [mod.TensorDict(a=torch.zeros(()), x=torch.zeros(())), mod.TensorDict(a=torch.zeros(()))]
    lazy = mod.LazyStackedTensorDict(*[m.clone() for m in members])
    lazy.update(mod.LazyStackedTensorDict(*members), b=torch.ones(2))
    assert [sorted(m.keys()) for m in lazy.tensordicts] == [["a", "b", "x"], ["a", "b"]]


@pytest.mark.parametrize("lib", ["shared_td", "tensordict"])
def test_a_tensorclass_field_named_other_updates_by_keyword(lib):
    mod = pytest.importorskip(lib)

    @mod.tensorclass
    class Holder:
        other: torch.Tensor

    tc = Holder(other=torch.zeros(1), batch_size=[1])
    assert tc.update(other=torch.ones(1)).other.tolist() == [1.0]
    assert tc.update_(other=torch.full((1,), 2.0)).other.tolist() == [2.0]
    assert tc.replace(other=torch.full((1,), 3.0)).other.tolist() == [3.0]


def test_a_reordered_or_nested_stack_never_takes_another_members_tensorclass(tmp_path):
    @shared_td.tensorclass
    class Pt:
        x: torch.Tensor

    lazy = shared_td.LazyStackedTensorDict(Pt(x=torch.zeros(3), batch_size=[3]),
                                           shared_td.TensorDict(y=torch.zeros(3), batch_size=[3]))
    reordered = lazy[[1, 0], 0:2]
    reordered.memmap(tmp_path / "r")
    loaded = shared_td.load_memmap(tmp_path / "r")
    assert sorted(loaded.tensordicts[0].keys()) == ["y"]  # never saved as a Pt

    @shared_td.tensorclass
    class Q:
        n: shared_td.TensorDict

    nested = shared_td.LazyStackedTensorDict(Q(n=shared_td.TensorDict(z=torch.zeros(3), batch_size=[3]), batch_size=[3]),
                                             Q(n=shared_td.TensorDict(z=torch.ones(3), batch_size=[3]), batch_size=[3]))
    nested["n"].memmap(tmp_path / "n")
    import json
    assert "Q" not in json.loads((tmp_path / "n" / "0" / "meta.json").read_text()).get("_type", "")
