"""transpose, flatten, unflatten and all(dim)/any(dim), side by side with tensordict 0.15.3.

Before, none of them existed: ``td.transpose(0, 1)`` and ``td.flatten()`` raised
AttributeError, and ``td.all(1)`` a TypeError (all() took no dim).

The grid runs each op on a dense TensorDict (a nested tensordict, a NonTensorData, a
NonTensorStack, named dims), on lazy stacks (each stack dim) and on a tensorclass, and
compares the batch size, names, values of every leaf (tensor and non-tensor), the class
of the result and its lock. Where we differ on purpose (see ``batch_dim_ops``): a lazy
stack's flatten/unflatten name the dims as a TensorDict's do (tensordict drops them or
moves the stack dim's name), all(dim)/any(dim) of a lazy stack keep the names, and a
dim outside the batch dims raises (tensordict warns and uses the dims of the leaves).
"""
from __future__ import annotations


import pytest
import torch

import shared_td
from shared_td.errors import BatchDimError


@pytest.fixture(scope="module")
def tensordict():
    return pytest.importorskip("tensordict")


_TC = {}


def _tc_class(lib):
    if lib.__name__ not in _TC:
        @lib.tensorclass
        class Obs:
            x: torch.Tensor
            label: str

        _TC[lib.__name__] = Obs
    return _TC[lib.__name__]


def _strings(shape, tag=""):
    if not shape:
        return tag
    return [_strings(shape[1:], f"{tag}{i}") for i in range(shape[0])]


def _dense(lib):
    td = lib.TensorDict(
        a=torch.arange(24).reshape(2, 3, 4),
        nested=lib.TensorDict(c=torch.arange(48.0).reshape(2, 3, 4, 2), batch_size=[2, 3, 4, 2]),
        task="walk", batch_size=[2, 3, 4], names=["x", "y", "z"],
    )
    td["words"] = _stack_of_strings(lib, [2, 3, 4])
    return td


def _stack_of_strings(lib, shape, tag=""):
    if not shape:
        return lib.NonTensorData(tag)
    return lib.NonTensorStack(*[_stack_of_strings(lib, shape[1:], f"{tag}{i}") for i in range(shape[0])])


def _member(lib, i):
    return lib.TensorDict(a=torch.arange(12).reshape(3, 4) + 100 * i,
                          nested=lib.TensorDict(c=torch.zeros(3, 4, 2) + i, batch_size=[3, 4]),
                          task=f"m{i}", batch_size=[3, 4])


def _lazy(lib, stack_dim):
    return lib.lazy_stack([_member(lib, 0), _member(lib, 1)], stack_dim, stack_dim_name="st")


def _tensorclass(lib):
    return _tc_class(lib)(x=torch.arange(24).reshape(2, 3, 4), label="hi", batch_size=[2, 3], names=["a", "b"])


_SUBJECTS = {
    "dense": _dense,
    "lazy0": lambda lib: _lazy(lib, 0),
    "lazy1": lambda lib: _lazy(lib, 1),
    "lazy2": lambda lib: _lazy(lib, 2),
    "tensorclass": _tensorclass,
}

_OPS = {
    "transpose(0,1)": lambda t: t.transpose(0, 1),
    "transpose(-1,0)": lambda t: t.transpose(-1, 0),
    "transpose(1,1)": lambda t: t.transpose(1, 1),
    "flatten()": lambda t: t.flatten(),
    "flatten(0,1)": lambda t: t.flatten(0, 1),
    "flatten(-2,-1)": lambda t: t.flatten(-2, -1),
    "flatten(1,1)": lambda t: t.flatten(1, 1),
    "unflatten(1,(-1,1))": lambda t: t.unflatten(1, (-1, 1)),
    "unflatten(-1,(1,-1))": lambda t: t.unflatten(-1, (1, -1)),
    "unflatten(0,(1,-1))": lambda t: t.unflatten(0, torch.Size([1, -1])),
    "all(1)": lambda t: t.all(1),
    "any(-1)": lambda t: t.any(-1),
    "all(0)": lambda t: t.all(dim=0),
}


