"""consolidate()'s options, side by side with tensordict 0.15.3: inplace, return_early
and num_threads, pin_memory, an already consolidated tree, non-tensor values."""
from __future__ import annotations

import pickle
import warnings

import pytest
import torch

from tests.reference import needs_tensordict, tensordict
from shared_td import LazyStackedTensorDict, TensorDict, TensorDictFuture
from shared_td.containers.tensorclass import tensorclass
from shared_td.errors import LockedTensorDictError

_FUTURE_WAIT = 30  # seconds: the bound on every future's result()


@tensorclass
class Step:
    obs: torch.Tensor
    note: str


def _tree(lib):
    return lib.TensorDict(
        a=torch.arange(6, dtype=torch.float32).reshape(3, 2),
        b={"c": torch.arange(3, dtype=torch.int16), "text": "hello"},
        big=torch.randn(3, 30_000),  # above the packing threshold: copied on its own
        flag=torch.tensor([True, False, True]),
        batch_size=[3],
    )


def _storages(td) -> set:
    return {leaf.untyped_storage().data_ptr()
            for leaf in td.values(include_nested=True, leaves_only=True) if leaf.numel()}


def _libraries():
    libs = [pytest.param(__import__("shared_td"), id="shared_td")]
    if tensordict is not None:
        libs.append(pytest.param(tensordict, id="tensordict", marks=needs_tensordict))
    return libs


# ----------------------------------------------------------------------------- inplace
@pytest.mark.parametrize("lib", _libraries())
def test_inplace_replaces_the_leaves_and_returns_self(lib):
    td = _tree(lib)
    expected = {key: value.clone() for key, value in td.items(include_nested=True, leaves_only=True)}
    old = {key: value for key, value in td.items(include_nested=True, leaves_only=True)}
    result = td.consolidate(inplace=True)
    assert result is td
    assert td.is_consolidated() and td.is_locked and td["b"].is_locked
    assert len(_storages(td)) == 1
    for key, value in expected.items():
        assert torch.equal(td[key], value), key
        assert td[key] is not old[key], key
    assert td["b", "text"] == "hello"
    td["a"][0, 0] = 42.0  # a view of the one storage, writable in place
    assert td["a"][0, 0] == 42.0 and old["a"][0, 0] == 0.0
    again = pickle.loads(pickle.dumps(td))
    assert again.is_consolidated() and torch.equal(again["a"], td["a"])


@pytest.mark.parametrize("lib", _libraries())
@pytest.mark.parametrize("where", ["root", "nested"])
def test_inplace_on_a_locked_tensordict_raises_and_changes_nothing(lib, where):
    td = _tree(lib)
    (td if where == "root" else td["b"]).lock_()
    before = {key: value for key, value in td.items(include_nested=True, leaves_only=True)}
    with pytest.raises(RuntimeError, match="locked"):
        td.consolidate(inplace=True)
    if lib is not tensordict:  # (tensordict 0.15.3 has replaced the leaves before "b")
        assert not td.is_consolidated()
        for key, value in before.items():
            assert td.get(key) is value, key


def test_inplace_error_names_the_locked_key_and_the_fix():
    td = _tree(__import__("shared_td"))
    td["b"].lock_()
    with pytest.raises(LockedTensorDictError, match=r"'b'.*unlock_\(\).*without inplace=True"):
        td.consolidate(inplace=True)


@pytest.mark.parametrize("lib", _libraries())
def test_inplace_tensorclass_is_self(lib):
    if lib is tensordict:
        @tensordict.tensorclass
        class TheirStep:
            obs: torch.Tensor
            note: str
        step = TheirStep(obs=torch.arange(4.0).reshape(2, 2), note="go", batch_size=[2])
    else:
        step = Step(obs=torch.arange(4.0).reshape(2, 2), note="go", batch_size=[2])
    old = step.obs
    assert step.consolidate(inplace=True) is step
    assert step.is_consolidated() and step.obs is not old and torch.equal(step.obs, old)
    assert step.note == "go"


def test_inplace_lazy_stack_is_self():
    # (tensordict 0.15.3 returns a new stack and leaves this one as it was)
    lazy = LazyStackedTensorDict(TensorDict(x=torch.ones(2)), TensorDict(x=torch.zeros(2), y=torch.ones(1)))
    old = lazy.tensordicts[1]["y"]
    assert lazy.consolidate(inplace=True) is lazy
    assert lazy.is_consolidated() and lazy.is_locked
    assert lazy.tensordicts[1]["y"] is not old and (lazy.tensordicts[1]["y"] == 1).all()
    assert len(_storages(lazy)) == 1


