"""Drop-in fixes of the 2026-12-06 (fifteenth) round, side by side with tensordict 0.15.3
where it is installed: found by running tensordict's upstream test_methods.py and
test_generic.py against shared_td (a probe outside the repository) and by fuzzer run 16."""
from __future__ import annotations

import pytest
import torch
import torch.utils._pytree as pytree

from tests.reference import LIBS, outcome


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("lazy", [False, True], ids=["TensorDict", "lazy"])
def test_update_in_place_takes_entries_as_keywords(lib, lazy):
    """``td.update_(a=x)`` writes ``x`` into ``a`` in place, as ``update(a=x)`` adds it
    (upstream test_update_kwargs; before: a TypeError)."""
    td = (lib.lazy_stack([lib.TensorDict(a=torch.zeros(())) for _ in range(3)]) if lazy
          else lib.TensorDict(a=torch.zeros(3), batch_size=[3]))
    before = td["a"] if not lazy else td.tensordicts[0]["a"]
    assert td.update_(a=torch.ones(3)) is td
    assert td["a"].tolist() == [1.0, 1.0, 1.0]
    if not lazy:
        assert td["a"] is before  # (in place: the same tensor)
    td.update_({"a": torch.full((3,), 2.0)}, a=torch.full((3,), 5.0))  # (the keywords win)
    assert td["a"].tolist() == [5.0, 5.0, 5.0]
    with pytest.raises(KeyError):
        td.update_(b=torch.ones(3))
    assert "b" not in td.keys()


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("method", ["update", "update_"])
def test_a_tensorclass_update_refuses_a_keyword_that_is_no_field(lib, method):
    """``tc.update_(bogus=x)`` (and ``update``) of a keyword that is neither a field nor
    an option raises a ValueError naming it, nothing written, as tensordict's (before:
    ignored in silence)."""

    @lib.tensorclass
    class Step:
        x: torch.Tensor

    step = Step(x=torch.zeros(2), batch_size=[2])
    getattr(step, method)(x=torch.ones(2))
    assert step.x.tolist() == [1.0, 1.0]
    with pytest.raises(ValueError, match="bogus"):
        getattr(step, method)(x=torch.full((2,), 3.0), bogus=torch.ones(2))
    assert step.x.tolist() == [1.0, 1.0] and list(step.keys()) == ["x"]
    getattr(step, method)(x=torch.full((2,), 4.0), non_blocking=False)  # (an option, not a field)
    assert step.x.tolist() == [4.0, 4.0]


_SOURCES = {  # (destination batch, source batch, source entries)
    "empty [4] into [3]": ([3], [4], {}),
    "nested empty [4] into [3]": ([3], [4], {"n": "td"}),
    "[4] into [3]": ([3], [4], {"x": (4,)}),
    "lazy [2, 3] into [3]": ([3], [2, 3], "lazy"),
    "empty [] into [3]": ([3], [], {}),
    "empty [3] into [3, 2]": ([3, 2], [3], {}),
    "[3, 2] into [3]": ([3], [3, 2], {"x": (3, 2)}),
    "[3] into []": ([], [3], {"x": (3,)}),
}


def _update(lib, case, inplace):
    mine, theirs, entries = _SOURCES[case]
    if entries == "lazy":
        source = lib.lazy_stack([lib.TensorDict(batch_size=theirs[1:]) for _ in range(theirs[0])])
    else:
        source = lib.TensorDict({k: lib.TensorDict(batch_size=theirs) if v == "td" else torch.zeros(v)
                                 for k, v in entries.items()}, batch_size=theirs)
    td = lib.TensorDict(batch_size=mine)
    td.update(source, inplace=inplace)
    return list(td.batch_size), {k: list(getattr(v, "batch_size", v.shape)) for k, v in td.items()}


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("case", list(_SOURCES))
def test_update_refuses_a_source_whose_batch_size_cannot_fit_even_when_empty(case, inplace):
    """tensordict 0.15.3 checks the batch sizes first: neither starting the other is a
    RuntimeError, even for a source with no entry (upstream test_update_batch_size_errors);
    shared_td accepted one and re-batched its nested tensordicts in silence."""
    import shared_td
    import tensordict
    from tests.reference import needs_tensordict

    ours = outcome(lambda: _update(shared_td, case, inplace))
    if needs_tensordict.args[0]:
        pytest.skip(needs_tensordict.kwargs["reason"])
    assert ours == outcome(lambda: _update(tensordict, case, inplace))
    if ours == "error":
        with pytest.raises(RuntimeError, match=r"batch size \[.*nothing was written"):
            _update(shared_td, case, inplace)


