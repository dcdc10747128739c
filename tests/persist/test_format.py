"""persist/format.py: the checked metadata model, file names, JSON rules, temporaries and
"is this a save at all", function by function."""
from __future__ import annotations

import json
import os
import pickle
import socket
import threading

import pytest
import torch

from shared_td.errors import FormatError
from shared_td.persist import format as fmt
from shared_td.persist.node_meta import ChildMeta, LeafMeta, NodeMeta
from shared_td.storage.files import Directory

WHERE = "/d/meta.json"


def _td_meta(**entries) -> dict:
    return {"_type": fmt.TENSORDICT_TYPE, "shape": [2], "device": None, **entries}


# ------------------------------------------------------------------ NodeMeta.from_json


def test_a_tensordict_node_is_read_with_its_leaves_children_and_names_in_file_order():
    meta = NodeMeta.from_json(_td_meta(
        b={"dtype": "torch.int16", "shape": [2, 5], "device": "cpu", "is_nested": False},
        a={"type": "TensorDict"},
        _names=["time"],
    ), where=WHERE)
    assert (meta.type, meta.batch_size, meta.device, meta.names) == (fmt.TENSORDICT_TYPE, (2,), None, ("time",))
    assert meta.entries == (LeafMeta("b", (2, 5), torch.int16), ChildMeta("a", "TensorDict"))
    assert meta.entries[0].nbytes == 20


def test_reserved_key_names_are_read_from_their_own_field():
    # a key named like a node field ("shape") is kept under _shared_td_entries
    meta = NodeMeta.from_json(_td_meta(**{
        fmt.RESERVED_ENTRIES: {"shape": {"dtype": "torch.float32", "shape": [2]}},
    }), where=WHERE)
    assert [entry.key for entry in meta.entries] == ["shape"]


def test_other_node_kinds_keep_their_document_and_stack_dim():
    document = {"_type": fmt.LAZY_STACK_TYPE, "stack_dim": 1}
    meta = NodeMeta.from_json(document, where=WHERE)
    assert (meta.batch_size, meta.stack_dim, meta.entries, meta.document) == (None, 1, (), document)


@pytest.mark.parametrize("document, field, words", [
    ([1, 2], None, "holds a JSON list, not an object"),
    ({"shape": [1]}, "_type", "is not a class name"),
    (_td_meta(shape=[-1]), "shape", "not a list of sizes"),
    (_td_meta(shape=[True]), "shape", "not a list of sizes"),
    (_td_meta(device="gpu9"), "device", "not a device torch knows"),
    (_td_meta(x={"dtype": "torch.float99", "shape": [2]}), "x.dtype", "unknown dtype 'torch.float99'"),
    (_td_meta(x={"shape": [2]}), "x", "neither a tensor"),
    (_td_meta(x={"type": 3}), "x.type", "is not a class name"),
    (_td_meta(x={"dtype": "torch.int8", "shape": [2], "is_nested": "yes"}), "x.is_nested", "true or false"),
    (_td_meta(x={"dtype": "torch.int8", "shape": [3]}), "shape", "does not fit key 'x'"),
    (_td_meta(x={"dtype": "torch.int64", "shape": [2, 2**62]}), "x.shape", "more bytes than any file"),
    (_td_meta(_names=["a", "b"]), "_names", "one name (a string or null) per batch dimension"),
    ({"_type": fmt.LAZY_STACK_TYPE, "stack_dim": -1}, "stack_dim", "not a dimension"),
    ({"_type": fmt.LAZY_STACK_TYPE, "stack_dim": 1.0}, "stack_dim", "not a dimension"),
])
def test_a_wrong_field_is_a_format_error_naming_the_file_and_field(document, field, words):
    with pytest.raises(FormatError) as caught:
        NodeMeta.from_json(document, where=WHERE)
    error = caught.value
    assert (error.path, error.field) == (WHERE, field)
    assert words in error.reason and str(error).startswith(f"{WHERE}: ")


def test_a_format_error_shows_at_most_80_characters_of_a_bad_value_and_pickles():
    with pytest.raises(FormatError) as caught:
        NodeMeta.from_json(_td_meta(shape="x" * 10_000), where=WHERE)
    assert len(caught.value.reason) < 200 and "..." in caught.value.reason
    again = pickle.loads(pickle.dumps(caught.value))
    assert (again.path, again.field, again.reason) == (WHERE, "shape", caught.value.reason)


def test_every_dtype_name_round_trips():
    for name, dtype in fmt.DTYPE_BY_NAME.items():
        assert fmt.dtype_name(dtype) == name
        assert fmt.dtype_from_name(name, where=WHERE) is dtype
    with pytest.raises(FormatError, match="unknown dtype 7"):
        fmt.dtype_from_name(7, where=WHERE, field="x.dtype")


# ------------------------------------------------------------------ names, JSON


@pytest.mark.parametrize("key, leaf, robust, names", [
    ("obs", True, True, ["obs.memmap"]),
    ("a b", True, True, ["a%20b.memmap", "a b.memmap"]),
    ("a/b", True, True, ["a%2Fb.memmap"]),  # its raw name would leave the directory
    ("C:x", False, True, ["C%3Ax", "C:x"]),  # one file name on Linux (not a drive)
    ("..", False, True, ["%2E%2E"]),
    ("a b", False, False, ["a b"]),  # legacy only
    ("a/b", True, False, []),
])
def test_file_names_robust_first_then_a_legacy_name_only_when_it_stays_inside(key, leaf, robust, names):
    assert fmt.file_names(key, leaf=leaf, robust_key=robust) == names


