"""LazyStackedTensorDict: members kept as they are, reads stack, writes reach the members."""
from __future__ import annotations

import multiprocessing
import pickle
from multiprocessing.reduction import ForkingPickler

import pytest
import torch
import torch.multiprocessing  # noqa: F401  (registers the shared-memory reductions)

from shared_td import LockedTensorDictError, NonTensorStack, TensorDict, is_leaf_nontensor
from shared_td.containers.lazy import LazyStackedTensorDict
from shared_td.errors import BatchSizeMismatchError


def td(batch=(3,), **entries):
    return TensorDict(entries, batch_size=list(batch))


def hetero():
    """Two members of batch [3]: ``a`` is [3, 2] in one and [3, 4] in the other."""
    return LazyStackedTensorDict(
        td(a=torch.zeros(3, 2), b=torch.arange(3.), n={"x": torch.zeros(3, 1)}, t="foo"),
        td(a=torch.ones(3, 4), b=torch.arange(3.) + 10, n={"x": torch.ones(3, 1)}, t="bar"),
    )


def homo(stack_dim=0):
    """Two members of batch [3] with equal shapes, stacked along ``stack_dim``."""
    members = [td(a=torch.arange(6.).reshape(3, 2) + 10 * i, n={"x": torch.full((3,), float(i))}) for i in range(2)]
    return LazyStackedTensorDict(*members, stack_dim=stack_dim)


# ---------------------------------------------------------------- construction
class TestConstruction:
    def test_members_are_kept_and_batch_size(self):
        m0, m1 = td(a=torch.zeros(3, 2)), td(a=torch.zeros(3, 5))
        lazy = LazyStackedTensorDict(m0, m1, stack_dim=1)
        assert lazy.tensordicts[0] is m0 and lazy.tensordicts[1] is m1
        assert lazy.batch_size == torch.Size([3, 2]) and lazy.shape == (3, 2)
        assert lazy.stack_dim == 1 and lazy.batch_dims == 2
        assert lazy.numel() == 6 and len(lazy) == 3
        assert lazy.device is None and lazy.names is None

    def test_negative_stack_dim_is_normalized(self):
        assert LazyStackedTensorDict(td(), td(), stack_dim=-1).stack_dim == 1
        assert LazyStackedTensorDict(td(), td(), stack_dim=-2).stack_dim == 0
        assert LazyStackedTensorDict.lazy_stack([td(), td()], -1).stack_dim == 1

    def test_stack_dim_out_of_range(self):
        with pytest.raises(IndexError, match="stack_dim=2"):
            LazyStackedTensorDict(td(), td(), stack_dim=2)
        with pytest.raises(IndexError, match="stack_dim=-3"):
            LazyStackedTensorDict(td(), td(), stack_dim=-3)

    def test_batch_size_mismatch_names_index_and_sizes(self):
        with pytest.raises(BatchSizeMismatchError, match=r"item 0 has batch_size \[3\] but item 2 has \[4\]"):
            LazyStackedTensorDict(td(), td(), td(batch=(4,)))
        with pytest.raises(RuntimeError):  # tensordict code catching RuntimeError still works
            LazyStackedTensorDict(td(), td(batch=(2,)))

    def test_not_a_tensordict(self):
        with pytest.raises(TypeError, match="item 1 is a Tensor"):
            LazyStackedTensorDict(td(), torch.zeros(3))

    def test_lazy_stack_classmethod(self):
        items = [td(a=torch.zeros(3)), td(a=torch.ones(3))]
        lazy = LazyStackedTensorDict.lazy_stack(items, dim=1)
        assert isinstance(lazy, LazyStackedTensorDict) and lazy.batch_size == (3, 2)
        assert lazy.tensordicts[1] is items[1]
        with pytest.raises(RuntimeError, match="cannot be empty"):
            LazyStackedTensorDict.lazy_stack([])

    def test_empty_stack(self):
        lazy = LazyStackedTensorDict()
        assert lazy.batch_size == torch.Size([0]) and list(lazy.keys()) == []
        assert lazy.is_empty()

    def test_device_common_or_none(self):
        lazy = LazyStackedTensorDict(td(a=torch.zeros(3)).to("cpu"), td(a=torch.zeros(3)).to("cpu"))
        assert lazy.device == torch.device("cpu")
        assert LazyStackedTensorDict(td(a=torch.zeros(3)).to("cpu"), td(a=torch.zeros(3))).device is None

    def test_names_from_members(self):
        named = [TensorDict(batch_size=[3], names=["x"]) for _ in range(2)]
        assert LazyStackedTensorDict(*named, stack_dim=1).names == ["x", None]

    def test_heterogeneous_tensordicts_stack_lazily_only_when_asked(self):
        # torch.stack raises, as tensordict 0.15.3 (it returned a lazy stack before)
        m0, m1 = td(a=torch.zeros(3, 2)), td(a=torch.zeros(3, 4))
        with pytest.raises(RuntimeError, match="'a'"):
            torch.stack([m0, m1], 1)
        lazy = LazyStackedTensorDict.lazy_stack([m0, m1], 1)
        assert isinstance(lazy, LazyStackedTensorDict)
        assert lazy.stack_dim == 1 and lazy.tensordicts[0] is m0


