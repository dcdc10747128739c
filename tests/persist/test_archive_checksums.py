"""refresh_archive_checksums: after writes into a mode="r+" archive, the stored CRC-32 of
each changed member is made true again (zipfile, unzip and unpack_memmap refuse the
archive before), side by side with tensordict 0.15.3's function of the same name."""
from __future__ import annotations

import io
import pathlib
import zipfile

import pytest
import torch

import shared_td
from shared_td import TensorDict, load_memmap, refresh_archive_checksums
from shared_td.errors import FormatError


def _tree() -> TensorDict:
    return TensorDict(obs=torch.zeros(4, 3), nested=TensorDict(r=torch.arange(4.0), batch_size=[4]),
                      text="hello", batch_size=[4])


def _written(path) -> str:
    """Save, load with mode="r+" and write into two leaves: two stale checksums."""
    _tree().save(path)
    loaded = load_memmap(path, mode="r+")
    loaded["obs"][1] = 7.0
    loaded["nested", "r"].mul_(-1)
    return str(path)


def test_stale_checksums_are_refreshed_and_the_data_kept(tmp_path):
    path = _written(tmp_path / "td.tdz")
    with zipfile.ZipFile(path) as archive:
        assert archive.testzip() in ("obs.memmap", "nested/r.memmap")
    result = refresh_archive_checksums(path)
    assert result == pathlib.Path(path) and isinstance(result, pathlib.Path)
    with zipfile.ZipFile(path) as archive:
        assert archive.testzip() is None
    assert shared_td.unpack_memmap(path, tmp_path / "unpacked")
    again = load_memmap(tmp_path / "unpacked")
    assert again["obs"][1].tolist() == [7.0, 7.0, 7.0] and again["nested", "r"].tolist() == [0.0, -1.0, -2.0, -3.0]
    assert again["text"] == "hello"


def test_an_archive_with_true_checksums_is_left_byte_for_byte(tmp_path):
    path = tmp_path / "td.tdz"
    _tree().save(path, compression="deflate")
    before = path.read_bytes()
    refresh_archive_checksums(path)
    assert path.read_bytes() == before


def test_members_with_a_data_descriptor(tmp_path):
    """A zip written to a stream keeps each CRC in a descriptor after the data (flag bit
    3; the local header's CRC is 0): that descriptor and the central record are fixed."""
    _tree().save(tmp_path / "d")

    class Stream(io.RawIOBase):  # not seekable: zipfile writes data descriptors
        def __init__(self):
            self.data = bytearray()

        def writable(self):
            return True

        def write(self, b):
            self.data += b
            return len(b)

    stream = Stream()
    with zipfile.ZipFile(stream, "w") as archive:
        for file in sorted((tmp_path / "d").rglob("*")):
            if file.is_file():
                archive.writestr(str(file.relative_to(tmp_path / "d")), file.read_bytes())
    path = tmp_path / "streamed.tdz"
    path.write_bytes(stream.data)
    with zipfile.ZipFile(path) as archive:
        assert all(info.flag_bits & 0x08 for info in archive.infolist())
    loaded = load_memmap(path, mode="r+")
    loaded["obs"].fill_(3.0)
    del loaded
    with zipfile.ZipFile(path) as archive:
        assert archive.testzip() == "obs.memmap"
    refresh_archive_checksums(path)
    with zipfile.ZipFile(path) as archive:
        assert archive.testzip() is None
    assert (load_memmap(path)["obs"] == 3.0).all()


def test_what_is_no_archive_is_refused(tmp_path):
    _tree().save(tmp_path / "directory")
    (tmp_path / "other.zip").write_bytes(b"")
    with zipfile.ZipFile(tmp_path / "photos.zip", "w") as archive:
        archive.writestr("a.jpg", b"\xff\xd8")
    photos = (tmp_path / "photos.zip").read_bytes()
    for path in (tmp_path / "directory", tmp_path / "other.zip", tmp_path / "missing"):
        with pytest.raises(ValueError, match="not an archive holding a saved tensordict"):
            refresh_archive_checksums(path)
    with pytest.raises(ValueError, match="holds no saved tensordict: it holds no meta.json at its root"):
        refresh_archive_checksums(tmp_path / "photos.zip")
    assert (tmp_path / "photos.zip").read_bytes() == photos
    assert sorted(p.name for p in tmp_path.iterdir()) == ["directory", "other.zip", "photos.zip"]  # no lock file


def test_an_escaping_member_is_refused_before_anything_is_written(tmp_path):
    _tree().save(tmp_path / "td.tdz")
    good = (tmp_path / "td.tdz").read_bytes()
    evil = tmp_path / "evil.tdz"
    with zipfile.ZipFile(tmp_path / "td.tdz") as source, zipfile.ZipFile(evil, "w") as target:
        for info in source.infolist():
            target.writestr(info, source.read(info))
        target.writestr("../escape.memmap", b"x" * 8)
    before = evil.read_bytes()
    with pytest.raises(FormatError, match="'../escape.memmap': refused"):
        refresh_archive_checksums(evil)
    assert evil.read_bytes() == before and (tmp_path / "td.tdz").read_bytes() == good


@pytest.mark.parametrize("writer,refresher", [("tensordict", "shared_td"), ("shared_td", "tensordict")])
def test_across_libraries(tmp_path, writer, refresher):
    tensordict = pytest.importorskip("tensordict")
    libs = {"shared_td": shared_td, "tensordict": tensordict}
    path = tmp_path / "td.tdz"
    libs[writer].TensorDict(obs=torch.zeros(4, 3), batch_size=[4]).save(path)
    libs[writer].TensorDict.load_memmap(path, mode="r+")["obs"].fill_(5.0)
    with zipfile.ZipFile(path) as archive:
        assert archive.testzip() == "obs.memmap"
    libs[refresher].refresh_archive_checksums(path)
    with zipfile.ZipFile(path) as archive:
        assert archive.testzip() is None
    for lib in libs.values():
        lib.unpack_memmap(path, tmp_path / f"by_{lib.__name__}")
        assert (lib.TensorDict.load_memmap(tmp_path / f"by_{lib.__name__}")["obs"] == 5.0).all()
