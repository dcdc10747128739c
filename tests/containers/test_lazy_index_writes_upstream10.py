"""Lazy-stack indexing found by running tensordict's upstream test_indexing.py cases side
by side (a probe outside the repository), against tensordict 0.15.3 where installed."""
from __future__ import annotations

import pytest
import torch

import shared_td
from tests.reference import LIBS


def _texts(lib, stack_dim=2, memmap_to=None):
    members = []
    for i in range(2 if stack_dim == 2 else 4):
        shape = [4, 3, 1] if stack_dim == 2 else [3, 2, 1]
        member = lib.TensorDict({"a": torch.zeros(*shape, 5)}, shape)
        member.set_non_tensor("text", f"s{i}")
        members.append(member)
    lazy = lib.lazy_stack(members, stack_dim)
    return lazy.memmap_(memmap_to) if memmap_to is not None else lazy


def _rows_with(lazy, text: str) -> list:
    texts = lazy.get("text").tolist()
    return [(i, j, k) for i in range(4) for j in range(3) for k in range(2) if texts[i][j][k][0] == text]


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("index", [([0, -1], [0, -1]), (Ellipsis, torch.tensor([[True], [False]]))],
                         ids=["two lists", "mask over two dims"])
def test_a_write_across_the_stack_dim_writes_the_non_tensor_value_into_every_row(lib, index):
    """Before: each selected element was planned on its own from the member as it was,
    so each member kept only the last element's value (2 rows of 4, 1 of 12)."""
    lazy = _texts(lib)
    value = lazy.to_tensordict()[index].apply(lambda x: torch.full_like(x, -1))
    value.set_non_tensor("text", "new")
    lazy[index] = value
    written = [tuple(p) for p in (lazy["a"][..., 0, 0] == -1).nonzero().tolist()]
    assert _rows_with(lazy, "new") == written and len(written) == value.batch_size.numel()


@pytest.mark.parametrize("lib", LIBS)
def test_two_bools_give_copies(lib, tmp_path):
    """As torch and tensordict: ``lazy[True, True]`` is advanced indexing (before: views
    of the members, so a write into the result reached the stack and its files)."""
    lazy = _texts(lib, memmap_to=tmp_path / "lazy")
    lazy[True, True].apply_(lambda leaf: leaf.fill_(7))  # (in place, into each member's leaf)
    assert not (lazy["a"] == 7).any()
    assert not (lib.TensorDict.load_memmap(tmp_path / "lazy")["a"] == 7).any()


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("index", [slice(None), Ellipsis, (slice(None), slice(None))], ids=["[:]", "[...]", "[:, :]"])
def test_one_value_over_every_element_of_a_memory_mapped_stack(lib, index, tmp_path):
    """``lazy[:] = value`` gives each member's memory-mapped NonTensorData one value over
    all its elements: written, also into the files, as tensordict 0.15.3 (before: refused
    as per-element values)."""
    lazy = _texts(lib, memmap_to=tmp_path / "lazy")
    value = lazy.to_tensordict()[index].apply(lambda x: torch.full_like(x, -1))
    value.set_non_tensor("text", "new")
    lazy[index] = value
    assert [member.get_non_tensor("text") for member in lazy.tensordicts] == ["new", "new"]
    back = lib.TensorDict.load_memmap(tmp_path / "lazy")
    assert [member.get_non_tensor("text") for member in back.tensordicts] == ["new", "new"]


def test_one_value_over_every_element_of_a_memory_mapped_tensordict(tmp_path):
    """The same write into a memory-mapped TensorDict's NonTensorData (tensordict 0.15.3
    refuses it there, as it refuses no other whole write); a part of it stays refused."""
    td = shared_td.TensorDict(a=torch.zeros(4), batch_size=[4]).set_non_tensor("text", "old")
    td.memmap_(tmp_path / "td")
    value = shared_td.TensorDict(a=torch.ones(4), batch_size=[4]).set_non_tensor("text", "new")
    td[:] = value
    assert td.get_non_tensor("text") == "new"
    assert shared_td.load_memmap(tmp_path / "td").get_non_tensor("text") == "new"
    with pytest.raises(RuntimeError, match="per-element values"):
        td[:2] = value[:2].set_non_tensor("text", "newer")
    assert td.get_non_tensor("text") == "new"


# lazy[rows] = a 0-d tensordict whose nested node (batch [2]) holds a non-tensor entry: the
# source was fitted to the rows row by row, which took the nested node's dim as the rows'
# (row 0 got element 0 everywhere, row 2 element 1; fuzz record 226286, triage24); it is
# broadcast to every row, as a tensor is (tensordict 0.15.3 does)
def _member(L, i, nt):
    obs = L.TensorDict({"k": torch.tensor([10. * i, 10. * i + 1])}, [2])
    if nt == "stack":
        obs["s"] = L.NonTensorStack(L.NonTensorData(f"walk{i}"), L.NonTensorData(f"run{i}"))
    else:
        obs.set_non_tensor("s", f"walk{i}")
    return L.TensorDict({"obs": obs}, [])


@pytest.mark.parametrize("nt", ["stack", "data"])
@pytest.mark.parametrize("index", [slice(None, None, 2), [0, 2], torch.tensor([True, False, True])],
                         ids=["step", "list", "mask"])
@pytest.mark.parametrize("lib", LIBS)
def test_a_row_with_a_nested_non_tensor_is_written_whole_into_every_row(lib, index, nt):
    L = lib
    x = L.LazyStackedTensorDict.lazy_stack([_member(L, i, nt) for i in range(3)])
    x[index] = x[1].clone()
    assert x.get(("obs", "k")).tolist() == [[10., 11.]] * 3
    assert x.get(("obs", "s")).tolist() == ([["walk1", "run1"]] * 3 if nt == "stack" else [["walk1"] * 2] * 3)
