"""Drop-in fixes of the 2026-12-06 (fourteenth) round, side by side with tensordict 0.15.3
where it is installed: found by the differential fuzzer (run 12, seeds 130000-136699)."""
from __future__ import annotations

import pytest
import torch

from tests.reference import LIBS


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("source", ["share_memory_", "memmap share_non_tensor", "memmap"])
@pytest.mark.parametrize("index", ["list", "tensor", "mask"])
def test_a_row_copy_of_a_shared_or_mapped_value_never_writes_into_its_source(lib, source, index, tmp_path):
    """``y = td[[0]]`` (an index list, tensor or mask) is a copy, its non-tensor values
    too: a write into it stays there (before, a shared or memory-mapped NonTensorData's
    copy kept its cell or its files, and ``y.set("c", None, inplace=True)`` replaced the
    source's value, on disk too; fuzzer seed 132994)."""
    td = lib.TensorDict({}, [1, 3])
    td.set_non_tensor("c", "run")
    if source == "share_memory_":
        td.share_memory_()
    else:
        td = td.memmap(tmp_path / "save", share_non_tensor=source.endswith("non_tensor"))
    rows = {"list": [0], "tensor": torch.tensor([0]), "mask": torch.tensor([True])}[index]
    copy = td[rows]
    copy.set("c", None, inplace=True)
    if lib.__name__ == "shared_td":  # (tensordict 0.15.3 makes it a stack of None per row)
        assert copy.get_non_tensor("c") is None
    assert td.get_non_tensor("c") == "run"
    if source != "share_memory_":
        assert lib.TensorDict.load_memmap(tmp_path / "save").get_non_tensor("c") == "run"


def test_a_row_view_of_a_shared_value_still_writes_into_it():
    """A slice or an int index is a view: its write reaches the shared value (README:
    the views that write through), unlike the copies above."""
    import shared_td

    td = shared_td.TensorDict({}, [1, 3])
    td.set_non_tensor("c", "run")
    td.share_memory_()
    td[0:1].set("c", "walk", inplace=True)
    assert td.get_non_tensor("c") == "walk"


