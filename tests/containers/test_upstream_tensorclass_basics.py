"""Tensorclass basics beside tensordict 0.15.3: what a run of tensordict's own
tensorclass tests (construction, fields, comparisons, updates, stacking) against
shared_td found different. Each test runs the same code on both libraries."""
from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Generic, TypeVar, get_origin

import pytest
import torch

import shared_td
from tests.reference import LIBS

def nested_step_class(lib):
    @lib.tensorclass
    class Step:
        obs: torch.Tensor
        task: str
        inner: "Step" = None

    return Step


def nested_step(lib, Step, value=0.0, task="walk", width=2):
    inner_step = Step(obs=torch.full((3, width), value), task=task + "-inner", batch_size=[3])
    return Step(obs=torch.full((3, width), value), task=task, inner=inner_step, batch_size=[3])


# ------------------------------------------------------------ dataclass field() declarations
@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("conversion", ["from_dataclass", "inplace_copy", "instance", "decorator"])
def test_a_dataclass_keeps_its_field_declarations(lib, conversion):
    # decorating a dataclass again once lost each field(): a default_factory field
    # became required, and repr/metadata/kw_only were reset
    source = dataclasses.make_dataclass("Episode", [
        ("reward", torch.Tensor, dataclasses.field(
            default_factory=lambda: torch.zeros(3), repr=False, metadata={"unit": "points"})),
        ("label", str, dataclasses.field(default="none", kw_only=True)),
    ])
    if conversion == "from_dataclass":
        cls = lib.from_dataclass(source)
    elif conversion == "inplace_copy":
        cls = lib.from_dataclass(source, inplace=True)
    elif conversion == "instance":
        cls = type(lib.from_dataclass(source()))
    else:
        cls = lib.tensorclass(source)
    first, second = cls(), cls()
    torch.testing.assert_close(first.reward, torch.zeros(3))
    assert first.reward is not second.reward  # one factory call each
    assert first.label == "none"
    reward, label = dataclasses.fields(cls)
    assert not reward.repr and reward.metadata == {"unit": "points"}
    assert label.kw_only


@pytest.mark.parametrize("lib", LIBS)
def test_tensorclass_over_a_dataclass_subclass_keeps_the_base_fields(lib):
    @dataclasses.dataclass
    class Base:
        a: torch.Tensor = dataclasses.field(default_factory=lambda: torch.ones(2))

    @lib.tensorclass
    class Child(Base):
        b: torch.Tensor = None

    child = Child()
    torch.testing.assert_close(child.a, torch.ones(2))
    assert child.b is None


# ------------------------------------------------------------ class attributes and signature
@pytest.mark.parametrize("lib", LIBS)
def test_expected_keys_autocast_and_signature(lib):
    @lib.tensorclass
    class Step:
        obs: torch.Tensor
        task: str = "walk"

    assert Step.__expected_keys__ == {"obs", "task"}
    assert Step._autocast is False and Step._nocast is False
    assert lib.from_dataclass(dataclasses.make_dataclass("Plain", [("a", int)]), nocast=True)._nocast
    # lock= is accepted but not listed, as in tensordict
    assert list(inspect.signature(Step).parameters)[-3:] == ["batch_size", "device", "names"]
    assert Step(obs=torch.zeros(2), batch_size=[2], lock=True).is_locked


@pytest.mark.parametrize("lib", LIBS)
def test_a_field_given_twice_is_a_value_error_and_a_type_error(lib):
    Step = nested_step_class(lib)
    for error in (ValueError, TypeError if lib is shared_td else ValueError):
        with pytest.raises(error, match="obs"):
            Step(torch.zeros(3), obs=torch.zeros(3), task="walk", batch_size=[3])


@pytest.mark.parametrize("lib", LIBS)
def test_setting_device_is_a_runtime_error(lib):
    step = nested_step(lib, nested_step_class(lib))
    with pytest.raises(RuntimeError, match="device cannot be set using tensorclass.device = device"):
        step.device = torch.device("cpu")
    assert step.device is None


# ------------------------------------------------------------ comparisons
@pytest.mark.parametrize("lib", LIBS)
def test_a_tensordict_compares_with_a_tensorclass_entry_by_entry(lib):
    Step = nested_step_class(lib)
    step = nested_step(lib, Step)
    plain = step.to_tensordict()
    assert (plain == step).all() and (step == plain).all()
    assert not (plain != step).any()
    assert (plain[:2] == step[:2]).all()
    assert (plain != step.clone().apply(lambda t: t + 1)).any()


