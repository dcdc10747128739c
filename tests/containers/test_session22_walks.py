"""Session 22, side by side with tensordict 0.15.3: walks over a tree go node by node and
hand the rest of the work to a nested collection's own method, so that a lazy stack
nested in a TensorDict (members alike or of different shapes), a tensorclass, or a
TensorDict subclass at the root are written, selected and compared as tensordict does:
``zero_``/``fill_`` reach a nested lazy stack's members, ``exclude``/``select`` of a key
through a lazy stack, a tensorclass or below a subclass root, and ``update``,
``update_``, ``copy_``, ``==``, ``torch.stack`` and ``rename_key_`` with a lazy stack
whose members' shapes differ."""
from __future__ import annotations

import pytest
import torch

import shared_td
from tests.reference import LIBS, tensordict

@shared_td.tensorclass
class OursTC:
    a: torch.Tensor
    s: str


if tensordict is not None:
    @tensordict.tensorclass
    class TheirsTC:
        a: torch.Tensor
        s: str


def _tc(lib):
    return OursTC if lib is shared_td else TheirsTC


def _lazy(lib, *shapes, **extra):
    """A lazy stack (stack_dim 0) of one member per shape, each holding ``c`` of that shape."""
    members = [lib.TensorDict({"c": torch.full(shape, 3.0), **extra}, batch_size=[]) for shape in shapes]
    return lib.LazyStackedTensorDict(*members, stack_dim=0)


def _members(lazy, key="c"):
    return [m[key].tolist() for m in lazy.tensordicts]


# ---------------------------------------------------------------- zero_ / fill_ (finding 2)
@pytest.mark.parametrize("lib", LIBS)
def test_zero_reaches_the_members_of_a_nested_lazy_stack(lib):
    lz = _lazy(lib, (2,), (2,))
    td = lib.TensorDict({"x": torch.ones(2), "lz": lz}, batch_size=[2])
    td.zero_()
    assert td["x"].tolist() == [0.0, 0.0]
    assert _members(lz) == [[0.0, 0.0], [0.0, 0.0]]


@pytest.mark.parametrize("lib", LIBS)
def test_zero_with_a_ragged_nested_lazy_stack(lib):
    lz = _lazy(lib, (1,), (2,))
    td = lib.TensorDict({"x": torch.ones(2), "lz": lz}, batch_size=[2])
    td.zero_()
    assert _members(lz) == [[0.0], [0.0, 0.0]]


@pytest.mark.parametrize("lib", LIBS)
def test_fill_of_a_tensordict_holding_a_lazy_stack(lib):
    lz = _lazy(lib, (2,), (2,))
    td = lib.TensorDict({"outer": lib.TensorDict({"lz": lz, "y": torch.zeros(2)}, batch_size=[2])}, batch_size=[2])
    td.fill_("outer", 7)
    assert td["outer", "y"].tolist() == [7.0, 7.0]
    assert _members(lz) == [[7.0, 7.0], [7.0, 7.0]]


@pytest.mark.parametrize("lib", LIBS)
def test_fill_of_a_key_inside_a_lazy_stack(lib):
    lz = _lazy(lib, (1,), (1,))
    td = lib.TensorDict({"lz": lz}, batch_size=[2])
    td.fill_(("lz", "c"), 7)
    assert _members(lz) == [[7.0], [7.0]]


def test_fill_of_a_missing_key_names_it():
    td = shared_td.TensorDict({"lz": _lazy(shared_td, (1,), (1,))}, batch_size=[2])
    with pytest.raises(KeyError, match="'lz', 'zz'"):
        td.fill_(("lz", "zz"), 7)


# ---------------------------------------------------------------- exclude / select (finding 3)
@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("inplace", [False, True])
def test_exclude_below_a_subclass_root(lib, inplace):
    class MyTD(lib.TensorDict):
        pass

    nxt = lib.TensorDict(obs=torch.ones(2), reward=torch.ones(2), batch_size=[2])
    td = MyTD({"obs": torch.zeros(2), "next": nxt}, batch_size=[2])
    out = td.exclude(("next", "reward"), inplace=inplace)
    assert sorted(map(str, out.keys(True, True))) == ["('next', 'obs')", "obs"]
    assert type(out) is MyTD and (out is td) == inplace
    assert ("next", "reward") in td.keys(True) or inplace  # (a copy leaves self as it is)


