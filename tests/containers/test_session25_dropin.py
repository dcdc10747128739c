"""Drop-in fixes of the 2026-12-06 (thirteenth) round, side by side with tensordict 0.15.3
where it is installed: found by tensordict's upstream tests and the differential fuzzer."""
from __future__ import annotations

import pytest
import torch

from tests.reference import LIBS


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("method", ["new_empty", "new_zeros", "new_ones"])
def test_new_like_keeps_a_non_tensor_value_for_every_row(lib, method):
    """A NonTensorData entry keeps its value, over the new batch size (before: an empty
    tensordict took its place, the value lost); a NonTensorStack still gives an empty
    tensordict (no value for the new rows), as tensordict 0.15.3."""
    td = lib.TensorDict(a=lib.NonTensorStack("a", "b").unsqueeze(-1), s="x", n={"t": "y"}, x=torch.ones(2),
                        batch_size=(2,))
    out = getattr(td, method)((4, 3))
    assert type(out.get("s")).__name__ == "NonTensorData" and out.get("s").batch_size == (4, 3)
    assert out["s"] == "x" and out["n", "t"] == "y"
    assert type(out.get("a")).__name__ == "TensorDict" and out.get("a").batch_size == (4, 3, 1)
    assert out["x"].shape == (4, 3)


@pytest.mark.parametrize("lib", LIBS)
def test_a_value_of_another_kind_written_in_place_raises_what_tensordict_users_catch(lib):
    """tensordict 0.15.3 raises a RuntimeError (a string into a tensor entry) and a
    ValueError that is a RuntimeError (a tensor into a string entry); shared_td's
    InPlaceKindError is both, and still the TypeError it was (found by tensordict's
    upstream test_set)."""
    td = lib.TensorDict(x=torch.ones(3), s="text", batch_size=[3])
    with pytest.raises(RuntimeError):
        td.set("x", "a string", inplace=True)
    with pytest.raises(RuntimeError) as caught:
        td.set("s", torch.zeros(3), inplace=True)
    assert isinstance(caught.value, ValueError)
    if lib.__name__ == "shared_td":
        assert isinstance(caught.value, TypeError) and "'s'" in str(caught.value)
    assert torch.equal(td["x"], torch.ones(3)) and td["s"] == "text"


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("source", ["share_memory_", "memmap_"])
@pytest.mark.parametrize("how", ["plain", "share_memory", "pickled"])
@pytest.mark.parametrize("write", ["set_", "update_"])
def test_consolidate_gives_non_tensor_values_of_its_own(lib, source, how, write, tmp_path):
    """A consolidated copy of a tree whose non-tensor values are shared or memory-mapped
    does not write into them (it kept the source's shared cell: ``set_`` on the copy
    changed the source; fuzzer seed 91384)."""
    import pickle

    td = lib.TensorDict({"a": torch.zeros(2)}, [2])
    td.set_non_tensor("text", "old")
    td.share_memory_() if source == "share_memory_" else td.memmap_(tmp_path / "save")
    out = td.consolidate(share_memory=how == "share_memory")
    if how == "pickled":
        out = pickle.loads(pickle.dumps(out))
    out.unlock_()
    out.set_("text", "new") if write == "set_" else out.update_({"text": "new"})
    assert td.get_non_tensor("text") == "old" and out.get_non_tensor("text") == "new"
