"""merge_tensordicts, dense_stack_tds, pad, pad_sequence and assert_allclose_td, side by
side with tensordict 0.15.3 (and where tensordict loses data or crashes, shared_td's own)."""
import pytest
import torch

import shared_td
from tests.reference import LIBS

S = shared_td


def _td(lib, **kw):
    return lib.TensorDict(**kw)


@pytest.mark.parametrize("lib", LIBS)
def test_merge_first_wins_and_callback(lib):
    a = lib.TensorDict({"a": {"b0": 0}, "common": 0, "s": "first"})
    b = lib.TensorDict({"a": {"b1": 1}, "f": 1, "common": 1, "s": "second", "t": "other"})
    out = lib.merge_tensordicts(a, b)
    assert sorted(out.keys(True, True), key=str) == [("a", "b0"), ("a", "b1"), "common", "f"]
    assert out["common"] == 0 and out["s"] == "first" and out["t"] == "other"
    assert out["f"] is b["f"]  # not copied
    assert lib.merge_tensordicts(a, b, callback_exist=lambda *v: v[0] + v[1])["common"] == 1
    assert lib.merge_tensordicts(a, b, callback_exist={"common": lambda *v: v[1] * 5})["common"] == 5
    with pytest.raises(RuntimeError):
        lib.merge_tensordicts(a)


def test_merge_leaf_against_node_names_the_key():  # tensordict 0.15.3: AttributeError
    with pytest.raises(KeyError, match="'x'"):
        shared_td.merge_tensordicts(shared_td.TensorDict(x=torch.zeros(3)),
                                    shared_td.TensorDict(x={"y": torch.zeros(2)}))


@pytest.mark.parametrize("lib", LIBS)
def test_dense_stack_tds(lib):
    lazy = lib.lazy_stack([lib.TensorDict(x=torch.zeros(3), batch_size=[3])] * 2, dim=1)
    dense = lib.dense_stack_tds(lazy)
    assert type(dense).__name__ == "TensorDict" and dense.batch_size == torch.Size([3, 2])
    inner = lib.lazy_stack([lib.TensorDict(a=torch.zeros(3)), lib.TensorDict(a=torch.zeros(4), b=torch.zeros(2))])
    box = lib.TensorDict(lazy=inner)
    out = lib.dense_stack_tds(lib.lazy_stack([box, box.clone()]))
    assert type(out).__name__ == "TensorDict" and out["lazy"].stack_dim == 1
    assert out["lazy"][:, 1]["b"].shape == torch.Size([2, 2])
    assert lib.dense_stack_tds(box) is box
    with pytest.raises(ValueError):
        lib.dense_stack_tds([box, box])


@pytest.mark.parametrize("dim", [-4, -5, 3])
def test_dense_stack_out_of_range_dim_is_an_error_as_torch_stack(dim):
    """tensordict 0.15.3 wraps a dim below -ndim - 1 into range (dim=-4 of 2 batch dims
    stacks at -1); shared_td stacked there too, while torch.stack and lazy_stack refuse it."""
    tds = [shared_td.TensorDict(a=torch.zeros(3, 2), batch_size=[3, 2]) for _ in range(2)]
    for stack in (shared_td.dense_stack_tds, shared_td.maybe_dense_stack):
        with pytest.raises(shared_td.BatchDimError, match=f"dim={dim}.* out of range .*-3 <= dim <= 2"):
            stack(tds, dim)
    assert shared_td.dense_stack_tds(tds, -3).batch_size == torch.Size([2, 3, 2])  # the lowest in range


@pytest.mark.parametrize("lib", LIBS)
def test_pad_tensors_nontensors_nested(lib):
    td = lib.TensorDict(a=torch.arange(3.0), s="x", n=lib.TensorDict(b=torch.ones(3, 2), batch_size=[3, 2]),
                        batch_size=[3])
    out = lib.pad(td, [1, 1], value=-1.0)
    assert out.batch_size == torch.Size([5]) and out["n"].batch_size == torch.Size([5, 2])
    assert out["a"].tolist() == [-1.0, 0.0, 1.0, 2.0, -1.0]
    assert out.get("s").tolist() == [None, "x", "x", "x", None]
    assert td.batch_size == torch.Size([3])  # the input is left alone
    same = td.clone()
    assert lib.pad(same, [0, 2], inplace=True) is same and same["a"].shape == torch.Size([5])
    for bad in ([0], [0, 1, 0, 1], [0, -4]):
        with pytest.raises(RuntimeError):
            lib.pad(td, bad)


