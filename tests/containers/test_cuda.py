"""Tensordicts on a CUDA device: sharing, memory mapping, consolidate, device moves.

tensordict 0.15.3's rules: a tensordict whose device is CUDA counts as shared
(``is_shared()``) and ``share_memory_()`` leaves it as it is, unlocked (CUDA tensors are
shared between processes already); ``memmap_`` puts its leaves in files or shared memory
on the CPU and its device becomes ``cpu``; ``"cuda"`` means the current CUDA device
(``cuda:0``). The first tests need no GPU (an empty tensordict on a CUDA device holds
no CUDA tensor); the others run where torch sees one (the device checks of the project).
"""
from __future__ import annotations

import pickle

import pytest
import torch

import shared_td
from shared_td import MemoryMappedTensor, TensorDict
from tests.reference import needs_tensordict, tensordict

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _libraries() -> list:
    return [shared_td] + ([tensordict] if tensordict is not None else [])


# ------------------------------------------------------------------ no GPU needed
@pytest.mark.parametrize("lib", _libraries(), ids=lambda lib: lib.__name__)
def test_a_tensordict_on_a_cuda_device_counts_as_shared_and_share_memory_leaves_it_as_it_is(lib):
    td = lib.TensorDict({}, batch_size=[], device="cuda:0")
    assert td.is_shared()
    assert td.share_memory_() is td
    assert not td.is_locked  # nothing was shared: it stays open
    assert td.is_shared()
    assert not lib.TensorDict({}, batch_size=[]).is_shared()  # a CPU one only once shared


@pytest.mark.parametrize("lib", _libraries(), ids=lambda lib: lib.__name__)
def test_a_tensordict_on_a_cuda_device_can_still_be_memory_mapped(lib, tmp_path):
    # it counts as shared, but share_memory_() did not mark it: memmap_ is not refused
    td = lib.TensorDict({}, batch_size=[], device="cuda:0")
    td.share_memory_()
    assert td.memmap_(tmp_path / "saved") is td
    assert td.is_memmap() and td.device == torch.device("cpu") and not td.is_shared()


@needs_tensordict
def test_cuda_sharing_rules_match_tensordict():
    ours = TensorDict({"nested": TensorDict({}, [], device="cuda:0")}, [], device="cuda:0")
    theirs = tensordict.TensorDict({"nested": tensordict.TensorDict({}, [], device="cuda:0")}, [], device="cuda:0")
    for td in (ours, theirs):
        td.share_memory_()
    assert (ours.is_shared(), ours.is_locked, ours["nested"].is_shared()) == (
        theirs.is_shared(), theirs.is_locked, theirs["nested"].is_shared())


def test_cuda_of_another_device_type_is_a_runtime_error_naming_the_fix():
    with pytest.raises(RuntimeError, match=r"a CUDA device is needed; use \.to\('cpu'\)"):
        TensorDict(a=torch.zeros(2), batch_size=[2]).cuda("cpu")


# ------------------------------------------------------------------ on a GPU
def _cuda_tree(lib):
    return lib.TensorDict(
        {"obs": torch.arange(12.0).reshape(4, 3), "nested": {"r": torch.arange(4)}, "task": "walk"},
        batch_size=[4], device="cuda")


@needs_cuda
@pytest.mark.parametrize("lib", _libraries(), ids=lambda lib: lib.__name__)
def test_cuda_means_the_current_device_and_cuda_moves_there(lib):
    td = _cuda_tree(lib)
    current = torch.device("cuda", torch.cuda.current_device())
    assert td.device == current and td["obs"].device == current and td["nested", "r"].device == current
    moved = lib.TensorDict(a=torch.ones(2), batch_size=[2]).cuda()
    assert moved.device == current and moved["a"].is_cuda
    assert lib.TensorDict(a=torch.ones(2), batch_size=[2]).cuda(0).device == torch.device("cuda:0")
    back = td.cpu()
    assert back.device == torch.device("cpu") and torch.equal(back["obs"], td["obs"].cpu())


