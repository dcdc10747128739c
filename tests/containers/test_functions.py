"""torch functions on tensordicts: torch.stack, torch.cat and the batch-dim ones."""
from __future__ import annotations

import pytest
import torch

from shared_td import TensorDict
from shared_td.containers.functions import stack


def make_td(offset: float = 0.0) -> TensorDict:
    return TensorDict(
        {"obs": torch.arange(6.0).reshape(3, 2) + offset, "nested": {"x": torch.arange(3) + int(offset)}},
        batch_size=[3],
    )


@pytest.mark.parametrize("dim, size", [(0, [2, 3]), (1, [3, 2]), (-1, [3, 2]), (-2, [2, 3])])
def test_stack(dim, size):
    a, b = make_td(), make_td(10)
    stacked = torch.stack([a, b], dim)
    assert isinstance(stacked, TensorDict) and stacked.batch_size == torch.Size(size)
    leaf_dim = dim % 2  # a negative dim counts from the end of the batch dims
    assert torch.equal(stacked["obs"], torch.stack([a["obs"], b["obs"]], leaf_dim))
    assert torch.equal(stacked["nested", "x"], torch.stack([a["nested", "x"], b["nested", "x"]], leaf_dim))
    assert stacked["nested"].batch_size == torch.Size(size)
    stacked["obs"].zero_()  # a copy
    assert a["obs"].sum() == 15


@pytest.mark.parametrize("dim, size", [(0, [6]), (-1, [6])])
def test_cat(dim, size):
    a, b = make_td(), make_td(10)
    cat = torch.cat([a, b], dim)
    assert cat.batch_size == torch.Size(size)
    assert torch.equal(cat["obs"], torch.cat([a["obs"], b["obs"]]))
    assert cat["nested", "x"].tolist() == [0, 1, 2, 10, 11, 12]
    assert torch.concat([a, b]).batch_size == torch.Size(size)


def test_cat_along_second_dim():
    a = TensorDict(x=torch.zeros(2, 3, 4), batch_size=[2, 3])
    b = TensorDict(x=torch.ones(2, 1, 4), batch_size=[2, 1])
    cat = torch.cat([a, b], 1)
    assert cat.batch_size == torch.Size([2, 4]) and cat["x"][:, 3].sum() == 8


def test_stack_and_cat_with_out():
    a, b = make_td(), make_td(10)
    out = torch.stack([a, a], 0).zero_()
    obs = out["obs"]
    assert torch.stack([a, b], 0, out=out) is out
    assert out["obs"] is obs and out["obs"][1].sum() == 75
    out = torch.cat([a, a]).zero_()
    assert torch.cat([a, b], out=out) is out and out["nested", "x"].tolist() == [0, 1, 2, 10, 11, 12]


def test_stack_different_keys_names_them():
    # stack: a RuntimeError, as tensordict 0.15.3 (cat: a KeyError, as tensordict)
    a, b = make_td(), make_td().exclude("obs")
    with pytest.raises(RuntimeError, match="obs"):
        torch.stack([a, b])
    c = make_td()
    c["nested", "y"] = torch.zeros(3)
    with pytest.raises(RuntimeError, match=r"\('nested', 'y'\)"):
        torch.stack([a, c])
    with pytest.raises(KeyError, match="obs"):
        torch.cat([a, b])


def test_stack_and_cat_batch_mismatch():
    with pytest.raises(ValueError, match=r"\[2\].*\[3\]") as info:
        torch.stack([make_td(), make_td()[:2]])
    assert isinstance(info.value, RuntimeError)
    with pytest.raises(ValueError, match="batch_size") as info:
        torch.cat([make_td(), make_td().unsqueeze(0)])
    assert isinstance(info.value, RuntimeError)
    with pytest.raises(ValueError, match="batch_size"):
        torch.cat([TensorDict(x=torch.zeros(2, 3), batch_size=[2, 3]), TensorDict(x=torch.zeros(3, 3), batch_size=[3, 3])], 1)
    with pytest.raises(ValueError, match="batch dim"):
        torch.cat([TensorDict(a=torch.zeros(())), TensorDict(a=torch.zeros(()))])


def test_stack_and_cat_bad_arguments():
    with pytest.raises(ValueError, match="empty"):
        stack([])  # torch.stack([]) never reaches a tensordict
    with pytest.raises(TypeError, match="Tensor"):
        torch.stack([make_td(), torch.zeros(3)])
    with pytest.raises(IndexError, match="dim"):
        torch.stack([make_td(), make_td()], 3)
    with pytest.raises(IndexError, match="dim"):
        torch.cat([make_td(), make_td()], 1)


def test_stack_of_stacks_and_zero_dim():
    rows = [TensorDict(a=torch.tensor(float(i)), b={"c": torch.tensor([i, i])}) for i in range(4)]
    stacked = torch.stack(rows)
    assert stacked.batch_size == torch.Size([4]) and stacked["b", "c"].shape == torch.Size([4, 2])
    again = torch.stack([stacked, stacked], 1)
    assert again.batch_size == torch.Size([4, 2]) and again[3, 1]["a"] == 3


def test_stack_keeps_device():
    a = TensorDict(x=torch.zeros(2), batch_size=[2], device="cpu")
    assert torch.stack([a, a]).device == torch.device("cpu")
    assert torch.cat([a, a]).device == torch.device("cpu")


def test_other_torch_functions():
    td = torch.stack([make_td(), make_td(1)], 1)  # [3, 2]
    assert len(torch.unbind(td, 1)) == 2
    assert [t.batch_size[0] for t in torch.split(td, 2)] == [2, 1]
    assert [t.batch_size[0] for t in torch.split(td, [1, 2])] == [1, 2]
    assert [t.batch_size[1] for t in torch.chunk(td, 2, dim=1)] == [1, 1]
    assert torch.unsqueeze(td, 0).batch_size == torch.Size([1, 3, 2])
    assert torch.squeeze(td.unsqueeze(2)).batch_size == torch.Size([3, 2])
    assert torch.squeeze(td.unsqueeze(2), 2).batch_size == torch.Size([3, 2])
    assert torch.permute(td, (1, 0)).batch_size == torch.Size([2, 3])
    assert torch.reshape(td, (6,)).batch_size == torch.Size([6])
    cloned = torch.clone(td)
    assert (cloned == td).all() and cloned["obs"] is not td["obs"]


def test_unsupported_torch_function():
    with pytest.raises(TypeError):
        torch.flip(make_td(), [0])


def test_stack_different_feature_shapes():
    lazy = pytest.importorskip("shared_td.containers.lazy")
    a = TensorDict(x=torch.zeros(3, 4), batch_size=[3])
    b = TensorDict(x=torch.zeros(3, 5), batch_size=[3])
    # torch.stack raises, as tensordict 0.15.3; stack() (default_collate's) stays lazy
    with pytest.raises(RuntimeError, match=r"'x'.*\[3, 4\].*\[3, 5\]"):
        torch.stack([a, b])
    stacked = stack([a, b])
    assert isinstance(stacked, lazy.LazyStackedTensorDict) and stacked.batch_size == torch.Size([2, 3])
