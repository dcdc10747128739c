"""Session 23, side by side with tensordict 0.15.3 (differential fuzz findings B7, A6):

* B7: a row write whose value has extra leading size-1 dims (``td[0] = {"r": ones(1, 2)}``
  into a row of 2, and ``update_at_``/``set_at_`` alike, nested and from TensorDict
  sources) was refused; torch's ``x[0] = ones(1, 2)`` drops those dims, and tensordict
  writes it. Only that is accepted: a value torch refuses still raises, naming the key,
  and writes nothing.
* A6: ``repeat`` (and ``repeat_interleave``) of a lazy stack whose members differ in keys
  gave a TensorDict of the keys every member has: the others were lost. Such a stack now
  gives a lazy stack of the members repeated, as tensordict does; a stack whose members
  agree still gives a TensorDict (README).
"""
from __future__ import annotations

import warnings

import pytest
import torch

import shared_td
from shared_td.errors import BatchSizeMismatchError
from tests.containers.conftest import assert_same_state, td_state
from tests.reference import LIBS

@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _rows(lib):
    """Batch [3]: a leaf "r" of rows of 2 and a nested TensorDict "n" with a leaf "q" alike."""
    return lib.TensorDict({"r": torch.zeros(3, 2), "n": lib.TensorDict({"q": torch.zeros(3, 2)}, [3])}, [3])


# ---------------------------------------------------------------- B7
_WRITES = {
    "setitem dict": lambda lib, td, v: td.__setitem__(1, {"r": v, "n": {"q": v}}),
    "setitem TensorDict": lambda lib, td, v: td.__setitem__(1, lib.TensorDict({"r": v, "n": lib.TensorDict({"q": v})})),
    "setitem tensor": lambda lib, td, v: td.__setitem__(1, v),
    "update_at_ dict": lambda lib, td, v: td.update_at_({"r": v, ("n", "q"): v}, 1),
    "update_at_ TensorDict": lambda lib, td, v: td.update_at_(
        lib.TensorDict({"r": v, "n": lib.TensorDict({"q": v})}), 1),
    "set_at_": lambda lib, td, v: td.set_at_("r", v, 1).set_at_(("n", "q"), v, 1),
}


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("write", list(_WRITES))
@pytest.mark.parametrize("shape", [(1, 2), (1, 1, 2), (1, 1)])
def test_a_row_value_with_leading_size_1_dims_is_written(lib, write, shape):
    """Refused before (BatchSizeMismatchError) for every write but none; torch drops the
    leading 1s of ``x[1] = value`` and tensordict writes it."""
    td = _rows(lib)
    value = torch.arange(1.0, 1.0 + torch.Size(shape).numel()).reshape(shape)
    _WRITES[write](lib, td, value)
    expected = torch.zeros(3, 2)
    expected[1] = value  # (torch's own rule)
    assert torch.equal(td["r"], expected)
    assert torch.equal(td["n", "q"], expected)


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("write", list(_WRITES))
@pytest.mark.parametrize("shape", [(2, 1), (2, 2), (1, 3), (2, 1, 2)])
def test_a_row_value_that_torch_refuses_is_still_refused(lib, write, shape):
    """Only leading 1s are dropped, as torch drops them: anything else raises (as in
    tensordict) and leaves the tensordict as it was."""
    td = _rows(lib)
    with pytest.raises(RuntimeError):
        torch.zeros(3, 2)[1] = torch.ones(shape)  # torch refuses it too
    before = td_state(td) if lib is shared_td else None
    with pytest.raises(RuntimeError) as caught:
        _WRITES[write](lib, td, torch.ones(shape))
    if lib is shared_td:
        assert isinstance(caught.value, BatchSizeMismatchError)
        assert "'r'" in str(caught.value) or "('n', 'q')" in str(caught.value)  # the key at fault
        assert_same_state(before, td_state(td))


@pytest.mark.parametrize("index", [[0, 2], torch.tensor([True, False, True]), slice(0, 2)])
def test_leading_size_1_dims_through_an_index_list_mask_or_slice_as_torch(index):
    """The same rule through an index tensor, a mask and a slice (torch's index_put_ and
    copy into a view both drop the leading 1s)."""
    td = _rows(shared_td)
    value = torch.tensor([[[5.0, 6.0]]])  # [1, 1, 2]
    td[index] = value
    expected = torch.zeros(3, 2)
    expected[index] = value
    assert torch.equal(td["r"], expected) and torch.equal(td["n", "q"], expected)


@pytest.mark.parametrize("write", ["setitem", "update_at_", "set_at_"])
def test_a_lazy_stack_row_takes_leading_size_1_dims_as_its_dense_form(write):
    """A lazy stack's row is written as the dense TensorDict's (shared_td: its members
    plan it the same way); tensordict 0.15.3's lazy stack refuses ``lz[0] = {"r":
    ones(1, 2)}`` and its update_at_, though its TensorDict and torch take it."""
    lazy = shared_td.lazy_stack([shared_td.TensorDict({"r": torch.zeros(2)}) for _ in range(3)])
    value = torch.tensor([[3.0, 4.0]])
    if write == "setitem":
        lazy[1] = {"r": value}
    elif write == "update_at_":
        lazy.update_at_({"r": value}, 1)
    else:
        lazy.set_at_("r", value, 1)
    assert lazy["r"].tolist() == [[0.0, 0.0], [3.0, 4.0], [0.0, 0.0]]
    assert lazy.tensordicts[1]["r"].tolist() == [3.0, 4.0]