@pytest.mark.parametrize("lib", LIBS)
def test_a_comparison_keeps_nested_tensorclasses(lib):
    Step = nested_step_class(lib)
    a, b = nested_step(lib, Step), nested_step(lib, Step)
    b.obs = b.obs + 1
    equal = a == b
    assert type(equal) is Step and type(equal.inner) is Step
    assert equal.inner.obs.all() and not equal.obs.any()
    assert (a != b).inner.task.dtype == torch.bool


# ------------------------------------------------------------ updates
@pytest.mark.parametrize("lib", LIBS)
def test_updating_a_nested_tensorclass_from_a_dict_keeps_its_class(lib):
    Step = nested_step_class(lib)
    td = lib.TensorDict(step=nested_step(lib, Step), batch_size=[3])
    td.update({"step": {"obs": torch.ones(3, 2)}})
    assert type(td["step"]) is Step
    assert td["step"].task == "walk" and (td["step"].obs == 1).all()

    step = nested_step(lib, Step)
    step.update(nested_step(lib, Step, 1.0, "run").to_dict(retain_none=False))
    assert type(step.inner) is Step
    assert step.inner.task == "run-inner" and (step.inner.obs == 1).all()


@pytest.mark.parametrize("lib", LIBS)
def test_update_takes_fields_as_keywords(lib):
    Step = nested_step_class(lib)
    step = nested_step(lib, Step)
    assert step.update(obs=torch.ones(3, 2)) is step
    assert (step.obs == 1).all()
    obs = step.obs
    assert step.update_(obs=torch.full((3, 2), 2.0)) is step
    assert step.obs is obs and (obs == 2).all()
    other = nested_step(lib, Step, 5.0, "run")
    step.update(other, task="keyword wins")
    assert (step.obs == 5).all() and step.task == "keyword wins"
    assert step.update() is step and step.update_() is step


# ------------------------------------------------------------ select, get, is_non_tensor
@pytest.mark.parametrize("lib", LIBS)
def test_select_as_tensordict_and_is_non_tensor(lib):
    step = nested_step(lib, nested_step_class(lib))
    kept = step.select("obs")
    assert type(kept) is type(step) and kept.task is None
    plain = step.select("obs", as_tensordict=True)
    assert type(plain) is lib.TensorDict and set(plain.keys()) == {"obs"}
    assert step.is_non_tensor("task") and not step.is_non_tensor("obs")
    assert step.is_non_tensor(("inner", "task"))
    assert step.to_tensordict().is_non_tensor("task")
    with pytest.raises(KeyError):
        step.is_non_tensor("missing")


@pytest.mark.parametrize("lib", LIBS)
def test_get_of_a_ragged_field_with_as_list_or_padding(lib):
    Step = nested_step_class(lib)
    ragged = lib.LazyStackedTensorDict(
        lib.TensorDict(obs=torch.ones(3), task="a"), lib.TensorDict(obs=torch.ones(2), task="b"))
    step = Step.from_tensordict(ragged)
    assert [t.shape for t in step.get("obs", as_list=True)] == [torch.Size([3]), torch.Size([2])]
    padded = step.get("obs", as_padded_tensor=True)
    assert padded.shape == (2, 3) and padded[1, -1] == 0
    assert step.get("inner") is None


# ------------------------------------------------------------ lazy stacks of tensorclasses
@pytest.mark.parametrize("lib", LIBS)
def test_lazy_stack_of_tensorclasses_is_the_class(lib):
    Step = nested_step_class(lib)
    a, b = nested_step(lib, Step, width=2), nested_step(lib, Step, 1.0, width=3)
    for stacked in (lib.LazyStackedTensorDict.lazy_stack([a, b], 0), lib.lazy_stack([a, b])):
        assert type(stacked) is Step
        assert isinstance(stacked._tensordict, lib.LazyStackedTensorDict)
        assert type(stacked.inner) is Step
        assert stacked[1].obs.shape == (3, 3) and stacked[0].inner.obs.shape == (3, 2)
        assert stacked.inner.task == [["walk-inner"] * 3] * 2


