"""``get`` of a missing key gives None, as tensordict 0.15.3's (before, shared_td raised a
KeyError: code written for tensordict that tests ``td.get(key) is None`` broke after
changing its import). ``td[key]``, ``pop`` and the methods that need the entry still
raise the KeyError naming the key; ``get`` through a tensor raises, as tensordict's.
Side by side with tensordict 0.15.3 where it is installed."""
from __future__ import annotations

import pytest
import torch

from tests.reference import LIBS


def _tree(lib):
    return lib.TensorDict(a=torch.zeros(2), s="x", n=lib.TensorDict(b=torch.zeros(2), batch_size=[2]),
                          batch_size=[2])


def _lazy(lib):
    first = lib.TensorDict(a=torch.zeros(2), batch_size=[2])
    second = lib.TensorDict(a=torch.zeros(2), c=torch.ones(2), batch_size=[2])
    return lib.LazyStackedTensorDict.lazy_stack([first, second])


def _tensorclass(lib):
    @lib.tensorclass
    class Step:
        x: torch.Tensor
        note: object = None
        inner: lib.TensorDict = None

    return Step(x=torch.zeros(2), inner=lib.TensorDict(a=torch.zeros(2), batch_size=[2]), batch_size=[2])


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("make", ["tree", "locked", "memmap", "shared", "lazy"])
@pytest.mark.parametrize("key", ["q", ("n", "q"), ("q", "r", "t"), ("s", "q")])
def test_get_of_a_missing_key_is_none(lib, make, key, tmp_path):
    td = _lazy(lib) if make == "lazy" else _tree(lib)
    if make == "locked":
        td.lock_()
    elif make == "memmap":
        td = td.memmap(tmp_path / "save")
    elif make == "shared":
        td.share_memory_()
    if make == "lazy" and key[0] in ("n", "s"):
        key = ("c",) + key[1:]  # (a key its second member has and its first lacks)
    assert td.get(key) is None
    assert td.get(key, 7) == 7
    assert td.get_at(key, 0) is None
    assert td.get_at(key, 0, "d") == "d"


@pytest.mark.parametrize("lib", LIBS)
def test_a_key_some_members_of_a_lazy_stack_lack_is_none(lib):
    lazy = _lazy(lib)
    assert lazy.get("c") is None
    assert lazy.get("c", as_list=True) is None


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("lazy", [False, True], ids=["tree", "lazy"])
def test_get_through_a_tensor_still_raises(lib, lazy):
    """A key below a tensor can never be there: tensordict raises a ValueError, and so
    does shared_td (a KeyThroughLeafError: also a KeyError)."""
    td = _lazy(lib) if lazy else _tree(lib)
    with pytest.raises(ValueError, match="'a'"):
        td.get(("a", "b"))
    assert td.get(("a", "b"), 3) == 3


@pytest.mark.parametrize("lib", LIBS)
def test_a_tensorclass_gives_none_for_a_missing_key_and_below_a_leaf_field(lib):
    step = _tensorclass(lib)
    assert step.get("q") is None
    assert step.get(("x", "q")) is None  # (below a tensor field: None, as tensordict's tensorclass)
    assert step.get(("inner", "q")) is None
    assert step.get("note") is None
    assert step.get_at("q", 0) is None
    with pytest.raises(ValueError):
        step.get(("inner", "a", "q"))


@pytest.mark.parametrize("lib", LIBS)
def test_non_tensor_containers_give_none(lib):
    assert lib.NonTensorData("x").get("q") is None
    assert lib.NonTensorStack(lib.NonTensorData("x"), lib.NonTensorData("y")).get("q") is None


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("call", [
    "td['q']", "td.pop('q')", "td.is_non_tensor('q')", "td.fill_('q', 1)", "td.fill_(('q', 'r'), 1)",
    "td.set_at_('q', 1, 0)", "lazy.set_at_('q', 1, 0)", "td.get_non_tensor('q')", "lazy['q']", "lazy.pop('q')",
    "td.apply(lambda x, y: x, other)", "td.named_apply(lambda k, x, y: x, other)",
    "td.apply(lambda x, y: x, other, call_on_nested=True)", "td.rename_key_('q', 'r')",
])
def test_what_needs_the_entry_still_raises_the_key_error(lib, call):
    """Each of these read the entry through ``get`` and raised its KeyError; now that
    ``get`` gives None they ask for the KeyError, as tensordict's raise one."""
    td = lib.TensorDict(a=torch.zeros(2), b=torch.ones(2), batch_size=[2])
    lazy = lib.LazyStackedTensorDict.lazy_stack([td.clone(), td.clone()])
    other = lib.TensorDict(a=torch.zeros(2), batch_size=[2])
    with pytest.raises(KeyError):
        eval(call, {"td": td, "lazy": lazy, "other": other})


def test_the_key_error_names_the_key_and_says_what_get_gives():
    import shared_td

    td = shared_td.TensorDict(a=torch.zeros(2), batch_size=[2])
    with pytest.raises(KeyError, match=r"'q'.*\['a'\].*td.get\(key\) gives None"):
        td["q"]


def test_the_docstring_example():
    import shared_td

    td = shared_td.TensorDict({"x": torch.zeros(2)}, [2])
    assert (td.get("y") is None, td.get("y", 0)) == (True, 0)
    assert td.entry_class("y") is type(None)