@needs_cuda
@pytest.mark.parametrize("lib", _libraries(), ids=lambda lib: lib.__name__)
def test_share_memory_of_a_cuda_tree_keeps_its_tensors(lib):
    td = _cuda_tree(lib)
    obs = td["obs"]
    assert td.share_memory_() is td and not td.is_locked and td.is_shared()
    assert td["obs"] is obs and obs.is_cuda


@needs_cuda
@pytest.mark.parametrize("lib", _libraries(), ids=lambda lib: lib.__name__)
def test_memmap_of_a_cuda_tree_lands_on_the_cpu_and_loads_back_onto_the_gpu(lib, tmp_path):
    td = _cuda_tree(lib)
    expected = td["obs"].cpu()
    td.memmap_(tmp_path / "saved")
    assert td.device == torch.device("cpu") and td.is_memmap() and not td.is_shared()
    assert isinstance(td["obs"], lib.MemoryMappedTensor) and torch.equal(td["obs"], expected)
    assert td["task"] == "walk"
    loaded = lib.TensorDict.load_memmap(tmp_path / "saved", device="cuda")
    assert loaded["obs"].is_cuda and torch.equal(loaded["obs"].cpu(), expected)
    assert loaded["nested", "r"].is_cuda and loaded["task"] == "walk"


@needs_cuda
def test_anonymous_memmap_and_memmap_like_of_a_cuda_tree():
    td = _cuda_tree(shared_td)
    like = td.memmap_like()
    assert like.device == torch.device("cpu") and like.is_memmap()
    assert torch.equal(like["obs"], torch.zeros(4, 3)) and like["obs"].shape == td["obs"].shape
    anonymous = _cuda_tree(shared_td).memmap_()
    assert anonymous.device == torch.device("cpu") and torch.equal(anonymous["obs"], td["obs"].cpu())
    again = pickle.loads(pickle.dumps(anonymous))  # by reference: the same shared memory
    anonymous["obs"][0, 0] = 100.0
    assert again["obs"][0, 0] == 100.0


@needs_cuda
def test_memory_mapped_tensor_from_and_to_the_gpu(tmp_path):
    source = torch.arange(6.0, device="cuda").reshape(2, 3)
    mapped = MemoryMappedTensor.from_tensor(source, filename=tmp_path / "t.memmap")
    assert mapped.device == torch.device("cpu") and torch.equal(mapped, source.cpu())
    moved = mapped.to("cuda")
    assert moved.is_cuda and not isinstance(moved, MemoryMappedTensor) and torch.equal(moved, source)


@needs_cuda
@pytest.mark.parametrize("pin", [False, True])
def test_consolidate_of_a_cuda_tree_is_one_cpu_storage(pin):
    td = _cuda_tree(shared_td)
    result = td.consolidate(pin_memory=pin)
    assert result.is_consolidated() and result.device == torch.device("cpu")
    assert torch.equal(result["obs"], td["obs"].cpu()) and torch.equal(result["nested", "r"], td["nested", "r"].cpu())
    assert result["obs"].untyped_storage().data_ptr() == result["nested", "r"].untyped_storage().data_ptr()
    assert result["obs"].is_pinned() == pin
    on_gpu = result.to("cuda")
    assert on_gpu["obs"].is_cuda and torch.equal(on_gpu["obs"], td["obs"])


@needs_cuda
def test_a_cuda_tree_published_is_attached_from_shared_cpu_memory():
    td = _cuda_tree(shared_td)
    with shared_td.Coordinator() as coord:
        coord.publish("policy", td)
        view = coord.attach("policy")
        assert view["obs"].device == torch.device("cpu") and torch.equal(view["obs"], td["obs"].cpu())
        assert torch.equal(view["nested", "r"], td["nested", "r"].cpu()) and view["task"] == "walk"


