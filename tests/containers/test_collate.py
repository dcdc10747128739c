"""torch's default_collate (and so a DataLoader) on tensordicts and tensorclasses, side by
side with tensordict 0.15.3, which adds its classes to torch's collate map as we do."""
from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, default_collate

import shared_td
from tests.containers import dropin_children as kids
from tests.reference import tensordict

LIBS = [shared_td] + ([tensordict] if tensordict is not None else [])
by_name = pytest.mark.parametrize("lib", LIBS, ids=lambda lib: lib.__name__)


def _step(lib, i: int, size: int = 3, **extra):
    return lib.TensorDict(obs=torch.full((size,), float(i)), reward=torch.tensor(i), task=f"t{i}", **extra)


@by_name
def test_a_list_of_tensordicts_is_stacked_along_a_new_first_dim(lib):
    batch = default_collate([_step(lib, i) for i in range(4)])
    assert type(batch) is lib.TensorDict and batch.batch_size == torch.Size([4])
    assert torch.equal(batch["obs"], torch.arange(4.0).unsqueeze(1).expand(4, 3))
    assert batch["reward"].tolist() == [0, 1, 2, 3] and batch["task"] == ["t0", "t1", "t2", "t3"]


@by_name
def test_samples_of_different_shapes_or_keys_make_a_lazy_stack(lib):
    shapes = default_collate([_step(lib, 0, 3), _step(lib, 1, 5)])
    assert type(shapes) is lib.LazyStackedTensorDict and shapes.batch_size == torch.Size([2])
    assert shapes[1]["obs"].shape == torch.Size([5])
    keys = default_collate([_step(lib, 0), _step(lib, 1, extra=torch.ones(2))])
    assert type(keys) is lib.LazyStackedTensorDict and "extra" in keys[1].keys()


@by_name
def test_a_list_of_tensorclass_instances_is_one_instance(lib):
    @lib.tensorclass
    class Step:
        obs: torch.Tensor
        task: str

    batch = default_collate([Step(obs=torch.full((2,), float(i)), task=f"t{i}", batch_size=[]) for i in range(3)])
    assert type(batch) is Step and batch.batch_size == torch.Size([3])
    assert batch.obs[:, 0].tolist() == [0.0, 1.0, 2.0]


@by_name
def test_batches_that_cannot_be_stacked_are_type_errors(lib):
    with pytest.raises(TypeError, match="batch dims"):
        default_collate([_step(lib, 0), lib.TensorDict(obs=torch.zeros(2, 3), batch_size=[2])])
    with pytest.raises(TypeError):
        default_collate([_step(lib, 0), torch.zeros(3)])


@by_name
@pytest.mark.timeout(120)
@pytest.mark.parametrize("dataset", [kids.StepDataset, kids.BatchDataset], ids=["samples", "__getitems__"])
def test_a_dataloader_with_spawn_workers_collates_tensordicts(lib, dataset):
    loader = DataLoader(dataset(lib.__name__, 12), batch_size=4, num_workers=2, multiprocessing_context="spawn")
    batches = list(loader)
    assert len(batches) == 3 and all(type(b) is lib.TensorDict and b.batch_size == torch.Size([4]) for b in batches)
    assert torch.cat([b["reward"] for b in batches]).tolist() == list(range(12))
    assert batches[2]["task"] == ["t8", "t9", "t10", "t11"]
