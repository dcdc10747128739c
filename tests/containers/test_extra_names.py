"""Small tensordict 0.15.3 names (issue 12): ``apply_``, ``dtype``, ``depth``,
``tensor_split``, and the classmethods ``stack``, ``cat``, ``maybe_dense_stack``,
``fromkeys``, ``from_list``, ``from_dataclass`` (and the module functions tensordict
exports). Each case runs the same code on shared_td and on tensordict 0.15.3 and compares
what comes out; an error must be of the class tensordict raises (ours may derive from it).
"""
from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

import shared_td
from tests.reference import dim_names, needs_tensordict, side_by_side, tensordict

pytestmark = needs_tensordict


def _error(fn):
    """The class of the exception ``fn()`` raises (warnings silenced), or None."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fn()
    except Exception as error:  # noqa: BLE001 (compared by class below)
        return error
    return None


def same_error(scenario):
    """``scenario(lib)`` raises on both, ours an instance of tensordict's class."""
    theirs = _error(lambda: scenario(tensordict))
    ours = _error(lambda: scenario(shared_td))
    assert theirs is not None, "tensordict does not raise"
    assert isinstance(ours, type(theirs)), (ours, theirs)


def _desc(value):
    """A comparable picture of a result: class, batch size, names, lock, leaves."""
    if isinstance(value, (tuple, list)):
        return [_desc(v) for v in value]
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, value.tolist())
    if not hasattr(value, "batch_size"):
        return value
    inner = getattr(value, "_tensordict", value)
    leaves = {}
    for key in inner.keys(True, True):
        leaf = inner.get(key)
        leaves[str(key)] = (leaf.dtype, leaf.tolist())
    try:
        names = dim_names(value)
    except (RuntimeError, ValueError):  # (a lazy stack whose members name their dims otherwise)
        names = "unreadable"
    return type(value).__name__, list(value.batch_size), names, value.is_locked, leaves


def _tree(lib, **options):
    return lib.TensorDict(a=torch.zeros(2, 3), b={"c": torch.ones(2, dtype=torch.int64)}, s="text",
                          batch_size=[2], names=["x"], **options)


def _lazy(lib):
    return lib.LazyStackedTensorDict(lib.TensorDict(a=torch.zeros(3), n={"m": torch.ones(3)}),
                                     lib.TensorDict(a=torch.ones(3), n={"m": torch.ones(3)}))


def _tc_class(lib):
    @lib.tensorclass
    class Step:
        obs: torch.Tensor
        label: str = "walk"

    return Step


# ------------------------------------------------------------------ apply_
@pytest.mark.parametrize("case", ["plus", "cast", "none", "others", "locked", "names kw", "batch_size kw"])
def test_apply_in_place_as_tensordict(case):
    def scenario(lib):
        td = _tree(lib)
        if case == "locked":
            td.lock_()
        a = td["a"]
        if case == "plus":
            out = td.apply_(lambda x: x + 1)
        elif case == "cast":  # a float64 result is written into the float32 leaf
            out = td.apply_(lambda x: x.double() + 0.5)
        elif case == "none":  # a None result leaves the leaf as it is
            out = td.apply_(lambda x: None if x.dtype == torch.int64 else x + 2)
        elif case == "others":
            out = td.apply_(lambda x, y: x + 2 * y, _tree(lib).apply(lambda x: x + 1))
        elif case == "names kw":  # the written tensordict keeps its names
            out = td.apply_(lambda x: x + 1, names=["y"])
        else:  # with batch_size, the results still go into the leaves
            out = td.apply_(lambda x: x + 1, batch_size=[2])
        return out is td, td["a"] is a, td["s"], _desc(td)

    side_by_side(scenario)