@pytest.mark.parametrize("lib", LIBS)
def test_an_index_write_of_a_value_holding_a_ragged_lazy_stack(lib):
    """``lazy[[0]] = row``, where ``row`` holds a nested lazy stack whose members' leaves
    have different shapes, writes it member by member (before: 'Failed to stack tensors
    ... under the key r', from reading the value's ragged leaf stacked; fuzzer seed
    135568)."""
    def row(k):
        inner = lib.lazy_stack([lib.TensorDict({"r": torch.arange(n) + k}, []) for n in (4, 1, 1)], 0)
        return lib.TensorDict({"next": inner, "b": torch.tensor(k)}, [])

    stack = lib.lazy_stack([row(0), row(10)], 0)
    stack[[0]] = stack[1].clone()
    first = stack.tensordicts[0]
    assert [member["r"].tolist() for member in first["next"].tensordicts] == [[10, 11, 12, 13], [10], [10]]
    assert first["b"].item() == 10
    assert [member["r"].tolist() for member in stack.tensordicts[1]["next"].tensordicts] == [[10, 11, 12, 13], [10], [10]]


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("source", ["share_memory_", "memmap_"])
@pytest.mark.parametrize("index", ["empty list", "empty tensor", "all-False mask"])
@pytest.mark.parametrize("write", ["set inplace", "update_"])
def test_a_selection_of_no_row_never_writes_into_the_source(lib, source, index, write, tmp_path):
    """Nothing selected, nothing written back: a non-tensor write into ``td[[]]`` of a
    shared or memory-mapped tree left the source's value replaced for every row."""
    td = lib.TensorDict({"obs": torch.zeros(2)}, [2])
    td.set_non_tensor("info", "walk")
    td.share_memory_() if source == "share_memory_" else td.memmap_(tmp_path / "save")
    rows = {"empty list": [], "empty tensor": torch.tensor([], dtype=torch.long),
            "all-False mask": torch.tensor([False, False])}[index]
    none = td[rows]
    none.set("info", "CHANGED", inplace=True) if write == "set inplace" else none.update_({"info": "CHANGED"})
    assert td.get_non_tensor("info") == "walk"


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("source", ["share_memory_", "memmap_"])
@pytest.mark.parametrize("index", ["list", "tensor", "mask"])
def test_a_row_copy_of_a_shared_or_mapped_stack_takes_writes_of_its_own(lib, source, index, tmp_path):
    """A NonTensorStack's selection by an index list, tensor or mask is a copy: a write
    into it is its own (before: refused with 'Cannot update a leaf NonTensorDataBase',
    the refusal meant for the views of such a stack). tensordict 0.15.3 writes a shared
    stack's copy into the stack."""
    td = lib.TensorDict({"obs": torch.zeros(3), "s": lib.NonTensorStack("a", "b", "c")}, [3])
    td.share_memory_() if source == "share_memory_" else td.memmap_(tmp_path / "save")
    rows = {"list": [0, 2], "tensor": torch.tensor([0, 2]), "mask": torch.tensor([True, False, True])}[index]
    copy = td[rows]
    copy.set("s", lib.NonTensorStack("Y", "Z"), inplace=True)
    assert copy.get("s").tolist() == ["Y", "Z"]
    if lib.__name__ == "shared_td" or source == "memmap_":
        assert td.get("s").tolist() == ["a", "b", "c"]


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("prepare", ["lock_", "memmap_"])
@pytest.mark.parametrize("method", ["flatten_keys", "unflatten_keys"])
def test_a_keys_block_on_a_locked_tree_writes_its_entries_back_in_place(lib, prepare, method, tmp_path):
    """Leaving ``with td.flatten_keys() as flat:`` on a locked tree (``lock_()``, or any
    tree after ``memmap_()``) writes the entries replaced in the block back in place, as
    on an unlocked one (before: a locked tree was left as it was, the block's writes lost
    in silence); a key added in the block is left out, as tensordict's ``update_`` skips
    it (a locked tree takes no new key)."""
    td = lib.TensorDict({"obs": torch.zeros(2), "n": {"a": torch.zeros(2)}}, [2])
    td.lock_() if prepare == "lock_" else td.memmap_(tmp_path / "save")
    with getattr(td, method)(".") as keys:
        keys["obs"] = keys["obs"] + 1
        keys["added"] = torch.ones(2)
        if method == "flatten_keys":
            keys["n.a"] = keys["n.a"] + 2
    assert td["obs"].tolist() == [1.0, 1.0]
    assert td["n", "a"].tolist() == ([2.0, 2.0] if method == "flatten_keys" else [0.0, 0.0])
    assert "added" not in td.keys()
    if prepare == "memmap_":
        assert lib.TensorDict.load_memmap(tmp_path / "save")["obs"].tolist() == [1.0, 1.0]


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("prepare", ["lock_", "share_memory_"])
@pytest.mark.parametrize("op", ["flatten", "view"])
@pytest.mark.parametrize("values", [("x", "x"), ("x", "y")])
def test_an_empty_shape_block_on_a_locked_lazy_stack_of_non_tensor_values(lib, prepare, op, values):
    """Leaving an empty ``with lazy.flatten(0, -1):`` (or ``view(-1)``) block on a locked
    lazy stack whose members hold a NonTensorData writes the same values back (before:
    a ValueError 'Cannot write a NonTensorStack ... into a NonTensorData', the write-back
    split along another dim than the members'; fuzzer seed 141040)."""
    members = []
    for value in values:
        member = lib.TensorDict({"c": torch.zeros(1, 2)}, [1, 2])
        member.set_non_tensor("s", value)
        members.append(member)
    stack = lib.lazy_stack(members, 0)
    getattr(stack, prepare)()
    with (stack.flatten(0, -1) if op == "flatten" else stack.view(-1)):
        pass
    assert stack.get("s").tolist() == [[[values[0]] * 2], [[values[1]] * 2]]


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("prepare", ["lock_", "memmap_"])
@pytest.mark.parametrize("method", ["flatten_keys", "unflatten_keys"])
def test_a_keys_block_on_a_locked_lazy_stack_writes_what_it_has(lib, prepare, method, tmp_path):
    """The key blocks on a locked lazy stack write the replaced entries back and skip the
    keys added (before: KeyError from the stack's ``update_``, which looked for missing
    keys before reading ``keys_to_update``; fuzzer seeds 150739, 152736)."""
    def member():
        return lib.TensorDict({"a": torch.zeros(2), "n": {"b": torch.zeros(2)}}, [2])

    stack = lib.lazy_stack([member(), member()])
    stack.lock_() if prepare == "lock_" else stack.memmap_(tmp_path / "save")
    with getattr(stack, method)() as keys:
        keys["new"] = torch.ones(2, 2)
        keys["a"] = torch.ones(2, 2)
    assert stack["a"].sum().item() == 4.0
    assert "new" not in stack.keys()


