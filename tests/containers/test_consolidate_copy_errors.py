"""consolidate() whose copy of a leaf fails: the error names the key of that leaf.

Before, the error was torch's alone ("Cannot copy out of meta tensor; no data!"), which
left a user with a tree of thousands of leaves to search. The class stays the copy's
(as tensordict 0.15.3 raises it), so handlers written for either library still catch it.
"""
from __future__ import annotations

import errno
import os

import pytest
import torch

from shared_td import TensorDict, lazy_stack
from shared_td.containers.consolidated_copy import leaf_copy_error


def _with_meta_leaf(size: int = 3) -> TensorDict:
    return TensorDict(
        a=torch.zeros(3),
        b={"c": torch.empty(3, size, device="meta"), "d": torch.ones(3)},
        batch_size=[3],
    )


@pytest.mark.parametrize("options", [
    {},
    {"share_memory": True},
    {"num_threads": 2},
    {"inplace": True},
])
@pytest.mark.parametrize("size", [1, 100_000], ids=["packed", "big"])
def test_meta_leaf_named(options, size):
    td = _with_meta_leaf(size)
    with pytest.raises(NotImplementedError, match=r"could not copy the leaf \('b', 'c'\): Cannot copy out of meta"):
        td.consolidate(**options)
    assert not td.is_locked and not td.is_consolidated()  # inplace=True changed nothing
    assert td["b", "c"].is_meta


def test_meta_leaf_named_in_a_file_and_the_file_not_made(tmp_path):
    path = tmp_path / "td.bin"
    with pytest.raises(NotImplementedError, match=r"\('b', 'c'\)"):
        _with_meta_leaf().consolidate(filename=path)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("inplace", [False, True])
def test_meta_leaf_named_by_the_future_of_return_early(inplace):
    td = _with_meta_leaf()
    future = td.consolidate(num_threads=2, return_early=True, inplace=inplace)
    with pytest.raises(NotImplementedError, match=r"\('b', 'c'\)"):
        future.result(timeout=60)
    assert not td.is_locked  # unlocked again after the failed copy


def test_member_of_a_lazy_stack_named():
    stack = lazy_stack([TensorDict(x=torch.zeros(2)), TensorDict(x=torch.empty(2, device="meta"))])
    parent = TensorDict(s=stack, batch_size=[2])
    with pytest.raises(NotImplementedError, match=r"the leaf \('s', 'x'\) of member 1 of the lazy stack at 's'"):
        parent.consolidate()


class _RefusesCopies(torch.Tensor):
    """A CPU tensor whose every operation but its making fails, as a tensor subclass over
    a device torch cannot read would."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.as_subclass or func.__name__ in ("__get__", "__set__"):
            return super().__torch_function__(func, types, args, kwargs or {})
        raise RuntimeError(f"{func.__name__} refused (simulated)")


def test_failed_copy_among_packed_leaves_names_that_leaf():
    """Small leaves are copied by one torch.cat per dtype run: the error names the one
    leaf of the run whose copy fails, not the run."""
    bad = torch.ones(3).as_subclass(_RefusesCopies)
    td = TensorDict({"a": torch.zeros(3), "n": {"bad": bad}, "z": torch.ones(3)}, batch_size=[3])
    with pytest.raises(RuntimeError, match=r"could not copy the leaf \('n', 'bad'\): .*refused \(simulated\)"):
        td.consolidate()


def test_error_class_as_tensordict_raises_it():
    tensordict = pytest.importorskip("tensordict")
    theirs = tensordict.TensorDict(a=torch.empty(3, device="meta"), batch_size=[3])
    with pytest.raises(Exception) as raised:
        theirs.consolidate()
    with pytest.raises(type(raised.value), match="'a'"):
        TensorDict(a=torch.empty(3, device="meta"), batch_size=[3]).consolidate()


def test_os_error_keeps_its_errno():
    error = leaf_copy_error(OSError(errno.ENOSPC, "No space left on device"), "the leaf 'a'")
    assert type(error) is OSError and error.errno == errno.ENOSPC and "'a'" in str(error)


def test_exception_without_a_message_constructor_gets_a_note():
    class Picky(Exception):
        def __init__(self, code: int, detail: str):
            super().__init__(code, detail)

    original = Picky(3, "nope")
    error = leaf_copy_error(original, "the leaf 'a'")
    assert error is original and "'a'" in error.__notes__[0]
