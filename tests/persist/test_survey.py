"""persist/survey.py: the tree read from meta.json files alone, and every problem found
in a damaged save (real saves, damaged on disk)."""
from __future__ import annotations

import json
import os

import pytest
import torch

import shared_td
from shared_td.errors import FormatError
from shared_td.persist import format as fmt
from shared_td.persist.survey import NODE, TENSOR, VALUE, survey


@shared_td.tensorclass
class Step:
    obs: torch.Tensor
    label: str


def _save(path) -> str:
    td = shared_td.TensorDict(
        obs=torch.zeros(4, 3),
        nested=shared_td.TensorDict(reward=torch.ones(4, dtype=torch.int16), batch_size=[4]),
        task="walk",
        empty=torch.zeros(4, 0),
        batch_size=[4],
    )
    td.memmap(path)
    return str(path)


def _by_key(found) -> dict:
    return {entry.path: entry for entry in found.root.walk()}


def test_a_save_is_read_whole_without_a_problem(tmp_path):
    found = survey(_save(tmp_path / "s"))
    assert found.problems == [] and found.prefix == str(tmp_path / "s")
    entries = _by_key(found)
    assert found.root.class_name == "TensorDict" and found.root.batch_size == [4]
    obs = entries["obs.memmap"]
    assert (obs.kind, obs.dtype, obs.shape, obs.nbytes, obs.size_on_disk) == (TENSOR, "torch.float32", [4, 3], 48, 48)
    assert entries["nested"].kind == NODE and entries[os.path.join("nested", "reward.memmap")].nbytes == 8
    task = entries["task"]
    assert (task.kind, task.class_name, task.value) == (VALUE, "NonTensorData", "'walk'")
    assert entries["empty.memmap"].size_on_disk == 0  # a zero-element leaf has no file
    assert found.totals() == {"leaves": 3, "bytes": 56, "bytes_on_disk": 56,
                              "non_tensor_values": 1, "nodes": 2}


def test_stacks_and_tensorclasses_are_walked_like_the_loader_walks_them(tmp_path):
    stack = shared_td.LazyStackedTensorDict.lazy_stack(
        [shared_td.TensorDict(a=torch.zeros(2)), shared_td.TensorDict(a=torch.ones(2))])
    stack.memmap(tmp_path / "stack")
    found = survey(str(tmp_path / "stack"))
    assert found.problems == [] and found.root.class_name == "LazyStackedTensorDict"
    assert [child.key for child in found.root.children] == ["0", "1"] and found.root.batch_size == [2]

    Step(obs=torch.zeros(3, 2), label="run", batch_size=[3]).memmap(tmp_path / "step")
    found = survey(str(tmp_path / "step"))
    assert found.problems == [] and found.root.class_name.endswith("Step")
    values = {entry.key: entry.value for entry in found.root.children if entry.kind == VALUE}
    assert [entry.key for entry in found.root.children if entry.kind == TENSOR] == ["obs"]
    assert "run" in "".join(values.values())


def test_damaged_files_are_errors_naming_each_file(tmp_path):
    root = _save(tmp_path / "s")
    os.truncate(os.path.join(root, "obs.memmap"), 10)
    os.unlink(os.path.join(root, "nested", "reward.memmap"))
    os.mkfifo(os.path.join(root, "nested", "reward.memmap"))  # never opened: it would block
    open(os.path.join(root, "stray.memmap"), "w").close()
    os.mkdir(os.path.join(root, "photos"))
    os.symlink("/etc", os.path.join(root, "escape"))
    found = survey(root)
    problems = {(p.severity, p.path): p.message for p in found.problems}
    assert problems[("error", "obs.memmap")] == (
        "10 bytes, but shape [4, 3] of torch.float32 needs 48: the file is truncated")
    assert problems[("error", os.path.join("nested", "reward.memmap"))] == "a FIFO, not a regular file"
    assert problems[("warning", "stray.memmap")].endswith("a leaf file of key 'stray', which no meta.json lists")
    assert problems[("warning", "photos")] == "an unknown directory: no meta.json names it"
    assert problems[("error", "escape")] == "a symlink to /etc (escapes the prefix); never followed"
    assert len(found.errors) == 3 and len(found.warnings) == 2


def test_a_missing_leaf_or_child_and_a_batch_size_that_does_not_fit(tmp_path):
    root = _save(tmp_path / "s")
    os.unlink(os.path.join(root, "obs.memmap"))
    meta_path = os.path.join(root, "nested", fmt.META)
    with open(meta_path) as file:
        meta = json.load(file)
    meta["shape"] = [5]
    meta["reward"]["shape"] = [5]
    with open(meta_path, "w") as file:
        json.dump(meta, file)
    found = survey(root)
    messages = {p.path: p.message for p in found.errors}
    assert messages["obs.memmap"] == "missing: the file of key 'obs' listed in meta.json"
    assert "batch size [4] does not fit key 'nested' of shape [5]" in messages[fmt.META]


def test_a_meta_json_the_loader_refuses_is_reported_with_the_loaders_words(tmp_path):
    root = _save(tmp_path / "s")
    meta_path = os.path.join(root, "nested", fmt.META)
    with open(meta_path) as file:
        meta = json.load(file)
    meta["reward"]["dtype"] = "torch.float99"
    with open(meta_path, "w") as file:
        json.dump(meta, file)
    found = survey(root)
    [problem] = found.errors
    assert problem.path == os.path.join("nested", fmt.META)
    assert problem.message.startswith("field 'reward.dtype': unknown dtype 'torch.float99'")
    assert _by_key(found)["nested"].class_name == "?"  # its files are not judged one by one


def test_what_is_no_save_is_refused_at_once(tmp_path):
    with pytest.raises(FileNotFoundError, match="No such directory"):
        survey(str(tmp_path / "missing"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match="is a file"):
        survey(str(tmp_path / "file"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="meta.json is missing"):
        survey(str(tmp_path / "empty"))
    (tmp_path / "photos").mkdir()
    (tmp_path / "photos" / fmt.META).write_text('{"name": "holidays"}')
    with pytest.raises(FormatError, match="not a saved tensordict: its meta.json has no _type"):
        survey(str(tmp_path / "photos"))