def test_inplace_after_memmap_leaves_the_files():
    td = TensorDict(a=torch.arange(3.0)).memmap_()
    td.unlock_()
    td.memmap_()
    assert td.is_memmap()
    td.unlock_()
    td.consolidate(inplace=True)
    assert not td.is_memmap() and td.is_consolidated()


# ----------------------------------------------------------------------------- return_early
@pytest.mark.parametrize("lib", _libraries())
def test_return_early_gives_a_future(lib):
    td = _tree(lib)
    future = td.consolidate(num_threads=2, return_early=True)
    assert type(future).__name__ == "TensorDictFuture"
    result = future.result()
    assert result.is_consolidated() and result.is_locked and not td.is_consolidated()
    assert (result == td).all()
    assert len(_storages(result)) == 1
    # fewer than 2 threads: no future (as tensordict)
    assert not isinstance(td.consolidate(return_early=True), type(future))
    # inplace: result() is the tensordict itself
    future = td.consolidate(num_threads=2, return_early=True, inplace=True)
    assert future.result() is td and td.is_consolidated()


@pytest.mark.parametrize("lib", _libraries())
@pytest.mark.parametrize("option", ["non_blocking", "use_buffer"])
def test_return_early_refuses_non_blocking_and_use_buffer(lib, option):
    with pytest.raises(NotImplementedError, match=option):
        _tree(lib).consolidate(num_threads=2, return_early=True, **{option: True})


def test_return_early_of_a_tensorclass_and_a_lazy_stack_keeps_their_class():
    # (tensordict 0.15.3 returns a TensorDict for a tensorclass here)
    step = Step(obs=torch.arange(4.0).reshape(2, 2), note="go", batch_size=[2])
    result = step.consolidate(num_threads=2, return_early=True).result(timeout=_FUTURE_WAIT)
    assert type(result) is Step and result.is_consolidated() and result.note == "go"
    lazy = LazyStackedTensorDict(TensorDict(x=torch.ones(2)), TensorDict(x=torch.zeros(2)))
    result = lazy.consolidate(num_threads=2, return_early=True).result(timeout=_FUTURE_WAIT)
    assert isinstance(result, LazyStackedTensorDict) and result.is_consolidated()


def test_a_failed_copy_is_raised_and_changes_nothing():
    td = TensorDict(a=torch.zeros(3), b=torch.zeros(3, device="meta"))
    old = td["a"]
    future = td.consolidate(num_threads=2, return_early=True, inplace=True)
    assert isinstance(future, TensorDictFuture)
    with pytest.raises(NotImplementedError, match="meta"):
        future.result(timeout=_FUTURE_WAIT)
    assert td["a"] is old and not td.is_locked and not td.is_consolidated()
    with pytest.raises(NotImplementedError, match="meta"):
        td.consolidate(inplace=True)
    assert td["a"] is old and not td.is_locked


@pytest.mark.parametrize("mode", ["plain", "shared", "file"])
def test_threads_copy_every_kind_of_leaf(mode, tmp_path):
    leaves = {f"k{i}": torch.randn(7) * i for i in range(50)}
    leaves.update(i16=torch.arange(5, dtype=torch.int16), i64=torch.arange(9), t=torch.ones(4, 3).t(),
                  big1=torch.randn(40_000), big2=torch.arange(20_000, dtype=torch.int32), empty=torch.zeros(0))
    td = TensorDict(leaves, nested={"x": torch.randn(2, 3)})
    kwargs = {"plain": {}, "shared": {"share_memory": True}, "file": {"filename": tmp_path / "one.bin"}}[mode]
    for result in (td.consolidate(num_threads=3, **kwargs),
                   td.consolidate(num_threads=3, return_early=True, **kwargs).result(timeout=_FUTURE_WAIT)):
        assert result.is_consolidated() and (result == td).all()
        assert len(_storages(result)) == 1


# ----------------------------------------------------------------------------- pin_memory
@pytest.mark.skipif(torch.accelerator.is_available(),
                    reason="checks the error where memory cannot be pinned; this machine has an accelerator and can")
@pytest.mark.parametrize("lib", _libraries())
def test_pin_memory_without_an_accelerator_is_a_runtime_error(lib, tmp_path):
    with pytest.raises(RuntimeError, match="accelerator"):
        _tree(lib).consolidate(pin_memory=True)
    with pytest.raises(RuntimeError, match="accelerator"):
        _tree(lib).consolidate(pin_memory=True, share_memory=True)
    # with a file, pin_memory is ignored (the storage is the file's mapping)
    result = _tree(lib).consolidate(pin_memory=True, filename=tmp_path / "one.bin")
    assert result.is_consolidated()


