"""A tensordict nested in two locked tensordicts keeps both locks: unlocking either root
is refused, as in tensordict 0.15.3 (found by running tensordict's test_errors.py lock
tests against shared_td, which unlocked the shared entry under the other root)."""
from __future__ import annotations

import gc

import pytest
import torch

import shared_td
from tests.reference import LIBS

LOCKED_GRAPH = "Cannot unlock a tensordict that is part of a locked graph"


def two_roots(lib):
    first = lib.TensorDict({("shared", "inner", "x"): torch.zeros(2)}, [2]).lock_()
    second = lib.TensorDict({"shared": first["shared"]}, [2]).lock_()
    return first, second


@pytest.mark.parametrize("lib", LIBS)
def test_unlocking_either_root_is_refused(lib):
    first, second = two_roots(lib)
    for root in (first, second):
        with pytest.raises(RuntimeError, match=LOCKED_GRAPH):
            root.unlock_()
    # nothing was unlocked on the way: both roots still refuse new keys
    assert first.is_locked and second.is_locked and first["shared", "inner"].is_locked
    with pytest.raises(RuntimeError, match="Cannot modify locked TensorDict"):
        second["shared"]["new"] = torch.zeros(2)


@pytest.mark.parametrize("lib", LIBS)
def test_a_root_holding_both_may_unlock_them(lib):
    first, second = two_roots(lib)
    both = lib.TensorDict({"first": first, "second": second}, [2]).lock_()
    both.unlock_()
    assert not first.is_locked and not second.is_locked
    both.lock_()
    assert first["shared"].is_locked


@pytest.mark.parametrize("lib", LIBS)
def test_once_the_other_root_is_gone_unlocking_works(lib):
    first, second = two_roots(lib)
    del second
    gc.collect()
    first.unlock_()
    first["shared"]["new"] = torch.ones(2)
    assert (first["shared", "new"] == 1).all()


def test_the_error_names_the_other_root_and_the_fix():
    first, second = two_roots(shared_td)
    with pytest.raises(RuntimeError, match=r"also held by another locked tensordict \(keys \['shared'\]\)\. "
                       "Drop that tensordict, or unlock both through a tensordict that holds them."):
        first.unlock_()
