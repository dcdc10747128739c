"""``refresh_archive_checksums``: the CRC-32 an archive stores for each member, made true
again after writes into its mapped payloads (``load_memmap(path, mode="r+")``,
``memmap_like("x.tdz")``), which change the data but not the checksums.

Each stored member's payload is read in chunks and its CRC-32 computed; where it
differs from the stored one, the new value is written where the zip keeps it: the
central directory record and the local header, or the data descriptor after the payload
when the member has one (local header flag bit 3, whose local CRC field stays 0).
Compressed members cannot be written in place (``mode="r+"`` refuses them), so their
checksums are left as they are. The archive is opened and its index checked as a load
checks it (:class:`~shared_td.persist.archive.Archive`), under its writer lock, so a
save replacing it waits; a writer still writing through a mapping meanwhile makes the
checksum stale again, as it would any copy. A process killed while this runs leaves a
loadable archive whose not yet refreshed checksums are still stale: run it again.
"""
from __future__ import annotations

import os
import pathlib
import struct
import zipfile
import zlib
from typing import Any

from shared_td.errors import FormatError
from shared_td.persist import atomic
from shared_td.persist.archive import Archive, looks_like_zip

__all__ = ["refresh_archive_checksums"]

_CENTRAL = struct.Struct("<4s6H3I5H2I")  # a central directory record's fixed part
_CENTRAL_SIGNATURE = b"PK\x01\x02"
_CENTRAL_CRC, _LOCAL_CRC = 16, 14  # where the CRC-32 lies in each header
_DESCRIPTOR_SIGNATURE = b"PK\x07\x08"
_USES_DESCRIPTOR = 0x08
_CHUNK = 1 << 22


def refresh_archive_checksums(archive_path: Any) -> pathlib.Path:
    """Recompute the CRC-32 of every stored member of the archive at ``archive_path``
    after in-place writes, so that zip tools (``zipfile``, ``unzip``,
    ``unpack_memmap``) accept it again; returns its path as a ``pathlib.Path``.

    Raises:
        ValueError: ``archive_path`` is not a zip archive holding a save
            (:func:`~shared_td.is_memmap_archive`); nothing is written.
        FormatError: its index is damaged or refused, as a load would refuse it.

    Examples:
        >>> import zipfile
        >>> _ = shared_td.TensorDict(a=torch.zeros(3)).save("data/td.tdz")
        >>> shared_td.load_memmap("data/td.tdz", mode="r+")["a"].add_(1)[0].item()
        1.0
        >>> zipfile.ZipFile("data/td.tdz").testzip()  # the first member with a stale CRC
        'a.memmap'
        >>> shared_td.refresh_archive_checksums("data/td.tdz").name
        'td.tdz'
        >>> zipfile.ZipFile("data/td.tdz").testzip() is None
        True
    """
    path = os.fspath(archive_path)
    if not os.path.isfile(path) or not looks_like_zip(path):
        raise ValueError(f"{path} is not an archive holding a saved tensordict (see is_memmap_archive); "
                         "refresh_archive_checksums only rewrites the checksums of such an archive.")
    archive = Archive(path, writable=True)  # a damaged or escaping index: FormatError
    try:
        why = archive.not_a_save()
        if why is not None:
            raise ValueError(f"{path} is a zip archive but holds no saved tensordict: {why}.")
        with atomic.acquired(path):
            _refresh(archive)
    finally:
        archive.close()
    return pathlib.Path(path)


def _refresh(archive: Archive) -> None:
    offset = archive.central_directory
    for info in archive.infos():
        record = os.pread(archive.fd, _CENTRAL.size, offset)
        if len(record) != _CENTRAL.size or record[:4] != _CENTRAL_SIGNATURE:
            raise archive.error(info.filename, "its central directory record is damaged")
        fields = _CENTRAL.unpack(record)
        name_len, extra_len, comment_len = fields[10:13]
        here, offset = offset, offset + _CENTRAL.size + name_len + extra_len + comment_len
        member = archive.members.get(info.filename)
        if member is None or member.compress_type != zipfile.ZIP_STORED:
            continue  # a directory entry, or compressed: never written in place
        crc = _crc_of(archive, info.filename, member.offset, member.size)
        if crc == info.CRC:
            continue
        packed = struct.pack("<I", crc)
        if info.flag_bits & _USES_DESCRIPTOR:
            after = member.offset + member.compress_size
            signed = os.pread(archive.fd, 4, after) == _DESCRIPTOR_SIGNATURE
            os.pwrite(archive.fd, packed, after + (4 if signed else 0))
        else:
            os.pwrite(archive.fd, packed, info.header_offset + _LOCAL_CRC)
        os.pwrite(archive.fd, packed, here + _CENTRAL_CRC)


def _crc_of(archive: Archive, name: str, offset: int, size: int) -> int:
    crc, done = 0, 0
    while done < size:
        chunk = os.pread(archive.fd, min(_CHUNK, size - done), offset + done)
        if not chunk:
            raise FormatError(archive.path, f"member {name!r}: its payload ends early (truncated archive)")
        crc = zlib.crc32(chunk, crc)
        done += len(chunk)
    return crc
