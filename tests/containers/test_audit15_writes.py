"""Audit 15 (F1, F2, F7 and two leftovers): ``update_at_``, ``set_at_`` and ``td[idx] = ...``
into trees holding lazy stacks (nested in a TensorDict or on their own) and read-only
(``mode="r"``) members, side by side with tensordict 0.15.3.

The rule where tensordict raises or half-writes: the write succeeds as the dense one
does, or raises with NOTHING written -- every write is checked, below lazy stacks and
read-only members too, before the first byte is written.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import shared_td
from shared_td.errors import ReadOnlyError
from tests.reference import LIBS, needs_tensordict, outcome, tensordict

def _lazy(lib, n=3):
    return lib.lazy_stack([lib.TensorDict(a=torch.zeros(4, 5), batch_size=[4]) for _ in range(n)])


def _read_only(tmp_path, name="ro", rows=4):
    """A TensorDict whose tensors are read-only (memory-mapped, loaded with mode="r")."""
    shared_td.TensorDict(a=torch.zeros(rows, 5), batch_size=[rows]).memmap_(str(tmp_path / name))
    return shared_td.TensorDict.load_memmap(str(tmp_path / name), mode="r")


# ---------------------------------------------------------------- F1: dicts into lazy stacks
@pytest.mark.parametrize("lib", LIBS)
def test_update_at_dict_into_nested_lazy_stack_writes_both(lib):
    # Before: BatchSizeMismatchError "entry 'a' of shape [5]" after x was written.
    p = lib.TensorDict(x=torch.zeros(3, 4, 5), l=_lazy(lib), batch_size=[3, 4])
    p.update_at_({"x": torch.ones(3, 5), "l": {"a": torch.ones(3, 5)}}, (slice(None), 0))
    assert (p["x"].sum().item(), p["l", "a"].sum().item()) == (15.0, 15.0)
    assert p["l", "a"][:, 0].eq(1).all()


@pytest.mark.parametrize("lib", LIBS)
def test_update_at_dict_into_lazy_stack_rows(lib):
    lazy = _lazy(lib)
    lazy.update_at_({"a": torch.ones(3, 5)}, (slice(None), 1))
    assert lazy["a"].sum().item() == 15.0 and lazy["a"][:, 1].eq(1).all()


@pytest.mark.parametrize("lib", LIBS)
def test_update_at_that_fails_below_a_nested_lazy_stack_raises(lib):
    p = lib.TensorDict(x=torch.zeros(3, 4, 5), l=_lazy(lib), batch_size=[3, 4])
    with pytest.raises(RuntimeError):
        p.update_at_({"x": torch.ones(3, 5), "l": {"a": torch.ones(3, 7)}}, (slice(None), 0))


def test_update_at_that_fails_below_a_nested_lazy_stack_writes_nothing():
    # tensordict 0.15.3 writes x, then raises; here nothing is written
    p = shared_td.TensorDict(x=torch.zeros(3, 4, 5), l=_lazy(shared_td), batch_size=[3, 4])
    with pytest.raises(RuntimeError, match="'a'"):
        p.update_at_({"x": torch.ones(3, 5), "l": {"a": torch.ones(3, 7)}}, (slice(None), 0))
    assert p["x"].sum().item() == 0.0 and p["l", "a"].sum().item() == 0.0


def test_setitem_that_fails_below_a_nested_lazy_stack_writes_nothing():
    lazy = shared_td.lazy_stack([shared_td.TensorDict(a=torch.zeros(4, 5), b={"c": torch.zeros(4)},
                                                      batch_size=[4]) for _ in range(3)])
    p = shared_td.TensorDict(x=torch.zeros(3, 4), l=lazy, batch_size=[3, 4])
    with pytest.raises(RuntimeError, match="'c'"):
        p[:, 0] = {"x": torch.ones(3), "l": {"a": torch.ones(3, 5), "b": {"c": torch.ones(3, 2)}}}
    assert p["x"].sum().item() == 0.0 and p["l", "a"].sum().item() == 0.0


# ---------------------------------------------------------------- F2: read-only members
def test_update_at_entry_dims_into_read_only_lazy_stack_writes_nothing(tmp_path):
    # Before: x was written, then ReadOnlyError from the lazy stack's member.
    ro = shared_td.lazy_stack([_read_only(tmp_path, f"m{i}") for i in range(3)])
    p = shared_td.TensorDict(x=torch.zeros(3, 4, 5), l=ro, batch_size=[3, 4])
    with pytest.raises(ReadOnlyError, match=r"\((update_at_|set_at_)\)"):
        p.update_at_({"x": torch.ones(3, 4), "l": {"a": torch.ones(3, 4)}}, (..., 0))
    assert p["x"].sum().item() == 0.0


@pytest.mark.parametrize("write", ["setitem", "update_at_", "set_at_", "update_at_entry_dims"])
def test_lazy_stack_with_one_read_only_member_writes_nothing(tmp_path, write):
    # Before: the writable member was written, then the read-only one raised.
    free = shared_td.TensorDict(a=torch.zeros(4, 5), batch_size=[4])
    lazy = shared_td.lazy_stack([free, _read_only(tmp_path)])
    with pytest.raises(ReadOnlyError):
        if write == "setitem":
            lazy[:, 0] = shared_td.TensorDict(a=torch.ones(2, 5), batch_size=[2])
        elif write == "update_at_":
            lazy.update_at_({"a": torch.ones(2, 5)}, (slice(None), 0))
        elif write == "set_at_":
            lazy.set_at_("a", torch.ones(2, 5), (slice(None), 0))
        else:
            lazy.update_at_({"a": torch.ones(2, 4)}, (..., 0))
    assert free["a"].sum().item() == 0.0


def test_ragged_lazy_stack_with_one_read_only_member_set_at_writes_nothing(tmp_path):
    # members of different feature shapes: set_at_ goes member by member
    free = shared_td.TensorDict(a=torch.zeros(4, 3), batch_size=[4])
    lazy = shared_td.lazy_stack([free, _read_only(tmp_path)])
    with pytest.raises(ReadOnlyError):
        lazy.set_at_("a", 1.0, (slice(None), 0))
    assert free["a"].sum().item() == 0.0


def test_setitem_into_tree_with_read_only_nested_lazy_member_writes_nothing(tmp_path):
    free = shared_td.TensorDict(a=torch.zeros(4, 5), batch_size=[4])
    p = shared_td.TensorDict(x=torch.zeros(2, 4), l=shared_td.lazy_stack([free, _read_only(tmp_path)]),
                             batch_size=[2, 4])
    with pytest.raises(ReadOnlyError):
        p[:, 1] = {"x": torch.ones(2), "l": {"a": torch.ones(2, 5)}}
    assert p["x"].sum().item() == 0.0 and free["a"].sum().item() == 0.0


# ---------------------------------------------------------------- F7: the error names the key
def test_update_at_entry_dims_error_names_the_entry_at_fault():
    td = shared_td.TensorDict(a=torch.zeros(3, 4, 5), b=torch.zeros(3, 4), batch_size=[3, 4])
    with pytest.raises(RuntimeError, match="entry 'b'"):  # (it said 'a')
        td.update_at_({"a": torch.ones(3, 4), "b": torch.ones(7)}, (..., 0))
    assert td["a"].sum().item() == 0.0


@pytest.mark.parametrize("lib", LIBS)
def test_update_at_entry_dims_with_a_non_tensor_value_raises_type_error(lib):
    td = lib.TensorDict(a=torch.zeros(3, 4, 5), s=lib.NonTensorData("x", batch_size=[3, 4]), batch_size=[3, 4])
    with pytest.raises(TypeError):
        td.update_at_({"a": torch.ones(3, 4), "s": "y"}, (..., 0))


def test_update_at_entry_dims_non_tensor_error_names_it():
    td = shared_td.TensorDict(a=torch.zeros(3, 4, 5), s=shared_td.NonTensorData("x", batch_size=[3, 4]),
                              batch_size=[3, 4])
    with pytest.raises(TypeError, match="'s'"):
        td.update_at_({"a": torch.ones(3, 4), "s": "y"}, (..., 0))
    assert td["a"].sum().item() == 0.0


def test_update_at_entry_dims_read_only_error_names_update_at(tmp_path):
    shared_td.TensorDict(a=torch.zeros(3, 4, 5), batch_size=[3, 4]).memmap_(str(tmp_path / "t"))
    td = shared_td.TensorDict.load_memmap(str(tmp_path / "t"), mode="r")
    with pytest.raises(ReadOnlyError, match=r"\(update_at_\)"):  # (it said td[index] = value)
        td.update_at_({"a": torch.ones(3, 4)}, (..., 0))


# ---------------------------------------------------------------- leftovers
@pytest.mark.parametrize("lib", LIBS)
def test_lazy_mask_write_of_an_unbatched_source_broadcasts(lib):
    # tensordict's lazy stack broadcasts a source of batch [] into the selected rows
    lazy = lib.lazy_stack([lib.TensorDict(a=torch.zeros(4), batch_size=[4]) for _ in range(3)])
    mask = torch.zeros(3, 4, dtype=torch.bool)
    mask[0, 1] = mask[2, 3] = True
    lazy[mask] = lib.TensorDict({"a": 1.0}, [])
    assert lazy["a"].sum().item() == 2.0 and lazy["a"][mask].eq(1).all()


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("index", [1, (slice(None), 1)], ids=["member", "column"])
def test_lazy_row_write_of_an_unbatched_source_with_feature_dims(lib, index):
    lazy = lib.lazy_stack([lib.TensorDict(a=torch.zeros(4, 5), b={"c": torch.zeros(4)}, batch_size=[4])
                           for _ in range(3)])
    lazy[index] = lib.TensorDict(a=torch.ones(5), b={"c": torch.ones(())}, batch_size=[])
    rows = 4 if index == 1 else 3
    assert (lazy["a"].sum().item(), lazy["b", "c"].sum().item()) == (5.0 * rows, float(rows))


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("flag", [False, True])
def test_lazy_write_at_a_0d_bool_of_a_td_row(lib, flag):
    td = lib.TensorDict(a=torch.arange(12.0).reshape(3, 4), batch_size=[3, 4])
    lazy = lib.lazy_stack([lib.TensorDict(a=torch.zeros(4), batch_size=[4]) for _ in range(3)])
    lazy[torch.tensor(flag)] = td[1, 2]
    assert lazy["a"].sum().item() == (72.0 if flag else 0.0)


def test_unbatched_source_that_does_not_fit_a_lazy_member_writes_nothing():
    lazy = shared_td.lazy_stack([shared_td.TensorDict(a=torch.zeros(4, 5), b={"c": torch.zeros(4)},
                                                      batch_size=[4]) for _ in range(3)])
    with pytest.raises(RuntimeError, match="'c'"):
        lazy[:, 0] = shared_td.TensorDict(a=torch.ones(5), b={"c": torch.ones(7)}, batch_size=[])
    assert lazy["a"].sum().item() == 0.0


@pytest.mark.parametrize("lib", LIBS)
def test_dense_row_write_of_an_unbatched_source_still_raises(lib):
    # tensordict's TensorDict refuses it (its lazy stack takes it, above)
    td = lib.TensorDict(a=torch.zeros(3, 4), batch_size=[3, 4])
    assert outcome(lambda: td.__setitem__((slice(None), 1), lib.TensorDict({"a": 1.0}, []))) == "error"


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("nested", [False, True])
def test_lazy_set_at_takes_a_numpy_array(lib, nested):
    lazy = lib.lazy_stack([lib.TensorDict(a=torch.zeros(4), batch_size=[4]) for _ in range(3)])
    target, key = (lib.TensorDict(l=lazy, batch_size=[3]), ("l", "a")) if nested else (lazy, "a")
    target.set_at_(key, np.ones(4, dtype=np.float32), 1)
    assert lazy["a"].sum().item() == 4.0 and lazy["a"][1].eq(1).all()


@pytest.mark.parametrize("lib", LIBS)
def test_lazy_set_at_of_a_nested_tensordict_splits_the_value(lib):
    # Before: the whole [3] value was given to every member's row (a BatchSizeMismatchError)
    lazy = lib.lazy_stack([lib.TensorDict(n=lib.TensorDict(b=torch.zeros(4), batch_size=[4]), batch_size=[4])
                           for _ in range(3)])
    lazy.set_at_("n", lib.TensorDict(b=torch.arange(1.0, 4.0), batch_size=[3]), (slice(None), 1))
    assert lazy["n", "b"][:, 1].tolist() == [1.0, 2.0, 3.0] and lazy["n", "b"].sum().item() == 6.0


@pytest.mark.parametrize("lib", LIBS)
def test_set_at_of_a_non_tensor_below_a_lazy_stack(lib):
    # Before: AttributeError ('LazyStackedTensorDict' object has no attribute '_tensordict')
    lazy = lib.lazy_stack([lib.TensorDict(s=lib.NonTensorData("x", batch_size=[4]), batch_size=[4])
                           for _ in range(3)])
    parent = lib.TensorDict(l=lazy, batch_size=[3])
    parent.set_at_(("l", "s"), "z", (0, 3))
    assert (lazy[0, 3]["s"], lazy[0, 2]["s"], lazy[1, 3]["s"]) == ("z", "x", "x")


@pytest.mark.parametrize("lib", LIBS)
def test_number_written_at_rows_reaches_a_nested_lazy_stack(lib):
    # Before: x was written and the lazy stack's members were not (the write went into
    # the stacked copy that reading its leaves gives)
    p = lib.TensorDict(x=torch.zeros(3, 4), l=_lazy(lib), batch_size=[3, 4])
    p[:, 0] = 1.0
    assert (p["x"].sum().item(), p["l", "a"].sum().item()) == (3.0, 15.0)
    assert outcome(lambda: p.__setitem__((slice(None), 1), torch.ones(5))) == "error"
    assert (p["x"].sum().item(), p["l", "a"].sum().item()) == (3.0, 15.0)


def test_number_written_at_rows_with_a_read_only_lazy_member_writes_nothing(tmp_path):
    free = shared_td.TensorDict(a=torch.zeros(4, 5), batch_size=[4])
    p = shared_td.TensorDict(x=torch.zeros(2, 4), l=shared_td.lazy_stack([free, _read_only(tmp_path)]),
                             batch_size=[2, 4])
    with pytest.raises(ReadOnlyError):
        p[:, 0] = 1.0
    assert p["x"].sum().item() == 0.0 and free["a"].sum().item() == 0.0


@pytest.mark.parametrize("lib", [pytest.param(shared_td, id="shared_td"),
                                 pytest.param(tensordict, id="tensordict", marks=needs_tensordict)])
@pytest.mark.parametrize("stack_dim, index, value", [
    (0, (slice(None), 0), torch.arange(3.0)),
    (0, (slice(None), slice(0, 2)), torch.arange(6.0).reshape(3, 2)),
    (1, (0, slice(None)), torch.arange(3.0)),
    (1, (slice(None), 1), torch.arange(4.0)),
], ids=["rows-of-dim-0", "block", "stack-dim-1", "one-member"])
def test_a_tensor_written_at_rows_of_a_lazy_stack_is_split_between_its_members(lib, stack_dim, index, value):
    # as on the dense stack: the tensor broadcast to each entry's part, then each member
    # its own slice (before: the whole tensor went to each member and the write raised)
    members = [lib.TensorDict(a=torch.zeros(4), n=lib.TensorDict(c=torch.zeros(4), batch_size=[4]), batch_size=[4])
               for _ in range(3)]
    lazy = lib.lazy_stack(members, stack_dim)
    dense = lazy.to_tensordict()
    lazy[index] = value
    dense[index] = value
    assert torch.equal(lazy["a"], dense["a"]) and torch.equal(lazy["n", "c"], dense["n", "c"])
    assert not torch.equal(dense["a"], torch.zeros_like(dense["a"]))