def _unnamed_as_none(names):
    return None if names is None or all(n is None for n in names) else list(names)


def _leaves(obj) -> dict:
    """Every leaf of ``obj`` (a tensordict or tensorclass): tensors as lists, non-tensor
    entries as their values; nested collections as their batch size and names."""
    td = obj._tensordict if type(obj).__name__ == "Obs" else obj
    out = {}
    for key in td.keys(include_nested=True, leaves_only=False):
        value = td.get(key)
        if isinstance(value, torch.Tensor):
            out[key] = ("tensor", value.dtype, value.tolist())
        elif type(value).__name__ in ("NonTensorData", "NonTensorStack"):
            out[key] = ("non-tensor", list(value.batch_size), value.tolist())
        else:
            out[key] = ("collection", list(value.batch_size))
    return out


def _kind(result) -> str:
    name = type(result).__name__
    return "TensorDict" if name == "TensorDict" else name


def _expected_names_differ(subject: str, op: str) -> bool:
    """Names we give on purpose differently (module doc): lazy flatten/unflatten/all."""
    return subject.startswith("lazy") and op.split("(")[0] in ("flatten", "unflatten", "all", "any")


@pytest.mark.parametrize("op", sorted(_OPS))
@pytest.mark.parametrize("subject", sorted(_SUBJECTS))
def test_as_tensordict(tensordict, subject, op):
    ours = _OPS[op](_SUBJECTS[subject](shared_td))
    theirs = _OPS[op](_SUBJECTS[subject](tensordict))
    assert _kind(ours) == _kind(theirs)
    assert ours.batch_size == theirs.batch_size
    if not _expected_names_differ(subject, op):
        assert _unnamed_as_none(ours.names) == _unnamed_as_none(theirs.names)
    assert ours.is_locked == theirs.is_locked
    assert _leaves(ours) == _leaves(theirs)


@pytest.mark.parametrize("op", ["transpose(1,1)", "flatten(1,1)"])
def test_no_op_on_lazy_stack_is_self(tensordict, op):
    for lib in (shared_td, tensordict):
        lazy = _lazy(lib, 0)
        assert _OPS[op](lazy) is lazy


def test_identity_unflatten_of_a_lazy_stack_is_self(tensordict):
    for lib in (shared_td, tensordict):
        lazy = _lazy(lib, 1)
        assert lazy.unflatten(1, [2]) is lazy


def test_transpose_of_a_lazy_stack_moves_the_stack_dim(tensordict):
    for stack_dim, dims, new_stack_dim in [(0, (0, 1), 1), (0, (0, 2), 2), (1, (0, 2), 1), (2, (0, 1), 2)]:
        ours, theirs = _lazy(shared_td, stack_dim), _lazy(tensordict, stack_dim)
        out, ref = ours.transpose(*dims), theirs.transpose(*dims)
        assert out.stack_dim == ref.stack_dim == new_stack_dim
        assert isinstance(out, shared_td.LazyStackedTensorDict)
        assert out.names == ref.names


def test_lazy_names_follow_the_dense_rule():
    """Our choice (module doc): the flattened dim is unnamed, the other names stay; the
    last new dim of an unflatten keeps the name (tensordict drops every name in a lazy
    flatten and moves the name of an unflattened stack dim to the first new dim)."""
    lazy = _lazy(shared_td, 0)  # batch [2, 3, 4], names ["st", None, None]
    assert lazy.flatten(1, 2).names == ["st", None]
    assert lazy.flatten(0, 1).names is None
    assert lazy.unflatten(0, (2, 1)).names == [None, "st", None, None]
    dense = lazy.to_tensordict()
    assert lazy.unflatten(0, (2, 1)).names == dense.unflatten(0, (2, 1)).names
    assert lazy.flatten(1, 2).names == dense.flatten(1, 2).names


@pytest.mark.parametrize("subject", ["dense", "tensorclass"])
def test_reduction_without_dim_is_a_bool(tensordict, subject):
    for name in ("all", "any"):
        ours = getattr(_SUBJECTS[subject](shared_td), name)()
        theirs = getattr(_SUBJECTS[subject](tensordict), name)()
        assert type(ours) is bool and ours == bool(theirs)


