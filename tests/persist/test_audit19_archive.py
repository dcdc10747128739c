"""Archives (.tdz), audit of session 19: what a write returns is the file it wrote (never
a file renamed over its path, nor that file's pickles), a compressed leaf's declared size
commits no memory before its data arrive, non-tensor values of a loaded archive are
read-only whatever the mode, unpack_memmap's refusals (its own source, a damaged archive),
deep nesting and overlapping members."""
from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import threading
import zipfile

import pytest
import torch

from shared_td import NonTensorData, NonTensorStack, TensorDict, load_memmap, memory_check, unpack_memmap
from shared_td.errors import FormatError, ReadOnlyError, StorageFullError
from shared_td.storage import files

MARK = "unpickled-by-shared_td"


class _Evil:
    """Unpickling it leaves a mark (a directory named ``path``)."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return os.makedirs, (self.path, 0o755, True)


# ------------------------------------------------------- 1. the result of a write
@pytest.mark.parametrize("like", [False, True])
def test_an_archive_write_returns_its_own_file_not_one_renamed_over_it(tmp_path, monkeypatch, like):
    """Another process (no shared_td lock: tensordict, mv, an attacker) renames its
    archive over the target right after this call's rename: the call still returns the
    data it wrote, mapped from its own file, and never unpickles the other file."""
    target, evil, mark = tmp_path / "x.tdz", tmp_path / "evil.tdz", tmp_path / MARK
    TensorDict(a=torch.full((4,), -1.0), obj=NonTensorData(_Evil(str(mark)))).save(evil)
    os.rmdir(mark)  # (left by the save of evil, which returns its tree unpickled)
    replace = files.Directory.replace

    def renamed_over_right_after(self, source, name):
        replace(self, source, name)
        if name == target.name:  # the other process wins the race, every time
            spare = tmp_path / "spare.tdz"
            shutil.copyfile(evil, spare)
            os.replace(spare, target)

    monkeypatch.setattr(files.Directory, "replace", renamed_over_right_after)
    td = TensorDict(a=torch.arange(4.0), obj=NonTensorData({1, 2}))  # (a set: pickled)
    out = td.memmap_like(target) if like else td.save(target)
    assert not mark.exists()
    assert out["a"].tolist() == ([0.0] * 4 if like else [0.0, 1.0, 2.0, 3.0])
    assert out["obj"] == {1, 2}
    if like:  # mapped shared: writes go into the file this call wrote, not the other
        out["a"].fill_(7.0)
        assert out["a"].tolist() == [7.0] * 4
    assert target.read_bytes() == evil.read_bytes()  # (the other file, untouched)
    assert not mark.exists()


def test_saves_racing_renames_over_their_path_return_their_own_data(tmp_path):
    """The same with a real race, bounded: a thread renames copies of another archive
    over the path in a loop while this thread saves 30 times."""
    target, evil, mark = tmp_path / "x.tdz", tmp_path / "evil.tdz", tmp_path / MARK
    TensorDict(a=torch.full((4,), -1.0), obj=NonTensorData(_Evil(str(mark)))).save(evil)
    os.rmdir(mark)
    stop = threading.Event()

    def rename_over_forever():
        spare = tmp_path / "spare.tdz"
        while not stop.is_set():
            shutil.copyfile(evil, spare)
            os.replace(spare, target)

    racer = threading.Thread(target=rename_over_forever, daemon=True)
    racer.start()
    try:
        for i in range(30):
            out = TensorDict(a=torch.full((4,), float(i)), obj=NonTensorData({i})).save(target)
            assert out["a"].tolist() == [float(i)] * 4 and out["obj"] == {i}
    finally:
        stop.set()
        racer.join(10)
    assert not racer.is_alive() and not mark.exists()


# ------------------------------------------------- 2. declared sizes commit no memory
def _declaring(tmp_path, nbytes: int, compression: str = "deflate"):
    """A tiny archive whose compressed leaf ``a`` declares ``nbytes`` (its meta.json's
    shape and its zip headers agree) but holds 16 bytes."""
    source = tmp_path / "small.tdz"
    TensorDict(a=torch.ones(4)).save(source, compression=compression)
    with zipfile.ZipFile(source) as zf:
        meta = json.loads(zf.read("meta.json"))
    meta["a"]["shape"] = [nbytes // 4]
    path = tmp_path / "declares.tdz"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("meta.json", json.dumps(meta))
        zf.writestr(zipfile.ZipInfo("a.memmap"), b"\0" * 16, compress_type=zipfile.ZIP_DEFLATED)
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as zf:
        info, central = zf.getinfo("a.memmap"), zf.start_dir
    struct.pack_into("<I", data, info.header_offset + 22, nbytes)  # the local header's size
    record = data.find(b"PK\x01\x02", central)
    while data[record + 46:record + 46 + 8] != b"a.memmap":
        record = data.find(b"PK\x01\x02", record + 4)
    struct.pack_into("<I", data, record + 24, nbytes)  # the central record's
    path.write_bytes(bytes(data))
    return path


_PEAK = r"""
import resource, sys
import shared_td
from shared_td.errors import FormatError
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    shared_td.load_memmap(sys.argv[1])
except FormatError as error:
    assert "end after 16 of" in str(error) and "a.memmap" in str(error), error
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) >> 10)
"""


def test_a_declared_size_commits_no_memory_before_the_data_arrive(tmp_path):
    """A 400-byte archive declaring 512 MiB: refused at the end of its 16 bytes, with
    the process's peak memory grown by far less than the size declared (it was filled
    with zeros first, all 512 MiB)."""
    path = _declaring(tmp_path, 512 << 20)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, "-c", _PEAK, str(path)], capture_output=True, text=True,
                          timeout=60, cwd=root, env={**os.environ, "PYTHONPATH": root})
    assert done.returncode == 0, done.stderr
    assert int(done.stdout.split()[-1]) < 64  # MiB


def test_a_declared_size_beyond_the_memory_is_refused_naming_the_member(tmp_path):
    path = _declaring(tmp_path, (1 << 32) - 4)  # (the most a zip32 header declares)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(memory_check, "memory_room", lambda: (1 << 30, "a test's limit"))
        with pytest.raises(StorageFullError, match=r"member 'a.memmap' of the archive .*declares.tdz.*"
                           r"compressed.*4294967292 bytes.*1073741824 bytes are available"):
            load_memmap(path)


# ------------------------------------- 3. non-tensor values of an archive: read-only
@pytest.mark.parametrize("mode", [None, "r", "r+"])
def test_non_tensor_values_of_an_archive_are_read_only_whatever_the_mode(tmp_path, mode):
    """mode="r+" writes tensors into the archive, but a non-tensor value lives in a
    member never rewritten: an in-place write is refused (it changed this process's copy
    only, silently), and the message says how to replace it, not to use mode='r+'.
    (tensordict 0.15.3 loses such writes silently in every mode.)"""
    path = tmp_path / "x.tdz"
    TensorDict(a=torch.zeros(4), s="old", stack=NonTensorStack("p", "q")).save(path)
    td = load_memmap(path, mode=mode)
    with pytest.raises(ReadOnlyError, match="set\\(\\) \\(not in place\\)") as refused:
        td.set_("s", "new")
    assert "mode='r+' (" not in str(refused.value) and "Load it with" not in str(refused.value)
    with pytest.raises(ReadOnlyError):
        td.get("stack")[0] = "z"
    assert td["s"] == "old" and load_memmap(path)["s"] == "old"
    td.set("s", "new")  # replaced in memory: allowed
    assert td["s"] == "new"
    if mode == "r+":  # tensors still written into the file
        td["a"].fill_(1.0)
        assert load_memmap(path)["a"].tolist() == [1.0] * 4


# ------------------------------------------------- 4, 5. unpack_memmap's refusals
@pytest.mark.parametrize("below", [(), ("sub",)])
def test_unpack_into_the_directory_holding_the_archive_is_refused_first(tmp_path, below):
    """The swap would delete the archive being extracted (tensordict's save too, which
    then holds nothing but the new files): a ValueError, nothing touched."""
    save = tmp_path / "d"
    TensorDict(b=torch.ones(2)).save(save)
    archive = save.joinpath(*below, "x.tdz")
    TensorDict(a=torch.zeros(3)).save(archive)
    before = sorted(os.listdir(tmp_path)), sorted(os.listdir(save))
    with pytest.raises(ValueError, match="lies inside that directory"):
        unpack_memmap(archive, save)
    assert (sorted(os.listdir(tmp_path)), sorted(os.listdir(save))) == before
    assert load_memmap(archive)["a"].tolist() == [0.0] * 3


def _flip_a_byte_of(path, member: str) -> None:
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo(member)
    name_len, extra_len = struct.unpack_from("<2H", data, info.header_offset + 26)
    data[info.header_offset + 30 + name_len + extra_len] ^= 1
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("member", ["meta.json", "n/meta.json"])
def test_unpack_says_which_member_is_damaged(tmp_path, member):
    """As load_memmap: a FormatError naming the member (it said "not a memory-mapped
    tensordict archive", naming neither); nothing is left at the target."""
    path = tmp_path / "t.tdz"
    TensorDict(a=torch.arange(4.0), n=TensorDict(c=torch.ones(3))).save(path)
    _flip_a_byte_of(path, member)
    with pytest.raises(FormatError, match=f"t.tdz.*member '{member}'"):
        unpack_memmap(path, tmp_path / "out")
    assert not os.path.lexists(tmp_path / "out")


def test_unpack_of_what_is_no_archive_still_says_so(tmp_path):
    (tmp_path / "text").write_text("hello")
    for source in (tmp_path / "text", tmp_path / "missing", tmp_path):
        with pytest.raises(ValueError, match="is not a memory-mapped tensordict archive"):
            unpack_memmap(source, tmp_path / "out")


# -------------------------------------------------------------- 6. deep nesting
def _nested_archive(path, depth: int) -> None:
    """An archive of ``depth`` TensorDicts nested one in the other (key "n"), a leaf at
    the bottom: as a save would be, were it not deeper than any writer goes."""
    node = {"shape": [], "device": "cpu", "_type": "<class 'tensordict._td.TensorDict'>"}
    leaf = {"device": "cpu", "shape": [1], "dtype": "torch.float32", "is_nested": False}
    with zipfile.ZipFile(path, "w") as zf:
        at = ""
        for _ in range(depth):
            zf.writestr(at + "meta.json", json.dumps({"n": {"type": "TensorDict"}, **node}))
            at += "n/"
        zf.writestr(at + "meta.json", json.dumps({"n": leaf, **node}))
        zf.writestr(at + "n.memmap", b"\0" * 4)


def test_members_deeper_than_any_save_are_refused_naming_one(tmp_path):
    """1100 levels: a FormatError naming the member (it was a
    RecursionError), from load_memmap and unpack_memmap, nothing left behind."""
    path = tmp_path / "deep.tdz"
    _nested_archive(path, 1100)
    for load in (lambda: load_memmap(path), lambda: unpack_memmap(path, tmp_path / "out")):
        with pytest.raises(FormatError, match=r"deep.tdz: member 'n/n/.*more than 1024 parts"):
            load()
    assert sorted(os.listdir(tmp_path)) == ["deep.tdz"]


def test_a_save_nested_deeper_than_the_recursion_limit_is_a_format_error(tmp_path):
    """Within the parts allowed, but more levels than a load can follow: a FormatError
    naming the save (tensordict 0.15.3: a RecursionError)."""
    path = tmp_path / "deep.tdz"
    _nested_archive(path, 1010)
    with pytest.raises(FormatError, match="deep.tdz: nested too deep to load.*recursion limit"):
        load_memmap(path)


def test_the_path_of_a_deep_chain_of_directories_needs_no_recursion():
    top = files.Directory(-1, "/top")
    below = top
    for _ in range(5000):
        below = files.Directory(-1, None, parent=below, name="n")
    assert below.path == "/top" + "/n" * 5000


def test_a_nested_archive_within_the_limits_loads(tmp_path):
    path = tmp_path / "nested.tdz"
    _nested_archive(path, 3)
    assert load_memmap(path)["n", "n", "n", "n"].tolist() == [0.0]


# ------------------------------------------------------- 7. overlapping members
def test_members_whose_payloads_overlap_are_refused_naming_both(tmp_path):
    """a.memmap's local header made to point its payload at b.memmap's (its extra field
    lengthened): both leaves would be views of the same bytes, and with mode="r+" a
    write into one would change the other (it loaded, a == b)."""
    path = tmp_path / "t.tdz"
    TensorDict(a=torch.arange(4.0), b=torch.arange(4.0) + 10).save(path)
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as zf:
        a, b = zf.getinfo("a.memmap"), zf.getinfo("b.memmap")

    def payload(info):
        name_len, extra_len = struct.unpack_from("<2H", data, info.header_offset + 26)
        return info.header_offset + 30 + name_len + extra_len, extra_len

    (a_start, a_extra), (b_start, _) = payload(a), payload(b)
    struct.pack_into("<H", data, a.header_offset + 28, a_extra + b_start - a_start)
    path.write_bytes(bytes(data))
    for mode in (None, "r+"):
        with pytest.raises(FormatError, match="member 'a.memmap': refused: its payload overlaps "
                                              "member 'b.memmap'"):
            load_memmap(path, mode=mode)


def test_a_compressed_leaf_is_a_private_copy_after_a_fork(tmp_path):
    # before: decompressed into a shared anonymous mapping, so a forked child's (a
    # DataLoader worker's) write into its "copy" reached the parent's
    path = str(tmp_path / "x.tdz")
    TensorDict(a=torch.zeros(4), b=torch.zeros(4)).save(path, compression="deflate")
    loaded = load_memmap(path)
    loaded["a"].fill_(1.0)  # a writable copy in memory, as documented
    pid = os.fork()
    if pid == 0:  # the child: write into its copy, then leave without cleaning up
        try:
            loaded["a"].fill_(7.0)
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert loaded["a"].tolist() == [1.0] * 4
