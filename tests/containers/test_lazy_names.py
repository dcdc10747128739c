"""The name of a lazy stack's own dim (``stack_dim_name``), side by side with tensordict 0.15.3.

Before, a lazy stack had no name of its own: ``lazy_stack(..., stack_dim_name=)`` was
refused (``TensorDict.lazy_stack`` dropped it silently), ``names`` could not be set, and
a save of a named stack (ours or tensordict's) lost the name on reading.

Where the two libraries differ on purpose (see ``LazyStackedTensorDict.names``): a
stack with no named dim has names None here, as our TensorDict (tensordict: all None);
names must be unique; ``torch.cat`` keeps the name (tensordict loses every name).
"""
from __future__ import annotations

import json
import os
import pickle

import pytest
import torch

import shared_td
from shared_td import LazyStackedTensorDict, TensorDict, lazy_stack
from shared_td.errors import FormatError


def _member(lib, names=None):
    return lib.TensorDict(x=torch.arange(6.0).reshape(3, 2), n={"y": torch.zeros(3)}, batch_size=[3], names=names)


def _stack(lib, dim=0, names=None, stack_dim_name="t"):
    return lib.lazy_stack([_member(lib, names), _member(lib, names)], dim=dim, stack_dim_name=stack_dim_name)


def _unnamed_as_none(names):
    """tensordict gives [None, ...] where we give None (see the module doc)."""
    return None if names is None or all(n is None for n in names) else list(names)


@pytest.fixture
def tensordict():
    return pytest.importorskip("tensordict")


# ------------------------------------------------------------------ names of a new stack
@pytest.mark.parametrize("dim", [0, 1, -1])
@pytest.mark.parametrize("member_names", [None, ["env"]])
def test_stack_dim_name_as_tensordict(tensordict, dim, member_names):
    ours, theirs = _stack(shared_td, dim, member_names), _stack(tensordict, dim, member_names)
    assert ours.names == theirs.names
    assert ours.stack_dim == theirs.stack_dim
    assert _unnamed_as_none(ours.tensordicts[0].names) == _unnamed_as_none(theirs.tensordicts[0].names)


def test_every_way_to_make_a_named_stack():
    members = [_member(shared_td), _member(shared_td)]
    made = [
        lazy_stack(members, 0, stack_dim_name="t"),
        LazyStackedTensorDict.lazy_stack(members, 0, stack_dim_name="t"),
        TensorDict.lazy_stack(members, 0, stack_dim_name="t"),  # forwarded, no longer dropped
        LazyStackedTensorDict(*members, stack_dim=0, stack_dim_name="t"),
    ]
    assert [stack.names for stack in made] == [["t", None]] * 4


def test_bad_stack_dim_name_refused():
    members = [_member(shared_td, ["env"]), _member(shared_td, ["env"])]
    with pytest.raises(TypeError, match="stack_dim_name must be a str"):
        lazy_stack(members, stack_dim_name=3)
    with pytest.raises(ValueError, match="'env' is already the name of a batch dim"):
        lazy_stack(members, stack_dim_name="env")


# ------------------------------------------------------------------ the setter
@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("names", [["t", "e"], [None, "e"], ["t", None], [None, None]])
def test_names_setter_as_tensordict(tensordict, dim, names):
    ours, theirs = _stack(shared_td, dim, stack_dim_name=None), _stack(tensordict, dim, stack_dim_name=None)
    ours.names = names
    theirs.names = names
    assert _unnamed_as_none(ours.names) == _unnamed_as_none(theirs.names)
    for mine, their in zip(ours.tensordicts, theirs.tensordicts):
        assert _unnamed_as_none(mine.names) == _unnamed_as_none(their.names)
        assert _unnamed_as_none(mine["n"].names) == _unnamed_as_none(their["n"].names)


def test_names_none_unnames_every_dim():
    stack = _stack(shared_td, names=["env"])
    stack.names = None
    assert stack.names is None and stack.tensordicts[1].names is None


