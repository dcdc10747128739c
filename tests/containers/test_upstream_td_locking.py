"""Lock state around ``with td.lock_()`` / ``with td.unlock_()`` blocks and unlocking a
lazy stack of nested tensordicts, side by side with tensordict 0.15.3 (differences found
by running tensordict's own locking tests against shared_td)."""
from __future__ import annotations

import pytest
import torch

import shared_td
from tests.reference import LIBS, tensordict

def small(lib):
    return lib.TensorDict({"obs": torch.zeros(2), "nested": {"x": torch.ones(2)}}, [2])


@pytest.mark.parametrize("lib", LIBS)
def test_with_unlock_on_unlocked_leaves_it_unlocked(lib):
    # `with td.unlock_(): td.update(...)` is the usual way to write into a tensordict
    # whatever its state: it must not lock one that was not locked
    td = small(lib)
    with td.unlock_():
        td["extra"] = torch.zeros(2)
    assert not td.is_locked and not td["nested"].is_locked
    td["later"] = torch.zeros(2)  # still writable


@pytest.mark.parametrize("lib", LIBS)
def test_with_lock_on_locked_leaves_it_locked(lib):
    td = small(lib).lock_()
    with td.lock_():
        assert td.is_locked
    assert td.is_locked and td["nested"].is_locked
    with pytest.raises(RuntimeError, match="Cannot modify locked TensorDict"):
        td["extra"] = torch.zeros(2)


@pytest.mark.parametrize("lib", LIBS)
def test_with_blocks_still_undo_a_change(lib):
    td = small(lib)
    with td.lock_():
        assert td.is_locked
    assert not td.is_locked
    td.lock_()
    with td.unlock_():
        assert not td.is_locked
    assert td.is_locked


@pytest.mark.parametrize("lib", LIBS)
def test_nested_with_blocks_restore_each_state(lib):
    td = small(lib)
    with td.lock_():
        with td.unlock_():
            assert not td.is_locked
        assert td.is_locked
        with td.lock_():  # already locked: nothing to undo
            pass
        assert td.is_locked
    assert not td.is_locked


@pytest.mark.parametrize("lib", LIBS)
def test_with_unlock_on_unlocked_lazy_stack(lib):
    stack = lib.LazyStackedTensorDict.lazy_stack([small(lib), small(lib)], 0)
    with stack.unlock_():
        pass
    assert not stack.is_locked
    assert not any(member.is_locked for member in stack.tensordicts)


@pytest.mark.parametrize("lib", LIBS)
def test_stacked_view_of_nested_members_cannot_unlock_them(lib):
    # stack.get("nested") of a locked stack stacks tensordicts nested in locked
    # members: unlocking that view would unlock entries of a locked tensordict
    stack = lib.LazyStackedTensorDict.lazy_stack([small(lib), small(lib)], 0).lock_()
    nested = stack.get("nested")
    assert nested.is_locked
    with pytest.raises(RuntimeError):
        nested.unlock_()
    assert all(member["nested"].is_locked for member in stack.tensordicts)
    with pytest.raises(RuntimeError, match="Cannot modify locked TensorDict"):
        stack.tensordicts[0]["nested"]["y"] = torch.zeros(2)


def test_stack_of_a_locked_tensordicts_child_cannot_unlock_it():
    parent = small(shared_td).lock_()
    stack = shared_td.LazyStackedTensorDict.lazy_stack([parent["nested"], small(shared_td)["nested"]], 0)
    with pytest.raises(RuntimeError, match="parent"):
        stack.unlock_()
    assert parent["nested"].is_locked


# ------------------------------------------------ to(..., inplace=True)
@pytest.mark.parametrize("lib", LIBS)
def test_to_dtype_inplace_changes_self_and_keeps_nested(lib):
    td = small(lib)
    nested = td["nested"]
    assert td.to(torch.float64, inplace=True) is td
    assert td["obs"].dtype == torch.float64 and td["nested", "x"].dtype == torch.float64
    assert td["nested"] is nested


@pytest.mark.parametrize("lib", LIBS)
def test_to_dtype_inplace_on_lazy_stack(lib):
    stack = lib.LazyStackedTensorDict.lazy_stack([small(lib), small(lib)], 0)
    members = list(stack.tensordicts)
    result = stack.to(torch.float64, inplace=True)
    assert result is stack or lib is tensordict  # tensordict 0.15.3: a new stack of the members
    assert all(a is b for a, b in zip(stack.tensordicts, members))
    assert all(member["obs"].dtype == torch.float64 for member in members)


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("how", ["lock", "memmap", "share_memory"])
def test_to_dtype_inplace_refused_when_locked(lib, how):
    td = small(lib)
    td = {"lock": td.lock_, "memmap": td.memmap_, "share_memory": td.share_memory_}[how]()
    with pytest.raises(RuntimeError, match="Cannot modify locked TensorDict"):
        td.to(torch.float64, inplace=True)
    assert td["obs"].dtype == torch.float32 and td.is_locked


def test_to_inplace_error_says_what_and_how():
    td = small(shared_td).lock_()
    with pytest.raises(shared_td.LockedTensorDictError, match=r"to\(\.\.\., inplace=True\).*unlock_\(\)"):
        td.to(torch.float64, inplace=True)


# ------------------------------------------------ rename_key_ of a locked tensordict
@pytest.mark.parametrize("lib", LIBS)
def test_locked_rename_onto_existing_key_is_a_lock_error(lib):
    td = small(lib).lock_()
    with pytest.raises(RuntimeError, match="Cannot modify locked TensorDict"):
        td.rename_key_("obs", "nested", safe=True)
    assert set(td.keys()) == {"obs", "nested"}


@pytest.mark.parametrize("lib", LIBS)
def test_safe_rename_onto_existing_key(lib):
    td = small(lib)
    with pytest.raises(KeyError, match="already present in TensorDict"):
        td.rename_key_("obs", "nested", safe=True)
    assert isinstance(td["obs"], torch.Tensor)
