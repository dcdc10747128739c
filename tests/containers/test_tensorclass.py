"""@tensorclass: construction, fields, batch ops, locking, TensorDict interplay, pickling."""
from __future__ import annotations

import copy
import dataclasses
import inspect
import pickle
import sys
from typing import Any

import pytest
import torch
import torch.multiprocessing as tmp

from shared_td import BatchSizeMismatchError, LockedTensorDictError, NonTensorData, TensorDict
from shared_td.containers import tensorclass as tc_module
from shared_td.containers.tensorclass import is_tensorclass, tensorclass, tensorclass_for_type_string


@tensorclass
class Obs:
    obs: torch.Tensor
    label: str = "walk"
    extra: Any = None


@tensorclass
class Nested:
    inner: Obs
    reward: torch.Tensor


@tensorclass
class Child(Obs):
    score: torch.Tensor = None

    def describe(self):
        return f"child {self.label}"


@tensorclass
class WithMethods:
    x: torch.Tensor

    def double(self):
        return self.x * 2

    def clone(self):  # a user method wins over the forwarded one
        return "user clone"

    @property
    def total(self):
        return float(self.x.sum())


@tensorclass
class Defaults:
    x: torch.Tensor = dataclasses.field(default_factory=lambda: torch.zeros(()))
    n: int = 3


@tensorclass(frozen=True)
class Frozen:
    x: torch.Tensor


@tensorclass(nocast=True)
class NoCast:
    n: Any
    arr: Any = None


@tensorclass(shadow=True)
class Shadow:
    clone: torch.Tensor


@tensorclass
class Checked:
    x: torch.Tensor

    def __post_init__(self):
        if (self.x < 0).any():
            raise ValueError("x must be >= 0")


@tensorclass(kw_only=True)
class KwOnly:
    x: torch.Tensor


@tensorclass
class CustomInit:
    x: torch.Tensor

    def __init__(self, value, batch_size=None):
        self.x = value * 2
        if batch_size is not None:
            self.batch_size = batch_size


def make(n=3):
    return Obs(obs=torch.arange(n * 2, dtype=torch.float32).reshape(n, 2), label="a", batch_size=[n])


def state(x):
    """What a failed operation must leave as it was."""
    inner = x._tensordict
    return (
        x.batch_size, inner.is_locked, list(inner.keys()),
        {k: (v.clone() if isinstance(v, torch.Tensor) else repr(v)) for k, v in inner.items()},
    )


def assert_state(x, before):
    after = state(x)
    assert after[:3] == before[:3]
    for key, old in before[3].items():
        new = after[3][key]
        assert torch.equal(old, new) if isinstance(old, torch.Tensor) else old == new, key


# ---------------------------------------------------------------- construction
def test_construct_keywords_positional_defaults():
    x = make()
    assert isinstance(x, Obs) and type(x) is Obs
    assert x.obs.shape == (3, 2) and x.label == "a" and x.extra is None
    y = Obs(torch.zeros(3, 2), "b", batch_size=[3])
    assert y.label == "b"
    assert Obs(torch.zeros(2)).batch_size == torch.Size([])
    params = inspect.signature(Obs.__init__).parameters
    assert list(params)[:4] == ["self", "obs", "label", "extra"]
    assert params["batch_size"].kind is inspect.Parameter.KEYWORD_ONLY
    defaults = inspect.signature(Defaults.__init__).parameters
    assert repr(defaults["x"].default) == "<factory>" and defaults["n"].default == 3


def test_custom_init():
    c = CustomInit(torch.ones(2))
    assert c.batch_size == torch.Size([]) and torch.equal(c.x, torch.full((2,), 2.0))
    c = CustomInit(torch.ones(2), batch_size=[2])
    assert c.batch_size == torch.Size([2]) and type(c[0]) is CustomInit and type(c.clone()) is CustomInit


def test_defaults_and_default_factory():
    d = Defaults()
    assert torch.equal(d.x, torch.zeros(())) and isinstance(d.n, torch.Tensor) and int(d.n) == 3
    d2 = Defaults(x=torch.ones(4), batch_size=[4])
    # a scalar default that cannot be a tensor of the batch is kept as a Python value
    assert d2.n == 3 and isinstance(d2._tensordict.get("n"), NonTensorData)
    assert Defaults().x is not Defaults().x  # the factory runs per instance


