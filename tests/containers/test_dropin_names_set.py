"""Four differences from tensordict 0.15.3 that the README listed, now gone; each case
runs the same code on shared_td and on tensordict and compares what comes out:

- the dim names after a mask, a bool or an N-D (advanced) index on a lazy stack (they
  were all dropped; an int at the stack dim beside an index tensor gave a lazy stack of
  views where tensordict gives the member's own copy);
- ``td.batch_size = ...`` keeps the names of the dims that stay (they were all dropped);
- a tensordict of another batch size set into a batched one (``td["a"] =
  TensorDict()``) takes the parent's batch size when its entries allow, as tensordict
  does (it was refused);
- ``update_at_(src, (..., 0))`` writes as ``set_at_`` does, each tensor entry indexed on
  its own dims, wherever tensordict writes so (a source shaped as the batch rows, which
  tensordict refuses, is still written into the rows).

Names are compared with shared_td's convention (``None`` when no dim is named;
tensordict gives a list of None).
"""
from __future__ import annotations


import pytest
import torch

import shared_td
from tests.reference import dim_names, needs_tensordict, outcome, side_by_side, tensordict

pytestmark = needs_tensordict


# ---------------------------------------------------------------- 1. lazy stacks
MASK2, MASK3 = torch.tensor([True, False]), torch.tensor([False, True, True])
LAZY_INDICES = {
    "2-D index": (torch.tensor([[0, 1], [1, 0]]),),
    "int, list": (0, [0, 1]),
    "two lists": ([0, 1], [0, 1]),
    "list, slice, list": ([0, 1], slice(None), [1, 2]),
    "int, slice, list": (0, slice(None), [1, 2]),
    "list, int": ([1], 0),
    "slice, int, list": (slice(None), 0, [1, 2]),
    "column and row": ([[0], [1]], [0, 1]),
    "True": (True,),
    "slice, True": (slice(None), True),
    "2-D mask": (torch.tensor([[True, False, True], [False, True, True]]),),
    "slice, 2-D mask": (slice(None), torch.ones(2, 3, dtype=torch.bool)),
    "mask": (MASK2,),
    "slice, mask": (slice(None), MASK3[:2]),
    "None, list": (None, [0, 1]),
    "slice, 2-D index": (slice(None), torch.tensor([[0, 1], [1, 0]])),
}


def _lazy(lib, dim, stack_dim_name):
    members = [lib.TensorDict(a=torch.zeros(2, 3, 5), batch_size=[2, 3], names=["x", "y"]) for _ in range(2)]
    kwargs = {} if stack_dim_name is None else {"stack_dim_name": stack_dim_name}
    return lib.lazy_stack(members, dim, **kwargs)


@pytest.mark.parametrize("index", LAZY_INDICES)
@pytest.mark.parametrize("dim", [0, 1, 2])
@pytest.mark.parametrize("stack_dim_name", [None, "s"])
def test_lazy_stack_names_after_advanced_index(index, dim, stack_dim_name):
    idx = LAZY_INDICES[index]

    def scenario(lib):
        out = _lazy(lib, dim, stack_dim_name)[idx]
        return dim_names(out), out.batch_size, type(out).__name__

    side_by_side(scenario)
    # and the batch size is torch's
    probe = torch.zeros(_lazy(shared_td, dim, stack_dim_name).batch_size)
    try:
        expected = probe[idx].shape
    except IndexError:
        return
    assert _lazy(shared_td, dim, stack_dim_name)[idx].batch_size == expected


def test_lazy_stack_index_names_reach_nested_entries():
    def scenario(lib):
        members = [lib.TensorDict(n=lib.TensorDict(b=torch.zeros(2, 3, 4), batch_size=[2, 3, 4]),
                                  batch_size=[2, 3], names=["x", "y"]) for _ in range(2)]
        out = lib.lazy_stack(members, 0, stack_dim_name="s")[torch.tensor([[0, 1], [1, 0]]), 1]
        return dim_names(out), dim_names(out["n"]), out["n"].batch_size

    side_by_side(scenario)


def test_lazy_stack_advanced_index_leaves_the_members_names():
    lazy = _lazy(shared_td, 0, "s")
    lazy[True]
    lazy[[0, 1], [0, 1]]
    assert lazy.names == ["s", "x", "y"]
    assert [m.names for m in lazy.tensordicts] == [["x", "y"], ["x", "y"]]


# ---------------------------------------------------------------- 2. batch_size setter
def _with_nested(lib, names=("x", "y")):
    return lib.TensorDict(a=torch.zeros(3, 4, 5), n=lib.TensorDict(b=torch.zeros(3, 4, 5, 6), batch_size=[3, 4, 5]),
                          batch_size=[3, 4], names=list(names))


def _tree(td):
    return dim_names(td), td.batch_size, {
        key: (dim_names(value), value.batch_size) for key, value in td.items(True) if not isinstance(value, torch.Tensor)}


