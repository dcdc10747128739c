"""Session 22, side by side with tensordict 0.15.3: a lazy stack of tensorclasses keeps
its members' classes through any index that selects whole members (what ``lazy[idx]``
gives and what its save writes), and a lazy stack's apply/named_apply take tensordict's
``default``, ``filter_empty``, ``out``, ``call_on_nested``, ``propagate_lock`` and
``names``."""
from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

import shared_td
from tests.reference import LIBS, needs_tensordict, tensordict

@shared_td.tensorclass
class OursA:
    x: torch.Tensor


@shared_td.tensorclass
class OursB:
    x: torch.Tensor
    y: torch.Tensor = None


if tensordict is not None:
    @tensordict.tensorclass
    class TheirsA:
        x: torch.Tensor

    @tensordict.tensorclass
    class TheirsB:
        x: torch.Tensor
        y: torch.Tensor = None


def _classes(lib):
    return (OursA, OursB) if lib is shared_td else (TheirsA, TheirsB)


def _class_name(value):
    return type(value).__name__.replace("Ours", "").replace("Theirs", "")


def _tc_stack(lib):
    """A lazy stack of tensorclasses A, B, A (member i holds i)."""
    a_cls, b_cls = _classes(lib)
    return lib.LazyStackedTensorDict(
        a_cls(x=torch.zeros(3), batch_size=[3]),
        b_cls(x=torch.ones(3), y=torch.ones(3), batch_size=[3]),
        a_cls(x=torch.full((3,), 2.0), batch_size=[3]),
    )


def _saved_types(path):
    """{directory: its class} of a save, the class names without Ours/Theirs."""
    found = {}
    for root, _, files in os.walk(path):
        if "meta.json" in files:
            with open(os.path.join(root, "meta.json")) as f:
                kind = json.load(f).get("_type", "?")
            found[os.path.relpath(root, path)] = kind.split(".")[-1].strip("'>").replace("Ours", "").replace(
                "Theirs", "")
    return found


# ------------------------------------------------------------ 1. indexing a stack of tensorclasses
WHOLE_MEMBERS = {
    "list": [1, 0],
    "tensor": torch.tensor([2, 0]),
    "mask": torch.tensor([True, True, False]),
    "mask_one_class": torch.tensor([True, False, True]),
    "twice": [0, 0],
    "twice_b": [1, 1],
    "step": slice(None, None, 2),
    "slice": slice(1, None),
    "full": slice(None),
    "reversed": slice(None, None, -1),
    "inside": (slice(None), 0),
    "inside_slice": (slice(None), slice(0, 2)),
    "new_dim": (None, [1, 0]),
}