def test_apply_on_a_lazy_stack_writes_into_its_members():
    def scenario(lib):
        stack = _lazy(lib)
        members = [m["a"] for m in stack.tensordicts]
        assert stack.apply_(lambda x: x * 2 + 1) is stack
        return [m.tolist() for m in members], [m["n", "m"].tolist() for m in stack.tensordicts]

    side_by_side(scenario)


def test_apply_on_a_tensorclass_returns_the_instance():
    def scenario(lib):
        step = _tc_class(lib)(obs=torch.zeros(2, 3), batch_size=[2])
        obs = step.obs
        out = step.apply_(lambda x: x + 3)
        return out is step, step.obs is obs, obs.tolist(), step.label

    side_by_side(scenario)


@pytest.mark.parametrize("case", ["wrong shape", "0-d result", "missing other key", "inplace given",
                                  "fn raises late"])
def test_apply_refusals_as_tensordict_and_nothing_written(case, unchanged):
    def call(lib, td):
        if case == "wrong shape":
            td.apply_(lambda x: torch.zeros(5))
        elif case == "0-d result":  # (not broadcast: the leading dims must be the batch size)
            td.apply_(lambda x: torch.tensor(7))
        elif case == "missing other key":
            td.apply_(lambda x, y: x + y, lib.TensorDict(a=torch.ones(2, 3), batch_size=[2]))
        elif case == "inplace given":
            td.apply_(lambda x: x, inplace=False)
        else:  # fn fails on the second leaf, after the first one's result was made
            td.apply_(lambda x: x + 1 if x.dtype == torch.float32 else 1 / 0)

    if case != "fn raises late":
        same_error(lambda lib: call(lib, _tree(lib)))
    expected = {"missing other key": KeyError, "inplace given": TypeError, "fn raises late": ZeroDivisionError}
    td = _tree(shared_td)
    with unchanged(td), pytest.raises(expected.get(case, RuntimeError)):
        call(shared_td, td)


def test_apply_failing_after_a_nested_leaf_writes_nothing(unchanged):
    # (tensordict 0.15.3 has written ("b", "c") when fn fails on "a")
    td = shared_td.TensorDict(b={"c": torch.zeros(2)}, a=torch.zeros(2, dtype=torch.int64), batch_size=[2])
    with unchanged(td), pytest.raises(ZeroDivisionError):
        td.apply_(lambda x: x + 1 if x.is_floating_point() else 1 / 0)


def test_apply_failing_on_a_later_member_writes_no_member(unchanged):
    stack = shared_td.LazyStackedTensorDict(shared_td.TensorDict(a=torch.zeros(3)),
                                            shared_td.TensorDict(a=torch.zeros(3, dtype=torch.int64)))
    for fn in (lambda x: x + 1 if x.dtype == torch.float32 else 1 / 0,
               lambda x: x + 1 if x.dtype == torch.float32 else torch.zeros(4, dtype=torch.int64)):
        with unchanged(stack.tensordicts[0]), pytest.raises((ZeroDivisionError, RuntimeError)):
            stack.apply_(fn)


def test_apply_leaves_non_tensor_entries_alone(monkeypatch):
    # a shared non-tensor value written back into itself would overwrite another
    # process's later write: apply_ must not write it at all
    td = _tree(shared_td).share_memory_()
    monkeypatch.setattr(type(td.get("s")), "_update_", lambda *a, **k: pytest.fail("non-tensor written"))
    td.apply_(lambda x: x + 1)
    assert td["a"].tolist() == [[1.0] * 3] * 2 and td["s"] == "text"


def test_apply_writes_through_a_memory_mapped_tensordict(tmp_path):
    td = _tree(shared_td).memmap_(tmp_path / "td")
    leaf = td["a"]
    td.apply_(lambda x: x + 4)
    assert td["a"] is leaf and td.is_locked
    assert shared_td.load_memmap(tmp_path / "td")["a"].tolist() == [[4.0] * 3] * 2


