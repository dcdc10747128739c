"""Drop-in fixes of the 2026-12-06 (thirteenth) round, side by side with tensordict 0.15.3
where it is installed: found by tensordict's upstream tests and the differential fuzzer."""
from __future__ import annotations

import pytest
import torch

from tests.reference import LIBS


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("method", ["new_empty", "new_zeros", "new_ones"])
def test_new_like_keeps_a_non_tensor_value_for_every_row(lib, method):
    """A NonTensorData entry keeps its value, over the new batch size (before: an empty
    tensordict took its place, the value lost); a NonTensorStack still gives an empty
    tensordict (no value for the new rows), as tensordict 0.15.3."""
    td = lib.TensorDict(a=lib.NonTensorStack("a", "b").unsqueeze(-1), s="x", n={"t": "y"}, x=torch.ones(2),
                        batch_size=(2,))
    out = getattr(td, method)((4, 3))
    assert type(out.get("s")).__name__ == "NonTensorData" and out.get("s").batch_size == (4, 3)
    assert out["s"] == "x" and out["n", "t"] == "y"
    assert type(out.get("a")).__name__ == "TensorDict" and out.get("a").batch_size == (4, 3, 1)
    assert out["x"].shape == (4, 3)


@pytest.mark.parametrize("lib", LIBS)
def test_a_value_of_another_kind_written_in_place_raises_what_tensordict_users_catch(lib):
    """tensordict 0.15.3 raises a RuntimeError (a string into a tensor entry) and a
    ValueError that is a RuntimeError (a tensor into a string entry); shared_td's
    InPlaceKindError is both, and still the TypeError it was (found by tensordict's
    upstream test_set)."""
    td = lib.TensorDict(x=torch.ones(3), s="text", batch_size=[3])
    with pytest.raises(RuntimeError):
        td.set("x", "a string", inplace=True)
    with pytest.raises(RuntimeError) as caught:
        td.set("s", torch.zeros(3), inplace=True)
    assert isinstance(caught.value, ValueError)
    if lib.__name__ == "shared_td":
        assert isinstance(caught.value, TypeError) and "'s'" in str(caught.value)
    assert torch.equal(td["x"], torch.ones(3)) and td["s"] == "text"


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("source", ["share_memory_", "memmap_"])
@pytest.mark.parametrize("how", ["plain", "share_memory", "pickled"])
@pytest.mark.parametrize("write", ["set_", "update_"])
def test_consolidate_gives_non_tensor_values_of_its_own(lib, source, how, write, tmp_path):
    """A consolidated copy of a tree whose non-tensor values are shared or memory-mapped
    does not write into them (it kept the source's shared cell: ``set_`` on the copy
    changed the source; fuzzer seed 91384)."""
    import pickle

    td = lib.TensorDict({"a": torch.zeros(2)}, [2])
    td.set_non_tensor("text", "old")
    td.share_memory_() if source == "share_memory_" else td.memmap_(tmp_path / "save")
    out = td.consolidate(share_memory=how == "share_memory")
    if how == "pickled":
        out = pickle.loads(pickle.dumps(out))
    out.unlock_()
    out.set_("text", "new") if write == "set_" else out.update_({"text": "new"})
    assert td.get_non_tensor("text") == "old" and out.get_non_tensor("text") == "new"


def _handles(lib, how):
    """``(tree to load into, a node of it taken before the load)``."""
    if how == "nested":
        tree = lib.TensorDict({"n": lib.TensorDict({"a": torch.zeros(2)}, [2])}, [2])
        return tree, tree.get("n")
    members = [lib.TensorDict({"a": torch.zeros(2)}, [2]) for _ in range(2)]
    if how == "member":
        return lib.LazyStackedTensorDict(*members, stack_dim=0), members[0]
    root = lib.LazyStackedTensorDict(*members, stack_dim=0)
    return root[[0]], root  # (fuzzer seed 95249: the stack holds root's member 0)


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("how", ["nested", "member", "indexed stack"])
@pytest.mark.parametrize("memmapped", [False, True])
def test_load_memmap_loads_into_the_nodes_the_tree_has(lib, how, memmapped, tmp_path):
    """A nested tensordict or lazy-stack member taken before ``load_memmap_`` sees the
    loaded values and the writes made through the tree afterwards (they were replaced by
    the loaded ones: the handle kept the old values; fuzzer seed 95249)."""
    tree, handle = _handles(lib, how)
    saved = tree.clone()
    saved.apply_(lambda t: t + 5)
    saved.memmap(tmp_path / "save")
    if memmapped:
        tree.memmap_(tmp_path / "own")
    tree.load_memmap_(tmp_path / "save")
    first = handle.get("a")[0].tolist() if how == "indexed stack" else handle.get("a").tolist()
    assert first == [5.0, 5.0]
    if memmapped and (how == "nested" or lib.__name__ == "shared_td"):  # the kept node is memory-mapped
        # into the loaded directory (tensordict 0.15.3 unlocks a stack's members: README)
        node = tree.get("n") if how == "nested" else tree.tensordicts[0]
        assert node.is_memmap() and str(node.saved_path).startswith(str(tmp_path / "save"))
    if tree.is_locked:
        tree.unlock_()
    tree.apply_(lambda t: t + 1)
    assert (handle.get("a")[0] if how == "indexed stack" else handle.get("a")).tolist() == [6.0, 6.0]


