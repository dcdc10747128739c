"""Session 24, side by side with tensordict 0.15.3 (divergences a differential fuzzer
found): how ``from_dict`` reads lists and tuples, ``apply`` of an empty NonTensorStack,
``select(strict=False)`` of a missing key inside a selected branch, ``update_at_`` of a
dict into a lazy stack nested under a 0-d TensorDict."""
from __future__ import annotations

import collections

import numpy as np
import pytest
import torch

from tests.reference import LIBS

Pair = collections.namedtuple("Pair", "p q")


def kind(value):
    return type(value).__name__


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("value, expected", [
    ([True, 1.5], "NonTensorStack"),  # numbers of two Python types: one value per element
    ([1, 2.5], "NonTensorStack"),
    ([[1, 2], [3, 4.0]], "NonTensorStack"),
    ([np.float32(1), 2.0], "NonTensorStack"),
    ([torch.tensor(1), 2], "NonTensorStack"),
    ([torch.zeros(2), torch.ones(2)], "NonTensorStack"),  # (the constructor stacks them)
    ([1 + 2j, 2], "NonTensorStack"),
    ([True, False], "Tensor"),
    ([[1, 2], [3, 4]], "Tensor"),
    ([[], []], "Tensor"),
    ([], "Tensor"),
])
def test_from_dict_makes_a_tensor_only_of_numbers_of_one_type(lib, value, expected):
    td = lib.TensorDict.from_dict({"a": value, "n": {"a": value}})
    assert kind(td.get("a")) == kind(td.get(("n", "a"))) == expected
    if expected == "NonTensorStack":
        assert td.get("a").batch_size[0] == len(value)


@pytest.mark.parametrize("lib", LIBS)
def test_from_dict_makes_a_tuple_a_nested_tensordict(lib):
    td = lib.TensorDict.from_dict({"t": (1, "x"), "p": Pair(torch.zeros(2), 3)})
    assert sorted(td.get("t").keys()) == ["0", "1"]
    assert td.get(("t", "0")).item() == 1 and td.get_non_tensor(("t", "1")) == "x"
    assert sorted(td.get("p").keys()) == ["p", "q"]
    assert torch.equal(td.get(("p", "p")), torch.zeros(2))


@pytest.mark.parametrize("lib", LIBS)
def test_from_dict_keeps_a_mixed_list_under_a_batch_size(lib):
    td = lib.TensorDict.from_dict({"a": [True, 1.5], "x": torch.zeros(2)}, batch_size=[2])
    assert td.get("a").tolist() == [True, 1.5]
    assert td[1]["a"] == 1.5


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("apply", ["apply", "named_apply"])
def test_apply_leaves_out_a_non_tensor_stack_of_no_value(lib, apply):
    empty = lib.NonTensorStack.from_list([])
    td = lib.TensorDict({"x": torch.zeros(0), "l": empty, "s": "kept", "n": {"l": empty}}, batch_size=[0])
    fn = (lambda t: t + 1) if apply == "apply" else (lambda key, t: t + 1)
    out = getattr(td, apply)(fn)
    assert sorted(out.keys(True)) == ["s", "x"]  # ("n" held it only: emptied, so left out)
    kept = getattr(td, apply)(fn, filter_empty=False)
    assert sorted(kept.keys(True), key=str) == [("n", "l"), "l", "n", "s", "x"]
    assert "l" in td.apply_(lambda t: t + 1).keys()  # (in place: nothing is removed)


