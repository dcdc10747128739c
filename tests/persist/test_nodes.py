"""The node-kind registry and the metadata model, both ways.

Every class reaches the engine through the NodeKind it registers; every meta.json is
written by ``NodeMeta.to_json`` and read by ``NodeMeta.from_json``.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from shared_td import LazyStackedTensorDict, NonTensorData, NonTensorStack, TensorDict, tensorclass
from shared_td.persist import format as fmt
from shared_td.persist import nodes
from shared_td.persist.node_meta import NodeMeta


@tensorclass
class Pair:
    x: torch.Tensor
    label: str


def _every_class() -> dict:
    """One tree holding a node of every kind (and keys named like node fields)."""
    td = TensorDict({"a": torch.arange(4.0).reshape(2, 2), "shape": torch.ones(2, dtype=torch.int8)}, [2],
                    names=["time"])
    td["note"] = NonTensorData("hello", batch_size=[2])
    td["odd"] = NonTensorData({1, 2}, batch_size=[2])  # a set: pickled
    td["words"] = NonTensorStack.from_list(["x", "y"])
    td["lazy"] = LazyStackedTensorDict(TensorDict(b=torch.ones(3)), TensorDict(b=torch.zeros(3)), stack_dim=0)
    td["pair"] = Pair(x=torch.ones(2, 1), label="left", batch_size=[2])
    return td


def test_every_meta_json_written_is_read_back_to_the_same_bytes(tmp_path):
    _every_class().memmap(tmp_path / "p")
    seen = set()
    for directory, _, names in os.walk(tmp_path / "p"):
        if fmt.META not in names:
            continue
        path = os.path.join(directory, fmt.META)
        with open(path, "rb") as file:
            written = file.read()
        meta = NodeMeta.from_json(json.loads(written), where=path)
        seen.add(nodes.kind_for_type_string(meta.type).name)
        again = meta.to_json()
        assert list(json.loads(again).items()) == list(json.loads(written).items()), path
        if b", " in written:  # tensordict's spaced separators (a NonTensorStack's are compact)
            assert again == written, path
    assert seen == {nodes.TENSORDICT, nodes.LAZY, nodes.TENSORCLASS, nodes.NON_TENSOR_DATA,
                    nodes.NON_TENSOR_STACK}


def test_each_class_finds_its_kind_and_its_type_string_finds_it_back():
    td = _every_class()
    for key, name in [("lazy", nodes.LAZY), ("pair", nodes.TENSORCLASS), ("note", nodes.NON_TENSOR_DATA),
                      ("words", nodes.NON_TENSOR_STACK)]:
        assert nodes.kind_for_object(td.get(key)).name == name, key
    assert nodes.kind_for_object(td).name == nodes.TENSORDICT
    # a subclass has the kind of its nearest registered class
    assert nodes.kind_for_object(type("MyTD", (TensorDict,), {})(batch_size=[])).name == nodes.TENSORDICT
    assert nodes.kind_for_type_string(fmt.LAZY_STACK_TYPE).name == nodes.LAZY
    # any other class name is a tensorclass's, found without importing its module
    assert nodes.kind_for_type_string("<class 'not_imported.Anything'>").name == nodes.TENSORCLASS


def test_an_object_of_no_kind_is_refused_by_name():
    with pytest.raises(TypeError, match="Cannot memory-map a dict"):
        nodes.kind_for_object({})


def test_a_rewrite_in_place_gives_the_bytes_a_new_save_gives(tmp_path):
    """make_memmap rewrites a node's meta.json through the same model as a save."""
    td = TensorDict({"a": torch.ones(2)}, [2]).memmap_(tmp_path / "p")
    td.make_memmap("b", (2, 3), dtype=torch.int16)
    TensorDict({"a": torch.ones(2), "b": torch.zeros(2, 3, dtype=torch.int16)}, [2]).memmap(tmp_path / "q")
    assert (tmp_path / "p" / fmt.META).read_bytes() == (tmp_path / "q" / fmt.META).read_bytes()