# ---------------------------------------------------------------- keys and reads
class TestRead:
    def test_keys(self):
        lazy = hetero()
        assert list(lazy.keys()) == ["a", "b", "n", "t"]
        assert list(lazy.keys(include_nested=True, leaves_only=True)) == ["a", "b", ("n", "x")]
        assert list(lazy.keys(True, True, is_leaf_nontensor)) == ["a", "b", ("n", "x"), "t"]
        assert ("n", "x") in lazy.keys(include_nested=True)
        assert "a" in lazy and ("n", "x") in lazy and "zz" not in lazy
        with pytest.raises(TypeError):
            _ = 3 in lazy

    def test_keys_are_the_common_ones(self):
        lazy = LazyStackedTensorDict(td(a=torch.zeros(3), b=torch.zeros(3)), td(a=torch.zeros(3), c=torch.zeros(3)))
        assert list(lazy.keys()) == ["a"] and "b" not in lazy
        with pytest.raises(KeyError, match="'b' not found"):
            lazy["b"]
        assert lazy.get("b") is None and lazy.get("b", "dflt") == "dflt"
        assert "exclusive_fields={0: {b: f32[]}, 1: {c: f32[]}}" in repr(lazy)

    def test_get_equal_shapes_stacks_a_copy(self):
        lazy = homo(stack_dim=1)
        value = lazy.get("a")
        assert value.shape == (3, 2, 2)
        assert torch.equal(value, torch.stack([m["a"] for m in lazy.tensordicts], 1))
        value.zero_()
        assert lazy.tensordicts[1]["a"].sum() > 0  # a copy, as in tensordict
        assert torch.equal(lazy["a"], torch.stack([m["a"] for m in lazy.tensordicts], 1))
        assert lazy["n", "x"].shape == (3, 2)

    def test_get_heterogeneous_raises(self):
        lazy = hetero()
        for read in (lambda: lazy.get("a"), lambda: lazy["a"], lazy.to_tensordict, lazy.contiguous, lazy.to_dict):
            with pytest.raises(RuntimeError, match=r"under the key 'a'.*as_list=True"):
                read()

    def test_get_as_list(self):
        lazy = hetero()
        values = lazy.get("a", as_list=True)
        assert [v.shape for v in values] == [(3, 2), (3, 4)]
        assert values[0] is lazy.tensordicts[0]["a"]

    def test_get_as_padded_tensor(self):
        lazy = hetero()
        padded = lazy.get("a", as_padded_tensor=True, padding_value=-1)
        assert padded.shape == (2, 3, 4)
        assert torch.equal(padded[0, :, :2], torch.zeros(3, 2)) and (padded[0, :, 2:] == -1).all()
        left = lazy.get("a", as_padded_tensor=True, padding_side="left")
        assert (left[0, :, :2] == 0).all() and torch.equal(left[1], torch.ones(3, 4))

    def test_get_as_nested_tensor(self):
        nested = hetero().get("a", as_nested_tensor=True)
        assert nested.is_nested
        assert [t.shape for t in nested.unbind()] == [(3, 2), (3, 4)]

    def test_missing_key(self):
        with pytest.raises(KeyError, match="'zz' not found"):
            hetero()["zz"]
        assert hetero().get("zz") is None and hetero().get("zz", as_list=True) is None

    def test_nested_is_lazy_stack_of_children(self):
        lazy = hetero()
        child = lazy.get("n")
        assert isinstance(child, LazyStackedTensorDict) and child.batch_size == (2, 3)
        assert child.tensordicts[0] is lazy.tensordicts[0]["n"]
        child.set_("x", torch.full((2, 3, 1), 7.0))
        assert (lazy.tensordicts[1]["n", "x"] == 7).all()

    def test_non_tensor(self):
        lazy = hetero()
        stack = lazy.get("t")
        assert isinstance(stack, NonTensorStack) and stack.batch_size == (2, 3)
        assert lazy["t"] == [["foo"] * 3, ["bar"] * 3]
        assert lazy[1]["t"] == "bar"

    def test_nested_heterogeneous_leaf(self):
        lazy = LazyStackedTensorDict(td(n={"x": torch.zeros(3, 2)}), td(n={"x": torch.zeros(3, 5)}))
        with pytest.raises(RuntimeError, match=r"\('n', 'x'\)"):
            lazy.get(("n", "x"))
        assert [v.shape[-1] for v in lazy.get(("n", "x"), as_list=True)] == [2, 5]

    def test_items_values_iteration(self):
        lazy = homo()
        assert [k for k, _ in lazy.items()] == ["a", "n"]
        assert list(lazy.values())[0].shape == (2, 3, 2)
        members = list(lazy)
        assert members[0] is lazy.tensordicts[0] and members[1] is lazy.tensordicts[1]
        rows = list(homo(stack_dim=1))
        assert len(rows) == 3 and isinstance(rows[0], LazyStackedTensorDict) and rows[0].batch_size == (2,)

    def test_to_dict_and_is_empty(self):
        out = homo().to_dict()
        assert out["a"].shape == (2, 3, 2) and out["n"]["x"].shape == (2, 3)
        assert not homo().is_empty()
        assert LazyStackedTensorDict(td(n={}), td(n={})).is_empty()

    def test_nested_lazy_members(self):
        inner = [hetero(), hetero()]
        outer = LazyStackedTensorDict(*inner, stack_dim=0)
        assert outer.batch_size == (2, 2, 3)
        assert outer[1] is inner[1] and outer[1, 0] is inner[1].tensordicts[0]
        assert outer["b"].shape == (2, 2, 3)
        with pytest.raises(RuntimeError, match="'a'"):
            outer.get("a")
        assert "a: f32[-1]" in repr(outer)


