"""Audit fixes, side by side with tensordict 0.15.3: lazy stacks with keys that only
some members have, the exception classes of split/unsqueeze, frozen tensorclasses'
hash, ``TensorClass.from_dict`` and the dim names kept by advanced indexing."""
from __future__ import annotations

import warnings

import pytest
import torch

import shared_td
from tests.reference import LIBS

def exclusive_stack(lib):
    """A lazy stack whose member 1 alone has "only_b" (and a nested "s", "x")."""
    a = lib.TensorDict({"c": torch.zeros(2)}, [2])
    b = lib.TensorDict({"c": torch.ones(2), "only_b": torch.ones(2), "s": {"x": torch.ones(2)}}, [2])
    return lib.LazyStackedTensorDict.lazy_stack([a, b], 0)


# ------------------------------------------------------------ 1. to_dict and exclusive keys
@pytest.mark.parametrize("lib", LIBS)
def test_to_dict_refuses_exclusive_keys(lib):
    # the dict would hold only the common keys: the exclusive one would be lost silently
    with pytest.raises(RuntimeError, match="exclusive keys"):
        exclusive_stack(lib).to_dict()


def test_to_dict_exclusive_error_names_key_and_fix():
    with pytest.raises(RuntimeError, match=r"'only_b'.*del td\['only_b'\]"):
        exclusive_stack(shared_td).to_dict()


@pytest.mark.parametrize("lib", LIBS)
def test_to_dict_nested_exclusive_keys(lib):
    a = lib.TensorDict({"n": {"c": torch.zeros(2)}}, [2])
    b = lib.TensorDict({"n": {"c": torch.ones(2), "only_b": torch.ones(2)}}, [2])
    with pytest.raises(RuntimeError, match="exclusive keys"):
        lib.LazyStackedTensorDict.lazy_stack([a, b], 0).to_dict()


@pytest.mark.parametrize("lib", LIBS)
def test_to_dict_common_keys_still_works(lib):
    lazy = exclusive_stack(lib)
    del lazy["only_b"], lazy["s"]
    assert lazy.to_dict()["c"].tolist() == [[0.0, 0.0], [1.0, 1.0]]


# ------------------------------------------------------------ 2. del of an exclusive key
@pytest.mark.parametrize("lib", LIBS)
def test_del_exclusive_key(lib):
    lazy = exclusive_stack(lib)
    del lazy["only_b"]
    assert [sorted(m.keys()) for m in lazy.tensordicts] == [["c"], ["c", "s"]]
    del lazy["s", "x"]  # a nested key that one member has
    assert sorted(lazy.tensordicts[1]["s"].keys()) == []


@pytest.mark.parametrize("lib", LIBS)
def test_del_key_no_member_has(lib):
    with pytest.raises(KeyError):
        del exclusive_stack(lib)["nowhere"]


@pytest.mark.parametrize("lib", LIBS)
def test_del_exclusive_key_locked(lib):
    lazy = exclusive_stack(lib).lock_()
    with pytest.raises(RuntimeError):
        del lazy["only_b"]
    assert "only_b" in lazy.tensordicts[1].keys()  # nothing removed


def test_del_exclusive_key_in_nested_lazy_member():
    inner = exclusive_stack(shared_td)
    outer = shared_td.LazyStackedTensorDict.lazy_stack([inner, inner.clone()], 0)
    del outer["only_b"]
    assert all("only_b" not in m.keys() for lazy in outer.tensordicts for m in lazy.tensordicts)


# ------------------------------------------------------------ 3. exception classes
@pytest.mark.parametrize("lib", LIBS)
def test_split_sizes_not_adding_up_is_runtime_error(lib):
    td = lib.TensorDict({"a": torch.zeros(2, 3)}, [2, 3])
    with pytest.raises(RuntimeError):
        td.split([1, 1], 1)


def test_split_sizes_message_and_old_class():
    td = shared_td.TensorDict({"a": torch.zeros(2, 3)}, [2, 3])
    with pytest.raises(ValueError, match=r"\[1, 1\] do not add up to 3, the size of batch dim 1"):
        td.split([1, 1], 1)  # still a ValueError, as this package raised before


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("dim", [3, 5, -4])
def test_unsqueeze_out_of_range_is_runtime_error(lib, dim):
    td = lib.TensorDict({"a": torch.zeros(2, 3)}, [2, 3])
    with pytest.raises(RuntimeError):
        td.unsqueeze(dim)


def test_unsqueeze_out_of_range_message():
    td = shared_td.TensorDict({"a": torch.zeros(2, 3)}, [2, 3])
    with pytest.raises(IndexError) as info:  # also an IndexError, as before
        td.unsqueeze(5)
    message = str(info.value)
    assert "dim=5" in message and "-3 <= dim <= 2" in message
    assert "3 batch dims" not in message  # the td has 2


def test_lazy_unsqueeze_out_of_range_message():
    td = shared_td.TensorDict({"a": torch.zeros(2, 3)}, [2, 3])
    lazy = shared_td.LazyStackedTensorDict.lazy_stack([td, td], 0)  # 3 batch dims
    with pytest.raises(RuntimeError, match=r"3 batch dims: the new dim goes at -4 <= dim <= 3"):
        lazy.unsqueeze(4)


# ------------------------------------------------------------ 4. frozen tensorclass hash
@pytest.mark.parametrize("lib", LIBS)
def test_frozen_tensorclass_is_hashable(lib):
    @lib.tensorclass(frozen=True)
    class C:
        y: torch.Tensor
        s: str

    c = C(y=torch.zeros(2), s="a", batch_size=[2])
    assert {c: 1}[c] == 1
    assert hash(c) == hash((c.y, "a"))  # dataclass's hash of the field values