@pytest.mark.parametrize("lib", LIBS)
def test_exclude_through_a_lazy_stack(lib):
    lz = _lazy(lib, (1,), (2,), b=torch.ones(()))
    td = lib.TensorDict({"x": torch.zeros(2), "lz": lz}, batch_size=[2])
    out = td.exclude(("lz", "b"))
    assert type(out["lz"]).__name__ == "LazyStackedTensorDict"
    assert sorted(map(str, out.keys(True, True))) == ["('lz', 'c')", "x"]
    assert [sorted(m.keys()) for m in lz.tensordicts] == [["b", "c"], ["b", "c"]]  # self kept
    td.exclude(("lz", "b"), inplace=True)
    assert [sorted(m.keys()) for m in lz.tensordicts] == [["c"], ["c"]]


@pytest.mark.parametrize("lib", LIBS)
def test_select_through_a_lazy_stack_shares_the_members_entries(lib):
    lz = _lazy(lib, (1,), (2,), b=torch.ones(()))
    td = lib.TensorDict({"x": torch.ones(2), "lz": lz}, batch_size=[2])
    ragged = td.select(("lz", "c"))  # (members of different shapes: no stacking)
    assert type(ragged["lz"]).__name__ == "LazyStackedTensorDict"
    assert list(ragged.keys(True, True)) == [("lz", "c")]
    selected = td.select("x", ("lz", "b"))
    selected["lz"].zero_()
    assert [m["b"].item() for m in lz.tensordicts] == [0.0, 0.0]


@pytest.mark.parametrize("lib", LIBS)
def test_exclude_and_select_through_a_tensorclass_keep_its_class(lib):
    tc = _tc(lib)(a=torch.ones(2, 2), s="q", batch_size=[2])
    td = lib.TensorDict({"x": torch.zeros(2), "tc": tc}, batch_size=[2])
    excluded = td.exclude(("tc", "a"))
    assert type(excluded["tc"]) is _tc(lib) and excluded["tc"].a is None and excluded["tc"].s == "q"
    assert tc.a is not None
    selected = td.select(("tc", "a"))
    assert type(selected["tc"]) is _tc(lib)
    assert selected["tc"].a is tc.a


def test_select_of_a_missing_nested_key_names_the_whole_key():
    td = shared_td.TensorDict({"n": {"y": torch.zeros(2)}}, batch_size=[2])
    with pytest.raises(KeyError, match="'n', 'q'"):
        td.select(("n", "q"))
    # not strict: the more specific key wins, and its branch is kept emptied (as tensordict 0.15.3)
    assert list(td.select(("n", "q"), "n", strict=False).keys(True)) == ["n"]


# ---------------------------------------------------------------- a ragged nested lazy stack (finding 5)
def _holding_ragged(lib):
    lz = _lazy(lib, (1,), (2,))
    return lib.TensorDict({"x": torch.zeros(2), "lz": lz}, batch_size=[2]), lz


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("method", ["update", "update_", "copy_"])
def test_update_with_a_ragged_nested_lazy_stack(lib, method):
    td, lz = _holding_ragged(lib)
    kept = lz.tensordicts[1]["c"]
    getattr(td, method)(td.clone().apply(lambda t: t + 1))
    assert td["x"].tolist() == [1.0, 1.0]
    assert _members(lz) == [[4.0], [4.0, 4.0]]
    assert (lz.tensordicts[1]["c"] is kept) == (method != "update")  # (update replaces, update_ writes in place)


@pytest.mark.parametrize("lib", LIBS)
def test_update_of_selected_keys_inside_a_ragged_nested_lazy_stack(lib):
    td, lz = _holding_ragged(lib)
    td.update(td.clone().apply(lambda t: t + 5), keys_to_update=[("lz", "c")])
    assert td["x"].tolist() == [0.0, 0.0] and _members(lz) == [[8.0], [8.0, 8.0]]


@pytest.mark.parametrize("lib", LIBS)
def test_apply__with_a_ragged_nested_lazy_stack(lib):
    td, lz = _holding_ragged(lib)
    td.apply_(lambda t: t.add_(1))
    assert _members(lz) == [[4.0], [4.0, 4.0]]


@pytest.mark.parametrize("lib", LIBS)
def test_eq_with_a_ragged_nested_lazy_stack(lib):
    td, _ = _holding_ragged(lib)
    result = td == td.clone()
    assert type(result["lz"]).__name__ == "LazyStackedTensorDict" and result["lz"].batch_size == torch.Size([2])
    assert result.all()
    assert not (td != td.clone()).any()
    assert type((td == 3)["lz"]).__name__ == "LazyStackedTensorDict" and (td == 3)["lz"].all()


