"""The repr, in tensordict 0.15.3's compact style.

The expected strings were printed by tensordict 0.15.3 for the same tensordicts.
"""
from __future__ import annotations

import pytest
import torch

from shared_td import NonTensorData, NonTensorStack, TensorDict, lazy_stack, tensorclass


def cases():
    yield "flat", TensorDict({"obs": torch.zeros(4, 3), "reward": torch.zeros(4, 1), "done": torch.zeros(4, dtype=torch.bool)}, batch_size=[4])
    yield "nested_nontensor", TensorDict({"a": torch.zeros(3, 4), "n": {"b": torch.zeros(3, 2, dtype=torch.bfloat16)}, "task": "walk"}, batch_size=[3])
    yield "device", TensorDict({"x": torch.zeros(2, 5, dtype=torch.int64)}, batch_size=[2], device="cpu")
    yield "empty", TensorDict()
    yield "scalars", TensorDict({"z": torch.zeros((), dtype=torch.complex64), "u": torch.zeros(2, dtype=torch.uint16), "f8": torch.zeros((), dtype=torch.float8_e5m2)})
    yield "multi_batch", TensorDict({"x": torch.zeros(2, 3, 4, 5)}, batch_size=[2, 3])
    yield "nested_extra_dims", TensorDict({"a": torch.zeros(2, 3), "b": TensorDict({"c": torch.zeros(2, 3, 4)}, batch_size=[2, 3])}, batch_size=[2])
    yield "long", TensorDict({f"observation_{i}": torch.zeros(8, 84, 84, 3, dtype=torch.uint8) for i in range(3)}, batch_size=[8])
    yield "long_nested", TensorDict({"obs": torch.zeros(4, 3), "nested": TensorDict({f"long_name_{i}": torch.zeros(4, 2, dtype=torch.float16) for i in range(4)}, batch_size=[4]), "reward": torch.zeros(4, 1)}, batch_size=[4])
    yield "deep_long", TensorDict({"k" * 30: torch.zeros(()), "j" * 30: TensorDict({"m" * 30: torch.zeros(()), "p": torch.zeros(3), "q": {"r" * 40: torch.zeros(())}})})
    yield "sort_dot", TensorDict({"a.b": torch.zeros(()), "a": torch.zeros(()), "B": torch.zeros(())})
    yield "stacked", torch.stack([TensorDict({"t": "a", "x": torch.zeros(2)}), TensorDict({"t": "b", "x": torch.zeros(2)})])
    yield "exactly80", TensorDict({"a" * 18: torch.zeros(()), "b" * 10: torch.zeros(())})
    yield "past80", TensorDict({"a" * 19: torch.zeros(()), "b" * 10: torch.zeros(())})
    yield "inner80", TensorDict({"n": {"a" * 52: torch.zeros(()), "b": torch.zeros(())}, "c" * 30: torch.zeros(())})
    yield "inner81", TensorDict({"n": {"a" * 53: torch.zeros(()), "b": torch.zeros(())}, "c" * 30: torch.zeros(())})