# ---------------------------------------------------------------- indexing
class TestIndex:
    def test_int_at_stack_dim_is_the_member(self):
        lazy = hetero()
        assert lazy[0] is lazy.tensordicts[0]
        assert lazy[-1] is lazy.tensordicts[1]
        assert lazy[1, ...] is lazy.tensordicts[1]
        s1 = homo(stack_dim=1)
        assert s1[:, 0] is s1.tensordicts[0] and s1[..., 1] is s1.tensordicts[1]

    def test_int_plus_other_dims(self):
        lazy = hetero()
        sub = lazy[1, 2]
        assert isinstance(sub, TensorDict) and sub.batch_size == ()
        assert torch.equal(sub["a"], torch.ones(4))
        sub.set_("b", torch.tensor(-5.0))  # a view: reaches the member
        assert lazy.tensordicts[1]["b"][2] == -5

    def test_slice_and_list_at_stack_dim_select_members(self):
        members = [td(a=torch.full((3,), float(i))) for i in range(4)]
        lazy = LazyStackedTensorDict(*members)
        part = lazy[1:3]
        assert isinstance(part, LazyStackedTensorDict) and part.batch_size == (2, 3)
        assert part.tensordicts[0] is members[1] and part.tensordicts[1] is members[2]
        picked = lazy[[3, 0]]
        assert [m is x for m, x in zip(picked.tensordicts, [members[3], members[0]])] == [True, True]
        masked = lazy[torch.tensor([True, False, False, True])]
        assert masked.tensordicts[0] is members[0] and masked.tensordicts[1] is members[3]
        assert lazy[::2].tensordicts[1] is members[2]
        assert lazy[2:2].batch_size == (0, 3)

    def test_index_other_dims_gives_lazy_views(self):
        lazy = homo(stack_dim=0)
        rows = lazy[:, 1:]
        assert isinstance(rows, LazyStackedTensorDict) and rows.batch_size == (2, 2) and rows.stack_dim == 0
        rows.set_("a", torch.full((2, 2, 2), -1.0))
        assert (lazy.tensordicts[0]["a"][1:] == -1).all() and (lazy.tensordicts[0]["a"][0] != -1).all()
        col = lazy[:, 2]
        assert col.batch_size == (2,) and torch.equal(col["a"], lazy["a"][:, 2])

    def test_stack_dim_moves_with_index(self):
        lazy = homo(stack_dim=1)
        out = lazy[0]
        assert isinstance(out, LazyStackedTensorDict) and out.stack_dim == 0 and out.batch_size == (2,)
        assert torch.equal(out["a"], lazy["a"][0])
        out = lazy[None]
        assert out.batch_size == (1, 3, 2) and out.stack_dim == 2
        out = lazy[[2, 0]]
        assert out.batch_size == (2, 2) and out.stack_dim == 1 and torch.equal(out["a"], lazy["a"][[2, 0]])
        out = lazy[torch.tensor([True, False, True])]
        assert torch.equal(out["a"], lazy["a"][torch.tensor([True, False, True])])

    @pytest.mark.parametrize("stack_dim", [0, 1, 2])
    @pytest.mark.parametrize(
        "index",
        [
            (slice(None), 1), (..., 0), (1, slice(0, 2)), (None, 0), ([0, 1], slice(None), 1),
            (slice(None), [1, 0]), (0, [1, 1], 0), (torch.ones(2, 3, 4, dtype=torch.bool),),
            (torch.tensor([[True, False, True], [False, True, True]]),), ([1, 0], [2, 0]),
            (slice(None), slice(None), [3, 0]), (0, slice(None), [1, 2]), ([0, 1], 0, [1, 2]),
            (True,), (slice(1, None), None, ..., -1),
        ],
    )
    def test_index_matches_dense(self, stack_dim, index):
        dense = td(batch=(2, 3, 4), a=torch.randn(2, 3, 4, 5), n={"x": torch.randn(2, 3, 4)})
        lazy = LazyStackedTensorDict(*dense.unbind(stack_dim), stack_dim=stack_dim)
        expected = dense[index]
        out = lazy[index]
        assert out.batch_size == expected.batch_size
        assert torch.equal(out["a"], expected["a"]) and torch.equal(out["n", "x"], expected["n", "x"])

    def test_out_of_range(self):
        lazy = homo(stack_dim=1)
        with pytest.raises(IndexError, match=r"batch size \[3, 2\]"):
            lazy[:, 5]
        with pytest.raises(IndexError, match=r"batch size \[3, 2\]"):
            lazy[3]
        with pytest.raises(IndexError, match="Too many indices"):
            lazy[0, 0, 0]