@pytest.mark.parametrize("lib", LIBS)
def test_apply_leaves_out_a_non_tensor_stack_of_a_zero_inner_dim(lib):
    td = lib.TensorDict({"x": torch.zeros(2, 0), "l": lib.NonTensorStack.from_list([[], []])}, batch_size=[2, 0])
    assert list(td.apply(lambda t: t + 1).keys()) == ["x"]


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("keys, expected", [
    ([("b", "zz")], {"b": {}}),
    (["b", ("b", "zz")], {"b": {}}),  # (the more specific key wins)
    ([("b", "c", "zz")], {"b": {"c": {}}}),
    ([("b", "a", "zz")], {"b": {}}),  # ("a" is a tensor: no branch to keep)
    ([("q", "zz")], {}),
    ([("x", "zz")], {}),
    ([("b", "zz"), ("b", "a")], {"b": {"a": [0.0, 0.0]}}),
])
def test_select_not_strict_keeps_the_branches_of_a_missing_key_emptied(lib, keys, expected):
    td = lib.TensorDict({"b": {"a": torch.zeros(2), "c": {"d": torch.zeros(2)}}, "x": torch.zeros(2)}, batch_size=[2])
    out = td.select(*keys, strict=False).to_dict()
    assert _as_lists(out) == expected
    members = [lib.TensorDict({"b": {"a": torch.zeros(())}}), lib.TensorDict({"b": {"a": torch.zeros(())}})]
    assert list(lib.lazy_stack(members).select(("b", "zz"), strict=False).keys(True)) == ["b"]


def _as_lists(tree):
    return {k: _as_lists(v) if isinstance(v, dict) else v.tolist() for k, v in tree.items()}


def _nested_lazy(lib):
    members = [lib.TensorDict({"a": torch.zeros(())}), lib.TensorDict({"a": torch.zeros(())})]
    return lib.TensorDict({"lz": lib.lazy_stack(members), "d": lib.TensorDict({"a": torch.zeros(2)}, [2])}, [])


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("key", ["lz", "d"])
def test_update_at_new_dim_of_a_0d_tensordict_broadcasts_into_a_nested_lazy_stack(lib, key):
    root = _nested_lazy(lib)
    root.update_at_({key: {"a": torch.tensor([5.0, 6.0])}}, None)
    assert root.get((key, "a")).tolist() == [5.0, 6.0]


def test_a_0d_tensordict_written_into_lazy_rows_broadcasts_each_leaf_to_its_part():
    # each leaf broadcast as torch assigns (trailing dims first), as the dense TensorDict
    # does; expanded to the rows instead, [2] became [*rows, 2] and raised
    import shared_td

    members = [shared_td.TensorDict({"a": torch.zeros(3, 2)}, [3]) for _ in range(2)]
    lz = shared_td.lazy_stack(members)
    lz[:, :2] = shared_td.TensorDict({"a": torch.arange(2.0)}, [])
    assert lz.get("a").tolist() == [[[0.0, 1.0], [0.0, 1.0], [0.0, 0.0]]] * 2
    with pytest.raises(shared_td.BatchSizeMismatchError, match="'a'.*part there has shape"):
        lz[:, :2] = shared_td.TensorDict({"a": torch.arange(3.0)}, [])
    assert lz.get("a").tolist() == [[[0.0, 1.0], [0.0, 1.0], [0.0, 0.0]]] * 2  # (nothing written)


@pytest.mark.parametrize("value, idx, expected", [
    (0, 1, ["a", 0, "c"]),
    (2.5, slice(0, 2), [2.5, 2.5, "c"]),
    (True, (), [True, True, True]),
    (None, 1, ["a", None, "c"]),
])
def test_update_at_of_a_number_into_a_non_tensor_entry_keeps_the_number(value, idx, expected):
    # (tensordict 0.15.3 raises TypeError; stored as tensor(0) before, a silent type change)
    import shared_td

    td = shared_td.TensorDict({"x": torch.zeros(3), "s": ["a", "b", "c"], "n": {"s": ["a", "b", "c"]}}, [3])
    td.update_at_({"s": value, "n": {"s": value}, "x": 1.0}, idx)
    for key in ("s", ("n", "s")):
        got = td.get(key).tolist()
        assert got == expected and [type(v) for v in got] == [type(v) for v in expected]
    written = torch.zeros(3)
    written[idx] = 1.0
    assert torch.equal(td.get("x"), written)