def test_names_setter_works_locked_as_tensordict(tensordict):
    ours, theirs = _stack(shared_td, stack_dim_name=None).lock_(), _stack(tensordict, stack_dim_name=None).lock_()
    ours.names = theirs.names = ["t", "e"]
    assert ours.names == theirs.names


def test_names_setter_wrong_length_as_tensordict(tensordict):
    theirs = _stack(tensordict)
    with pytest.raises(Exception) as raised:
        theirs.names = ["t"]
    with pytest.raises(type(raised.value), match="1 names"):
        _stack(shared_td).names = ["t"]


def test_names_setter_checks_every_member_before_renaming_any():
    first = _member(shared_td)
    second = _member(shared_td)
    second["deep"] = TensorDict(z=torch.zeros(3, 4), batch_size=[3, 4], names=[None, "f"])
    stack = lazy_stack([first, second], stack_dim_name="t")
    with pytest.raises(RuntimeError, match="used twice"):
        stack.names = ["u", "f"]  # second's nested dims would be named ["f", "f"]
    assert stack.names == ["t", None] and first.names is None and second["deep"].names == [None, "f"]
    with pytest.raises(ValueError, match="unique"):
        stack.names = ["u", "u"]


def test_parent_naming_the_leading_dims_checked():
    """NamedBatchDims's protocol (how a parent names its children's leading dims): a name
    given to the stack dim that a member's dim has already is refused, nothing renamed."""
    stack = _stack(shared_td, 0, ["env"], stack_dim_name=None)
    with pytest.raises(RuntimeError, match="'env', the name of its stack dim"):
        stack._rename_leading(["env"], check_only=True)
    assert stack.names == [None, "env"]
    stack._rename_leading(["time"], check_only=False)
    assert stack.names == ["time", "env"] and stack.tensordicts[0].names == ["env"]


def test_refine_names_as_tensordict(tensordict):
    ours, theirs = _stack(shared_td, stack_dim_name=None), _stack(tensordict, stack_dim_name=None)
    assert ours.refine_names("t", "e") is ours
    theirs.refine_names("t", "e")
    assert ours.names == theirs.names == ["t", "e"]
    assert ours.tensordicts[0].names == theirs.tensordicts[0].names == ["e"]


# ------------------------------------------------------------------ what keeps the name
_OPS = {
    "index_slice": lambda s: s[1:],
    "index_tensor": lambda s: s[torch.tensor([1, 0])],
    "index_mask": lambda s: s[torch.tensor([True, False])],
    "index_other_dim": lambda s: s[..., 0],
    "slice_other_dim": lambda s: s[:, :2],
    "unsqueeze_0": lambda s: s.unsqueeze(0),
    "unsqueeze_last": lambda s: s.unsqueeze(-1),
    "permute": lambda s: s.permute(1, 0),
    "expand": lambda s: s.expand(4, 2, 3),
    "clone": lambda s: s.clone(),
    "to": lambda s: s.to(torch.float64),
    "apply": lambda s: s.apply(lambda x: x + 1),
    "select": lambda s: s.select("x"),
    "exclude": lambda s: s.exclude("x"),
    "empty": lambda s: s.empty(),
    "nested_get": lambda s: s.get("n"),
    "split": lambda s: s.split(1, 0)[1],
    "reshape": lambda s: s.reshape(6),
    "pickle": lambda s: pickle.loads(pickle.dumps(s)),
    "consolidate": lambda s: s.consolidate(),
}


@pytest.mark.parametrize("op", sorted(_OPS))
@pytest.mark.parametrize("member_names", [None, ["env"]])
def test_operations_keep_or_drop_the_name_as_tensordict(tensordict, op, member_names):
    ours = _OPS[op](_stack(shared_td, names=member_names))
    theirs = _OPS[op](_stack(tensordict, names=member_names))
    assert _unnamed_as_none(ours.names) == _unnamed_as_none(theirs.names)


@pytest.mark.parametrize("batch_size,names,shape", [([3], ["env"], (4, 3)), ([3], ["env"], (3,)),
                                                    ([1, 3], ["a", "env"], (2, 4, 3))])
