"""Five more differences from tensordict 0.15.3, now gone; each case runs the same code
on shared_td and on tensordict and compares what comes out:

1. a tensordict set into a named one whose dims it does not name yet (``parent["c"] =
   child``, ``set``, ``update``, the constructor) is stored as a renamed shallow copy,
   the caller's object keeps its names (it was renamed in place);
2. ``set(key, tensordict, inplace=True)`` over a nested tensordict writes the entries it
   has in place and adds the others (it raised KeyError for a missing one);
3. a lazy stack's ``update_at_(source, (..., 0))`` reads the index on each entry's own
   dims, as the dense tensordict's does (it indexed the batch dims); ``update_at_`` and
   ``set_at_`` of a TensorDict reach the members of a lazy stack nested in it (the
   write went to a stacked copy and was lost);
4. an index that selects no member through a 0-d bool (``lazy[False]``, ``lazy[...,
   False]``) gives a lazy stack of the members indexed so (it gave a dense TensorDict);
5. a tensorclass's ``load_memmap_``/``load_memmap`` have tensordict's signatures.

Names are compared with shared_td's convention (``None`` when no dim is named;
tensordict gives a list of None).
"""
from __future__ import annotations

import inspect

import pytest
import torch

import shared_td
from tests.reference import dim_names, needs_tensordict, side_by_side

pytestmark = needs_tensordict


def _keys(td):
    return sorted(".".join(k) if isinstance(k, tuple) else k for k in td.keys(True, True))


# ---------------------------------------------------------------- 1. names of a set child
def _child(lib, kind):
    if kind == "td":
        return lib.TensorDict(a=torch.zeros(3), batch_size=[3])
    if kind == "nested":
        return lib.TensorDict(a=torch.zeros(3), n=lib.TensorDict(b=torch.zeros(3), batch_size=[3]), batch_size=[3])
    if kind == "partly named":
        return lib.TensorDict(a=torch.zeros(3, 2), batch_size=[3, 2], names=[None, "z"])
    if kind == "locked":
        return lib.TensorDict(a=torch.zeros(3), batch_size=[3]).lock_()
    if kind == "lazy":
        return lib.LazyStackedTensorDict(*[lib.TensorDict(a=torch.zeros(())) for _ in range(3)], stack_dim=0)
    if kind == "named alike":
        return lib.TensorDict(a=torch.zeros(3), batch_size=[3], names=["t"])
    if kind == "named otherwise":
        return lib.TensorDict(a=torch.zeros(3), batch_size=[3], names=["u"])
    raise AssertionError(kind)


def _store(lib, how, child):
    if how == "ctor":
        return lib.TensorDict({"c": child}, batch_size=[3], names=["t"])
    parent = lib.TensorDict(batch_size=[3], names=["t"])
    if how == "setitem":
        parent["c"] = child
    elif how == "set":
        parent.set("c", child)
    elif how == "set nested key":
        parent.set(("x", "c"), child)
        return parent["x"]
    elif how == "set inplace (absent)":
        parent.set("c", child, inplace=True)
    elif how == "update":
        parent.update({"c": child})
    return parent


@pytest.mark.parametrize("how", ["setitem", "set", "set nested key", "set inplace (absent)", "update", "ctor"])
@pytest.mark.parametrize("kind", ["td", "nested", "partly named", "locked", "lazy", "named alike", "named otherwise"])
def test_set_child_named_by_parent_leaves_callers_object(how, kind):
    def scenario(lib):
        child = _child(lib, kind)
        stored = _store(lib, how, child)["c"]
        return (dim_names(child), dim_names(stored), stored is child, child.is_locked,
                stored["a"].data_ptr() == child["a"].data_ptr(), type(stored).__name__)

    side_by_side(scenario)


def test_set_child_named_by_parent_tensorclass():
    def scenario(lib):
        @lib.tensorclass
        class Step:
            x: torch.Tensor

        step = Step(x=torch.zeros(3), batch_size=[3])
        parent = lib.TensorDict(batch_size=[3], names=["t"])
        parent["c"] = step
        return dim_names(step), dim_names(parent["c"]), parent["c"] is step, parent["c"].x is step.x

    side_by_side(scenario)


