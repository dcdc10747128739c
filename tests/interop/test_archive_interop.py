"""Archives (``.tdz``) between shared_td and tensordict 0.15.3, both ways.

Each test writes an archive with one library and reads it with the other, or compares
what the two write for the same data (member names, compression, payload alignment).
"""
from __future__ import annotations

import os
import zipfile

import pytest
import torch

from tests.interop.test_interop import (
    BATCH_SIZES, DIRECTIONS, DTYPES, LIBS, ROBUST_KEYS, assert_same, files, load, nested_td,
    set_non_tensor,
)
from tests.persist.archive_children import inside, maps_of
from tests.reference import needs_tensordict

pytestmark = needs_tensordict


def payload_layout(path) -> dict[str, tuple[int, int]]:
    """member -> (compression, payload offset modulo 64), read from the local headers."""
    layout = {}
    with zipfile.ZipFile(path) as zf, open(path, "rb") as raw:
        for info in zf.infolist():
            raw.seek(info.header_offset + 26)
            name_len, extra_len = int.from_bytes(raw.read(2), "little"), int.from_bytes(raw.read(2), "little")
            layout[info.filename] = (info.compress_type, (info.header_offset + 30 + name_len + extra_len) % 64)
    return layout


@pytest.mark.parametrize("compression", [None, "deflate", "lzma"])
@pytest.mark.parametrize("batch", BATCH_SIZES)
@pytest.mark.parametrize("writer,reader", DIRECTIONS)
def test_nested_archive_round_trip(tmp_path, writer, reader, batch, compression):
    source = nested_td(writer, batch)
    set_non_tensor(writer, source, "note", "hello")
    source.save(tmp_path / "td.tdz", compression=compression)
    loaded = load(reader, tmp_path / "td.tdz")
    assert_same(loaded, source)


@pytest.mark.parametrize("writer,reader", DIRECTIONS)
def test_every_dtype_and_robust_keys(tmp_path, writer, reader):
    lib = LIBS[writer]
    data = {str(dtype): torch.arange(6).reshape(2, 3).to(dtype) for dtype in DTYPES}
    data.update({key: torch.full((2,), float(i)) for i, key in enumerate(ROBUST_KEYS) if key})
    data["empty"] = torch.zeros(2, 0)
    source = lib.TensorDict(data, batch_size=[2])
    source.save(tmp_path / "k.tdz")
    assert_same(load(reader, tmp_path / "k.tdz"), source)


@pytest.mark.parametrize("writer,reader", DIRECTIONS)
def test_lazy_stack_archive(tmp_path, writer, reader):
    lib = LIBS[writer]
    stack = lib.LazyStackedTensorDict(
        *[lib.TensorDict(x=torch.full((2,), float(i)), batch_size=[]) for i in range(3)], stack_dim=0)
    stack.save(tmp_path / "s.tdz")
    assert_same(LIBS[reader].LazyStackedTensorDict.load_memmap(tmp_path / "s.tdz"), stack)


@pytest.mark.parametrize("compression", [None, "deflate"])
def test_both_write_the_same_members_aligned_alike(tmp_path, compression):
    for name in LIBS:
        td = nested_td(name, [3])
        set_non_tensor(name, td, "note", "hello")
        td.save(tmp_path / f"{name}.tdz", compression=compression)
    ours, theirs = payload_layout(tmp_path / "shared_td.tdz"), payload_layout(tmp_path / "tensordict.tdz")
    assert sorted(ours) == sorted(theirs)
    for member, (kind, misalignment) in ours.items():
        assert kind == theirs[member][0], member
        if member.endswith(".memmap") and kind == zipfile.ZIP_STORED:
            assert misalignment == 0 == theirs[member][1], member


def test_tensordicts_archive_is_mapped_in_place_by_shared_td(tmp_path):
    import tensordict

    source = nested_td("tensordict", [3])
    source.save(tmp_path / "t.tdz")
    loaded = load("shared_td", tmp_path / "t.tdz")
    ranges = maps_of(tmp_path / "t.tdz")
    assert inside(loaded["obs"], ranges) and inside(loaded["level1", "level2", "level3", "pix"], ranges)
    writable = load("shared_td", tmp_path / "t.tdz", mode="r+")
    writable["obs"].fill_(5.0)
    assert (tensordict.TensorDict.load_memmap(tmp_path / "t.tdz")["obs"] == 5.0).all()


def test_memmap_like_archive_filled_by_tensordict(tmp_path):
    import tensordict

    like = nested_td("shared_td", [3]).memmap_like(tmp_path / "like.tdz")
    theirs = tensordict.TensorDict.load_memmap(tmp_path / "like.tdz", mode="r+")
    theirs["obs"].fill_(2.0)
    assert (like["obs"] == 2.0).all()


@pytest.mark.parametrize("packer,unpacker", DIRECTIONS)
def test_pack_and_unpack_across_libraries(tmp_path, packer, unpacker):
    source = nested_td("shared_td", [3])
    source.save(tmp_path / "d")
    LIBS[packer].pack_memmap(tmp_path / "d", tmp_path / "d.tdz")
    LIBS[unpacker].unpack_memmap(tmp_path / "d.tdz", tmp_path / "u")
    assert files(tmp_path / "u") == files(tmp_path / "d")
    assert_same(load("shared_td", tmp_path / "u"), source)
    assert LIBS[unpacker].is_memmap_archive(tmp_path / "d.tdz")
    assert not LIBS[unpacker].is_memmap_archive(tmp_path / "d")


def test_an_escaping_member_in_tensordicts_archive_is_refused(tmp_path):
    """A member path with '..' is refused by shared_td with a FormatError naming it."""
    import shared_td

    source = nested_td("tensordict", [3])
    source.save(tmp_path / "t.tdz")
    with zipfile.ZipFile(tmp_path / "t.tdz", "a") as zf:
        zf.writestr("../escape.memmap", b"\0" * 8)
    with pytest.raises(shared_td.FormatError, match="'../escape.memmap'"):
        load("shared_td", tmp_path / "t.tdz")
    assert not os.path.exists(tmp_path.parent / "escape.memmap")
