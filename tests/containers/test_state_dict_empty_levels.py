"""A state dict holding the levels of an empty nested tensordict (metadata, no leaf) loads as
in tensordict 0.15.3: strict does not refuse them and they are not added, so a locked
(memory-mapped) tensordict that lacks them takes the checkpoint (before: StateDictKeysError
with strict, LockedTensorDictError without; found running tensordict's upstream
test_load_state_dict_incomplete)."""
from __future__ import annotations

import pytest
import torch

import shared_td
from tests.reference import LIBS


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("flatten", [True, False])
@pytest.mark.parametrize("locked", [False, True])
def test_levels_of_an_empty_nested_tensordict_load_as_nothing(lib, strict, flatten, locked, tmp_path):
    if lib is not shared_td and not flatten:
        pytest.skip("tensordict 0.15.3 adds the levels of the nested format (and then cannot load into a "
                    "locked tree); shared_td loads both formats as the flat one")
    sd = lib.TensorDict({"a": {"b": {"c": {}}}, "d": 1}, []).state_dict(flatten=flatten)
    dest = lib.TensorDict({"d": 0}, [])
    if locked:
        dest.memmap_(tmp_path)
    dest.load_state_dict(sd, strict=strict)
    assert int(dest["d"]) == 1
    assert set(dest.keys(True)) == {"d"}


def test_a_level_with_a_value_is_still_an_other_key_for_strict():
    sd = shared_td.TensorDict({"a": {"b": {"c": torch.ones(())}}, "d": 1}, []).state_dict()
    dest = shared_td.TensorDict({"d": 0}, [])
    with pytest.raises(shared_td.StateDictKeysError, match="'a'"):
        dest.load_state_dict(sd, strict=True)
    assert int(dest["d"]) == 0


def test_a_level_with_a_non_tensor_value_is_still_loaded():
    sd = shared_td.TensorDict({"a": {"b": {"note": "kept"}}, "d": 1}, []).state_dict()
    dest = shared_td.TensorDict({"d": 0}, [])
    dest.load_state_dict(sd, strict=False)
    assert dest["a", "b", "note"] == "kept"