@pytest.mark.parametrize("lib", LIBS)
def test_pad_lazy_stack_and_tensorclass(lib):
    lazy = lib.lazy_stack([lib.TensorDict(a=torch.zeros(2), batch_size=[2]),
                           lib.TensorDict(a=torch.ones(2), batch_size=[2])])
    out = lib.pad(lazy, [0, 1, 1, 0])
    assert type(out).__name__ == "TensorDict"
    assert out["a"].tolist() == [[0, 0, 0], [0, 1, 1], [0, 0, 0]]
    lazy2 = lazy.clone()
    assert lib.pad(lazy2, [0, 1, 1, 0], inplace=True) is lazy2 and lazy2["a"].tolist() == out["a"].tolist()

    @lib.tensorclass
    class Step:
        x: torch.Tensor
        y: str

    padded = lib.pad(Step(x=torch.ones(2), y="h", batch_size=[2]), [0, 1])
    assert type(padded) is Step and padded.x.tolist() == [1, 1, 0]


def test_pad_ragged_lazy_stack_keeps_members():  # tensordict 0.15.3: RuntimeError
    lazy = shared_td.lazy_stack([shared_td.TensorDict(a=torch.zeros(2)), shared_td.TensorDict(a=torch.ones(3))])
    out = shared_td.pad(lazy, [0, 1])
    assert out.batch_size == torch.Size([3]) and out.tensordicts[2]["a"].tolist() == [0, 0, 0]


def test_pad_inplace_locked_refused_before_any_write():
    td = shared_td.TensorDict(a=torch.zeros(2), batch_size=[2]).lock_()
    with pytest.raises(shared_td.LockedTensorDictError):
        shared_td.pad(td, [0, 1], inplace=True)
    assert td.batch_size == torch.Size([2]) and td["a"].shape == torch.Size([2])


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("side", ["right", "left"])
def test_pad_sequence_batch_dim_masks(lib, side):
    a = lib.TensorDict(x=torch.ones(2, 3), n=lib.TensorDict(y=torch.ones(2), batch_size=[2]), s="p", batch_size=[2])
    b = lib.TensorDict(x=torch.ones(4, 3) * 2, n=lib.TensorDict(y=torch.ones(4), batch_size=[4]), s="q",
                       batch_size=[4])
    out = lib.pad_sequence([a, b], return_mask=True, padding_side=side, padding_value={("n", "y"): 7})
    assert out.batch_size == torch.Size([2, 4]) and out["x"].shape == torch.Size([2, 4, 3])
    expected = [[True, True, False, False], [True] * 4]
    if side == "left":
        expected[0] = expected[0][::-1]
    assert out["masks", "x"].tolist() == expected and out["masks", "n", "y"].tolist() == expected
    assert out["n", "y"][0].tolist() == ([1, 1, 7, 7] if side == "right" else [7, 7, 1, 1])
    strings = out.get("s").tolist()[0]
    assert strings == (["p", "p", None, None] if side == "right" else [None, None, "p", "p"])
    custom = lib.pad_sequence([a, b], return_mask=("m", "k"))
    assert ("m", "k", "x") in custom.keys(True)


@pytest.mark.parametrize("lib", LIBS)
def test_pad_sequence_feature_dim(lib):
    c, d = lib.TensorDict(x=torch.ones(3, 2)), lib.TensorDict(x=torch.ones(3, 4))
    out = lib.pad_sequence([c, d], pad_dim=1, return_mask=True)
    assert out.batch_size == torch.Size([2]) and out["x"].shape == torch.Size([2, 3, 4])
    assert out["masks", "x"].tolist() == [[True, True, False, False], [True] * 4]
    assert lib.pad_sequence([c, d], pad_dim=-1)["x"].shape == torch.Size([2, 3, 4])


@pytest.mark.parametrize("lib", LIBS)
def test_pad_sequence_errors(lib):
    c = lib.TensorDict(x=torch.ones(3, 2))
    with pytest.raises(RuntimeError):
        lib.pad_sequence([])
    with pytest.raises(ValueError):
        lib.pad_sequence([c, c], padding_side="mid")
    with pytest.raises(RuntimeError):
        lib.pad_sequence([lib.TensorDict(x=1.0), lib.TensorDict(x=2.0)])
    with pytest.raises(KeyError):
        lib.pad_sequence([c, c], padding_value={"zz": 1})
    with pytest.raises(RuntimeError):
        lib.pad_sequence([c, lib.TensorDict(x=torch.ones(4, 5))])


