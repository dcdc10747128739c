"""A tensorclass's ``saved_path`` is ``<directory>/_tensordict`` (where its leaf files
are), as in tensordict 0.15.3; loading that path gives the tensorclass back (tensordict
fails there), and loading ``<directory>`` still does."""
from __future__ import annotations

import pytest
import torch

import shared_td
from tests.reference import needs_tensordict, tensordict
from shared_td.containers.tensorclass import tensorclass


@tensorclass
class Step:
    obs: torch.Tensor
    label: str = "x"


def _libraries():
    libs = [pytest.param(shared_td, id="shared_td")]
    if tensordict is not None:
        libs.append(pytest.param(tensordict, id="tensordict", marks=needs_tensordict))
    return libs


if tensordict is not None:
    @tensordict.tensorclass
    class TdStep:  # at module level: tensordict finds a saved tensorclass by its name
        obs: torch.Tensor
        label: str = "x"


def _step_class(lib):
    return Step if lib is shared_td else TdStep


@pytest.mark.parametrize("lib", _libraries())
@pytest.mark.parametrize("how", ["memmap_", "memmap", "save"])
def test_saved_path_of_a_tensorclass_is_its_tensordict_directory(lib, tmp_path, how):
    step = _step_class(lib)(obs=torch.arange(3.0), batch_size=[3])
    result = getattr(step, how)(tmp_path)
    assert result.saved_path == tmp_path / "_tensordict"
    assert result.saved_path == result._tensordict.saved_path
    # code written for tensordict finds the leaf files there
    assert (result.saved_path / "obs.memmap").is_file()


@pytest.mark.parametrize("lib", _libraries())
def test_saved_path_of_a_nested_tensorclass(lib, tmp_path):
    td = lib.TensorDict(step=_step_class(lib)(obs=torch.ones(3), batch_size=[3]), batch_size=[3])
    td.memmap_(tmp_path)
    assert td["step"].saved_path == tmp_path / "step" / "_tensordict"


@pytest.mark.parametrize("lib", _libraries())
def test_load_of_saved_path_gives_its_tensordict_and_of_the_directory_the_tensorclass(lib, tmp_path):
    step_class = _step_class(lib)
    saved = step_class(obs=torch.arange(3.0), label="run", batch_size=[3]).memmap(tmp_path)
    for load in (lib.TensorDict.load_memmap, step_class.load_memmap, lib.load):
        inner = load(saved.saved_path)
        assert type(inner) is lib.TensorDict  # the class on disk there, as in tensordict
        assert inner["obs"].tolist() == [0.0, 1.0, 2.0] and inner["label"] == "run"
        whole = load(saved.saved_path.parent)
        assert isinstance(whole, step_class) and whole.label == "run"
        assert whole.obs.tolist() == [0.0, 1.0, 2.0]


@pytest.mark.parametrize("lib", _libraries())
def test_memmap_refresh_of_a_tensorclass_reloads_it_in_place(lib, tmp_path):
    step = _step_class(lib)(obs=torch.zeros(3), batch_size=[3]).memmap_(tmp_path)
    lib.TensorDict.load_memmap(step.saved_path)["obs"][1] = 5.0  # another handle writes
    assert step.memmap_refresh_() is step
    assert step.obs.tolist() == [0.0, 5.0, 0.0] and step.is_memmap()
    assert step.saved_path == tmp_path / "_tensordict"
    assert not (tmp_path / "_tensordict" / "_tensordict").exists()  # not written into itself


def test_load_memmap_in_place_from_saved_path_writes_no_nested_copy(tmp_path):
    step = Step(obs=torch.zeros(3), batch_size=[3]).memmap_(tmp_path)
    step.load_memmap_(step.saved_path)
    assert step.is_memmap() and step.saved_path == tmp_path / "_tensordict"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["_tensordict", "meta.json"]
    assert not (tmp_path / "_tensordict" / "_tensordict").exists()
    assert isinstance(shared_td.load(tmp_path), Step)