# ------------------------------------------------------------------ errors
@pytest.mark.parametrize("call", [
    lambda t: t.all(3), lambda t: t.any(-4), lambda t: t.all(dim=10),
])
def test_reduction_dim_outside_the_batch(tensordict, call):
    with pytest.raises(RuntimeError):  # tensordict's class
        call(_dense(tensordict))
    with pytest.raises(BatchDimError, match=r"(all|any)\(dim="):
        call(_dense(shared_td))


@pytest.mark.parametrize("dims", [(0, 3), (-4, 0), (3, 3)])
def test_transpose_dim_outside_the_batch(tensordict, dims):
    with pytest.raises(ValueError):  # tensordict's class
        _dense(tensordict).transpose(*dims)
    with pytest.raises(ValueError, match="transpose: dim") as raised:
        _dense(shared_td).transpose(*dims)
    assert isinstance(raised.value, BatchDimError)


def test_flatten_end_before_start(tensordict):
    for lib in (shared_td, tensordict):
        with pytest.raises(ValueError, match="end dimension must be greater or equal"):
            _dense(lib).flatten(2, 1)


def test_flatten_dim_outside_the_batch_raises():
    """tensordict 0.15.3 warns and flattens the dims of the leaves (it will raise from
    0.17); we raise as a tensor's flatten does."""
    with pytest.raises(BatchDimError, match=r"flatten: end_dim=3"):
        _dense(shared_td).flatten(0, 3)


def test_unflatten_errors_as_tensordict(tensordict):
    for lib in (shared_td, tensordict):
        with pytest.raises(IndexError):
            _dense(lib).unflatten(3, (1, 1))
        with pytest.raises(RuntimeError, match="don't multiply up"):
            _dense(lib).unflatten(0, (3, 1))


def test_no_batch_dim_flatten_adds_one(tensordict):
    for lib in (shared_td, tensordict):
        out = lib.TensorDict(a=torch.zeros(5)).flatten()
        assert out.batch_size == torch.Size([1]) and out["a"].shape == (1, 5)


# ------------------------------------------------------------------ in place
def test_flatten_inplace_keeps_identities(tensordict):
    for lib in (shared_td, tensordict):
        td = _dense(lib).exclude("words")  # (tensordict refuses a NonTensorStack in place)
        nested, a = td["nested"], td["a"]
        assert td.flatten(0, 1, inplace=True) is td
        assert td.batch_size == (6, 4) and td.names == [None, "z"]
        assert td["nested"] is nested and td["nested"].batch_size == (6, 4, 2)
        assert td["a"].data_ptr() == a.data_ptr()
        assert td.unflatten(0, (2, 3), inplace=True) is td
        assert td.batch_size == (2, 3, 4) and td["nested"] is nested


def test_flatten_inplace_moves_non_tensor_values():
    """A NonTensorStack entry is replaced by its reshape (tensordict 0.15.3 refuses it)."""
    td = _dense(shared_td)
    assert td.flatten(inplace=True).get("words").tolist() == _dense(shared_td).flatten().get("words").tolist()
    assert td["task"] == "walk"


def test_inplace_refused_before_any_change(tensordict):
    td = _dense(shared_td)
    lazy = _lazy(shared_td, 0)
    lazy.names = ["x", "y", "z"]
    td["lazy"] = lazy
    with pytest.raises(NotImplementedError, match="inplace=False"):
        td.flatten(inplace=True)
    assert td.batch_size == (2, 3, 4) and td["a"].shape == (2, 3, 4)
    with pytest.raises(NotImplementedError):
        _lazy(shared_td, 0).unflatten(0, (2, 1), inplace=True)
    locked = _dense(shared_td).lock_()
    with pytest.raises(RuntimeError, match="locked"):
        locked.flatten(inplace=True)
    assert locked.batch_size == (2, 3, 4)


# ------------------------------------------------------------------ memmap, shared, views
_SHARING = ["memmap", "shared", "locked"]
_VIEW_OPS = ["transpose(-1,0)", "flatten(0,1)", "flatten(1,1)", "unflatten(1,(-1,1))", "all(1)"]