def test_pad_sequence_different_keys_raise():  # tensordict 0.15.3 returns an empty TensorDict
    with pytest.raises(KeyError, match="lacks"):
        shared_td.pad_sequence([shared_td.TensorDict(x=torch.ones(3)), shared_td.TensorDict(y=torch.ones(3))])


def test_pad_sequence_promotes_dtypes():  # tensordict 0.15.3 casts to the first's dtype
    out = shared_td.pad_sequence([shared_td.TensorDict(x=torch.ones(2, dtype=torch.long)),
                                  shared_td.TensorDict(x=torch.full((3,), 0.5))])
    assert out["x"].dtype == torch.float32 and out["x"][1].tolist() == [0.5, 0.5, 0.5]


@pytest.mark.parametrize("lib", LIBS)
def test_assert_allclose_td(lib):
    a = lib.TensorDict(x=torch.zeros(3), n={"y": torch.ones(2)}, s="a")
    assert lib.assert_allclose_td(a, a.clone())
    assert lib.assert_allclose_td(a, lib.TensorDict(x=torch.zeros(3), n={"y": torch.ones(2)}, s="b"))
    with pytest.raises(AssertionError, match=r"\('p', 'n', 'y'\)"):
        lib.assert_allclose_td(a, lib.TensorDict(x=torch.zeros(3), n={"y": torch.zeros(2)}, s="a"), prefix=("p",))
    with pytest.raises(KeyError):
        lib.assert_allclose_td(a, lib.TensorDict(x=torch.zeros(3)))
    assert lib.assert_allclose_td(a, lib.TensorDict(x=torch.zeros(3)), intersection=True)
    with pytest.raises(AssertionError):
        lib.assert_allclose_td(lib.TensorDict(x=torch.ones(2)), lib.TensorDict(x=torch.ones(2, dtype=torch.float64)))
    with pytest.raises(RuntimeError):
        lib.assert_allclose_td(lib.TensorDict(x=torch.ones(2)), lib.TensorDict(x=torch.ones(3)))
    with pytest.raises(TypeError):
        lib.assert_allclose_td(a, {"x": 1})
    lazy = lib.lazy_stack([lib.TensorDict(x=torch.zeros(3)), lib.TensorDict(x=torch.ones(3))])
    assert lib.assert_allclose_td(lazy, lazy.clone())
    assert lib.assert_close is lib.assert_allclose_td  # its other name


@pytest.mark.parametrize("lib", LIBS)
def test_pad_in_place_of_a_lazy_stack_gives_it_the_new_batch_size(lib):
    stack = lib.lazy_stack([lib.TensorDict({"a": torch.ones(3)}, [3]) for _ in range(2)], 0)
    assert lib.pad(stack, [1, 0, 0, 2], inplace=True) is stack
    assert stack.batch_size == torch.Size([3, 5]) and stack["a"].shape == torch.Size([3, 5])
    assert stack[0]["a"].tolist() == [0.0] * 5 and stack[1]["a"].tolist() == [1.0, 1.0, 1.0, 0.0, 0.0]


# -- fuzzer round 5: pad of lazy stacks (new members' non-tensor values None; crops)


def _lazy_nt(n):
    members = [S.TensorDict(x=torch.full((), float(i + 1)), batch_size=[]) for i in range(n)]
    for t in members:
        t.set_non_tensor("s", "u")
    return S.lazy_stack(members, 0)


def test_pad_lazy_new_members_hold_none_for_0d_non_tensor():
    out = S.pad(_lazy_nt(2), [1, 1], value=-1)
    assert out["s"].tolist() == [None, "u", "u", None]
    assert out["x"].tolist() == [-1.0, 1.0, 2.0, -1.0]


def test_pad_sequence_lazy_non_tensor_padded_with_none():
    td = S.TensorDict(n=_lazy_nt(2), batch_size=[2])
    out = S.pad_sequence([td[:l] for l in (0, 1, 2)], pad_dim=0)
    assert out["n", "s"].tolist() == [[None, None], ["u", None], ["u", "u"]]


def test_pad_lazy_crop_all_members_then_grow():
    for ps, n, want in (([2, -1], 1, [[-1.0] * 2] * 2), ([-1, 1], 1, [[-1.0] * 2]), ([-2, 3], 2, [[-1.0] * 2] * 3)):
        lz = S.lazy_stack([S.TensorDict(x=torch.full((2,), float(i + 1))) for i in range(n)], 0)
        out = S.pad(S.TensorDict(n=lz, batch_size=[n]), ps, value=-1)
        assert out["n", "x"].tolist() == want


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("stack_dim,sizes,shape", [(0, [-2, 0], [0, 3]), (0, [-1, -1, 0, 1], [0, 4]),
                                                   (1, [0, 1, -1, -1], [4, 0])])
