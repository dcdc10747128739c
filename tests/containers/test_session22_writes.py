"""Session 22, side by side with tensordict 0.15.3: writes into lazy stacks that were
lost or refused (differential fuzz findings 1, 4, 6, 7): ``set_at_`` through a lazy stack
nested in the members of another, ``update_at_`` with an entry-dims index and a
non-tensor entry, ``lazy.update_(lazy.to_dict())`` with non-tensor entries, and
``lazy.set_non_tensor`` of a nested key whose node has more batch dims than the stack."""
from __future__ import annotations

import warnings

import pytest
import torch

import shared_td
from tests.reference import LIBS

@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _lazy_in_lazy(lib, deep: bool, inner_dim: int):
    """A lazy stack of two TensorDicts, each holding (under "mid" when ``deep``) a lazy
    stack "lz" of two TensorDicts with an entry "c" of shape [3, 4] (batch [3])."""
    def member():
        lz = lib.LazyStackedTensorDict(*[lib.TensorDict(c=torch.zeros(3, 4), batch_size=[3]) for _ in range(2)],
                                       stack_dim=inner_dim)
        td = lib.TensorDict({"lz": lz}, batch_size=lz.batch_size[:1])
        return lib.TensorDict({"mid": td}, batch_size=td.batch_size) if deep else td
    return lib.LazyStackedTensorDict(member(), member(), stack_dim=0)


# ---------------------------------------------------------------- finding 1
@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("deep", [False, True])
@pytest.mark.parametrize("inner_dim", [0, 1])
@pytest.mark.parametrize("index", [0, (1, 0), (Ellipsis, 0)])
def test_set_at_through_lazy_in_lazy_reaches_the_inner_members(lib, deep, inner_dim, index):
    """set_at_ of a key inside a lazy stack nested in the members of a lazy stack wrote
    into a stacked copy of the member's entry: nothing reached the inner members."""
    root = _lazy_in_lazy(lib, deep, inner_dim)
    key = ("mid", "lz", "c") if deep else ("lz", "c")
    shape = torch.zeros(root.get(key).shape)[index].shape
    value = torch.arange(1.0, 1 + shape.numel()).reshape(shape)
    expected = torch.zeros(root.get(key).shape)
    expected[index] = value
    root.set_at_(key, value, index)
    assert torch.equal(root.get(key), expected)
    # (written into the inner members themselves, not only seen through get)
    inner = root.tensordicts[1].get(key[:-1]).tensordicts[0]["c"]
    assert torch.equal(inner, expected[1].unbind(inner_dim)[0])


@pytest.mark.parametrize("lib", LIBS)
def test_update_at_through_lazy_in_lazy_reaches_the_inner_members(lib):
    root = _lazy_in_lazy(lib, False, 0)
    root.update_at_({"lz": {"c": torch.ones(2, 2, 3)}}, (Ellipsis, 1))
    assert root.get(("lz", "c"))[..., 1].sum().item() == 12
    assert root.tensordicts[0]["lz"].tensordicts[1]["c"][:, 1].tolist() == [1.0, 1.0, 1.0]


# ---------------------------------------------------------------- finding 4
@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("text", [None, "hello", "bye"])
def test_update_at_entry_dims_index_with_a_non_tensor_entry(lib, text):
    """update_at_(src, (..., 0)): a non-tensor entry beside the tensor ones made the whole
    source be written as rows (a -> [[9], [1], [2]] instead of [[9], [9], [9]])."""
    td = lib.TensorDict(a=torch.arange(3).reshape(3, 1), batch_size=[3])
    if text is not None:
        td.set_non_tensor("text", "hello")
    source = td[..., 0].clone()
    source.set("a", torch.full((1,), 9))
    if text is not None:
        source.set_non_tensor("text", text)
    td.update_at_(source, (Ellipsis, 0))
    assert td["a"].tolist() == [[9], [9], [9]]
    if text is not None:  # (the non-tensor entry at the index read on its batch dims)
        assert td["text"] == ("hello" if text == "hello" else [text, "hello", "hello"])