def test_expand_of_a_tensordict_keeps_its_names_as_tensordict(tensordict, batch_size, names, shape):
    """What a lazy stack's expand gives its members: before, the names were dropped."""
    ours = TensorDict(x=torch.zeros(*batch_size), n={"y": torch.zeros(*batch_size)}, batch_size=batch_size, names=names)
    theirs = tensordict.TensorDict(x=torch.zeros(*batch_size), batch_size=batch_size, names=names)
    assert ours.expand(*shape).names == theirs.expand(*shape).names
    assert ours.expand(*shape)["n"].names == theirs.expand(*shape).names


def test_cat_keeps_the_name():
    stack = _stack(shared_td)
    assert torch.cat([stack, stack], 0).names == ["t", None]
    assert torch.cat([stack, stack], 1).names == ["t", None]


# ------------------------------------------------------------------ saved and read
@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("writer,reader", [("shared_td", "shared_td"), ("tensordict", "shared_td"),
                                           ("shared_td", "tensordict")])
def test_memmap_load_round_trip_across_libraries(tmp_path, tensordict, dim, writer, reader):
    libs = {"shared_td": shared_td, "tensordict": tensordict}
    written = _stack(libs[writer], dim, ["env"])
    written.memmap(tmp_path / "s")
    with open(tmp_path / "s" / "meta.json") as meta:
        assert json.load(meta)["stack_dim_name"] == "t"
    loaded = libs[reader].LazyStackedTensorDict.load_memmap(tmp_path / "s")
    assert loaded.names == written.names
    assert libs[reader].TensorDict.load_memmap(tmp_path / "s").names == written.names


def test_nested_stack_saved_and_read(tmp_path):
    parent = TensorDict(s=_stack(shared_td, 1), batch_size=[3])
    parent.memmap(tmp_path / "p")
    assert TensorDict.load_memmap(tmp_path / "p")["s"].names == [None, "t"]
    assert parent.memmap_like(tmp_path / "like")["s"].names == [None, "t"]
    parent.save(tmp_path / "saved")
    assert TensorDict.load(tmp_path / "saved")["s"].names == [None, "t"]


def test_memmap_in_place_keeps_the_name(tmp_path):
    stack = _stack(shared_td)
    stack.memmap_(tmp_path / "s")
    assert stack.names == ["t", None]
    assert TensorDict.load_memmap(tmp_path / "s").names == ["t", None]


@pytest.mark.parametrize("writer,reader", [("shared_td", "shared_td"), ("tensordict", "shared_td"),
                                           ("shared_td", "tensordict")])
def test_consolidated_file_across_libraries(tmp_path, tensordict, writer, reader):
    libs = {"shared_td": shared_td, "tensordict": tensordict}
    _stack(libs[writer], 1).consolidate(filename=tmp_path / "s.bin")
    assert libs[reader].TensorDict.from_consolidated(tmp_path / "s.bin").names == [None, "t"]


def test_bad_stack_dim_name_in_meta_json_is_a_format_error(tmp_path):
    _stack(shared_td).memmap(tmp_path / "s")
    path = tmp_path / "s" / "meta.json"
    with open(path) as meta:
        document = json.load(meta)
    document["stack_dim_name"] = 3
    with open(path, "w") as meta:
        json.dump(document, meta)
    with pytest.raises(FormatError, match="stack_dim_name") as raised:
        TensorDict.load_memmap(tmp_path / "s")
    assert os.fspath(path) in str(raised.value)


