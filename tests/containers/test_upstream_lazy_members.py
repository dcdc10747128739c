"""Building a LazyStackedTensorDict member by member, as tensordict's test_lazy.py does:
an empty stack's ``batch_size`` is the members' (``stack_dim=1, batch_size=[1, 2]``
gives ``[1, 0, 2]``) and it takes a ``device``; ``append``/``insert`` add members;
``__getitems__`` reads a DataLoader batch in one index operation. Found by running
tensordict's tests against shared_td."""
from __future__ import annotations

import pytest
import torch

import shared_td
from shared_td.errors import LockedTensorDictError
from tests.reference import LIBS

@pytest.mark.parametrize("lib", LIBS)
def test_empty_stack_takes_the_members_batch_size_and_device(lib):
    lazy = lib.LazyStackedTensorDict(stack_dim=1, batch_size=[1, 2], device="cpu")
    assert lazy.batch_size == (1, 0, 2)
    assert lazy.device == torch.device("cpu")
    for copy in (lazy.clone(), lazy.clone(recurse=False)):
        assert copy.batch_size == (1, 0, 2)
        assert copy.device == torch.device("cpu")
    assert lib.LazyStackedTensorDict(stack_dim=0, batch_size=[2]).batch_size == (0, 2)
    assert lib.LazyStackedTensorDict(stack_dim=0).batch_size == (0,)


@pytest.mark.parametrize("lib", LIBS)
def test_cat_with_an_empty_stack(lib):
    empty_dense = lib.TensorDict({"a": torch.empty(0, 2)}, [0, 2])
    empty_lazy = lib.LazyStackedTensorDict(stack_dim=0, batch_size=[2])
    result = torch.cat([empty_dense, empty_lazy], 0)
    assert result.batch_size == (0, 2)


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("stack_dim", [0, 1])
def test_append_and_insert(lib, stack_dim):
    lazy = lib.LazyStackedTensorDict(
        *[lib.TensorDict({"a": torch.full((4,), float(i))}, [4]) for i in range(2)], stack_dim=stack_dim
    )
    lazy.append(lib.TensorDict({"a": torch.full((4,), 2.0), "extra": torch.zeros(4)}, [4]))
    lazy.insert(0, lib.TensorDict({"a": torch.full((4,), -1.0)}, [4]))
    assert lazy.batch_size == ((4, 4) if stack_dim == 0 else (4, 4))
    assert set(lazy.keys()) == {"a"}  # "extra" is not in every member
    rows = lazy["a"] if stack_dim == 0 else lazy["a"].T
    assert rows[:, 0].tolist() == [-1.0, 0.0, 1.0, 2.0]
    with pytest.raises(TypeError, match="TensorDictBase"):
        lazy.append(torch.zeros(4))
    with pytest.raises(ValueError, match="Batch sizes"):
        lazy.insert(1, lib.TensorDict({"a": torch.zeros(5)}, [5]))
    assert len(lazy.tensordicts) == 4


def test_insert_into_a_locked_stack_raises():
    lazy = shared_td.LazyStackedTensorDict(shared_td.TensorDict({"a": torch.zeros(2)}, [2])).lock_()
    with pytest.raises(LockedTensorDictError, match="locked"):
        lazy.append(shared_td.TensorDict({"a": torch.zeros(2)}, [2]))
    assert len(lazy.tensordicts) == 1


@pytest.mark.parametrize("lib", LIBS)
def test_getitems_reads_ragged_rows(lib):
    lazy = lib.lazy_stack([lib.TensorDict(x=torch.zeros(i)) for i in range(5)])
    batch = lazy.__getitems__([3, 0, 4])
    assert isinstance(batch, lib.LazyStackedTensorDict)
    assert [len(row["x"]) for row in batch] == [3, 0, 4]


@pytest.mark.parametrize("lib", LIBS)
def test_a_ragged_stack_as_a_dataloader_dataset(lib):
    lazy = lib.lazy_stack([lib.TensorDict(x=torch.full((i + 1,), float(i))) for i in range(6)])
    loader = torch.utils.data.DataLoader(lazy, batch_size=3, collate_fn=lambda batch: batch)
    batches = list(loader)
    assert [[row["x"].shape[0] for row in batch] for batch in batches] == [[1, 2, 3], [4, 5, 6]]


def test_copies_of_an_empty_stack_keep_its_batch_size():
    """consolidate() rebuilds the stack from its members' batch size, which an empty
    stack has no member to tell (tensordict 0.15.3's consolidate() gives batch size
    [0] here: not copied)."""
    import pickle

    lazy = shared_td.LazyStackedTensorDict(stack_dim=1, batch_size=[3, 2])
    assert lazy.consolidate().batch_size == (3, 0, 2)
    assert pickle.loads(pickle.dumps(lazy)).batch_size == (3, 0, 2)
    assert lazy.to("cpu").batch_size == (3, 0, 2)


@pytest.mark.parametrize("lib", LIBS)
def test_ragged_values_of_a_stack_of_stacks(lib):
    """get(as_list=True / as_padded_tensor=True) of a lazy stack whose members are
    ragged lazy stacks: a nested list, and one tensor padded across both levels."""
    inner = lib.lazy_stack([lib.TensorDict(a=torch.arange(3.0)), lib.TensorDict(a=torch.arange(4.0))])
    outer = lib.lazy_stack([inner, inner.copy()])
    as_list = outer.get("a", as_list=True)
    assert [[value.tolist() for value in row] for row in as_list] == [[[0, 1, 2], [0, 1, 2, 3]]] * 2
    padded = outer.get("a", as_padded_tensor=True, padding_value=-1)
    assert padded.tolist() == [[[0, 1, 2, -1], [0, 1, 2, 3]]] * 2


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("dim,members", [(0, 3), (-1, 4), (1, 2)])
def test_to_lazystack_restacks_along_another_dim(lib, dim, members):
    lazy = lib.LazyStackedTensorDict(
        *[lib.TensorDict(a=torch.randn(3, 4), batch_size=[3, 4]) for _ in range(2)], stack_dim=1
    )
    restacked = lazy.to_lazystack(dim)
    assert len(restacked.tensordicts) == members
    assert restacked.batch_size == lazy.batch_size
    assert torch.equal(restacked["a"], lazy["a"])


@pytest.mark.parametrize("lib", LIBS)
def test_flatten_keys_of_a_lazy_stack(lib):
    lazy = lib.lazy_stack([
        lib.TensorDict(x=0.0, R=1.0, n=lib.TensorDict(b=2.0, a=3.0)),
        lib.TensorDict(R=1.0, x=0.0, n=lib.TensorDict(a=3.0, b=2.0)),
    ])
    flat = lazy.flatten_keys()
    assert list(flat.keys()) == ["x", "R", "n.b", "n.a"]
    assert flat["n.a"].tolist() == [3.0, 3.0]
    assert set(flat.unflatten_keys().keys(True, True)) == {"x", "R", ("n", "a"), ("n", "b")}
    lazy.flatten_keys("/", inplace=True)
    assert set(lazy.keys()) == {"x", "R", "n/a", "n/b"}
