"""The marker class every tensordict class derives from (containers/value_kinds.py)."""
import torch

import shared_td
from shared_td.containers.value_kinds import TensorDictRoot, is_tensor_collection


def test_the_marker_adds_no_visible_member_to_tensordict_classes():
    # a class that seems to have __slots__ looks stateless to code that reads state from
    # slots (torch.fx's unify_object took two different TensorDicts for equal)
    for cls in (shared_td.TensorDict, shared_td.LazyStackedTensorDict, shared_td.NonTensorData):
        assert not hasattr(cls, "__slots__"), cls
        assert issubclass(cls, TensorDictRoot)
    assert vars(TensorDictRoot).keys() <= {"__module__", "__doc__", "__dict__", "__weakref__", "__qualname__"}


def test_the_marker_is_what_tensor_collections_are():
    td = shared_td.TensorDict({"x": torch.zeros(2)}, [2])
    assert is_tensor_collection(td) and is_tensor_collection(type(td))
    assert not is_tensor_collection(torch.zeros(2)) and not is_tensor_collection(dict)