# ---------------------------------------------------------------- writes
class TestWrite:
    def test_set_splits_into_members(self):
        lazy = homo(stack_dim=1)
        value = torch.arange(18.).reshape(3, 2, 3)
        lazy.set("new", value)
        assert torch.equal(lazy.tensordicts[1]["new"], value[:, 1])
        lazy["a"] = torch.zeros(3, 2, 7)  # replaces the entries (a new feature shape)
        assert lazy.tensordicts[0]["a"].shape == (3, 7)

    def test_set_nested_key_creates_children_in_members(self):
        lazy = hetero()
        lazy.set(("m", "y"), torch.ones(2, 3))
        assert torch.equal(lazy.tensordicts[1]["m", "y"], torch.ones(3))
        lazy["task"] = "walk"
        assert lazy.tensordicts[0]["task"] == "walk" and lazy["task"] == [["walk"] * 3] * 2

    def test_set_dict(self):
        lazy = hetero()
        lazy.set("d", {"z": torch.zeros(2, 3, 6)})
        assert lazy.tensordicts[1]["d", "z"].shape == (3, 6)

    def test_set_wrong_batch(self, unchanged):
        lazy = homo()
        with unchanged(lazy), pytest.raises(BatchSizeMismatchError, match=r"shape \[3, 2\].*batch_size \[2, 3\]"):
            lazy.set("a", torch.zeros(3, 2))

    def test_set_in_place(self):
        lazy = hetero()
        lazy.set_("b", torch.full((2, 3), 4.0))
        assert (lazy.tensordicts[0]["b"] == 4).all() and (lazy.tensordicts[1]["b"] == 4).all()
        before = lazy.tensordicts[1]["b"]
        lazy.set_("b", torch.zeros(2, 3))
        assert lazy.tensordicts[1]["b"] is before  # same storage, written in place

    def test_set_in_place_wrong_shape_leaves_all_members(self, unchanged):
        lazy = homo()
        with unchanged(lazy.tensordicts[0]), unchanged(lazy.tensordicts[1]), pytest.raises(
            BatchSizeMismatchError, match="in place"
        ):
            lazy.set_("a", torch.zeros(2, 3, 5))
        with pytest.raises(KeyError, match="does not exist"):
            lazy.set_("zz", torch.zeros(2, 3))

    def test_update_(self):
        lazy = homo()
        lazy.update_({"a": torch.ones(2, 3, 2), "n": {"x": torch.full((2, 3), 3.0)}})
        assert (lazy.tensordicts[1]["a"] == 1).all() and (lazy.tensordicts[0]["n", "x"] == 3).all()
        with pytest.raises(KeyError, match="'zz'"):
            lazy.update_({"zz": torch.ones(2, 3)})
        other = hetero().clone()
        other.get("n").set_("x", torch.full((2, 3, 1), 9.0))
        target = hetero()
        target.update_(other)  # the same layout: member-wise, heterogeneous shapes fine
        assert (target.tensordicts[1]["n", "x"] == 9).all()

    def test_update(self):
        lazy = hetero()
        lazy.update({"c": torch.ones(2, 3), "n": {"w": torch.zeros(2, 3)}, "a": torch.zeros(2, 3, 6)})
        assert "c" in lazy.tensordicts[0].keys() and ("n", "w") in lazy.tensordicts[1].keys(True)
        assert lazy.tensordicts[0]["a"].shape == (3, 6) and ("n", "x") in lazy.tensordicts[1].keys(True)

    def test_update_failures_leave_members(self, unchanged):
        lazy = homo()
        members = lazy.tensordicts
        with unchanged(members[0]), unchanged(members[1]), pytest.raises(BatchSizeMismatchError, match="'a'"):
            lazy.update_({"n": {"x": torch.ones(2, 3)}, "a": torch.ones(2, 3, 5)})
        with unchanged(members[0]), unchanged(members[1]), pytest.raises(BatchSizeMismatchError, match=r"\[2, 3\]"):
            lazy.update({"b": torch.ones(3, 3)})
        members[1].lock_()
        with unchanged(members[0]), unchanged(members[1]), pytest.raises(LockedTensorDictError, match="'b'"):
            lazy.update({"b": torch.ones(2, 3)})
        with unchanged(members[0]), unchanged(members[1]), pytest.raises(LockedTensorDictError, match="replace"):
            lazy.update({"a": torch.ones(2, 3, 2)})
        lazy.update({"a": torch.ones(2, 3, 2)}, inplace=True)
        assert (members[0]["a"] == 1).all()

    def test_setitem_int_writes_the_member(self):
        lazy = homo()
        lazy[1] = td(a=torch.full((3, 2), 5.0), n={"x": torch.zeros(3)})
        assert (lazy.tensordicts[1]["a"] == 5).all()
        assert torch.equal(lazy.tensordicts[0]["a"], homo().tensordicts[0]["a"])

    def test_setitem_other_dims_and_dict(self):
        lazy = homo(stack_dim=0)
        lazy[:, 0] = td(batch=(2,), a=torch.full((2, 2), 7.0), n={"x": torch.zeros(2)})
        assert (lazy.tensordicts[0]["a"][0] == 7).all() and (lazy.tensordicts[1]["a"][0] == 7).all()
        assert (lazy.tensordicts[1]["a"][1] != 7).all()
        lazy[0, 2] = {"a": torch.full((2,), 9.0)}
        assert (lazy.tensordicts[0]["a"][2] == 9).all() and (lazy.tensordicts[1]["a"][2] != 9).all()
        lazy[:, 1:] = 0
        assert (lazy["a"][:, 1:] == 0).all() and (lazy["a"][:, 0] == 7).all()

    def test_setitem_advanced_index(self):
        dense = td(batch=(2, 3), a=torch.zeros(2, 3, 2))
        lazy = LazyStackedTensorDict(*[m.clone() for m in dense.unbind(1)], stack_dim=1)
        mask = torch.tensor([[True, False, True], [False, True, False]])
        lazy[mask] = td(batch=(3,), a=torch.arange(6.).reshape(3, 2))
        dense[mask] = td(batch=(3,), a=torch.arange(6.).reshape(3, 2))
        assert torch.equal(lazy["a"], dense["a"])

    def test_setitem_heterogeneous(self):
        lazy = hetero()
        lazy[:, 1] = {"b": torch.full((2,), -1.0)}  # (a dict's values have the rows' batch dims)
        assert lazy.tensordicts[0]["b"][1] == -1 and lazy.tensordicts[1]["b"][1] == -1

    def test_setitem_wrong_shape_leaves_members(self, unchanged):
        lazy = homo()
        bad = td(batch=(2,), a=torch.zeros(2, 5))
        with unchanged(lazy), pytest.raises(BatchSizeMismatchError):
            lazy[:, 0] = bad

    def test_del(self):
        lazy = hetero()
        del lazy["b"]
        assert "b" not in lazy.tensordicts[0].keys() and "b" not in lazy.tensordicts[1].keys()
        assert lazy.pop("t") is not None and "t" not in lazy.tensordicts[1].keys()
        with pytest.raises(KeyError):
            del lazy["zz"]