def test_eq_with_a_batch_tensor_lines_it_up_with_each_members_rows():
    """(tensordict 0.15.3 raises for a ragged stack: each member compares with its row)"""
    lz = shared_td.LazyStackedTensorDict(shared_td.TensorDict(c=torch.zeros(3)), shared_td.TensorDict(c=torch.ones(3)),
                                         stack_dim=0)
    td = shared_td.TensorDict({"lz": shared_td.lazy_stack([lz, lz.clone()], 1), "x": torch.zeros(2, 3)}, batch_size=[2])
    result = td == torch.tensor([0.0, 1.0])
    assert result["x"].tolist() == [[True] * 3, [False] * 3]
    assert result["lz"].batch_size == torch.Size([2, 2]) and result["lz"].all()


@pytest.mark.parametrize("lib", LIBS)
def test_torch_stack_of_tensordicts_holding_a_ragged_lazy_stack(lib):
    td, lz = _holding_ragged(lib)
    out = torch.stack([td, td.clone()], 0)
    assert type(out).__name__ == "TensorDict" and out.batch_size == torch.Size([2, 2])
    assert type(out["lz"]).__name__ == "LazyStackedTensorDict" and out["lz"].batch_size == torch.Size([2, 2])
    assert out["x"].shape == torch.Size([2, 2])


def test_torch_stack_still_names_a_dense_leaf_of_another_shape():
    td, _ = _holding_ragged(shared_td)
    td["n"] = shared_td.TensorDict(y=torch.zeros(2, 3), batch_size=[2])
    other = td.clone()
    other["n", "y"] = torch.zeros(2, 4)
    with pytest.raises(RuntimeError, match=r"\('n', 'y'\)"):
        torch.stack([td, other], 0)


@pytest.mark.parametrize("lib", LIBS)
def test_rename_key_of_a_ragged_lazy_stack(lib):
    lz = _lazy(lib, (1,), (2,), d=torch.zeros(()))
    kept = lz.tensordicts[1]["c"]
    lz.rename_key_("c", "r")
    assert [sorted(m.keys()) for m in lz.tensordicts] == [["d", "r"], ["d", "r"]]
    assert lz.tensordicts[1]["r"] is kept


def test_rename_key_through_a_nested_ragged_lazy_stack():
    """(tensordict 0.15.3 raises here: it stacks the entry)"""
    td, lz = _holding_ragged(shared_td)
    td.rename_key_(("lz", "c"), ("lz", "r"))
    assert [sorted(m.keys()) for m in lz.tensordicts] == [["r"], ["r"]]
    assert td.rename_key_(("lz", "r"), ("lz", "r"), safe=True) is td  # to itself: nothing, as tensordict
    with pytest.raises(KeyError, match="'lz', 'q'"):
        td.rename_key_(("lz", "q"), ("lz", "s"))
    assert [sorted(m.keys()) for m in lz.tensordicts] == [["r"], ["r"]]


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("args", [(torch.float64,), ("cpu",), ("cpu", torch.float16)])
@pytest.mark.parametrize("lazy", [False, True])
def test_to_of_a_locked_tensordict_gives_a_locked_copy(lib, args, lazy):
    """to(dtype) / to(device) of a locked tree (without a device: a new copy) is locked,
    its nested tensordicts too, as in tensordict 0.15.3 (ours came back unlocked)."""
    make = lambda: lib.TensorDict(a=torch.zeros(2), n=lib.TensorDict(b=torch.zeros(2), batch_size=[2]),
                                  batch_size=[2])
    td = (lib.lazy_stack([make(), make()]) if lazy else make()).lock_()
    moved = td.to(*args)
    assert moved is not td and moved.is_locked and moved["n"].is_locked
    assert not make().to(*args).is_locked


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("lazy", [False, True])
def test_to_of_an_unlocked_tree_with_a_locked_node_gives_an_unlocked_copy(lib, lazy):
    """Only the root decides the copy's lock, as in tensordict 0.15.3: a locked member of
    an unlocked lazy stack, or a locked nested tensordict of an unlocked root, was locked
    in the copy (its update raised)."""
    locked = lib.TensorDict(a=torch.zeros(2), batch_size=[2]).lock_()
    tree = (lib.lazy_stack([locked, lib.TensorDict(a=torch.zeros(2), batch_size=[2])]) if lazy
            else lib.TensorDict(n=locked, batch_size=[2]))
    moved = tree.to(torch.float64)
    nodes = moved.tensordicts if lazy else [moved["n"]]
    assert not moved.is_locked and not any(node.is_locked for node in nodes)
    moved.update({"a" if lazy else ("n", "a"): torch.ones(2, 2) if lazy else torch.ones(2)})