@pytest.mark.parametrize("lib", LIBS)
def test_a_lazy_update_in_place_reads_only_the_keys_to_update(lib):
    stack = lib.lazy_stack([lib.TensorDict({"a": torch.zeros(2)}, [2]) for _ in range(2)])
    stack.update_({"a": torch.ones(2, 2), "new": torch.ones(2, 2)}, keys_to_update=["a"])
    assert stack["a"].sum().item() == 4.0 and "new" not in stack.keys()


@pytest.mark.parametrize("lib", LIBS)
def test_new_like_of_a_lazy_stack_of_tensorclasses_leaves_a_stacked_field_empty(lib):
    """``new_zeros`` of a lazy stack of tensorclasses whose non-tensor field differs across
    members: the field has no value for the new rows, an empty tensordict as for a plain
    NonTensorStack key (before: a NonTensorData holding the old rows' list; fuzzer seed
    140558)."""
    from typing import Any

    @lib.tensorclass
    class Tagged:
        info: Any

    stack = lib.lazy_stack([Tagged(info="w", batch_size=[3]), Tagged(info="z", batch_size=[3])])
    field = stack.new_zeros(2)._tensordict.get("info")
    assert isinstance(field, lib.TensorDict) and not list(field.keys())


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("index, kind, shape", [
    ((0, None), "NonTensorData", (1,)), ((None, 0), "NonTensorData", (1,)),
    ([0], "NonTensorStack", (1,)), (None, "NonTensorStack", (1, 3)), (0, "NonTensorData", ())])
def test_a_stack_indexed_to_one_element_with_dims_added_is_that_element(lib, index, kind, shape):
    """``stack[0, None]``: the element at 0 with a dim added, a NonTensorData, as in
    tensordict 0.15.3 (it stayed a NonTensorStack of one value); a list index keeps the
    stack's dim (a stack of one)."""
    out = lib.NonTensorStack("a", "b", "c")[index]
    assert type(out).__name__ == kind and tuple(out.batch_size) == shape


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("index, kind, shape", [
    ((None, 1, 0), "NonTensorData", (1,)), ((0, None, None, 1), "NonTensorData", (1, 1)),
    ((0, None), "NonTensorStack", (1, 2)), ((None, 0, [1]), "NonTensorStack", (1, 1))])
def test_a_nested_stack_indexed_to_one_element_with_dims_added(lib, index, kind, shape):
    inner = lib.NonTensorStack(lib.NonTensorStack("a", "b"), lib.NonTensorStack("c", "d"))
    out = inner[index]
    assert type(out).__name__ == kind and tuple(out.batch_size) == shape


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("root", ["td", "lazy"])
@pytest.mark.parametrize("how", ["to('cpu')", "cpu()", "to(torch.float64)"])
def test_a_to_block_writes_back_on_the_sources_dtypes(lib, root, how):
    """Leaving ``with td.to(...) as t:`` writes ``t`` back into ``td`` (keys added and
    entries replaced in the block; each tensor back in its dtype when ``to`` cast them),
    as tensordict 0.15.3 (before, nothing was written back)."""
    td = lib.TensorDict({"a": torch.zeros(2), "n": {"b": torch.zeros(2)}}, [2])
    if root == "lazy":
        td = lib.lazy_stack([td[0], td[1]])
    with eval("td." + how) as t:
        t["a"] = torch.ones(2, dtype=t["a"].dtype)
        t["n", "b"] += 2
        t["new"] = torch.ones(2)
    assert td["a"].tolist() == [1.0, 1.0] and td["a"].dtype == torch.float32
    assert td["n", "b"].tolist() == [2.0, 2.0] and "new" in td.keys()


