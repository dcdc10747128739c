"""What tensordict's own test_generic.py (its second half) found, side by side with
tensordict 0.15.3: keys(is_leaf=) of a lazy stack holding a tensorclass, a key renamed to
its parent, a new nested entry written through an index keeping its own batch dims, and
a lazy stack's ``empty(batch_size=, device=)``."""
from __future__ import annotations

import pytest
import torch

import shared_td

from tests.reference import LIBS


def _step_class(lib):
    @lib.tensorclass
    class Step:
        x: torch.Tensor

    return Step


@pytest.mark.parametrize("lib", LIBS)
def test_lazy_stack_keys_is_leaf_sees_the_tensorclass(lib):
    step = _step_class(lib)
    td = lib.TensorDict(a=torch.zeros(3), tc=step(x=torch.zeros(3, 4), batch_size=[3]), batch_size=[3])
    stack = lib.lazy_stack([td[0], td[1]])
    is_leaf = lambda cls: cls is step  # noqa: E731
    for tree in (td, stack):
        assert list(tree.keys(True, True, is_leaf=is_leaf)) == ["tc"]
        assert len(tree.keys(True, True, is_leaf=is_leaf)) == 1
        assert "tc" in tree.keys(True, True, is_leaf=is_leaf)
        assert [type(value) for value in tree.values(True, True, is_leaf=is_leaf)] == [step]
        if lib.__name__ == "shared_td":  # (tensordict walks into it on a TensorDict: documented)
            assert ("tc", "x") not in list(tree.keys(True, False, is_leaf=is_leaf))  # listed whole, not walked


@pytest.mark.parametrize("lib", LIBS)
def test_rename_key_to_its_parent(lib):
    td = lib.TensorDict(a={"b": {"c": torch.tensor(7)}})
    assert td.rename_key_(("a", "b", "c"), ("a", "b")) is td
    assert td["a", "b"] == 7 and list(td.keys(True, True)) == [("a", "b")]


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("kind", ["td", "tensorclass", "lazy", "lazy dim 1"])
def test_a_new_nested_entry_written_through_an_index_keeps_its_batch_dims(lib, kind):
    inner = {
        "td": lambda: lib.TensorDict(i=torch.ones(3, 4, 2), batch_size=[3, 4]),
        "tensorclass": lambda: _step_class(lib)(x=torch.ones(3, 4, 2), batch_size=[3, 4]),
        "lazy": lambda: lib.lazy_stack([lib.TensorDict(i=torch.ones(4, 2), batch_size=[4])] * 3),
        "lazy dim 1": lambda: lib.lazy_stack([lib.TensorDict(i=torch.ones(3, 2), batch_size=[3])] * 4, 1),
    }[kind]
    buffer = lib.TensorDict(batch_size=[5, 3])
    buffer[0] = lib.TensorDict(n=inner(), batch_size=[3])  # (a tensorclass: its class kept, a lazy stack: dense)
    assert buffer["n"].batch_size == torch.Size([5, 3, 4])  # shared_td: [5, 3] (a lazy stack: TypeError)
    assert buffer[0]["n"].batch_size == torch.Size([3, 4])
    leaf = next(iter(buffer["n"].values(True, True)))
    assert leaf[0].eq(1).all() and leaf[1:].eq(0).all()


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("stack_dim", [0, 1])
def test_lazy_stack_empty_with_a_batch_size_or_device(lib, stack_dim):
    lazy = lib.lazy_stack([lib.TensorDict(i=torch.ones(4, 2), n={"z": torch.ones(4)}, s="x", batch_size=[4])] * 3,
                          stack_dim)
    size = list(lazy.batch_size)

    def shape(result):
        return type(result).__name__, result.batch_size, sorted(map(str, result.keys(True)))

    assert shape(lazy.empty(batch_size=size)) == ("LazyStackedTensorDict", torch.Size(size), [])
    assert shape(lazy.empty(batch_size=[5, *size])) == ("TensorDict", torch.Size([5, *size]), [])
    assert shape(lazy.empty(batch_size=[])) == ("TensorDict", torch.Size([]), [])
    assert shape(lazy.empty(recurse=True, batch_size=[])) == ("TensorDict", torch.Size([]), ["n", "s"])
    # the dims up to the stack dim kept: still a stack (of members with fewer dims)
    kept = lazy.empty(recurse=True, batch_size=size[:1])
    assert shape(kept) == ("LazyStackedTensorDict" if stack_dim == 0 else "TensorDict", torch.Size(size[:1]),
                           ["n", "s"])
    assert lazy.empty(device="cpu").device == torch.device("cpu")  # (a device, not the str given)
    assert lib.TensorDict(batch_size=[2]).empty(device="cpu").device == torch.device("cpu")
    with pytest.raises(RuntimeError, match="'n'"):  # a nested tensordict that cannot take it
        lazy.empty(recurse=True, batch_size=[2, *size])


@pytest.mark.parametrize("lib", LIBS)
def test_permute_out_of_range_is_the_value_error_tensordict_raises(lib):
    td = lib.TensorDict(a=torch.zeros(2, 3, 4, 5), batch_size=[2, 3, 4, 5])
    with pytest.raises(ValueError):
        td.permute(2, 5, 0, 1)
    if lib.__name__ == "shared_td":  # also the IndexError torch raises for a tensor's permute
        with pytest.raises(IndexError, match="permute: dim=5 is out of range"):
            td.permute(2, 5, 0, 1)


def _separable(lib):
    return lib.TensorDict(a=torch.zeros(3), b=torch.ones(3), s="x",
                          nested=lib.TensorDict(c=torch.zeros(3), d=torch.zeros(3), batch_size=[3]),
                          e=lib.TensorDict(f=torch.zeros(3), batch_size=[3]), batch_size=[3])