# ---------------------------------------------------------------- re-fuzz audit (session 22, round e)
def _alias_stacks(lib):
    """Lazy stacks that hold one member object twice: ``[m, m]``, ``[m, m, n]`` and a
    stack of two stacks of ``[m, n]``; returns ``(stack, [its distinct members])``."""
    m, n = (lib.TensorDict(t0=torch.zeros(()), t1=torch.ones(())) for _ in range(2))
    yield lib.lazy_stack([m, m]), [m]
    m, n = (lib.TensorDict(t0=torch.zeros(()), t1=torch.ones(())) for _ in range(2))
    yield lib.lazy_stack([m, m, n]), [m, n]
    m, n = (lib.TensorDict(t0=torch.zeros(()), t1=torch.ones(())) for _ in range(2))
    yield lib.lazy_stack([lib.lazy_stack([m, n]), lib.lazy_stack([m, n])]), [m, n]


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("nested", [False, True])
def test_rename_key_of_a_lazy_stack_holding_a_member_twice(lib, nested):
    """A member stacked twice renames once (ours renamed it, then raised a KeyError for
    the second time, leaving the members after it unrenamed)."""
    for lz, members in _alias_stacks(lib):
        if nested:
            lib.TensorDict(lz=lz, batch_size=lz.batch_size[:1]).rename_key_(("lz", "t0"), ("lz", "r"), safe=True)
        else:
            lz.rename_key_("t0", "r", safe=True)
        assert [sorted(m.keys()) for m in members] == [["r", "t1"]] * len(members)


@pytest.mark.parametrize("key", [("t0",), ("n", "t0")])
@pytest.mark.parametrize("alias", [False, True])
def test_rename_key_through_a_lazy_stack_with_a_locked_member_changes_nothing(key, alias):
    """(tensordict 0.15.3 raises too, after renaming in the members before the locked one;
    ours did the same: now every member's lock is checked first)"""
    a, b = (shared_td.TensorDict(t0=torch.zeros(()), n=shared_td.TensorDict(t0=torch.zeros(()))) for _ in range(2))
    (b["n"] if len(key) == 2 else b).lock_()
    root = shared_td.TensorDict(lz=shared_td.lazy_stack([a, a, b] if alias else [a, b]), batch_size=[3 if alias else 2])
    with pytest.raises(shared_td.LockedTensorDictError):
        root.rename_key_(("lz", *key), ("lz", *key[:-1], "r"))
    assert sorted(a.keys(True, True), key=str) == sorted(b.keys(True, True), key=str) == [("n", "t0"), "t0"]


def test_rename_key_into_a_locked_nested_tensordict_of_a_member_changes_nothing():
    """The tensordict that receives the new key is checked before any member renames
    (the first member renamed, then the second one's set raised)."""
    members = [shared_td.TensorDict(a=shared_td.TensorDict(x=torch.zeros(())), b=shared_td.TensorDict())
               for _ in range(2)]
    members[1]["b"].lock_()
    with pytest.raises(shared_td.LockedTensorDictError):
        shared_td.lazy_stack(members).rename_key_(("a", "x"), ("b", "x"))
    assert [list(m.keys(True, True)) for m in members] == [[("a", "x")]] * 2


def _field_s(tc):
    """What the tensorclass's field ``s`` holds: its value, and whether an entry stores it."""
    inner = tc._tensordict
    return tc.s, "s" in inner.keys()


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("how", ["update", "update_", "update_inplace"])
@pytest.mark.parametrize("held", ["p", None])
def test_update_with_none_for_a_tensorclass_field(lib, how, held):
    """None for a declared field (what to_dict() gives for an empty one): update empties
    the field, update_ leaves an empty one empty and writes one that holds a value, as
    tensordict 0.15.3 (ours: update_ raised a KeyError, update stored NonTensorData(None))."""
    td = lib.TensorDict(t0=torch.zeros(2), tc=_tc(lib)(a=torch.zeros(2, 2), s=held, batch_size=[2]), batch_size=[2])
    source = {"t0": torch.ones(2), "tc": {"a": torch.ones(2, 2), "s": None}}
    if how == "update_inplace":
        td.update(source, inplace=True)
    else:
        getattr(td, how)(source)
    assert td["t0"].tolist() == [1.0, 1.0] and td["tc"].a.tolist() == [[1.0, 1.0]] * 2
    assert _field_s(td["tc"]) == (None, how == "update_" and held is not None)


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("method", ["update", "update_"])
def test_to_dict_of_a_selection_of_a_tensorclass_updates_back(lib, method):
    td = lib.TensorDict(t0=torch.zeros(2), tc=_tc(lib)(a=torch.zeros(2, 2), s="p", batch_size=[2]), batch_size=[2])
    for part in (td.select(("tc", "a")), td.exclude(("tc", "s"))):
        copy = part.clone()
        getattr(copy, method)(part.to_dict())
        assert _field_s(copy["tc"]) == (None, False)


