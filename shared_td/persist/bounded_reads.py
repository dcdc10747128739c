"""Reading a save without trusting the sizes it declares: the caps on what is read
whole (``MAX_META_BYTES``, ``MAX_PICKLE_BYTES``), and archive members read in bounded
pieces, never more than their header announces.

A file's size can lie about its content (a sparse file announces any size at no cost on
disk), so a file read whole is refused unread past a cap (``storage.files.read_whole``
does it for the files of a directory, ``archive.Archive.read`` for members).

A zip member's header announces its size (``file_size``), but its compressed data may
decompress to far more: a 1 kB bzip2 member can hold 800 MB of zeros. ``zipfile``
hands its bzip2 and lzma decompressors no output limit, so even a chunked read of such
a member gets all of it in one piece, and a whole-member read keeps it in memory. Here
the compressed bytes are read from the archive's descriptor (``pread``) and fed to our
own decompressor (``zlib.decompressobj``, ``bz2.BZ2Decompressor``,
``lzma.LZMADecompressor``), asking each call for at most ``chunk`` bytes and, in all,
for the size the header announces: one byte more than that is a
:class:`~shared_td.errors.FormatError` at once, fewer is one at the end, and so is a
CRC-32 that differs from the stored one. Memory held: one piece of output and one of
input, whatever the member says.

The caller decides the size it trusts before reading anything (a leaf's
``meta.json`` shape, a cap on metadata): :class:`~shared_td.persist.archive.Archive`
checks it against the header, then reads through this module.

Examples:
    >>> import io, zipfile
    >>> buffer = io.BytesIO()
    >>> with zipfile.ZipFile(buffer, "w", zipfile.ZIP_BZIP2) as zf:
    ...     zf.writestr("x", b"ab" * 100_000)
    >>> info = zipfile.ZipFile(buffer).getinfo("x")
    >>> path = "data/one.zip"; _ = open(path, "wb").write(buffer.getvalue())
    >>> fd = os.open(path, os.O_RDONLY)
    >>> offset = info.header_offset + 30 + len("x")  # (no extra field: zipfile wrote none)
    >>> member = MemberData(offset, info.file_size, info.compress_type, info.compress_size, info.CRC)
    >>> [len(piece) for piece in member_pieces(fd, member, ValueError, chunk=1 << 16)]
    [65536, 65536, 65536, 3392]
    >>> os.close(fd)
"""
from __future__ import annotations

import bz2
import lzma
import os
import zipfile
import zlib
from dataclasses import dataclass
from typing import Callable, Iterator

#: the most bytes of output (and of compressed input) held at once by a read
CHUNK = 1 << 20

#: The most bytes a meta.json may hold: one is read whole (then decoded and parsed), so
#: its size is checked first and a bigger one refused unread (a damaged or hostile save:
#: a sparse file of 1 GiB takes no disk, yet reading it takes 1 GiB of memory and as
#: much again to decode). A node's entry takes ~90 bytes (a node of 100,000 leaves:
#: ~9 MB), but a NonTensorStack keeps its values in its meta.json (a million strings of
#: 200 characters: ~200 MB), hence this much room; what it bounds, reading and decoding,
#: is ~0.5 GiB of memory and well under a second.
MAX_META_BYTES = 256 << 20
#: The most bytes a pickle side file (other.pickle, pickle.pkl) may hold: read whole and
#: unpickled only with allow_pickle=True, from a save the caller trusts, so this is only
#: against damage (an archive has always refused bigger members).
MAX_PICKLE_BYTES = 1 << 30

Refusal = Callable[[str], Exception]  # a reason -> the error to raise (naming the member)


@dataclass(frozen=True)
class MemberData:
    """Where one member's data lie in the archive file and what its header says of them."""

    offset: int  # of its first (compressed) byte in the file
    size: int  # uncompressed, as announced
    compress_type: int
    compress_size: int
    crc: int  # CRC-32 of the uncompressed data, as stored


def member_pieces(fd: int, member: MemberData, refuse: Refusal, *, chunk: int = CHUNK) -> Iterator[bytes]:
    """The data of ``member`` (read from ``fd``) in pieces of at most ``chunk`` bytes,
    exactly ``member.size`` bytes in all, their CRC-32 checked once the last is given
    (so a caller must read them all). Any damage, or more or fewer bytes than announced,
    raises ``refuse(reason)``."""
    pieces = _stored(fd, member, refuse, chunk) if member.compress_type == zipfile.ZIP_STORED \
        else _decompressed(fd, member, refuse, chunk)
    crc = 0
    for piece in pieces:
        crc = zlib.crc32(piece, crc)
        yield piece
    _check_crc(member, crc, refuse)


def read_member(fd: int, member: MemberData, refuse: Refusal) -> bytes:
    """All of ``member``'s data, CRC-32 checked: one ``pread`` into the result for a
    stored member, pieces joined for a compressed one. The caller has checked that
    ``member.size`` is a size it accepts to hold."""
    if member.compress_type != zipfile.ZIP_STORED:
        return b"".join(member_pieces(fd, member, refuse))
    data = os.pread(fd, member.size, member.offset) if member.size else b""
    if len(data) != member.size:  # (a regular file gives all at once up to 2 GiB)
        raise refuse(f"its payload ends after {len(data)} of its {member.size} bytes (truncated archive)")
    _check_crc(member, zlib.crc32(data), refuse)
    return data