@pytest.mark.parametrize("lib", LIBS)
def test_update_at_entry_dims_index_with_a_non_tensor_entry_of_a_lazy_stack(lib):
    members = []
    for _ in range(2):
        member = lib.TensorDict(a=torch.zeros(3, 1), batch_size=[3])
        member.set_non_tensor("text", "hello")
        members.append(member)
    lazy = lib.LazyStackedTensorDict(*members, stack_dim=0)
    lazy.update_at_({"a": torch.full((2, 3), 9.0), "text": lib.NonTensorData("bye")}, (Ellipsis, 0))
    assert lazy["a"].flatten().tolist() == [9.0] * 6
    assert [list(m["text"]) for m in members] == [["bye", "hello", "hello"]] * 2


@pytest.mark.parametrize("lib", LIBS)
def test_update_at_entry_dims_index_plain_str_in_a_dict_stays_refused(lib):
    """(a NonTensorData given is written; a plain str in the dict is a TypeError in both)"""
    td = lib.TensorDict(a=torch.zeros(3, 4, 5), s=lib.NonTensorData("x", batch_size=[3, 4]), batch_size=[3, 4])
    with pytest.raises(TypeError):
        td.update_at_({"a": torch.ones(3, 4), "s": "y"}, (Ellipsis, 0))
    if lib is shared_td:  # (checked before writing; tensordict has written "a" by then)
        assert td["a"].sum().item() == 0
    td.update_at_({"a": torch.ones(3, 4), "s": lib.NonTensorData("y")}, (Ellipsis, 0))
    assert td["a"].sum().item() == 12 and list(td["s"][0]) == ["y", "x", "x", "x"]


# ---------------------------------------------------------------- finding 6
def _members_with(lib, value, nested=False, count=2):
    members = []
    for _ in range(count):
        member = lib.TensorDict(a=torch.zeros(2), batch_size=[2])
        member.set_non_tensor("n", value)
        if nested:
            member = lib.TensorDict({"sub": member, "b": torch.zeros(2)}, batch_size=[2])
        members.append(member)
    return members


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("value", [6, "walk"])
@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("stack_dim", [0, 1])
def test_lazy_update__of_its_own_to_dict(lib, value, nested, stack_dim):
    """lazy.update_(lazy.to_dict()) raised (ValueError for a str, TypeError for an int):
    the split gave each member's NonTensorData one value per element."""
    members = _members_with(lib, value, nested)
    lazy = lib.LazyStackedTensorDict(*members, stack_dim=stack_dim)
    entry = members[0].get(("sub", "n") if nested else "n")
    lazy.update_(lazy.to_dict())
    assert members[0].get(("sub", "n") if nested else "n") is entry  # written in place
    assert members[1].get(("sub", "n") if nested else "n").data == value


@pytest.mark.parametrize("lib", LIBS)
def test_lazy_update__of_its_own_to_dict_in_lazy(lib):
    inner = [lib.LazyStackedTensorDict(*_members_with(lib, 6), stack_dim=0) for _ in range(2)]
    lazy = lib.LazyStackedTensorDict(*inner, stack_dim=0)
    lazy.update_(lazy.to_dict())
    assert inner[1].tensordicts[0].get("n").data == 6


@pytest.mark.parametrize("holder", ["td", "lazy"])
def test_update__of_to_dict_through_a_nested_lazy_stack(holder):
    """(tensordict 0.15.3 raises here: a ValueError)"""
    def of_lazy():
        lazy = shared_td.LazyStackedTensorDict(*_members_with(shared_td, "w"), stack_dim=0)
        return shared_td.TensorDict({"lz": lazy}, batch_size=[2])
    root = of_lazy() if holder == "td" else shared_td.LazyStackedTensorDict(of_lazy(), of_lazy(), stack_dim=0)
    root.update_(root.to_dict())
    assert root.get(("lz", "n")).tolist() == root.to_dict()["lz"]["n"]