def test_load_memmap_into_a_lazy_stack_of_another_batch_size_is_refused(tmp_path):
    """(it took the save's batch size in silence; tensordict 0.15.3 keeps its own over
    the save's leaves; a TensorDict raises the same BatchSizeMismatchError)"""
    import shared_td

    small = shared_td.lazy_stack([shared_td.TensorDict(a=torch.ones(1), batch_size=[1]) for _ in range(2)])
    small.memmap(tmp_path / "save")
    stack = shared_td.lazy_stack([shared_td.TensorDict(a=torch.zeros(3), batch_size=[3]) for _ in range(2)])
    with pytest.raises(shared_td.BatchSizeMismatchError, match=r"\[2, 1\].*\[2, 3\]"):
        stack.load_memmap_(tmp_path / "save")
    assert stack.batch_size == (2, 3) and stack["a"].tolist() == [[0.0] * 3] * 2


@pytest.mark.parametrize("lib", LIBS)
def test_tensorclass_update_of_none_at_a_nested_key_writes_it(lib):
    """``tc.update({("inner", "a"): None})`` writes None into the nested entry, as
    TensorDict.update and tensordict 0.15.3 do (it was dropped with the None given to
    the class's own fields, and the old value kept; fuzzer seed 103163)."""
    inner = lib.TensorDict(batch_size=[1])
    inner.set_non_tensor("a", "walk")

    @lib.tensorclass
    class Step:
        inner: lib.TensorDict
        info: str

    step = Step(inner=inner, info="walk", batch_size=[1])
    step.update({("inner", "a"): None, "info": None})
    value = step.inner.get_non_tensor("a")  # (tensordict 0.15.3: its LinkedList([None]))
    assert (value is None or list(value) == [None]) and step.info is None


@pytest.mark.parametrize("lib", LIBS)
def test_non_tensor_items_of_a_lazy_stack_with_ragged_tensors(lib):
    """``non_tensor_items``/``filter_non_tensor_data`` of a lazy stack whose members hold
    tensors of different shapes under one key read only the non-tensor keys (they read
    every key stacked: "Failed to stack tensors"; fuzzer seed 110519)."""
    members = [lib.TensorDict(a=torch.zeros(3, n), s=text, n={"t": text, "u": torch.zeros(3, n + 1)}, batch_size=[3])
               for n, text in ((1, "x"), (4, "z"))]
    stack = lib.lazy_stack(members)
    items = dict(stack.non_tensor_items(True))
    assert set(items) == {"s", ("n", "t")} and items["s"].tolist() == [["x"] * 3, ["z"] * 3]
    assert set(stack.filter_non_tensor_data().keys(True, True)) == {"a", ("n", "u")}


def test_non_tensor_items_of_a_tree_holding_a_ragged_lazy_stack():
    """The same through a dense tree that holds such a stack (fuzzer seed 120177; with
    members this ragged tensordict 0.15.3 raises too); keys and kinds as tensordict's
    for a stack that is not ragged (the test above)."""
    import shared_td

    members = [shared_td.TensorDict(a=torch.zeros(3, n), s=text, batch_size=[3]) for n, text in ((1, "x"), (4, "z"))]
    root = shared_td.TensorDict(l=shared_td.lazy_stack(members, 1), t="top", n={"u": "deep", "v": torch.zeros(2)},
                                batch_size=[])
    assert [key for key, _ in root.non_tensor_items(True)] == [("l", "s"), "t", ("n", "u")]
    assert [key for key, _ in root.non_tensor_items()] == ["t"]
    assert set(root.filter_non_tensor_data().keys(True, True)) == {("l", "a"), ("n", "v")}
