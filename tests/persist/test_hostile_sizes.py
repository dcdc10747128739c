"""Sizes a save declares are not trusted: a reader decides what it accepts to hold
before reading (persist.bounded_reads).

* Archives: a 1 kB bzip2 member can hold hundreds of MB. Before, ``zipfile`` gave the
  whole member in one piece (it hands bzip2/lzma no output limit) to the load, to
  ``shared-td verify``'s checksum pass and to ``unpack_memmap``, and a compressed leaf
  was then copied twice more (3x its size). Now a compressed leaf whose header announces
  another size than its shape is refused before decompressing it, data holding more than
  announced are refused at the first byte too many, and a legitimate compressed leaf
  costs about its size.
* Directories: meta.json (and pickles) were read whole whatever their size: a sparse
  1 GiB meta.json (no disk used) cost seconds and 2 GB. Now a file past its cap is a
  FormatError naming it, its size and the cap, before it is read.
* A NonTensorStack nested 800 deep: ``verify`` said ok and a load ended in a
  RecursionError; both now refuse it with a FormatError naming the file.

Peak memory is measured in one child process (its own peak RSS, reset between cases
through /proc/self/clear_refs, reported back): the test process is never measured.
"""
from __future__ import annotations

import bz2
import functools
import json
import os
import re
import struct
import subprocess
import sys
import zipfile
import zlib

import pytest
import torch

from shared_td import FormatError, NonTensorData, TensorDict, load_memmap, unpack_memmap
from shared_td.persist import format as fmt
from shared_td.persist import node_meta
from shared_td.persist.archive import is_memmap_archive
from shared_td.persist.bounded_reads import MAX_META_BYTES, MAX_PICKLE_BYTES
from shared_td.persist.survey import survey

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MiB = 1 << 20
BOMB = 96 * MiB  # what the bzip2 member of a bomb decompresses to (from ~600 bytes)
TD_TYPE = "<class 'tensordict._td.TensorDict'>"
STACK_TYPE = "<class 'tensordict.tensorclass.NonTensorStack'>"


