"""Damaged archives: each damage is a FormatError naming the archive and the member,
and nothing is written outside the destination (tests/persist/test_archive.py has the
rest)."""
from __future__ import annotations

import os
import stat
import zipfile

import pytest
import torch

from tests.persist.archive_children import saved_archive

from shared_td import FormatError, is_memmap_archive, load_memmap, unpack_memmap


def _members(path) -> list[tuple[zipfile.ZipInfo, bytes]]:
    with zipfile.ZipFile(path) as zf:
        return [(info, zf.read(info)) for info in zf.infolist()]


def _rezip(path, members) -> None:
    with zipfile.ZipFile(path, "w") as zf:
        for info, data in members:
            zf.writestr(info, data)


def test_truncated_archive(tmp_path):
    path = saved_archive(tmp_path)
    data = path.read_bytes()
    for size in (len(data) - 10, len(data) // 2, 100):
        path.write_bytes(data[:size])
        with pytest.raises(FormatError, match=f"{path}.*truncated"):
            load_memmap(path)
        assert not is_memmap_archive(path)


def test_bad_crc_of_metadata(tmp_path):
    path = saved_archive(tmp_path)
    data = bytearray(path.read_bytes())
    data[data.index(b'"_type"') + 1] ^= 0x20  # inside the stored root meta.json
    path.write_bytes(bytes(data))
    with pytest.raises(FormatError, match=f"{path}: member 'meta.json'.*CRC"):
        load_memmap(path)


def _break_central_crc(path, member: str) -> None:
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as zf:
        start = zf.start_dir
    at = data.index(member.encode(), start) - 46  # the central record of ``member``
    assert data[at:at + 4] == b"PK\x01\x02"
    data[at + 16] ^= 0xFF
    path.write_bytes(bytes(data))


def test_bad_crc_of_a_compressed_payload(tmp_path):
    path = saved_archive(tmp_path, compression="deflate")
    _break_central_crc(path, "a.memmap")
    with pytest.raises(FormatError, match="member 'a.memmap'.*CRC"):
        load_memmap(path)


def test_bad_crc_of_a_stored_payload_is_found_by_unpack_not_by_load(tmp_path):
    path = saved_archive(tmp_path)
    _break_central_crc(path, "a.memmap")
    assert torch.equal(load_memmap(path)["a"], torch.arange(4.0))  # mapped: not read whole
    with pytest.raises(FormatError, match="member 'a.memmap'.*CRC"):
        unpack_memmap(path, tmp_path / "out")
    assert not os.path.lexists(tmp_path / "out")
    assert not [e for e in os.listdir(tmp_path) if "shared_td-new" in e]


@pytest.mark.parametrize("name, why", [
    ("../evil.memmap", "'..'"), ("/abs.memmap", "absolute"), ("sub\\x.memmap", "backslash"),
    ("C:/x.memmap", "drive"), ("a/./b.memmap", "'.'"),
])
def test_member_paths_that_could_escape_are_refused(tmp_path, name, why):
    path = saved_archive(tmp_path)
    members = _members(path) + [(zipfile.ZipInfo(name), b"\0" * 8)]
    _rezip(path, members)
    with pytest.raises(FormatError, match=f"member .*refused.*{why}"):
        load_memmap(path)
    with pytest.raises(FormatError, match=f"member .*refused.*{why}"):
        unpack_memmap(path, tmp_path / "out")
    assert sorted(os.listdir(tmp_path)) == sorted(["t.tdz", ".t.tdz.lock"])
    assert not os.path.exists(tmp_path.parent / "evil.memmap")


def test_symlink_member_and_duplicates_are_refused(tmp_path):
    path = saved_archive(tmp_path)
    link = zipfile.ZipInfo("n/b.memmap")
    link.create_system = 3
    link.external_attr = (stat.S_IFLNK | 0o777) << 16
    members = [(i, d) for i, d in _members(path) if i.filename != "n/b.memmap"] + [(link, b"/etc/passwd")]
    _rezip(path, members)
    with pytest.raises(FormatError, match="'n/b.memmap'.*symlink"):
        load_memmap(path)
    with pytest.raises(FormatError, match="'n/b.memmap'.*symlink"):
        unpack_memmap(path, tmp_path / "out")
    assert not os.path.lexists(tmp_path / "out")
    path = saved_archive(tmp_path, "d.tdz")
    members = _members(path)
    with pytest.warns(UserWarning, match="Duplicate name"):
        _rezip(path, members + [m for m in members if m[0].filename == "a.memmap"])
    with pytest.raises(FormatError, match="'a.memmap'.*twice"):
        load_memmap(path)


def test_member_shorter_than_its_shape(tmp_path):
    path = saved_archive(tmp_path)
    members = [(i, d[:8] if i.filename == "a.memmap" else d) for i, d in _members(path)]
    _rezip(path, members)
    with pytest.raises(FormatError, match="'a.memmap': holds 8 bytes.*shape \\(4,\\) \\(16 bytes\\)"):
        load_memmap(path)




def _announce_size(path, member: str, size: int) -> None:
    """Make the local and central headers of ``member`` announce ``size`` uncompressed
    bytes (its stored bytes and CRC unchanged)."""
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as zf:
        info, start = zf.getinfo(member), zf.start_dir
    data[info.header_offset + 22: info.header_offset + 26] = size.to_bytes(4, "little")
    at = data.index(member.encode(), start) - 46  # its central record
    assert data[at:at + 4] == b"PK\x01\x02"
    data[at + 24: at + 28] = size.to_bytes(4, "little")
    path.write_bytes(bytes(data))


def test_stored_member_whose_sizes_disagree(tmp_path):
    # 8 bytes stored, 16 announced, as the shape asks: mapped as 16 bytes, the leaf read
    # the central directory after them (and verify passed: the CRC of the 8 matched)
    path = saved_archive(tmp_path)
    members = [(i, d[:8] if i.filename == "a.memmap" else d) for i, d in _members(path)]
    _rezip(path, members)
    _announce_size(path, "a.memmap", 16)
    with pytest.raises(FormatError, match=f"{path}: member 'a.memmap'.*8 bytes stored, 16 announced"):
        load_memmap(path)
    assert not is_memmap_archive(path)