@pytest.mark.parametrize("lib", LIBS)
def test_update_emptying_a_field_of_a_locked_tensorclass_changes_nothing(lib):
    td = lib.TensorDict(tc=_tc(lib)(a=torch.zeros(2), s="p", batch_size=[2]), batch_size=[2]).lock_()
    with pytest.raises(RuntimeError, match="Cannot modify locked TensorDict"):
        td.update({"tc": {"a": torch.ones(2), "s": None}})
    assert td["tc"].a.tolist() == [0.0, 0.0] and td["tc"].s == "p"


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("key", [("a", "x"), ("lz", "c", "z")])
def test_fill_of_a_key_through_a_tensor_is_a_key_error(lib, key):
    """A ValueError as tensordict 0.15.3's (ours a KeyThroughLeafError, a KeyError too);
    ours raised an AttributeError: 'Tensor' object has no attribute 'get'."""
    td = lib.TensorDict(a=torch.zeros(2), lz=lib.lazy_stack([lib.TensorDict(c=torch.zeros(())) for _ in range(2)]),
                        batch_size=[2])
    with pytest.raises(KeyError if lib is shared_td else ValueError, match="is a Tensor, not a tensordict"):
        td.fill_(key, 1)
    if lib is shared_td:
        with pytest.raises(ValueError):
            td.fill_(key, 1)
    assert td["a"].tolist() == [0.0, 0.0] and td["lz", "c"].tolist() == [0.0, 0.0]


@pytest.mark.parametrize("op", ["zero_", "fill_"])
def test_zero_and_fill_refuse_a_read_only_member_before_writing(tmp_path, op):
    """A read-only (mode="r") member of a nested lazy stack is refused before any tensor
    is written (the tensors before it were written, then it raised)."""
    shared_td.TensorDict(c=torch.ones(3)).memmap(tmp_path / "m")
    writable = shared_td.TensorDict(c=torch.ones(3))
    read_only = shared_td.TensorDict.load_memmap(tmp_path / "m", mode="r")
    root = shared_td.TensorDict(a=torch.ones(2), lz=shared_td.lazy_stack([writable, read_only]))
    with pytest.raises(shared_td.ReadOnlyError, match=op):
        root.zero_() if op == "zero_" else root.fill_("lz", 0)
    assert root["a"].tolist() == [1.0, 1.0] and writable["c"].tolist() == [1.0] * 3


def test_zero_of_a_lazy_stack_refuses_a_read_only_member_before_writing(tmp_path):
    """The lazy stack's own zero_ (at the top): member by member, it zeroed the members
    before a read-only one, then raised."""
    shared_td.TensorDict(c=torch.ones(3)).memmap(tmp_path / "m")
    writable = shared_td.TensorDict(c=torch.ones(3))
    stack = shared_td.lazy_stack([writable, shared_td.TensorDict.load_memmap(tmp_path / "m", mode="r")])
    with pytest.raises(shared_td.ReadOnlyError, match="zero_"):
        stack.zero_()
    assert writable["c"].tolist() == [1.0] * 3
    shared_td.lazy_stack([writable, shared_td.TensorDict(c=torch.ones(3))]).zero_()
    assert writable["c"].tolist() == [0.0] * 3


@pytest.mark.parametrize("lib", LIBS)
def test_fill_of_a_lazy_stack(lib):
    """A lazy stack has fill_, as in tensordict 0.15.3 (it was an AttributeError): each
    member's tensor, or every tensor of a nested tensordict, filled; a missing key a KeyError."""
    members = [lib.TensorDict(c=torch.zeros(2), n=lib.TensorDict(x=torch.zeros(2), batch_size=[2]), batch_size=[2])
               for _ in range(2)]
    stack = lib.lazy_stack(members)
    assert stack.fill_("c", 1) is stack and stack.fill_("n", 3) is stack
    assert [m["c"].tolist() for m in members] == [[1.0, 1.0]] * 2
    assert [m["n", "x"].tolist() for m in members] == [[3.0, 3.0]] * 2
    with pytest.raises(KeyError):
        stack.fill_("zz", 1)