# ---------------------------------------------------------------- locking and sharing
class TestLock:
    def test_lock_propagates(self):
        lazy = homo()
        assert lazy.lock_() is lazy and lazy.is_locked
        assert all(m.is_locked for m in lazy.tensordicts)
        with pytest.raises(RuntimeError, match="locked graph"):
            lazy.tensordicts[0].unlock_()
        lazy.unlock_()
        assert not lazy.is_locked and not any(m.is_locked for m in lazy.tensordicts)

    def test_locked_writes(self, unchanged):
        lazy = homo().lock_()
        with unchanged(lazy), pytest.raises(LockedTensorDictError, match="cannot add key 'zz'"):
            lazy.set("zz", torch.zeros(2, 3))
        with unchanged(lazy), pytest.raises(LockedTensorDictError, match="replace key 'a'"):
            lazy.set("a", torch.zeros(2, 3, 2))
        with unchanged(lazy), pytest.raises(LockedTensorDictError, match="remove"):
            del lazy["a"]
        lazy.set_("a", torch.ones(2, 3, 2))  # in place is allowed
        assert (lazy.tensordicts[1]["a"] == 1).all()
        with lazy.unlock_():
            lazy.set("zz", torch.zeros(2, 3))
        assert lazy.is_locked and "zz" in lazy.tensordicts[0].keys()

    def test_one_locked_member_refuses_set(self, unchanged):
        lazy = homo()
        lazy.tensordicts[1].lock_()
        assert not lazy.is_locked
        with unchanged(lazy.tensordicts[0]), pytest.raises(LockedTensorDictError):
            lazy.set("zz", torch.zeros(2, 3))
        assert "zz" not in lazy.tensordicts[0].keys()

    def test_all_locked_members(self):
        lazy = LazyStackedTensorDict(td(a=torch.zeros(3)).lock_(), td(a=torch.zeros(3)).lock_())
        assert lazy.is_locked

    def test_share_memory(self):
        lazy = homo()
        assert not lazy.is_shared() and not lazy.is_memmap()
        assert lazy.share_memory_() is lazy
        assert lazy.is_shared() and lazy.is_locked
        assert all(m["a"].is_shared() for m in lazy.tensordicts)

    def test_mixed_shared_raises(self):
        lazy = LazyStackedTensorDict(td(a=torch.zeros(3)), td(a=torch.zeros(3)).share_memory_())
        with pytest.raises(RuntimeError, match="shared status mismatch"):
            lazy.is_shared()


