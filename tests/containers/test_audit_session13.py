"""Audit of keys(sort=True) and refine_names, side by side with tensordict 0.15.3.

* ``sort=True`` ordered nested keys as tuples of parts (``("a", "c")`` before ``"a-b"``),
  tensordict by the parts joined with "." (``"a-b"`` < ``"a.c"``): keys, values and items
  came in another order whenever a key held a character that sorts before ".".
* ``refine_names`` set the names outright: it renamed named dims (``["a", None]`` refined
  to ``("z", "b")`` gave ``["z", "b"]``) and refused ``...``. As torch's and
  tensordict's, it names the unnamed dims, checks the named ones (RuntimeError, nothing
  renamed) and takes one ``...`` for the dims whose names stay; lazy stacks share it.
"""
from __future__ import annotations

import pytest
import torch

import shared_td
from tests.containers.conftest import assert_same_state, td_state


@pytest.fixture
def tensordict():
    return pytest.importorskip("tensordict")


def _sortable_tree(lib):
    # ' ' and '-' sort before '.', '_' after it; "a.c" (one key) sorts as ("a", "c")
    return lib.TensorDict(
        {"a-b": torch.zeros(2), "a": {"c": torch.zeros(2), "_": {"z": torch.zeros(2)}}, "a b": torch.zeros(2),
         "A": torch.zeros(2), "a.z": torch.zeros(2), "a.c": torch.zeros(2), "a_x": torch.zeros(2)},
        [2],
    )


@pytest.mark.parametrize("include_nested", [False, True])
@pytest.mark.parametrize("leaves_only", [False, True])
def test_sorted_keys_values_and_items_come_in_tensordicts_order(tensordict, include_nested, leaves_only):
    ours, theirs = _sortable_tree(shared_td), _sortable_tree(tensordict)
    args = (include_nested, leaves_only)
    expected = list(theirs.keys(*args, sort=True))
    assert list(ours.keys(*args, sort=True)) == expected
    assert len(ours.keys(*args, sort=True)) == len(expected)
    expected_items = [key for key, _value in theirs.items(*args, sort=True)]
    assert [key for key, _value in ours.items(*args, sort=True)] == expected_items
    assert [type(value).__name__ for value in ours.values(*args, sort=True)] == [
        type(value).__name__ for value in theirs.values(*args, sort=True)]


def test_sorted_keys_of_a_lazy_stack_come_in_tensordicts_order(tensordict):
    def stack(lib):
        return lib.lazy_stack([_sortable_tree(lib), _sortable_tree(lib)], 0)

    ours, theirs = stack(shared_td), stack(tensordict)
    assert list(ours.keys(True, sort=True)) == list(theirs.keys(True, sort=True))
    assert [key for key, _ in ours.items(True, True, sort=True)] == [key for key, _ in theirs.items(True, True, sort=True)]


# ------------------------------------------------------------------ refine_names
_REFINES = [
    ("a", None, None),
    ("a", ..., "c"),
    (..., "c"),
    ("a", ...),
    (...,),
    ("a", "b", "c"),
]


@pytest.mark.parametrize("names", _REFINES, ids=str)
@pytest.mark.parametrize("start", [None, ["a", None, None], [None, "b", None]], ids=str)
def test_refine_names_names_unnamed_dims_as_tensordict(tensordict, names, start):
    results = []
    for lib in (shared_td, tensordict):
        td = lib.TensorDict({"x": torch.zeros(2, 3, 4), "n": {"y": torch.zeros(2, 3, 4)}}, [2, 3, 4], names=start)
        try:
            assert td.refine_names(*names) is td
            got = (td.names, td["n"].names)
        except RuntimeError:
            got = "RuntimeError"
        results.append(got if got == "RuntimeError" else tuple(
            None if n is None or all(x is None for x in n) else n for n in got))
    assert results[0] == results[1]


@pytest.mark.parametrize("names", [("z", None), (None, "b"), ("z", ...), (..., "z")], ids=str)
def test_refine_names_of_a_named_dim_to_another_name_raises_and_renames_nothing(tensordict, names):
    theirs = tensordict.TensorDict({"n": {"y": torch.zeros(2, 3)}}, [2, 3], names=["a", "b"])
    with pytest.raises(RuntimeError):
        theirs.refine_names(*names)
    ours = shared_td.TensorDict({"n": {"y": torch.zeros(2, 3)}}, [2, 3], names=["a", "b"])
    before = td_state(ours)
    with pytest.raises(RuntimeError, match="refine_names only names unnamed dims") as raised:
        ours.refine_names(*names)
    assert "td.names = [...]" in str(raised.value)  # the fix: how to rename
    assert_same_state(before, td_state(ours))


@pytest.mark.parametrize("names", [(..., ...), ("a", "b", "c", ...), ("a",), ("a", "b", "c")], ids=str)
def test_refine_names_with_the_wrong_count_is_a_value_error(names):
    td = shared_td.TensorDict({}, [2, 3])
    with pytest.raises(ValueError, match="refine_names"):
        td.refine_names(*names)
    assert td.names is None


def test_refine_names_of_a_lazy_stack_checks_its_own_dim_name(tensordict):
    def stack(lib):
        return lib.lazy_stack([lib.TensorDict({"x": torch.zeros(3)}, [3]) for _ in range(2)], 0, stack_dim_name="t")

    ours, theirs = stack(shared_td), stack(tensordict)
    for refine in [("t", "e"), ("t", ...), (..., "e")]:
        assert ours.refine_names(*refine).names == theirs.refine_names(*refine).names
        assert ours.tensordicts[0].names == theirs.tensordicts[0].names
    for refine in [("u", "e"), (None, "e"), ("t", "f")]:
        with pytest.raises(RuntimeError):
            theirs.refine_names(*refine)
        with pytest.raises(RuntimeError, match="refine_names only names unnamed dims"):
            ours.refine_names(*refine)
        assert ours.names == ["t", "e"] and ours.tensordicts[1].names == ["e"]


def test_refine_names_of_a_tensorclass_as_tensordict(tensordict):
    results = []
    for lib in (shared_td, tensordict):
        @lib.tensorclass
        class Obs:
            x: torch.Tensor

        obs = Obs(x=torch.zeros(2, 3), batch_size=[2, 3])
        obs.names = ["time", None]
        refined = obs.refine_names(..., "env").names
        with pytest.raises(RuntimeError):
            obs.refine_names("t", "env")
        results.append((refined, obs.names))
    assert results[0] == results[1] == (["time", "env"], ["time", "env"])
