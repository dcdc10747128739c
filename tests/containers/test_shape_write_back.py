"""``with td.<batch-shape op>(...) as v:`` writes ``v``'s new keys and replaced entries
back into ``td`` on leaving the block, as tensordict 0.15.3 does (before, they were lost
in silence: found by tensordict's upstream test_view_cm). Side by side with tensordict.
"""
from __future__ import annotations

import gc
import weakref

import pytest
import torch

import shared_td
from tests.reference import LIBS

OPS = {
    "view(-1)": lambda t: t.view(-1),
    "view(4, 3)": lambda t: t.view(4, 3),
    "flatten(0, 1)": lambda t: t.flatten(0, 1),
    "flatten()": lambda t: t.flatten(),
    "permute(1, 0)": lambda t: t.permute(1, 0),
    "transpose(0, 1)": lambda t: t.transpose(0, 1),
    "unsqueeze(0)": lambda t: t.unsqueeze(0),
    "unsqueeze(dim=-1)": lambda t: t.unsqueeze(dim=-1),
    "unflatten(1, (2, 2))": lambda t: t.unflatten(1, (2, 2)),
}


def written_in_block(lib, make, op, lazy=False):
    """``td``'s keys and first value of ``a`` after a block that adds ``new`` and
    replaces ``a`` in ``op(td)``."""
    td = make(lib, lazy)
    with op(td) as view:
        view["new"] = torch.zeros(view.batch_size)
        view["a"] = torch.full(view.batch_size, 7.0)
    return sorted(td.keys()), td["a"].flatten()[0].item(), td["new"].shape


def grid(lib, lazy):
    if lazy:  # [3, 2, 4]: two members of [3, 4] stacked at dim 1
        return lib.lazy_stack([lib.TensorDict(a=torch.ones(3, 4), batch_size=[3, 4]) for _ in range(2)], 1)
    return lib.TensorDict(a=torch.ones(3, 4), b={"c": torch.ones(3, 4, 2)}, batch_size=[3, 4])


def column(lib, lazy):  # [1, 3, 4], for squeeze(0)
    if lazy:
        return lib.lazy_stack([lib.TensorDict(a=torch.ones(1, 4), batch_size=[1, 4]) for _ in range(3)], 1)
    return lib.TensorDict(a=torch.ones(1, 3, 4), batch_size=[1, 3, 4])


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("name", sorted(OPS))
def test_a_tensordict_gets_the_keys_added_and_entries_replaced_in_the_block(lib, name):
    keys, first, shape = written_in_block(lib, grid, OPS[name])
    assert keys == ["a", "b", "new"] and first == 7.0 and shape == (3, 4)


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("name", ["view(-1)", "flatten(0, 1)", "permute(1, 0)", "transpose(0, 1)", "unsqueeze(0)",
                                  "unflatten(1, (2, 2))"])
def test_a_lazy_stack_gets_them_too(lib, name):
    op = {"permute(1, 0)": lambda t: t.permute(1, 0, 2), "unflatten(1, (2, 2))": lambda t: t.unflatten(2, (2, 2))}.get(
        name, OPS[name])
    keys, first, shape = written_in_block(lib, grid, op, lazy=True)
    assert keys == ["a", "new"] and first == 7.0 and shape == (3, 2, 4)


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("lazy", [False, True])
def test_squeeze_of_a_dim(lib, lazy):
    keys, first, shape = written_in_block(lib, column, lambda t: t.squeeze(0), lazy)
    assert "new" in keys and first == 7.0 and shape == (1, 3, 4)


def test_squeeze_of_every_dim_of_size_one_writes_back_too():
    """(tensordict 0.15.3 raises at the end of the block: 'Cannot use td.squeeze() as a
    decorator if the dimension is implicit'; the dims squeezed are known here)"""
    td = shared_td.TensorDict(a=torch.ones(1, 3, 1), batch_size=[1, 3, 1])
    with td.squeeze() as view:
        view["new"] = torch.arange(3.0)
    assert td["new"].shape == (1, 3, 1) and td["new"].flatten().tolist() == [0.0, 1.0, 2.0]


@pytest.mark.parametrize("lib", LIBS)
def test_a_tensorclass_gets_a_field_set_in_the_block(lib):
    @lib.tensorclass
    class Data:
        X: torch.Tensor
        z: str

    data = Data(X=None, z="s", batch_size=[3, 4])
    with data.view(-1) as flat:
        flat.X = torch.zeros(12, 5)
    assert data.X.shape == (3, 4, 5)