# ------------------------------------------------------------------ pin_memory
@pytest.mark.skipif(torch.accelerator.is_available(), reason="this machine can pin memory")
def test_pin_memory_without_an_accelerator_says_why():
    td = TensorDict(a=torch.zeros(2), batch_size=[2])
    with pytest.raises(RuntimeError, match=r"pin_memory\(\): pinned memory needs .* accelerator"):
        td.pin_memory()
    with pytest.raises(RuntimeError, match="leave it out on this machine"):
        td.pin_memory(inplace=True)
    assert not td["a"].is_pinned()


def _pin_tree(lib):
    shared = torch.arange(4.0)
    stack = lib.lazy_stack([lib.TensorDict(v=torch.zeros(2)), lib.TensorDict(v=torch.ones(2))])
    return lib.TensorDict({"obs": torch.ones(4, 3), "alias": shared, "again": shared, "task": "walk",
                           "nested": {"r": torch.arange(4)}, "stack": stack}, batch_size=[])


@needs_cuda
@pytest.mark.parametrize("lib", _libraries(), ids=lambda lib: lib.__name__)
@pytest.mark.parametrize("num_threads", [None, 2])
def test_pin_memory_pins_every_leaf_once_and_keeps_the_tree(lib, num_threads):
    td = _pin_tree(lib)
    pinned = td.pin_memory(num_threads=num_threads)
    assert pinned is not td and not td["obs"].is_pinned()
    for key in ("obs", "alias", ("nested", "r")):
        assert pinned[key].is_pinned() and torch.equal(pinned[key], td[key])
    # one copy of one tensor held under two keys (tensordict copies it twice, except inplace)
    assert (pinned["alias"] is pinned["again"]) == (lib is shared_td)
    assert pinned["task"] == "walk" and type(pinned["stack"]) is type(td["stack"])
    assert all(member["v"].is_pinned() for member in pinned["stack"].tensordicts)
    assert not pinned.is_locked and td.lock_().pin_memory().is_locked


@needs_cuda
@pytest.mark.parametrize("lib", _libraries(), ids=lambda lib: lib.__name__)
def test_pin_memory_inplace_replaces_the_leaves_of_open_nodes_only(lib, tmp_path):
    td = _pin_tree(lib)
    nested = td["nested"]
    assert td.pin_memory(inplace=True) is td and td["nested"] is nested
    assert td["obs"].is_pinned() and td["nested", "r"].is_pinned() and td["stack"].tensordicts[0]["v"].is_pinned()
    mapped = lib.TensorDict(a=torch.zeros(3), batch_size=[3]).memmap_(tmp_path / "m")
    leaf = mapped["a"]
    assert mapped.pin_memory(inplace=True) is mapped and mapped["a"] is leaf and not leaf.is_pinned()


@needs_cuda
def test_a_tensorclass_is_pinned_as_its_class():
    from shared_td import tensorclass

    @tensorclass
    class Step:
        obs: torch.Tensor
        task: str

    step = Step(obs=torch.zeros(3, 2), task="walk", batch_size=[3])
    pinned = step.pin_memory()
    assert type(pinned) is Step and pinned.obs.is_pinned() and pinned.task == "walk"
    assert step.pin_memory(inplace=True) is step and step.obs.is_pinned()


@needs_cuda
def test_a_dataloader_with_pin_memory_pins_tensordict_batches():
    buffer = TensorDict(obs=torch.arange(64.0).reshape(32, 2), batch_size=[32])
    loader = torch.utils.data.DataLoader(range(32), batch_size=8, pin_memory=True,
                                         collate_fn=lambda rows: buffer[torch.tensor(rows)])
    batches = list(loader)
    assert len(batches) == 4 and all(isinstance(b, TensorDict) and b["obs"].is_pinned() for b in batches)
    assert torch.equal(torch.cat([b["obs"] for b in batches]), buffer["obs"])
    on_gpu = batches[0].to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(on_gpu["obs"].cpu(), buffer["obs"][:8])