def _shared_dense(lib, how, tmp_path):
    td = lib.TensorDict(a=torch.arange(24).reshape(2, 3, 4),
                        nested=lib.TensorDict(c=torch.zeros(2, 3, 4, 2), batch_size=[2, 3, 4]),
                        task="walk", batch_size=[2, 3, 4])
    if how == "memmap":
        td.memmap_(tmp_path / lib.__name__)
    elif how == "shared":
        td.share_memory_()
    else:
        td.lock_()
    return td


@pytest.mark.parametrize("op", _VIEW_OPS)
@pytest.mark.parametrize("how", _SHARING)
def test_flags_of_the_result_as_tensordict(tensordict, tmp_path, how, op):
    ours = _OPS[op](_shared_dense(shared_td, how, tmp_path))
    theirs = _OPS[op](_shared_dense(tensordict, how, tmp_path))
    assert (ours.is_locked, ours.is_memmap(), ours.is_shared()) == \
        (theirs.is_locked, theirs.is_memmap(), theirs.is_shared())
    assert (ours["nested"].is_locked, ours["nested"].is_memmap()) == \
        (theirs["nested"].is_locked, theirs["nested"].is_memmap())


@pytest.mark.parametrize("op", ["transpose(-1,0)", "flatten(0,1)", "unflatten(1,(-1,1))"])
@pytest.mark.parametrize("how", _SHARING)
def test_writes_through_the_result_reach_the_original(tensordict, tmp_path, how, op):
    for lib in (shared_td, tensordict):
        td = _shared_dense(lib, how, tmp_path)
        out = _OPS[op](td)
        out["a"][(0,) * out.batch_dims] = -1  # the first element in every layout
        out["nested", "c"].fill_(7.0)
        assert td["a"][0, 0, 0] == -1, lib.__name__
        assert (td["nested", "c"] == 7.0).all(), lib.__name__


def test_writes_through_a_lazy_transpose_reach_the_members(tensordict):
    for lib in (shared_td, tensordict):
        lazy = _lazy(lib, 0)
        out = lazy.transpose(0, 2)  # batch [4, 3, 2]
        out[1, 2, 1] = lib.TensorDict(a=torch.tensor(-5), nested=lib.TensorDict(c=torch.ones(2)), task="m1")
        assert lazy.tensordicts[1]["a"][2, 1] == -5, lib.__name__


# ------------------------------------------------------------------ non-tensor containers
_NON_TENSOR_OPS = ["transpose(0,1)", "transpose(1,1)", "flatten()", "flatten(0,1)", "unflatten(1,(-1,1))",
                   "all(1)", "any(-1)"]


@pytest.mark.parametrize("op", _NON_TENSOR_OPS)
@pytest.mark.parametrize("kind", ["NonTensorData", "NonTensorStack"])
def test_non_tensor_container_as_tensordict(tensordict, kind, op):

    def build(lib):
        if kind == "NonTensorData":
            return lib.NonTensorData("x", batch_size=[2, 3])
        return _stack_of_strings(lib, [2, 3])

    ours, theirs = _OPS[op](build(shared_td)), _OPS[op](build(tensordict))
    assert type(ours).__name__ == type(theirs).__name__
    assert ours.batch_size == theirs.batch_size
    if type(theirs).__name__ == kind:  # (not the empty TensorDict of a stack's all(dim))
        assert ours.tolist() == theirs.tolist()


@pytest.mark.parametrize("call", ["transpose", "flatten", "unflatten"])
def test_torch_functions_dispatch_to_the_tensordict_methods(tensordict, call):
    def run(lib):
        td = lib.TensorDict(a=torch.arange(24.0).reshape(2, 3, 4), batch_size=[2, 3])
        out = {"transpose": lambda: torch.transpose(td, 0, 1), "flatten": lambda: torch.flatten(td),
               "unflatten": lambda: torch.unflatten(td, 1, (3, 1))}[call]()
        return out.batch_size, out["a"]

    (ours_size, ours_a), (theirs_size, theirs_a) = run(shared_td), run(tensordict)
    assert ours_size == theirs_size and torch.equal(ours_a, theirs_a)
