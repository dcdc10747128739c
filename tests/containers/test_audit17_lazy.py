"""Session-17 differential audit, lazy stacks: each test failed before its fix.

* In-place writes into a stack of lazy stacks (``set_``, ``update_``,
  ``update(inplace=True)``, ``set(inplace=True)``, ``apply_``, ``copy_``, and ``update``
  adding a key with a locked inner member) checked the outer members only: the first
  inner stack was written, then the second raised. Every member is now checked, a lazy
  member's own members too, before any member is written.
* The same for a member loaded with ``load_memmap(mode="r")`` (a ReadOnlyError after
  member 0 was written), and for ``TensorDict(a=writable, b=read_only).update_(...)``.
* ``share_memory_()`` of a lazy stack with a member holding an unpicklable value shared
  (and locked) member 0 before it raised; ``is_shared()`` then raised "shared status
  mismatch". It is checked for the whole stack first now.
* ``permute``/``transpose`` of members without batch dims holding a 0-dim leaf raised a
  TypeError (``tensor.permute(*())``).
* An empty selection (``outer[2:]``) of a stack of lazy stacks with ragged inner entries
  raised "Failed to stack tensors"; it is an empty lazy stack, as in tensordict.
* ``lazy_stack`` of NonTensorData / NonTensorStack items is a NonTensorStack.
* ``td[mask0, mask1]`` keeps no dim name for the merged dim.
"""
from __future__ import annotations

import threading

import pytest
import torch

import shared_td as st

tdict = pytest.importorskip("tensordict")

LIBS = [st, tdict]


def _nested(L):
    """A stack of two lazy stacks whose "x" is [2] in the first, [3] in the second."""
    lazy = L.LazyStackedTensorDict.lazy_stack
    in1 = lazy([L.TensorDict(x=torch.zeros(2)), L.TensorDict(x=torch.zeros(2))], 0)
    in2 = lazy([L.TensorDict(x=torch.zeros(3)), L.TensorDict(x=torch.zeros(3))], 0)
    return in1, in2, lazy([in1, in2], 0)


NESTED_WRITES = {
    "set_": lambda L, outer, v: outer.set_("x", v),
    "update_": lambda L, outer, v: outer.update_({"x": v}),
    "update(inplace=True)": lambda L, outer, v: outer.update({"x": v}, inplace=True),
    "set(inplace=True)": lambda L, outer, v: outer.set("x", v, inplace=True),
    "apply_": lambda L, outer, v: outer.apply_(lambda t: torch.ones(2) if t.shape[-1] == 2 else torch.ones(4)),
    "copy_": lambda L, outer, v: outer.copy_(L.LazyStackedTensorDict.lazy_stack(
        [outer.tensordicts[0].clone().apply_(lambda t: t.fill_(1)),
         L.LazyStackedTensorDict.lazy_stack([L.TensorDict(x=torch.ones(2)), L.TensorDict(x=torch.ones(2))], 0)], 0)),
}


@pytest.mark.parametrize("name", list(NESTED_WRITES))
def test_nested_lazy_in_place_write_is_all_or_nothing(name):
    in1, in2, outer = _nested(st)
    with pytest.raises((RuntimeError, ValueError)):
        NESTED_WRITES[name](st, outer, torch.ones(2, 2, 2))
    assert in1.tensordicts[0]["x"].tolist() == [0.0, 0.0]  # (was [1.0, 1.0]: half written)
    assert in2.tensordicts[0]["x"].tolist() == [0.0, 0.0, 0.0]
    # tensordict 0.15.3 raises too (it half-writes for most of them)
    with pytest.raises(Exception):
        NESTED_WRITES[name](tdict, _nested(tdict)[2], torch.ones(2, 2, 2))


def test_nested_lazy_fitting_write_still_writes():
    lazy = st.LazyStackedTensorDict.lazy_stack
    in1 = lazy([st.TensorDict(x=torch.zeros(2)), st.TensorDict(x=torch.zeros(2))], 0)
    outer = lazy([in1, in1.clone()], 0)
    outer.set_("x", torch.ones(2, 2, 2))
    outer.update_({"x": torch.full((2, 2, 2), 2.0)})
    assert in1.tensordicts[1]["x"].tolist() == [2.0, 2.0]
    outer.apply_(lambda t: t + 1)
    assert outer.get("x").unique().tolist() == [3.0]


