"""``state_dict``/``load_state_dict`` in tensordict 0.15.3's format: a state dict of either
package loads into the other (flat and nested, non-tensor values, tensorclasses), a load
writes in place into shared and memory-mapped leaves, and what is refused writes
nothing."""
from __future__ import annotations

import pytest
import torch

import shared_td
td_module = pytest.importorskip("tensordict")


@shared_td.tensorclass
class StdStep:
    obs: torch.Tensor
    label: str
    extra: torch.Tensor = None


@td_module.tensorclass
class TdStep:
    obs: torch.Tensor
    label: str
    extra: torch.Tensor = None


STEPS = {shared_td: StdStep, td_module: TdStep}


def tree(lib, fill: float):
    return lib.TensorDict(a=torch.full((2,), fill), text=f"v{fill}", batch_size=[2],
                          n=lib.TensorDict(b=torch.full((2, 3), fill), batch_size=[2]),
                          step=STEPS[lib](obs=torch.full((2, 4), fill), label=f"l{fill}", batch_size=[2]))


def plain(td) -> dict:
    return {"a": td["a"].tolist(), "text": td["text"], "n.b": td["n", "b"].tolist(),
            "step.obs": td["step"].obs.tolist(), "step.label": td["step"].label, "step.extra": td["step"].extra}


@pytest.mark.parametrize("source", [shared_td, td_module], ids=["from_shared_td", "from_tensordict"])
@pytest.mark.parametrize("target", [shared_td, td_module], ids=["into_shared_td", "into_tensordict"])
@pytest.mark.parametrize("flatten", [True, False])
def test_a_state_dict_of_either_package_loads_into_the_other(source, target, flatten):
    state = tree(source, 1.0).state_dict(flatten=flatten)
    loaded = tree(target, 0.0)
    assert loaded.load_state_dict(state) is loaded
    assert plain(loaded) == plain(tree(target, 1.0))


def test_the_format_is_tensordicts():
    ours, theirs = tree(shared_td, 1.0).state_dict(), tree(td_module, 1.0).state_dict()
    assert list(ours) == list(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)
    step = {**theirs._metadata["step"], "_type": "StdStep"}
    assert dict(ours._metadata) == {**theirs._metadata, "step": step}


def test_a_load_writes_into_the_leaves_of_a_shared_and_a_memory_mapped_tensordict(tmp_path):
    shared = tree(shared_td, 0.0).share_memory_()
    leaf = shared["n", "b"]
    shared.load_state_dict(tree(shared_td, 3.0).state_dict())
    assert leaf.tolist() == [[3.0] * 3] * 2 and shared["n", "b"] is not None and leaf.is_shared()
    mapped = tree(shared_td, 0.0).memmap_(tmp_path / "saved")
    mapped.load_state_dict(tree(shared_td, 5.0).state_dict())
    reloaded = shared_td.TensorDict.load_memmap(tmp_path / "saved")
    assert reloaded["a"].tolist() == [5.0, 5.0] and reloaded["text"] == "v5.0" and reloaded["step"].label == "l5.0"


def test_a_checkpoint_through_torch_save_loads_back(tmp_path):
    torch.save(tree(shared_td, 2.0).state_dict(), tmp_path / "ckpt.pt")
    loaded = tree(shared_td, 0.0).load_state_dict(torch.load(tmp_path / "ckpt.pt", weights_only=False))
    assert plain(loaded) == plain(tree(shared_td, 2.0))


def test_a_lazy_stack_gives_its_stacked_leaves_and_loads_them_into_its_members():
    stack = shared_td.lazy_stack([shared_td.TensorDict(x=torch.ones(2)), shared_td.TensorDict(x=torch.zeros(2))])
    target = shared_td.lazy_stack([shared_td.TensorDict(x=torch.zeros(2)), shared_td.TensorDict(x=torch.zeros(2))])
    target.load_state_dict(stack.state_dict())
    assert [member["x"].tolist() for member in target.tensordicts] == [[1.0, 1.0], [0.0, 0.0]]


def test_keep_vars_keeps_the_autograd_tensors():
    weight = torch.ones(2, requires_grad=True)
    td = shared_td.TensorDict(w=weight)
    assert td.state_dict(keep_vars=True)["w"] is weight
    assert not td.state_dict()["w"].requires_grad


def test_keys_that_would_collide_when_flat_are_a_key_error_naming_them():
    td = shared_td.TensorDict({"a.b": torch.zeros(1), "a": shared_td.TensorDict(b=torch.ones(1))})
    with pytest.raises(KeyError, match="'a.b'.*state_dict\\(flatten=False\\)"):
        td.state_dict()
    assert set(td.state_dict(flatten=False)) == {"a.b", "a"}