@pytest.mark.parametrize("new", [[3], [], [3, 4], [3, 4, 5], torch.Size([3])], ids=str)
@pytest.mark.parametrize("names", [("x", "y"), ("x", None), (None, "y")], ids=str)
def test_batch_size_setter_keeps_the_names_of_the_dims_that_stay(new, names):
    def scenario(lib):
        td = _with_nested(lib, names)
        td.batch_size = new
        return _tree(td)

    side_by_side(scenario)


@pytest.mark.parametrize("steps", [
    [[3, 2, 2]],  # a new dim unnamed, also in the child that named it
    [[3], [3, 2, 2]],  # shrunk, then grown: the dims dropped lose their names
])
@pytest.mark.parametrize("named", [True, False])
def test_batch_size_setter_names_children_as_tensordict(steps, named):
    def scenario(lib):
        td = lib.TensorDict(n=lib.TensorDict(batch_size=[3, 2, 2], names=[None, "y", "z"]), batch_size=[3, 2],
                            names=["x", "y"] if named else None)
        for new in steps:
            td.batch_size = new
        return _tree(td)

    side_by_side(scenario)


def test_batch_size_setter_grows_a_nested_tensordict_with_the_names():
    def scenario(lib):
        td = lib.TensorDict(a=torch.zeros(3, 4, 5), n=lib.TensorDict(b=torch.zeros(3, 4, 5), batch_size=[3]),
                            batch_size=[3], names=["x"])
        out = []
        td.batch_size = [3, 4]
        out.append(_tree(td))
        td.names = ["x", "y"]
        td.batch_size = [3, 4, 5]
        out.append(_tree(td))
        td.batch_size = [3]
        out.append(_tree(td))
        return out

    side_by_side(scenario)


# ---------------------------------------------------------------- 3. a tensordict of another batch size set
def _values(lib):
    return {
        "empty": lambda: lib.TensorDict(),
        "entries, batch []": lambda: lib.TensorDict(b=torch.zeros(3)),
        "a scalar entry": lambda: lib.TensorDict(b=torch.zeros(())),
        "empty, batch [1]": lambda: lib.TensorDict(batch_size=[1]),
        "empty, batch [2]": lambda: lib.TensorDict(batch_size=[2]),
        "empty, batch [3, 2]": lambda: lib.TensorDict(batch_size=[3, 2]),
        "empty, batch [2, 2]": lambda: lib.TensorDict(batch_size=[2, 2]),
        "named, batch [2]": lambda: lib.TensorDict(batch_size=[2], names=["z"]),
        "entries, batch [2]": lambda: lib.TensorDict(b=torch.zeros(2), batch_size=[2]),
        "nested empty": lambda: lib.TensorDict(c=lib.TensorDict()),
        "nested with entries": lambda: lib.TensorDict(c=lib.TensorDict(d=torch.zeros(3, 2))),
        "locked empty": lambda: lib.TensorDict().lock_(),
        "lazy stack": lambda: lib.lazy_stack([lib.TensorDict(), lib.TensorDict()]),
    }


def _ways(lib):
    def parent(**kwargs):
        return lib.TensorDict(a=torch.zeros(3, 4), batch_size=[3], **kwargs)

    def item(value, **kwargs):
        td = parent(**kwargs)
        td["v"] = value
        return td

    def set_(value):
        return parent().set("v", value)

    def nested_key(value):
        td = parent()
        td["x", "v"] = value
        return td

    def update(value):
        return parent().update({"v": value})

    def update_nested(value):
        return parent().update({"v": {"w": value}})

    def constructor(value):
        return lib.TensorDict({"a": torch.zeros(3, 4), "v": value}, [3])

    def keywords(value):
        return lib.TensorDict(a=torch.zeros(3, 4), v=value, batch_size=[3])

    def named_parent(value):
        return item(value, names=["n"])

    def locked_parent(value):
        td = parent()
        td.lock_()
        td["v"] = value
        return td

    return dict(item=item, set=set_, nested_key=nested_key, update=update, update_nested=update_nested,
                constructor=constructor, keywords=keywords, named_parent=named_parent,
                locked_parent=locked_parent)


@pytest.mark.parametrize("value", list(_values(shared_td)))
@pytest.mark.parametrize("way", list(_ways(shared_td)))
def test_a_tensordict_set_takes_the_parents_batch_size(way, value):
    def scenario(lib):
        given = _values(lib)[value]()
        before = (given.batch_size, dim_names(given))
        td = _ways(lib)[way](given)
        if before[0][:1] != (3,):  # the value given is not changed: a shallow copy is resized
            assert (given.batch_size, dim_names(given)) == before
        return _tree(td)

    side_by_side(scenario)