@pytest.mark.parametrize("L", LIBS, ids=["shared_td", "tensordict"])
def test_nested_lazy_update_adding_key_with_locked_inner_member(L):
    lazy = L.LazyStackedTensorDict.lazy_stack
    in1 = lazy([L.TensorDict(x=torch.zeros(2)), L.TensorDict(x=torch.zeros(2))], 0)
    in2 = lazy([L.TensorDict(x=torch.zeros(2)), L.TensorDict(x=torch.zeros(2)).lock_()], 0)
    outer = lazy([in1, in2], 0)
    with pytest.raises(RuntimeError):
        outer.update({"y": torch.ones(2, 2, 2)})
    if L is st:  # (tensordict 0.15.3 adds "y" to in1's members first)
        assert sorted(in1.tensordicts[0].keys()) == ["x"]


@pytest.fixture
def read_only_dir(tmp_path):
    st.TensorDict(x=torch.zeros(2), n=st.TensorDict(y=torch.zeros(2), batch_size=[2]),
                  s=st.NonTensorData("old"), batch_size=[2]).memmap(tmp_path)
    return tmp_path


READ_ONLY_WRITES = {
    "set_": lambda lz: lz.set_("x", torch.ones(2, 2)),
    "update_": lambda lz: lz.update_({"x": torch.ones(2, 2)}),
    "update(inplace=True)": lambda lz: lz.update({"x": torch.ones(2, 2)}, inplace=True),
    "set(inplace=True)": lambda lz: lz.set("x", torch.ones(2, 2), inplace=True),
    "apply_": lambda lz: lz.apply_(lambda t: t + 1),
    "copy_": lambda lz: lz.copy_(lz.clone().apply_(lambda t: t.fill_(1))),
    "set_ nested": lambda lz: lz.set_(("n", "y"), torch.ones(2, 2)),
    "set_ non-tensor": lambda lz: lz.set_("s", "new"),
    "update_ non-tensor": lambda lz: lz.update_({"s": "new"}),
    "set(inplace=True) non-tensor": lambda lz: lz.set("s", "new", inplace=True),
}


@pytest.mark.parametrize("name", list(READ_ONLY_WRITES))
def test_lazy_in_place_write_with_read_only_member_writes_nothing(read_only_dir, name):
    a = st.TensorDict(x=torch.zeros(2), n=st.TensorDict(y=torch.zeros(2), batch_size=[2]),
                      s=st.NonTensorData("old"), batch_size=[2])
    b = st.TensorDict.load_memmap(read_only_dir, mode="r")
    lz = st.LazyStackedTensorDict.lazy_stack([a, b], 0)
    with pytest.raises(st.ReadOnlyError):
        READ_ONLY_WRITES[name](lz)
    assert a["x"].tolist() == [0.0, 0.0] and a["n", "y"].tolist() == [0.0, 0.0] and a["s"] == "old"


def test_tensordict_update_with_read_only_child_writes_nothing(read_only_dir):
    a = st.TensorDict(x=torch.zeros(2), batch_size=[2])
    outer = st.TensorDict(a=a, b=st.TensorDict.load_memmap(read_only_dir, mode="r"), batch_size=[2])
    with pytest.raises(st.ReadOnlyError):
        outer.update_({"a": {"x": torch.ones(2)}, "b": {"x": torch.ones(2)}})
    assert a["x"].tolist() == [0.0, 0.0]
    td = st.TensorDict.load_memmap(read_only_dir, mode="r")
    td.set("a_new", torch.zeros(2))  # a writable entry beside the read-only ones
    with pytest.raises(st.ReadOnlyError):
        td.update_({"a_new": torch.ones(2), "x": torch.ones(2)})
    assert td["a_new"].tolist() == [0.0, 0.0]


def test_lazy_share_memory_with_unpicklable_member_changes_nothing():
    a = st.TensorDict(x=torch.zeros(2), batch_size=[2])
    b = st.TensorDict(x=torch.zeros(2), t=st.NonTensorData(threading.Lock()), batch_size=[2])
    lz = st.LazyStackedTensorDict.lazy_stack([a, b], 0)
    with pytest.raises(TypeError, match="share_memory_"):
        lz.share_memory_()
    assert not a.is_shared() and not a.is_locked and not lz.is_locked
    assert lz.is_shared() is False  # (raised "shared status mismatch")