def test_construct_errors():
    with pytest.raises(TypeError, match=r"missing 1 required positional argument: 'obs'"):
        Obs(label="a")
    with pytest.raises(TypeError, match="takes 4 positional arguments but 5 were given; pass batch_size"):
        Obs(torch.zeros(1), "a", None, 4)
    with pytest.raises(TypeError, match="multiple values for argument 'obs'"):
        Obs(torch.zeros(1), obs=torch.zeros(1))
    with pytest.raises(AttributeError, match=r"'foo'.*Its fields are \['extra', 'label', 'obs'\]"):
        Obs(obs=torch.zeros(1), foo=1)
    with pytest.raises(TypeError, match="takes 1 positional argument but 2 were given"):
        KwOnly(torch.zeros(1))
    assert KwOnly(x=torch.zeros(1)).x.shape == (1,)


def test_wrong_batch_size_names_the_field():
    with pytest.raises(BatchSizeMismatchError, match="'obs'"):
        Obs(obs=torch.zeros(4, 2), batch_size=[3])
    x = make()
    before = state(x)
    with pytest.raises(BatchSizeMismatchError, match=r"'obs'.*\[4, 2\]"):
        x.obs = torch.zeros(4, 2)
    assert_state(x, before)
    with pytest.raises(RuntimeError):  # tensordict raises RuntimeError: still caught
        x.obs = torch.zeros(5)


# ---------------------------------------------------------------- fields
def test_field_reads_and_writes():
    x = make()
    assert isinstance(x._tensordict, TensorDict) and x._tensordict.batch_size == x.batch_size
    x.label = "run"
    assert x.label == "run" and isinstance(x._tensordict.get("label"), NonTensorData)
    x.extra = {"a": 1}  # dicts are Python values in a tensorclass
    assert x.extra == {"a": 1} and isinstance(x._tensordict.get("extra"), NonTensorData)
    x.extra = torch.ones(3)
    assert torch.equal(x.extra, torch.ones(3))
    x.extra = None
    assert x.extra is None and "extra" not in x.keys()
    del x.label
    assert x.label is None


def test_unknown_attribute_read_and_write():
    x = make()
    with pytest.raises(AttributeError, match=r"no attribute or field 'foo'.*\['extra', 'label', 'obs'\]"):
        x.foo
    before = state(x)
    with pytest.raises(AttributeError, match=r"Cannot set the attribute 'foo': Obs has no such field"):
        x.foo = 1
    with pytest.raises(AttributeError, match="'_private'"):
        x._private = 1
    assert_state(x, before)
    assert not hasattr(x, "_keys_str")


def test_dataclass_integration_and_subclass():
    assert dataclasses.is_dataclass(Obs) and dataclasses.is_dataclass(make())
    assert [f.name for f in dataclasses.fields(Child)] == ["obs", "label", "extra", "score"]
    c = Child(torch.zeros(2, 1), "c", None, torch.ones(2), batch_size=[2])
    assert isinstance(c, Obs) and c.describe() == "child c" and torch.equal(c.score, torch.ones(2))
    assert type(c[0]) is Child and c[0].describe() == "child c"
    assert is_tensorclass(c) and is_tensorclass(Child) and not is_tensorclass(TensorDict())
    assert Obs._is_tensorclass and Obs.label == "walk"


def test_user_methods_win():
    w = WithMethods(torch.ones(2, 3), batch_size=[2])
    assert w.clone() == "user clone"
    assert torch.equal(w.double(), torch.full((2, 3), 2.0))
    assert w.total == 6.0
    assert type(w[0]) is WithMethods and w[0].total == 3.0


def test_post_init_runs_on_init_and_rebuilds():
    with pytest.raises(ValueError, match="x must be >= 0"):
        Checked(torch.tensor([-1.0]), batch_size=[1])
    c = Checked(torch.tensor([1.0, 2.0]), batch_size=[2])
    assert type(c[0]) is Checked
    with pytest.raises(ValueError, match="x must be >= 0"):
        c.apply(lambda t: -t)


# ---------------------------------------------------------------- options
def test_frozen():
    f = Frozen(torch.zeros(2), batch_size=[2])
    assert f.is_locked
    with pytest.raises(dataclasses.FrozenInstanceError, match="cannot assign to field 'x'"):
        f.x = torch.ones(2)
    with pytest.raises(LockedTensorDictError, match="Cannot modify locked"):
        f.set("x", torch.ones(2))
    f.x[0] = 1
    f.set_("x", torch.tensor([2.0, 3.0]))
    assert torch.equal(f.x, torch.tensor([2.0, 3.0]))


