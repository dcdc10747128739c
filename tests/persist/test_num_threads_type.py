"""memmap_/memmap/memmap_like/save: a num_threads that is not an int is a TypeError
(tensordict 0.15.3 raises TypeError for a str or None; shared_td's load_memmap too)."""
import pytest
import torch

import shared_td as L  # (L: the library under test)


@L.tensorclass
class _TC:
    x: torch.Tensor
    label: str


RECEIVERS = {
    "td": lambda: L.TensorDict({"a": {"b": torch.zeros(3)}, "s": "x"}, [3]),
    "lazy": lambda: L.LazyStackedTensorDict.lazy_stack([L.TensorDict({"x": torch.zeros(2)}, [2]),
                                                          L.TensorDict({"x": torch.zeros(3)}, [3])][:1] * 2),
    "tensorclass": lambda: _TC(x=torch.zeros(3), label="l", batch_size=[3]),
    "nontensordata": lambda: L.NonTensorData("v", batch_size=[2]),
    "nontensorstack": lambda: L.NonTensorStack(L.NonTensorData("a"), L.NonTensorData("b")),
}
CALLS = {
    "memmap_": lambda o, p, n: o.memmap_(p, num_threads=n),
    "memmap_anonymous": lambda o, p, n: o.memmap_(num_threads=n),
    "memmap": lambda o, p, n: o.memmap(p, num_threads=n),
    "memmap_like": lambda o, p, n: o.memmap_like(p, num_threads=n),
    "save": lambda o, p, n: o.save(p, num_threads=n),
}


@pytest.mark.parametrize("receiver", list(RECEIVERS))
@pytest.mark.parametrize("call", list(CALLS))
@pytest.mark.parametrize("bad", ["2", None, 2.0])
def test_a_num_threads_that_is_not_an_int_is_a_type_error(receiver, call, bad, tmp_path):
    obj = RECEIVERS[receiver]()
    with pytest.raises(TypeError, match="num_threads"):
        CALLS[call](obj, tmp_path / "p", bad)
    assert not obj.is_locked and not obj.is_memmap()
    assert not (tmp_path / "p").exists()