@pytest.mark.skipif(torch.accelerator.is_available(),
                    reason="checks the error where memory cannot be pinned; this machine has an accelerator and can")
def test_pin_memory_error_names_the_fix():
    with pytest.raises(RuntimeError, match="without pin_memory=True"):
        _tree(__import__("shared_td")).consolidate(pin_memory=True)


@pytest.mark.skipif(not torch.accelerator.is_available(), reason="needs an accelerator to pin memory")
def test_pin_memory_pins_the_buffer():
    result = _tree(__import__("shared_td")).consolidate(pin_memory=True)
    assert result.is_consolidated() and result["a"].is_pinned() and result["b", "c"].is_pinned()
    assert result.consolidate(pin_memory=True) is result
    again = pickle.loads(pickle.dumps(result))
    assert torch.equal(again["a"], result["a"])


# ----------------------------------------------------------------------------- already consolidated
@pytest.mark.parametrize("lib", _libraries())
def test_an_already_consolidated_tensordict_is_returned_as_is(lib):
    once = _tree(lib).consolidate()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert once.consolidate() is once
        assert once.consolidate(inplace=True) is once
        assert once.consolidate(num_threads=2) is once
        if not torch.accelerator.is_available():
            assert once.consolidate(pin_memory=True) is once


def test_an_already_consolidated_tensordict_asked_for_another_storage_is_copied(tmp_path):
    # (tensordict 0.15.3 returns it unchanged with a FutureWarning; 0.17 will copy)
    once = _tree(__import__("shared_td")).consolidate()
    shared = once.consolidate(share_memory=True)
    assert shared is not once and shared.is_consolidated() and shared["a"]._backing is not None
    assert shared.consolidate(share_memory=True) is shared
    path = tmp_path / "one.bin"
    in_file = shared.consolidate(filename=path)
    assert in_file is not shared and in_file.consolidate(filename=path) is in_file
    assert in_file.consolidate(filename=tmp_path / "other.bin") is not in_file


# ----------------------------------------------------------------------------- non-tensor values
@pytest.mark.parametrize("lib", _libraries())
def test_the_source_non_tensor_values_stay_unlocked(lib):
    td = lib.TensorDict(s="txt", nested={"t": "u"}, a=torch.zeros(1))
    result = td.consolidate()
    assert result.get("s").is_locked and result.get(("nested", "t")).is_locked
    assert not td.get("s").is_locked and not td.get(("nested", "t")).is_locked
    assert result["s"] == "txt" and result["nested", "t"] == "u"
    td.get("s").unlock_()  # not part of the result's locked graph


@pytest.mark.parametrize("lib", _libraries())
def test_a_non_tensor_root(lib):
    value = lib.NonTensorData("x")
    result = value.consolidate()
    assert result is not value and result.data == "x" and result.is_consolidated()
    assert not value.is_locked


@pytest.mark.parametrize("lib", _libraries())
@pytest.mark.parametrize("num_threads", [-1, None, True, 1])
def test_num_threads_below_two_copy_in_the_calling_thread(lib, num_threads):
    result = _tree(lib).consolidate(num_threads=num_threads)  # (-1 was a ValueError)
    assert result.is_consolidated()


@pytest.mark.parametrize("lib", _libraries())
def test_filename_with_share_memory_is_the_file_shared(lib, tmp_path):
    # (a ValueError before): the file's mapping is the memory processes share
    result = _tree(lib).consolidate(filename=tmp_path / "td.bin", share_memory=True)
    assert result.is_consolidated() and result["a"].is_shared()
    assert lib.TensorDict.from_consolidated(tmp_path / "td.bin")["a"].tolist() == result["a"].tolist()


def test_return_early_inplace_locks_the_tree_while_the_copy_runs():
    # its leaves are replaced by position once the copy ends: an entry deleted meanwhile
    # gave the next entries the views of others (b read as a's values, c a view of 2M)
    td = TensorDict(a=torch.full((2_000_000,), 1.0), b=torch.full((2_000_000,), 2.0), c=torch.full((3,), 3.0))
    future = td.consolidate(inplace=True, num_threads=2, return_early=True)
    with pytest.raises(LockedTensorDictError):
        del td["a"]
    result = future.result(timeout=_FUTURE_WAIT)
    assert result is td and td.is_consolidated() and td.is_locked
    assert td["b"][:2].tolist() == [2.0, 2.0] and td["c"].tolist() == [3.0, 3.0, 3.0]
