"""Indexing along batch dims, ``td[idx] = other`` writes and the batch-dim view ops."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from shared_td import BatchSizeMismatchError, IndexTypeError, NonTensorStack, TensorDict
from tests.reference import needs_tensordict


def make_td() -> TensorDict:
    """batch [3, 4]; a nested tensordict with an extra batch dim; a non-tensor."""
    td = TensorDict(
        {
            "obs": torch.arange(3 * 4 * 2.0).reshape(3, 4, 2),
            "nested": TensorDict(x=torch.arange(3 * 4 * 5).reshape(3, 4, 5), batch_size=[3, 4, 5]),
        },
        batch_size=[3, 4],
    )
    td["task"] = "walk"
    return td


# ----------------------------------------------------------------------------- reading
@pytest.mark.parametrize(
    "index",
    [
        1, -1, slice(1, 3), slice(None, None, 2), (1, 2), (slice(None), 0), Ellipsis, (Ellipsis, 1),
        (1, Ellipsis), None, (None, 0), (0, None, slice(1, 3)), torch.tensor([0, 2]), [2, 0],
        np.array([1, 1]), (slice(None), [0, 3]), torch.tensor([True, False, True]),
        torch.ones(3, 4, dtype=torch.bool), (1, torch.tensor([True, False, True, False])),
        range(0, 3, 2), torch.tensor(1), np.int64(2), [], (slice(None), []),
    ],
)
def test_index_matches_torch(index):
    td = make_td()
    sub = td[index]
    # Ellipsis stands for the batch dims only: the leaves get a trailing full slice.
    parts = index if isinstance(index, tuple) else (index,)
    leaf_index = parts + (slice(None),) if any(p is Ellipsis for p in parts) else index
    expected = td["obs"][leaf_index]
    assert sub.batch_size == expected.shape[:-1]
    assert torch.equal(sub["obs"], expected)
    assert torch.equal(sub["nested", "x"], td["nested", "x"][leaf_index])
    assert sub["nested"].batch_size == td["nested", "x"][leaf_index].shape
    assert sub["task"] == "walk" and sub.get("task").batch_size == sub.batch_size


@pytest.mark.parametrize("index", [1, slice(0, 2), (slice(None), 1), Ellipsis, None, (1, slice(None, None, 2))])
def test_basic_index_is_a_view(index):
    td = make_td()
    view = td[index]
    view["obs"].fill_(-1.0)
    view["nested", "x"].fill_(-1)
    assert bool((td["obs"][index] == -1).all()) and bool((td["nested", "x"][index] == -1).all())
    assert (td["obs"] == -1).sum() == view["obs"].numel()


@pytest.mark.parametrize("index", [[0, 2], torch.tensor([1]), torch.tensor([True, False, True]), (0, [1, 2])])
def test_advanced_index_copies(index):
    td = make_td()
    copy = td[index]
    copy["obs"].fill_(-1.0)
    copy["nested", "x"].fill_(-1)
    assert not (td["obs"] == -1).any() and not (td["nested", "x"] == -1).any()


def test_names_follow_basic_indices():
    td = make_td()
    td.names = ["env", "time"]
    assert td[0].names == ["time"]
    assert td[:, 1].names == ["env"]
    assert td[None].names == [None, "env", "time"]
    assert td[1:].names == ["env", "time"]


@pytest.mark.parametrize(
    "index, error, match",
    [
        (3, IndexError, "out of bounds"),
        (-4, IndexError, "out of bounds"),
        ((0, 4), IndexError, "out of bounds"),
        (torch.tensor([0, 5]), IndexError, "5"),
        ([1, -9], IndexError, "-9"),
        ((0, 0, 0), IndexError, "[Tt]oo many"),
        ((Ellipsis, 0, Ellipsis), IndexError, "Ellipsis"),
        (torch.ones(3, dtype=torch.bool)[:2], IndexError, "[Ss]hape|match"),
        (1.5, IndexTypeError, "1.5"),
        (torch.tensor([0.5]), IndexTypeError, "float"),
        (object(), IndexTypeError, "object"),
    ],
)
def test_bad_indices(index, error, match):
    td = make_td()
    with pytest.raises(error, match=match):
        td[index]
    with pytest.raises(IndexError):  # what torch and tensordict raise for all of them
        td[index]


@needs_tensordict
@pytest.mark.parametrize("index", [[[]], [[], []], (slice(None), [[]]), np.zeros((0, 2), dtype=np.int64)])
def test_empty_list_indices_select_nothing_as_tensordict_does(index):
    import tensordict

    ours = make_td()[index]
    theirs = tensordict.TensorDict(obs=make_td()["obs"], batch_size=[3, 4])[index]
    assert ours.batch_size == theirs.batch_size and ours["obs"].shape == theirs["obs"].shape


# ----------------------------------------------------------------------------- writing
def test_write_tensordict_at_index():
    td = make_td()
    row = TensorDict(
        {"obs": torch.full((4, 2), 7.0), "nested": TensorDict(x=torch.full((4, 5), 9), batch_size=[4, 5])},
        batch_size=[4],
    )
    td[1] = row
    assert bool((td["obs"][1] == 7).all()) and bool((td["nested", "x"][1] == 9).all())
    assert td["obs"][0].sum() == 28 and td["obs"][2].sum() == 156  # other rows kept


def test_write_dict_scalar_and_tensor():
    td = make_td()
    td[0:2] = {"obs": torch.zeros(2, 4, 2)}
    assert not td["obs"][:2].any() and td["obs"][2].sum() == 156
    td[:, 0] = 1.0  # a number broadcasts; a dict's values have the rows' batch dims (as tensordict)
    assert bool((td["obs"][:, 0] == 1).all())
    with pytest.raises(BatchSizeMismatchError, match="obs"):
        td[:, 0] = {"obs": 1.0}
    td[2] = 5  # a number goes to every tensor leaf
    assert bool((td["obs"][2] == 5).all()) and bool((td["nested", "x"][2] == 5).all())
    td[0] = torch.tensor(3)
    assert bool((td["nested", "x"][0] == 3).all())


def test_write_with_mask_and_index_tensor():
    td = make_td()
    mask = torch.tensor([True, False, True])
    td[mask] = TensorDict(obs=torch.zeros(2, 4, 2), batch_size=[2, 4])
    assert not td["obs"][0].any() and not td["obs"][2].any() and td["obs"][1].any()
    td[torch.tensor([1, 0])] = TensorDict(obs=torch.full((2, 4, 2), 4.0), batch_size=[2, 4])
    assert bool((td["obs"][:2] == 4).all())


def test_replay_buffer_writes():
    """A circular buffer: rows written in place at a cursor, through a view too."""
    buffer = TensorDict(
        {"obs": torch.zeros(5, 3), "reward": torch.zeros(5), "info": {"done": torch.zeros(5, dtype=torch.bool)}},
        batch_size=[5],
    )
    storage = buffer["obs"]
    cursor = 0
    for step in range(7):
        item = TensorDict(
            {"obs": torch.full((3,), float(step)), "reward": torch.tensor(float(step)),
             "info": {"done": torch.tensor(step % 2 == 0)}},
            batch_size=[],
        )
        buffer[cursor] = item
        cursor = (cursor + 1) % 5
    assert buffer["obs"] is storage
    assert buffer["reward"].tolist() == [5.0, 6.0, 2.0, 3.0, 4.0]
    assert buffer["info", "done"].tolist() == [False, True, True, False, True]
    batch = TensorDict({"obs": torch.ones(2, 3), "reward": torch.ones(2), "info": {"done": torch.ones(2, dtype=torch.bool)}}, batch_size=[2])
    buffer[torch.tensor([4, 0])] = batch
    assert buffer["reward"].tolist() == [1.0, 6.0, 2.0, 3.0, 1.0]
    buffer[1:3][0] = batch[0]  # writes through a view
    assert buffer["reward"][1] == 1.0


def test_write_adds_missing_key_zero_filled():
    td = make_td()
    td[1] = TensorDict(extra=torch.ones(4, 2), batch_size=[4])
    assert td["extra"].shape == torch.Size([3, 4, 2])
    assert td["extra"][1].sum() == 8 and not td["extra"][0].any()


def test_write_non_tensor_at_index():
    td = make_td()
    td[1] = TensorDict(task="run", batch_size=[4])
    assert td[1, 2]["task"] == "run" and td[1]["task"] == ["run"] * 4 and td[0, 0]["task"] == "walk"
    assert td["task"] == [["walk"] * 4, ["run"] * 4, ["walk"] * 4]


@pytest.mark.parametrize(
    "index, value, error, match",
    [
        (0, TensorDict(obs=torch.zeros(4, 3), batch_size=[4]), ValueError, "'obs'"),
        # 'new' is valid and comes first: it must not be added when 'obs' fails
        # (a source of another batch size than the rows: refused first, as tensordict)
        (0, TensorDict(new=torch.zeros(4), obs=torch.zeros(5, 2), batch_size=[]), ValueError,
         r"rows have batch size \[4\].*source tensordict \[\]"),
        (0, TensorDict(new=torch.zeros(4), obs=torch.zeros(4, 5, 2), batch_size=[4]), ValueError, "'obs'"),
        # 'obs' is valid and comes first: it must not be written when nested 'x' fails
        (0, {"obs": torch.zeros(4, 2), "nested": TensorDict(x=torch.zeros(4, 6), batch_size=[4])}, ValueError, "'x'"),
        (0, {"obs": torch.zeros(4, 2), "nested": TensorDict(new=torch.zeros(4, 5), y=torch.zeros(2), batch_size=[])},
         ValueError, "'nested'"),
        (0, {"obs": torch.zeros(4, 2), "nested": TensorDict(new=torch.zeros(4, 5), y=torch.zeros(4, 2), batch_size=[4])},
         ValueError, "'y'"),
        # a tensor goes into every leaf of 'nested' (as tensordict): 'x' is [4, 5] there
        (0, {"obs": torch.zeros(4, 2), "nested": torch.zeros(4)}, ValueError, r"\('nested', 'x'\)"),
        (0, {"obs": torch.zeros(4, 2), "task": NotImplemented, "zz": torch.zeros(9, 9)}, ValueError, "'zz'"),
        (slice(0, 2), TensorDict(obs=torch.zeros(3, 4, 2), batch_size=[3, 4]), ValueError, r"batch size \[2, 4\]"),
        (3, TensorDict(obs=torch.zeros(4, 2), batch_size=[4]), IndexError, "out of bounds"),
        (0, "text", TypeError, "str"),
        (0, torch.zeros(7), ValueError, "entry 'obs'"),  # the first leaf that does not fit
        (0, {"obs": "text"}, TypeError, "'obs'"),
        (slice(0, 2), {"obs": torch.zeros(2, 4, 2), "task": NonTensorStack("a", "b", "c")}, ValueError, "'task'"),
    ],
)
def test_failing_write_changes_nothing(unchanged, index, value, error, match):
    td = make_td()
    with unchanged(td), pytest.raises(error, match=match):
        td[index] = value


# ----------------------------------------------------------------------------- batch-dim ops
def test_unbind_split_chunk():
    td = make_td()
    rows = td.unbind(0)
    assert len(rows) == 3 and rows[1].batch_size == torch.Size([4])
    assert [c.batch_size[0] for c in td.split(2)] == [2, 1]
    assert [c.batch_size[1] for c in td.split([1, 3], dim=1)] == [1, 3]
    assert [c.batch_size[0] for c in td.chunk(2)] == [2, 1]
    columns = torch.unbind(td, 1)
    assert len(columns) == 4 and columns[0]["task"] == "walk"
    columns[0]["obs"].zero_()  # views
    assert not td["obs"][:, 0].any()
    with pytest.raises(ValueError, match="split"):
        td.split([1, 1])
    with pytest.raises(IndexError, match="dim"):
        td.unbind(2)


def test_shape_ops():
    td = make_td()
    assert td.expand(2, 3, 4).batch_size == torch.Size([2, 3, 4])
    assert td.expand(2, 3, 4)["nested"].batch_size == torch.Size([2, 3, 4, 5])
    assert td.reshape(-1).batch_size == torch.Size([12]) and td.reshape(12)["obs"].shape == torch.Size([12, 2])
    assert td.reshape(2, 6)["nested", "x"].shape == torch.Size([2, 6, 5])
    assert td.unsqueeze(-1).batch_size == torch.Size([3, 4, 1])
    assert td.unsqueeze(0).squeeze(0).batch_size == td.batch_size
    assert td.unsqueeze(1).unsqueeze(0).squeeze().batch_size == td.batch_size
    permuted = td.permute(1, 0)
    assert permuted.batch_size == torch.Size([4, 3]) and permuted["obs"].shape == torch.Size([4, 3, 2])
    assert torch.equal(permuted["obs"][2, 1], td["obs"][1, 2])
    assert permuted["nested", "x"].shape == torch.Size([4, 3, 5])
    assert td.permute(-1, 0).batch_size == torch.Size([4, 3])
    assert td.view(12)["task"] == "walk"


def test_view_ops_share_storage():
    td = make_td()
    for view in (td.view(-1), td.unsqueeze(0), td.permute(1, 0), td.unsqueeze(1).squeeze(1)):
        view["obs"].add_(1)
    assert td["obs"][0, 0].tolist() == [4.0, 5.0]


def test_bad_shape_ops():
    td = make_td()
    with pytest.raises(RuntimeError):
        td.reshape(5)
    with pytest.raises(RuntimeError):
        td.expand(2, 4, 4)
    with pytest.raises(ValueError, match="permute"):
        td.permute(0, 0)
    with pytest.raises(IndexError, match="dim"):
        td.unsqueeze(4)
    with pytest.raises(RuntimeError):
        td.permute(1, 0).view(-1)  # not contiguous: view impossible


def test_indexing_formats_no_index(monkeypatch):
    # A tensor index reaches the nested tensordicts; nothing may build a message with it
    # (torch's repr of a 256-row index cost 0.5 ms per sample before).
    td = make_td()
    index = torch.tensor([2, 0])

    def no_repr(self, *args, **kwargs):
        raise AssertionError("the index was formatted on a path that raised nothing")

    monkeypatch.setattr(torch.Tensor, "__repr__", no_repr)
    sub = td[index]
    td[index] = sub
    assert torch.equal(sub["nested", "x"], td["nested", "x"][index])


@pytest.mark.parametrize("index", [1, -2, (1, 2), slice(0, 2), (Ellipsis, 3)])
def test_basic_index_of_a_memmapped_locked_td_keeps_everything(tmp_path, index):
    # the row read of a replay buffer (a fast path): every leaf a MemoryMappedTensor of
    # the same file, every node locked and linked to its locked parent, the flags kept
    from shared_td import MemoryMappedTensor

    plain = make_td()
    plain.names = ["rows", "cols"]
    td = plain.clone().memmap_(tmp_path / "buf")
    view, reference = td[index], plain[index]
    assert view.batch_size == reference.batch_size and view.names == reference.names
    assert view.device == td.device and view["nested"].batch_size == reference["nested"].batch_size
    assert view.is_locked and view.is_memmap() and view["nested"].is_locked
    assert view["nested"].is_memmap() and view.get("task").is_locked
    for key in [("obs",), ("nested", "x")]:
        leaf, whole = view.get(key), td.get(key)
        assert type(leaf) is MemoryMappedTensor and leaf.filename == whole.filename
        assert leaf.parent_shape == whole.shape
        assert leaf.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()
        assert torch.equal(leaf, reference.get(key))
    assert view["task"] == "walk" and view.get("task").batch_size == view.batch_size
    with pytest.raises(RuntimeError, match="locked graph"):
        view["nested"].unlock_()
    with pytest.raises(RuntimeError, match="locked graph"):
        view.get("task").unlock_()
    with pytest.raises(RuntimeError, match="locked"):
        view["new"] = torch.zeros(view.batch_size)
    with view.unlock_():
        assert not view["nested"].is_locked and not view.is_memmap()
    assert view.is_locked and view["nested"].is_locked