def test_apply_writes_through_a_shared_memory_tensordict():
    td = _tree(shared_td).share_memory_()
    storage = td["a"].untyped_storage().data_ptr()
    td.apply_(lambda x: x - 1)
    assert td["a"].is_shared() and td["a"].untyped_storage().data_ptr() == storage
    assert td["a"].tolist() == [[-1.0] * 3] * 2 and td["b", "c"].tolist() == [0, 0]


# ------------------------------------------------------------------ dtype, depth
@pytest.mark.parametrize("make", [
    lambda lib: lib.TensorDict(a=torch.zeros(2), b={"c": torch.ones(2)}, batch_size=[2]),
    lambda lib: _tree(lib),  # float32 and int64: None
    lambda lib: lib.TensorDict(),
    lambda lib: lib.TensorDict(a=torch.zeros(2), s="x", e={}, batch_size=[2]),  # non-tensors do not count
    lambda lib: _lazy(lib),
    lambda lib: lib.LazyStackedTensorDict(lib.TensorDict(a=torch.zeros(2)),
                                          lib.TensorDict(a=torch.zeros(2, dtype=torch.int32))),
    lambda lib: _tc_class(lib)(obs=torch.zeros(2), batch_size=[2]),
], ids=["one dtype", "two dtypes", "empty", "non-tensor", "lazy", "lazy two dtypes", "tensorclass"])
def test_dtype_and_depth_as_tensordict(make):
    side_by_side(lambda lib: (make(lib).dtype, make(lib).depth))


@pytest.mark.parametrize("entries", [{"a": 0}, {"a": {"b": {"c": 0}}}, {"a": {}}, {"a": {"b": {}}, "c": 1},
                                     {"a": {"b": "text"}}])
def test_depth_counts_the_levels_that_hold_a_leaf(entries):
    side_by_side(lambda lib: lib.TensorDict(entries).depth)


# ------------------------------------------------------------------ tensor_split
@pytest.mark.parametrize("spec", [3, 7, 9, [1, 5], (2,), [-2], [5, 1], [0, 20], torch.tensor(3),
                                  torch.tensor([1, 5])], ids=str)
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_tensor_split_as_tensordict(spec, dim):
    def scenario(lib):
        td = lib.TensorDict(x=torch.arange(28).reshape(4, 7), batch_size=[4, 7], names=["t", "u"]).lock_()
        parts = td.tensor_split(spec, dim)
        return [(list(p.batch_size), p["x"].tolist(), p.names, p.is_locked) for p in parts]

    side_by_side(scenario)


def test_torch_tensor_split_of_a_tensordict_as_tensordict():
    side_by_side(lambda lib: [p["x"].tolist() for p in torch.tensor_split(
        lib.TensorDict(x=torch.arange(6), batch_size=[6]), [2, 3])])


def test_tensor_split_gives_views():
    td = shared_td.TensorDict(x=torch.zeros(5), batch_size=[5])
    first, second = td.tensor_split(2)
    second["x"] += 1
    assert td["x"].tolist() == [0.0, 0.0, 0.0, 1.0, 1.0]


@pytest.mark.parametrize("spec, dim", [(2.0, 0), (0, 0), (2, 2), (torch.tensor([1.0]), 0),
                                       (torch.ones(1, 1, dtype=torch.long), 0), ("ab", 0)], ids=str)
def test_tensor_split_refusals_as_tensordict(spec, dim):
    same_error(lambda lib: lib.TensorDict(x=torch.zeros(4, 7), batch_size=[4, 7]).tensor_split(spec, dim))


def test_tensor_split_of_a_lazy_stack_and_a_tensorclass():
    def scenario(lib):
        stack = lib.LazyStackedTensorDict(*[lib.TensorDict(a=torch.full((3,), float(i))) for i in range(3)])
        step = _tc_class(lib)(obs=torch.arange(5), batch_size=[5])
        return ([(type(p).__name__, p["a"].tolist()) for p in stack.tensor_split(2)],
                [(type(p).__name__, p.obs.tolist()) for p in step.tensor_split([2])])

    side_by_side(scenario)