def test_a_tensorclass_update_at_of_a_number_into_an_any_field_keeps_the_number():
    from typing import Any

    import shared_td

    @shared_td.tensorclass
    class Step:
        obs: torch.Tensor
        info: Any

    step = Step(obs=torch.zeros(3), info="x", batch_size=[3])
    step.update_at_({"info": 0, "obs": torch.ones(())}, 1)
    assert step.info == ["x", 0, "x"] and type(step.info[1]) is int
    assert step.obs.tolist() == [0.0, 1.0, 0.0]


def _only_an_empty_stack(lib):
    return lib.TensorDict({"s": lib.NonTensorStack.from_list([])}, [0])


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("lazy", [False, True])
def test_apply_in_place_of_a_tree_holding_only_an_empty_stack(lib, lazy):
    # apply() gives None there (every entry left out): apply_ has nothing to write
    td = _only_an_empty_stack(lib)
    if lazy:
        td = lib.lazy_stack([td, td.clone()])
    assert td.apply(lambda t: t + 1) is None
    assert td.apply_(lambda t: t + 1) is td
    assert "s" in td.keys(True)


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("make", ["detach", "data", "zeros_like", "ones_like", "expand_as"])
def test_structure_keeping_ops_keep_an_empty_stack(lib, make):
    td = lib.TensorDict({"s": lib.NonTensorStack.from_list([]), "x": torch.zeros(0), "e": lib.TensorDict({}, [0])}, [0])
    out = {"detach": lambda: td.detach(), "data": lambda: td.data, "zeros_like": lambda: torch.zeros_like(td),
           "ones_like": lambda: torch.ones_like(td), "expand_as": lambda: td.expand_as(td)}[make]()
    # (expand_as is an apply, as in tensordict 0.15.3: the empty stack is left out)
    assert sorted(out.keys()) == (["e", "x"] if make == "expand_as" else ["e", "s", "x"])


def _stack_holding_tensorclasses(lib, cls):
    td = lib.TensorDict({"c": cls(obs=torch.zeros(2), batch_size=[2]),
                         "n": {"c": cls(obs=torch.zeros(2), batch_size=[2])}}, [2])
    return td, lib.lazy_stack([td, td.clone()])


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("how", ["contiguous", "to_tensordict", "clone"])
def test_a_dense_copy_of_a_lazy_stack_never_writes_into_its_members_tensorclasses(lib, how):
    @lib.tensorclass
    class Obs:
        obs: torch.Tensor

    member, stack = _stack_holding_tensorclasses(lib, Obs)
    out = getattr(stack, how)()
    out.get("c")[0] = Obs(obs=torch.ones(2), batch_size=[2])
    out.get(("n", "c"))[0] = Obs(obs=torch.ones(2), batch_size=[2])
    assert member.get("c").obs.tolist() == member.get(("n", "c")).obs.tolist() == [0.0, 0.0]
    assert out.get(("c", "obs"))[0].tolist() == [1.0, 1.0]
    # to_tensordict gives TensorDicts all the way down, as TensorDict.to_tensordict;
    # contiguous and clone keep the tensorclasses
    kind = "TensorDict" if how == "to_tensordict" else "Obs"
    assert type(out.get("c")).__name__ == type(out.get(("n", "c"))).__name__ == kind


@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("how", ["update_", "update_inplace"])
def test_a_lazy_stacks_update_in_place_writes_a_number_into_a_non_tensor_entry(nested, how):
    # as TensorDict.update_ does (the README's differences: tensordict 0.15.3 keeps the
    # old value); the lazy stack raised a batch-size error instead
    import shared_td

    stack = shared_td.lazy_stack([shared_td.TensorDict(obs=torch.zeros(1), batch_size=[1]) for _ in range(3)])
    for member in stack.tensordicts:
        member.set_non_tensor("done", "x")
    root = shared_td.TensorDict({"b": stack}, [3]) if nested else stack
    prefix = ("b",) if nested else ()
    source = {prefix + ("done",): 3, prefix + ("obs",): torch.ones(3, 1)}
    root.update_(source) if how == "update_" else root.update(source, inplace=True)
    assert [member.get_non_tensor("done") for member in stack.tensordicts] == [3, 3, 3]
    assert stack.get("obs").flatten().tolist() == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("keys, removes", [
    (["missing"], False), ([("n", "missing")], False), ([("q", "r")], False), (["a"], True), ([("n", "b")], True),
])
def test_exclude_in_place_on_a_locked_tensordict_refuses_only_a_real_removal(lib, keys, removes):
    td = lib.TensorDict(a=torch.zeros(2), n={"b": torch.zeros(2)}, batch_size=[2]).lock_()
    if removes:
        with pytest.raises(RuntimeError, match="locked"):
            td.exclude(*keys, inplace=True)
    else:
        assert td.exclude(*keys, inplace=True) is td
    assert sorted(td.keys(True), key=str) == [("n", "b"), "a", "n"]


