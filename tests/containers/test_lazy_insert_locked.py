"""Fuzzer finding (seed 303593): a lazy stack that says is_locked (every member locked: a reshape of a
memory-mapped or locked stack) must refuse append/insert, and the lock is checked before the
member's device and batch size, as tensordict 0.15.3 does."""
import pytest
import torch

import shared_td


def _stack():
    return shared_td.lazy_stack([shared_td.TensorDict({"a": torch.zeros(2)}, [2]) for _ in range(3)], 0)


@pytest.mark.parametrize("meth", ["append", "insert"])
def test_reshape_of_memmapped_stack_refuses_new_member(tmp_path, meth):
    view = _stack().memmap_(prefix=str(tmp_path)).reshape(-1)
    assert view.is_locked
    new = shared_td.TensorDict({"a": torch.ones(())}, [], device="cpu")
    with pytest.raises(RuntimeError, match="Cannot modify locked TensorDict"):
        view.append(new) if meth == "append" else view.insert(0, new)
    assert view.batch_size == torch.Size([6]) and view.is_locked


@pytest.mark.parametrize("meth", ["append", "insert"])
def test_locked_stack_refuses_before_device_check(tmp_path, meth):
    ls = _stack().memmap_(prefix=str(tmp_path))  # on cpu now
    new = shared_td.TensorDict({"a": torch.ones(2)}, [2])  # device None
    with pytest.raises(RuntimeError, match="Cannot modify locked TensorDict"):
        ls.append(new) if meth == "append" else ls.insert(0, new)
    assert ls.batch_size == torch.Size([3, 2])


def test_stack_of_locked_members_refuses_new_member():
    ls = shared_td.lazy_stack([shared_td.TensorDict({"a": torch.zeros(2)}, [2]).lock_() for _ in range(2)], 0)
    assert ls.is_locked
    with pytest.raises(RuntimeError, match="Cannot modify locked TensorDict"):
        ls.append(shared_td.TensorDict({"a": torch.zeros(2)}, [2]))
    assert ls.batch_size == torch.Size([2, 2]) and ls.is_locked