# ------------------------------------------------------------------ a consolidated tree's move
def _consolidated_tree(lib, **options):
    td = lib.TensorDict({"obs": torch.arange(12.0).reshape(4, 3), "nested": {"r": torch.arange(4)},
                         "empty": torch.zeros(4, 0), "task": "walk"}, batch_size=[4])
    return td, td.consolidate(**options)


def test_a_consolidated_tree_moves_as_one_storage_even_to_the_meta_device():
    # no GPU needed: the meta device holds no data, but the move builds the same tree
    _td, consolidated = _consolidated_tree(shared_td)
    moved = consolidated.to("meta")
    assert moved.device == torch.device("meta") and moved["nested"].device == torch.device("meta")
    assert moved["obs"].is_meta and moved["nested", "r"].dtype == torch.int64 and moved["empty"].shape == (4, 0)
    assert moved.is_locked and moved["task"] == "walk" and moved.is_consolidated()


@needs_cuda
@pytest.mark.parametrize("lib", _libraries(), ids=lambda lib: lib.__name__)
@pytest.mark.parametrize("options", [{}, {"share_memory": True}, {"pin_memory": True}],
                         ids=["plain", "share_memory", "pin_memory"])
def test_a_consolidated_tree_moves_to_the_gpu_as_one_storage_and_back(lib, options):
    td, consolidated = _consolidated_tree(lib, **options)
    moved = consolidated.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert moved.device.type == "cuda" and moved["obs"].is_cuda and moved.is_consolidated() and moved.is_locked
    assert moved["obs"].untyped_storage().data_ptr() == moved["nested", "r"].untyped_storage().data_ptr()
    assert torch.equal(moved["obs"].cpu(), td["obs"]) and torch.equal(moved["nested", "r"].cpu(), td["nested", "r"])
    assert moved["task"] == "walk"
    back = moved.to("cpu")
    assert back.device == torch.device("cpu") and back.is_consolidated()
    assert torch.equal(back["obs"], td["obs"]) and back["obs"].untyped_storage().data_ptr() == \
        back["nested", "r"].untyped_storage().data_ptr()
    for tree in (moved, back):
        again = pickle.loads(pickle.dumps(tree))
        assert torch.equal(again["obs"].cpu(), td["obs"]) and again["task"] == "walk"


@needs_cuda
@pytest.mark.parametrize("non_blocking", [False, True])
def test_a_tree_moved_leaf_by_leaf_is_ready_when_to_returns(non_blocking):
    # each leaf's copy is queued and the GPU waited for once: the values must be there
    # when to() returns (unless the caller asked for non_blocking and synchronizes)
    rows = [torch.full((64, 32), float(i)) for i in range(200)]
    td = TensorDict({f"k{i}": {"x": row} for i, row in enumerate(rows)}, batch_size=[64])
    on_gpu = td.to("cuda", non_blocking=non_blocking)
    back = on_gpu.to("cpu", non_blocking=non_blocking)
    if non_blocking:
        torch.cuda.synchronize()
    assert on_gpu.device.type == "cuda" and back.device == torch.device("cpu")
    assert all(torch.equal(back[f"k{i}", "x"], row) for i, row in enumerate(rows))


@needs_cuda
def test_share_memory_of_a_cpu_tree_leaves_the_values_of_a_nested_cuda_tensordict_alone():
    """share_memory_() puts a tree's values in one memfd before the nodes are shared: not
    those of a nested tensordict on a CUDA device, whose own share_memory_() leaves it as
    it is (triage24)."""
    inner = TensorDict({"obs": torch.zeros(2, device="cuda"), "task": "walk"}, [], device="cuda")
    td = TensorDict({"label": "cpu side", "inner": inner}, [])
    td.share_memory_()
    assert td.get("label").is_shared()
    assert td["inner"].get("task")._shared_value is None and not td["inner"].is_locked