def _index_outcome(lib, index, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = _tc_stack(lib)[index]
        result.memmap(tmp_path)
        loaded = lib.TensorDict.load_memmap(tmp_path)
    return _class_name(result), _saved_types(tmp_path), _class_name(loaded), result.batch_size


@needs_tensordict
@pytest.mark.parametrize("index", list(WHOLE_MEMBERS.values()), ids=list(WHOLE_MEMBERS))
def test_an_index_of_whole_members_keeps_their_tensorclasses_as_tensordict(index, tmp_path):
    ours = _index_outcome(shared_td, index, tmp_path / "ours")
    theirs = _index_outcome(tensordict, index, tmp_path / "theirs")
    assert ours == theirs
    assert any(kind in ("A", "B") for kind in ours[1].values())  # (the classes are there)


@pytest.mark.parametrize("lib", LIBS)
def test_a_mixed_reordering_saves_each_member_as_its_own_class(lib, tmp_path):
    reordered = _tc_stack(lib)[[1, 0]]
    reordered.memmap(tmp_path)
    assert _saved_types(tmp_path) == {".": "LazyStackedTensorDict", "0": "B", "0/_tensordict": "TensorDict",
                                      "1": "A", "1/_tensordict": "TensorDict"}
    loaded = lib.TensorDict.load_memmap(tmp_path)
    assert loaded["x"].tolist() == [[1.0] * 3, [0.0] * 3]


@pytest.mark.parametrize("lib", LIBS)
def test_members_of_one_class_selected_give_that_class_over_the_stack(lib):
    a_cls, _ = _classes(lib)
    for index in ([0, 0], slice(None, None, 2), torch.tensor([2, 0])):
        selected = _tc_stack(lib)[index]
        assert type(selected) is a_cls and isinstance(selected._tensordict, lib.LazyStackedTensorDict)
    assert _tc_stack(lib)[[2, 0]].x[:, 0].tolist() == [2.0, 0.0]


@pytest.mark.parametrize("lib", LIBS)
def test_lazy_i_gives_the_member_as_its_tensorclass(lib):
    a_cls, b_cls = _classes(lib)
    lazy = _tc_stack(lib)
    assert type(lazy[0]) is a_cls and type(lazy[1]) is b_cls and type(lazy[0, 1:]) is a_cls
    assert lazy[0, 1:].batch_size == torch.Size([2])
    lazy[1].x[0] = 7.0  # a view of the member: the write reaches the stack
    assert lazy["x"][1, 0].item() == 7.0
    assert [type(m) for m in lazy] == [a_cls, b_cls, a_cls]
    assert [type(m) for m in lazy.unbind(0)] == [a_cls, b_cls, a_cls]
    assert [type(m) for m in torch.unbind(lazy, 0)] == [a_cls, b_cls, a_cls]


@pytest.mark.parametrize("lib", LIBS)
def test_a_negative_step_at_the_stack_dim_reverses_the_members(lib):
    lazy = lib.LazyStackedTensorDict(*[lib.TensorDict(a=torch.full((2,), float(i)), batch_size=[2])
                                       for i in range(3)])
    assert lazy[::-1]["a"][:, 0].tolist() == [2.0, 1.0, 0.0]
    assert lazy[1::-1]["a"][:, 0].tolist() == [1.0, 0.0]
    assert lazy[::-2]["a"][:, 0].tolist() == [2.0, 0.0]
    with pytest.raises(ValueError, match="step must be greater than zero"):
        lazy[:, ::-1]  # (another dim: refused, as torch and tensordict refuse it)


def test_a_plain_stack_still_gives_its_members_themselves():
    lazy = shared_td.lazy_stack([shared_td.TensorDict(a=torch.zeros(2), batch_size=[2])] * 2)
    assert lazy[0] is lazy.tensordicts[0]
    assert type(lazy[0:1]) is shared_td.LazyStackedTensorDict


# ------------------------------------------------------------ 2. apply's options on a lazy stack
def _ragged(lib):
    """Members with different keys: member 0 has a and b, member 1 a only."""
    return lib.LazyStackedTensorDict(lib.TensorDict(a=torch.zeros(2), b=torch.ones(2), batch_size=[2]),
                                     lib.TensorDict(a=torch.ones(2), batch_size=[2]))


def _other(lib):
    return lib.LazyStackedTensorDict(lib.TensorDict(a=torch.full((2,), 5.0), batch_size=[2]),
                                     lib.TensorDict(a=torch.full((2,), 7.0), b=torch.full((2,), 9.0),
                                                    batch_size=[2]))


def _members(result):
    if result is None:
        return None
    return [{"/".join(k) if isinstance(k, tuple) else k: v.tolist() for k, v in m.items(True, True)}
            for m in result.tensordicts]


APPLY_CASES = {
    "default": lambda lib: lib.apply(lambda x, y: x + y, _other_of(lib), default=100),
    "named_default": lambda lib: lib.named_apply(lambda k, x, y: x + y, _other_of(lib), default=100),
    "all_none": lambda lib: lib.apply(lambda x: None),
    "all_none_keep": lambda lib: lib.apply(lambda x: None, filter_empty=False),
    "all_none_filter": lambda lib: lib.apply(lambda x: None, filter_empty=True),
    "some_none": lambda lib: lib.apply(lambda x: None if x.sum() == 0 else x),
    "member_none": lambda lib: lib.apply(lambda x: x if x.sum() == 0 else None),
    "member_none_filter": lambda lib: lib.apply(lambda x: x if x.sum() == 0 else None, filter_empty=True),
    "call_on_nested": lambda lib: lib.apply(lambda x: x * 2, call_on_nested=True),
}


def _other_of(lazy):
    return _other(shared_td if isinstance(lazy, shared_td.LazyStackedTensorDict) else tensordict)


@needs_tensordict
@pytest.mark.parametrize("case", list(APPLY_CASES.values()), ids=list(APPLY_CASES))
def test_apply_options_as_tensordict(case):
    assert _members(case(_ragged(shared_td))) == _members(case(_ragged(tensordict)))


@pytest.mark.parametrize("lib", LIBS)
def test_apply_default_fills_the_key_a_member_of_other_lacks(lib):
    result = _ragged(lib).apply(lambda x, y: x + y, _other(lib), default=100)
    assert _members(result) == [{"a": [5.0, 5.0], "b": [101.0, 101.0]}, {"a": [8.0, 8.0]}]
    with pytest.raises(KeyError):
        _ragged(lib).apply(lambda x, y: x + y, _other(lib))


@pytest.mark.parametrize("lib", LIBS)
def test_apply_of_a_stack_that_fn_empties_is_none(lib):
    assert _ragged(lib).apply(lambda x: None) is None
    assert _members(_ragged(lib).apply(lambda x: None, filter_empty=False)) == [{}, {}]
    # a member empty already is no member that fn emptied: an empty member, as with False
    partly = lib.LazyStackedTensorDict(lib.TensorDict(batch_size=[2]), lib.TensorDict(a=torch.ones(2), batch_size=[2]))
    assert _members(partly.apply(lambda x: None)) == [{}, {}]


@pytest.mark.parametrize("lib", LIBS)
def test_apply_out_writes_into_the_members_of_out(lib):
    out = _ragged(lib).clone().zero_()
    members = list(out.tensordicts)
    result = _ragged(lib).apply(lambda x: x + 1, out=out)
    assert list(result.tensordicts) == members and all(a is b for a, b in zip(result.tensordicts, members))
    assert _members(out) == [{"a": [1.0, 1.0], "b": [2.0, 2.0]}, {"a": [2.0, 2.0]}]
    with pytest.raises(ValueError, match="out must be a LazyStackedTensorDict"):
        _ragged(lib).apply(lambda x: x, out=lib.TensorDict(a=torch.zeros(2, 2), batch_size=[2, 2]))


@pytest.mark.parametrize("lib", LIBS)
def test_apply_out_stacked_along_another_dim_is_updated(lib):
    out = lib.LazyStackedTensorDict(*[lib.TensorDict(a=torch.zeros(2), batch_size=[2]) for _ in range(2)],
                                    stack_dim=1)
    assert _ragged(lib).select("a").apply(lambda x: x + 1, out=out) is out
    assert out["a"].tolist() == [[1.0, 1.0], [2.0, 2.0]]


def test_apply_out_returns_out_itself():
    # (tensordict 0.15.3 returns a new stack of out's members; the dense apply returns out)
    out = _ragged(shared_td).clone()
    assert _ragged(shared_td).apply(lambda x: x + 1, out=out) is out


@pytest.mark.parametrize("lib", LIBS)
def test_apply_call_on_nested_gives_fn_the_nested_tensordicts(lib):
    lazy = lib.LazyStackedTensorDict(
        lib.TensorDict(n=lib.TensorDict(a=torch.zeros(2), batch_size=[2]), batch_size=[2]),
        lib.TensorDict(n=lib.TensorDict(a=torch.ones(2), c=torch.ones(2), batch_size=[2]), batch_size=[2]))
    result = lazy.named_apply(lambda key, x: x.select("a") if key == "n" else x, call_on_nested=True)
    assert _members(result) == [{"n/a": [0.0, 0.0]}, {"n/a": [1.0, 1.0]}]


@pytest.mark.parametrize("lib", LIBS)
def test_apply_propagate_lock_and_names(lib):
    lazy = _ragged(lib).lock_()
    assert lazy.apply(lambda x: x + 1, propagate_lock=True).is_locked
    assert not lazy.apply(lambda x: x + 1).is_locked
    assert _ragged(lib).apply(lambda x: x, names=["s", "t"]).names == ["s", "t"]


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("option", [{"names": ["s", "t"]}, {"device": "cpu"}, {"batch_size": [2, 2]}])
def test_apply_inplace_takes_no_batch_size_names_or_device(lib, option):
    with pytest.raises(ValueError, match="inplace=True"):
        _ragged(lib).apply(lambda x: x, inplace=True, **option)


@pytest.mark.parametrize("method", ["apply", "named_apply"])
def test_is_leaf_is_still_refused_by_name(method):
    fn = (lambda x: x) if method == "apply" else (lambda key, x: x)
    with pytest.raises(TypeError, match=rf"^LazyStackedTensorDict\.{method}\(is_leaf=\.\.\.\)"):
        getattr(_ragged(shared_td), method)(fn, is_leaf=lambda cls: True)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'bogus'"):
        getattr(_ragged(shared_td), method)(fn, bogus=1)


@pytest.mark.parametrize("lib", LIBS)
def test_apply_of_a_stack_of_no_member_is_none(lib):
    assert lib.LazyStackedTensorDict(stack_dim=0, batch_size=[2]).apply(lambda x: x + 1) is None


@pytest.mark.parametrize("lib", LIBS)
def test_a_nested_stack_with_a_member_empty_already_is_kept_as_tensordict_keeps_it(lib):
    # (only a stack every member of which fn emptied is left out: one was empty already)
    partly = lib.LazyStackedTensorDict(lib.TensorDict(batch_size=[2]), lib.TensorDict(a=torch.ones(2), batch_size=[2]))
    emptied = lib.LazyStackedTensorDict(*[lib.TensorDict(a=torch.ones(2), batch_size=[2]) for _ in range(2)])
    keep_2d = lambda x: x if x.ndim == 2 and x.shape[1] == 2 else None  # noqa: E731
    for stack, expected in ((partly, ["b", "ls"]), (emptied, ["b"])):
        result = lib.TensorDict(ls=stack, b=torch.ones(2, 2), batch_size=[2]).apply(keep_2d)
        assert sorted(result.keys()) == expected


# ---------------------------------------------------------------- audit of 1b88c44 (round c)
def _post_init_class(lib, calls):
    @lib.tensorclass
    class Obs:
        x: torch.Tensor

        def __post_init__(self):
            calls.append(1)
            self.x = self.x.float()  # a __post_init__ that assigns a field
    return Obs


def _post_init_stack(lib, calls):
    Obs = _post_init_class(lib, calls)
    return lib.LazyStackedTensorDict(Obs(x=torch.zeros(3, dtype=torch.int64), batch_size=[3]),
                                     Obs(x=torch.ones(3, dtype=torch.int64), batch_size=[3]))


@pytest.mark.parametrize("lib", LIBS)
def test_reading_whole_members_runs_no_post_init(lib):
    # (1) tensordict gives the stored member back: its __post_init__ does not run again
    calls = []
    lazy = _post_init_stack(lib, calls)
    before = len(calls)
    lazy[0], list(lazy), lazy.unbind(0)
    assert len(calls) == before
    assert type(lazy[1]).__name__ == "Obs" and lazy[1].x.tolist() == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("what", ["lazy[0]", "iter", "unbind", "split", "write", "write rows", "write part"])
def test_a_locked_stack_whose_post_init_assigns_a_field_is_read_and_written(lib, what):
    # (1) share_memory_ locks the stack: a rebuilt member re-ran __post_init__, which raised
    lazy = _post_init_stack(lib, [])
    lazy.share_memory_()
    if what == "lazy[0]":
        assert lazy[0].x.tolist() == [0.0, 0.0, 0.0]
    elif what == "iter":
        assert [type(m).__name__ for m in lazy] == ["Obs", "Obs"]
    elif what == "unbind":
        assert len(lazy.unbind(0)) == 2
    elif what == "split":
        assert len(lazy.split(1)) == 2
    elif what == "write":
        lazy[0] = torch.full((3,), 5.0)
        assert lazy[0].x.tolist() == [5.0, 5.0, 5.0]
    elif what == "write rows":  # (the shapes of the rows written were read by lazy[0:2])
        lazy[0:2] = torch.full((2, 3), 6.0)
        assert lazy[1].x.tolist() == [6.0, 6.0, 6.0]
    else:
        lazy[0, 1:] = torch.full((2,), 7.0)
        assert lazy[0].x.tolist() == [0.0, 7.0, 7.0]


def test_a_locked_stack_whose_post_init_assigns_a_field_is_memmapped(tmp_path):
    # (1) memmap_ wrote each member as its class, rebuilt with __post_init__: it raised
    lazy = _post_init_stack(shared_td, [])
    lazy.memmap_(tmp_path / "saved")
    assert lazy.is_locked and lazy[1].x.tolist() == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("read", ["lazy[0]", "lazy[::1]", "list"])
def test_reading_a_frozen_member_does_not_lock_the_stack(lib, read):
    # (1) a frozen class's rebuild locked the member a read gave (a read had a side effect)
    @lib.tensorclass(frozen=True)
    class F:
        x: torch.Tensor
    lazy = lib.LazyStackedTensorDict(F(x=torch.zeros(3), batch_size=[3]), F(x=torch.ones(3), batch_size=[3]))
    for member in lazy.tensordicts:
        member.unlock_()
    {"lazy[0]": lambda: lazy[0], "lazy[::1]": lambda: lazy[::1], "list": lambda: list(lazy)}[read]()
    assert [member.is_locked for member in lazy.tensordicts] == [False, False]
    lazy["x"] = torch.full((2, 3), 5.0)  # (a field replaced: raised LockedTensorDictError)
    assert lazy[1].x.tolist() == [5.0] * 3


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("pieces", ["split(1)", "split([2, 1])", "chunk(3)", "tensor_split(3)"])
def test_split_pieces_of_a_tensorclass_stack_are_lazy_stacks_that_cat(lib, pieces):
    # (3) each piece was the members' tensorclass over a stack: torch.cat refused the mix
    A, B = _classes(lib)
    lazy = lib.LazyStackedTensorDict(A(x=torch.zeros(3), batch_size=[3]), B(x=torch.ones(3), batch_size=[3]),
                                     A(x=torch.full((3,), 2.0), batch_size=[3]))
    parts = {"split(1)": lambda: lazy.split(1), "split([2, 1])": lambda: lazy.split([2, 1]),
             "chunk(3)": lambda: lazy.chunk(3), "tensor_split(3)": lambda: lazy.tensor_split(3)}[pieces]()
    assert {type(part).__name__ for part in parts} == {"LazyStackedTensorDict"}
    assert parts[0]["x"][0].tolist() == [0.0, 0.0, 0.0]
    assert torch.cat(parts)["x"][:, 0].tolist() == [0.0, 1.0, 2.0]


def _stack_of_stacks(lib, inner_keys):
    def inner():
        return lib.LazyStackedTensorDict(*[lib.TensorDict({k: torch.ones(2) for k in keys}, batch_size=[2])
                                           for keys in inner_keys])
    return lib.LazyStackedTensorDict(inner(), inner())


def _nested_keys(result):
    return None if result is None else [[sorted(m.keys()) for m in member.tensordicts] for member in result.tensordicts]


@pytest.mark.parametrize("lib", LIBS)
def test_apply_keeps_nested_stacks_whose_members_hold_different_keys(lib):
    # (2) a nested stack's result (only the keys all its members share: none) counted as
    # emptied: its members' "b" and "c" were dropped, or the whole result was None
    lazy = _stack_of_stacks(lib, [("a", "b"), ("a", "c")])
    result = lazy.named_apply(lambda key, x: None if key == "a" else x)
    assert _nested_keys(result) == [[["b"], ["c"]], [["b"], ["c"]]]


@pytest.mark.parametrize("lib", LIBS)
def test_identity_apply_filter_empty_keeps_nested_stacks_of_disjoint_keys(lib):
    # (2) nothing emptied at all: the result was None
    lazy = _stack_of_stacks(lib, [("b",), ("c",)])
    assert _nested_keys(lazy.apply(lambda x: x, filter_empty=True)) == [[["b"], ["c"]], [["b"], ["c"]]]


@pytest.mark.parametrize("lib", LIBS)
def test_apply_emptying_every_nested_member_is_still_none(lib):
    lazy = _stack_of_stacks(lib, [("b",), ("c",)])
    assert lazy.apply(lambda x: None) is None


def test_a_tensorclass_member_and_what_lazy_i_gives_are_in_the_stack():
    # (7) `member in lazy` is identity with a member (lazy.py's documented difference:
    # tensordict 0.15.3 raises its NestedKey RuntimeError for any tensorclass operand):
    # the tensorclass given and what lazy[0] gives were not found
    given = OursA(x=torch.zeros(2), batch_size=[2])
    lazy = shared_td.LazyStackedTensorDict(given, OursA(x=torch.ones(2), batch_size=[2]))
    assert given in lazy and lazy[0] in lazy and all(member in lazy for member in lazy)
    assert lazy.tensordicts[1] in lazy and OursA(x=torch.zeros(2), batch_size=[2]) not in lazy


def _plus_one(value):
    return value.apply(lambda leaf: leaf + 1) if hasattr(value, "batch_size") else value + 1


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("kind", ["TensorDict", "lazy", "locked"])
def test_apply_inplace_call_on_nested_writes_fn_results_into_self(lib, kind):
    # (4) the results were built and dropped: self came back unchanged
    def td():
        return lib.TensorDict(a=torch.zeros(2), n=lib.TensorDict(b=torch.zeros(2), batch_size=[2]), batch_size=[2])
    target = lib.LazyStackedTensorDict(td(), td()) if kind == "lazy" else td()
    if kind == "locked":
        target.lock_()
    a, nested = target["a"], target["n"]
    assert target.apply(_plus_one, inplace=True, call_on_nested=True) is target
    assert target["a"].flatten().tolist() == [1.0] * target["a"].numel()
    assert target["n", "b"].flatten().tolist() == [1.0] * target["n", "b"].numel()
    if kind != "lazy":  # written in place: the tensors and the nested tensordict held before
        assert a.tolist() == [1.0, 1.0] and target["n"] is nested


def _numbered(lib, count, stack_dim=0, size=2):
    return lib.LazyStackedTensorDict(*[lib.TensorDict(a=torch.full((size,), float(i)), batch_size=[size])
                                       for i in range(count)], stack_dim=stack_dim)


@pytest.mark.parametrize("out_count, out_dim, out_size", [(1, 0, 2), (3, 0, 2), (2, 1, 7)])
def test_apply_out_that_cannot_take_the_result_is_refused_before_any_write(out_count, out_dim, out_size):
    # (5) fewer members: out's first member written, then a bare IndexError (tensordict's
    # too); more: out returned with a batch size that is not the result's (tensordict
    # gives a stack of out's first members): a BatchSizeMismatchError (a ValueError) now
    out = _numbered(shared_td, out_count, out_dim, out_size)
    before = out["a"].clone()
    with pytest.raises(ValueError, match="out has batch size"):
        _numbered(shared_td, 2).apply(lambda x: x + 10, out=out)
    assert torch.equal(out["a"], before)


@pytest.mark.parametrize("lib", LIBS)
def test_apply_out_takes_names_and_propagate_lock(lib):
    # (5) names= and propagate_lock= were ignored when out= was given
    out = _numbered(lib, 2).clone()
    result = _numbered(lib, 2).apply(lambda x: x + 1, out=out, names=["s", "t"])
    assert result.names == ["s", "t"]
    locked = _numbered(lib, 2).lock_()
    assert locked.apply(lambda x: x + 1, out=_numbered(lib, 2).clone(), propagate_lock=True).is_locked


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("option", ["names", "device"])
def test_apply_inplace_takes_names_or_device_none(lib, option):
    # (5) None asks for nothing: tensordict takes it with inplace=True, shared_td raised
    lazy = _numbered(lib, 2)
    assert lazy.apply(lambda x: x + 1, inplace=True, **{option: None}) is lazy
    assert lazy["a"][:, 0].tolist() == [1.0, 2.0]


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("case", ["read [::-1, [1, 0]]", "write tensor", "write number", "write [::-1, [1, 0]]",
                                  "write stack_dim=1"])
def test_a_negative_step_at_the_stack_dim_in_writes_and_beside_an_index_tensor(lib, case):
    # (6) only a read of lazy[::-1] alone took it: these raised "step must be greater than zero"
    stack_dim = 1 if case == "write stack_dim=1" else 0
    lazy = lib.LazyStackedTensorDict(*[lib.TensorDict(a=torch.full((2,), float(i)), batch_size=[2]) for i in range(3)],
                                     stack_dim=stack_dim)
    if case == "read [::-1, [1, 0]]":
        assert lazy[::-1, [1, 0]]["a"].tolist() == [[2.0, 2.0], [1.0, 1.0], [0.0, 0.0]]
        return
    if case == "write tensor":
        lazy[::-1] = torch.tensor([[5.0], [6.0], [7.0]])
    elif case == "write number":
        lazy[::-1] = 0.0
    elif case == "write [::-1, [1, 0]]":
        lazy[::-1, [1, 0]] = torch.tensor([[5.0, 6.0], [7.0, 8.0], [9.0, 10.0]])
    else:
        lazy[:, ::-1] = torch.tensor([5.0, 6.0, 7.0])
    expected = {"write tensor": [[7.0, 7.0], [6.0, 6.0], [5.0, 5.0]], "write number": [[0.0, 0.0]] * 3,
                "write [::-1, [1, 0]]": [[10.0, 9.0], [8.0, 7.0], [6.0, 5.0]],
                "write stack_dim=1": [[7.0, 6.0, 5.0], [7.0, 6.0, 5.0]]}[case]
    assert lazy["a"].tolist() == expected