def test_lazy_share_memory_refuses_a_memory_mapped_nested_node(tmp_path):
    inner = st.TensorDict(y=torch.zeros(2), batch_size=[2]).memmap_(tmp_path)
    a = st.TensorDict(x=torch.zeros(2), batch_size=[2])
    b = st.TensorDict(x=torch.zeros(2), n=inner, batch_size=[2])
    lz = st.LazyStackedTensorDict.lazy_stack([a, b], 0)
    with pytest.raises(RuntimeError, match="memory-mapped"):
        lz.share_memory_()
    assert not a.is_shared() and not a.is_locked


def _scalar_stack(L):
    return L.LazyStackedTensorDict.lazy_stack([L.TensorDict(r=torch.tensor(1.0)), L.TensorDict(r=torch.tensor(2.0))], 0)


@pytest.mark.parametrize("L", LIBS, ids=["shared_td", "tensordict"])
def test_permute_with_scalar_leaves(L):
    assert _scalar_stack(L).permute(0)["r"].tolist() == [1.0, 2.0]
    assert L.TensorDict(r=torch.tensor(1.0)).permute(dims=[])["r"].item() == 1.0
    episode = lambda: L.LazyStackedTensorDict.lazy_stack(  # noqa: E731
        [L.TensorDict(reward=torch.tensor(float(i))) for i in range(3)], 0)
    batch = L.LazyStackedTensorDict.lazy_stack([episode(), episode()], 0)  # a batch of rollouts
    swapped = batch.transpose(0, 1)
    assert swapped.batch_size == torch.Size([3, 2])
    assert swapped["reward"].tolist() == [[0.0, 0.0], [1.0, 1.0], [2.0, 2.0]]


@pytest.mark.parametrize("L", LIBS, ids=["shared_td", "tensordict"])
def test_permute_with_scalar_non_tensor(L):
    lz = L.LazyStackedTensorDict.lazy_stack([L.TensorDict(s=L.NonTensorData("a")),
                                             L.TensorDict(s=L.NonTensorData("b"))], 0)
    assert list(lz.permute(0)["s"]) == ["a", "b"]
    assert L.NonTensorStack("a", "b").permute(0).tolist() == ["a", "b"]
    assert L.NonTensorData("a").permute(dims=[]).data == "a"


@pytest.mark.parametrize("L", LIBS, ids=["shared_td", "tensordict"])
@pytest.mark.parametrize("index", [slice(2, None), torch.tensor([False, False])], ids=["slice", "mask"])
def test_empty_selection_of_nested_ragged_lazy(L, index):
    inner = L.LazyStackedTensorDict.lazy_stack(
        [L.TensorDict(h=torch.zeros(1), x=torch.zeros(())), L.TensorDict(h=torch.zeros(2), x=torch.zeros(()))], 0)
    outer = L.LazyStackedTensorDict.lazy_stack([inner, inner.clone()], 0)
    outer.names = ["env", "agent"]
    empty = outer[index]
    assert empty.batch_size == torch.Size([0, 2]) and empty.names == ["env", "agent"]
    assert sorted(empty.keys()) == ["h", "x"]
    assert empty["x"].shape == torch.Size([0, 2])


@pytest.mark.parametrize("L", LIBS, ids=["shared_td", "tensordict"])
def test_lazy_stack_of_non_tensors(L):
    r = L.lazy_stack([L.NonTensorData("a"), L.NonTensorData("b")])
    assert type(r).__name__ == "NonTensorStack" and r.tolist() == ["a", "b"]
    r = L.lazy_stack([L.NonTensorStack("a", "b"), L.NonTensorStack("c", "d")])
    assert type(r).__name__ == "NonTensorStack" and r.tolist() == [["a", "b"], ["c", "d"]]
    r = L.LazyStackedTensorDict.lazy_stack([L.NonTensorData("a"), L.NonTensorData("b")], 0)
    assert r.tolist() == ["a", "b"]


@pytest.mark.parametrize("masks", [([False, True], [False, True]), ([True, True], [True, False]),
                                   ([False, True], [False, False])])
def test_two_masks_leave_no_dim_name(masks):
    results = []
    for L in LIBS:
        td = L.TensorDict(a=torch.zeros(2, 2, 4), batch_size=[2, 2, 4], names=["d0", "d1", "d2"])
        results.append(td[torch.tensor(masks[0]), torch.tensor(masks[1])].names)
    assert results[0] == results[1] == [None, "d2"]