@pytest.mark.parametrize("lib", LIBS)
def test_apply_in_place_of_a_function_giving_none_writes_nothing(lib):
    td = lib.TensorDict(a=torch.zeros(2), batch_size=[2])
    assert td.apply_(lambda t: None) is td and td["a"].tolist() == [0.0, 0.0]


def test_memmap_and_memmap_like_keep_an_empty_non_tensor_stack(short_tmp_path):
    # (tensordict 0.15.3: memmap raises "items cannot be empty", memmap_like drops it)
    import shared_td

    td = shared_td.TensorDict({"x": torch.zeros(0), "s": shared_td.NonTensorStack.from_list([])}, [0])
    for how in ("memmap", "memmap_like"):
        out = getattr(td, how)(str(short_tmp_path / how))
        assert sorted(out.keys()) == ["s", "x"]
        back = shared_td.load_memmap(str(short_tmp_path / how))
        assert type(back.get("s")).__name__ == "NonTensorStack" and back.get("s").batch_size == torch.Size([0])


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("how", ["apply", "apply_inplace", "apply_", "lazy"])
def test_apply_refuses_a_result_that_does_not_start_with_the_batch_size(lib, how):
    # (a 0-d result under batch [2] made an invalid tree; in place, it was broadcast)
    td = lib.TensorDict(a=torch.arange(4.0).reshape(2, 2), n={"b": torch.ones(2)}, batch_size=[2])
    run = {"apply": lambda: td.apply(torch.sum), "apply_inplace": lambda: td.apply(torch.sum, inplace=True),
           "apply_": lambda: td.apply_(torch.sum),
           "lazy": lambda: lib.lazy_stack([td, td.clone()]).apply(lambda t: t.sum())}[how]
    with pytest.raises(RuntimeError, match="batch dimension mismatch"):
        run()
    assert td["a"].tolist() == [[0.0, 1.0], [2.0, 3.0]]
    assert td.apply(torch.sum, batch_size=[])["a"].item() == 6.0


@pytest.mark.parametrize("how", ["td", "nested", "lazy", "tensorclass"])
def test_apply_in_place_writes_nothing_when_one_result_does_not_fit(how):
    # every result is made and checked before the first is written (key by key, the
    # keys before the misfit were written; tensordict 0.15.3 half-writes a lazy stack)
    import shared_td

    @shared_td.tensorclass
    class Pair:
        a: torch.Tensor
        b: torch.Tensor

    def fn(v):
        return v * 5 if v.dim() == 1 else v.sum(-1)  # b's [2] does not fit its [2, 3]

    members = [shared_td.TensorDict(a=torch.ones(2), b=torch.ones(2, 3), batch_size=[2]) for _ in range(2)]
    target = {"td": lambda: members[0], "nested": lambda: shared_td.TensorDict(n=members[0], batch_size=[2]),
              "lazy": lambda: shared_td.lazy_stack(members),
              "tensorclass": lambda: Pair(a=members[0]["a"], b=members[0]["b"], batch_size=[2])}[how]()
    with pytest.raises(shared_td.BatchSizeMismatchError):
        target.apply(fn, inplace=True)
    with pytest.raises(shared_td.BatchSizeMismatchError):
        target.apply_(fn)
    assert [m["a"].tolist() for m in members] == [[1.0, 1.0]] * 2
    target.apply(lambda v: v * 2, inplace=True)
    assert members[0]["a"].tolist() == [2.0, 2.0] and members[0]["b"].sum().item() == 12.0


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("lazy", [False, True])
def test_unflatten_keys_gives_new_nested_tensordicts_holding_the_same_tensors(lib, lazy):
    # self's own nested tensordicts were put in the result: "n_q" unflattened into the
    # result's "n" was added to self's "n", and the result's lock locked self's "n"
    td = lib.TensorDict({"a_b": torch.zeros(2), "n": {"c": torch.zeros(2), "m": {"z": torch.zeros(2)}},
                         "n_q": torch.ones(2)}, batch_size=[2])
    source = lib.lazy_stack([td, td.clone()]) if lazy else td
    out = source.unflatten_keys("_")
    assert sorted(td["n"].keys()) == ["c", "m"]
    assert out.get(("n", "q")).tolist() == source.get("n_q").tolist()
    out.lock_()
    assert not td["n"].is_locked and not td["n", "m"].is_locked
    if not lazy:
        assert out["n"] is not td["n"] and out["n", "m"] is not td["n", "m"] and out["n", "c"] is td["n", "c"]