def test_update_in_place_of_an_empty_source_of_another_batch_size_is_still_accepted():
    """As tensordict's ``update_``: it checks no batch size (nothing is added)."""
    import shared_td

    td = shared_td.TensorDict(x=torch.zeros(3), batch_size=[3])
    assert td.update_(shared_td.TensorDict(batch_size=[4])) is td


@pytest.mark.parametrize("lib", LIBS)
def test_an_empty_tensordict_set_into_a_lazy_stack_takes_its_batch_size(lib):
    """``lazy["inner"] = TensorDict({...}, [])`` whose tensors start with the stack's batch
    size is re-batched, as ``TensorDict.set`` does (upstream test_nested_td_emptyshape;
    before: a BatchSizeMismatchError)."""
    lazy = lib.lazy_stack([lib.TensorDict(a=torch.zeros(3), batch_size=[3]) for _ in range(2)], 0)
    inner = lib.TensorDict({"x": torch.randn(2, 3, 1)}, [])
    lazy["inner"] = inner
    assert lazy["inner"].batch_size == torch.Size([2, 3])
    assert torch.equal(lazy["inner"]["x"], inner["x"])
    assert inner.batch_size == torch.Size([])  # (a copy is re-batched, not the value)
    lazy["empty"] = lib.TensorDict()
    assert lazy["empty"].batch_size == torch.Size([2, 3])
    with pytest.raises(RuntimeError):
        lazy["bad"] = lib.TensorDict({"x": torch.zeros(4)}, [])
    assert "bad" not in lazy.keys()


@pytest.mark.parametrize("lib", LIBS)
def test_the_values_of_a_non_tensor_stack_are_walked_by_pytree(lib):
    """torch's pytree walks ``td[key]`` of a NonTensorStack down to its values (upstream
    test_non_tensor_data[stacked_td]; before: one leaf, the whole list)."""
    lazy = lib.lazy_stack([lib.TensorDict(a=torch.zeros(3), batch_size=[3]) for _ in range(2)], 0)
    lazy["this", "other"] = "success"
    values = lazy["this", "other"]
    assert pytree.tree_leaves(values) == ["success"] * 6
    assert pytree.tree_map(str.upper, values) == [["SUCCESS"] * 3] * 2


def test_a_rebuilt_tree_of_linked_values_is_a_plain_list_that_writes_nothing():
    import shared_td

    td = shared_td.TensorDict(batch_size=[2])
    td["names"] = ["a", "b"]
    rebuilt = pytree.tree_map(str.upper, td["names"])
    assert type(rebuilt) is list and rebuilt == ["A", "B"]
    assert [path for path, _ in pytree.tree_flatten_with_path(td["names"])[0]] == [
        (pytree.SequenceKey(0),), (pytree.SequenceKey(1),)]
    assert td["names"] == ["a", "b"]


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("locked", [False, True])
def test_deleting_a_tensorclass_field_that_holds_none_is_a_no_op(lib, locked):
    """A field set to None holds no entry: ``del_`` leaves it None, as tensordict's
    (before: a KeyError; fuzzer run 16)."""

    @lib.tensorclass
    class Step:
        obs: torch.Tensor
        node: object = None

    step = Step(obs=torch.zeros(2), batch_size=[2])
    if locked:
        step.lock_()
    assert step.del_("node") is step
    assert step.node is None and list(step.keys()) == ["obs"]
    with pytest.raises(KeyError):
        step.del_("zzz")


def test_stack_into_an_out_that_lacks_a_key_names_it_and_writes_nothing():
    """README: shared_td refuses where tensordict 0.15.3 drops the key in silence (fuzzer
    run 16); the error names the key and ``out=``, not the ``update_`` it used inside."""
    import shared_td

    tds = [shared_td.TensorDict(a=torch.ones(2), b=torch.ones(2), batch_size=[2]) for _ in range(3)]
    out = shared_td.TensorDict(a=torch.zeros(3, 2), batch_size=[3, 2])
    with pytest.raises(KeyError, match=r"out=out.*'b'.*nothing was written"):
        torch.stack(tds, 0, out=out)
    assert out["a"].sum() == 0 and list(out.keys()) == ["a"]