def _leaf_keys(td):
    return sorted(map(str, td.keys(True, True)))


@pytest.mark.parametrize("lib", LIBS)
def test_separates_moves_the_entries_into_a_new_tensordict(lib):
    td = _separable(lib)
    a = td["a"]
    out = td.separates("a", ("nested", "c"))
    assert _leaf_keys(out) == ["('nested', 'c')", "a"] and out.batch_size == torch.Size([3])
    assert out["a"] is a  # not copied
    assert _leaf_keys(td) == ["('e', 'f')", "('nested', 'd')", "b"] and td["s"] == "x"
    emptied = _separable(lib)
    assert _leaf_keys(emptied.separates(("e", "f"))) == ["('e', 'f')"]
    assert "e" not in emptied.keys()  # left empty: removed (filter_empty=True)
    kept = _separable(lib)
    kept.separates(("e", "f"), filter_empty=False)
    assert "e" in kept.keys() and kept["e"].is_empty()
    with_default = _separable(lib).separates("a", "zz", default=torch.ones(3))  # a default: not strict
    assert _leaf_keys(with_default) == ["a", "zz"]
    lazy = lib.lazy_stack([_separable(lib), _separable(lib)])
    out = lazy.separates("a")
    assert type(out).__name__ == "LazyStackedTensorDict" and _leaf_keys(out) == ["a"] and "a" not in lazy.keys()
    with pytest.raises(RuntimeError):
        _separable(lib).lock_().separates("a")


def test_separates_a_missing_key_leaves_the_tensordict_whole():
    """tensordict 0.15.3 has removed "a" by the time "zz" raises: "a" is lost."""
    td = _separable(shared_td)
    with pytest.raises(KeyError, match="zz"):
        td.separates("a", "zz")
    assert _leaf_keys(td) == _leaf_keys(_separable(shared_td))
    assert _leaf_keys(td.separates("a", "zz", strict=False)) == ["a"]  # skipped


# ------------------------------------------------------------ the review of this change
@shared_td.tensorclass
class _Cast:
    x: torch.Tensor

    def __post_init__(self):
        self.x = self.x.float()


def _cast_member():
    td = shared_td.TensorDict(a=torch.zeros(2), o=_Cast(x=torch.zeros(2), batch_size=[2]), batch_size=[2])
    td.get("o")._tensordict.set("x", torch.zeros(2, dtype=torch.long))
    return td


def test_listing_keys_of_a_lazy_stack_runs_no_tensorclass_post_init():
    lazy = shared_td.lazy_stack([_cast_member(), _cast_member()])
    assert list(lazy.keys(True, True)) == ["a", ("o", "x")]
    assert lazy.tensordicts[0].get("o")._tensordict.get("x").dtype == torch.long  # not cast by a listing
    lazy.lock_()
    assert list(lazy.keys(True, True)) == ["a", ("o", "x")]  # (raised LockedTensorDictError)
    assert ("o", "x") in lazy.keys(True, True)


def _tree():
    return shared_td.TensorDict(a=torch.arange(3.0), n=shared_td.TensorDict(c=torch.zeros(3), batch_size=[3]), batch_size=[3])


@pytest.mark.parametrize("how", ["separates", "split_keys", "lazy"])
def test_a_locked_nested_tensordict_leaves_the_keys_before_it_in_place(how):
    td = shared_td.lazy_stack([_tree(), _tree()]) if how == "lazy" else _tree()
    (td.tensordicts[1] if how == "lazy" else td)["n"].lock_()
    with pytest.raises(RuntimeError, match="locked"):
        if how == "split_keys":
            td.split_keys(["a", ("n", "c")], inplace=True)
        else:
            td.separates("a", ("n", "c"))
    assert sorted(map(str, td.keys(True, True))) == ["('n', 'c')", "a"]


def test_separates_filter_empty_removes_what_the_removal_emptied_only():
    td = shared_td.TensorDict(a=torch.zeros(3), m=shared_td.TensorDict(b=torch.zeros(3), batch_size=[3]),
                    n=shared_td.TensorDict(c=torch.zeros(3), e=shared_td.TensorDict(batch_size=[3]), batch_size=[3]),
                    k=shared_td.TensorDict(batch_size=[3]), batch_size=[3])
    td["n"].lock_()
    out = td.separates("a", ("m", "b"))  # (raised on the locked n's empty e, "a" lost)
    assert sorted(map(str, out.keys(True, True))) == ["('m', 'b')", "a"]
    assert sorted(map(str, td.keys(True))) == ["('n', 'c')", "('n', 'e')", "k", "n"]  # m emptied: gone; k kept


# ------------------------------------------------------------ fuzz round 8


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("recurse", [False, True])
@pytest.mark.parametrize("batch_size, expected", [
    ([2], ["a"]), ([2, 3, 4], ["a", "b", None]), ([2, 3], ["a", "b"]), ([5, 3], ["a", "b"]),
])
def test_empty_with_another_batch_size_keeps_the_names_by_position(lib, recurse, batch_size, expected):
    # as the batch_size setter: the dims that stay keep their names, new dims are unnamed
    td = lib.TensorDict({"x": torch.zeros(2, 3)}, [2, 3], names=["a", "b"])
    assert td.empty(recurse, batch_size=batch_size).names == expected


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("stack_dim", [1, 2])
def test_lazy_empty_to_a_tensordict_keeps_the_names_by_position(lib, stack_dim):
    td = lib.TensorDict({"x": torch.zeros(2, 3)}, [2, 3], names=["a", "b"])
    lazy = lib.lazy_stack([td.clone(), td.clone()], dim=stack_dim)
    for recurse in (False, True):
        assert lazy.empty(recurse, batch_size=[2]).names == ["a"]
