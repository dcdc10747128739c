"""One node: a lazy stack of members of different shapes is published, attached and
summarised (Coordinator.layout) like any tree; the summary lists each member's leaves
(a stacked view would be a copy, in no shared memory, and cannot be made for them)."""
from __future__ import annotations

import torch

import shared_td


def _members():
    return [shared_td.TensorDict(a=torch.full((3,), float(m)), b=torch.zeros(3, width), batch_size=[3])
            for m, width in enumerate((2, 5))]


def test_a_lazy_stack_of_different_shapes_publishes_at_the_top_level_and_nested():
    with shared_td.Coordinator() as coord:
        top = coord.publish("top", shared_td.LazyStackedTensorDict(*_members(), stack_dim=1))
        nested = coord.publish("nested", shared_td.TensorDict(x=torch.zeros(3), s=shared_td.LazyStackedTensorDict(
            *_members(), stack_dim=1), batch_size=[3]))
        view = coord.attach("top")
        assert type(view) is shared_td.LazyStackedTensorDict and view.stack_dim == 1
        assert view.tensordicts[1]["b"].shape == (3, 5)
        view.tensordicts[1]["a"][0] = 7.0
        assert top.tensordicts[1]["a"][0] == 7.0  # the same memory
        assert coord.attach("nested")["s"].tensordicts[0]["b"].shape == (3, 2)
        leaves = {leaf["key"]: leaf for leaf in coord.layout("nested")["leaves"]}
        assert sorted(leaves) == ["s.0.a", "s.0.b", "s.1.a", "s.1.b", "x"]
        assert leaves["s.1.b"]["shape"] == [3, 5] and leaves["s.1.b"]["where"] == "anonymous"
        assert coord.layout("top")["class"] == "LazyStackedTensorDict"
        assert coord.layout("top")["batch_size"] == [3, 2] and nested.batch_size == (3,)
