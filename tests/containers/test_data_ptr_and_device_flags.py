"""``data_ptr``, ``is_contiguous``, ``is_cpu``, ``is_cuda`` and ``is_meta``, side by side
with tensordict 0.15.3 (before, each was an AttributeError)."""
from __future__ import annotations

import pytest
import torch

from tests.reference import LIBS


def _tree(lib):
    return lib.TensorDict(a=torch.zeros(2), s="x", n=lib.TensorDict(b=torch.zeros(2, 1), batch_size=[2]),
                          batch_size=[2])


def _ptrs(result) -> dict:
    return {key: value.item() for key, value in result.items(True, True)}


@pytest.mark.parametrize("lib", LIBS)
def test_data_ptr_has_the_keys_and_tells_views_from_copies(lib):
    td = _tree(lib)
    pointers = td.data_ptr()
    assert pointers.batch_size == torch.Size([]) and pointers.device == torch.device("cpu")
    assert set(_ptrs(pointers)) == {"a", ("n", "b")}  # non-tensor values have none
    assert _ptrs(td.unsqueeze(0).data_ptr()) == _ptrs(pointers)  # views of the same leaves
    assert _ptrs(td[1:].data_ptr()) != _ptrs(pointers)  # views with an offset
    assert _ptrs(td[1:].data_ptr(storage=True)) == _ptrs(td.data_ptr(storage=True))
    assert _ptrs(td.clone().data_ptr(storage=True))["a"] != _ptrs(td.data_ptr(storage=True))["a"]


@pytest.mark.parametrize("lib", LIBS)
def test_a_lazy_stack_gives_its_members_pointers(lib):
    members = [_tree(lib), _tree(lib)]
    stack = lib.lazy_stack(members)
    pointers = _ptrs(stack.data_ptr())
    assert set(pointers) == {("0", "a"), ("0", "n", "b"), ("1", "a"), ("1", "n", "b")}
    assert pointers["1", "a"] == members[1]["a"].data_ptr()


@pytest.mark.parametrize("lib", LIBS)
def test_is_contiguous_and_the_device_flags(lib):
    td = lib.TensorDict(a=torch.zeros(2, 3), batch_size=[2])
    assert td.is_contiguous()
    assert not lib.TensorDict(a=torch.zeros(3, 2).T, batch_size=[2]).is_contiguous()
    assert not lib.lazy_stack([td, td]).is_contiguous()  # (stacked when read)
    assert (td.is_cpu, td.is_cuda, td.is_meta) == (False, False, False)  # no device
    on_cpu = td.to("cpu")
    assert (on_cpu.is_cpu, on_cpu.is_cuda, on_cpu.is_meta) == (True, False, False)


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("where", ["child", "grandchild", "non_tensor_stack", "tensorclass_field"])
def test_a_stack_below_the_root_is_not_contiguous(lib, where):
    lazy = lib.lazy_stack([lib.TensorDict(a=torch.zeros(2), batch_size=[2]) for _ in range(3)])
    if where == "child":
        td = lib.TensorDict(n=lazy, batch_size=[3])
    elif where == "grandchild":
        td = lib.TensorDict(m=lib.TensorDict(n=lazy, batch_size=[3]), batch_size=[3])
    elif where == "non_tensor_stack":
        td = lib.TensorDict(a=torch.zeros(3), s=lib.NonTensorStack("a", "b", "c"), batch_size=[3])
    else:
        @lib.tensorclass
        class Holder:
            n: lib.TensorDict

        td = Holder(n=lazy, batch_size=[3])
    assert not td.is_contiguous()
    if where != "non_tensor_stack":  # (contiguous() keeps a NonTensorStack, in both)
        assert td.contiguous().is_contiguous()  # (the lazy stacks made dense)
    assert lib.TensorDict(s=lib.NonTensorData("x", batch_size=[3]), batch_size=[3]).is_contiguous()