# ---------------------------------------------------------------- lazy results
class TestOps:
    def test_apply_named_apply(self):
        lazy = hetero()
        out = lazy.apply(lambda x: x + 1)
        assert isinstance(out, LazyStackedTensorDict) and out.stack_dim == 0
        assert torch.equal(out.tensordicts[1]["a"], torch.full((3, 4), 2.0))
        assert out["t"] == lazy["t"]
        seen = []
        lazy.named_apply(lambda key, x: seen.append(key), nested_keys=True)
        assert ("n", "x") in seen and "a" in seen
        lazy.apply(lambda x: x.zero_(), inplace=True)
        assert (lazy.tensordicts[1]["a"] == 0).all()

    def test_apply_with_others_and_batch_size(self):
        lazy = homo()
        summed = lazy.apply(lambda x, y: x + y, homo())
        assert torch.equal(summed["a"], 2 * homo()["a"])
        dense = lazy.apply(lambda x: x.sum(0), batch_size=[3])
        assert isinstance(dense, TensorDict) and torch.equal(dense["a"], homo()["a"].sum(0))

    def test_clone_to_cpu(self):
        lazy = hetero()
        copy = lazy.clone()
        assert isinstance(copy, LazyStackedTensorDict) and copy.tensordicts[0] is not lazy.tensordicts[0]
        copy.tensordicts[0]["b"].fill_(-3)
        assert (lazy.tensordicts[0]["b"] != -3).all()
        doubled = lazy.to(torch.float64)
        assert doubled.tensordicts[1]["a"].dtype == torch.float64
        assert lazy.cpu() is not None

    def test_contiguous_and_to_tensordict(self):
        lazy = homo(stack_dim=1)
        dense = lazy.contiguous()
        assert type(dense) is TensorDict and dense.batch_size == (3, 2)
        assert torch.equal(dense["a"], lazy["a"]) and type(dense["n"]) is TensorDict
        assert type(lazy.to_tensordict()) is TensorDict

    def test_unbind(self):
        lazy = homo(stack_dim=1)
        members = lazy.unbind(1)
        assert members[0] is lazy.tensordicts[0] and members[1] is lazy.tensordicts[1]
        assert torch.unbind(lazy, -1)[1] is lazy.tensordicts[1]
        rows = lazy.unbind(0)
        assert len(rows) == 3 and torch.equal(rows[2]["a"], lazy["a"][2])

    @pytest.mark.parametrize("stack_dim", [0, 1])
    def test_split_along_stack_dim_keeps_the_members(self, stack_dim):
        members = [td(a=torch.full((3, i + 1), float(i))) for i in range(4)]  # ragged "a"
        lazy = LazyStackedTensorDict(*members, stack_dim=stack_dim)
        for pieces, sizes in [(lazy.split(3, stack_dim), [3, 1]), (lazy.split([1, 3], stack_dim), [1, 3]),
                              (torch.split(lazy, 2, stack_dim - 2), [2, 2])]:
            assert [p.batch_size[stack_dim] for p in pieces] == sizes
            assert all(isinstance(p, LazyStackedTensorDict) and p.stack_dim == stack_dim for p in pieces)
            joined = [m for p in pieces for m in p.tensordicts]
            assert len(joined) == len(members) and all(a is b for a, b in zip(joined, members))

    @pytest.mark.parametrize("stack_dim", [0, 1])
    def test_split_along_another_dim_gives_views(self, stack_dim):
        lazy = homo(stack_dim=stack_dim)
        dim = 1 - stack_dim  # the members' batch dim of size 3
        pieces = lazy.split([2, 1], dim)
        expected = lazy["a"].split([2, 1], dim)
        assert [p.batch_size[dim] for p in pieces] == [2, 1]
        expected_x = lazy["n", "x"].split([2, 1], dim)
        for piece, want, want_x in zip(pieces, expected, expected_x):
            assert isinstance(piece, LazyStackedTensorDict) and piece.stack_dim == stack_dim
            assert torch.equal(piece["a"], want) and torch.equal(piece["n", "x"], want_x)
        pieces[1].set_("a", torch.full(pieces[1]["a"].shape, -1.0))  # writes reach the members
        assert (lazy.tensordicts[1]["a"][2] == -1).all() and (lazy.tensordicts[1]["a"][:2] != -1).all()

    def test_split_ragged_along_another_dim(self):
        pieces = hetero().split(2, 1)
        assert [tuple(p.batch_size) for p in pieces] == [(2, 2), (2, 1)]
        assert [v.shape for v in pieces[0].get("a", as_list=True)] == [(2, 2), (2, 4)]
        assert pieces[1]["t"] == [["foo"], ["bar"]]
        assert torch.equal(pieces[1]["b"], hetero()["b"][:, 2:])

    def test_split_errors(self):
        with pytest.raises(ValueError, match="do not add up"):
            homo().split([1, 2], 0)
        with pytest.raises(ValueError, match="must be positive"):
            homo().split(0, 1)

    @pytest.mark.parametrize("stack_dim", [0, 1])
    def test_chunk(self, stack_dim):
        members = [td(a=torch.full((3, 2), float(i))) for i in range(4)]
        lazy = LazyStackedTensorDict(*members, stack_dim=stack_dim)
        dense = lazy["a"]
        for chunks in (1, 2, 3, 4, 5):
            for dim in (0, 1, -1):
                pieces = lazy.chunk(chunks, dim)
                expected = dense.chunk(chunks, dim % 2)  # -1 is the last batch dim, not a feature dim
                assert len(pieces) == len(expected)
                for piece, want in zip(pieces, expected):
                    assert isinstance(piece, LazyStackedTensorDict) and piece.stack_dim == stack_dim
                    assert torch.equal(piece["a"], want)
        halves = torch.chunk(lazy, 2, stack_dim)
        assert halves[0].tensordicts[1] is members[1] and halves[1].tensordicts[0] is members[2]
        with pytest.raises(ValueError, match="chunks must be positive"):
            lazy.chunk(0)

    def test_unsqueeze(self):
        lazy = homo(stack_dim=1)
        for dim, stack_dim in [(0, 2), (1, 2), (2, 1), (-1, 1)]:
            out = lazy.unsqueeze(dim)
            assert out.stack_dim == stack_dim and torch.equal(out["a"], lazy["a"].unsqueeze(dim if dim >= 0 else 2))

    def test_squeeze(self):
        lazy = LazyStackedTensorDict(td(batch=(1, 3), a=torch.zeros(1, 3)), stack_dim=1)
        assert lazy.batch_size == (1, 1, 3)
        assert lazy.squeeze(0).batch_size == (1, 3) and lazy.squeeze(0).stack_dim == 0
        assert lazy.squeeze(1) is lazy.tensordicts[0]
        assert lazy.squeeze().batch_size == (3,)
        assert lazy.squeeze(2) is lazy  # size 3: nothing to squeeze

    def test_permute(self):
        lazy = homo(stack_dim=1)
        out = lazy.permute(1, 0)
        assert out.stack_dim == 0 and out.batch_size == (2, 3)
        assert torch.equal(out["a"], lazy["a"].permute(1, 0, 2))
        with pytest.raises(ValueError, match="each of the 2 batch dims"):
            lazy.permute(0, 0)

    def test_expand(self):
        lazy = hetero()
        out = lazy.expand(4, 2, 3)
        assert isinstance(out, LazyStackedTensorDict) and out.batch_size == (4, 2, 3) and out.stack_dim == 1
        assert out.get("a", as_list=True)[1].shape == (4, 3, 4)
        with pytest.raises(RuntimeError):
            lazy.expand(3, 3)

    def test_reshape(self):
        lazy = homo(stack_dim=1)
        flat = lazy.reshape(-1)
        assert flat.batch_size == (6,) and torch.equal(flat["a"], lazy["a"].reshape(6, 2))
        flat.set_("a", torch.zeros(6, 2))  # elements are views of the members
        assert (lazy.tensordicts[0]["a"] == 0).all()
        assert lazy.view(2, 3).batch_size == (2, 3)
        assert lazy.reshape(3, 2) is lazy
        with pytest.raises(RuntimeError):
            lazy.reshape(5)

    def test_torch_stack_and_cat(self):
        a, b = hetero(), hetero()
        stacked = torch.stack([a, b], 0)
        assert isinstance(stacked, LazyStackedTensorDict) and stacked.batch_size == (2, 2, 3)
        # a copy, as torch.stack of tensors and tensordict 0.15.3 (session 23: it was ``a``)
        assert stacked[0] is not a and torch.equal(stacked[0]["b"], a["b"])
        joined = torch.cat([a, b], 0)
        assert isinstance(joined, LazyStackedTensorDict) and joined.batch_size == (4, 3)
        assert joined.tensordicts == a.tensordicts + b.tensordicts
        across = torch.cat([a, b], 1)
        assert across.batch_size == (2, 6) and across.stack_dim == 0
        assert across.tensordicts[1]["a"].shape == (6, 4)

    def test_compare_all_any(self):
        lazy = hetero()
        eq = lazy == lazy.clone()
        assert isinstance(eq, LazyStackedTensorDict) and eq.all()
        assert (lazy != lazy.clone()).any() is False
        assert (lazy == 0).tensordicts[0]["a"].all() and not (lazy == 0).all()
        assert lazy.any() and not hetero().zero_().exclude("t").any()
        dense = homo()
        assert (dense == dense.to_tensordict()).all()
        with pytest.raises(BatchSizeMismatchError):
            _ = dense == td((5,), a=torch.zeros(5, 2))
        with pytest.raises(KeyError):  # (an empty one takes the stack's batch size, as tensordict's)
            _ = dense == td()

    def test_select_exclude(self):
        lazy = hetero()
        assert list(lazy.select("a").keys()) == ["a"]
        assert "a" not in lazy.exclude("a").keys() and "a" in lazy.keys()

    def test_nested_in_tensordict(self):
        ragged = td(batch=(2,), l=hetero())
        with pytest.raises(RuntimeError, match="under the key 'a'"):
            ragged.get(("l", "a"))
        assert ragged["l", "b"].shape == (2, 3)
        parent = td(batch=(2,), l=homo(), z=torch.zeros(2))
        assert isinstance(parent["l"], LazyStackedTensorDict)
        assert (parent == parent.clone()).all()
        assert parent.apply(lambda x: x + 1)["l", "a"].shape == (2, 3, 2)
        assert "l: LazyStackedTensorDict[3]{a: f32[2], n: {x: f32[]}}" in repr(parent)