def _ragged_parts(lib):
    def one(v):
        members = [lib.TensorDict({"h": torch.full((3,), v)}, []), lib.TensorDict({"h": torch.full((2,), v)}, [])]
        return lib.TensorDict({"lazy": lib.lazy_stack(members), "dense": torch.full((2,), v)}, [])

    return one(0.0), one(1.0)


@pytest.mark.parametrize("lib", LIBS)
def test_stacking_into_out_through_a_ragged_nested_lazy_stack(lib):
    """``lazy_stack([a, b], out=out)`` where the items hold a lazy stack whose tensors
    differ in shape writes into ``out`` (upstream test_lazy.py, 9 tests; before: "Failed
    to stack tensors", as checking out's keys read each leaf of the result densely)."""
    a, b = _ragged_parts(lib)
    out = a.unsqueeze(0).expand(2).clone()
    assert lib.LazyStackedTensorDict.lazy_stack([a, b], dim=0, out=out) is out
    assert out["dense"].tolist() == [[0.0, 0.0], [1.0, 1.0]]
    assert out[1]["lazy"][1]["h"].tolist() == [1.0, 1.0] and out[1]["lazy"][0]["h"].tolist() == [1.0] * 3


@pytest.mark.parametrize("lib", LIBS)
def test_in_finds_a_key_of_a_ragged_nested_lazy_stack(lib):
    a, _ = _ragged_parts(lib)
    assert ("lazy", "h") in a and ("lazy", "q") not in a and ("dense", "q") not in a


@pytest.mark.parametrize("lib", LIBS)
def test_get_passes_a_lazy_stacks_options_to_the_one_on_the_keys_path(lib):
    """``td.get(("inner", "x"), as_list=True)`` (or ``as_padded_tensor=True`` with its
    padding) where ``inner`` is a ragged lazy stack: the stack reads it (before: a
    TypeError; upstream test_lazy.py)."""
    inner = lib.lazy_stack([lib.TensorDict({"x": torch.ones(1)}), lib.TensorDict({"x": torch.ones(2) * 2})])
    td = lib.TensorDict(inner=inner, batch_size=[2])
    assert [t.tolist() for t in td.get(("inner", "x"), as_list=True)] == [[1.0], [2.0, 2.0]]
    padded = td.get(("inner", "x"), as_padded_tensor=True, padding_side="left", padding_value=100)
    assert padded.tolist() == [[100.0, 1.0], [2.0, 2.0]]
    assert td.get(("inner", "q"), as_list=True) is None
    dense = lib.TensorDict(a=torch.zeros(2), batch_size=[2])
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (tensordict warns that 0.17 will change this)
        assert torch.equal(dense.get("a", as_list=True), torch.zeros(2))  # (no stack on the way: the entry)


def test_get_refuses_a_keyword_it_does_not_know():
    import shared_td

    td = shared_td.TensorDict(a=torch.zeros(2), batch_size=[2])
    with pytest.raises(TypeError, match="bogus"):
        td.get("a", bogus=1)


@pytest.mark.parametrize("lib", LIBS)
def test_unravel_key_list_and_make_tensordict(lib):
    """Two public names of tensordict 0.15.3 that shared_td lacked (upstream test_utils.py,
    test_misc.py)."""
    assert lib.unravel_key_list(["a", ("b",), ("c", ("d",))]) == ["a", "b", ("c", "d")]
    with pytest.raises(TypeError):
        lib.unravel_key_list("a")
    td = lib.make_tensordict(a=torch.zeros(3, 4), b=torch.zeros(3))
    assert td.batch_size == torch.Size([]) and sorted(td.keys()) == ["a", "b"]
    td = lib.make_tensordict({"a": torch.zeros(3), "b": {"c": torch.zeros(3, 4)}}, auto_batch_size=True)
    assert td.batch_size == torch.Size([3]) and td["b"].batch_size == torch.Size([3, 4])
    td = lib.make_tensordict({"a": torch.ones(2)}, batch_size=[2], a=torch.zeros(2))
    assert td["a"].tolist() == [1.0, 1.0]  # (input_dict's entries win over the keywords)