def test_in_place_set_still_refuses_leading_size_1_dims():
    """``set_`` copies into the whole entry (``copy_``), which takes no extra dims, in
    torch and in tensordict: unchanged."""
    td = _rows(shared_td)
    with pytest.raises(RuntimeError):
        td[0].set_("r", torch.ones(1, 2))
    assert not td["r"].any()


# ---------------------------------------------------------------- A6
def _mixed(lib, stack_dim=0):
    """A lazy stack of two members of batch [2]: only the second has "only"."""
    first = lib.TensorDict({"a": torch.arange(2.0), "s": "x"}, [2])
    second = lib.TensorDict({"a": torch.arange(2.0) + 10, "only": torch.ones(2)}, [2])
    return lib.lazy_stack([first, second], stack_dim)


def _members(out):
    return type(out).__name__, out.stack_dim, [sorted(m.keys()) for m in out.tensordicts]


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("stack_dim, counts", [(0, (2, 1)), (0, (3, 2)), (1, (2, 2)), (1, (1, 3))])
def test_repeat_of_a_lazy_stack_whose_members_differ_in_keys_keeps_every_key(lib, stack_dim, counts):
    """Was a TensorDict of "a" only ("only" and "s" lost)."""
    lazy = _mixed(lib, stack_dim)
    out = lazy.repeat(*counts)
    tiles = counts[stack_dim]
    assert _members(out) == ("LazyStackedTensorDict", stack_dim, [["a", "s"], ["a", "only"]] * tiles)
    assert out.batch_size == torch.zeros(lazy.batch_size).repeat(*counts).shape
    assert torch.equal(out["a"], lazy["a"].repeat(*counts))
    assert out.tensordicts[-1]["only"].tolist() == [1.0] * (2 * counts[1 - stack_dim])
    assert out.tensordicts[0]["s"] == "x"


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("repeats, dim", [(2, 0), (torch.tensor([1, 3]), 0), (2, 1), (2, None),
                                          (torch.tensor([0, 2, 1, 1]), None)])
def test_repeat_interleave_of_a_lazy_stack_whose_members_differ_in_keys_keeps_every_key(lib, repeats, dim):
    lazy = _mixed(lib)
    out = lazy.repeat_interleave(repeats, dim)
    assert type(out).__name__ == "LazyStackedTensorDict"
    assert torch.equal(out["a"], lazy["a"].repeat_interleave(repeats, dim))
    assert any("only" in member.keys() for member in out.tensordicts)
    assert all(("only" in member.keys()) == (member["a"].min() >= 10) for member in out.tensordicts)


@pytest.mark.parametrize("lib", LIBS)
def test_repeat_of_a_nested_lazy_stack_whose_members_differ_keeps_every_key(lib):
    td = lib.TensorDict({"l": _mixed(lib)}, [2])
    out = td.repeat(2).get("l")
    assert _members(out) == ("LazyStackedTensorDict", 0, [["a", "s"], ["a", "only"]] * 2)


@pytest.mark.parametrize("lib", LIBS)
def test_repeat_of_a_lazy_stack_with_ragged_members_gives_a_lazy_stack(lib):
    """Members whose "a" differ in shape: was a RuntimeError (no dense copy exists)."""
    lazy = lib.lazy_stack([lib.TensorDict(a=torch.zeros(2)), lib.TensorDict(a=torch.ones(3))])
    out = lazy.repeat(2)
    assert [m["a"].tolist() for m in out.tensordicts] == [[0.0, 0.0], [1.0, 1.0, 1.0]] * 2


def test_repeat_of_a_lazy_stack_gives_copies_and_keeps_names_and_lock():
    """Each tile is a copy of its own (as torch's repeat; tensordict 0.15.3 puts the same
    member objects in every tile, so a write into one reaches the others); the stack dim's
    name and the lock stay, as a dense repeat keeps them."""
    lazy = shared_td.lazy_stack([_mixed(shared_td).tensordicts[0], _mixed(shared_td).tensordicts[1]],
                                stack_dim_name="t").lock_()
    out = lazy.repeat(2, 1)
    out.tensordicts[0]["a"].add_(100)
    assert out["a"][:, 0].tolist() == [100.0, 10.0, 0.0, 10.0]
    assert lazy.tensordicts[0]["a"].tolist() == [0.0, 1.0]
    assert out.names == ["t", None] and out.is_locked


def test_repeat_of_a_lazy_stack_whose_members_agree_still_gives_a_tensordict():
    """README: a lazy stack's repeat gives a TensorDict when nothing would be lost."""
    lazy = shared_td.lazy_stack([shared_td.TensorDict(a=torch.zeros(2), batch_size=[2]) for _ in range(2)])
    assert type(lazy.repeat(2, 1)) is shared_td.TensorDict
    assert type(lazy.repeat_interleave(2, 0)) is shared_td.TensorDict