# ---------------------------------------------------------------- repr and pickling
class TestReprPickle:
    def test_repr(self):
        lazy = LazyStackedTensorDict(TensorDict(a=torch.zeros(2)), TensorDict(a=torch.ones(3)))
        assert repr(lazy) == "LazyStackedTensorDict(batch_size=[2], stack_dim=0, fields={a: f32[-1]})"
        lazy = LazyStackedTensorDict(td(a=torch.zeros(3, 2)), td(a=torch.ones(3, 4, 5)), stack_dim=1)
        assert repr(lazy) == "LazyStackedTensorDict(batch_size=[3,2], stack_dim=1, fields={a: f32[-1]})"
        assert "n: {x: f32[1]}" in repr(hetero()) and "t: str" in repr(hetero())

    def test_pickle(self):
        lazy = hetero().lock_()
        out = pickle.loads(pickle.dumps(lazy))
        assert isinstance(out, LazyStackedTensorDict) and out.stack_dim == 0 and out.is_locked
        assert torch.equal(out.tensordicts[1]["a"], lazy.tensordicts[1]["a"])
        assert out["t"] == lazy["t"]
        with pytest.raises(RuntimeError, match="locked graph"):
            out.tensordicts[0].unlock_()

    def test_forking_pickler(self):
        lazy = homo().share_memory_()
        out = ForkingPickler.loads(ForkingPickler.dumps(lazy))
        assert isinstance(out, LazyStackedTensorDict) and out.is_shared()
        out.set_("a", torch.full((2, 3, 2), 8.0))  # the same shared memory
        assert (lazy.tensordicts[1]["a"] == 8).all()

    @pytest.mark.timeout(30)
    def test_write_from_another_process(self):
        ctx = multiprocessing.get_context("fork")
        lazy = homo().share_memory_()
        queue = ctx.Queue()
        process = ctx.Process(target=_child_writes, args=(queue,))
        process.start()
        queue.put(lazy)
        process.join(20)
        assert process.exitcode == 0
        assert (lazy.tensordicts[0]["a"] == 42).all() and (lazy.tensordicts[1]["n", "x"] == 42).all()


def _child_writes(queue) -> None:
    lazy = queue.get(timeout=10)
    lazy.set_("a", torch.full((2, 3, 2), 42.0))
    lazy.get("n").set_("x", torch.full((2, 3), 42.0))