def test_strict_refuses_other_keys_before_writing_anything():
    td = shared_td.TensorDict(a=torch.zeros(1), c=torch.zeros(1))
    with pytest.raises(RuntimeError, match=r"lacks \['c'\] and has \['b'\] more.*Nothing was written"):
        td.load_state_dict(shared_td.TensorDict(a=torch.ones(1), b=torch.ones(1)).state_dict())
    assert td["a"].tolist() == [0.0]
    td.load_state_dict(shared_td.TensorDict(a=torch.ones(1), b=torch.ones(1)).state_dict(), strict=False)
    assert td["a"].tolist() == [1.0] and td["b"].tolist() == [1.0] and td["c"].tolist() == [0.0]


def test_assign_replaces_the_tensors():
    td = shared_td.TensorDict(a=torch.zeros(2))
    before = td["a"]
    new = shared_td.TensorDict(a=torch.ones(2)).state_dict()
    td.load_state_dict(new, assign=True)
    assert td["a"] is not before and before.tolist() == [0.0, 0.0] and td["a"].tolist() == [1.0, 1.0]


def test_a_non_tensor_stack_keeps_its_values():
    td = shared_td.TensorDict(s=shared_td.NonTensorStack("x", "y"), batch_size=[2])
    target = shared_td.TensorDict(s=shared_td.NonTensorStack("p", "q"), batch_size=[2])
    target.load_state_dict(td.state_dict())
    assert target["s"].tolist() == ["x", "y"]


def test_a_non_tensor_field_the_class_lacks_is_refused_naming_it():
    state = StdStep(obs=torch.ones(2, 4), label="a", batch_size=[2]).state_dict()
    state._metadata[""]["_non_tensor"]["unknown"] = 1
    target = StdStep(obs=torch.zeros(2, 4), label="b", batch_size=[2])
    with pytest.raises(RuntimeError, match=r"has \['unknown'\] more.*Nothing was written"):
        target.load_state_dict(state)
    assert target.obs.sum().item() == 0 and target.label == "b"


def test_a_leaf_and_a_level_that_would_share_a_flat_key_are_refused():
    # (tensordict 0.15.3 writes both, and its state dict then fails to load: "invalid data type 'str'")
    td = shared_td.TensorDict({"a.b": torch.zeros(1), "a": {"b": {"c": torch.ones(1)}}})
    with pytest.raises(KeyError, match="'a.b'"):
        td.state_dict()
    nested = td.state_dict(flatten=False)
    assert shared_td.TensorDict({"a.b": torch.ones(1), "a": {"b": {"c": torch.zeros(1)}}}).load_state_dict(
        nested)["a", "b", "c"].tolist() == [1.0]


LIBS = [shared_td, td_module]
IDS = ["shared_td", "tensordict"]


@pytest.mark.parametrize("lib", LIBS, ids=IDS)
def test_a_locked_tensorclass_loads_a_state_dict_whose_field_is_none_as_its_own(lib):
    # NEW-3: the field holds a stored None (update_ of None into a consolidated tensorclass); 39e54a5
    # deleted the entry, which the locked tensorclass refused
    step = STEPS[lib](obs=torch.zeros(2), label="a", batch_size=[2]).consolidate()
    step.update_({"label": None})
    assert step.is_locked and step.label is None
    assert step.load_state_dict(step.state_dict()) is step
    assert step.label is None


@pytest.mark.parametrize("lib", LIBS, ids=IDS)
@pytest.mark.parametrize("batch", [[2, 1], []], ids=["batched", "no_batch"])
@pytest.mark.parametrize("value", [{"d": 1}, 0], ids=["dict", "number"])
def test_a_non_tensor_value_loads_as_a_non_tensor_value_with_assign(lib, batch, value):
    # NEW-4: 39e54a5 wrote it with set(), which reads a dict as a nested tensordict and a number as a tensor
    source = lib.TensorDict(a=torch.ones(batch), batch_size=batch)
    source.set_non_tensor("s", value)
    target = lib.TensorDict(a=torch.zeros(batch), batch_size=batch)
    target.set_non_tensor("s", "old")
    target.load_state_dict(source.state_dict(), assign=True)
    assert lib.is_non_tensor(target.get("s")) and target.get_non_tensor("s") == value
    assert target["a"].tolist() == torch.ones(batch).tolist()