def test_nocast_and_shadow():
    n = NoCast(5, [1, 2])
    assert n.n == 5 and type(n.n) is int and n.arr == [1, 2]
    assert Shadow(torch.zeros(1)).clone.shape == (1,)
    with pytest.raises(AttributeError, match="'clone'.*shadow=True"):
        @tensorclass
        class Bad:
            clone: torch.Tensor
    with pytest.raises(AttributeError, match="'batch_size'"):
        @tensorclass
        class Bad2:
            batch_size: torch.Tensor


@pytest.mark.parametrize("option", [{"autocast": True}, {"tensor_only": True}, {"cast_filter": lambda k, v: True}])
def test_unsupported_options_raise(option):
    name = next(iter(option))
    with pytest.raises(TypeError, match=f"does not support the option {name}="):
        tensorclass(**option)
    with pytest.raises(TypeError, match="exclusive"):
        tensorclass(autocast=True, nocast=True)


# ---------------------------------------------------------------- locking
def test_lock_refuses_replacement_allows_in_place():
    x = make()
    assert x.lock_() is x and x.is_locked
    before = state(x)
    with pytest.raises(LockedTensorDictError, match="Here: cannot replace key 'obs'"):
        x.obs = torch.ones(3, 2)
    with pytest.raises(RuntimeError, match="Cannot modify locked"):
        x.extra = torch.ones(3)
    assert_state(x, before)
    x.obs[0] = 100
    x.set_("obs", x.obs + 1)
    assert x.obs[0, 0] == 101
    with x.unlock_():
        assert not x.is_locked
        x.obs = torch.ones(3, 2)
    assert x.is_locked and torch.equal(x.obs, torch.ones(3, 2))
    x.unlock_()
    with x.lock_():
        assert x.is_locked
    assert not x.is_locked
    x.is_locked = True
    assert x._tensordict.is_locked


# ---------------------------------------------------------------- batch ops
def test_indexing_types_and_views():
    x = make(4)
    assert x[0].batch_size == torch.Size([]) and x[0].label == "a" and type(x[0]) is Obs
    view = x[1:3]
    view.obs[0] = -1  # basic indices are views
    assert torch.equal(x.obs[1], torch.tensor([-1.0, -1.0]))
    mask = torch.tensor([True, False, True, False])
    assert torch.equal(x[mask].obs, x.obs[mask])
    assert torch.equal(x[[0, 3]].obs, x.obs[[0, 3]])
    assert x[..., None].batch_size == torch.Size([4, 1]) and x[None].batch_size == torch.Size([1, 4])
    assert x[...].batch_size == x.batch_size
    with pytest.raises(ValueError, match="indexed along its batch dimensions; to read a field"):
        x["obs"]
    with pytest.raises(ValueError, match="to write a field"):
        x["obs"] = torch.zeros(4, 2)


def test_setitem():
    x = make(4)
    x[0] = Obs(torch.full((2,), 7.0), "a")
    assert torch.equal(x.obs[0], torch.full((2,), 7.0))
    x[1:3] = TensorDict(obs=torch.full((2, 2), 5.0), batch_size=[2])
    assert (x.obs[1:3] == 5).all()
    x[torch.tensor([False, False, False, True])] = Obs(torch.zeros(1, 2), batch_size=[1])
    assert (x.obs[3] == 0).all()
    before = state(x)
    with pytest.raises(BatchSizeMismatchError, match=r"batch size \[2\].*source tensordict \[3\]"):
        x[0:2] = Obs(torch.zeros(3, 5), batch_size=[3])
    with pytest.raises(BatchSizeMismatchError, match="'obs'"):
        x[0:2] = Obs(torch.zeros(2, 5), batch_size=[2])
    assert_state(x, before)