@pytest.mark.parametrize("lib", LIBS)
def test_hash_of_plain_and_custom_tensorclasses(lib):
    @lib.tensorclass
    class Plain:
        y: torch.Tensor

    @lib.tensorclass(frozen=True)
    class Custom:
        y: torch.Tensor

        def __hash__(self):
            return 7

    with pytest.raises(TypeError, match="unhashable"):
        hash(Plain(y=torch.zeros(2)))  # its fields can change
    assert hash(Custom(y=torch.zeros(2))) == 7


# ------------------------------------------------------------ 5. TensorClass.from_dict
@pytest.mark.parametrize("lib", LIBS)
def test_tensorclass_from_dict(lib):
    @lib.tensorclass
    class A:
        x: torch.Tensor
        s: str

    a = A.from_dict({"x": torch.zeros(2, 3), "s": "a"}, batch_size=[2])
    assert isinstance(a, A) and a.s == "a" and a.batch_size == torch.Size([2])
    b = A.from_dict({"x": torch.zeros(2, 3), "s": "b"}, batch_dims=1)  # implies auto_batch_size
    assert b.batch_size == torch.Size([2])
    c = A.from_dict({"x": torch.zeros(2, 3)}, auto_batch_size=True)
    assert c.batch_size == torch.Size([2, 3]) and c.s is None  # a missing field is None
    with pytest.raises(ValueError):
        A.from_dict({"x": torch.zeros(2), "bad": torch.zeros(2)})
    with pytest.raises(ValueError):
        A.from_dict({"x": torch.zeros(2)}, batch_size=[2], batch_dims=1)


@pytest.mark.parametrize("lib", LIBS)
def test_tensorclass_from_dict_missing_default_warns(lib):
    @lib.tensorclass
    class A:
        x: torch.Tensor
        n: int = 3

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        a = A.from_dict({"x": torch.zeros(2)})
    assert a.n is None  # as tensordict 0.15.3 (its 0.17 fills the default)
    assert any(issubclass(w.category, FutureWarning) for w in caught)


# ------------------------------------------------------------ 6. names after advanced indexing
t = torch.tensor
INDICES = {
    "mask": lambda: t([True, False]),
    "int_tensor": lambda: t([0, 0]),
    "list": lambda: [0, 1, 1],
    "column_tensor": lambda: (slice(None), t([0, 2, 2])),
    "column_mask": lambda: (slice(None), t([True, False, True])),
    "int_2d": lambda: t([[0, 1], [1, 0]]),
    "column_int_2d": lambda: (slice(None), t([[0, 1], [1, 0]])),
    "tensor_then_int": lambda: (t([0, 1]), 0),
    "int_then_tensor": lambda: (0, t([0, 1])),
    "scalar_tensor": lambda: t(1),
    "none_tensor": lambda: (None, t([0, 1])),
    "ellipsis_tensor": lambda: (..., t([0, 1])),
    "two_tensors_3d": lambda: (t([0, 1]), t([0, 1])),
    "mask_2d_3d": lambda: torch.ones(2, 3, dtype=torch.bool),
    "separated_3d": lambda: (t([0, 1]), slice(None), t([0, 1])),
    "adjacent_3d": lambda: (slice(None), t([0, 1]), t([0, 1])),
    "int_slice_tensor_3d": lambda: (0, slice(None), t([0, 1])),
    "tensor_slice_int_3d": lambda: (t([0, 1]), slice(None), 0),
    "tensor_none_tensor_3d": lambda: (slice(None), t([0, 1]), None, t([0, 1])),
    "tensor_int_tensor_4d": lambda: (slice(None), t([0, 1]), 0, t([0, 1])),
}


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("name", INDICES)
def test_advanced_index_keeps_names(lib, name):
    if name.endswith("_4d"):
        td = lib.TensorDict({"a": torch.zeros(3, 4, 5, 6)}, [3, 4, 5, 6], names=["x", "y", "z", "w"])
    elif name.endswith("_3d"):
        td = lib.TensorDict({"a": torch.zeros(2, 3, 4)}, [2, 3, 4], names=["x", "y", "z"])
    else:
        td = lib.TensorDict({"a": torch.zeros(2, 3)}, [2, 3], names=["x", "y"])
    out = td[INDICES[name]()]
    expected = {
        "mask": ["x", "y"], "int_tensor": ["x", "y"], "list": ["x", "y"],
        "column_tensor": ["x", "y"], "column_mask": ["x", "y"], "int_2d": [None, None, "y"],
        "column_int_2d": ["x", None, None], "tensor_then_int": ["x"], "int_then_tensor": ["y"],
        "scalar_tensor": ["y"], "none_tensor": [None, "x", "y"], "ellipsis_tensor": ["x", "y"],
        "two_tensors_3d": [None, "z"], "mask_2d_3d": [None, "z"],
        "separated_3d": [None, "y"], "adjacent_3d": ["x", None],
        "int_slice_tensor_3d": ["y", "z"], "tensor_slice_int_3d": ["x", "y"],
        "tensor_none_tensor_3d": [None, "x", None],
        "tensor_int_tensor_4d": ["x", None],  # an int does not separate: the block stays  # None separates: torch puts the block first
    }[name]
    assert out.names == expected
    assert len(out.names) == out.batch_dims


def test_bool_beside_index_tensor_gives_no_names():
    td = shared_td.TensorDict({"a": torch.zeros(3, 4, 5)}, [3, 4, 5], names=["x", "y", "z"])
    out = td[:, t([0, 1]), True]  # True varies along no dim: the tensor's dim keeps "y",
    assert out.names == ["x", "y", "z"]  # as in tensordict 0.15.3 (test_upstream_names_index.py)
