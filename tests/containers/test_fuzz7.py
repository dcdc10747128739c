"""What fuzz round 7 (differential against tensordict 0.15.3) found: a new lazy-stack entry
written through an index, renames below the key itself and out of a lazy stack, a
tensordict written at an index of a non-tensor entry, and lazy apply/view(dtype) with a
batch_size keeping nested tensorclasses."""
from __future__ import annotations

import pytest
import torch

from shared_td import NonTensorData, TensorDict, lazy_stack, tensorclass


@pytest.mark.parametrize("how", ["setitem", "set_at_"])
def test_tensordict_written_at_index_into_non_tensor_entry_is_refused(how):
    td = TensorDict({"k0": torch.zeros(2)}, [2])
    td.set_non_tensor(("nn", "x"), [1, 2])
    before = td.get(("nn", "x")).tolist()
    value = TensorDict({"a": torch.ones(2, 2)}, [2, 2])
    with pytest.raises(TypeError):  # (it stored the whole tensordict as each row's value)
        if how == "setitem":
            src = td.clone()
            src.set(("nn", "x"), value)
            td[:] = src
        else:
            td.set_at_(("nn", "x"), value, 0)
    assert td.get(("nn", "x")).tolist() == before
    assert torch.equal(td["k0"], torch.zeros(2))


@tensorclass
class _TC:
    obs: torch.Tensor
    info: str = None


def _stack():
    return lazy_stack([TensorDict({"a": torch.zeros(()), "tc": _TC(obs=torch.zeros(2), info="u", batch_size=[])}, [])
                       for _ in range(3)])


def test_lazy_apply_batch_size_keeps_tensorclass():
    out = _stack().apply(lambda x: x + 1, batch_size=[3])
    assert type(out.get("tc")) is _TC  # (tensordict 0.15.3; it was a plain TensorDict)
    assert torch.equal(out.get("tc").obs, torch.ones(3, 2))


def test_lazy_view_dtype_batch_size_keeps_tensorclass():
    out = _stack().view(torch.int32, batch_size=[3])
    assert type(out.get("tc")) is _TC
    assert out.get("tc").obs.dtype == torch.int32


def _value(kind):
    if kind == "tc":
        return _TC(obs=torch.ones(3, 2), info="w", batch_size=[3, 2])
    if kind == "td":
        return TensorDict({"info": torch.ones(3, 2), "obs": torch.ones(3, 2)}, [3, 2])
    return torch.ones(3, 2)


@pytest.mark.parametrize("kind", ["tc", "td", "tensor"])
@pytest.mark.parametrize("lazy", [False, True])
def test_rename_key_below_itself_moves_the_entry(kind, lazy):
    # rename_key_("a", ("a", "b")): the entry moves under a new tensordict at "a" (tensordict
    # 0.15.3); a tensorclass entry was lost entirely, a tensordict raised ValueError
    td = TensorDict({"k0": torch.zeros(3)}, [3])
    td.set("newn", _value(kind))
    if lazy:
        td = lazy_stack([td, td.clone()])
    td.rename_key_("newn", ("newn", "info"))
    moved = td.get(("newn", "info"))
    if not lazy:
        assert type(moved).__name__ == {"tc": "_TC", "td": "TensorDict", "tensor": "Tensor"}[kind]
    got = moved if kind == "tensor" else moved.obs if kind == "tc" else moved["obs"]
    assert torch.equal(got, torch.ones(got.shape)) and got.shape[-2:] == (3, 2)
    assert sorted(map(str, td.keys())) == ["k0", "newn"]


def test_rename_key_below_itself_safe_when_new_key_exists_inside():
    # the entry at the new key is inside the one moved: nothing is overwritten (tensordict 0.15.3)
    td = TensorDict({}, [])
    td.set(("nn", "x", "a"), torch.ones(2))
    td.rename_key_("nn", ("nn", "x"), safe=True)
    assert torch.equal(td.get(("nn", "x", "x", "a")), torch.ones(2))