def test_stack_cat_and_splits():
    a, b = make(), make()
    b.obs += 10
    s = torch.stack([a, b], 0)
    assert type(s) is Obs and s.batch_size == torch.Size([2, 3]) and s.extra is None
    assert torch.equal(s[1].obs, b.obs) and s[1, 0].label == "a"
    c = torch.cat([a, b])
    assert type(c) is Obs and c.batch_size == torch.Size([6])
    parts = c.unbind(0)
    assert len(parts) == 6 and all(type(p) is Obs for p in parts)
    assert [p.batch_size[0] for p in c.split(4)] == [4, 2]
    assert [p.batch_size[0] for p in c.chunk(3)] == [2, 2, 2] and type(c.chunk(3)[0]) is Obs
    assert [type(p) for p in torch.unbind(a)] == [Obs] * 3


def test_shape_ops():
    x = Obs(torch.zeros(2, 3, 5), batch_size=[2, 3])
    assert x.expand(4, 2, 3).batch_size == torch.Size([4, 2, 3])
    assert x.reshape(6).batch_size == torch.Size([6]) and x.reshape(-1).obs.shape == (6, 5)
    v = x.view(3, 2)
    v.obs.fill_(1)  # a view shares storage
    assert (x.obs == 1).all()
    assert x.unsqueeze(0).batch_size == torch.Size([1, 2, 3])
    assert x.unsqueeze(-1).squeeze(-1).batch_size == torch.Size([2, 3]) and x[None].squeeze().batch_size == torch.Size([2, 3])
    p = x.permute(1, 0)
    assert type(p) is Obs and p.batch_size == torch.Size([3, 2]) and p.obs.shape == (3, 2, 5)
    for op in (x.expand(4, 2, 3), x.reshape(6), x.unsqueeze(0), p):
        assert type(op) is Obs and op.label == "walk"


def test_to_clone_contiguous():
    x = make()
    y = x.clone()
    assert type(y) is Obs and y.label == "a"
    y.obs.fill_(-5)
    assert not (x.obs == -5).any()
    assert x.to(torch.float64).obs.dtype == torch.float64 and type(x.to(torch.float64)) is Obs
    assert x.to("cpu").device == torch.device("cpu") and type(x.cpu()) is Obs
    assert x.expand(2, 3).contiguous().obs.is_contiguous()
    assert type(x.contiguous()) is Obs


def test_apply_and_named_apply():
    x = make()
    y = x.apply(lambda t: t + 1)
    assert type(y) is Obs and torch.equal(y.obs, x.obs + 1) and y.label == "a"
    z = x.apply(lambda a, b: a + b, y)  # another tensorclass as argument
    assert torch.equal(z.obs, 2 * x.obs + 1)
    keys = []
    x.named_apply(lambda k, t: keys.append(k) or t)
    assert keys == ["obs"]
    assert x.apply(lambda t: t.zero_(), inplace=True) is x and not x.obs.any()


# ---------------------------------------------------------------- entries
def test_get_set_keys_values_items():
    x = make()
    assert x.get("label") == "a" and x.get("extra") is None and x.get("extra", 7) == 7
    assert x.get("nope", "dflt") == "dflt"
    assert x.get("nope") is None
    assert x.set("obs", torch.ones(3, 2)) is x and torch.equal(x.obs, torch.ones(3, 2))
    before = state(x)
    with pytest.raises(AttributeError, match="'newkey'"):
        x.set("newkey", torch.ones(3))
    with pytest.raises(KeyError, match="does not exist"):
        x.set_("extra", torch.ones(3))
    assert_state(x, before)
    assert list(x.keys()) == ["obs", "label"]
    assert [type(v).__name__ for v in x.values()] == ["Tensor", "NonTensorData"]
    assert [k for k, _ in x.items()] == ["obs", "label"] and "obs" in x


def test_nested_keys():
    n = Nested(inner=make(), reward=torch.zeros(3), batch_size=[3])
    assert type(n.inner) is Obs and n.get(("inner", "label")) == "a"
    n.set(("inner", "obs"), torch.full((3, 2), 4.0))
    assert (n.inner.obs == 4).all()
    assert ("inner", "obs") in n.keys(include_nested=True)
    assert type(n[0].inner) is Obs
    assert repr(n) == (
        "Nested(batch_size=[3], fields={\n"
        "    inner: Obs{label: str, obs: f32[2], extra: None},\n"
        "    reward: f32[]})"
    )