# ------------------------------------------------------------------ a parent's names
def _named_parent_cases(lib) -> dict:
    """What each way of putting a lazy stack (or a named TensorDict) under a named
    parent gives: the child's names, or the class of the error."""
    def outcome(make):
        try:
            return _unnamed_as_none(make())
        except Exception as error:  # noqa: BLE001 - the class is what is compared
            return type(error).__name__

    def renamed_parent():
        parent = lib.TensorDict(s=_stack(lib, stack_dim_name=None), batch_size=[2])
        parent.names = ["q"]
        return parent["s"].names

    def set_into_named(stack_dim_name):
        parent = lib.TensorDict(batch_size=[2], names=["q"])
        parent["s"] = _stack(lib, stack_dim_name=stack_dim_name)
        return parent["s"].names

    return {
        "parent renamed": outcome(renamed_parent),
        "unnamed stack set into a named parent": outcome(lambda: set_into_named(None)),
        "named stack set into a parent named otherwise": outcome(lambda: set_into_named("t")),
        "named stack given to a parent named otherwise": outcome(
            lambda: lib.TensorDict(s=_stack(lib), batch_size=[2], names=["q"])["s"].names),
        "named tensordict given to a parent named otherwise": outcome(
            lambda: lib.TensorDict(s=_member(lib, ["t"]), batch_size=[3], names=["q"])["s"].names),
        "unnamed tensordict given to a named parent": outcome(
            lambda: lib.TensorDict(s=_member(lib), batch_size=[3], names=["q"])["s"].names),
        "plain dict given to a named parent": outcome(
            lambda: lib.TensorDict({"s": {"x": torch.zeros(3)}}, batch_size=[3], names=["q"])["s"].names),
    }


def test_a_named_parent_names_a_lazy_stack_as_tensordict(tensordict):
    """A parent's names reach a lazy-stack child (they did not: the stack kept its own,
    unnamed or named otherwise), and names given to TensorDict() that clash with a
    child's are a RuntimeError (they silently renamed the child)."""
    ours = _named_parent_cases(shared_td)
    assert ours == _named_parent_cases(tensordict)
    assert ours["parent renamed"] == ["q", None]
    assert ours["named stack given to a parent named otherwise"] == "RuntimeError"


def _names_or_error(make):
    try:
        return make()
    except Exception as error:  # noqa: BLE001 - the class is what is compared
        return type(error).__name__


def test_members_named_otherwise_are_an_error_as_tensordict(tensordict):
    """A lazy stack whose members name their dims differently: ``names`` is a ValueError
    (it gave the first member's), so a named parent cannot silently rename the others;
    setting the stack's names mends it."""
    outcomes = []
    for lib in (shared_td, tensordict):
        lazy = lib.lazy_stack([_member(lib, ["e"]), _member(lib, ["f"])], 0)
        outcomes.append(_names_or_error(lambda: lazy.names))
        parent = lib.TensorDict(batch_size=[2], names=["q"])
        outcomes.append(_names_or_error(lambda: parent.set("s", lazy)))
    assert outcomes[:2] == outcomes[2:] == ["ValueError", "ValueError"]
    lazy = lazy_stack([_member(shared_td, ["e"]), _member(shared_td, ["f"])], 0)
    lazy.names = ["t", "env"]
    assert lazy.names == ["t", "env"] and [m.names for m in lazy.tensordicts] == [["env"], ["env"]]


def test_an_unnamed_parent_takes_a_named_childs_names_as_tensordict(tensordict):
    """Setting a named child into an unnamed tensordict names the tensordict and its
    other children (it stayed unnamed)."""
    outcomes = []
    for lib in (shared_td, tensordict):
        parent = lib.TensorDict(o=torch.zeros(3), u=lib.TensorDict(batch_size=[3]), batch_size=[3])
        parent["c"] = lib.TensorDict(x=torch.zeros(3, 2), batch_size=[3, 2], names=["t", "z"])
        parent["s"] = _stack(lib, dim=1, stack_dim_name=None)
        unnamed = lib.TensorDict(o=torch.zeros(3), batch_size=[3])
        unnamed["c"] = lib.TensorDict(x=torch.zeros(3, 2), batch_size=[3, 2], names=[None, "z"])
        clash = lib.TensorDict(u=lib.TensorDict(batch_size=[3], names=["k"]), batch_size=[3])
        outcomes.append([parent.names, parent["u"].names, parent["c"].names, parent["s"].names,
                         _unnamed_as_none(unnamed.names),
                         _names_or_error(lambda: clash.set("c", lib.TensorDict(batch_size=[3], names=["t"])))])
    assert outcomes[0] == outcomes[1]
    assert outcomes[0][:2] == [["t"], ["t"]]