def test_lazy_update__per_member_one_value_writes_it_and_checks_first():
    members = _members_with(shared_td, "walk")
    lazy = shared_td.LazyStackedTensorDict(*members, stack_dim=0)
    lazy.update_({"a": torch.ones(2, 2), "n": [["run", "run"], ["jump", "jump"]]})
    assert [m["n"] for m in members] == ["run", "jump"] and lazy["a"].sum().item() == 4
    assert all(type(m.get("n")).__name__ == "NonTensorData" for m in members)
    # values that differ inside a member stay refused, and nothing is written
    with pytest.raises(ValueError, match="'n'"):
        lazy.update_({"a": torch.zeros(2, 2), "n": [["x", "x"], ["y", "z"]]})
    assert [m["n"] for m in members] == ["run", "jump"] and lazy["a"].sum().item() == 4
    lazy.set_("n", [["p", "p"], ["q", "q"]])
    assert [m["n"] for m in members] == ["p", "q"]
    # a tensor into a non-tensor entry stays refused unless it is the value held, written again
    ints = shared_td.LazyStackedTensorDict(*_members_with(shared_td, 6), stack_dim=0)
    with pytest.raises(TypeError, match="Tensor"):
        ints.update_({"n": torch.full((2, 2), 7)})
    ints.update_({"n": [[6, 6], [6, 6]]})
    assert ints.tensordicts[0].get("n").data == 6


# ---------------------------------------------------------------- finding 7
@pytest.mark.parametrize("lib", LIBS)
def test_lazy_set_non_tensor_of_a_nested_key_with_more_batch_dims(lib):
    """lazy.set_non_tensor(("sub", "k"), v) built a NonTensorData of the root's batch size,
    which the nested stack (one more batch dim) refused: BatchSizeMismatchError."""
    members = [lib.TensorDict({"a": torch.zeros(()), "sub": lib.TensorDict(x=torch.zeros(2), batch_size=[2])},
                              batch_size=[]) for _ in range(2)]
    lazy = lib.LazyStackedTensorDict(*members, stack_dim=0)
    lazy.set_non_tensor(("sub", "k"), 3)
    lazy.set_non_tensor("top", 4)
    assert [m.get(("sub", "k")).data for m in members] == [3, 3]
    assert [sorted(m["sub"].keys()) for m in members] == [["k", "x"]] * 2
    assert [m.get_non_tensor("top") for m in members] == [4, 4]


@pytest.mark.parametrize("batch_size", [[], [3], [2]])
def test_lazy_set_of_one_non_tensor_value_of_another_batch_size(batch_size):
    """As TensorDict.set re-batches one value (tensordict 0.15.3 accepts it too)."""
    members = [shared_td.TensorDict(sub=shared_td.TensorDict(x=torch.zeros(2), batch_size=[2]), batch_size=[])
               for _ in range(2)]
    lazy = shared_td.LazyStackedTensorDict(*members, stack_dim=0)
    lazy.set(("sub", "k"), shared_td.NonTensorData(3, batch_size=batch_size))
    assert [m.get(("sub", "k")).batch_size for m in members] == [torch.Size([2])] * 2
    assert lazy.get(("sub", "k")).tolist() == [[3, 3], [3, 3]]


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("holder", ["lazy", "td"])
def test_update_of_a_lazy_stack_by_a_tensordict_of_fewer_batch_dims(lib, holder):
    """lazy.update_(TensorDict(..., batch_size=[])) raised BatchSizeMismatchError; so did
    a TensorDict's update_ reaching a nested lazy stack with such a source."""
    members = [lib.TensorDict(a=torch.zeros(2), b=lib.TensorDict(c=torch.zeros(2, 3), batch_size=[2, 3]),
                              batch_size=[2]) for _ in range(2)]
    lazy = lib.LazyStackedTensorDict(*members, stack_dim=1)
    if holder == "lazy":
        lazy.update_(lib.TensorDict({"a": torch.ones(2, 2), "b": {"c": torch.ones(2, 2, 3)}}, batch_size=[]))
        lazy.update(lib.TensorDict({"a": torch.full((2, 2), 2.0)}, batch_size=[2]))
    else:
        td = lib.TensorDict({"lz": lazy}, batch_size=[2])
        td.update_(lib.TensorDict({"lz": {"a": torch.ones(2, 2), "b": {"c": torch.ones(2, 2, 3)}}}, batch_size=[]))
        td.update_(lib.TensorDict({"lz": {"a": torch.full((2, 2), 2.0)}}, batch_size=[]))
    assert members[1]["a"].tolist() == [2.0, 2.0] and members[0]["b", "c"].sum().item() == 6