# ------------------------------------------------------------------ classmethods
def _pair(lib, other=None):
    a = lib.TensorDict(x=torch.zeros(3), batch_size=[3], names=["t"])
    b = lib.TensorDict(x=torch.ones(3), batch_size=[3], names=["t"])
    return [a, b if other is None else other]


CLASSMETHOD_CASES = {
    "stack": lambda lib: lib.TensorDict.stack(_pair(lib), 1),
    "stack tensors": lambda lib: lib.TensorDict.stack([torch.zeros(2), torch.ones(2)]),
    "stack out": lambda lib: lib.TensorDict.stack(_pair(lib), out=lib.TensorDict(x=torch.zeros(2, 3), batch_size=[2, 3])),
    "lazy class stack": lambda lib: lib.LazyStackedTensorDict.stack(_pair(lib)),
    "cat": lambda lib: lib.TensorDict.cat(_pair(lib)),
    "cat tensors": lambda lib: lib.TensorDict.cat([torch.zeros(2), torch.ones(2)]),
    "lazy class cat": lambda lib: lib.LazyStackedTensorDict.cat(_pair(lib)),
    "maybe dense: same": lambda lib: lib.TensorDict.maybe_dense_stack(_pair(lib)),
    "maybe dense: keys": lambda lib: lib.TensorDict.maybe_dense_stack(_pair(lib, lib.TensorDict(y=torch.ones(3), batch_size=[3])))[1]["y"],
    "maybe dense: shapes": lambda lib: lib.LazyStackedTensorDict.maybe_dense_stack(_pair(lib, lib.TensorDict(x=torch.ones(3, 2), batch_size=[3])))[1],
    "maybe dense: lazy items": lambda lib: lib.maybe_dense_stack([lib.lazy_stack(_pair(lib))] * 2, 1),
    "maybe dense: out": lambda lib: lib.maybe_dense_stack(_pair(lib), out=lib.TensorDict(x=torch.zeros(2, 3), z=torch.zeros(2, 3), batch_size=[2, 3])),
    "fromkeys": lambda lib: lib.TensorDict.fromkeys(["a", ("b", "c")], 1),
    "fromkeys default": lambda lib: lib.TensorDict.fromkeys(["a"]),
    "fromkeys one tensor": lambda lib: (lambda td: td["a"] is td["b", "c"])(lib.TensorDict.fromkeys(["a", ("b", "c")], torch.zeros(3))),
    "fromkeys str": lambda lib: lib.LazyStackedTensorDict.fromkeys(["a"], "s")["a"],
    "module fromkeys": lambda lib: lib.fromkeys(["a"], 2.5),
    "module stack cat": lambda lib: (lib.stack(_pair(lib)), lib.cat(_pair(lib))),
    "from_list": lambda lib: lib.TensorDict.from_list([{"a": torch.zeros(3)}, {"a": torch.ones(3)}]),
    "from_list sizes": lambda lib: lib.TensorDict.from_list([{"a": torch.zeros(3)}, {"a": torch.ones(3)}], batch_size=[2, 3], names=["x", "y"]),
    "from_list auto": lambda lib: lib.TensorDict.from_list([{"a": torch.zeros(3, 4)}] * 2, auto_batch_size=True),
    "from_list batch_dims": lambda lib: lib.TensorDict.from_list([{"a": torch.zeros(3, 4)}] * 2, batch_dims=2),
    "from_list ragged": lambda lib: lib.TensorDict.from_list([{"a": torch.zeros(3)}, {"a": torch.ones(4)}])[1],
    "from_list lazy": lambda lib: lib.TensorDict.from_list([{"a": torch.zeros(3)}] * 2, lazy=True)[0],
    "from_list tensordicts": lambda lib: lib.TensorDict.from_list(_pair(lib), names=["n", "t"]),
    "from_list numbers": lambda lib: lib.TensorDict.from_list([{"a": 1}, {"a": 2}], batch_size=[2]),
    "from_list strings": lambda lib: lib.TensorDict.from_list([{"a": "u"}, {"a": "v"}])["a"],
    "lazy from_list": lambda lib: lib.LazyStackedTensorDict.from_list([{"a": torch.zeros(3)}] * 2, batch_size=[3], names=["s", "t"]),
}


