"""Session 23, side by side with tensordict 0.15.3 (divergences a differential fuzzer
found): select of a key and a key inside it, tuples in a NonTensorStack, a tensorclass's
nested non-tensors (get, get_at), empty(recurse=True) of nested tensorclasses and lazy
stacks, and to_dict(retain_none=...)."""
from __future__ import annotations

import warnings
from typing import Any, Optional

import pytest
import torch

import shared_td
from tests.reference import LIBS, tensordict

@shared_td.tensorclass
class OursNote:
    val: torch.Tensor
    note: Any
    opt: Optional[torch.Tensor] = None


@shared_td.tensorclass
class OursHolder:
    obs: torch.Tensor
    info: Any
    inner: shared_td.TensorDict
    child: OursNote


if tensordict is not None:
    @tensordict.tensorclass
    class TheirsNote:
        val: torch.Tensor
        note: Any
        opt: Optional[torch.Tensor] = None

    @tensordict.tensorclass
    class TheirsHolder:
        obs: torch.Tensor
        info: Any
        inner: tensordict.TensorDict
        child: TheirsNote


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (tensordict's FutureWarnings)
        yield


def _note(lib, note="nn"):
    cls = OursNote if lib is shared_td else TheirsNote
    return cls(val=torch.zeros(2), note=note, batch_size=[2])


def _holder(lib):
    """A tensorclass whose field ``inner`` (a TensorDict) holds non-tensors, one nested
    deeper, and a tensorclass; its field ``child`` is a tensorclass."""
    cls = OursHolder if lib is shared_td else TheirsHolder
    inner = lib.TensorDict({"s": lib.NonTensorStack("p", "q"), "d": lib.NonTensorData("z", batch_size=[2]),
                            "t": torch.ones(2), "n": {"m": lib.NonTensorStack("u", "v")},
                            "x": _note(lib, "deep")}, [2])
    return cls(obs=torch.zeros(2), info="x", inner=inner, child=_note(lib), batch_size=[2])


def _keys(td):
    return sorted(map(str, td.keys(True)))


def _tree(lib):
    return lib.TensorDict({"b": {"a": torch.zeros(2), "c": torch.ones(2), "d": {"e": torch.ones(2)}},
                           "x": torch.ones(2)}, [2])


# ---------------------------------------------------------------- A2: select / exclude
SELECTIONS = [
    ("b", ("b", "a")),
    (("b", "a"), "b"),
    ("b", ("b", "d", "e")),
    (("b", "d"), ("b", "d", "e")),
    ("b", ("b", "d")),
]
EXPECTED_SELECT = [
    ["('b', 'a')", "b"],
    ["('b', 'a')", "b"],
    ["('b', 'd')", "('b', 'd', 'e')", "b"],
    ["('b', 'd')", "('b', 'd', 'e')", "b"],
    ["('b', 'd')", "('b', 'd', 'e')", "b"],
]


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("keys,expected", list(zip(SELECTIONS, EXPECTED_SELECT)), ids=str)
def test_select_the_more_specific_key_wins(lib, keys, expected):
    assert _keys(_tree(lib).select(*keys)) == expected
    in_place = _tree(lib)
    in_place.select(*keys, inplace=True)
    assert _keys(in_place) == expected
    assert _keys(lib.lazy_stack([_tree(lib), _tree(lib)]).select(*keys)) == expected


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("keys", SELECTIONS, ids=str)
def test_exclude_the_whole_key_wins(lib, keys):
    expected = ["('b', 'a')", "('b', 'c')", "b", "x"] if keys[0] == ("b", "d") else ["x"]
    assert _keys(_tree(lib).exclude(*keys)) == expected
    in_place = _tree(lib)
    in_place.exclude(*keys, inplace=True)
    assert _keys(in_place) == expected


@pytest.mark.parametrize("lib", LIBS)
def test_select_not_strict_with_a_key_inside_the_whole_one(lib):
    assert _keys(_tree(lib).select("b", ("b", "a"), ("b", "zz"), strict=False)) == ["('b', 'a')", "b"]
    assert _keys(_tree(lib).select(("zz", "q"), ("x", "q"), strict=False)) == []
    with pytest.raises(KeyError):
        _tree(lib).select("b", ("b", "zz"))


@pytest.mark.parametrize("lib", LIBS)
def test_select_of_a_tensorclass_field_and_a_key_inside_it(lib):
    out = _holder(lib).select("inner", ("inner", "t"))
    assert _keys(out.inner) == ["t"]


# ---------------------------------------------------------------- A3: tuples are values
@pytest.mark.parametrize("lib", LIBS)
def test_a_tuple_in_a_nontensor_stack_is_one_value(lib):
    stack = lib.NonTensorStack.from_list([("a", 1), ("b", 2)])
    assert tuple(stack.batch_size) == (2,) and stack.tolist() == [("a", 1), ("b", 2)]
    outer_tuple = lib.NonTensorStack.from_list((("a", 1), ("b", 2)))
    assert tuple(outer_tuple.batch_size) == (2,)
    lists = lib.NonTensorStack.from_list((["a", 1], ["b", 2]))  # (lists nest, inside a tuple too)
    assert tuple(lists.batch_size) == (2, 2)
    in_lists = lib.NonTensorStack.from_list([[("a", 1), ("b", 2)], [("c", 1), ("d", 2)]])
    assert tuple(in_lists.batch_size) == (2, 2) and in_lists.tolist()[1][0] == ("c", 1)
    assert tuple(lib.NonTensorStack(("a", 1), ("b", 2)).batch_size) == (2,)


@pytest.mark.parametrize("lib", LIBS)
def test_a_list_of_tuples_set_in_a_tree_keeps_the_tuples(lib):
    td = lib.TensorDict({"x": [("a", 1), ("b", 2)]}, [2])
    assert tuple(td.get("x").batch_size) == (2,) and td.get("x").tolist() == [("a", 1), ("b", 2)]
    td["y"] = [("a", 1), ("b", 2, 3)]
    assert td[1]["y"] == ("b", 2, 3)


# ---------------------------------------------------------------- A4/B8: tensorclass get
@pytest.mark.parametrize("lib", LIBS)
def test_tensorclass_get_of_a_nontensor_below_a_field_gives_the_container(lib):
    tc = _holder(lib)
    assert type(tc.get(("inner", "s"))).__name__ == "NonTensorStack"
    assert type(tc.get(("inner", "d"))).__name__ == "NonTensorData"
    assert type(tc.get(("inner", "n", "m"))).__name__ == "NonTensorStack"
    assert type(tc.get(("inner", "x", "note"))).__name__ == "NonTensorData"
    assert type(tc.get(("inner", "s"), None)).__name__ == "NonTensorStack"
    assert type(tc[0].get(("inner", "s"))).__name__ == "NonTensorData"
    # a field of a tensorclass (here or in a nested one): its value, as before
    assert tc.get("info") == "x" and tc.get(("info",)) == "x"
    assert tc.get(("child", "note")) == "nn"
    assert tc.get(("inner", "zz"), "default") == "default"


@pytest.mark.parametrize("lib", LIBS)
def test_tensorclass_get_at_of_a_nested_nontensor(lib):
    tc = _holder(lib)
    assert tc.get_at(("inner", "s"), torch.tensor([1, 0])).tolist() == ["q", "p"]
    assert tc.get_at(("inner", "s"), 1).data == "q"
    assert tc.get_at(("inner", "n", "m"), 1).data == "v"
    assert tc.get_at(("inner", "d"), torch.tensor([1, 0])).tolist() == ["z", "z"]


@pytest.mark.parametrize("lib", LIBS)
def test_lazy_stack_of_tensorclasses_get_of_a_nested_field_gives_values(lib):
    stacked = lib.lazy_stack([_holder(lib), _holder(lib)])
    assert [list(row) for row in stacked.get(("child", "note"))] == [["nn", "nn"], ["nn", "nn"]]
    assert [list(row) for row in stacked.get("info")] == [["x", "x"], ["x", "x"]]


# ---------------------------------------------------------------- A5: empty(recurse=True)
def _mixed(lib):
    return lib.TensorDict({
        "s": "x", "t": torch.ones(2), "n": {"u": torch.ones(2, 3), "ns": "y", "e": {}},
        "c": _note(lib),
        "l": lib.lazy_stack([lib.TensorDict({"z": torch.zeros(()), "zs": "q"}),
                             lib.TensorDict({"z": torch.zeros(()), "w": torch.ones(())})]),
    }, [2])


def _summary(td):
    return [(str(k), type(td.get(k)).__name__.replace("Ours", "").replace("Theirs", ""),
             tuple(td.get(k).batch_size)) for k in td.keys(True)]


@pytest.mark.parametrize("lib", LIBS)
def test_empty_recurse_keeps_nested_tensorclasses_and_lazy_stacks(lib):
    source = _mixed(lib)
    out = source.empty(recurse=True)
    assert _summary(out) == [
        ("s", "NonTensorData", (2,)), ("('n', 'ns')", "NonTensorData", (2,)), ("('n', 'e')", "TensorDict", (2,)),
        ("n", "TensorDict", (2,)), ("('c', 'note')", "NonTensorData", (2,)), ("c", "Note", (2,)),
        ("l", "LazyStackedTensorDict", (2,)),
    ]
    assert [sorted(m.keys()) for m in out.get("l").tensordicts] == [["zs"], []]
    assert out.get("c").note == "nn" and out.get("c").val is None
    assert "val" in source.get("c").keys()  # (the source keeps its entries)
    assert _summary(lib.lazy_stack([_mixed(lib), _mixed(lib)]).empty(recurse=True))[4:6] == [
        ("('c', 'note')", "NonTensorStack", (2, 2)), ("c", "Note", (2, 2))]


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("size", [[], [5], [2, 3], [3, 2]], ids=str)
def test_empty_recurse_with_another_batch_size(lib, size):
    """Every nested collection kept must agree with the new batch size on the dims both
    have (a RuntimeError otherwise: the tree would be invalid); shorter nested
    tensordicts and tensorclasses get it, a lazy stack cannot."""
    cases = {
        "nested": lambda: lib.TensorDict({"n": {"u": torch.ones(2, 3), "m": {}}}, [2]),
        "longer": lambda: lib.TensorDict({"n": lib.TensorDict({"u": torch.ones(2, 3)}, [2, 3])}, [2]),
        "class": lambda: lib.TensorDict({"c": _note(lib)}, [2]),
        "lazy": lambda: lib.TensorDict({"l": lib.lazy_stack([lib.TensorDict(), lib.TensorDict()])}, [2]),
        "other": lambda: lib.TensorDict({"e": lib.TensorDict({}, [2, 4])}, [2]),
        "data": lambda: lib.TensorDict({"s": "x", "t": torch.ones(2)}, [2]),
    }
    expected = {
        (): {"nested": [("('n', 'm')", "TensorDict", (2,)), ("n", "TensorDict", (2,))],
             "longer": [("n", "TensorDict", (2, 3))],
             "class": [("('c', 'note')", "NonTensorData", (2,)), ("c", "Note", (2,))],
             "lazy": [("l", "LazyStackedTensorDict", (2,))], "other": [("e", "TensorDict", (2, 4))],
             "data": [("s", "NonTensorData", (2,))]},
        (2, 3): {"nested": [("('n', 'm')", "TensorDict", (2, 3)), ("n", "TensorDict", (2, 3))],
                 "longer": [("n", "TensorDict", (2, 3))],
                 "class": [("('c', 'note')", "NonTensorData", (2, 3)), ("c", "Note", (2, 3))],
                 "lazy": "error", "other": "error", "data": [("s", "NonTensorData", (2, 3))]},
    }.get(tuple(size), {name: "error" for name in cases if name != "data"})
    for name, make in cases.items():
        if name not in expected:
            continue  # (a non-tensor that disagrees: see the next test)
        try:
            got = _summary(make().empty(recurse=True, batch_size=size))
        except RuntimeError:
            got = "error"
        assert got == expected[name], name


def test_empty_recurse_with_another_batch_size_keeps_rebatching_a_nontensor_value():
    """shared_td's own (tensordict 0.15.3 raises a RuntimeError): a NonTensorData that
    disagrees with the new batch size is re-batched and a NonTensorStack left out, as
    before; only nested collections, whose tree would be invalid, are refused."""
    td = shared_td.TensorDict({"s": "x", "st": shared_td.NonTensorStack("a", "b")}, [2])
    out = td.empty(recurse=True, batch_size=[5])
    assert _summary(out) == [("s", "NonTensorData", (5,))]
    with pytest.raises(RuntimeError, match="'n'"):
        shared_td.TensorDict({"n": {}}, [2]).empty(recurse=True, batch_size=[5])


# ---------------------------------------------------------------- B3: to_dict(retain_none)
def _with_nones(lib):
    td = lib.TensorDict({"a": torch.zeros(2), "n": {"m": torch.ones(2)}, "c": _note(lib, None),
                         "st": lib.NonTensorStack(None, None), "sm": lib.NonTensorStack(None, "a"), "e": {}}, [2])
    td.set_non_tensor("none", None)
    td.set_non_tensor(("n", "none"), None)
    td.set_non_tensor("x", "y")
    return td


@pytest.mark.parametrize("lib", LIBS)
def test_to_dict_retain_none(lib):
    kept = _with_nones(lib).to_dict(retain_none=True)
    assert sorted(kept) == sorted(_with_nones(lib).to_dict()) == ["a", "c", "e", "n", "none", "sm", "st", "x"]
    assert kept["none"] is None and kept["n"]["none"] is None and kept["st"] == [None, None]
    assert kept["c"]["note"] is None and kept["c"]["opt"] is None
    dropped = _with_nones(lib).to_dict(retain_none=False)
    assert sorted(dropped) == ["a", "c", "e", "n", "sm", "x"]
    assert sorted(dropped["n"]) == ["m"] and sorted(dropped["c"]) == ["val"]
    assert dropped["sm"] == [None, "a"] and dropped["e"] == {}
    stacked = lib.lazy_stack([_with_nones(lib), _with_nones(lib)])
    assert sorted(stacked.to_dict(retain_none=False)) == ["a", "c", "e", "n", "sm", "x"]
    assert sorted(stacked.to_dict(retain_none=True)) == ["a", "c", "e", "n", "none", "sm", "st", "x"]
    assert sorted(stacked.to_dict(retain_none=False)["c"]) == ["val"]
    assert sorted(lib.TensorDict({"c": _note(lib, None)}, [2]).to_dict(retain_none=False)["c"]) == ["val"]
    with pytest.raises(TypeError):
        _with_nones(lib).to_dict(False)  # (keyword only, as in tensordict)


@pytest.mark.parametrize("lib", LIBS)
def test_tensorclass_to_dict_retain_none_reaches_its_nested_entries(lib):
    tc = _holder(lib)
    tc.inner.set_non_tensor("none", None)
    assert tc.to_dict(retain_none=True)["inner"]["none"] is None
    assert "none" not in tc.to_dict(retain_none=False)["inner"]


@pytest.mark.parametrize("lib", LIBS)
def test_to_dict_of_a_nontensor_entry_is_its_value(lib):
    assert lib.NonTensorData("x", batch_size=[2]).to_dict() == "x"
    assert lib.NonTensorData(None).to_dict(retain_none=False) is None
    assert lib.NonTensorStack(None, "a").to_dict() == [None, "a"]


@pytest.mark.parametrize("L", LIBS)
@pytest.mark.parametrize("kind", ["td", "lazy", "nested"])
def test_rename_key_to_itself_with_safe_changes_nothing(L, kind):
    """``rename_key_(k, k, safe=True)`` leaves the tree as it is, as tensordict 0.15.3
    (it raised KeyError "already present"; found by the fuzzer's second round); a locked
    tree still refuses it."""
    leaf = torch.arange(2.0)
    if kind == "lazy":
        td, key = L.lazy_stack([L.TensorDict(a=leaf.clone(), batch_size=[2]) for _ in range(2)]), "a"
    elif kind == "nested":
        td, key = L.TensorDict(n=L.TensorDict(a=leaf.clone(), batch_size=[2]), batch_size=[2]), ("n", "a")
    else:
        td, key = L.TensorDict(a=leaf.clone(), batch_size=[2]), "a"
    assert td.rename_key_(key, key, safe=True) is td
    assert td.get(key).tolist() == ([[0.0, 1.0]] * 2 if kind == "lazy" else [0.0, 1.0])
    assert sorted(map(str, td.keys(True, True))) == [str(key)]
    with pytest.raises(RuntimeError):
        L.TensorDict(a=leaf.clone(), batch_size=[2]).lock_().rename_key_("a", "a", safe=True)