# ------------------------------------------------------------ a class's own __init__
def scaled_class(lib, api):
    def __init__(self, obs, scale=2.0):
        # the container is built from batch_size/device before this runs
        assert self.batch_size == torch.Size([2])
        self.obs = obs * scale

    if api == "subclass":
        return type("Scaled", (lib.TensorClass,), {"__annotations__": {"obs": torch.Tensor}, "__init__": __init__})
    return lib.tensorclass(type("Scaled", (), {"__annotations__": {"obs": torch.Tensor}, "__init__": __init__}))


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("api", ["decorator", "subclass"])
def test_own_init_gets_the_container_keywords_applied(lib, api):
    Scaled = scaled_class(lib, api)
    step = Scaled(torch.ones(2, 3), batch_size=[2], device="cpu", names=["env"])
    torch.testing.assert_close(step.obs, torch.full((2, 3), 2.0))
    assert step.device == torch.device("cpu") and step.names == ["env"]
    torch.testing.assert_close(Scaled(obs=torch.ones(2), scale=3.0, batch_size=[2]).obs, torch.full((2,), 3.0))
    assert list(inspect.signature(Scaled).parameters) == ["obs", "scale", "batch_size", "device", "names"]


@pytest.mark.parametrize("lib", LIBS)
def test_own_init_with_var_keywords_and_super_init(lib):
    class Base(lib.TensorClass):
        obs: torch.Tensor

    class Options(Base):
        def __init__(self, obs, **options):
            # batch_size and names do not reach **options
            assert set(options) == {"scale"}
            super().__init__(obs=obs * options["scale"])

    step = Options(torch.ones(3), scale=3.0, batch_size=[3], names=["env"], lock=True)
    assert (step.obs == 3).all() and step.batch_size == (3,) and step.names == ["env"]
    assert step.is_locked
    assert list(inspect.signature(Options).parameters) == ["obs", "batch_size", "device", "names", "options"]

    class WithReward(Base):
        reward: torch.Tensor

        def __init__(self, obs):
            self.reward = obs + 1  # set before super().__init__, and kept by it
            super().__init__(obs=obs, batch_size=obs.shape[:1], names=["env"])

    step = WithReward(torch.zeros(3))
    assert (step.reward == 1).all() and (step.obs == 0).all()
    assert step.batch_size == (3,) and step.names == ["env"]


@pytest.mark.parametrize("lib", LIBS)
def test_the_generated_init_goes_through_a_custom_setattr(lib):
    seen = []

    class Clipped(lib.TensorClass):
        obs: torch.Tensor

        def __setattr__(self, name, value):
            seen.append(name)
            super().__setattr__(name, value.clamp(max=1.0) if isinstance(value, torch.Tensor) else value)

    step = Clipped(obs=torch.arange(3.0), batch_size=[3])
    assert seen == ["obs"] and step.obs.tolist() == [0.0, 1.0, 1.0]


@pytest.mark.parametrize("lib", LIBS)
def test_shadowing_fields_take_the_container_keywords(lib):
    class Graph(lib.TensorClass["shadow"]):
        x: torch.Tensor
        batch_size: Any
        device: Any

    graph = Graph(torch.zeros(10, 4), batch_size=4, device="not-a-device")
    assert graph.batch_size == 4 and graph.device == "not-a-device"
    assert graph._tensordict.batch_size == torch.Size([]) and graph._tensordict.device is None


# ------------------------------------------------------------ TensorClass options and generics
@pytest.mark.parametrize("lib", LIBS)
def test_tensorclass_base_has_the_option_defaults(lib):
    assert lib.TensorClass._nocast is False and lib.TensorClass._frozen is False
    assert lib.TensorClass._autocast is False

    class Frozen(lib.TensorClass["nocast", "frozen"]):
        a: int

    assert Frozen._nocast and Frozen._frozen and not lib.TensorClass._frozen


@pytest.mark.parametrize("lib", LIBS)
def test_a_generic_tensorclass_takes_type_arguments(lib):
    T = TypeVar("T")

    class Base(lib.TensorClass, Generic[T]):
        x: torch.Tensor

    class Child(Base[T]):
        y: torch.Tensor

    class Concrete(Base[int]):
        y: torch.Tensor

    assert get_origin(Base[int]) is Base and Child.__parameters__ == (T,)
    for cls in (Child, Child[float], Concrete):
        obj = cls(x=torch.zeros(3), y=torch.ones(3), batch_size=[3])
        assert isinstance(obj, Base) and (obj[0].y == 1).all()

    class NoCast(Base["nocast"]):  # flags still configure the class
        z: int

    assert isinstance(NoCast(x=torch.zeros(()), z=1).z, int)
    with pytest.raises(TypeError):
        lib.TensorClass[int]
    with pytest.raises(TypeError):
        lib.TensorClass["autocst"]