@pytest.mark.parametrize("lib", LIBS)
def test_a_list_mixing_tensors_and_numbers_is_one_value_per_element(lib):
    # (to_dict of such a NonTensorStack, given back to the constructor, made a tensor)
    values = [torch.tensor(1 + 2j), 3, 3]
    td = lib.TensorDict({"a": values}, batch_size=[3])
    assert type(td.get("a")).__name__ == "NonTensorStack"
    again = lib.TensorDict(td.to_dict(), batch_size=[3])
    assert type(again.get("a")).__name__ == "NonTensorStack" and again.get("a").tolist()[1:] == [3, 3]


@pytest.mark.parametrize("lib", LIBS)
def test_a_non_tensor_data_takes_its_own_value_written_at_an_index(lib):
    td = lib.TensorDict(batch_size=[2])
    td["a"] = "run"
    held = td.get("a")
    held[-1] = lib.NonTensorData("run")  # nothing changes (it raised in shared_td)
    assert type(held).__name__ == "NonTensorData" and td["a"] == "run"
    with pytest.raises(ValueError, match="one value for all its elements"):
        held[-1] = lib.NonTensorData("walk")


@pytest.mark.parametrize("how", ["set_", "update_"])
def test_an_in_place_write_of_keys_the_entry_lacks_raises_before_writing(how):
    # (tensordict 0.15.3 writes "c" and drops "z" silently)
    import shared_td

    td = shared_td.TensorDict({"n": {"c": torch.zeros(2)}}, [2])
    source = shared_td.TensorDict({"c": torch.ones(2), "z": torch.ones(2)}, [2])
    with pytest.raises(KeyError, match="'n', 'z'"):
        td.set_("n", source) if how == "set_" else td.update_({"n": source})
    assert td["n", "c"].tolist() == [0.0, 0.0] and sorted(td["n"].keys()) == ["c"]
    td.set("n", source, inplace=True)
    assert sorted(td["n"].keys()) == ["c", "z"]


@pytest.mark.parametrize("lib", LIBS)
def test_a_row_write_into_a_ragged_lazy_stack_reads_only_the_keys_written(lib):
    # a dict written into rows of a lazy stack read every key of the rows (stacking
    # "b", whose members differ in shape: RuntimeError), since this session's broadcast
    members = [lib.TensorDict(done=torch.zeros(3, dtype=torch.bool), b=torch.zeros(3, 4), batch_size=[3]),
               lib.TensorDict(done=torch.zeros(3, dtype=torch.bool), b=torch.zeros(3), batch_size=[3])]
    stack = lib.lazy_stack(members, 1)
    stack.update_at_({"done": torch.tensor([True, False])}, 0)
    stack[1] = {"b": torch.ones(2)}
    assert stack.get("done").tolist() == [[True, False], [False, False], [False, False]]
    assert [m["b"].sum().item() for m in members] == [4.0, 1.0]


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("lazy", [False, True])
def test_unflatten_keys_gives_new_non_tensor_entries(lib, lazy):
    # (the source's own NonTensorData and NonTensorStack were put in the result: an
    # element, a set_at_, a set_ or the lock on the result reached the source)
    td = lib.TensorDict({"a.b": torch.zeros(3)}, batch_size=[3])
    td["obs"] = lib.NonTensorStack(True, None, 3)
    td["txt"] = "walk"
    source = lib.lazy_stack([td, td.clone()]) if lazy else td
    out = source.unflatten_keys(".")
    out.set_at_("obs", "q", 0 if not lazy else (0, 0))
    out.set_("txt", "run")
    out.lock_()
    assert td.get("obs").tolist() == [True, None, 3] and td.get("txt").data == "walk"
    assert not td.get("obs").is_locked