@pytest.mark.parametrize("lib", LIBS, ids=IDS)
@pytest.mark.parametrize("where", ["root", "node"])
def test_a_lazy_stack_with_keys_only_some_members_hold_is_refused(lib, where):
    # NEW-5: 39e54a5 gave the common keys only, leaving 'only0' out of the checkpoint in silence
    stack = lib.lazy_stack([lib.TensorDict(a=torch.zeros(()), only0=torch.ones(())), lib.TensorDict(a=torch.ones(()))])
    tree = stack if where == "root" else lib.TensorDict(n=stack, batch_size=[2])
    with pytest.raises(RuntimeError, match="exclusive keys" if lib is td_module else "only0"):
        tree.state_dict()


def test_the_nested_format_and_an_empty_tensorclass_level_are_tensordicts():
    # NOTE-1/NOTE-2: flatten=False writes a non-tensor entry's level in its own state dict only, and a
    # tensorclass level without non-tensor fields has `_non_tensor: {}`, as tensordict 0.15.3
    @shared_td.tensorclass
    class StdPair:
        x: torch.Tensor

    @td_module.tensorclass
    class TdPair:
        x: torch.Tensor

    states = []
    for lib, pair in ((shared_td, StdPair), (td_module, TdPair)):
        td = lib.TensorDict(a=torch.zeros(2), s="txt", p=pair(x=torch.ones(2), batch_size=[2]), batch_size=[2])
        states.append((td.state_dict(flatten=False), td.state_dict()))
    (ours_nested, ours_flat), (theirs_nested, theirs_flat) = states
    assert list(ours_nested._metadata) == list(theirs_nested._metadata) == [""]
    assert dict(ours_nested["s"]._metadata) == dict(theirs_nested["s"]._metadata)
    assert ours_flat._metadata["p"] == {**theirs_flat._metadata["p"], "_type": "StdPair"}
    loaded = shared_td.TensorDict(a=torch.ones(2), s="old", p=StdPair(x=torch.zeros(2), batch_size=[2]), batch_size=[2])
    loaded.load_state_dict(theirs_nested)
    assert loaded["s"] == "txt" and loaded["p"].x.tolist() == [1.0, 1.0]


@pytest.mark.parametrize("kind", ["tensordict", "tensorclass"])
def test_a_strict_load_of_other_keys_raises_what_tensordict_raises_for_either_kind(kind):
    # tensordict 0.15.3: RuntimeError for a tensordict, KeyError for a tensorclass; ours is both
    tree = StdStep(obs=torch.zeros(2), label="a", batch_size=[2]) if kind == "tensorclass" else \
        shared_td.TensorDict(obs=torch.zeros(2), batch_size=[2])
    state = tree.state_dict()
    state["other"] = torch.ones(2)
    for expected in (RuntimeError, KeyError):
        with pytest.raises(expected, match=r"has \['other'\] more\). Pass strict=False"):
            tree.load_state_dict(state)
    assert tree.obs.tolist() == [0.0, 0.0] if kind == "tensorclass" else tree["obs"].tolist() == [0.0, 0.0]


@pytest.mark.parametrize("lib", LIBS, ids=IDS)
@pytest.mark.parametrize("prep", ["plain", "lock_", "memmap_"])
def test_tensordicts_state_dict_of_a_field_of_none_values_keeps_the_stack(lib, prep, tmp_path):
    # triage25 (fuzz record 224588): tensordict 0.15.3 records a tensorclass field holding a NonTensorStack of
    # None values as `_non_tensor: {"label": None}`; the load took that None for "the field is None" and deleted
    # the entry (a LockedTensorDictError in a locked or memory-mapped tree); tensordict keeps the stack
    def tree(mod):
        step = STEPS[mod](obs=torch.zeros(2), label=mod.NonTensorStack.from_list([None, None]), batch_size=[2])
        return mod.TensorDict(s=step, batch_size=[2])
    state = tree(td_module).state_dict()
    target = tree(lib)
    if prep == "lock_":
        target.lock_()
    elif prep == "memmap_":
        target.memmap_(tmp_path)
    assert target.load_state_dict(state) is target
    assert target.get(("s", "label")).tolist() == [None, None]


@pytest.mark.parametrize("lib", LIBS, ids=IDS)
@pytest.mark.parametrize("prep", ["plain", "lock_", "share_memory_"])
def test_a_key_the_tensorclass_has_no_field_for_is_not_added_by_a_lax_load(lib, prep):
    # triage25 (fuzz record 225415): load_state_dict(strict=False) added a tensor under a key that is no field of
    # the class to the tensorclass's tensordict (a LockedTensorDictError when locked); tensordict 0.15.3 skips it
    step = STEPS[lib](obs=torch.zeros(2), label="a", batch_size=[2])
    state = step.state_dict()
    state["not_a_field"] = torch.ones(2)
    if prep != "plain":
        getattr(step, prep)()
    assert step.load_state_dict(state, strict=False) is step
    assert "not_a_field" not in step.to_tensordict().keys()
