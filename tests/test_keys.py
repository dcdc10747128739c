"""Nested keys (shared_td.keys) and the keys view of a tensordict."""
from __future__ import annotations

import pytest
import torch

from shared_td import KeyTypeError, TensorDict
from shared_td.keys import is_nested_key, key_repr, unravel_key


@pytest.mark.parametrize(
    "key, expected",
    [
        ("a", ("a",)),
        ("", ("",)),
        (("a",), ("a",)),
        (("a", "b"), ("a", "b")),
        (("a", ("b", "c")), ("a", "b", "c")),
        ((("a",), (("b",),), "c"), ("a", "b", "c")),
        ("a.b", ("a.b",)),
    ],
)
def test_unravel_key(key, expected):
    assert unravel_key(key) == expected
    assert is_nested_key(key)


@pytest.mark.parametrize("key", [1, 1.5, None, b"a", ["a"], ("a", 1), ("a", ("b", None)), object()])
def test_bad_keys(key):
    with pytest.raises(KeyTypeError, match="str") as info:
        unravel_key(key)
    # catchable as tensordict's KeyError and as a TypeError
    assert isinstance(info.value, KeyError) and isinstance(info.value, TypeError)
    assert type(key).__name__ in str(info.value)
    assert not is_nested_key(key)


@pytest.mark.parametrize("key", [(), ((),), ((), ()), ("a", (), "b")])
def test_empty_keys(key):
    with pytest.raises(ValueError, match="empty"):
        unravel_key(key)
    assert not is_nested_key(key)


def test_key_type_error_message_is_plain():
    # KeyError's str() would quote the message; KeyTypeError shows it as written.
    error = KeyTypeError("a message")
    assert str(error) == "a message"


def test_key_repr():
    assert key_repr(("a",)) == "'a'"
    assert key_repr(("a", "b")) == "('a', 'b')"


# ----------------------------------------------------------------------------- keys view
def make_td() -> TensorDict:
    td = TensorDict({"b": torch.zeros(2), "a": {"y": torch.zeros(2), "x": {"z": torch.zeros(2)}}}, batch_size=[2])
    td["t"] = "text"
    return td


def test_keys_view_iteration_and_len():
    td = make_td()
    assert list(td.keys()) == ["b", "a", "t"]
    assert len(td.keys()) == 3
    nested = list(td.keys(include_nested=True))
    assert set(nested) == {"b", "a", ("a", "y"), ("a", "x"), ("a", "x", "z"), "t"}
    assert len(td.keys(True)) == 6
    assert list(td.keys(True, True, sort=True)) == [("a", "x", "z"), ("a", "y"), "b"]
    assert list(td.keys(leaves_only=True)) == ["b"]  # "t" is non-tensor: not a leaf by default


def test_keys_view_contains():
    td = make_td()
    keys = td.keys()
    assert "a" in keys and "b" in keys and "t" in keys
    assert ("a",) in keys and ("a", "y") not in keys  # nested only with include_nested
    nested = td.keys(include_nested=True)
    assert ("a", "y") in nested and ("a", ("x", "z")) in nested and "z" not in nested
    leaves = td.keys(True, True)
    assert "a" not in leaves and ("a", "y") in leaves and "t" not in leaves
    assert 3 not in keys and None not in keys and () not in keys


def _mixed_tree(lib):
    """Every kind of entry a walk meets: tensors, a nested tensordict, a tensorclass, a
    non-tensor value and a non-tensor stack, a lazy stack (with lib's own classes)."""
    @lib.tensorclass
    class Step:
        obs: torch.Tensor
        note: str

    td = lib.TensorDict({"b": torch.zeros(2), "a": {"y": torch.zeros(2), "x": {"z": torch.zeros(2)}}}, batch_size=[2])
    td["t"] = "text"
    td["step"] = Step(obs=torch.zeros(2, 3), note="n", batch_size=[2])
    td["s"] = lib.NonTensorStack("u", "v")
    td["lazy"] = lib.LazyStackedTensorDict(lib.TensorDict(q=torch.zeros(()), r={"w": torch.zeros(())}),
                                           lib.TensorDict(q=torch.ones(()), r={"w": torch.ones(())}))
    return td