# ------------------------------------------------------------------------ archives
@functools.lru_cache(maxsize=None)
def _bzip2_of_zeros(size: int) -> tuple[bytes, int]:
    """The bzip2 stream of ``size`` zero bytes and their CRC-32 (made once: ~0.5 s)."""
    compressor, block, crc = bz2.BZ2Compressor(), bytes(4 * MiB), 0
    parts = []
    for _ in range(size // len(block)):
        parts.append(compressor.compress(block))
        crc = zlib.crc32(block, crc)
    return b"".join(parts) + compressor.flush(), crc


def _zip(path, members) -> None:
    """A zip holding ``members``: (name, method, data as stored, size announced, CRC-32)
    each, written byte by byte (zipfile cannot write a header that lies)."""
    out, central = bytearray(), bytearray()
    for name, method, data, size, crc in members:
        raw, at = name.encode(), len(out)
        out += struct.pack("<4s5H3I2H", b"PK\x03\x04", 20, 0, method, 0, 0x21, crc, len(data), size,
                           len(raw), 0) + raw + data
        central += struct.pack("<4s6H3I5H2I", b"PK\x01\x02", 20, 20, 0, method, 0, 0x21, crc, len(data),
                               size, len(raw), 0, 0, 0, 0, 0, at) + raw
    end = struct.pack("<4s4H2IH", b"PK\x05\x06", 0, 0, len(members), len(members), len(central), len(out), 0)
    path.write_bytes(bytes(out + central + end))


def _meta_member(meta: dict) -> tuple:
    data = json.dumps(meta).encode()
    return ("meta.json", zipfile.ZIP_STORED, data, len(data), zlib.crc32(data))


def _one_float_meta() -> dict:
    return {"a": {"device": "cpu", "shape": [1], "dtype": "torch.float32", "is_nested": False},
            "shape": [], "device": "cpu", "_type": TD_TYPE}


def _bomb(path, *, honest: bool):
    """An archive whose meta.json says leaf 'a' is one float32 (4 bytes) and whose
    bzip2 member ``a.memmap`` decompresses to BOMB zero bytes; its header announces
    them (``honest``) or announces 4 bytes (and the CRC-32 of 4 zero bytes)."""
    stream, crc = _bzip2_of_zeros(BOMB)
    size, crc = (BOMB, crc) if honest else (4, zlib.crc32(bytes(4)))
    _zip(path, [_meta_member(_one_float_meta()), ("a.memmap", zipfile.ZIP_BZIP2, stream, size, crc)])
    return path


def test_a_compressed_leaf_announcing_another_size_is_refused_before_decompressing(tmp_path):
    path = _bomb(tmp_path / "bomb.tdz", honest=True)
    assert path.stat().st_size < 2000
    with pytest.raises(FormatError, match=(
            f"^{re.escape(str(path))}: member 'a.memmap': is compressed and announces {BOMB} bytes once "
            "decompressed, "
            r"but key 'a' .* says a torch.float32 tensor of shape \(1,\) \(4 bytes\): refused before "
            "decompressing it")):
        load_memmap(path)


def test_verify_reports_what_a_load_refuses_without_reading_it(tmp_path):
    """verify said "ok" on the archive above, which a load refuses, after reading all of
    the member for its checksum (7 s for an 800 MB one)."""
    path = _bomb(tmp_path / "bomb.tdz", honest=True)
    assert [(p.path, p.message) for p in survey(str(path)).errors] == [(
        "a.memmap", "shape [1] of torch.float32 needs 4 bytes, but the member is compressed and announces "
        f"{BOMB} bytes once decompressed: a load refuses it")]


def test_data_holding_more_than_announced_are_refused_at_the_first_byte_too_many(tmp_path):
    path = _bomb(tmp_path / "bomb.tdz", honest=False)
    too_many = (f"^{re.escape(str(path))}: member 'a.memmap': its compressed data hold more than the 4 "
                "bytes its header announces")
    with pytest.raises(FormatError, match=too_many):
        load_memmap(path)
    with pytest.raises(FormatError, match=too_many):
        unpack_memmap(path, tmp_path / "out")
    assert not os.path.lexists(tmp_path / "out")
    problems = [(p.path, p.message) for p in survey(str(path)).errors]  # what verify reports
    assert [where for where, _ in problems] == ["a.memmap"]
    assert "hold more than the 4 bytes its header announces" in problems[0][1]


def test_data_holding_fewer_bytes_than_announced_are_refused(tmp_path):
    data = torch.arange(4, dtype=torch.float32).numpy().tobytes()
    compressed = bz2.compress(data[:8])  # 8 bytes in the stream, 16 announced
    path = tmp_path / "short.tdz"
    meta = dict(_one_float_meta(), a={"device": "cpu", "shape": [4], "dtype": "torch.float32", "is_nested": False})
    _zip(path, [_meta_member(meta), ("a.memmap", zipfile.ZIP_BZIP2, compressed, 16, zlib.crc32(data))])
    with pytest.raises(FormatError, match="member 'a.memmap': its compressed data end after 8 of the 16 bytes"):
        load_memmap(path)


def test_an_unknown_compression_method_is_a_format_error(tmp_path):
    path = tmp_path / "odd.tdz"
    _zip(path, [_meta_member(_one_float_meta()), ("a.memmap", 93, b"\0" * 8, 4, zlib.crc32(bytes(4)))])
    with pytest.raises(FormatError, match="'a.memmap': it is compressed with method 93"):
        load_memmap(path)


def test_an_archive_meta_json_over_the_cap_is_refused_unread(tmp_path):
    # a 20-byte deflate stream whose header announces one byte more than the cap
    stream = zlib.compressobj(wbits=-15)
    data = stream.compress(b"{}") + stream.flush()
    path = tmp_path / "big.tdz"
    _zip(path, [("meta.json", zipfile.ZIP_DEFLATED, data, MAX_META_BYTES + 1, zlib.crc32(b"{}"))])
    with pytest.raises(FormatError, match=(f"^{re.escape(str(path))}: member 'meta.json': {MAX_META_BYTES + 1} "
                                           f"bytes, more than the {MAX_META_BYTES} bytes .* refused unread")):
        load_memmap(path)
    assert not is_memmap_archive(path)
    with pytest.raises(FormatError, match="its meta.json cannot be read: member 'meta.json': .* refused unread"):
        survey(str(path))  # what verify runs: its checksum pass skips the member too


@pytest.mark.parametrize("compression", ["deflate", "bzip2", "lzma"])
def test_archives_tensordict_compresses_load_unpack_and_verify(tmp_path, compression):
    # a leaf of 1.6 MB: more than one piece (1 MiB) of decompressed data
    tensordict = pytest.importorskip("tensordict")
    values = torch.arange(400_000, dtype=torch.float32)
    path = tmp_path / "theirs.tdz"
    tensordict.TensorDict(a=values, b=torch.ones(3, dtype=torch.int64)).save(path, compression=compression)
    loaded = load_memmap(path)
    assert torch.equal(loaded["a"], values) and loaded["b"].tolist() == [1, 1, 1]
    assert survey(str(path)).errors == []
    unpacked = load_memmap(unpack_memmap(path, tmp_path / "dir"))
    assert torch.equal(unpacked["a"], values)


# ----------------------------------------------------------------------- directories
def _sparse(path, size: int) -> None:
    with open(path, "wb") as file:
        file.truncate(size)  # no block on disk


def test_a_sparse_meta_json_over_the_cap_is_refused_unread(tmp_path):
    prefix = tmp_path / "buf"
    prefix.mkdir()
    _sparse(prefix / "meta.json", MAX_META_BYTES + 1)
    refused = f"{MAX_META_BYTES + 1} bytes, more than the {MAX_META_BYTES} bytes .* refused unread"
    with pytest.raises(FormatError, match=f"^{re.escape(str(prefix))}/meta.json: {refused}"):
        load_memmap(prefix)
    assert fmt.not_a_save(str(prefix)).startswith(f"its meta.json is too big: {MAX_META_BYTES + 1} bytes")


def test_a_pickle_over_its_cap_is_refused_unread(tmp_path):
    prefix = tmp_path / "nt"
    NonTensorData({1, 2}).memmap(prefix)  # a set: pickled to other.pickle
    assert load_memmap(prefix, allow_pickle=True).data == {1, 2}
    os.unlink(prefix / fmt.OTHER_PICKLE)
    _sparse(prefix / fmt.OTHER_PICKLE, MAX_PICKLE_BYTES + 1)
    refused = f"^{re.escape(str(prefix))}/other.pickle: {MAX_PICKLE_BYTES + 1} bytes, more than"
    with pytest.raises(FormatError, match=refused):
        load_memmap(prefix, allow_pickle=True)


@pytest.mark.parametrize("depth", ["cap + 1", 800])
def test_a_non_tensor_stack_nested_too_deep_is_refused_by_load_and_verify(tmp_path, depth):
    depth = node_meta.MAX_STACK_DEPTH + 1 if depth == "cap + 1" else depth
    prefix = tmp_path / "deep"
    prefix.mkdir()
    meta = {"_type": STACK_TYPE, "stack_dim": 0, "data": json.loads("[" * depth + "1" + "]" * depth)}
    (prefix / "meta.json").write_text(json.dumps(meta))
    refused = rf"^{re.escape(str(prefix))}/meta.json: field 'data': its lists nest more than \d+ deep"
    with pytest.raises(FormatError, match=refused):
        load_memmap(prefix)
    assert [(p.path, "nest more than" in p.message) for p in survey(str(prefix)).errors] == [("meta.json", True)]


def test_a_non_tensor_stack_as_deep_as_the_cap_loads(tmp_path):
    depth = node_meta.MAX_STACK_DEPTH
    prefix = tmp_path / "deep"
    prefix.mkdir()
    meta = {"_type": STACK_TYPE, "stack_dim": 0, "data": json.loads("[" * depth + '"x"' + "]" * depth)}
    (prefix / "meta.json").write_text(json.dumps(meta))
    assert load_memmap(prefix).batch_size == torch.Size([1] * depth)
    assert survey(str(prefix)).errors == []


# ------------------------------------------------------------------ peak memory
def _peaks(warm: str, cases: list) -> None:
    """Child: load ``warm`` (imports, first-use allocations: outside any case), then run
    each (label, action, path) and print {label: [peak RSS growth in MiB, outcome]} as
    one JSON line; the peak is reset before each case."""
    from shared_td.persist.survey import survey as verify  # what `shared-td verify` runs

    actions = {"load": load_memmap, "verify": lambda path: verify(path).errors,
               "unpack": lambda path: unpack_memmap(path, path + ".unpacked")}
    load_memmap(warm)
    found = {}
    for label, action, path in cases:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")  # peak RSS := current RSS
        before = _peak_kib()
        try:
            result = actions[action](path)
            outcome = "ok" if not isinstance(result, list) else [p.message for p in result]
        except FormatError as error:
            outcome = f"FormatError: {error}"
        found[label] = [(_peak_kib() - before) / 1024, outcome]
    print(json.dumps(found))


def _peak_kib() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))