@pytest.mark.parametrize("lib", LIBS)
def test_a_frozen_class_sets_its_fields_in_its_own_init(lib):
    class Frozen(lib.TensorClass, frozen=True):
        obs: torch.Tensor

        def __init__(self, obs):
            object.__setattr__(self, "obs", obs * 2)  # as in a frozen dataclass

    class FrozenChild(Frozen):
        reward: torch.Tensor

        def __init__(self, obs):
            super().__init__(obs)
            object.__setattr__(self, "reward", self.obs + 1)

    step = FrozenChild(torch.ones(2), batch_size=[2])
    assert (step.obs == 2).all() and (step.reward == 3).all()
    assert step.is_locked and not {"obs", "reward"} & set(vars(step))
    with pytest.raises(dataclasses.FrozenInstanceError):
        step.obs = torch.zeros(2)


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("frozen", [False, True])
def test_super_init_without_arguments_or_with_lock(lib, frozen):
    class Base(lib.TensorClass, frozen=frozen):
        obs: torch.Tensor

    class Late(lib.TensorClass, frozen=frozen):
        obs: torch.Tensor

        def __init__(self, obs):
            super().__init__()  # TensorClass's: obs is set after it
            object.__setattr__(self, "obs", obs * 2)

    class TooEarly(Base):
        reward: torch.Tensor

        def __init__(self, obs):
            super().__init__()  # Base's generated __init__ needs obs


    class Locked(Base):
        reward: torch.Tensor = None

        def __init__(self, obs):
            super().__init__(obs=obs, lock=True)

    assert (Late(torch.ones(2)).obs == 2).all()
    with pytest.raises(TypeError, match="obs"):
        TooEarly(torch.ones(2))
    step = Locked(torch.ones(2))
    assert step.reward is None and step.is_locked


@pytest.mark.parametrize("lib", LIBS)
def test_own_init_that_names_batch_size_gets_it_and_it_applies(lib):
    received = []

    class Step(lib.TensorClass):
        obs: torch.Tensor

        def __init__(self, obs, batch_size=None, device=None):
            received.append((batch_size, device))
            self.obs = obs

    step = Step(torch.ones(2), batch_size=[2], device="cpu")
    assert received == [([2], "cpu")]
    assert step.batch_size == (2,) and step.device == torch.device("cpu")


@pytest.mark.parametrize("lib", LIBS)
def test_a_subclass_without_init_runs_its_base_init_and_defaults(lib):
    class Parent(lib.TensorClass):
        obs: torch.Tensor

        def __init__(self, obs):
            self.obs = obs * 2

    class Child(Parent):
        reward: torch.Tensor = None
        done: torch.Tensor = dataclasses.field(default_factory=lambda: torch.zeros(2))

    class GrandChild(Child):
        pass

    for cls in (Child, GrandChild):
        step = cls(torch.ones(2), batch_size=[2])
        assert (step.obs == 2).all() and step.reward is None and (step.done == 0).all()
        assert list(inspect.signature(cls).parameters) == ["obs", "batch_size", "device", "names"]


@pytest.mark.parametrize("lib", LIBS)
def test_own_init_that_leaves_a_required_field_unset_is_a_type_error(lib):
    class Step(lib.TensorClass):
        obs: torch.Tensor
        reward: torch.Tensor
        note: torch.Tensor = dataclasses.field(init=False)

        def __init__(self, obs):
            self.obs = obs

    with pytest.raises(TypeError, match="did not set the required field 'reward'"):
        Step(torch.ones(2))

    class Complete(Step):
        def __init__(self, obs):
            self.obs = self.reward = obs

    assert Complete(torch.ones(2)).note is None  # init=False without a default


@pytest.mark.parametrize("lib", LIBS)
def test_replace_gives_a_copy_with_some_fields_replaced(lib):
    Step = nested_step_class(lib)
    step = nested_step(lib, Step)
    other = nested_step(lib, Step, 1.0, "run")
    replaced = step.replace(other)
    assert type(replaced) is Step and type(replaced.inner) is Step
    assert replaced.task == "run" and replaced.inner.task == "run-inner"
    assert (replaced.inner.obs == 1).all()
    assert step.task == "walk" and step.inner.task == "walk-inner" and (step.inner.obs == 0).all()
    renamed = step.replace(task="jump")
    assert renamed.task == "jump" and step.task == "walk"
    assert renamed.obs is step.obs  # a shallow copy: the leaves are shared
    assert step.replace() is step