@pytest.mark.parametrize("lib", LIBS)
def test_a_mask_selecting_nothing_from_a_stack_of_a_ragged_lazy_stack(lib):
    # (the empty selection stacked the first member's entries: "Failed to stack tensors")
    ragged = lib.lazy_stack([lib.TensorDict(a=torch.zeros(1, 3, 4), batch_size=[1, 3]),
                             lib.TensorDict(a=torch.zeros(1, 3), batch_size=[1, 3])], 2)
    outer = lib.lazy_stack([ragged], 1)
    empty = outer[torch.zeros(1, 1, 3, dtype=torch.bool)]
    assert empty.batch_size == torch.Size([0, 2]) and sorted(empty.keys()) == ["a"]
    assert outer[torch.tensor([[[True, False, True]]])].batch_size == torch.Size([2, 2])


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("rows", [[1, 1], [1, 0], 1])
def test_a_0d_tensordict_written_into_lazy_rows_beside_a_non_tensor_entry(lib, rows):
    # a source of batch [] whose leaf happened to start with the rows' size ([2] into 2
    # rows) was taken as of the rows' batch size when a non-tensor entry was beside it:
    # row 1 got next[1] = [0, 0] instead of the whole [4, 0], silently (found by the fuzzer)
    members = [lib.TensorDict({"next": torch.tensor([4, 0], dtype=torch.uint8)}, []),
               lib.TensorDict({"next": torch.tensor([3, 3], dtype=torch.uint8)}, [])]
    for member, text in zip(members, ("", "x")):
        member.set_non_tensor("a", text)
    stack = lib.lazy_stack(members)
    stack[rows] = stack[0].clone()
    assert [m["next"].tolist() for m in members] == [[4, 0], [4, 0]]
    assert stack.get("a").tolist() == ["", ""]


@pytest.mark.parametrize("kind", ["dense", "lazy"])
@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("how", ["update_", "update_inplace", "update_at_"])
def test_an_in_place_update_writes_a_dict_into_a_non_tensor_entry_as_one_value(kind, nested, how):
    # a dict given for a NonTensorData entry is its new Python value, as a TensorDict's
    # update_ keeps it (the README's differences: tensordict 0.15.3 keeps the old value or
    # raises KeyError); the lazy stack split it as a tensordict and raised a batch-size
    # error for its key 'd'
    import shared_td

    if kind == "lazy":
        node = shared_td.lazy_stack([shared_td.TensorDict(obs=torch.zeros(1), batch_size=[]) for _ in range(2)])
        for member in node.tensordicts:
            member.set_non_tensor("done", "walk")
    else:
        node = shared_td.TensorDict(obs=torch.zeros(2, 1), batch_size=[2]).set_non_tensor("done", "walk")
    root = shared_td.TensorDict({"b": node}, [2]) if nested else node
    source = {"done": {"d": 1}, "obs": torch.ones(2, 1)}
    source = {"b": source} if nested else source
    if how == "update_":
        root.update_(source)
    elif how == "update_inplace":
        root.update(source, inplace=True)
    else:
        root.update_at_(source, slice(None))
    assert node.get("done").tolist() == [{"d": 1}, {"d": 1}]
    assert node.get("obs").flatten().tolist() == [1.0, 1.0]
