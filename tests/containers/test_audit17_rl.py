"""The RL hot paths of the session-17 audit, side by side with tensordict 0.15.3 where it
makes sense: a write through an index tensor, list or mask of a source leaf of another
dtype (float64 rewards from numpy into a float32 buffer) is cast as a slice write casts
it, instead of failing halfway; a write that torch refuses for memory overlap is refused
before the first leaf is written; lazy ``set_at_`` casts too; a uint8 index is a mask;
the fast lane's cached plan keeps no leaf alive; ``TensorDict.__getitems__``."""
from __future__ import annotations

import gc
import warnings
import weakref

import numpy as np
import pytest
import torch

import shared_td
from shared_td import LazyStackedTensorDict, TensorDict

tensordict = pytest.importorskip("tensordict")


def buffer(lib, rows: int = 8):
    return lib.TensorDict(obs=torch.zeros(rows, 4), action=torch.zeros(rows, 2), reward=torch.zeros(rows, 1),
                          done=torch.zeros(rows, 1, dtype=torch.bool), batch_size=[rows])


def batch(lib, n: int = 3):
    return lib.TensorDict(obs=torch.ones(n, 4), action=torch.ones(n, 2),
                          reward=torch.as_tensor(np.full((n, 1), 0.5)),  # float64, as numpy gives it
                          done=torch.ones(n, 1, dtype=torch.bool), batch_size=[n])


def plain(td) -> dict:
    return {key: value.clone() for key, value in td.items(include_nested=True, leaves_only=True)}


def assert_same(ours, theirs) -> None:
    ours, theirs = plain(ours), plain(theirs)
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert ours[key].dtype == theirs[key].dtype, key
        torch.testing.assert_close(ours[key], theirs[key], msg=str(key))


ROWS = [torch.tensor([6, 7, 0]), [6, 7, 0], np.array([6, 7, 0]),
        torch.tensor([True, False, False, False, False, True, False, True])]


# ---------------------------------------------------------------- 1. dtypes
@pytest.mark.parametrize("rows", ROWS, ids=["tensor", "list", "array", "mask"])
@pytest.mark.parametrize("shared", [False, True], ids=["memory", "shared"])
def test_index_write_of_another_dtype_is_cast_as_a_slice_write(rows, shared):
    """tensordict (and torch's index_put_) refuse the float64 reward after obs and
    action were written; a slice write casts it. We cast for an index as for a slice:
    the result is tensordict's slice write of the same rows."""
    buf = buffer(shared_td).share_memory_() if shared else buffer(shared_td)
    for _ in range(2):  # the general write, then the fast lane
        buf[rows] = batch(shared_td)
    assert buf._row_write_plan is not None
    ref = buffer(tensordict)  # (the rows of batch() are alike: any order of rows will do)
    mask = isinstance(rows, torch.Tensor) and rows.dtype == torch.bool
    for row in ((0, 5, 7) if mask else (6, 7, 0)):
        ref[row:row + 1] = batch(tensordict)[:1]  # a slice write: tensordict casts
    assert_same(buf, ref)
    assert buf["reward"].dtype == torch.float32


def test_tensordict_refuses_it_halfway():
    """Why: tensordict 0.15.3 writes obs and action, then raises on reward."""
    ref = buffer(tensordict)
    with pytest.raises(RuntimeError, match="dtypes match"):
        ref[torch.tensor([0, 1, 2])] = batch(tensordict)
    assert ref["obs"].sum() > 0 and ref["reward"].sum() == 0


@pytest.mark.parametrize("as_dict", [False, True])
def test_update_at_of_another_dtype_is_cast(as_dict):
    td = TensorDict(a=torch.zeros(6), b=torch.zeros(6, dtype=torch.int64), batch_size=[6]).share_memory_()
    source = {"a": torch.ones(2), "b": torch.full((2,), 2.5)}
    td.update_at_(source if as_dict else TensorDict(source, batch_size=[2]), torch.tensor([0, 3]))
    assert td["a"].tolist() == [1, 0, 0, 1, 0, 0]
    assert td["b"].tolist() == [2, 0, 0, 2, 0, 0] and td["b"].dtype == torch.int64  # as a slice casts