@pytest.mark.parametrize("lib", LIBS)
def test_a_locked_tensordict_gets_the_values_in_place(lib):
    td = lib.TensorDict(a=torch.ones(3, 4), batch_size=[3, 4])
    view = td.view(-1)
    td.lock_()
    leaf = td["a"]
    with view as flat:
        flat["a"].fill_(5.0)
    assert td.is_locked and td["a"] is leaf and (td["a"] == 5.0).all()


@pytest.mark.parametrize("lib", LIBS)
def test_a_block_that_raises_writes_nothing_back(lib):
    td = lib.TensorDict(a=torch.ones(3, 4), batch_size=[3, 4])
    with pytest.raises(ZeroDivisionError):
        with td.view(-1) as flat:
            flat["new"] = torch.zeros(12)
            1 / 0
    assert list(td.keys()) == ["a"]


def test_the_result_holds_its_source_weakly():
    """A chain of views made in a loop keeps no earlier tree alive (the write-back holds
    its source weakly), and a block over a view whose source is gone writes nowhere."""
    td = shared_td.TensorDict(a=torch.ones(3, 4), batch_size=[3, 4])
    first = weakref.ref(td)
    for _ in range(3):
        td = td.unsqueeze(0).squeeze(0)
    gc.collect()
    assert first() is None
    view = shared_td.TensorDict(a=torch.ones(3, 4), batch_size=[3, 4]).view(-1)
    gc.collect()
    with view as flat:
        flat["new"] = torch.zeros(12)
    assert "new" in flat.keys()


@pytest.mark.parametrize("lib", LIBS)
def test_squeeze_of_a_lazy_stack_dim_gives_the_member_itself(lib):
    """The stack dim of size 1 squeezed is the member: the block writes into it directly,
    and the member is not marked (a later ``with member:`` writes nothing anywhere)."""
    member = lib.TensorDict(a=torch.ones(3), batch_size=[3])
    stack = lib.lazy_stack([member], 0)
    with stack.squeeze(0) as view:
        view["new"] = torch.zeros(3)
    assert "new" in stack.keys() and "new" in member.keys()
    if lib.__name__ == "shared_td":
        assert view is member and getattr(member, "_last_op", None) is None


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("lazy", [False, True])
def test_swapaxes_swapdims_movedim_moveaxis_as_tensordict(lib, lazy):
    """torch's other names for transpose, and movedim/moveaxis (a permute): the same
    batch sizes, names and leaves as tensordict 0.15.3, views of the source, and their
    with-blocks write back as the other batch-shape views."""
    if lazy:
        td = lib.lazy_stack([lib.TensorDict(a=torch.arange(12.0).view(3, 4), batch_size=[3, 4]) for _ in range(2)])
    else:
        td = lib.TensorDict(a=torch.arange(24.0).view(2, 3, 4), batch_size=[2, 3, 4], names=["x", "y", "z"])
    assert td.swapaxes(0, 2).batch_size == td.swapdims(0, 2).batch_size == td.transpose(0, 2).batch_size
    assert torch.equal(td.swapaxes(0, 2)["a"], td["a"].transpose(0, 2))
    for source, destination in [(0, -1), ([0, 1], [2, 0]), (2, 0)]:
        moved = td.movedim(source, destination)
        assert torch.equal(moved["a"], td["a"].movedim(source, destination))
        assert td.moveaxis(source, destination).batch_size == moved.batch_size
    if not lazy:
        assert td.movedim(0, -1).names == ["y", "z", "x"]
    with td.movedim(0, -1) as view:
        view["new"] = torch.ones(view.batch_size)
    assert td["new"].shape == td.batch_size
    td.movedim(0, -1).zero_()
    assert (td["a"] == 0).all()


LAZY_BLOCK_OPS = {
    "unflatten(0, (2, 1))": lambda t: t.unflatten(0, (2, 1)),
    "view(-1)": lambda t: t.view(-1),
    "unsqueeze(0)": lambda t: t.unsqueeze(0),
    "transpose(0, 1)": lambda t: t.transpose(0, 1),
}


# (tensordict 0.15.3's view of a lazy stack is a dense copy, whose block writes copies back:
# that pair is not compared)
@pytest.mark.parametrize(("L", "op"), [pytest.param(lib.values[0], op, id=f"{lib.id}-{op}", marks=lib.marks)
                                       for lib in LIBS for op in LAZY_BLOCK_OPS
                                       if not (op == "view(-1)" and lib.id == "tensordict")])