def _check_crc(member: MemberData, crc: int, refuse: Refusal) -> None:
    if crc != member.crc:
        # (zipfile's words after the colon, which `shared-td verify` has always shown)
        raise refuse(f"its data do not match the archive's checksum: Bad CRC-32 ({crc:#010x} read, "
                     f"{member.crc:#010x} stored)")


def _stored(fd: int, member: MemberData, refuse: Refusal, chunk: int) -> Iterator[bytes]:
    done = 0
    while done < member.size:
        piece = os.pread(fd, min(chunk, member.size - done), member.offset + done)
        if not piece:
            raise refuse(f"its payload ends after {done} of its {member.size} bytes (truncated archive)")
        done += len(piece)
        yield piece


def _decompressed(fd: int, member: MemberData, refuse: Refusal, chunk: int) -> Iterator[bytes]:
    """Feed the compressed bytes to the member's decompressor, asking for at most
    ``chunk`` bytes a call and for no more than the announced size in all (then for one
    byte more, to see that there is none)."""
    start, end = member.offset, member.offset + member.compress_size
    stream, start = _decompressor(fd, member, start, end, refuse)
    produced, exhausted = 0, False
    while not stream.eof:
        data = b""
        if stream.needs_input and not exhausted:
            data = os.pread(fd, min(chunk, end - start), start) if start < end else b""
            start += len(data)
            exhausted = not data
        left = member.size - produced
        try:
            out = stream.decompress(data, min(chunk, left) if left else 1)
        except _DAMAGE as error:
            raise refuse(f"its compressed data cannot be decompressed: {error}") from None
        if len(out) > left:
            raise refuse(f"its compressed data hold more than the {member.size} bytes its header "
                         "announces: refused without decompressing the rest (a damaged or hostile archive)")
        if out:
            produced += len(out)
            yield out
        elif not data and (exhausted or not stream.needs_input):
            break  # no input left to give and no output to take: the stream ends here
    if produced != member.size:
        raise refuse(f"its compressed data end after {produced} of the {member.size} bytes its header "
                     "announces (a truncated or damaged archive)")


# what the decompressors raise on damaged data (bz2: OSError; after the end: EOFError)
_DAMAGE = (zlib.error, lzma.LZMAError, OSError, EOFError, ValueError)


class _Inflate:
    """zlib's raw deflate (what zip stores) with the interface of bz2's and lzma's
    decompressors: ``decompress(data, max_length)``, ``needs_input``, ``eof``. zlib keeps
    the input it did not use in ``unconsumed_tail`` instead of buffering it."""

    def __init__(self):
        self._zlib = zlib.decompressobj(-zlib.MAX_WBITS)

    @property
    def eof(self) -> bool:
        return self._zlib.eof

    @property
    def needs_input(self) -> bool:
        return not self._zlib.unconsumed_tail

    def decompress(self, data: bytes, max_length: int) -> bytes:
        return self._zlib.decompress(data or self._zlib.unconsumed_tail, max_length)


def _decompressor(fd: int, member: MemberData, start: int, end: int, refuse: Refusal):
    """The decompressor of ``member`` and where its compressed stream starts."""
    if member.compress_type == zipfile.ZIP_DEFLATED:
        return _Inflate(), start
    if member.compress_type == zipfile.ZIP_BZIP2:
        return bz2.BZ2Decompressor(), start
    if member.compress_type == zipfile.ZIP_LZMA:
        return _lzma(fd, member, start, end, refuse)
    raise refuse(f"it is compressed with method {member.compress_type}, which shared_td cannot read "
                 "(only stored, deflate, bzip2 and lzma)")


def _lzma(fd: int, member: MemberData, start: int, end: int, refuse: Refusal):
    """Zip's lzma: a 4-byte header (version, then the size of the properties), the
    5-byte LZMA1 properties (lc/lp/pb in one byte, the dictionary size), then a raw LZMA1
    stream."""
    head = os.pread(fd, min(9, end - start), start)
    if len(head) < 9 or int.from_bytes(head[2:4], "little") != 5 or head[4] >= 9 * 5 * 5:
        raise refuse("its lzma header is damaged")
    pb, rest = divmod(head[4], 9 * 5)
    lp, lc = divmod(rest, 9)
    # liblzma allocates the dictionary the properties ask for (up to 4 GiB, whatever the
    # data); no match reaches back further than the bytes produced, which are at most
    # the announced size, so a dictionary of that size decodes every valid stream
    dict_size = max(4096, min(int.from_bytes(head[5:9], "little"), member.size + 1))
    lzma1 = {"id": lzma.FILTER_LZMA1, "lc": lc, "lp": lp, "pb": pb, "dict_size": dict_size}
    try:
        return lzma.LZMADecompressor(lzma.FORMAT_RAW, filters=[lzma1]), start + 9
    except _DAMAGE as error:
        raise refuse(f"its lzma header is damaged: {error}") from None