@pytest.mark.parametrize("index", [torch.tensor([0, 2]), [0, 2], torch.tensor([True, False, True, False])])
def test_set_at_and_a_tensor_value_of_another_dtype_are_cast(index):
    td = TensorDict(r=torch.zeros(4), n={"x": torch.zeros(4, 2)}, batch_size=[4])
    td.set_at_("r", torch.ones(2, dtype=torch.float64), index)
    td[index] = torch.full((), 2, dtype=torch.int64)  # into every leaf
    assert td["r"].tolist() == [2, 0, 2, 0] and td["n", "x"][:, 0].tolist() == [2, 0, 2, 0]
    assert td["r"].dtype == torch.float32


def test_lazy_stack_along_dim_1_casts_in_every_member():
    members = [TensorDict(obs=torch.zeros(6, 2), reward=torch.zeros(6), batch_size=[6]) for _ in range(2)]
    lazy = LazyStackedTensorDict(*members, stack_dim=1)
    lazy[torch.tensor([1, 4])] = TensorDict(obs=torch.ones(2, 2, 2), reward=torch.ones(2, 2, dtype=torch.float64),
                                            batch_size=[2, 2])
    for member in members:
        assert member["obs"].any(-1).tolist() == [False, True, False, False, True, False]
        assert member["reward"].tolist() == [0, 1, 0, 0, 1, 0] and member["reward"].dtype == torch.float32


# ---------------------------------------------------------------- 1. memory overlap
def test_an_expanded_leaf_is_refused_before_anything_is_written():
    for lib in (shared_td, tensordict):
        td = lib.TensorDict(a=torch.zeros(4), b=torch.zeros(1).expand(4), batch_size=[4])
        with pytest.raises(RuntimeError) as info:
            td[0:2] = lib.TensorDict(a=torch.ones(2), b=torch.ones(2), batch_size=[2])
        if lib is shared_td:
            assert "'b'" in str(info.value) and td["a"].sum() == 0  # nothing written
        else:
            assert td["a"].sum() == 2  # tensordict: a written, then b refused


@pytest.mark.parametrize("warm", [False, True], ids=["general", "fast lane"])
@pytest.mark.parametrize("rows", [torch.tensor([4, 5]), slice(0, 2)], ids=["tensor", "slice"])
def test_a_source_in_the_memory_written_is_refused_naming_the_key(warm, rows):
    td = TensorDict(a=torch.zeros(6), b=torch.arange(6.0), batch_size=[6])
    if warm:
        td[rows] = TensorDict(a=torch.ones(2), b=torch.ones(2), batch_size=[2])
        td["a"].zero_()
        td["b"].copy_(torch.arange(6.0))
    with pytest.raises(RuntimeError, match="'b'"):
        td[rows] = TensorDict(a=torch.ones(2), b=td["b"][1:3] if rows == slice(0, 2) else td["b"][4:6],
                              batch_size=[2])
    assert td["a"].sum() == 0 and td["b"].tolist() == list(range(6))


def _overlap_cases():
    """(name, leaf maker, index, source maker from the leaf): single-leaf writes that
    torch refuses or accepts for memory overlap."""
    def arange(n=6):
        return torch.arange(float(n))

    def grid():
        return torch.arange(12.0).reshape(6, 2)

    return [
        ("expanded, slice", lambda: torch.zeros(1).expand(6), slice(0, 2), lambda t: torch.ones(2)),
        ("expanded, int", lambda: torch.zeros(1).expand(6), 1, lambda t: torch.ones(())),
        ("expanded rows, int", lambda: torch.zeros(6, 1).expand(6, 3), 1, lambda t: torch.ones(3)),
        ("expanded, tensor", lambda: torch.zeros(1).expand(6), torch.tensor([0, 2]), lambda t: torch.ones(2)),
        ("overlapping slice", arange, slice(0, 2), lambda t: t[1:3]),
        ("same slice", arange, slice(0, 2), lambda t: t[0:2]),
        ("disjoint slice", arange, slice(0, 2), lambda t: t[2:4]),
        ("tensor, overlapping", arange, torch.tensor([0, 1]), lambda t: t[1:3]),
        ("tensor, disjoint view", arange, torch.tensor([0, 1]), lambda t: t[2:4]),
        ("tensor, strided view", arange, torch.tensor([0, 1]), lambda t: t[::3]),
        ("tensor, expanded view", arange, torch.tensor([0, 1]), lambda t: t[3:4].expand(2)),
        ("mask, view", arange, torch.tensor([True, True, False, False, False, False]), lambda t: t[1:3]),
        ("rows: int, other row", grid, 0, lambda t: t[1]),
        ("rows: slice, overlapping", grid, slice(0, 2), lambda t: t[1:3]),
        ("rows: tensor, column view", grid, torch.tensor([0, 1]), lambda t: t[2:4, :1]),
        ("rows: tensor, rows view", grid, torch.tensor([0, 1]), lambda t: t[2:4]),
    ]


