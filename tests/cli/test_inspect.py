"""`shared-td inspect`: the tree of directories written by shared_td and tensordict 0.15.3,
as text and as JSON, from metadata only (pickles are never unpickled)."""
from __future__ import annotations

import os

import pytest

from tests.cli.cli_helpers import run_cli, run_json, run_main, save_by, save_lazy_stack, save_ours

import shared_td


def _by_key(tree: dict) -> dict:
    return {child["key"]: child for child in tree["children"]}


@pytest.mark.parametrize("writer", ["shared_td", "tensordict"])
def test_json_describes_every_entry(tmp_path, writer):
    prefix = save_by(writer, tmp_path / "saved")
    code, document = run_json("inspect", prefix)
    assert code == 0
    tree = document["tree"]
    assert document["prefix"] == prefix
    assert (tree["class"], tree["batch_size"]) == ("TensorDict", [4])
    entries = _by_key(tree)
    assert list(entries) == ["obs", "a/b c", "next", "empty", "task", "obj", "stack"]
    obs = entries["obs"]
    assert (obs["kind"], obs["dtype"], obs["shape"], obs["bytes"], obs["size_on_disk"]) == (
        "tensor", "torch.float32", [4, 3], 48, 48)
    # the key as the user wrote it, its file percent-encoded
    assert (entries["a/b c"]["path"], entries["a/b c"]["bytes"]) == ("a%2Fb%20c.memmap", 32)
    assert entries["empty"]["bytes"] == 0 and entries["empty"]["shape"] == [4, 0]
    reward = _by_key(entries["next"])["reward"]
    assert (reward["path"], reward["bytes"]) == (os.path.join("next", "reward.memmap"), 16)
    assert entries["task"]["class"] == "NonTensorData"
    assert entries["task"]["value"].startswith("'walk walk") and entries["task"]["value"].endswith("...")
    assert len(entries["task"]["value"]) == 60
    pickled = os.path.getsize(os.path.join(prefix, "obj", "other.pickle"))
    assert entries["obj"]["value"] == f"<pickled, {pickled} bytes>"
    assert (entries["stack"]["class"], entries["stack"]["value"]) == ("NonTensorStack", "['a', 'b', 'c', 'd']")
    assert document["totals"] == {
        "leaves": 4, "bytes": 48 + 32 + 16, "bytes_on_disk": 48 + 32 + 16,
        "non_tensor_values": 3, "nodes": 2,
    }
    assert document["problems"] == []


def test_text_tree_shows_keys_shapes_sizes_and_totals(tmp_path):
    prefix = save_ours(tmp_path / "saved")
    done = run_cli("inspect", prefix)
    assert done.returncode == 0 and done.stderr == ""
    lines = done.stdout.splitlines()
    assert lines[0] == f"{prefix}: TensorDict, batch size [4]"
    text = done.stdout
    assert "├── obs " in text and "float32" in text and "[4, 3]" in text and "48 B" in text
    assert "├── 'a/b c'" in text  # quoted: it has a space
    assert "│   └── reward" in text
    assert "<pickled, " in text
    assert lines[-1] == "4 leaves, 96 B of tensor data (96 B in leaf files), 3 non-tensor values"


def test_a_pickled_value_is_never_unpickled(tmp_path):
    prefix = save_ours(tmp_path / "saved")
    # a pickle that would create a file if it were loaded
    marker = tmp_path / "unpickled"
    payload = b"cos\nsystem\n(S'touch " + str(marker).encode() + b"'\ntR."
    with open(os.path.join(prefix, "obj", "other.pickle"), "wb") as file:
        file.write(payload)
    code, document = run_json("inspect", prefix)
    assert code == 0 and not marker.exists()
    assert _by_key(document["tree"])["obj"]["value"] == f"<pickled, {len(payload)} bytes>"


def test_lazy_stack_members(tmp_path):
    prefix = save_lazy_stack(tmp_path / "lazy")
    code, document = run_json("inspect", prefix)
    tree = document["tree"]
    assert code == 0 and (tree["class"], tree["batch_size"]) == ("LazyStackedTensorDict", [2])
    assert [m["key"] for m in tree["children"]] == ["0", "1"]
    assert [m["children"][0]["shape"] for m in tree["children"]] == [[2], [3]]


def test_a_broken_save_is_shown_with_a_hint_to_verify(tmp_path):
    prefix = save_ours(tmp_path / "saved")
    os.truncate(os.path.join(prefix, "obs.memmap"), 8)
    code, out, err = run_main("inspect", prefix)
    assert code == 0 and err == ""
    assert "8 B (needs 48 B)" in out
    assert out.splitlines()[-1] == f"1 error, 0 warnings: run `shared-td verify {prefix}` for the list"


def test_no_saved_tensordict_is_a_one_line_error(tmp_path):
    for target, message in [
        (tmp_path / "missing", "No such directory"),
        (tmp_path, "meta.json is missing"),
    ]:
        done = run_cli("inspect", target)
        assert done.returncode == 1 and done.stdout == ""
        assert len(done.stderr.splitlines()) == 1 and message in done.stderr
        assert "Traceback" not in done.stderr


@pytest.mark.parametrize("writer", ["shared_td", "tensordict"])
def test_tensorclass_fields_are_shown_without_importing_its_class(tmp_path, writer):
    lib = pytest.importorskip("tensordict") if writer == "tensordict" else __import__("shared_td")
    import torch

    @lib.tensorclass
    class Step:
        obs: torch.Tensor
        label: str

    prefix = str(tmp_path / "step")
    Step(obs=torch.zeros(2, 3), label="a", batch_size=[2]).memmap_(prefix)
    code, document = run_json("inspect", prefix)
    tree = document["tree"]
    assert code == 0 and tree["class"].endswith(".Step") and tree["batch_size"] == [2]
    entries = _by_key(tree)
    assert entries["obs"]["path"] == os.path.join("_tensordict", "obs.memmap")
    assert (entries["obs"]["bytes"], entries["label"]["value"]) == (24, "'a'")
    code, out, _ = run_main("verify", prefix)
    assert code == 0 and out.startswith("ok: ")


def test_a_nested_tensor_of_tensordict_is_shown_and_an_error(tmp_path):
    tensordict = pytest.importorskip("tensordict")
    import torch

    prefix = str(tmp_path / "nested")
    with pytest.warns(UserWarning):  # torch: nested tensors are a prototype
        nested = torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)])
    tensordict.TensorDict(nt=nested).memmap_(prefix)
    code, out, _ = run_main("inspect", prefix)
    assert code == 0 and "nested" in out and "(2 tensors)" in out
    code, document = run_json("verify", prefix)  # an error: load_memmap refuses it
    assert code == 1
    assert [p["severity"] for p in document["problems"]] == ["error"]
    assert "nested tensor" in document["problems"][0]["message"]
    with pytest.raises(NotImplementedError, match="nested"):
        shared_td.TensorDict.load_memmap(prefix)