def test_pad_crops_a_lazy_stack_to_no_member(lib, stack_dim, sizes, shape):
    stack = lib.lazy_stack([lib.TensorDict({"a": torch.ones(3)}, [3]) for _ in range(2)], stack_dim)
    out = lib.pad(stack, sizes)
    assert out.batch_size == torch.Size(shape) and out["a"].shape == torch.Size(shape)


# -- review of this round's change: pad checks everything before any write




@pytest.mark.parametrize("make", ["lock", "memmap", "share"])
def test_pad_inplace_of_a_locked_shared_or_memmapped_tree_is_refused_even_without_resizing(make, tmp_path):
    td = S.TensorDict(a=torch.zeros(3), batch_size=[3])
    td = {"lock": td.lock_, "memmap": lambda: td.memmap_(tmp_path), "share": td.share_memory_}[make]()
    leaf = td["a"]
    with pytest.raises(RuntimeError):
        S.pad(td, [0, 0], inplace=True)
    assert td["a"] is leaf or td["a"].data_ptr() == leaf.data_ptr()  # the leaf the files/segment back is kept


def test_pad_a_crop_larger_than_the_dim_on_one_side_is_refused_before_any_write():
    td = S.TensorDict({"n": S.TensorDict(s=S.NonTensorStack("a", "b", "c"), batch_size=[3]),
                       "a": torch.arange(3.)}, batch_size=[3])
    with pytest.raises(RuntimeError, match="crops more"):
        S.pad(td, [-4, 2], inplace=True)
    assert td["n"].batch_size == torch.Size([3]) and td["n", "s"] == ["a", "b", "c"]
    stack = S.lazy_stack([S.TensorDict(a=torch.zeros(2), batch_size=[2]) for _ in range(3)])
    with pytest.raises(RuntimeError, match="crops more"):
        S.pad(stack, [-4, 2])  # (3 - 4 + 2 = 1 row; it gave 2 rows)


def test_pad_inplace_of_a_lazy_stack_holding_one_member_twice_pads_it_once():
    member = S.TensorDict(a=torch.ones(3), batch_size=[3])
    td = S.TensorDict(l=S.lazy_stack([member, member], 1), batch_size=[3])
    S.pad(td, [0, 1], inplace=True)
    assert td.batch_size == torch.Size([4]) and td["l"].batch_size == torch.Size([4, 2])
    assert member.batch_size == torch.Size([4])


# -- fuzzer round 5 triage: pad_sequence's pad_dim checks



@pytest.mark.parametrize("lib", LIBS)
def test_pad_sequence_negative_dim_on_batch_and_feature_dims_longer_sample_is_value_error(lib):
    # pad_dim=-3 lands on batch dim 0 of "a" (batch dims only) and batch dim 1 of "b": the batch
    # cannot be padded along it, and item 1 is longer than item 0 (tensordict's ValueError).
    tds = [lib.TensorDict(a=torch.zeros(n, 2, 1), b=torch.zeros(n, 2, 1, 3), batch_size=[n, 2, 1]) for n in (1, 2)]
    with pytest.raises(ValueError, match="pad_dim=-3"):
        lib.pad_sequence(tds, pad_dim=-3)


def test_pad_sequence_negative_dim_mixed_landing_shorter_sample_is_value_error():
    # tensordict 0.15.3 broadcasts item 1's f (1, 3) into 2 rows (made-up data, masks all True)
    tds = [shared_td.TensorDict(v=torch.ones(n), f=torch.ones(n, 3), batch_size=[n]) for n in (2, 1)]
    with pytest.raises(ValueError, match="batch sizes differ along dim 0"):
        shared_td.pad_sequence(tds, pad_dim=-1, return_mask=True)
    same = [shared_td.TensorDict(v=torch.ones(2), f=torch.ones(2, n), batch_size=[2]) for n in (2, 3)]
    out = shared_td.pad_sequence(same, pad_dim=-1, return_mask=True)  # equal batches: still pads the features
    assert out["f"].shape == (2, 2, 3) and out["masks", "f"].sum(-1).tolist() == [[2, 2], [3, 3]]


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("pad_dim", [1, -2])
def test_pad_sequence_without_tensors_pad_dim_out_of_range(lib, pad_dim):
    tds = [lib.TensorDict(batch_size=[1]) for _ in range(2)]
    with pytest.raises(IndexError):
        lib.pad_sequence(tds, pad_dim=pad_dim)
    assert list(lib.pad_sequence(tds, pad_dim=-1).batch_size) == [2, 1]
