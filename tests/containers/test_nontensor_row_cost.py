"""The work of one row write into a buffer with a per-row non-tensor column (session-21 RL
audit, finding 2): ``buf[i] = step`` turned the index into positions with
``torch.arange(capacity)`` and copied the whole list at every write, O(capacity) per
step. The positions now come from the index (an int, a slice, an integer tensor) and a
stack in this process's memory changes its list in place. Asserted on the work done
(no tensor of every position is built, the list is the same object), never on timings;
the values written are compared with tensordict 0.15.3's.
"""
from __future__ import annotations

import pytest
import torch

import shared_td
from shared_td import NonTensorData, NonTensorStack, TensorDict

tensordict = pytest.importorskip("tensordict")

CAPACITY = 4096


@pytest.fixture
def aranges(monkeypatch):
    """The sizes of the torch.arange calls made while the test runs."""
    sizes = []
    real = torch.arange

    def counting(*args, **kwargs):
        out = real(*args, **kwargs)
        sizes.append(out.numel())
        return out

    monkeypatch.setattr(torch, "arange", counting)
    return sizes


def _buffer(lib, capacity=CAPACITY):
    return lib.TensorDict(obs=torch.zeros(capacity, 2), info=lib.NonTensorStack(*["-"] * capacity),
                          batch_size=[capacity])


@pytest.mark.parametrize("index", [7, -1, slice(10, 14), slice(1, 9, 3), torch.tensor([3, -2, 3])],
                         ids=["int", "negative", "slice", "step", "tensor"])
def test_row_write_builds_no_tensor_of_every_position_and_keeps_the_list(aranges, index):
    buf = _buffer(shared_td)
    values = buf.get("info")._values
    rows = torch.zeros(CAPACITY)[index].shape
    step = TensorDict(obs=torch.ones(rows + (2,)), info=NonTensorData("ok", batch_size=rows), batch_size=rows)
    aranges.clear()
    buf[index] = step
    assert all(size < CAPACITY for size in aranges), aranges
    assert buf.get("info")._values is values  # changed in place, not copied
    written = torch.zeros(CAPACITY, dtype=torch.bool)
    written[index] = True
    assert [value == "ok" for value in buf.get("info").tolist()] == written.tolist()


@pytest.mark.parametrize("index", [7, -3, slice(2, 6), slice(0, 9, 4), torch.tensor([5, -1]),
                                   torch.tensor([True, False] * 8), (slice(None), 1)],
                         ids=["int", "negative", "slice", "step", "tensor", "mask", "2d-tuple"])
def test_values_written_as_tensordict_writes_them(index):
    results = []
    for lib in (shared_td, tensordict):
        batch = [16] if not isinstance(index, tuple) else [8, 2]
        buf = lib.TensorDict(info=lib.NonTensorStack.from_list(
            [f"v{i}" for i in range(16)] if len(batch) == 1 else [[f"v{i}", f"w{i}"] for i in range(8)]),
            batch_size=batch)
        rows = torch.zeros(batch)[index].shape
        values = [f"new{i}" for i in range(rows.numel())] if rows.numel() > 1 else "new"
        step = lib.TensorDict(info=lib.NonTensorStack.from_list(values) if rows.numel() > 1
                              else lib.NonTensorData(values, batch_size=rows), batch_size=rows)
        buf[index] = step
        results.append(buf.get("info").tolist())
    assert results[0] == results[1]


@pytest.mark.parametrize("index", [(16,), (-17,), (torch.tensor([0, 16]),)])
def test_out_of_range_is_torchs_index_error_and_nothing_changes(index):
    stack = NonTensorStack(*["-"] * 16)
    with pytest.raises(IndexError):
        stack._set_at(index, NonTensorData("x"))
    assert stack.tolist() == ["-"] * 16


def test_flat_positions_of_other_indices_index_one_cached_tensor(aranges):
    from shared_td.containers.nontensor import flat_positions

    size = torch.Size([CAPACITY // 4, 4])
    first = flat_positions((1,), size)
    assert first == ([4, 5, 6, 7], torch.Size([4]))
    aranges.clear()
    assert flat_positions((slice(None), 2), size)[0][:2] == [2, 6]
    assert flat_positions((torch.tensor([0, 2]),), torch.Size([4]))[0] == [0, 2]
    assert aranges == []  # made once per batch size, not per write


@pytest.mark.parametrize("mode", ["shared", "memmap"])
def test_shared_and_memmap_stacks_still_write_whole(tmp_path, mode):
    buf = _buffer(shared_td, 64)
    if mode == "shared":
        buf.memmap_(share_non_tensor=True)
    else:
        buf.memmap_(tmp_path / "buf")
    values = buf.get("info")._values
    buf[3] = TensorDict(obs=torch.ones(2), info=NonTensorData("ok"), batch_size=[])
    assert buf.get("info").tolist()[2:5] == ["-", "ok", "-"]
    assert values[3] == "-"  # (a list read before the write is not changed under its reader)
    if mode == "memmap":
        assert shared_td.TensorDict.load_memmap(tmp_path / "buf").get("info").tolist()[3] == "ok"