@pytest.mark.parametrize("case", _overlap_cases(), ids=lambda case: case[0])
def test_overlap_refusals_are_torchs(case):
    """One leaf (nothing can be half written): we raise where tensordict (torch) raises,
    before writing, and write the same values where it does not."""
    _, make, index, source = case
    outcome = {}
    for lib in (shared_td, tensordict):
        leaf = make()
        td = lib.TensorDict(x=leaf, batch_size=[6])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (torch warns of index_put_ into an expanded tensor)
            try:
                td[index] = lib.TensorDict(x=source(td["x"]), batch_size=td["x"][index].shape[:1])
                outcome[lib] = td["x"].clone()
            except RuntimeError as error:
                outcome[lib] = "refused"
                if lib is shared_td:
                    assert "'x'" in str(error) and "Nothing was written" in str(error)
                    torch.testing.assert_close(td["x"], make())
    if isinstance(outcome[tensordict], str):
        assert outcome[shared_td] == "refused"
    else:
        torch.testing.assert_close(outcome[shared_td], outcome[tensordict])


# ---------------------------------------------------------------- 2. lazy set_at_
@pytest.mark.parametrize("index", [torch.tensor([0, 2]), [0, 2], (torch.tensor([1]), slice(None))],
                         ids=["tensor", "list", "tuple"])
def test_lazy_set_at_casts_as_tensordict(index):
    sums = {}
    for lib in (shared_td, tensordict):
        lazy = lib.LazyStackedTensorDict(*[lib.TensorDict(r=torch.zeros(3), batch_size=[3]) for _ in range(4)],
                                         stack_dim=0)
        rows = 1 if isinstance(index, tuple) else 2
        lazy.set_at_("r", torch.arange(rows * 3, dtype=torch.float64).reshape(rows, 3) + 1, index)
        sums[lib] = lazy["r"]
    assert sums[shared_td].dtype == torch.float32
    torch.testing.assert_close(sums[shared_td], sums[tensordict])


def test_lazy_set_at_into_members_of_two_dtypes_writes_both():
    """The stacked entry is float64 (a float32 value was refused there), and the float32
    member gets its elements cast (index_put_ would refuse them after the float64 member
    was written)."""
    out = {}
    for lib in (shared_td, tensordict):
        members = [lib.TensorDict(r=torch.zeros(3, dtype=dtype), batch_size=[3])
                   for dtype in (torch.float64, torch.float32)]
        lib.LazyStackedTensorDict(*members, stack_dim=0).set_at_("r", torch.ones(2, 3), torch.tensor([0, 1]))
        out[lib] = [(member["r"].dtype, member["r"].tolist()) for member in members]
    assert out[shared_td] == out[tensordict] == [(torch.float64, [1.0] * 3), (torch.float32, [1.0] * 3)]


