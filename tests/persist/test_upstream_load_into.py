"""Loading a save into an existing tensordict (``load_memmap_`` of a lazy stack,
``load_memmap(out=)`` and devices), side by side with tensordict 0.15.3: differences
found by running tensordict's own load tests against shared_td."""
from __future__ import annotations

import pytest
import torch

import shared_td
from tests.reference import LIBS

def stack_of_three(lib, value=0.0):
    return lib.LazyStackedTensorDict.lazy_stack(
        [lib.TensorDict({"c": torch.full((2,), value), "n": {"d": torch.full((2,), value)}}, [2])
         for _ in range(3)], 0)


@pytest.mark.parametrize("lib", LIBS)
def test_load_memmap_into_memory_mapped_lazy_stack(lib, tmp_path):
    stack_of_three(lib, 1.0).memmap(tmp_path / "src")
    dest = stack_of_three(lib).memmap(tmp_path / "dest")
    assert dest.load_memmap_(tmp_path / "src") is dest
    if lib is shared_td:  # tensordict 0.15.3 answers is_memmap() False for a stack
        assert dest.is_memmap() and dest.is_locked
    assert (dest == 1).all()
    for member in dest.tensordicts:
        member["c"].add_(1)  # in-place writes reach the loaded files
        member["n", "d"].add_(1)
    assert (lib.TensorDict.load_memmap(tmp_path / "src") == 2).all()
    assert (lib.TensorDict.load_memmap(tmp_path / "dest") == 0).all()


@pytest.mark.parametrize("lib", LIBS)
def test_load_memmap_into_plain_lazy_stack(lib, tmp_path):
    stack_of_three(lib, 1.0).memmap(tmp_path / "src")
    dest = stack_of_three(lib)
    dest.load_memmap_(tmp_path / "src")
    assert isinstance(dest, lib.LazyStackedTensorDict)
    assert dest.batch_size == torch.Size([3, 2])
    assert (dest == 1).all()


def test_load_memmap_of_a_stack_into_a_tensordict_is_refused_unchanged(tmp_path):
    stack_of_three(shared_td, 1.0).memmap(tmp_path / "src")
    dest = shared_td.TensorDict({"c": torch.zeros(3, 2)}, [3, 2])
    with pytest.raises(ValueError, match="lazy stack.*nothing changed"):
        dest.load_memmap_(tmp_path / "src")
    assert set(dest.keys()) == {"c"} and (dest["c"] == 0).all()


def save_flat(lib, path):
    lib.TensorDict({"a": torch.ones(3), "nested": {"b": torch.ones(3)}}, batch_size=[3]).memmap(path)


@pytest.mark.parametrize("lib", LIBS)
def test_out_without_device_loads_on_outs_device(lib, tmp_path):
    save_flat(lib, tmp_path)
    out = lib.TensorDict({"nested": {}}, batch_size=[3], device="meta")
    loaded = lib.TensorDict.load_memmap(tmp_path, out=out)
    assert loaded is out
    assert loaded["a"].device == torch.device("meta")
    assert loaded["nested", "b"].device == torch.device("meta")


@pytest.mark.parametrize("lib", LIBS)
def test_out_on_another_device_than_asked_is_refused(lib, tmp_path):
    save_flat(lib, tmp_path)
    out = lib.TensorDict({"kept": torch.zeros(3, device="meta")}, batch_size=[3], device="meta")
    with pytest.raises(ValueError, match="Cannot load a tensordict on device"):
        lib.TensorDict.load_memmap(tmp_path, device="cpu", out=out)
    assert set(out.keys()) == {"kept"}


def test_out_device_error_names_both_devices_and_the_fix(tmp_path):
    save_flat(shared_td, tmp_path)
    out = shared_td.TensorDict(batch_size=[3], device="meta")
    with pytest.raises(ValueError, match=r"device cpu into out.*device meta: give device='meta'"):
        shared_td.load_memmap(tmp_path, device="cpu", out=out)


def test_out_lazy_stack_is_a_type_error(tmp_path):
    # README: out= takes a TensorDict only (tensordict 0.15.3 also fills a stack)
    stack_of_three(shared_td).memmap(tmp_path)
    out = stack_of_three(shared_td)
    with pytest.raises(TypeError, match="load_memmap_"):
        shared_td.TensorDict.load_memmap(tmp_path, out=out)
    assert (out == 0).all()


# ------------------------------------------------ subpath into a lazy stack's member
def saved_stack(lib, prefix):
    stack = lib.LazyStackedTensorDict.lazy_stack(
        [lib.TensorDict({"x": torch.full((2,), float(i)), "sub": {"y": torch.full((2,), float(i))}}, [2])
         for i in range(3)], 0)
    stack.save(prefix)
    return stack


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("archive", [False, True])
def test_subpath_walks_into_a_stack_member(lib, tmp_path, archive):
    prefix = tmp_path / ("saved.tdz" if archive else "saved")
    saved_stack(lib, prefix)
    member = lib.TensorDict.load_memmap(prefix, subpath="1")
    assert member.batch_size == torch.Size([2]) and (member["x"] == 1).all()
    nested = lib.TensorDict.load_memmap(prefix, subpath=("2", ("sub",)))
    assert (nested["y"] == 2).all()


@pytest.mark.parametrize("lib", LIBS)
def test_subpath_past_the_last_member_is_refused(lib, tmp_path):
    saved_stack(lib, tmp_path / "saved")
    with pytest.raises(ValueError, match="No tensordict found under subpath"):
        lib.TensorDict.load_memmap(tmp_path / "saved", subpath=("3", "sub"))


def test_subpath_error_names_the_save_and_the_key(tmp_path):
    saved_stack(shared_td, tmp_path / "saved")
    with pytest.raises(ValueError, match=r"saved/1/meta.json lists no key 'nope'"):
        shared_td.load_memmap(tmp_path / "saved", subpath=("1", "nope"))