@pytest.mark.parametrize("lib", LIBS)
def test_a_linked_list_shows_its_class(lib):
    """``repr``/``str`` of ``td[key]`` of a NonTensorStack say ``LinkedList(...)``, nested
    ones too, as tensordict's (upstream test_linked_list_str)."""
    td = lib.TensorDict(batch_size=[2, 2])
    td["n"] = [["a", "b"], ["c", "d"]]
    shown = "LinkedList([LinkedList(['a', 'b']), LinkedList(['c', 'd'])])"
    assert repr(td["n"]) == str(td["n"]) == f"{td['n']}" == shown
    assert td["n"] == [["a", "b"], ["c", "d"]] and repr(td["n"].tolist()) == "[['a', 'b'], ['c', 'd']]"


def _step_class(lib):
    @lib.tensorclass
    class Step:
        obs: torch.Tensor
        act: torch.Tensor = None

    return Step


def test_a_tensorclass_update_in_place_takes_keys_to_update():
    """A regression of this round's keyword check (fuzzer triage 14): ``keys_to_update``
    is an option of ``update_``, not a field (README: only the selected keys are
    written)."""
    import shared_td

    step = _step_class(shared_td)(obs=torch.zeros(2), act=torch.zeros(2), batch_size=[2])
    step.update_({"obs": torch.ones(2), "act": torch.ones(2)}, keys_to_update=["obs"])
    assert step.obs.tolist() == [1.0, 1.0] and step.act.tolist() == [0.0, 0.0]


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("how", ["as_list", "as_nested_tensor"])
def test_get_passes_the_options_to_a_lazy_stack_of_tensorclasses_on_the_path(lib, how):
    step = _step_class(lib)
    stack = lib.lazy_stack([step(obs=torch.zeros(2), batch_size=[]), step(obs=torch.zeros(3), batch_size=[])])
    got = lib.TensorDict(t=stack, batch_size=[2]).get(("t", "obs"), **{how: True})
    shapes = [x.shape for x in (got if how == "as_list" else got.unbind())]
    assert shapes == [torch.Size([2]), torch.Size([3])]


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("join", ["stack", "cat"])
def test_stack_and_cat_of_tensorclasses_write_into_out(lib, join):
    """``torch.stack(tcs, out=out)`` and ``torch.cat`` of tensorclasses wrote nothing into
    ``out`` (fuzzer triage 14): ``out`` is written, as tensordict's."""
    step = _step_class(lib)
    if join == "stack":
        out = step(obs=torch.zeros(2, 3), batch_size=[2])
        torch.stack([step(obs=torch.ones(3), batch_size=[]), step(obs=torch.full((3,), 2.0), batch_size=[])], out=out)
        assert out.obs[:, 0].tolist() == [1.0, 2.0]
    else:
        out = step(obs=torch.zeros(4, 3), batch_size=[4])
        torch.cat([step(obs=torch.ones(2, 3), batch_size=[2]), step(obs=torch.full((2, 3), 2.0), batch_size=[2])],
                  out=out)
        assert out.obs[:, 0].tolist() == [1.0, 1.0, 2.0, 2.0]


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("how", ["update", "update_", "update with keywords", "0-dim", "lazy"])
def test_a_tensordict_is_updated_from_a_tensorclass(lib, how):
    """``td.update(tc)`` (``update_`` too) writes the fields (before: "Iteration over a
    0-dim tensordict", the tensorclass walked as rows; fuzzer triage 14)."""
    step = _step_class(lib)
    td = lib.TensorDict(obs=torch.zeros(2), batch_size=[2])
    if how == "update":
        td.update(step(obs=torch.ones(2), batch_size=[2]))
    elif how == "update_":
        td.update_(step(obs=torch.ones(2), batch_size=[2]))
    elif how == "update with keywords":
        td.update(step(obs=torch.ones(2), batch_size=[2]), extra=torch.ones(2))
        assert td["extra"].tolist() == [1.0, 1.0]
    elif how == "0-dim":
        td = lib.TensorDict(obs=torch.zeros(())).update(step(obs=torch.ones(()), batch_size=[]))
    else:
        td = lib.lazy_stack([lib.TensorDict(obs=torch.zeros(())), lib.TensorDict(obs=torch.zeros(()))])
        td.update(step(obs=torch.ones(2), batch_size=[2]))
    assert (td["obs"] == 1).all()


