"""A subclass of TensorDict stays one through the operations that derive a new tree
from it (index, clone, select, to, reshape, stack, cat, memmap, load), as in
tensordict 0.15.3, side by side with it where it is installed."""
import pickle

import pytest
import torch

import shared_td

try:
    import tensordict
except ImportError:  # the comparison runs only where tensordict is installed
    tensordict = None


class Sub(shared_td.TensorDict):
    pass


if tensordict is not None:
    class TdSub(tensordict.TensorDict):
        pass


def _subclass(lib):
    return Sub if lib is shared_td else TdSub  # (module level: pickle finds them)


OPERATIONS = {
    "clone": lambda t, lib: t.clone(),
    "clone(recurse=False)": lambda t, lib: t.clone(False),
    "row": lambda t, lib: t[0],
    "rows": lambda t, lib: t[torch.tensor([0, 2])],
    "apply": lambda t, lib: t.apply(lambda x: x + 1),
    "select": lambda t, lib: t.select("a"),
    "exclude": lambda t, lib: t.exclude("a"),
    "to": lambda t, lib: t.to("cpu", dtype=torch.float64),
    "empty": lambda t, lib: t.empty(),
    "copy": lambda t, lib: t.copy(),
    "unbind": lambda t, lib: t.unbind(0)[0],
    "reshape": lambda t, lib: t.reshape(-1),
    "detach": lambda t, lib: t.detach(),
    "stack": lambda t, lib: torch.stack([t, t]),
    "cat": lambda t, lib: torch.cat([t, t]),
    "stack of plain first": lambda t, lib: torch.stack([lib.TensorDict(a=torch.zeros(3), n={"b": torch.ones(3)}, batch_size=[3]), t]),
    "memmap": lambda t, lib: t.memmap(),
    "memmap_like": lambda t, lib: t.memmap_like(),
    "pickle": lambda t, lib: pickle.loads(pickle.dumps(t)),
    "consolidate": lambda t, lib: t.consolidate(),
    "nested entry": lambda t, lib: t["n"],
}


def _class_names(lib, operation):
    sub = _subclass(lib)
    tree = sub(a=torch.zeros(3), n={"b": torch.ones(3)}, batch_size=[3])
    result = OPERATIONS[operation](tree, lib)
    return "Sub" if type(result) is sub else type(result).__name__


@pytest.mark.parametrize("operation", list(OPERATIONS))
def test_result_class_as_tensordict(operation):
    expected = {"stack of plain first": "TensorDict", "nested entry": "TensorDict"}.get(operation, "Sub")
    assert _class_names(shared_td, operation) == expected
    if tensordict is not None:
        assert _class_names(tensordict, operation) == expected


def test_subclass_load_memmap_gives_the_subclass(tmp_path):
    sub = _subclass(shared_td)
    sub(a=torch.arange(3), batch_size=[3]).memmap(tmp_path / "saved")
    loaded = sub.load_memmap(tmp_path / "saved")
    assert type(loaded) is sub and loaded["a"].tolist() == [0, 1, 2]
    # the class on disk otherwise: TensorDict.load_memmap gives a TensorDict
    assert type(shared_td.TensorDict.load_memmap(tmp_path / "saved")) is shared_td.TensorDict


def test_subclass_with_its_own_slots_round_trips(tmp_path):
    class Slotted(shared_td.TensorDict):
        __slots__ = ("extra",)

    Slotted(a=torch.arange(3), batch_size=[3]).memmap(tmp_path / "saved")
    loaded = Slotted.load_memmap(tmp_path / "saved")
    assert type(loaded) is Slotted and loaded["a"].tolist() == [0, 1, 2]
    loaded.set("b", torch.ones(3))  # a working tree: unlocked, as every load


@shared_td.tensorclass
class Base:
    x: torch.Tensor


@shared_td.tensorclass
class Extended(Base):
    y: torch.Tensor


class Stack(shared_td.LazyStackedTensorDict):
    pass


def test_no_subclass_is_made_up_from_a_save_of_its_base(tmp_path):
    """Only a TensorDict save becomes the TensorDict subclass that loads it: a tensorclass
    subclass loading its base's save got its added fields as None."""
    Base(x=torch.zeros(2), batch_size=[2]).memmap(tmp_path / "tc")
    assert type(Extended.load_memmap(tmp_path / "tc")) is Base
    shared_td.lazy_stack([shared_td.TensorDict(a=torch.zeros(1), batch_size=[1])] * 2).memmap(tmp_path / "lazy")
    assert type(Stack.load_memmap(tmp_path / "lazy")) is shared_td.LazyStackedTensorDict


@pytest.mark.parametrize("lib", ["shared_td", "tensordict"])
def test_comparisons_of_a_subclass_are_tensordicts(lib):
    if lib == "tensordict" and tensordict is None:
        pytest.skip("tensordict is not installed")
    sub = _subclass(shared_td if lib == "shared_td" else tensordict)
    tree = sub(a=torch.zeros(3), batch_size=[3])
    assert type(tree == 0).__name__ == type(tree != 0).__name__ == "TensorDict"


_TENSORDICT_SAVES_A_SUBCLASS = """
import sys, torch, tensordict
class Sub(tensordict.TensorDict):
    pass
Sub(a=torch.arange(3), n={"b": torch.ones(3)}, batch_size=[3]).memmap(sys.argv[1])
"""


def test_tensordict_save_of_a_subclass_loads(tmp_path):
    """tensordict 0.15.3 writes a subclass's own class in meta.json: shared_td read it as
    an unknown tensorclass (FormatError). It loads as that subclass where one of that
    name is defined (Sub.load_memmap for a script's class), else the error names the fix."""
    pytest.importorskip("tensordict")
    import subprocess
    import sys

    subprocess.run([sys.executable, "-c", _TENSORDICT_SAVES_A_SUBCLASS, str(tmp_path / "saved")],
                   check=True, timeout=120)
    loaded = Sub.load_memmap(tmp_path / "saved")
    assert type(loaded) is Sub and loaded["a"].tolist() == [0, 1, 2] and loaded["n", "b"].tolist() == [1.0] * 3
    with pytest.raises(shared_td.FormatError, match=r"__main__\.Sub.*TensorDict subclass.*load_memmap"):
        shared_td.TensorDict.load_memmap(tmp_path / "saved")


def test_subclass_save_loads_in_tensordict(tmp_path):
    if tensordict is None:
        pytest.skip("tensordict is not installed")
    Sub(a=torch.arange(3), n={"b": torch.ones(3)}, batch_size=[3]).memmap(tmp_path / "saved")
    loaded = tensordict.TensorDict.load_memmap(tmp_path / "saved")
    assert type(loaded) is tensordict.TensorDict and loaded["a"].tolist() == [0, 1, 2]