# ---------------------------------------------------------------- 3. uint8 masks
def test_a_uint8_index_is_a_mask_as_in_torch():
    mask = torch.tensor([[1, 0, 1], [0, 1, 0]], dtype=torch.uint8)
    out = {}
    for lib in (shared_td, tensordict):
        td = lib.TensorDict(a=torch.arange(24.0).reshape(2, 3, 4), batch_size=[2, 3], names=["x", "y"])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out[lib] = (td[mask], td[mask, ...])
        assert any("uint8" in str(w.message) for w in caught)
    for ours, theirs in zip(out[shared_td], out[tensordict]):
        assert ours.batch_size == theirs.batch_size == torch.Size([3])
        assert ours.batch_dims == 1 and (ours.names in (None, [None]))
        torch.testing.assert_close(ours["a"], theirs["a"])


def test_a_uint8_masked_tensordict_saves_and_loads(tmp_path):
    td = TensorDict(a=torch.arange(24.0).reshape(2, 3, 4), batch_size=[2, 3], names=["x", "y"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rows = td[torch.tensor([[1, 0, 1], [0, 1, 0]], dtype=torch.uint8)]
    rows.memmap_(tmp_path / "rows")
    back = TensorDict.load_memmap(tmp_path / "rows")
    assert back.batch_size == torch.Size([3])
    torch.testing.assert_close(back["a"], rows["a"])


def test_a_uint8_mask_writes_as_a_bool_one():
    td = TensorDict(a=torch.arange(6.0), batch_size=[6])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        td[np.array([1, 0, 1, 0, 0, 1], dtype=np.uint8)] = 0.0
    assert td["a"].tolist() == [0, 1, 0, 3, 4, 0]


# ---------------------------------------------------------------- 4. the plan keeps nothing alive
@pytest.mark.parametrize("change", ["memmap_", "del", "replace"])
def test_the_fast_lane_plan_keeps_no_old_leaf_alive(change, tmp_path):
    buf = TensorDict(obs=torch.zeros(64, 4), rew=torch.zeros(64), batch_size=[64])
    buf[0:2] = TensorDict(obs=torch.ones(2, 4), rew=torch.ones(2), batch_size=[2])
    assert buf._row_write_plan is not None
    old = weakref.ref(buf["obs"])
    if change == "memmap_":
        buf.memmap_(tmp_path / "buf")
    elif change == "del":
        del buf["obs"]
    else:
        buf["obs"] = torch.zeros(64, 4)
    gc.collect()
    assert old() is None
    if change != "del":  # and the next write goes into the current leaves
        buf[2:4] = TensorDict(obs=torch.full((2, 4), 3.0), rew=torch.ones(2), batch_size=[2])
        assert buf["obs"][2:4].eq(3).all() and buf["obs"][:2].sum() == (8 if change == "memmap_" else 0)


# ---------------------------------------------------------------- 5. __getitems__
def test_getitems_reads_a_batch_in_one_index_as_tensordict():
    ours = TensorDict(obs=torch.arange(20.0).reshape(10, 2), batch_size=[10])
    theirs = tensordict.TensorDict(obs=torch.arange(20.0).reshape(10, 2), batch_size=[10])
    got, want = ours.__getitems__([3, 0, 7]), theirs.__getitems__([3, 0, 7])
    assert type(got) is TensorDict and got.batch_size == want.batch_size
    torch.testing.assert_close(got["obs"], want["obs"])


def test_a_dataloader_over_a_tensordict_gets_tensordict_batches():
    from torch.utils.data import DataLoader

    td = TensorDict(obs=torch.arange(20.0).reshape(10, 2), batch_size=[10])
    first = next(iter(DataLoader(td, batch_size=4, collate_fn=lambda rows: rows)))
    assert isinstance(first, TensorDict) and first.batch_size == torch.Size([4])
    collated = next(iter(DataLoader(td, batch_size=4)))
    torch.testing.assert_close(collated["obs"], td["obs"][:4])


def test_a_dataloader_over_a_tensorclass_reads_each_batch_in_one_index():
    """Without ``__getitems__`` a DataLoader read a tensorclass row by row; with
    ``collate_fn=lambda x: x`` its batch was a list of rows (tensordict: one instance)."""
    from torch.utils.data import DataLoader

    @shared_td.tensorclass
    class Rows:
        obs: torch.Tensor

    data = Rows(obs=torch.arange(8.0), batch_size=[8])
    batches = list(DataLoader(data, batch_size=4, collate_fn=lambda batch: batch))
    assert [type(b) for b in batches] == [Rows, Rows]
    assert batches[1].obs.tolist() == [4.0, 5.0, 6.0, 7.0]


# ---------------------------------------------------------------- 6. a leaf changed in place
def _move_storage(leaf, how):
    """Change ``leaf``'s storage in place: the same tensor object, the same shape."""
    if how == "share_memory_":
        leaf.share_memory_()
    elif how == "pickler":  # what every multiprocessing Queue.put of the leaf does to it
        import importlib
        import io
        from multiprocessing.reduction import ForkingPickler

        importlib.import_module("torch.multiprocessing")  # (which registers torch's reductions)
        ForkingPickler(io.BytesIO()).dump(leaf)
    elif how == "set_":
        leaf.set_(leaf.clone())
    else:
        leaf.data = leaf.clone()


MOVES = ["share_memory_", "pickler", "set_", "data"]


@pytest.mark.parametrize("how", MOVES)
@pytest.mark.parametrize("rows", [slice(2, 4), torch.tensor([2, 3])], ids=["slice", "tensor"])
def test_a_source_in_a_leaf_whose_storage_moved_is_refused_before_anything_is_written(how, rows):
    """The plan kept the leaf's old storage range: the view of the moved leaf passed the
    fast lane's overlap check, and torch refused it after 'a' was written."""
    td = TensorDict(a=torch.zeros(6), b=torch.arange(6.0), batch_size=[6])
    td[0:2] = TensorDict(a=torch.ones(2), b=torch.ones(2), batch_size=[2])  # plans the fast lane
    _move_storage(td["b"], how)
    before = plain(td)
    with pytest.raises(RuntimeError, match="'b'"):
        td[rows] = TensorDict(a=torch.full((2,), 7.0), b=td["b"][1:3], batch_size=[2])
    after = plain(td)
    assert all(torch.equal(before[key], after[key]) for key in before)  # nothing written


@pytest.mark.parametrize("how", MOVES)
def test_the_fast_lane_writes_into_a_leaf_whose_storage_moved(how):
    td = TensorDict(a=torch.zeros(6), b=torch.zeros(6), batch_size=[6])
    td[0:2] = TensorDict(a=torch.ones(2), b=torch.ones(2), batch_size=[2])
    old_plan = td._row_write_plan
    _move_storage(td["b"], how)
    td[2:4] = TensorDict(a=torch.full((2,), 7.0), b=td["a"][2:4] + 3, batch_size=[2])
    assert td["a"].tolist() == [1, 1, 7, 7, 0, 0] and td["b"].tolist() == [1, 1, 3, 3, 0, 0]
    assert td._row_write_plan is not None and td._row_write_plan is not old_plan  # planned again


@pytest.mark.parametrize("rows", [torch.tensor([2, 3]), [2, 3], slice(2, 4)], ids=["tensor", "list", "slice"])
@pytest.mark.parametrize("new_dtype", [torch.float64, torch.int32], ids=["float64", "int32 view"])
def test_a_leaf_whose_dtype_changed_in_place_is_written_as_tensordict_writes_it(rows, new_dtype):
    """``leaf.data = ...`` of another dtype (a new storage, or a view of the same one):
    the plan cast the source to the old dtype, and torch's index_put_ refused it after
    'a' was written. Now as tensordict (which plans nothing)."""
    results = []
    for lib in (shared_td, tensordict):
        td = lib.TensorDict(a=torch.zeros(6), b=torch.zeros(6), batch_size=[6])
        td[torch.tensor([0, 1])] = lib.TensorDict(a=torch.ones(2), b=torch.ones(2), batch_size=[2])
        leaf = td["b"]
        leaf.data = leaf.to(torch.float64) if new_dtype == torch.float64 else leaf.view(torch.int32)
        td[rows] = lib.TensorDict(a=torch.full((2,), 7.0), b=torch.ones(2, dtype=new_dtype), batch_size=[2])
        results.append(td)
    assert results[0]["b"].dtype == new_dtype
    assert_same(*results)