def test_the_copy_set_shares_the_tensors():
    source = shared_td.TensorDict(b=torch.zeros(3))
    td = shared_td.TensorDict(batch_size=[3])
    td["v"] = source
    assert td["v"] is not source and td["v"].batch_size == torch.Size([3])
    assert td["v", "b"] is source["b"]


def test_a_nested_tensordict_that_does_not_fit_is_still_refused():
    """tensordict 0.15.3 resizes the value and leaves its nested tensordict of batch [2]
    under a parent of batch [3] (a tree whose nested batch sizes disagree); shared_td
    refuses it, as before."""
    td = shared_td.TensorDict(a=torch.zeros(3), batch_size=[3])
    with pytest.raises(shared_td.errors.BatchSizeMismatchError):
        td["v"] = shared_td.TensorDict(c=shared_td.TensorDict(batch_size=[2]))
    assert "v" not in td.keys()


def test_a_locked_parent_still_refuses():
    td = shared_td.TensorDict(a=torch.zeros(3), batch_size=[3]).lock_()
    with pytest.raises(shared_td.errors.LockedTensorDictError):
        td["v"] = shared_td.TensorDict()
    assert "v" not in td.keys()


# ---------------------------------------------------------------- 4. update_at_ with an Ellipsis
def _target(lib):
    return lib.TensorDict(a=torch.zeros(3, 4, 5), n=lib.TensorDict(b=torch.zeros(3, 4, 2), batch_size=[3, 4]),
                          batch_size=[3, 4])


def _sources(lib):
    return {
        "rows": lambda: lib.TensorDict(a=torch.ones(3, 5), n=lib.TensorDict(b=torch.ones(3, 2), batch_size=[3]),
                                       batch_size=[3]),
        "rows as a dict": lambda: {"a": torch.ones(3, 5), "n": {"b": torch.ones(3, 2)}},
        "entry-indexed, no batch": lambda: lib.TensorDict(a=torch.ones(3, 4)),
        "entry-indexed [3, 4]": lambda: lib.TensorDict(a=torch.ones(3, 4), batch_size=[3, 4]),
        "entry-indexed dict": lambda: {"a": torch.ones(3, 4)},
        "entry-indexed nested dict": lambda: {"n": {"b": torch.ones(3, 4)}},
        "a number": lambda: {"a": torch.tensor(2.0)},
        "a feature row": lambda: {"a": torch.arange(4.0)},
        "nested tensordict of rows": lambda: lib.TensorDict(
            n=lib.TensorDict(b=torch.ones(3, 2), batch_size=[3]), batch_size=[3]),
        "nested tensordict, entry-indexed": lambda: lib.TensorDict(n=lib.TensorDict(b=torch.ones(3, 4))),
        "a tensor and a nested tensordict": lambda: lib.TensorDict(
            a=torch.ones(3, 4), n=lib.TensorDict(b=torch.ones(3, 2), batch_size=[3])),
    }


UPDATE_AT_INDICES = {
    "(..., 0)": (Ellipsis, 0),
    "(0, ...)": (0, Ellipsis),
    "(:, 0)": (slice(None), 0),
    "0": 0,
    "(..., 1, 0)": (Ellipsis, 1, 0),
    "(..., [0, 1])": (Ellipsis, [0, 1]),
    "(:, :, 0)": (slice(None), slice(None), 0),
}


@pytest.mark.parametrize("source", list(_sources(shared_td)))
@pytest.mark.parametrize("index", UPDATE_AT_INDICES)
def test_update_at_indexes_entries_as_tensordict(index, source):
    idx = UPDATE_AT_INDICES[index]

    def scenario(lib):
        td = _target(lib)
        td.update_at_(_sources(lib)[source](), idx)
        return td["a"].tolist(), td["n", "b"].tolist()

    ours, theirs = outcome(lambda: scenario(shared_td)), outcome(lambda: scenario(tensordict))
    if theirs == "error":
        return  # (kept: see test_update_at_rows_where_tensordict_refuses)
    assert ours == theirs


@pytest.mark.parametrize("source", ["rows", "rows as a dict"])
def test_update_at_rows_where_tensordict_refuses(source):
    """A source shaped as the rows ``td[..., 0]``: tensordict 0.15.3 raises (it indexes
    the leaf ``a`` of shape [3, 4, 5] on its last dim), shared_td writes the rows, as
    ``td[..., 0] = source`` does in both."""
    td = _target(shared_td)
    td.update_at_(_sources(shared_td)[source](), (Ellipsis, 0))
    expected = _target(shared_td)
    expected[..., 0] = _sources(shared_td)["rows"]()
    assert (td == expected).all()


def test_update_at_checks_every_entry_before_writing():
    td = _target(shared_td)
    with pytest.raises(RuntimeError):  # "a" fits the entry, "n" fits neither way
        td.update_at_({"a": torch.ones(3, 4), "n": {"b": torch.ones(7)}}, (Ellipsis, 0))
    assert (td["a"] == 0).all()
