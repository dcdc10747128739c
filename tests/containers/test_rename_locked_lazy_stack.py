"""rename_key_ on a locked lazy stack (lock_, share_memory_, memmap_) refuses with the lock
error first, as a locked TensorDict does (and tensordict 0.15.3 for both), also when
safe=True and the new key exists; nothing is renamed (found by tensordict's test_methods.py)."""
import pytest
import torch

from shared_td import LazyStackedTensorDict, TensorDict


def _members():
    return [TensorDict(a=torch.zeros(2), b=torch.ones(2), n=TensorDict(x=torch.zeros(2), batch_size=[2]),
                       batch_size=[2]) for _ in range(2)]


@pytest.mark.parametrize("lock", ["lock_", "share_memory_", "memmap_"])
@pytest.mark.parametrize("stack_dim", [0, 1])
@pytest.mark.parametrize("old,new", [("a", "b"), (("n", "x"), "b")])
def test_locked_lazy_stack_rename_safe_existing_raises_lock_error(lock, stack_dim, old, new):
    lz = getattr(LazyStackedTensorDict.lazy_stack(_members(), stack_dim), lock)()
    with pytest.raises(RuntimeError, match="locked"):
        lz.rename_key_(old, new, safe=True)
    assert set(lz.keys(True, True)) == {"a", "b", ("n", "x")}


@pytest.mark.parametrize("stack_dim", [0, 1])
def test_lazy_stack_matches_tensordict(stack_dim):
    td = _members()[0].lock_()
    lz = LazyStackedTensorDict.lazy_stack(_members(), stack_dim).lock_()
    errs = []
    for t in (td, lz):
        with pytest.raises(Exception) as ei:
            t.rename_key_("a", "b", safe=True)
        errs.append(type(ei.value))
    assert errs[0] is errs[1]


def test_unlocked_lazy_stack_safe_existing_still_keyerror():
    lz = LazyStackedTensorDict.lazy_stack(_members(), 0)
    with pytest.raises(KeyError, match="already present"):
        lz.rename_key_("a", "b", safe=True)
    lz.rename_key_("a", "z", safe=True)
    assert "z" in lz.keys() and "a" not in lz.keys()
