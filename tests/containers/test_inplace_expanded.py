"""An expanded entry (several elements one memory location) written in place as a whole:
tensordict 0.15.3 raises its _InplaceWriteError, a ValueError and a RuntimeError; shared_td
raises InPlaceWriteError, both too, naming the key, before anything is written (the fuzzer
found torch's bare RuntimeError, which an ``except ValueError`` missed)."""
from __future__ import annotations

import pytest
import torch

import shared_td
from tests.reference import LIBS

WRITES = {
    "set_": lambda td: td.set_("a", torch.ones(2, 2)),
    "set inplace": lambda td: td.set("a", torch.ones(2, 2), inplace=True),
    "update inplace": lambda td: td.update({"a": torch.ones(2, 2)}, inplace=True),
    "apply_": lambda td: td.apply_(lambda x: x + 1),
}


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("write", list(WRITES))
def test_a_whole_write_into_an_expanded_entry_is_a_value_and_runtime_error(lib, write):
    td = lib.TensorDict({"a": torch.zeros(2)}, [2]).expand(2, 2)
    with pytest.raises(ValueError) as raised:
        WRITES[write](td)
    assert isinstance(raised.value, RuntimeError)
    if lib is shared_td:
        assert isinstance(raised.value, shared_td.InPlaceWriteError)
        assert "'a'" in str(raised.value) and "expanded" in str(raised.value)


def test_update_into_an_expanded_entry_writes_nothing():
    """All or nothing: the entry before the expanded one is left as it was."""
    base = shared_td.TensorDict({"b": torch.zeros(2, 2)}, [2, 2])
    base["a"] = torch.zeros(2).expand(2, 2)
    with pytest.raises(shared_td.InPlaceWriteError, match="'a'"):
        base.update_({"b": torch.ones(2, 2), "a": torch.ones(2, 2)})
    assert base["b"].eq(0).all()


def test_an_expanded_row_of_one_element_is_still_written():
    """A dim of stride 0 and one element holds no element twice: written as before."""
    td = shared_td.TensorDict({"a": torch.zeros(3).expand(1, 3)}, [1])
    td.set_("a", torch.ones(1, 3))
    assert td["a"].eq(1).all()