def test_a_to_result_holds_its_source_weakly():
    import gc
    import weakref

    import shared_td

    td = shared_td.TensorDict({"a": torch.zeros(2)}, [2])
    source = weakref.ref(td)
    cast = td.to(torch.float64)
    del td
    gc.collect()
    assert source() is None and cast["a"].dtype == torch.float64


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("source", ["plain", "share_memory_", "memmap_"])
def test_the_values_of_a_stack_are_a_list_that_writes_back(lib, source, tmp_path):
    """``td["names"]`` of a NonTensorStack is a LinkedList, as tensordict 0.15.3's: an
    item or slice assignment writes into the tensordict (before: a plain list, the write
    lost in silence); ``tolist()`` is a plain copy."""
    td = lib.TensorDict(batch_size=[3])
    td["names"] = ["a", "b", "c"]
    if source == "share_memory_":
        td.share_memory_()
    elif source == "memmap_":
        td.memmap_(tmp_path / "save")
    values = td["names"]
    values[0] = "z"
    values[1:] = ["y", "x"]
    assert td.get("names").tolist() == ["z", "y", "x"] == values
    assert type(values.tolist()) is list
    if source == "memmap_":
        assert lib.TensorDict.load_memmap(tmp_path / "save").get("names").tolist() == ["z", "y", "x"]


@pytest.mark.parametrize("lib", LIBS)
def test_a_nested_stacks_values_write_back_at_their_position_and_unlink_on_a_length_change(lib):
    import pickle

    td = lib.TensorDict(batch_size=[2, 2])
    td["s"] = [["a", "b"], ["c", "d"]]
    values = td["s"]
    values[0][1] = "z"
    values[1] = ["p", "q"]
    assert td.get("s").tolist() == [["a", "z"], ["p", "q"]]
    copy = pickle.loads(pickle.dumps(values))
    assert copy == [["a", "z"], ["p", "q"]]
    copy[0] = ["no", "link"]
    values.append("x")  # a length change unlinks: later assignments stay in the list
    values[0] = ["m", "n"]
    assert td.get("s").tolist() == [["a", "z"], ["p", "q"]]


def test_a_value_the_stack_refuses_leaves_the_list_as_it_was(tmp_path):
    import shared_td

    td = shared_td.TensorDict(batch_size=[2])
    td["s"] = ["a", "b"]
    td.memmap_(tmp_path / "save")
    values = shared_td.TensorDict.load_memmap(tmp_path / "save", mode="r")["s"]
    with pytest.raises(shared_td.ReadOnlyError):
        values[0] = "z"
    assert values == ["a", "b"]


def test_a_key_block_of_a_tensorclass_never_adds_a_key_that_is_no_field():
    """``tc.flatten_keys()`` of a tensorclass with a nested tensordict field gives a
    TensorDict (tensordict 0.15.3 raises at the call); leaving its block with a key that
    is no field raises a ValueError and writes nothing (before: the key was put into the
    instance, which ``set`` and ``update`` refuse; fuzzer seed 153463), while the
    block's writes to fields still reach it."""
    import shared_td

    @shared_td.tensorclass
    class Step:
        obs: torch.Tensor
        inner: shared_td.TensorDict

    step = Step(obs=torch.zeros(2), inner=shared_td.TensorDict({"c": torch.zeros(2)}, [2]), batch_size=[2])
    with pytest.raises(ValueError, match="'new'"):
        with step.flatten_keys(".") as flat:
            flat.set("new", torch.ones(2))
            flat["obs"] = torch.ones(2)
    assert sorted(step._tensordict.keys()) == ["inner", "obs"] and step.obs.tolist() == [0.0, 0.0]
    with step.flatten_keys(".") as flat:
        flat["inner.c"] = torch.ones(2)
        flat["inner.d"] = torch.ones(2)
    assert step.inner["c"].tolist() == [1.0, 1.0] and "d" in step.inner.keys()