# printed by tensordict 0.15.3 for each case
EXPECTED = {
    'flat': 'TensorDict(batch_size=[4], fields={done: bool[], obs: f32[3], reward: f32[1]})',
    'nested_nontensor': 'TensorDict(batch_size=[3], fields={a: f32[4], n: {b: bf16[2]}, task: str})',
    'device': 'TensorDict(batch_size=[2], device=cpu, fields={x: i64[5]})',
    'empty': 'TensorDict(batch_size=[], fields={})',
    'scalars': 'TensorDict(batch_size=[], fields={f8: f8_e5m2[], u: u16[2], z: c64[]})',
    'multi_batch': 'TensorDict(batch_size=[2,3], fields={x: f32[4,5]})',
    'nested_extra_dims': 'TensorDict(batch_size=[2], fields={a: f32[3], b: [3]{c: f32[4]}})',
    'long': 'TensorDict(batch_size=[8], fields={\n    observation_0: u8[84,84,3],\n    observation_1: u8[84,84,3],\n    observation_2: u8[84,84,3]})',
    'long_nested': 'TensorDict(batch_size=[4], fields={\n    nested: {\n        long_name_0: f16[2],\n        long_name_1: f16[2],\n        long_name_2: f16[2],\n        long_name_3: f16[2]},\n    obs: f32[3],\n    reward: f32[1]})',
    'deep_long': 'TensorDict(batch_size=[], fields={\n    jjjjjjjjjjjjjjjjjjjjjjjjjjjjjj: {\n        mmmmmmmmmmmmmmmmmmmmmmmmmmmmmm: f32[],\n        p: f32[3],\n        q: {rrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrr: f32[]}},\n    kkkkkkkkkkkkkkkkkkkkkkkkkkkkkk: f32[]})',
    'sort_dot': 'TensorDict(batch_size=[], fields={B: f32[], a.b: f32[], a: f32[]})',
    'stacked': 'TensorDict(batch_size=[2], fields={t: NonTensorStack, x: f32[2]})',
    'exactly80': 'TensorDict(batch_size=[], fields={aaaaaaaaaaaaaaaaaa: f32[], bbbbbbbbbb: f32[]})',
    'past80': 'TensorDict(batch_size=[], fields={\n    aaaaaaaaaaaaaaaaaaa: f32[],\n    bbbbbbbbbb: f32[]})',
    'inner80': 'TensorDict(batch_size=[], fields={\n    cccccccccccccccccccccccccccccc: f32[],\n    n: {aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa: f32[], b: f32[]}})',
    'inner81': 'TensorDict(batch_size=[], fields={\n    cccccccccccccccccccccccccccccc: f32[],\n    n: {\n        aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa: f32[],\n        b: f32[]}})',
}


@pytest.mark.parametrize("name, td", list(cases()), ids=[name for name, _ in cases()])
def test_repr_matches_tensordict(name, td):
    assert repr(td) == EXPECTED[name]
    assert str(td) == EXPECTED[name]


def test_repr_of_views_and_locked():
    td = TensorDict({"obs": torch.zeros(4, 3)}, batch_size=[4]).lock_()
    assert repr(td[1:3]) == "TensorDict(batch_size=[2], fields={obs: f32[3]})"
    assert repr(td.unsqueeze(0)) == "TensorDict(batch_size=[1,4], fields={obs: f32[3]})"
    assert repr(td.keys()) == "_TensorDictKeysView(['obs'], include_nested=False, leaves_only=False)"


def test_repr_of_non_tensor_classes():
    assert repr(NonTensorData("walk", batch_size=[3])) == (
        "NonTensorData(data=walk, batch_size=torch.Size([3]), device=None)"
    )
    assert repr(NonTensorStack("a", "b")) == (  # tensordict 0.15.3's layout
        "NonTensorStack(\n    ['a', 'b'],\n    batch_size=torch.Size([2]),\n    device=None)"
    )


@tensorclass
class Pose:
    x: torch.Tensor


def test_repr_of_a_lazy_stack_names_its_members_tensorclass():
    """A tensorclass entry of a lazy stack's members is shown by its class name, as in a
    TensorDict (it showed as a plain ``{...}``); printed by tensordict 0.15.3 for the
    same stacks of its own class of this name (the first member's class names it)."""
    members = [TensorDict(b=Pose(x=torch.zeros(2), batch_size=[2]), batch_size=[2]) for _ in range(2)]
    assert repr(lazy_stack(members)) == "LazyStackedTensorDict(batch_size=[2,2], stack_dim=0, fields={b: Pose{x: f32[]}})"
    mixed = [TensorDict(b=Pose(x=torch.zeros(2), batch_size=[2]), batch_size=[2]),
             TensorDict(b=TensorDict(x=torch.zeros(2), batch_size=[2]), batch_size=[2])]
    assert repr(lazy_stack(mixed)) == "LazyStackedTensorDict(batch_size=[2,2], stack_dim=0, fields={b: Pose{x: f32[]}})"
    assert repr(lazy_stack(mixed[::-1])) == "LazyStackedTensorDict(batch_size=[2,2], stack_dim=0, fields={b: {x: f32[]}})"
