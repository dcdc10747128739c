"""Non-tensor entries of a save loaded read-only (``mode="r"``, or from an archive) refuse
in-place writes, as its tensors do (ReadOnlyError), with nothing written: before, the
write changed this process's copy only and the save kept the old value, silently."""
from __future__ import annotations

import pytest
import torch

import shared_td
from shared_td.errors import ReadOnlyError

WRITES = {
    "row": lambda td: td.__setitem__(1, shared_td.TensorDict(t="Z", batch_size=[])),
    "row with a tensor": lambda td: td.__setitem__(1, shared_td.TensorDict(t="Z", x=torch.tensor(5.0), batch_size=[])),
    "set_at_": lambda td: td.set_at_("t", "Z", 1),
    "set_": lambda td: td.set_("t", shared_td.NonTensorStack("A", "B", "C")),
    "update_ of a NonTensorData": lambda td: td.update_({"u": "two"}),
}


@pytest.fixture
def saved(tmp_path):
    td = shared_td.TensorDict(t=shared_td.NonTensorStack("p", "q", "r"), u="one", x=torch.zeros(3), batch_size=[3])
    td.memmap(tmp_path / "dir")
    td.memmap(tmp_path / "packed.tdz")
    return tmp_path


def _state(td) -> tuple:
    return td.get("t").tolist(), td.get("u").data, td["x"].tolist()


ORIGINAL = (["p", "q", "r"], "one", [0.0, 0.0, 0.0])


@pytest.mark.parametrize("where, mode, reason", [("dir", "r", "mode='r'"), ("packed.tdz", None, "archive")])
@pytest.mark.parametrize("write", sorted(WRITES))
def test_a_read_only_load_refuses_non_tensor_writes_and_writes_nothing(saved, where, mode, reason, write):
    loaded = shared_td.load_memmap(saved / where, mode=mode)
    with pytest.raises(ReadOnlyError, match=reason):
        WRITES[write](loaded)
    assert _state(loaded) == ORIGINAL
    assert _state(shared_td.load_memmap(saved / where)) == ORIGINAL


def test_a_writable_load_still_takes_the_writes(saved):
    # (its tensors write into their files; its non-tensor values are this process's
    # copies, as in tensordict 0.15.3, whose load_memmap gives an unlocked tree too)
    loaded = shared_td.load_memmap(saved / "dir")
    WRITES["row with a tensor"](loaded)
    assert _state(loaded) == (["p", "Z", "r"], "one", [0.0, 5.0, 0.0])
    assert shared_td.load_memmap(saved / "dir")["x"].tolist() == [0.0, 5.0, 0.0]