def test_set_child_named_by_parent_nested_entries_are_copies():
    """The copy is tensordict's ``clone(recurse=False)``: its nested tensordicts are new
    too (renamed), the caller's keep their names, and a key added to the caller's
    object later is not in the stored one."""
    def scenario(lib):
        child = _child(lib, "nested")
        inner = child["n"]
        parent = lib.TensorDict(batch_size=[3], names=["t"])
        parent["c"] = child
        child["later"] = torch.ones(3)
        return (dim_names(inner), parent["c", "n"] is inner, dim_names(parent["c", "n"]),
                _keys(parent["c"]), parent["c", "n", "b"] is inner["b"])

    side_by_side(scenario)


# ---------------------------------------------------------------- 2. set(inplace=True) adds keys
def _nested_with(lib, current, names=None):
    return lib.TensorDict(v=current, batch_size=[3], names=names)


@pytest.mark.parametrize("names", [None, ["t"]])
@pytest.mark.parametrize("value_kind", ["td", "dict"])
def test_set_inplace_into_nested_adds_missing_keys(names, value_kind):
    def scenario(lib):
        td = _nested_with(lib, lib.TensorDict(a=torch.zeros(3), batch_size=[3]), names)
        nested, a = td["v"], td["v", "a"]
        b = torch.full((3,), 2.0)
        value = {"a": torch.ones(3), "b": b}
        if value_kind == "td":
            value = lib.TensorDict(value, batch_size=[3])
        td.set("v", value, inplace=True)
        return (_keys(td), td["v"] is nested, td["v", "a"] is a, a.tolist(), td["v", "b"] is b,
                dim_names(td["v"]), dim_names(value) if value_kind == "td" else None)

    side_by_side(scenario)


def test_set_inplace_into_nested_adds_nested_tensordicts():
    def scenario(lib):
        td = _nested_with(lib, lib.TensorDict(a=torch.zeros(3), batch_size=[3]))
        w = lib.TensorDict(c=torch.ones(3), batch_size=[3])
        td.set("v", lib.TensorDict(a=torch.ones(3), w=w, batch_size=[3]), inplace=True)
        return _keys(td), td["v", "w"] is w, td["v", "a"].tolist()

    side_by_side(scenario)


@pytest.mark.parametrize("case", ["locked", "shape"])
def test_set_inplace_into_nested_refused(case):
    """A locked tensordict takes no new key, a value of the wrong shape is refused; in
    shared_td nothing is written then (tensordict writes ``a`` before it fails)."""
    def scenario(lib):
        td = _nested_with(lib, lib.TensorDict(a=torch.zeros(3), batch_size=[3]))
        a_shape = (3,) if case == "locked" else (3, 2)
        if case == "locked":
            td.lock_()
        td.set("v", lib.TensorDict(a=torch.ones(a_shape), b=torch.ones(3), batch_size=[3]), inplace=True)
        return _keys(td)

    side_by_side(scenario)
    td = _nested_with(shared_td, shared_td.TensorDict(a=torch.zeros(3), batch_size=[3])).lock_()
    with pytest.raises(RuntimeError):
        td.set("v", shared_td.TensorDict(a=torch.ones(3), b=torch.ones(3), batch_size=[3]), inplace=True)
    assert _keys(td) == ["v.a"] and td["v", "a"].sum() == 0


def test_set_inplace_into_nested_tensorclass_and_lazy_stack():
    def scenario(lib):
        @lib.tensorclass
        class Pair:
            x: torch.Tensor
            y: torch.Tensor = None

        td = _nested_with(lib, Pair(x=torch.zeros(3), batch_size=[3]))
        td.set("v", Pair(x=torch.ones(3), y=torch.ones(3), batch_size=[3]), inplace=True)
        lazy = lib.LazyStackedTensorDict(*[lib.TensorDict(a=torch.zeros(())) for _ in range(3)])
        td2 = _nested_with(lib, lazy)
        td2.set("v", lib.TensorDict(a=torch.ones(3), b=torch.ones(3), batch_size=[3]), inplace=True)
        return (td["v"].x.tolist(), td["v"].y.tolist(), _keys(td2), type(td2["v"]).__name__,
                td2["v"] is lazy, lazy.tensordicts[1]["b"].item())

    side_by_side(scenario)


