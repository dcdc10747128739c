"""tensordict 0.15.3 idioms that failed here without saying why (audit 21): each is built
as tensordict has it, side by side with it, or raises a TypeError that names the
tensordict option or torch function (never one of our mixin classes)."""
from __future__ import annotations

import warnings

import pytest
import torch

import shared_td

tdict = pytest.importorskip("tensordict")

BOTH = pytest.mark.parametrize("lib", [shared_td, tdict], ids=["shared_td", "tensordict"])


def _tree(lib):
    return lib.TensorDict({"a": torch.arange(4.), "b": torch.arange(4), "n": {"c": torch.ones(4, 2)}, "e": {}},
                          batch_size=[4])


def _summary(td):
    """keys (nested, in order), each leaf's values, batch size, device, lock."""
    if td is None:
        return None
    leaves = {k: v.tolist() if isinstance(v, torch.Tensor) else v
              for k, v in td.items(include_nested=True, leaves_only=True)}
    return list(td.keys(include_nested=True)), leaves, list(td.batch_size), td.device, td.is_locked


@BOTH
def test_set_takes_inplace_by_position(lib):
    td = _tree(lib)
    a = td["a"]
    td.set("a", torch.zeros(4), True)
    assert td["a"] is a and a.tolist() == [0.0] * 4
    td.set("new", torch.ones(4), False)
    assert td["new"].tolist() == [1.0] * 4


def test_a_tensorclass_set_takes_inplace_by_position():
    @shared_td.tensorclass
    class Step:
        x: torch.Tensor

    step = Step(x=torch.ones(3), batch_size=[3])
    x = step.x
    step.set("x", torch.zeros(3), True)
    assert step.x is x and x.tolist() == [0.0] * 3


APPLY_CASES = {
    "emptied": lambda lib, td: td.apply(lambda x: x if x.ndim == 1 else None),
    "all None": lambda lib, td: td.exclude("e").apply(lambda x: None),
    "all None, empty kept": lambda lib, td: td.apply(lambda x: None),
    "filter_empty=False": lambda lib, td: td.apply(lambda x: x if x.ndim == 1 else None, filter_empty=False),
    "filter_empty=True": lambda lib, td: td.apply(lambda x: x, filter_empty=True),
    "default": lambda lib, td: td.apply(lambda x, y: x + y, lib.TensorDict(a=torch.ones(4), batch_size=[4]),
                                        default=7),
    "named default": lambda lib, td: td.named_apply(lambda k, x, y: x * 0 + y, td.exclude("a"), default=2),
    "out": lambda lib, td: td.apply(lambda x: x * 2, out=lib.TensorDict(z=torch.zeros(4), batch_size=[4])),
    "propagate_lock": lambda lib, td: td.lock_().apply(lambda x: x + 1, propagate_lock=True),
    "lock not propagated": lambda lib, td: td.lock_().apply(lambda x: x + 1),
    "call_on_nested": lambda lib, td: td.apply(
        lambda v: v.apply(lambda x: x + 1) if lib.is_tensor_collection(v) else v * 3, call_on_nested=True),
}


@pytest.mark.parametrize("case", list(APPLY_CASES))
def test_apply_keywords_as_tensordict(case):
    ours = APPLY_CASES[case](shared_td, _tree(shared_td))
    theirs = APPLY_CASES[case](tdict, _tree(tdict))
    assert _summary(ours) == _summary(theirs)


def test_apply_call_on_nested_sees_the_top_level_entries_and_out_is_returned():
    for lib in (shared_td, tdict):
        td = _tree(lib)
        td["s"] = "text"
        seen = []
        td.named_apply(lambda key, v: seen.append((key, type(v).__name__)), call_on_nested=True, nested_keys=True)
        assert seen == [("a", "Tensor"), ("b", "Tensor"), ("n", "TensorDict"), ("e", "TensorDict"),
                        ("s", "NonTensorData")]
        out = lib.TensorDict(batch_size=[4])
        assert td.apply(lambda x: x, out=out) is out
    with pytest.raises(KeyError):  # no default: a key the other lacks raises, as there
        _tree(shared_td).apply(lambda x, y: x, shared_td.TensorDict(a=torch.ones(4), batch_size=[4]))


@pytest.mark.parametrize("method", ["apply", "named_apply"])
def test_apply_options_not_built_name_the_option_not_our_classes(method):
    td = _tree(shared_td)
    with pytest.raises(TypeError, match=rf"TensorDict\.{method}\(is_leaf=\.\.\.\).*not supported by shared_td"):
        getattr(td, method)(lambda *x: x[-1], is_leaf=lambda cls: True)
    with pytest.raises(TypeError, match=rf"TensorDict\.{method}\(\) got an unexpected keyword argument 'bogus'"):
        getattr(td, method)(lambda *x: x[-1], bogus=1)


