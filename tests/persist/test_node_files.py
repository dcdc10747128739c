"""The node kinds as the saved files show them: what each class writes as its node
(``_type``, what its parent records of it, its sub-directories and side files), and
that a rewrite drops side files no longer needed. Only through the public API
(memmap, load_memmap) and the files, so that it holds however persist/nodes.py is
organised inside."""
from __future__ import annotations

import json
import os

import torch

import shared_td
from shared_td.persist import format as fmt


@shared_td.tensorclass
class Pair:
    left: torch.Tensor
    note: object


def _meta(*parts) -> dict:
    with open(os.path.join(*parts, fmt.META)) as file:
        return json.load(file)


def test_each_kind_writes_its_type_and_its_parent_records_its_class(tmp_path):
    td = shared_td.TensorDict(
        sub=shared_td.TensorDict(x=torch.zeros(2), batch_size=[2]),
        stack=shared_td.lazy_stack([shared_td.TensorDict(y=torch.zeros(1)), shared_td.TensorDict(y=torch.ones(1))]),
        word=shared_td.NonTensorData("walk", batch_size=[2]),
        words=shared_td.NonTensorStack("a", "b"),
        pair=Pair(left=torch.zeros(2, 1), note="n", batch_size=[2]),
        batch_size=[2],
    )
    td.memmap(tmp_path)
    root = _meta(tmp_path)
    assert root["_type"] == fmt.TENSORDICT_TYPE and root["shape"] == [2]
    assert {key: root[key]["type"] for key in ("sub", "stack", "word", "words", "pair")} == {
        "sub": "TensorDict", "stack": "LazyStackedTensorDict", "word": "NonTensorData",
        "words": "NonTensorStack", "pair": "Pair",
    }
    assert _meta(tmp_path, "sub")["_type"] == fmt.TENSORDICT_TYPE
    assert _meta(tmp_path, "stack")["_type"] == fmt.LAZY_STACK_TYPE
    assert sorted(os.listdir(tmp_path / "stack")) == ["0", "1", fmt.META]  # one directory per member
    assert _meta(tmp_path, "word") == {"_type": fmt.NON_TENSOR_DATA_TYPE, "data": "walk",
                                       "_metadata": None, "_is_non_tensor": True}
    assert _meta(tmp_path, "words")["data"] == ["a", "b"]
    assert _meta(tmp_path, "pair")["_type"] == str(Pair)
    assert os.path.isdir(tmp_path / "pair" / fmt.TENSORCLASS_CHILD)  # its tensors live there
    loaded = shared_td.load_memmap(tmp_path)
    assert type(loaded["pair"]) is Pair and loaded["stack"][1]["y"].tolist() == [1.0]


def test_values_json_cannot_hold_go_to_side_files_which_a_rewrite_removes(tmp_path):
    td = shared_td.TensorDict(value=shared_td.NonTensorData(b"\x00bytes"),
                              words=shared_td.NonTensorStack(b"x", b"y"))
    td.memmap(tmp_path)
    assert "data" not in _meta(tmp_path, "value")
    assert sorted(os.listdir(tmp_path / "value")) == sorted([fmt.META, fmt.OTHER_PICKLE])
    assert _meta(tmp_path, "words")["data"] == fmt.STACK_PICKLE
    assert (tmp_path / "words" / fmt.STACK_PICKLE).is_file()
    # rewritten with values JSON holds: the pickles are gone, not left stale beside them
    shared_td.TensorDict(value="plain", words=shared_td.NonTensorStack("x", "y")).memmap(tmp_path, existsok=True)
    assert sorted(os.listdir(tmp_path / "value")) == [fmt.META]
    assert sorted(os.listdir(tmp_path / "words")) == [fmt.META]
    assert shared_td.load_memmap(tmp_path)["value"] == "plain"
