"""apply(fn, batch_size=...) that changes the batch size: a NonTensorData passes with the new batch size, a NonTensorStack that does not fit is a BatchSizeMismatchError naming its key (tensordict 0.15.3 drops it silently; the README says so)."""
import pytest
import torch
from shared_td import LazyStackedTensorDict, NonTensorStack, TensorDict
from shared_td.errors import BatchSizeMismatchError


def test_apply_new_batch_size_keeps_one_value():
    td = TensorDict({"a": torch.arange(6.).view(2, 3), "s": "txt"}, [2, 3])
    out = td.apply(lambda x: x[0], batch_size=[3])
    assert out.batch_size == (3,)
    assert out["s"] == "txt"


@pytest.mark.parametrize("kind", ["lazy", "stack"])
def test_apply_new_batch_size_refuses_per_element_values(kind):
    if kind == "lazy":
        td = LazyStackedTensorDict.lazy_stack(
            [TensorDict({"a": torch.arange(3.), "s": f"t{i}"}, [3]) for i in range(2)], 0)
    else:
        td = TensorDict({"a": torch.arange(6.).view(2, 3),
                         "s": NonTensorStack.from_list([["x"] * 3, ["y"] * 3])}, [2, 3])
    with pytest.raises(BatchSizeMismatchError, match="'s'"):
        td.apply(lambda x: x[0], batch_size=[3])
    out = td.exclude("s").apply(lambda x: x[0], batch_size=[3])
    assert out.batch_size == (3,) and "s" not in out.keys()