def test_set_strict_keeps_refusing_missing_nested_keys():
    """``set_`` writes into existing entries only: a key the nested tensordict lacks is
    a KeyError, nothing written (tensordict 0.15.3 silently drops it)."""
    td = _nested_with(shared_td, shared_td.TensorDict(a=torch.zeros(3), batch_size=[3]))
    with pytest.raises(KeyError, match="'b'"):
        td.set_("v", shared_td.TensorDict(a=torch.ones(3), b=torch.ones(3), batch_size=[3]))
    assert _keys(td) == ["v.a"] and td["v", "a"].sum() == 0


def test_tensorclass_update_from_tensorclass():
    def scenario(lib):
        @lib.tensorclass
        class Pair:
            x: torch.Tensor

        pair = Pair(x=torch.zeros(3), batch_size=[3])
        pair.update_(Pair(x=torch.ones(3), batch_size=[3]))
        return pair.x.tolist()

    side_by_side(scenario)


# ---------------------------------------------------------------- 3. lazy update_at_
def _lazy(lib, stack_dim):
    members = [lib.TensorDict(a=torch.zeros(4, 5), b=lib.TensorDict(c=torch.zeros(4, 6), batch_size=[4]),
                              batch_size=[4]) for _ in range(3)]
    return lib.LazyStackedTensorDict(*members, stack_dim=stack_dim)


def _rows(lazy):
    return lazy.batch_size[:-1]


LAZY_UPDATES = {
    "tensor shaped as entry[..., 0]": lambda lib, lazy: ({"a": torch.arange(lazy.batch_size.numel(), dtype=torch.float)
                                                         .reshape(lazy.batch_size)}, (..., 0)),
    "tensordict source": lambda lib, lazy: (lib.TensorDict(a=torch.ones(lazy.batch_size)), (..., 0)),
    "nested tensordict value": lambda lib, lazy: (
        {"b": lib.TensorDict(c=torch.ones(*_rows(lazy), 6), batch_size=_rows(lazy))}, (..., 0)),
    "broadcast scalar": lambda lib, lazy: ({"a": torch.tensor(7.0)}, (..., 1)),
}


@pytest.mark.parametrize("stack_dim", [0, 1])
@pytest.mark.parametrize("case", list(LAZY_UPDATES))
def test_lazy_update_at_reads_index_on_entries(stack_dim, case):
    def scenario(lib):
        lazy = _lazy(lib, stack_dim)
        source, index = LAZY_UPDATES[case](lib, lazy)
        lazy.update_at_(source, index)
        return lazy["a"].tolist(), lazy["b", "c"].tolist()

    side_by_side(scenario)


@pytest.mark.parametrize("write", ["update_at_ dict", "update_at_ tensordict value", "set_at_"])
def test_writes_at_index_reach_a_nested_lazy_stack(write):
    """A lazy stack nested in a TensorDict: ``get`` of its leaves is a new stacked tensor,
    so the write goes through the stack into its members (it was lost)."""
    def scenario(lib):
        lazy = lib.LazyStackedTensorDict(*[lib.TensorDict(c=torch.zeros(4, 6), batch_size=[4]) for _ in range(3)])
        td = lib.TensorDict(b=lazy, a=torch.zeros(3, 4, 5), batch_size=[3, 4])
        if write == "update_at_ dict":
            td.update_at_({"b": {"c": torch.ones(3, 4)}}, (..., 0))
        elif write == "update_at_ tensordict value":
            td.update_at_({"b": lib.TensorDict(c=torch.ones(3, 6), batch_size=[3])}, (..., 0))
        else:
            td.set_at_(("b", "c"), torch.ones(6), (0, 0))
        return td["b", "c"].tolist(), lazy.tensordicts[0]["c"].sum().item()

    side_by_side(scenario)