@pytest.mark.parametrize("include_nested", [False, True])
@pytest.mark.parametrize("leaves_only", [False, True])
@pytest.mark.parametrize("nontensor_leaves", [False, True])
@pytest.mark.parametrize("sort", [False, True])
def test_keys_view_len_is_what_iteration_lists_as_tensordict(include_nested, leaves_only, nontensor_leaves, sort):
    import shared_td

    libs = [shared_td]
    try:
        import tensordict

        libs.append(tensordict)
    except ImportError:
        pass
    listed = []
    for lib in libs:
        is_leaf = (shared_td.is_leaf_nontensor if lib is shared_td else lib.base._is_leaf_nontensor) if nontensor_leaves else None
        td = _mixed_tree(lib)
        view = td.keys(include_nested, leaves_only, is_leaf, sort=sort)
        keys = list(iter(view))
        assert len(view) == len(keys) and list(view) == keys
        assert all(key in view for key in keys)
        # items() and values() list a nested tensordict before its entries, keys() after
        items = [(key, type(value).__name__) for key, value in td.items(include_nested, leaves_only, is_leaf, sort=sort)]
        assert [type(value).__name__ for value in td.values(include_nested, leaves_only, is_leaf, sort=sort)] == [
            name for _key, name in items]
        assert sorted(map(str, keys)) == sorted(str(key) for key, _name in items)
        listed.append((keys, items))
    if len(listed) == 2:
        assert listed[0] == listed[1]


def test_keys_view_contains_reads_only_the_path(monkeypatch):
    td = TensorDict({f"node{i}": {"obs": torch.zeros(2)} for i in range(50)}, batch_size=[2])
    reads = []
    for name in ("_get_str", "_items_str", "_keys_str"):
        method = getattr(TensorDict, name)
        monkeypatch.setattr(TensorDict, name, lambda self, *args, _m=method, _n=name: reads.append(_n) or _m(self, *args))
    view = td.keys(True, True)
    assert ("node7", "obs") in view and "node7" not in view and ("node7", "missing") not in view
    assert ("node7", "obs", "deeper") not in view  # a tensor has no keys
    # a lookup along the path (before: the whole tree walked for each ``in``)
    assert reads == ["_get_str"] * 2 + ["_get_str"] + ["_get_str"] * 2 + ["_get_str"] * 2, reads


def test_keys_view_is_live():
    td = make_td()
    keys = td.keys()
    td["c"] = torch.zeros(2)
    assert "c" in keys and len(keys) == 4
    del td["b"]
    assert "b" not in keys


def test_keys_view_repr():
    td = TensorDict(a=torch.zeros(()), b={"c": torch.zeros(())})
    assert repr(td.keys()) == "_TensorDictKeysView(['a', 'b'], include_nested=False, leaves_only=False)"


def test_keys_of_tensordict_accept_nested_tuples():
    td = make_td()
    assert td["a", ("x", "z")] is td["a"]["x"]["z"]
    assert td.get((("a",), "y")) is td["a", "y"]
    td[("n", ("m", "o"))] = torch.ones(2)
    assert td["n", "m", "o"].sum() == 2


def test_public_unravel_key_is_tensordicts():
    # shared_td.unravel_key returns what tensordict.unravel_key returns: a str for one part
    import shared_td

    assert shared_td.unravel_key("a") == "a" and shared_td.unravel_key(("a",)) == "a"
    assert shared_td.unravel_key(("a", ("b", "c"))) == ("a", "b", "c")
    with pytest.raises(TypeError):
        shared_td.unravel_key(1)


class _ReprCounted:
    """A non-key whose repr is counted: a check that formats it builds a message eagerly."""

    reprs = 0

    def __repr__(self) -> str:
        type(self).reprs += 1
        return "<counted>"


@pytest.mark.parametrize("key", [_ReprCounted(), ("a", _ReprCounted()), ("a", ("b", _ReprCounted())), ((), "a")])
def test_is_nested_key_formats_nothing(key):
    # is_nested_key runs on every td[index]; an index tensor's repr costs ~1 ms
    _ReprCounted.reprs = 0
    assert not is_nested_key(key)
    assert _ReprCounted.reprs == 0


def test_unravel_key_to_tuple_gives_an_empty_tuple_for_what_is_not_a_key():
    from shared_td import unravel_key_to_tuple

    assert unravel_key_to_tuple("a") == ("a",)
    assert unravel_key_to_tuple(("a", ("b", ("c",)))) == ("a", "b", "c")
    assert unravel_key_to_tuple(("a", 1)) == unravel_key_to_tuple(1) == unravel_key_to_tuple(()) == ()