@pytest.mark.parametrize("case", list(CLASSMETHOD_CASES))
def test_classmethods_as_tensordict(case):
    side_by_side(lambda lib: _desc(CLASSMETHOD_CASES[case](lib)))


@pytest.mark.parametrize("case", ["stack keys", "stack shapes", "cat keys", "maybe dense strict out",
                                  "fromkeys bad key", "from_list bad batch_size", "from_list empty",
                                  "from_list dense ragged", "from_dataclass of a dict"])
def test_classmethod_refusals_as_tensordict(case):
    def scenario(lib):
        other = lib.TensorDict(y=torch.ones(3), batch_size=[3])
        if case == "stack keys":
            lib.TensorDict.stack(_pair(lib, other))
        elif case == "stack shapes":
            lib.TensorDict.stack(_pair(lib, lib.TensorDict(x=torch.ones(3, 2), batch_size=[3])))
        elif case == "cat keys":
            lib.TensorDict.cat(_pair(lib, other))
        elif case == "maybe dense strict out":
            out = lib.TensorDict(x=torch.zeros(2, 3), z=torch.zeros(2, 3), batch_size=[2, 3])
            lib.maybe_dense_stack(_pair(lib), out=out, strict=True)
        elif case == "fromkeys bad key":
            lib.TensorDict.fromkeys([1])
        elif case == "from_list bad batch_size":
            lib.TensorDict.from_list([{"a": torch.zeros(3)}] * 2, batch_size=[3])
        elif case == "from_list empty":
            lib.TensorDict.from_list([])
        elif case == "from_list dense ragged":
            lib.TensorDict.from_list([{"a": torch.zeros(3)}, {"a": torch.ones(4)}], lazy=False)
        else:
            lib.TensorDict.from_dataclass({"a": 1})

    same_error(scenario)


def test_tensorclass_classmethods_give_the_class():
    def scenario(lib):
        step_cls = _tc_class(lib)
        step = step_cls(obs=torch.zeros(4), batch_size=[4])
        return [(type(r).__name__, list(r.batch_size)) for r in (
            step_cls.stack([step, step]), step_cls.cat([step, step]), step_cls.maybe_dense_stack([step, step]),
            step_cls.fromkeys(["obs"]), step_cls.from_list([step[0], step[1]]), step.stack([step, step]))]

    side_by_side(scenario)


@dataclasses.dataclass
class _Inner:
    z: int = 3


@dataclasses.dataclass
class _Data:
    obs: torch.Tensor
    reward: float
    inner: _Inner
    name: str = "n"


@pytest.mark.parametrize("options", [{}, {"auto_batch_size": True}, {"auto_batch_size": True, "batch_dims": 1},
                                     {"batch_size": [3]}], ids=str)
def test_from_dataclass_as_tensordict(options):
    def scenario(lib):
        data = _Data(obs=torch.zeros(3, 4), reward=1.5, inner=_Inner(), name="walk")
        td = lib.TensorDict.from_dataclass(data, **options)
        return _desc(td), td["name"]

    side_by_side(scenario)


def test_from_dataclass_as_tensorclass_and_on_the_lazy_class():
    def scenario(lib):
        data = _Data(obs=torch.zeros(3, 4), reward=1.5, inner=_Inner())
        step = lib.TensorDict.from_dataclass(data, as_tensorclass=True, batch_size=[3])
        return (type(step).__name__, list(step.batch_size), step.obs.shape,
                _desc(lib.LazyStackedTensorDict.from_dataclass(data)))

    side_by_side(scenario)


