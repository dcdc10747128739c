"""load_memmap of directories that are damaged or hostile: special files never block,
every bad meta.json field is a FormatError naming the file and the field, and `shared-td
verify` reports what the load refuses. Read-only saves: test_read_only_saves.py."""
from __future__ import annotations

import contextlib
import io
import json
import multiprocessing
import os
import queue
import socket
import stat

import pytest
import torch

from tests.persist.persist_helpers import NonTensorData, TensorDict, dir_state, make_td
from tests.processes import finish, wait_until

from shared_td import FormatError
from shared_td.cli import main

BOUND = 20  # seconds: a load that takes longer is hung (the test fails, it does not wait on)


def _outcome(results, function, args):
    try:
        result = function(*args)
    except BaseException as error:  # noqa: BLE001 - reported to the parent
        results.put(("raised", type(error).__name__, isinstance(error, RuntimeError), str(error)))
    else:
        results.put(("returned", result))


def in_child(function, *args):
    """Run ``function(*args)`` in a forked child, bounded: its result, or
    ``("raised", class name, is a RuntimeError, message)``. A hang fails the test."""
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    child = context.Process(target=_outcome, args=(results, function, args), daemon=True)
    child.start()
    try:
        return results.get(timeout=BOUND)
    except queue.Empty:
        pytest.fail(f"{function.__name__}{args} did not return within {BOUND} s (it blocked)")
    finally:
        child.kill()
        child.join(BOUND)


def load_keys(path):
    return sorted(TensorDict.load_memmap(path, allow_pickle=True).keys(True, True))


def verify_json(path):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = main(["verify", "--json", str(path)])
    return code, json.loads(out.getvalue())


def run_cli(command, path):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([command, str(path)])
    return code, out.getvalue(), err.getvalue()


def inspect_code(path):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return main(["inspect", str(path)])


@pytest.fixture
def saved(tmp_path):
    td = make_td()
    td.save(tmp_path / "s")
    return td, tmp_path / "s"


# ----------------------------------------------------------------- item 8: special files
def _fifo(path):
    os.mkfifo(path)


def _socket(path):
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    return server  # kept open by the caller for the test's duration


def _zero_device(path):
    try:  # /dev/zero: a read never ends
        os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 5))
    except PermissionError:
        pytest.skip("creating a device node needs CAP_MKNOD, which this process lacks")


SPECIAL = {"FIFO": _fifo, "socket": _socket, "character device": _zero_device}


def listing(root) -> dict:
    """relative path -> (mode, size, mtime) of everything under ``root``, from lstat
    only (dir_state would read a FIFO and block)."""
    state = {}
    for directory, dirnames, names in os.walk(root):
        for name in dirnames + names:
            info = os.lstat(os.path.join(directory, name))
            state[os.path.relpath(os.path.join(directory, name), root)] = (
                info.st_mode, info.st_size, info.st_mtime_ns)
    return state


@pytest.mark.parametrize("kind", SPECIAL)
@pytest.mark.parametrize("target", ["meta.json", "nested/meta.json", "float32.memmap",
                                    "nested/x.memmap", "obj/other.pickle"])
def test_special_files_are_refused_at_once(tmp_path, kind, target):
    td = make_td()
    td["obj"] = NonTensorData(3 + 4j, batch_size=[3])  # complex: pickled
    path = tmp_path / "s"
    td.save(path)
    os.unlink(path / target)
    keep = SPECIAL[kind](path / target)
    disk = listing(path)
    outcome = in_child(load_keys, path)
    assert outcome[:3] == ("raised", "FormatError", True), outcome
    assert str(path / target) in outcome[3] and ("a " + kind) in outcome[3]
    if target == "meta.json":
        # the root is then no save at all: verify and inspect refuse it in one line,
        # with the words atomic=True uses (format.not_a_save)
        for command in ("verify", "inspect"):
            code, out, err = in_child(run_cli, command, path)[1]
            assert (code, out) == (1, "") and str(path) in err and ("a " + kind) in err, err
    else:
        code, document = in_child(verify_json, path)[1]
        assert code == 1 and not document["ok"]
        assert [(p["severity"], ("a " + kind) in p["message"]) for p in document["problems"]
                if p["path"] == target] == [("error", True)], document
        assert in_child(inspect_code, path) == ("returned", 0)
    assert listing(path) == disk
    del keep


def _open_for_writing(path):
    os.close(os.open(path, os.O_WRONLY))  # blocks until someone opens the FIFO for reading


