"""Loading tensorclasses beside tensordict 0.15.3: what a run of tensordict's own
tensorclass memmap tests against shared_td found different. A TensorClass subclass's
``load_memmap`` wraps a plain tensordict save in the class; ``load_memmap_`` refuses the
save of another tensorclass; a class saved from ``__main__`` (a script or notebook)
loads through the class of the same qualname."""
from __future__ import annotations

import json

import pytest
import torch

import shared_td
from tests.reference import LIBS

def step_classes(lib):
    class Step(lib.TensorClass):
        obs: torch.Tensor

    @lib.tensorclass
    class DecoratedStep:
        obs: torch.Tensor

    class OtherStep(lib.TensorClass):
        obs: torch.Tensor

    return Step, DecoratedStep, OtherStep


# ------------------------------------------------------------ a plain save, loaded by a class
@pytest.mark.parametrize("lib", LIBS)
def test_subclass_load_memmap_wraps_a_plain_tensordict_save(lib, tmp_path):
    Step, DecoratedStep, _ = step_classes(lib)
    lib.TensorDict(obs=torch.arange(3.0), batch_size=[3]).memmap(tmp_path / "plain")
    for loaded in (Step.load_memmap(tmp_path / "plain"), Step.load(tmp_path / "plain")):
        assert type(loaded) is Step
        assert loaded.obs.tolist() == [0.0, 1.0, 2.0]
        assert loaded.batch_size == torch.Size([3])
    # the decorator form gives the TensorDict, as tensordict does
    assert type(DecoratedStep.load_memmap(tmp_path / "plain")) is lib.TensorDict


@pytest.mark.parametrize("lib", LIBS)
def test_subclass_load_memmap_wraps_a_lazy_stack_save(lib, tmp_path):
    Step, _, _ = step_classes(lib)
    lib.LazyStackedTensorDict.lazy_stack(
        [lib.TensorDict(obs=torch.zeros(2)), lib.TensorDict(obs=torch.ones(3))], 0
    ).memmap(tmp_path / "lazy")
    loaded = Step.load_memmap(tmp_path / "lazy")
    assert type(loaded) is Step
    assert loaded[1].obs.tolist() == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("lib", LIBS)
def test_subclass_load_memmap_refuses_keys_that_are_no_fields(lib, tmp_path):
    Step, _, _ = step_classes(lib)
    lib.TensorDict(obs=torch.zeros(3), extra=torch.ones(3), batch_size=[3]).memmap(tmp_path / "x")
    with pytest.raises(ValueError, match="extra|y"):
        Step.load_memmap(tmp_path / "x")


@pytest.mark.parametrize("lib", LIBS)
def test_load_memmap_of_another_tensorclass_keeps_the_saved_class(lib, tmp_path):
    Step, _, OtherStep = step_classes(lib)
    Step(obs=torch.ones(2), batch_size=[2]).memmap(tmp_path / "step")
    # (by qualname: tensordict 0.15.3 may give the Step of an earlier call, see below)
    assert type(OtherStep.load_memmap(tmp_path / "step")).__qualname__ == Step.__qualname__


# ------------------------------------------------------------ load_memmap_ of another class
@pytest.mark.parametrize("lib", LIBS)
def test_load_memmap_in_place_refuses_another_tensorclass(lib, tmp_path):
    Step, _, OtherStep = step_classes(lib)
    Step(obs=torch.ones(3), batch_size=[3]).memmap(tmp_path / "step")
    dest = OtherStep(obs=torch.zeros(3), batch_size=[3])
    with pytest.raises(ValueError, match="Cannot load a saved Step in place"):
        dest.load_memmap_(tmp_path / "step")
    assert dest.obs.tolist() == [0.0, 0.0, 0.0]
    assert not dest.is_memmap()


def test_load_memmap_in_place_error_says_how_to_load_it(tmp_path):
    Step, _, OtherStep = step_classes(shared_td)
    Step(obs=torch.ones(3), batch_size=[3]).memmap(tmp_path / "step")
    with pytest.raises(ValueError, match=r"OtherStep.*Step\.load_memmap\(\)"):
        OtherStep(obs=torch.zeros(3), batch_size=[3]).load_memmap_(tmp_path / "step")


def test_load_memmap_in_place_of_its_own_class_and_of_a_plain_save(tmp_path):
    # Step is defined anew at each call under the same name, as a notebook cell run again
    # does: the same class here (tensordict 0.15.3 looks the name up, finds the Step of
    # an earlier call and refuses "a saved Step in place into an instance of Step")
    lib = shared_td
    Step, _, _ = step_classes(lib)
    Step(obs=torch.ones(3), batch_size=[3]).memmap(tmp_path / "step")
    lib.TensorDict(obs=torch.full((3,), 2.0), batch_size=[3]).memmap(tmp_path / "plain")
    dest = Step(obs=torch.zeros(3), batch_size=[3])
    assert dest.load_memmap_(tmp_path / "step") is dest
    assert dest.obs.tolist() == [1.0, 1.0, 1.0]
    assert dest.load_memmap_(tmp_path / "plain") is dest
    assert dest.obs.tolist() == [2.0, 2.0, 2.0]


# ------------------------------------------------------------ a class saved from __main__
def saved_from_main(lib, path):
    """A save of a Step whose meta.json names it as a script would: __main__.<qualname>."""
    Step, _, OtherStep = step_classes(lib)
    Step(obs=torch.ones(3), batch_size=[3]).memmap(path)
    meta = json.loads((path / "meta.json").read_text())
    meta["_type"] = f"<class '__main__.{Step.__qualname__}'>"
    (path / "meta.json").write_text(json.dumps(meta))
    return Step, OtherStep


@pytest.mark.parametrize("lib", LIBS)
def test_class_saved_from_main_loads_through_the_class_of_that_qualname(lib, tmp_path):
    Step, _ = saved_from_main(lib, tmp_path / "s")
    for loaded in (Step.load_memmap(tmp_path / "s"), Step.load(tmp_path / "s")):
        assert type(loaded) is Step
        assert loaded.obs.tolist() == [1.0, 1.0, 1.0]
    dest = Step(obs=torch.zeros(3), batch_size=[3])
    assert dest.load_memmap_(tmp_path / "s") is dest
    assert dest.obs.tolist() == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("lib", LIBS)
def test_class_saved_from_main_is_not_guessed_by_other_classes(lib, tmp_path):
    Step, OtherStep = saved_from_main(lib, tmp_path / "s")
    for cls in (lib.TensorDict, OtherStep):
        with pytest.raises(RuntimeError, match="__main__"):
            cls.load_memmap(tmp_path / "s")


def test_class_saved_from_main_error_says_which_call_loads_it(tmp_path):
    saved_from_main(shared_td, tmp_path / "s")
    with pytest.raises(RuntimeError, match=r"script or notebook.*load_memmap\(\)"):
        shared_td.TensorDict.load_memmap(tmp_path / "s")


def test_class_saved_from_main_fallback_ends_with_the_load(tmp_path):
    Step, _ = saved_from_main(shared_td, tmp_path / "s")
    Step.load_memmap(tmp_path / "s")
    with pytest.raises(KeyError):
        shared_td.containers.tensorclass.tensorclass_for_type_string(
            f"<class '__main__.{Step.__qualname__}'>")