def test_lazy_update_at_like_dense():
    """What tensordict's lazy stack refuses (an index with more parts than batch dims)
    is written as the dense tensordict writes it, into the members."""
    lazy = _lazy(shared_td, 0)
    dense = lazy.contiguous()
    for td in (lazy, dense):
        td.update_at_({"a": torch.ones(3)}, (slice(None), 0, 1))
    assert torch.equal(lazy["a"], dense["a"]) and lazy["a"].sum() == 3
    assert lazy.tensordicts[2]["a"][0, 1] == 1


# ---------------------------------------------------------------- 4. empty selections
EMPTY_INDICES = {
    "False": False,
    "False, :": (False, slice(None)),
    "True": True,
    "0-d bool tensor": torch.tensor(False),
    "None, False": (None, False),
    "..., False": (Ellipsis, False),
    "False, 0": (False, 0),
    "bool mask of members": torch.zeros(3, dtype=torch.bool),
    "[]": [],
    "empty long tensor": torch.tensor([], dtype=torch.long),
    "0:0": slice(0, 0),
    "full mask": torch.zeros(3, 4, dtype=torch.bool),
}


@pytest.mark.parametrize("stack_dim", [0, 1])
@pytest.mark.parametrize("case", list(EMPTY_INDICES))
def test_lazy_empty_selection_class(stack_dim, case):
    def scenario(lib):
        members = [lib.TensorDict(a=torch.zeros(4, 5), x=torch.zeros(4), batch_size=[4]) for _ in range(3)]
        lazy = lib.LazyStackedTensorDict(*members, stack_dim=stack_dim)
        index = EMPTY_INDICES[case]
        if case == "bool mask of members":
            index = torch.zeros(lazy.batch_size[0], dtype=torch.bool)
        if case == "full mask":
            index = torch.zeros(lazy.batch_size, dtype=torch.bool)
        out = lazy[index]
        summary = [type(out).__name__, list(out.batch_size), _keys(out), list(out["a"].shape)]
        if type(out).__name__ == "LazyStackedTensorDict":
            summary += [out.stack_dim, len(out.tensordicts), list(out.tensordicts[0].batch_size)]
        return summary

    side_by_side(scenario)


def test_lazy_zero_d_bool_write():
    lazy = _lazy(shared_td, 0)
    lazy[False] = shared_td.TensorDict(a=torch.ones(0, 3, 4, 5), batch_size=[0, 3, 4])
    lazy[True] = shared_td.TensorDict(a=torch.ones(1, 3, 4, 5), batch_size=[1, 3, 4])
    assert lazy["a"].sum() == 60


# ---------------------------------------------------------------- 5. tensorclass load signatures
def _parameters(function):
    return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]


@pytest.mark.parametrize("style", ["decorator", "subclass"])
@pytest.mark.parametrize("method", ["load_memmap_", "load_memmap", "load_", "load"])
def test_tensorclass_load_signatures(style, method):
    def scenario(lib):
        if style == "decorator":
            @lib.tensorclass
            class Step:
                x: torch.Tensor
        else:
            class Step(lib.TensorClass):
                x: torch.Tensor
        return _parameters(getattr(Step, method))

    side_by_side(scenario)


@pytest.mark.parametrize("call", ["load_memmap num_threads", "load_memmap_ num_threads", "load_ mode",
                                  "load_memmap_ robust_key", "load_memmap device"])
def test_tensorclass_load_keywords(tmp_path, call):
    def scenario(lib):
        @lib.tensorclass
        class Step:
            x: torch.Tensor

        prefix = tmp_path / lib.__name__
        Step(x=torch.ones(3), batch_size=[3]).memmap(prefix)
        empty = Step(x=torch.zeros(3), batch_size=[3])
        if call == "load_memmap num_threads":
            return Step.load_memmap(prefix, num_threads=2).x.tolist()
        if call == "load_memmap_ num_threads":
            return empty.load_memmap_(prefix, num_threads=2).x.tolist()
        if call == "load_ mode":
            return empty.load_(prefix, mode="r").x.tolist()
        if call == "load_memmap_ robust_key":
            return empty.load_memmap_(prefix, True, allow_pickle=False).x.tolist()
        return Step.load_memmap(prefix, "cpu", False, robust_key=True).x.tolist()

    side_by_side(scenario)