@pytest.mark.parametrize("value, kept", [
    (None, True), ("walk", True), (3, True), (True, True), (1.5, True),
    ([1, "a", [None]], True), ({"a": {"b": 1}}, True),
    (float("nan"), False), (float("inf"), False), ({1: "a"}, False), ({"a", "b"}, False),
    (b"bytes", False), ([1, object()], False),
])
def test_is_json_value_keeps_only_what_survives_a_json_round_trip(value, kept):
    assert fmt.is_json_value(value) is kept


def test_dumps_writes_tensordicts_separators():
    document = {"a": [1, 2], "b": "x"}
    assert fmt.dumps(document) == b'{"a": [1, 2], "b": "x"}'
    assert fmt.dumps(document, compact=True) == b'{"a":[1,2],"b":"x"}'
    assert json.loads(fmt.dumps(document)) == document


def test_leaf_entry_and_node_entries_describe_a_tensor():
    entry = LeafMeta.of("x", torch.zeros(2, 3, dtype=torch.bfloat16)).to_json()
    assert entry == {"device": "cpu", "shape": [2, 3], "dtype": "torch.bfloat16", "is_nested": False}
    assert fmt.node_entries(_td_meta(x=entry)) == {"x": entry}


# ------------------------------------------------------------------ temporaries


def test_write_temporary_names_its_writer_and_replaces_a_stale_one(tmp_path):
    with Directory.open(str(tmp_path)) as directory:
        stale = f"meta.json.{os.getpid()}.{threading.get_ident()}.tmp"
        (tmp_path / stale).write_bytes(b"left by a killed writer of this pid and thread")
        name = fmt.write_temporary(directory, fmt.META, b"{}")
    assert name == stale and (tmp_path / name).read_bytes() == b"{}"
    assert fmt.temporary_writer_pid(name) == os.getpid()
    for other in ("meta.json.tmp", "meta.json.12.tmp", "notes.1.2.tmp", "x.memmap.1.2.tmp"):
        assert fmt.temporary_writer_pid(other) is None
    assert fmt.temporary_writer_pid("other.pickle.77.3.tmp") == 77


# ------------------------------------------------------------------ not_a_save


def _meta(directory, document) -> None:
    directory.mkdir(exist_ok=True)
    (directory / fmt.META).write_text(json.dumps(document))


def test_saves_of_every_kind_are_saves(tmp_path):
    for kind, document in [
        ("td", _td_meta()),
        ("stack", {"_type": fmt.LAZY_STACK_TYPE, "stack_dim": 0}),
        ("data", {"_type": fmt.NON_TENSOR_DATA_TYPE, "data": 1}),
        ("pickled", {"_type": fmt.NON_TENSOR_DATA_TYPE, "_is_non_tensor": True}),
        ("nstack", {"_type": fmt.NON_TENSOR_STACK_TYPE, "stack_dim": 0, "data": [1]}),
    ]:
        _meta(tmp_path / kind, document)
        assert fmt.not_a_save(str(tmp_path / kind)) is None, kind
    _meta(tmp_path / "tc", {"_type": "<class 'mymodule.Step'>"})
    assert "_tensordict/ directory of a saved tensorclass is missing" in fmt.not_a_save(str(tmp_path / "tc"))
    (tmp_path / "tc" / fmt.TENSORCLASS_CHILD).mkdir()
    assert fmt.not_a_save(str(tmp_path / "tc")) is None


@pytest.mark.parametrize("content, words", [
    ("[1]", "holds a JSON list, not an object"),
    ("{not json", "is not valid JSON"),
    ('{"a": 1, "b": 2, "c": 3, "d": 4, "e": 5, "f": 6}', "no _type (it holds the keys 'a', 'b', 'c', 'd', 'e', ...)"),
    ("{}", "no _type (it holds the keys none)"),
    (json.dumps({"_type": fmt.TENSORDICT_TYPE, "shape": []}), "but no 'device'"),
    (json.dumps({"_type": fmt.NON_TENSOR_DATA_TYPE}), "but no 'data' or '_is_non_tensor'"),
    (json.dumps({"_type": "photos"}), "names no tensordict class"),
])
def test_what_is_not_a_save_is_said_in_words(tmp_path, content, words):
    (tmp_path / fmt.META).write_text(content)
    assert words in fmt.not_a_save(str(tmp_path))


def test_a_meta_json_that_is_no_regular_file_is_never_opened_or_followed(tmp_path):
    assert fmt.not_a_save(str(tmp_path)) == "it has no meta.json"
    real = tmp_path / "real"
    _meta(real, _td_meta())
    link = tmp_path / "link"
    link.mkdir()
    (link / fmt.META).symlink_to(real / fmt.META)
    assert fmt.not_a_save(str(link)) == "its meta.json is a symlink (not followed)"
    fifo = tmp_path / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / fmt.META)  # opening it for reading would block without a writer
    assert fmt.not_a_save(str(fifo)) == "its meta.json is a FIFO, not a regular file"
    sock_dir = tmp_path / "sock"
    sock_dir.mkdir()
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(sock_dir / fmt.META))
        assert fmt.not_a_save(str(sock_dir)) == "its meta.json is a socket, not a regular file"