class _SwapBeforeOpen:
    """``os`` for shared_td.storage.files, whose ``open`` of ``name`` first renames
    ``replacement`` over it: the swap at the last moment, after any check a load makes
    before it opens the file (the race a hostile writer of the directory can win)."""

    def __init__(self, name, replacement, directory):
        self.name, self.replacement, self.directory = name, replacement, directory

    def open(self, name, *args, dir_fd=None, **kwargs):
        if name == self.name and os.path.lexists(self.replacement):
            os.rename(self.replacement, self.directory / name)
        return os.open(name, *args, dir_fd=dir_fd, **kwargs)

    def __getattr__(self, attribute):
        return getattr(os, attribute)


def test_a_fifo_swapped_in_for_a_leaf_is_refused_without_being_opened(saved, monkeypatch):
    """A FIFO renamed over a leaf file right before the load opens it is refused without
    being opened: a writer waiting in open() on the FIFO stays waiting (an open for
    reading, even non-blocking and closed at once, would let it through)."""
    from shared_td.storage import files

    td, path = saved
    fifo = path.parent / "fifo"
    os.mkfifo(fifo)
    writer = multiprocessing.get_context("fork").Process(target=_open_for_writing, args=(fifo,), daemon=True)
    writer.start()
    try:
        def waiting():
            with open(f"/proc/{writer.pid}/wchan") as f:
                return f.read() == "wait_for_partner"

        assert wait_until(waiting), "the writer never reached its open() of the FIFO"
        monkeypatch.setattr(files, "os", _SwapBeforeOpen("float32.memmap", fifo, path))
        with pytest.raises(FormatError, match="a FIFO, not a regular file") as info:
            TensorDict.load_memmap(path)
        assert str(path / "float32.memmap") in str(info.value)
        writer.join(0.5)
        assert writer.is_alive(), "the load opened the FIFO: the writer waiting on it went through"
    finally:
        with contextlib.suppress(OSError):  # let the writer through, whatever happened
            os.close(os.open(path / "float32.memmap", os.O_RDONLY | os.O_NONBLOCK))
        finish(writer)


def test_meta_json_that_is_a_directory(saved):
    td, path = saved
    os.unlink(path / "nested" / "meta.json")
    os.mkdir(path / "nested" / "meta.json")
    with pytest.raises(FormatError, match="a directory, not a regular file") as info:
        TensorDict.load_memmap(path)
    assert str(path / "nested" / "meta.json") in str(info.value)
    code, document = verify_json(path)
    assert code == 1 and [p["path"] for p in document["problems"]] == ["nested/meta.json"]


# ----------------------------------------------------------------- items 11, 12: meta.json fields
def _rewrite(path, edit):
    document = json.loads((path / "meta.json").read_text())
    edit(document)
    (path / "meta.json").write_text(json.dumps(document))


@pytest.mark.parametrize("batch_size", [[5], [2, 7]])
def test_a_batch_size_that_does_not_fit_is_refused(tmp_path, batch_size):
    path = tmp_path / "s"
    TensorDict({"a": torch.zeros(2, 3)}, [2]).save(path)
    _rewrite(path, lambda d: d.update(shape=batch_size))
    with pytest.raises(RuntimeError) as info:
        TensorDict.load_memmap(path)
    message = str(info.value)
    assert isinstance(info.value, FormatError)
    assert str(path / "meta.json") in message and str(batch_size) in message and "[2, 3]" in message
    code, document = verify_json(path)
    assert code == 1 and document["problems"][0]["path"] == "meta.json"
    assert str(batch_size) in document["problems"][0]["message"]


def test_a_child_whose_batch_size_does_not_fit_is_refused(saved):
    td, path = saved
    _rewrite(path / "nested" / "deeper", lambda d: d.update(shape=[]))  # its leaf fits []
    with pytest.raises(FormatError, match=r"\[3\] does not fit key 'deeper' of shape \[\]") as info:
        TensorDict.load_memmap(path)
    assert info.value.path == str(path / "nested" / "meta.json")
    code, document = verify_json(path)
    errors = [p for p in document["problems"] if p["severity"] == "error"]
    assert code == 1 and [p["path"] for p in errors] == ["nested/meta.json"]
    assert errors[0]["message"] == info.value.detail