@BOTH
def test_update_takes_entries_as_keywords_and_ignore_lock_warns(lib):
    td = lib.TensorDict(a=torch.zeros(2), batch_size=[2])
    td.update({"a": torch.ones(2), "b": torch.ones(2)}, a=torch.full((2,), 5.0), c=torch.ones(2))
    assert td["a"].tolist() == [5.0, 5.0] and sorted(td.keys()) == ["a", "b", "c"]
    td.update(d=torch.ones(2))
    assert "d" in td.keys()
    td.lock_()
    with pytest.warns(DeprecationWarning, match="ignore_lock"):
        td.update({"a": torch.ones(2)}, inplace=True, ignore_lock=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(RuntimeError, match="Cannot modify locked TensorDict"):  # the lock stays
            td.update({"z": torch.ones(2)}, ignore_lock=True)


def test_update_option_not_built_names_the_option():
    td = shared_td.TensorDict(a=torch.zeros(2), batch_size=[2])
    with pytest.raises(TypeError, match=r"TensorDict\.update\(is_leaf=\.\.\.\).*not supported by shared_td"):
        td.update({}, is_leaf=lambda cls: True)
    td.update({}, is_leaf=None)  # its default: accepted


@pytest.mark.parametrize("is_leaf", [None, "all", "none", "is_leaf_nontensor", "default_is_leaf"])
def test_flatten_keys_is_leaf_as_tensordict(is_leaf):
    def flat(lib):
        td = lib.TensorDict(a=torch.zeros(2), n={"x": {"y": torch.zeros(2)}, "s": "str"}, batch_size=[2])
        chosen = {None: None, "all": lambda cls: True, "none": lambda cls: False}.get(is_leaf)
        chosen = getattr(lib, is_leaf) if chosen is None and is_leaf else chosen
        return list(td.flatten_keys(is_leaf=chosen).keys())

    assert flat(shared_td) == flat(tdict)


@BOTH
def test_clear_device_auto_device_filter_empty(lib):
    td = lib.TensorDict(a=torch.zeros(3), n={"b": torch.zeros(3)}, batch_size=[3], device="cpu").lock_()
    assert td.clear_device_() is td and td.device is None and td["n"].device is None
    assert td["a"].device == torch.device("cpu")
    assert td.auto_device_().device == torch.device("cpu") and td["n"].device == torch.device("cpu")
    assert lib.TensorDict(batch_size=[3]).auto_device_().device is None
    td = lib.TensorDict(a=torch.zeros(3), b={}, c={"d": {}}, s={"t": "text"}, batch_size=[3])
    assert list(td.filter_empty_().keys()) == ["a", "s"]
    locked = lib.TensorDict(a=torch.zeros(3), b={}, batch_size=[3]).lock_()
    with pytest.raises(RuntimeError, match="Cannot modify locked TensorDict"):
        locked.filter_empty_()
    stack = lib.lazy_stack([lib.TensorDict(a=torch.zeros(2), b={}) for _ in range(2)])
    assert list(stack.filter_empty_().keys()) == ["a"]


@BOTH
def test_lazy_stack_extend(lib):
    stack = lib.lazy_stack([lib.TensorDict(a=torch.zeros(2), batch_size=[2])] * 2, dim=1)
    stack.extend([lib.TensorDict(a=torch.ones(2), batch_size=[2])])
    assert stack.batch_size == (2, 3) and stack["a"][:, 2].tolist() == [1.0, 1.0]


def test_lazy_stack_extend_is_all_or_nothing():
    stack = shared_td.lazy_stack([shared_td.TensorDict(a=torch.zeros(2))])
    with pytest.raises(TypeError, match="Expected new value to be TensorDictBase"):
        stack.extend([shared_td.TensorDict(a=torch.ones(2)), 3])
    assert stack.batch_size == (1,)


@BOTH
@pytest.mark.parametrize("method", ["apply", "named_apply", "exclude", "flatten_keys"])
def test_non_tensor_containers_map_to_a_copy(lib, method):
    args = {"apply": (lambda x: 1 / 0,), "named_apply": (lambda k, x: 1 / 0,), "exclude": ("a",)}.get(method, ())
    for value in (lib.NonTensorData("walk", batch_size=[2]), lib.NonTensorStack("a", "b")):
        out = getattr(value, method)(*args)
        assert type(out) is type(value) and out is not value and out.tolist() == value.tolist()


@pytest.mark.parametrize("call, name", [
    (lambda td: torch.where(torch.tensor([True, False]), td, td), "torch.where"),
    (lambda td: torch.gather(td, 0, torch.tensor([0])), "torch.gather"),
])
def test_a_torch_function_not_built_is_named(call, name):
    td = shared_td.TensorDict(a=torch.zeros(2), batch_size=[2])
    assert call(tdict.TensorDict(a=torch.zeros(2), batch_size=[2])) is not None  # tensordict has it
    with pytest.raises(TypeError, match=rf"^{name}\(\.\.\.\) of a TensorDict is not supported by shared_td"):
        call(td)
    assert torch.stack([td, td]).batch_size == (2, 2)  # the functions that are built still run