def test_peak_memory_stays_bounded(tmp_path):
    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("no /proc/self/clear_refs: the child cannot measure each case's peak")
    lying, honest = _bomb(tmp_path / "lying.tdz", honest=False), _bomb(tmp_path / "honest.tdz", honest=True)
    leaf = 64 * MiB
    TensorDict(a=torch.zeros(leaf // 4)).save(tmp_path / "legit.tdz", compression="deflate")
    warm = str(tmp_path / "warm.tdz")
    TensorDict(a=torch.zeros(2)).save(warm, compression="deflate")
    sparse = tmp_path / "sparse"
    sparse.mkdir()
    _sparse(sparse / "meta.json", MAX_META_BYTES + 1)
    cases = [("load, meta says 4 bytes, member announces 96 MiB", "load", str(honest)),
             ("load, member announces 4 bytes, holds 96 MiB", "load", str(lying)),
             ("verify, member announces and holds 96 MiB", "verify", str(honest)),
             ("unpack, member announces 4 bytes, holds 96 MiB", "unpack", str(lying)),
             ("load, sparse meta.json", "load", str(sparse)),
             ("load, legitimate compressed 64 MiB leaf", "load", str(tmp_path / "legit.tdz"))]
    child = subprocess.run(
        [sys.executable, "-c", f"from tests.persist.test_hostile_sizes import _peaks; _peaks({warm!r}, {cases!r})"],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr[-3000:]
    found = json.loads(child.stdout.strip().splitlines()[-1])
    for label, _, _ in cases[:-1]:
        grown, outcome = found[label]
        assert grown < 40, f"{label}: peak RSS grew by {grown:.0f} MiB ({outcome})"
    assert found[cases[0][0]][1].startswith("FormatError") and found[cases[1][0]][1].startswith("FormatError")
    grown, outcome = found[cases[-1][0]]
    assert outcome == "ok" and grown < 1.25 * leaf / MiB, f"a {leaf // MiB} MiB leaf took {grown:.0f} MiB"