BAD_FIELDS = {  # (where, edit, field named in the error)
    "negative batch size": ("", lambda d: d.update(shape=[-2]), "shape"),
    "string batch size": ("", lambda d: d.update(shape="3"), "shape"),
    "bool in batch size": ("", lambda d: d.update(shape=[True]), "shape"),
    "unknown device": ("", lambda d: d.update(device="gpu7"), "device"),
    "device a list": ("", lambda d: d.update(device=["cpu"]), "device"),
    "_type a number": ("", lambda d: d.update(_type=3), "_type"),
    "_type missing": ("", lambda d: d.pop("_type"), "_type"),
    "names too short": ("", lambda d: d.update(_names=[]), "_names"),
    "overflowing shape": ("", lambda d: d["float32"].update(shape=[3, 2**62, 2**62]), "float32.shape"),
    "huge dim": ("", lambda d: d["empty"].update(shape=[3, 0, 2**64]), "empty.shape"),
    "null shape": ("", lambda d: d["float32"].update(shape=None), "float32.shape"),
    "float dim": ("", lambda d: d["float32"].update(shape=[3, 2.0]), "float32.shape"),
    "negative dim": ("", lambda d: d["float32"].update(shape=[3, -2]), "float32.shape"),
    "list dtype": ("", lambda d: d["float32"].update(dtype=["torch.float32"]), "float32.dtype"),
    "unknown dtype": ("", lambda d: d["float32"].update(dtype="torch.float33"), "float32.dtype"),
    "leaf device": ("", lambda d: d["float32"].update(device="warp"), "float32.device"),
    "is_nested a string": ("", lambda d: d["float32"].update(is_nested="no"), "float32.is_nested"),
    "neither leaf nor node": ("", lambda d: d["float32"].pop("dtype"), "float32"),
    "child type a list": ("", lambda d: d["nested"].update(type=[]), "nested.type"),
    "stack_dim a string": ("stack", lambda d: d.update(stack_dim="0"), "stack_dim"),
}


@pytest.mark.parametrize("case", BAD_FIELDS)
def test_bad_meta_json_fields_name_the_file_and_the_field(saved, case):
    td, path = saved
    where, edit, field = BAD_FIELDS[case]
    _rewrite(path / where, edit)
    disk = dir_state(path)
    with pytest.raises(FormatError) as info:
        TensorDict.load_memmap(path)
    meta = os.path.join(path, where, "meta.json") if where else str(path / "meta.json")
    assert (info.value.path, info.value.field) == (meta, field)
    assert str(info.value).startswith(f"{meta}: field {field!r}: ")
    assert isinstance(info.value, RuntimeError) and isinstance(info.value, ValueError)
    assert dir_state(path) == disk
    if field == "_type" and not where:
        # a root without a known _type is no save at all: verify refuses it in one line,
        # with the words atomic=True uses (format.not_a_save)
        code, out, err = run_cli("verify", path)
        assert (code, out) == (1, "") and "not a saved tensordict" in err and "_type" in err
        return
    code, document = verify_json(path)  # the same error, one line, no traceback
    errors = [p for p in document["problems"] if p["severity"] == "error"]
    assert code == 1 and len(errors) == 1
    assert errors[0]["path"] == os.path.join(where, "meta.json")
    assert errors[0]["message"] == info.value.detail


@pytest.mark.parametrize("text", ["", "{", '"a string"', "[1]", "\xff", "[" * 100_000])
def test_meta_json_that_is_no_json_object(saved, text):
    td, path = saved
    (path / "meta.json").write_bytes(text.encode("latin-1"))
    with pytest.raises(FormatError, match="meta.json"):
        TensorDict.load_memmap(path)
    # the root is then no save at all: verify refuses it in one line (as atomic=True does)
    code, out, err = run_cli("verify", path)
    assert (code, out) == (1, "") and "meta.json" in err and "not a saved tensordict" in err


def test_format_error_pickles(saved):
    import pickle

    error = FormatError("/x/meta.json", "bad", field="shape")
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.path, copy.reason, copy.field, str(copy)) == (error.path, "bad", "shape", str(error))


# ----------------------------------------------------------------- make_memmap shapes
@pytest.mark.parametrize("key", ["z", ("new", "z")])
def test_make_memmap_negative_shape_is_a_value_error_leaving_nothing(tmp_path, key):
    td = TensorDict({"a": torch.zeros(2)}, [2]).memmap_(tmp_path / "p")
    disk = dir_state(tmp_path)
    with pytest.raises(ValueError, match="-3"):
        td.make_memmap(key, (2, -3))
    assert dir_state(tmp_path) == disk and set(td.keys()) == {"a"}