def test_the_module_functions_are_exported_as_in_tensordict():
    for name in ("maybe_dense_stack", "stack", "cat", "fromkeys"):
        assert name in shared_td.__all__ and callable(getattr(shared_td, name))


# ------------------------------------------------------------------ split_keys
def _split_tree(lib):
    return lib.TensorDict(a=torch.zeros(3), b={"c": torch.zeros(3), "d": torch.zeros(3, 2)}, s="text", e={},
                          batch_size=[3], names=["t"])


SPLIT_CASES = {
    "lists": lambda lib, td: td.split_keys(["a"], [("b", "c")]),
    "dict renames": lambda lib, td: td.split_keys({"a": "z", ("b", "c"): ("q", "r")}),
    "callable": lambda lib, td: td.split_keys(lambda key, value: value.ndim == 1, lambda key, value: key == ("b", "d")),
    "a whole nested tensordict": lambda lib, td: td.split_keys(["b"]),
    "a non-tensor": lambda lib, td: td.split_keys(["s"]),
    "missing, not strict": lambda lib, td: td.split_keys(["zz", "a"], strict=False),
    "missing with a default": lambda lib, td: td.split_keys(["zz"], strict=False, default=torch.ones(3)),
    "twice, not strict": lambda lib, td: td.split_keys(["a"], ["a"], strict=False),
    "reproduce_struct": lambda lib, td: td.split_keys([("b", "c")], reproduce_struct=True),
    "no set": lambda lib, td: td.split_keys(),
    "locked": lambda lib, td: td.lock_().split_keys(["a"]),
    "inplace": lambda lib, td: td.split_keys(["a"], [("b", "c")], inplace=True) + (td,),
}


@pytest.mark.parametrize("case", list(SPLIT_CASES))
def test_split_keys_as_tensordict(case):
    def scenario(lib):
        td = _split_tree(lib)
        a = td["a"]
        parts = SPLIT_CASES[case](lib, td)
        shapes = [sorted((str(k), tuple(v.shape)) for k, v in p.items(True, True)) for p in parts]
        return (_desc(parts), shapes, [sorted(map(str, p.keys(True))) for p in parts],
                [p.get("a", None) is a for p in parts], parts[-1] is td, sorted(map(str, td.keys(True))))

    side_by_side(scenario)


@pytest.mark.parametrize("case", ["missing", "twice", "missing, default ignored", "locked, inplace"])
def test_split_keys_refusals_as_tensordict_and_nothing_removed(case, unchanged):
    def call(td):
        if case == "missing":
            td.split_keys(["a"], ["zz"], inplace=True)
        elif case == "twice":
            td.split_keys(["a"], ["a"], inplace=True)
        elif case == "missing, default ignored":
            td.split_keys(["zz"], default=torch.ones(3))
        else:
            td.split_keys(["a"], inplace=True)

    def tree(lib):
        td = _split_tree(lib)
        return td.lock_() if case == "locked, inplace" else td

    same_error(lambda lib: call(tree(lib)))
    td = tree(shared_td)
    with unchanged(td), pytest.raises((KeyError, RuntimeError)):
        call(td)


def test_split_keys_of_a_lazy_stack_and_a_tensorclass():
    def scenario(lib):
        stack = lib.LazyStackedTensorDict(*[lib.TensorDict(a=torch.zeros(3), b=torch.ones(3))] * 2)

        @lib.tensorclass
        class Pair:
            x: torch.Tensor
            y: torch.Tensor

        pair = Pair(x=torch.zeros(3), y=torch.ones(3), batch_size=[3])
        return _desc(stack.split_keys(["a"])), [(type(p).__name__, _desc(p)) for p in pair.split_keys(["x"])]

    side_by_side(scenario)
