"""``update(source, update_batch_size=True)`` and ``update`` of a lazy stack over a
TensorDict node, side by side with tensordict 0.15.3 where it is installed (before: a
TypeError, "update_batch_size is not supported by shared_td", and the lazy stack was
merged into the TensorDict, which raised "Failed to stack tensors" for a ragged one)."""
from __future__ import annotations

import warnings

import pytest
import torch

import shared_td
from tests.reference import LIBS, dim_names


def _update(td, source, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # (tensordict's about a prefix batch size)
        return td.update(source, update_batch_size=True, **options)


def _keys(td) -> list:
    return sorted(map(str, td.keys(True)))


@pytest.mark.parametrize("lib", LIBS)
def test_the_destination_takes_the_source_batch_size_keeping_its_nested_tensordicts(lib):
    td = lib.TensorDict(a=torch.zeros(3), b={"c": torch.zeros(3, 2)}, batch_size=[3])
    nested = td["b"]
    source = lib.TensorDict(a=torch.ones(5), b={"c": torch.ones(5, 2), "d": torch.ones(5, 7)}, e=torch.ones(5),
                            batch_size=[5])
    assert _update(td, source) is td
    assert td.batch_size == (5,) and td["b"] is nested and nested.batch_size == (5,)
    assert _keys(td) == ["('b', 'c')", "('b', 'd')", "a", "b", "e"]
    assert td["a"] is source["a"] and td["b", "c"] is source["b", "c"]  # (by reference, as update)
    assert td["b", "d"].shape == (5, 7)


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("theirs, expected", [([5, 4], [5, 4]), ([5], [5])], ids=["deeper", "shallower"])
def test_a_nested_tensordict_takes_its_source_batch_size(lib, theirs, expected):
    td = lib.TensorDict(b=lib.TensorDict(c=torch.zeros(3, 2), batch_size=[3, 2]), batch_size=[3])
    source = lib.TensorDict(b=lib.TensorDict(c=torch.ones(5, 4), batch_size=theirs), batch_size=[5])
    _update(td, source)
    assert td.batch_size == (5,) and list(td["b"].batch_size) == expected and td["b", "c"].shape == (5, 4)


@pytest.mark.parametrize("lib", LIBS)
def test_under_a_root_that_fits_only_the_nested_tensordict_changes(lib):
    td = lib.TensorDict(b=lib.TensorDict(c=torch.zeros(3, 2), batch_size=[3, 2]), x=torch.zeros(3), batch_size=[3])
    x = td["x"]
    _update(td, lib.TensorDict(b=lib.TensorDict(c=torch.ones(3, 4), batch_size=[3, 4]), batch_size=[3]))
    assert td.batch_size == (3,) and td["b"].batch_size == (3, 4) and td["x"] is x


@pytest.mark.parametrize("lib", LIBS)
def test_a_batch_size_that_starts_the_source_is_kept(lib):
    td = lib.TensorDict(a=torch.zeros(()), batch_size=[])
    _update(td, lib.TensorDict(a=torch.ones(2), batch_size=[2]))
    assert td.batch_size == () and td["a"].tolist() == [1.0, 1.0]


@pytest.mark.parametrize("lib", LIBS)
def test_a_new_batch_size_drops_the_dim_names(lib):
    td = lib.TensorDict(a=torch.zeros(3), batch_size=[3], names=["time"])
    _update(td, lib.TensorDict(a=torch.ones(5), batch_size=[5]))
    assert td.batch_size == (5,) and dim_names(td) is None


@pytest.mark.parametrize("lib", LIBS)
def test_non_tensor_values_follow(lib):
    td = lib.TensorDict(a=torch.zeros(3), s="x", batch_size=[3])
    _update(td, lib.TensorDict(a=torch.ones(5), s="y", batch_size=[5]))
    assert td.batch_size == (5,) and td["s"] == "y" and td.get("s").batch_size == (5,)


@pytest.mark.parametrize("lib", LIBS)
def test_tensorclasses_root_and_nested(lib):
    @lib.tensorclass
    class Point:
        x: torch.Tensor

    td = lib.TensorDict(p=Point(x=torch.zeros(3), batch_size=[3]), batch_size=[3])
    _update(td, lib.TensorDict(p=Point(x=torch.ones(5), batch_size=[5]), batch_size=[5]))
    assert td.batch_size == (5,) and type(td["p"]) is Point and td["p"].batch_size == (5,)
    point = Point(x=torch.zeros(3), batch_size=[3])
    _update(point, Point(x=torch.ones(5), batch_size=[5]))
    assert point.batch_size == (5,) and point.x.tolist() == [1.0] * 5


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("case", ["key missing from the source", "inplace", "keys_to_update", "locked", "memmap"])
def test_what_cannot_be_rebatched_raises_and_changes_nothing(lib, case, tmp_path):
    td = lib.TensorDict(a=torch.zeros(3), n={"x": torch.zeros(3)}, batch_size=[3])
    source = lib.TensorDict(a=torch.ones(5), n={"x": torch.ones(5)}, batch_size=[5])
    options = {}
    if case == "key missing from the source":
        td["only_here"] = torch.zeros(3)
    elif case == "inplace":
        options = {"inplace": True}
    elif case == "keys_to_update":
        options = {"keys_to_update": ["a"]}
    elif case == "locked":
        td.lock_()
    else:
        td.memmap_(tmp_path / "td")
    before = {key: value for key, value in td.items(True, True)}
    with pytest.raises(RuntimeError) as raised:
        _update(td, source, **options)
    if lib is shared_td:
        assert "Nothing was written" in str(raised.value)
        if case == "key missing from the source":
            assert "'only_here'" in str(raised.value)
    assert td.batch_size == (3,) and td["n"].batch_size == (3,)
    assert all(td[key] is value for key, value in before.items())


def test_a_failing_update_after_the_rebatch_puts_every_node_back(monkeypatch):
    td = shared_td.TensorDict(a=torch.zeros(3), n={"x": torch.zeros(3)}, s="text", batch_size=[3], names=["t"])
    nested, leaves = td["n"], dict(td.items(True, True))

    def failing_plan(*args, **kwargs):
        raise RuntimeError("the plan failed")

    monkeypatch.setattr(shared_td.TensorDict, "_plan_update", failing_plan)
    with pytest.raises(RuntimeError, match="the plan failed"):
        td.update(shared_td.TensorDict(a=torch.ones(5), n={"x": torch.ones(5)}, s="new", batch_size=[5]),
                  update_batch_size=True)
    monkeypatch.undo()
    assert td.batch_size == (3,) and td.names == ["t"] and td["n"] is nested and nested.batch_size == (3,)
    assert dict(td.items(True, True)).keys() == leaves.keys()
    assert all(td.get(key) is value for key, value in leaves.items())
    assert td["s"] == "text"


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("count", [1, 3, 4])
@pytest.mark.parametrize("source_kind", ["lazy", "dense"])
def test_a_lazy_stack_gets_as_many_members_as_its_source(lib, count, source_kind):
    lazy = lib.lazy_stack([lib.TensorDict(a=torch.zeros(2)) for _ in range(3)])
    members = list(lazy.tensordicts)
    if source_kind == "lazy":
        source = lib.lazy_stack([lib.TensorDict(a=torch.full((2,), float(i))) for i in range(count)])
    else:
        source = lib.TensorDict(a=torch.arange(count).float()[:, None].expand(count, 2).clone(), batch_size=[count])
    _update(lazy, source)
    assert lazy.batch_size == (count,) and len(lazy.tensordicts) == count
    assert [member["a"].tolist() for member in lazy.tensordicts] == [[float(i)] * 2 for i in range(count)]
    if count >= 3:
        assert lazy.tensordicts[:3] == members  # (updated, not replaced)
    if count > 3 and source_kind == "lazy":
        assert lazy.tensordicts[3] is not source.tensordicts[3]  # a copy
        assert lazy.tensordicts[3]["a"] is source.tensordicts[3]["a"]  # (shallow)


@pytest.mark.parametrize("lib", LIBS)
def test_a_lazy_stack_member_that_lacks_a_key_of_the_stack_is_refused(lib):
    lazy = lib.lazy_stack([lib.TensorDict(a=torch.zeros(2), b=torch.zeros(2)) for _ in range(3)])
    with pytest.raises(RuntimeError):
        _update(lazy, lib.lazy_stack([lib.TensorDict(a=torch.ones(2)) for _ in range(4)]))
    assert lazy.batch_size == (3,) and _keys(lazy) == ["a", "b"]


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("ragged", [False, True], ids=["same shapes", "ragged"])
def test_a_lazy_stack_written_over_a_tensordict_node_replaces_it_by_a_lazy_stack(lib, ragged):
    """As tensordict 0.15.3: the node becomes a lazy stack of its slices updated with the
    source's members (before: merged into the TensorDict, "Failed to stack" if ragged);
    the old node and its tensors are left as they were."""
    td = lib.TensorDict(n=lib.TensorDict(a=torch.zeros(2, 3), keep=torch.zeros(2), batch_size=[2]), batch_size=[2])
    old = td["n"]
    shapes = [3, 4] if ragged else [3, 3]
    source = lib.TensorDict(n=lib.lazy_stack([lib.TensorDict(a=torch.ones(k)) for k in shapes]), batch_size=[2])
    td.update(source)
    node = td["n"]
    assert type(node).__name__ == "LazyStackedTensorDict" and node is not old
    assert [member["a"].shape[0] for member in node.tensordicts] == shapes
    assert node.tensordicts[1]["keep"].shape == ()  # the old node's other entries, sliced
    assert old["a"].eq(0).all() and old.batch_size == (2,)


@pytest.mark.parametrize("lib", LIBS)
def test_a_lazy_stack_nested_in_a_rebatched_tensordict_follows(lib):
    td = lib.TensorDict(a=torch.zeros(3), stack=lib.lazy_stack([lib.TensorDict(x=torch.zeros(3), batch_size=[3]) for _ in range(2)], 1),
                        batch_size=[3])
    source = lib.TensorDict(a=torch.ones(5), stack=lib.TensorDict(x=torch.ones(5, 4), batch_size=[5, 4]), batch_size=[5])
    stack = td["stack"]
    _update(td, source)
    assert td.batch_size == (5,) and td["stack"].batch_size == (5, 4) and td["stack", "x"].eq(1).all()
    if lib is shared_td:  # (tensordict 0.15.3 refills the same object too; asserted on ours)
        assert td["stack"] is stack and len(stack.tensordicts) == 4


def test_a_nested_lazy_stack_that_cannot_take_its_source_changes_nothing():
    """The source of a lazy stack nested in a rebatched tensordict has no dim to split
    along: a RuntimeError naming its key, and every node put back as it was."""
    td = shared_td.TensorDict(a=torch.zeros(3), stack=shared_td.lazy_stack(
        [shared_td.TensorDict(x=torch.zeros(3), batch_size=[3]) for _ in range(2)], 1), batch_size=[3])
    stack, members, a = td["stack"], list(td["stack"].tensordicts), td["a"]
    source = shared_td.TensorDict(a=torch.ones(5), stack=shared_td.TensorDict(x=torch.ones(5), batch_size=[5]),
                                  batch_size=[5])
    with pytest.raises(RuntimeError, match=r"cannot split .* the tensordict at 'stack'"):
        td.update(source, update_batch_size=True)
    assert td.batch_size == (3,) and td["a"] is a and td["stack"] is stack
    assert stack.tensordicts == members and stack.batch_size == (3, 2)


# fuzzer run 20 (update_bs, update_lazy_node): a key only some members of a lazy stack hold, keys_to_update,
# a lazy stack over a TensorDict whose batch size starts its own

@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("nested,source_members", [(False, 3), (True, 2), (True, 3)])
def test_a_lazy_stack_member_key_the_source_lacks_is_refused(lib, nested, source_members):
    """A key only some members hold ("extra") is a key of the node: a rebatch would drop it."""
    m0 = lib.TensorDict(a=torch.zeros(1), extra=torch.full((1,), 7.0), batch_size=[1])
    lazy = lib.lazy_stack([m0, lib.TensorDict(a=torch.zeros(1), batch_size=[1])], 1)
    src_lazy = lib.lazy_stack([lib.TensorDict(a=torch.ones(2), batch_size=[2]) for _ in range(source_members)], 1)
    x = lib.TensorDict(b=lazy, batch_size=[1]) if nested else lazy
    src = lib.TensorDict(b=src_lazy, batch_size=[2]) if nested else src_lazy
    batch = x.batch_size
    with pytest.raises(RuntimeError):
        x.update(src, update_batch_size=True)
    if lib is shared_td:  # (tensordict 0.15.3 has rebatched x before it raises)
        assert x.batch_size == batch
        assert m0["extra"].tolist() == [7.0]
        assert sorted(m0.keys()) == ["a", "extra"]


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("other_lazy", [False, True])
def test_keys_to_update_leaves_an_unselected_node_of_another_batch_size_alone(lib, other_lazy):
    other = (lib.lazy_stack([lib.TensorDict(z=torch.zeros(1), batch_size=[1]) for _ in range(2)], 1) if other_lazy
             else lib.TensorDict(z=torch.zeros(1, 2), batch_size=[1, 2]))
    x = lib.TensorDict(c=lib.TensorDict(v=torch.zeros(1), batch_size=[1]), other=other, batch_size=[1])
    src = lib.TensorDict(c=lib.TensorDict(v=torch.ones(1), batch_size=[1]),
                         other=lib.TensorDict(z=torch.ones(1, 3), batch_size=[1, 3]), batch_size=[1])
    x.update(src, update_batch_size=True, keys_to_update=["c"])
    assert x["c", "v"].tolist() == [1.0]
    assert x["other"].batch_size == torch.Size([1, 2])
    assert x["other", "z"].tolist() == [[0.0, 0.0]]
    if lib is shared_td:  # the selected node itself: still refused (README-listed; tensordict rebatches it)
        with pytest.raises(RuntimeError):
            x.update(src, update_batch_size=True, keys_to_update=["other"])


@pytest.mark.parametrize("lib", LIBS)
def test_a_lazy_stack_over_a_tensordict_whose_batch_starts_it_restacks(lib):
    x = lib.TensorDict(a=torch.zeros(2), n=lib.TensorDict(z=torch.zeros(2), batch_size=[2]), batch_size=[2])
    node = x["n"]
    src = lib.lazy_stack([lib.TensorDict(a=torch.ones(3), n=lib.TensorDict(z=torch.ones(3) * i, batch_size=[3]),
                                         batch_size=[3]) for i in range(2)], 0)
    x.update(src)
    assert type(x["n"]).__name__ == "LazyStackedTensorDict" and x["n"] is not node
    assert x["n", "z"].tolist() == [[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]]
    assert node["z"].tolist() == [0.0, 0.0]  # the TensorDict itself is left as it was


@pytest.mark.parametrize("lib", LIBS)
def test_a_member_key_its_own_part_lacks_is_refused_even_if_another_part_has_it(lib):
    """(fuzz20 seed 211971) member 0 holds "extra"; its part does not, the extra (4th) part does."""
    m0 = lib.TensorDict(a=torch.zeros(1), extra=torch.full((1,), 7.0), batch_size=[1])
    x = lib.TensorDict(b=lib.lazy_stack([m0, lib.TensorDict(a=torch.zeros(1), batch_size=[1])], 1), batch_size=[1])
    parts = [lib.TensorDict(a=torch.ones(2), batch_size=[2]) for _ in range(3)]
    parts.append(lib.TensorDict(a=torch.ones(2), extra=torch.ones(2), batch_size=[2]))
    src = lib.TensorDict(b=lib.lazy_stack(parts, 1), batch_size=[2])
    with pytest.raises(RuntimeError):
        x.update(src, update_batch_size=True)
    if lib is shared_td:
        assert x.batch_size == torch.Size([1]) and sorted(m0.keys()) == ["a", "extra"]


@pytest.mark.parametrize("lib", LIBS)
def test_a_lazy_stack_refilled_with_more_members_rebatches_their_nested_tensordicts(lib):
    # (fuzzer run 21: the members keep their batch size [], their nested "next" goes from [1] to [4, 2]:
    # before, "must start with the batch size [1]" while tensordict 0.15.3 took it)
    member = lib.TensorDict(next=lib.TensorDict(b=torch.zeros(1), batch_size=[1]))
    lazy = lib.lazy_stack([member], 0)
    source = lib.TensorDict(next=lib.TensorDict(b=torch.arange(8.).reshape(4, 2), batch_size=[4, 2]),
                            batch_size=[4])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        assert lazy.update(source, update_batch_size=True) is lazy
    assert lazy.batch_size == (4,) and lazy.tensordicts[0] is member
    assert lazy["next"].batch_size == (4, 2)
    assert lazy["next", "b"].tolist() == source["next", "b"].tolist()


@pytest.mark.parametrize("stack_dim", [0, 1])
@pytest.mark.parametrize("nested", [False, True])
def test_a_lazy_stack_given_no_row_keeps_the_source_other_dims(stack_dim, nested):
    # (tensordict 0.15.3 refuses a source of no row; the stack had lost its other dims: [0])
    lazy = shared_td.LazyStackedTensorDict(
        *[shared_td.TensorDict(a=torch.zeros(3), batch_size=[3]) for _ in range(2)], stack_dim=stack_dim)
    shape = [0, 3] if stack_dim == 0 else [3, 0]
    source = shared_td.TensorDict(a=torch.zeros(shape), batch_size=shape)
    if nested:
        root = shared_td.TensorDict(s=lazy)
        _update(root, shared_td.TensorDict(s=source))
        lazy = root["s"]
    else:
        _update(lazy, source)
    assert lazy.batch_size == tuple(shape)  # (a stack of no member holds no key)


@pytest.mark.parametrize("born_empty", [False, True])
def test_a_lazy_stack_of_no_member_given_no_row_of_other_dims_takes_them(born_empty):
    # (no member and no part: nothing was planned, and the update refused the source,
    # "pass update_batch_size=True", which was passed; review44)
    if born_empty:
        lazy = shared_td.LazyStackedTensorDict(stack_dim=0, batch_size=[3])
    else:
        lazy = shared_td.LazyStackedTensorDict(
            *[shared_td.TensorDict(a=torch.zeros(3), batch_size=[3]) for _ in range(2)], stack_dim=0)
        _update(lazy, shared_td.TensorDict(a=torch.zeros(0, 3), batch_size=[0, 3]))
    assert lazy.batch_size == (0, 3)
    _update(lazy, shared_td.TensorDict(a=torch.zeros(0, 5), batch_size=[0, 5]))
    assert lazy.batch_size == (0, 5)