def _noted_step_class(lib):
    from typing import Any

    @lib.tensorclass
    class Noted:
        obs: torch.Tensor
        info: Any

    return Noted


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("how", ["update_", "update"])
def test_keys_to_update_reaches_a_field_of_a_nested_tensorclass(lib, how):
    """``td.update_(src, keys_to_update=[("c", "obs")])`` where ``c`` is a tensorclass:
    its field is written (before: left as it was, in silence; fuzzer run 18)."""
    noted = _noted_step_class(lib)
    td = lib.TensorDict({"a": torch.zeros(2), "c": noted(obs=torch.zeros(2, 3), info="run", batch_size=[2])}, [2])
    src = lib.TensorDict({"a": torch.ones(2), "c": noted(obs=torch.ones(2, 3), info="walk", batch_size=[2])}, [2])
    getattr(td, how)(src, keys_to_update=[("c", "obs"), "a"])
    assert td["a"].tolist() == [1.0, 1.0] and td["c"].obs[:, 0].tolist() == [1.0, 1.0]
    assert td["c"].info == "run"


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("deeper", [False, True])
def test_stack_into_out_writes_a_nested_tensorclass_with_a_non_tensor_field(lib, deeper):
    """``torch.stack(items, out=out)`` where the items hold a tensorclass with a non-tensor
    field left that field's tensors at out's old values (fuzzer run 18: 8 records)."""
    noted = _noted_step_class(lib)
    item = lib.TensorDict({"a": torch.ones(2), "c": noted(obs=torch.ones(2, 3), info="run", batch_size=[2])}, [2])
    if deeper:
        item = lib.TensorDict({"n": item}, [2])
    other = item.clone()
    other.apply_(lambda t: t.add_(1))
    out = torch.stack([item.clone(), other.clone()], 0)
    out.zero_()
    torch.stack([item, other], 0, out=out)
    written = out["n", "c"] if deeper else out["c"]
    assert written.obs[..., 0].tolist() == [[1.0, 1.0], [2.0, 2.0]]


@pytest.mark.parametrize("batch", [[2, 5], [1, 5], [3, 3]])
def test_a_lazy_stack_refuses_an_update_whose_batch_size_cannot_fit(batch):
    """As a TensorDict does (an empty source too); nothing written (fuzzer run 18;
    README: tensordict 0.15.3 checks member by member and lets [3, 3] pass)."""
    import shared_td

    lazy = shared_td.lazy_stack([shared_td.TensorDict(x=torch.zeros(3), batch_size=[3]) for _ in range(2)])
    with pytest.raises(RuntimeError, match="nothing was written"):
        lazy.update(shared_td.TensorDict(n=shared_td.TensorDict(batch_size=batch), batch_size=batch))
    assert list(lazy.keys()) == ["x"]


@pytest.mark.parametrize("lib", LIBS)
def test_padding_refuses_a_value_the_dtype_cannot_hold(lib):
    """``as_padded_tensor=True, padding_value=-1`` of uint8 tensors: torch's
    ``pad_sequence`` and tensordict refuse it (before: padded with 255; fuzzer run 18)."""
    lazy = lib.lazy_stack([lib.TensorDict(x=torch.ones(1, dtype=torch.uint8)),
                           lib.TensorDict(x=torch.ones(2, dtype=torch.uint8))])
    with pytest.raises(RuntimeError, match="overflow"):
        lazy.get("x", as_padded_tensor=True, padding_value=-1)
    assert lazy.get("x", as_padded_tensor=True, padding_value=7).tolist() == [[1, 7], [1, 1]]


@pytest.mark.parametrize("lib", LIBS)
def test_keys_to_update_below_a_tensorclass_the_tree_lacks_adds_it_whole(lib):
    """``td.update(src, keys_to_update=[("c", "obs")])`` where ``src["c"]`` is a
    tensorclass and ``td`` has no ``c``: the tensorclass is added whole, as tensordict's
    (this round's first descent into tensorclass fields added a TensorDict of ``obs``
    only; fuzzer run 19)."""
    noted = _noted_step_class(lib)
    td = lib.TensorDict({"a": torch.zeros(2)}, [2])
    src = lib.TensorDict({"a": torch.ones(2), "c": noted(obs=torch.ones(2, 3), info="walk", batch_size=[2])}, [2])
    td.update(src, keys_to_update=[("c", "obs")])
    assert type(td["c"]) is noted and td["c"].info == "walk" and td["c"].obs[:, 0].tolist() == [1.0, 1.0]
    assert td["a"].tolist() == [0.0, 0.0]