def _tree():
    members = []
    for i in range(2):
        t = TensorDict({"k1": torch.zeros(())}, [])
        t.set_non_tensor("k0", f"v{i}")
        members.append(t)
    return TensorDict({"x": torch.arange(2), "k1": lazy_stack(members)}, [2])


def test_non_tensor_renamed_out_of_lazy_stack_takes_writes():
    td = _tree()
    td.rename_key_(("k1", "k0"), "renamed")
    td.set_at_("renamed", "new", 0)  # (a KeyError: the write went to the members' old key)
    td[1] = td[0].clone()
    td.update_({"renamed": ["a", "b"]})
    assert td.get("renamed").tolist() == ["a", "b"]
    assert sorted(td.get("k1").keys()) == ["k1"]


@pytest.mark.parametrize("rows", [[2, 2, 2], [0, 0, 1], [2, 0, 1]])
def test_setitem_new_lazy_entry_rows_not_written_are_zeros(rows):
    # td[idx] = src, src holding a key td lacks whose value is a lazy stack, idx as long as
    # the batch dim but missing some rows: the entry keeps its keys, zeros in those rows
    td = TensorDict({"k0": torch.zeros(3)}, [3])
    idx = torch.tensor(rows)
    src = td[idx].clone()
    src.set("newn", lazy_stack([TensorDict({"a": torch.full((2,), float(i + 1))}, [2]) for i in range(3)]))
    td[idx] = src
    expected = torch.zeros(3, 2)
    for i, r in enumerate(rows):
        expected[r] = i + 1
    assert ("newn", "a") in td.keys(True)
    assert torch.equal(td.get(("newn", "a")), expected)


@pytest.mark.parametrize("keys", [(("k0", "k1"), "k0"), ("k0", ("k0", "k1"))])
@pytest.mark.parametrize("locked", [False, True])
def test_a_key_and_a_key_inside_it_are_refused_before_anything_is_taken(keys, locked):
    """tensordict 0.15.3 takes ("k0", "k1"), then "k0" without it: the inner entry is lost
    from the tree and from the result (the other order: a KeyError, or its lock error)."""
    td = TensorDict(k0=TensorDict(k1=torch.zeros(2), k2=torch.ones(2), batch_size=[2]), batch_size=[2])
    if locked:
        td.lock_()
    for take in (lambda: td.separates(*keys), lambda: td.split_keys(list(keys), inplace=True)):
        with pytest.raises(ValueError, match=r"'k0' and \('k0', 'k1'\) are both given"):
            take()
    assert sorted(map(str, td.keys(True, True))) == ["('k0', 'k1')", "('k0', 'k2')"]
    assert sorted(map(str, td.split_keys([("k0", "k1")], ["k0"])[1].keys(True, True))) == ["('k0', 'k2')"]


# ------------------------------------------------------------ the second review
@tensorclass
class _Fields:
    x: torch.Tensor


def test_index_write_of_a_new_lazy_stack_of_tensorclasses_keeps_its_fields():
    td = TensorDict(k=torch.zeros(3), batch_size=[3])
    src = TensorDict(k=torch.ones(3), newn=lazy_stack([_Fields(x=torch.ones(2) * (i + 1)) for i in range(3)]),
                     batch_size=[3])
    td[torch.tensor([2, 2, 0])] = src
    assert td.get(("newn", "x")).tolist() == [[3.0, 3.0], [0.0, 0.0], [2.0, 2.0]]


def test_index_write_of_a_new_lazy_stack_leaves_no_member_value_in_rows_not_written():
    td = TensorDict(k=torch.zeros(3), batch_size=[3])
    members = [TensorDict(s=NonTensorData(f"v{i}"), a=torch.ones(())) for i in range(3)]
    src = TensorDict(k=torch.ones(3), newn=lazy_stack(members), batch_size=[3])
    td[torch.tensor([2, 2, 0])] = src
    assert [td[i]["newn", "s"] for i in range(3)] == ["v2", None, "v1"]  # as tensordict 0.15.3