def test_update():
    x = make()
    assert x.update({"obs": torch.full((3, 2), 2.0), "label": "u"}) is x
    assert (x.obs == 2).all() and x.label == "u"
    x.update(Obs(torch.full((3, 2), 3.0), "v", batch_size=[3]))
    assert (x.obs == 3).all() and x.label == "v"
    x.update({"extra": torch.ones(3)})
    x.update({"extra": None})
    assert x.extra is None
    x.update_({"obs": torch.zeros(3, 2)})
    assert not x.obs.any()
    before = state(x)
    with pytest.raises(ValueError, match=r"\['zz'\] are not fields of Obs"):
        x.update({"obs": torch.ones(3, 2), "zz": torch.ones(3)})
    with pytest.raises(KeyError, match="extra"):
        x.update_({"obs": torch.ones(3, 2), "extra": torch.ones(3)})
    assert_state(x, before)


def test_batch_size_names_len_iter():
    x = Obs(torch.zeros(2, 3, 4), batch_size=[2, 3])
    assert x.shape == x.batch_size == torch.Size([2, 3])
    assert x.ndim == x.batch_dims == 2 and x.numel() == 6 and len(x) == 2
    assert [type(i) for i in x] == [Obs, Obs] and list(x)[0].batch_size == torch.Size([3])
    x.batch_size = [2]
    assert x.batch_size == torch.Size([2]) and x._tensordict.batch_size == torch.Size([2])
    with pytest.raises(BatchSizeMismatchError):
        x.batch_size = [5]
    assert x.batch_size == torch.Size([2])
    x.names = ["time"]
    # refine_names checks a named dim (as tensordict 0.15.3); setting names renames it
    assert x.names == ["time"] and x.refine_names("time").names == ["time"]
    with pytest.raises(RuntimeError, match="refine_names"):
        x.refine_names("t")
    x.names = ["t"]
    assert x.names == ["t"]
    assert x.device is None


def test_compare_all_any():
    x = make()
    eq = x == x.clone()
    assert type(eq) is Obs and eq.obs.dtype == torch.bool and eq.all()
    assert not (x != x.clone()).any()
    assert type(x == 0) is Obs and (x == 0).obs[0, 0]
    assert not (x == 0).all()
    with pytest.raises((RuntimeError, ValueError), match="ambiguous"):
        bool(x)
    with pytest.raises(TypeError):
        hash(x)


def test_to_dict_and_to_tensordict():
    n = Nested(inner=make(), reward=torch.zeros(3), batch_size=[3])
    d = n.to_dict()
    assert d["inner"]["label"] == "a" and d["inner"]["extra"] is None and torch.equal(d["reward"], n.reward)
    td = n.to_tensordict()
    assert type(td) is TensorDict and type(td.get("inner")) is TensorDict
    assert td["inner", "label"] == "a"
    td["inner", "obs"].fill_(-3)
    assert not (n.inner.obs == -3).any()  # a copy


def test_repr():
    x = make()
    assert repr(x) == "Obs(batch_size=[3], fields={label: str, obs: f32[2], extra: None})"
    s = torch.stack([x, x])
    assert repr(s) == (
        "Obs(batch_size=[2,3], fields={label: NonTensorStack, obs: f32[2], extra: None})"
    )
    assert "device=cpu" in repr(x.to("cpu"))


def test_share_memory():
    x = make()
    assert not x.is_shared() and not x.is_memmap()
    assert x.share_memory_() is x
    assert x.is_shared() and x.is_locked and x.obs.is_shared()


# ---------------------------------------------------------------- from/to tensordict
def test_from_tensordict():
    td = TensorDict(obs=torch.ones(3, 2), batch_size=[3])
    x = Obs.from_tensordict(td)
    assert x._tensordict is td and x.label is None and x.extra is None
    x2 = Obs.from_tensordict(td, non_tensordict={"label": "z"})
    assert x2.label == "z"
    assert Obs._from_tensordict(td)._tensordict is td
    with pytest.raises(ValueError, match=r"\['q'\] of the tensordict are not fields of Obs"):
        Obs.from_tensordict(TensorDict(q=torch.ones(3), batch_size=[3]))
    with pytest.raises(TypeError, match="needs a TensorDict"):
        Obs.from_tensordict({"obs": torch.ones(3)})