@pytest.mark.parametrize("stack_dim", [0, 1])
@pytest.mark.parametrize("act", ["none", "add", "set_"])
def test_a_block_on_a_lazy_stack_keeps_the_leaves_it_did_not_replace(L, op, stack_dim, act):
    members = [L.TensorDict(a=torch.ones(2), n=L.TensorDict(b=torch.ones(2), batch_size=[2]), batch_size=[2])
               for _ in range(2)]
    td = L.lazy_stack(members, stack_dim)  # (2, 2)
    held_a, held_b = members[0]["a"], members[0]["n", "b"]
    with LAZY_BLOCK_OPS[op](td) as v:
        if act == "add":
            v["new"] = torch.zeros(v.batch_size)
        elif act == "set_":
            v.set_(("n", "b"), torch.full(v.batch_size, 5.0))
    held_a.fill_(9.0)
    held_b.fill_(7.0)
    assert td.tensordicts[0]["a"].tolist() == [9.0, 9.0]
    assert td.tensordicts[0]["n", "b"].tolist() == [7.0, 7.0]
    if act == "add":
        assert td["new"].shape == (2, 2)


@pytest.mark.parametrize("L", LIBS)
def test_a_block_on_a_lazy_stack_still_replaces_the_entries_replaced_in_it(L):
    members = [L.TensorDict(a=torch.ones(2), batch_size=[2]) for _ in range(2)]
    td = L.lazy_stack(members, 1)
    held = members[0]["a"]
    with td.unflatten(0, (2, 1)) as v:
        v["a"] = torch.full((2, 1, 2), 3, dtype=torch.int64)
    held.fill_(9.0)
    assert td["a"].dtype == torch.int64 and td["a"].tolist() == [[3, 3], [3, 3]]


# ------------------------------------------------ non-tensor entries the block left alone
# (fuzz record 222863: every non-tensor entry was rewritten on leaving the block, so a
# NonTensorStack or NonTensorData read before it no longer reached td, and a squeeze
# block turned a NonTensorStack into one value)
NT_BLOCK_OPS = {
    "squeeze(0)": lambda t: t.squeeze(0),
    "unsqueeze(0)": lambda t: t.unsqueeze(0),
    "view(-1)": lambda t: t.view(-1),
    "permute(0)": lambda t: t.permute(0),
}


def one_row(L, entry):
    td = L.TensorDict(t=torch.zeros(1), batch_size=[1])
    td["s"] = ["run"] if entry == "stack" else L.NonTensorData("run", batch_size=[1])
    return td


# (tensordict 0.15.3's squeeze block writes a NonTensorStack back over a NonTensorData:
# that triple is not compared)
@pytest.mark.parametrize(("L", "op", "entry"),
                         [pytest.param(lib.values[0], op, entry, id=f"{lib.id}-{op}-{entry}", marks=lib.marks)
                          for lib in LIBS for op in NT_BLOCK_OPS for entry in ("stack", "data")
                          if not (lib.id == "tensordict" and op == "squeeze(0)" and entry == "data")])
@pytest.mark.parametrize("act", ["none", "add"])
def test_a_block_keeps_the_non_tensor_entries_it_did_not_change(L, op, entry, act):
    td = one_row(L, entry)
    held = td.get("s")
    with NT_BLOCK_OPS[op](td) as v:
        if act == "add":
            v["new"] = torch.ones(v.batch_size)
    assert type(td.get("s")) is type(held)
    assert td.to_dict()["s"] == (["run"] if entry == "stack" else "run")
    # an entry read before the block still reaches td
    if entry == "stack":
        held[0] = "walk"
    else:
        held.update_(L.NonTensorData("walk", batch_size=[1]))
    assert td.get("s").tolist() == ["walk"]


@pytest.mark.parametrize("L", LIBS)
@pytest.mark.parametrize("op", ["unsqueeze(0)", "permute(0)"])
def test_a_block_still_writes_a_non_tensor_value_replaced_in_it(L, op):
    td = one_row(L, "data")
    with NT_BLOCK_OPS[op](td) as v:
        v["s"] = L.NonTensorData("walk", batch_size=v.batch_size)
    assert td.get("s").tolist() == ["walk"]