# ---------------------------------------------------------------- inside a TensorDict
def test_tensorclass_as_tensordict_value():
    td = TensorDict(batch_size=[3])
    td["x"] = make()
    assert type(td["x"]) is Obs and type(td[0]["x"]) is Obs and td[0]["x"].batch_size == torch.Size([])
    assert torch.equal(td["x", "obs"], td["x"].obs) and td["x", "label"] == "a"
    assert repr(td) == (
        "TensorDict(batch_size=[3], fields={\n    x: Obs{label: str, obs: f32[2], extra: None}})"
    )
    s = torch.stack([td, td.clone()])
    assert type(s["x"]) is Obs and s["x"].batch_size == torch.Size([2, 3])
    assert type(td.clone()["x"]) is Obs and td.clone()["x"] is not td["x"]
    assert type(td.unsqueeze(0)["x"]) is Obs
    assert type(td.apply(lambda t: t * 2)["x"]) is Obs
    with pytest.raises(BatchSizeMismatchError):
        td["y"] = make(4)


def test_lock_propagates_from_parent_tensordict():
    x = make()
    td = TensorDict(x=x, batch_size=[3])
    td.lock_()
    assert x.is_locked
    with pytest.raises(RuntimeError, match="part of a locked graph"):
        x.unlock_()
    with pytest.raises(LockedTensorDictError):
        x.label = "no"
    td.unlock_()
    assert not x.is_locked


# ---------------------------------------------------------------- registry and pickling
def test_registry():
    assert tensorclass_for_type_string(str(Obs)) is Obs
    assert tc_module._REGISTRY[str(Child)] is Child
    with pytest.raises(KeyError, match="import .* the module"):
        tensorclass_for_type_string("<class 'no_such_module_xyz.Thing'>")


def test_registry_never_imports_a_module_named_in_data(tmp_path, monkeypatch):
    # Loading must not run code chosen by whoever wrote the files: a module named in a
    # type string is not imported, even when it is importable.
    (tmp_path / "tc_registry_probe.py").write_text(
        "import pathlib\n"
        f"pathlib.Path({str(tmp_path / 'imported')!r}).touch()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "tc_registry_probe", raising=False)
    with pytest.raises(KeyError, match="No tensorclass"):
        tensorclass_for_type_string("<class 'tc_registry_probe.Point'>")
    assert "tc_registry_probe" not in sys.modules
    assert not (tmp_path / "imported").exists()


def test_pickle_roundtrip_and_deepcopy():
    n = Nested(inner=make(), reward=torch.arange(3.0), batch_size=[3])
    n.lock_()
    m = pickle.loads(pickle.dumps(n))
    assert type(m) is Nested and type(m.inner) is Obs and m.inner.label == "a"
    assert torch.equal(m.reward, n.reward) and m.is_locked and m.inner.is_locked
    c = copy.deepcopy(n)
    assert type(c.inner) is Obs and torch.equal(c.reward, n.reward) and c.reward is not n.reward


class PlainSubclass(Obs):  # not re-decorated: still a tensorclass, and registered
    def hello(self):
        return "hello"


def test_plain_subclass():
    p = PlainSubclass(torch.zeros(2, 1), batch_size=[2])
    assert type(p[0]) is PlainSubclass and p[0].hello() == "hello"
    assert tensorclass_for_type_string(str(PlainSubclass)) is PlainSubclass


def _child_fill(queue, done):
    x = queue.get()
    x.obs.fill_(7.0)
    done.put((type(x).__name__, x.label))


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_torch_multiprocessing_shares_storage(method):
    x = make()
    x.share_memory_()
    ctx = tmp.get_context(method)
    queue, done = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_child_fill, args=(queue, done))
    proc.start()
    queue.put(x)
    assert done.get(timeout=30) == ("Obs", "a")
    proc.join(30)
    assert proc.exitcode == 0
    assert (x.obs == 7).all()


def test_a_class_seen_before_it_was_decorated_is_a_tensorclass_after():
    """Whether a class is a tensorclass is remembered per class (a walk asked it of
    every node): a class met before the decorator made it one must not stay a plain one."""
    from shared_td import tensorclass_protocol

    class Late:
        obs: torch.Tensor

    plain = Late()
    assert not tensorclass_protocol.is_tensorclass(Late) and tensorclass_protocol.unwrap_tensorclass(plain) is plain
    decorated = tensorclass(Late)
    assert decorated is Late and tensorclass_protocol.is_tensorclass(Late)
    step = Late(obs=torch.zeros(2, 3), batch_size=[2])
    assert tensorclass_protocol.unwrap_tensorclass(step) is step._tensordict
    assert list(TensorDict(s=step, batch_size=[2]).keys(True, True)) == [("s", "obs")]
