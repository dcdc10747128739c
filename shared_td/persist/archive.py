"""Archives: a whole save in one zip file (``td.save("x.tdz")``), readable in place.

**What is in one.** The entries of the zip are exactly the files of the directory
layout (``meta.json`` at every level, ``<key>.memmap`` payloads, ``other.pickle`` ...),
named by their path below the prefix, with no directory entries: unzipping it gives
the directory save, and tensordict 0.15.3 reads ours as we read its. Payloads
(``*.memmap``) are stored uncompressed by default, their first byte at a multiple of
64 in the file (the local header's extra field is padded with a block of id ``0x6474``
as tensordict pads it), so that a load maps the archive once and every leaf is a view
into that mapping: no copy, pages read when touched. ``compression=`` ("deflate",
"bzip2", "lzma" or a ``zipfile.ZIP_*`` constant) compresses the payloads; such a leaf
is decompressed into memory when it is loaded: into a buffer of exactly the size its
meta.json gives, never more (persist.bounded_reads), of anonymous pages committed as the
data fill them, and refused (StorageFullError) if the memory has no room for that size.
Other entries are always stored.

**Writes into a loaded archive.** By default (and with ``mode="r"``) the archive is
mapped privately and its leaves are read-only tensors: a write raises
:class:`~shared_td.errors.ReadOnlyError` naming the archive (*ours*: tensordict lets it
change a private copy, lost without a word). With ``mode="r+"`` the archive is mapped
shared and writes reach the file; a compressed or unaligned payload cannot be mapped
so, and is then an error naming the member. Like tensordict, such writes do not update
the members' CRC-32, which a load does not check for mapped payloads (that would read
the whole archive at every load, defeating lazy mapping); ``zipfile``/``unzip`` would:
``refresh_archive_checksums`` (persist.archive_checksums) makes them true again.
A compressed (or, in a foreign zip, unaligned) leaf loaded without ``"r+"`` is a copy
in memory: writable, and its writes never reach the archive. Non-tensor values (in
meta.json or pickle members, never rewritten in place) are read-only in every mode: an
in-place write raises ReadOnlyError (``set()`` replaces one in memory).

**Damage.** Opening checks what is cheap before anything is mapped: the central
directory (a truncated file has none), every member's name (no absolute path, ``..``
or ``.`` part, backslash, drive or NUL), its kind (a symlink or other non-regular
member is refused), duplicates, encryption, the local header matching the central
one, the payload lying inside the file and overlapping no other member's local header
and payload nor the central directory, a path of at most ``MAX_PATH_PARTS`` parts (a
save nested deeper than a load can follow is a FormatError too, persist.loader); a leaf
member shorter than its meta.json's
shape is refused when loaded, and so is a compressed one whose header announces another
size than the shape's (before anything is decompressed). CRCs are checked for every
member read whole (meta.json, pickles, compressed payloads). Each is a
:class:`~shared_td.errors.FormatError` naming the archive and the member.

**Sizes are not trusted.** Members are read through our own decompressors
(persist.bounded_reads), in pieces of at most 1 MiB, and never past the size their header
announces: data that hold more are refused as soon as one byte too many comes out (a
1 kB bzip2 member announcing 4 bytes costs 5 bytes of output, not its 800 MB). A
compressed leaf is decompressed only if its header announces exactly its shape's bytes,
a ``meta.json`` only up to ``bounded_reads.MAX_META_BYTES``, a pickle up to
``MAX_PICKLE_BYTES``: more is refused unread.

**Atomic.** An archive is always written to a new file beside its target
(``.<name>.shared_td-new-<pid>-<random>``), zipped straight from the tree in memory
(no file per leaf on the way), and renamed over the target under its writer lock
(``.<name>.lock``), so a failure or a SIGKILL leaves the old archive whole; a killed
writer's temporary file is removed by the next writer and by ``shared-td gc``. A
symlinked target: the file it points to is replaced, the link stays; other hard links
keep the old content. Not synced to disk, as the directory layout: this guards against
a killed process, not a power loss. Writing is in ``persist.archive_write``; the format
is in docs/format.md, section 10.
"""
from __future__ import annotations

import errno
import json
import mmap
import os
import posixpath
import re
import stat
import struct
import threading
import zipfile
from typing import Any, Callable, Iterator

import torch

from shared_td import memory_check
from shared_td.errors import FormatError, StorageFullError
from shared_td.memmap_tensor import MemoryMappedTensor
from shared_td.persist import format as fmt
from shared_td.persist.bounded_reads import MAX_META_BYTES, MemberData, member_pieces, read_member
from shared_td.persist.node_meta import LeafMeta
from shared_td.storage import files
from shared_td.storage.fd_mapping import map_error

#: the suffix that makes ``memmap``/``save`` write an archive (``archive=None``)
ARCHIVE_SUFFIX = ".tdz"
#: payloads start at a multiple of this (torch.save's alignment, every itemsize divides it)
ALIGNMENT = 64
_LOCAL_HEADER = struct.Struct("<4s5H3I2H")
_LOCAL_SIGNATURE = b"PK\x03\x04"
#: How a zip file starts: a local header, or the end record of an empty zip.
ZIP_STARTS = (_LOCAL_SIGNATURE, b"PK\x05\x06")

COMPRESSIONS = {
    "stored": zipfile.ZIP_STORED,
    "deflate": zipfile.ZIP_DEFLATED,
    "deflated": zipfile.ZIP_DEFLATED,
    "bzip2": zipfile.ZIP_BZIP2,
    "lzma": zipfile.ZIP_LZMA,
}
_READ_ONLY_REASON = ("it was loaded from an archive, which is mapped read-only unless "
                     "loaded with mode='r+'")
_DRIVE = re.compile(r"[A-Za-z]:")
#: Member paths have at most this many parts: shared_td and tensordict write ~500 nested
#: tensordicts (~650 parts for tensorclasses) before Python's recursion limit stops them.
MAX_PATH_PARTS = 1024
#: a compressed leaf at least this big is decompressed only if the memory has room for it
_CHECKED_SIZE = 1 << 24


def check_compression(compression: Any) -> int:
    """The ``zipfile`` constant of ``compression`` (a name, a constant or None);
    ValueError listing the valid ones otherwise."""
    if compression is None:
        return zipfile.ZIP_STORED
    if isinstance(compression, str) and compression.lower() in COMPRESSIONS:
        return COMPRESSIONS[compression.lower()]
    if type(compression) is int and compression in set(COMPRESSIONS.values()):
        return compression
    names = ", ".join(repr(name) for name in COMPRESSIONS)
    raise ValueError(f"Unknown compression {compression!r}: use one of {names}, a zipfile "
                     "constant (zipfile.ZIP_STORED, ZIP_DEFLATED, ZIP_BZIP2, ZIP_LZMA) or None.")


def wants_archive(prefix: Any, archive: bool | None) -> bool:
    """Whether a write to ``prefix`` makes an archive: ``archive``, or for None a
    prefix ending with ``.tdz``."""
    if archive is None:
        return prefix is not None and os.fspath(prefix).endswith(ARCHIVE_SUFFIX)
    return bool(archive)


# ------------------------------------------------------------------------ reading
#: Where one member's payload lies in the archive file, and what its header says of it.
Member = MemberData


def name_problem(name: str) -> str | None:
    """Why the member name ``name`` could escape or confuse a destination, else None."""
    if not name or "\x00" in name:
        return "an empty name or a NUL byte"
    if "\\" in name:
        return "a backslash (a Windows path separator)"
    if name.startswith("/"):
        return "an absolute path"
    parts = name.rstrip("/").split("/")
    if _DRIVE.fullmatch(parts[0]):
        return "a drive letter"
    if any(part in ("", ".", "..") for part in parts):
        return "a '.', '..' or empty path part"
    try:  # zip names are UTF-8: a lone surrogate (an undecodable byte) has no encoding
        name.encode("utf-8")
    except UnicodeEncodeError as error:
        return f"a character UTF-8 cannot encode ({name[error.start:error.end]!r}, a lone surrogate)"
    return None


class Archive:
    """An archive opened for a load: its checked member index and (once needed) one
    mapping of the whole file. ``writable``: opened read-write, mapped shared. ``fd``: a
    descriptor of the archive already open (opened read-write if ``writable``), which the
    Archive then owns; ``path`` only names it in messages and mapped tensors. A caller
    that must read the very file it opened or wrote passes it: ``path`` may name another
    file by now (a rename over it)."""

    def __init__(self, path: str, *, writable: bool = False, read_only_reason: str | None = None,
                 fd: int | None = None):
        self.path = path
        self.writable = writable
        self.read_only_reason = read_only_reason or _READ_ONLY_REASON
        self.fd = open_regular_file(path, os.O_RDWR if writable else os.O_RDONLY) if fd is None else fd
        self._backing = None
        self._mapping = threading.Lock()  # leaves may be loaded on a thread pool
        try:
            self._file = open(self.fd, "rb", closefd=False)
            try:
                self._zip = zipfile.ZipFile(self._file)
            except (zipfile.BadZipFile, OSError, ValueError, EOFError) as error:
                raise FormatError(path, f"not a complete zip archive (truncated?): {error}") from None
            self.members, self.directories = self._index()
        except BaseException:
            self.close()
            raise

    def _index(self) -> tuple[dict[str, Member], set[str]]:
        size = os.fstat(self.fd).st_size
        members: dict[str, Member] = {}
        directories = {""}
        spans: list[tuple[int, int, str]] = []  # (local header's offset, payload's end, name)
        for info in self._zip.infolist():
            name = info.filename
            problem = name_problem(name)
            if problem is None and info.flag_bits & 0x1:
                problem = "it is encrypted"
            kind = stat.S_IFMT(info.external_attr >> 16) if info.create_system == 3 else 0
            if problem is None and kind and not (stat.S_ISREG(kind) or stat.S_ISDIR(kind)):
                problem = f"it is {files.file_kind(kind)}, not a regular file"
            if problem is None and name in members:
                problem = "it appears twice"
            if problem is None and name.rstrip("/").count("/") >= MAX_PATH_PARTS:
                problem = (f"its path has more than {MAX_PATH_PARTS} parts, deeper than any "
                           "save is nested (a damaged or hostile archive)")
            if problem is not None:
                raise self.error(name, f"refused: {problem}")
            if name.endswith("/"):
                _add_parents(directories, name.rstrip("/") + "/x")
                continue
            members[name] = member = self._locate(info, size)
            spans.append((info.header_offset, member.offset + member.compress_size, name))
            _add_parents(directories, name)
        clash = set(members) & directories
        if clash:
            raise self.error(sorted(clash)[0], "refused: it is both a file and a directory")
        self._check_apart(spans)
        return members, directories

    def _check_apart(self, spans: list[tuple[int, int, str]]) -> None:
        """Refuse members whose local headers and payloads overlap one another or the
        central directory: two leaves would be views of the same bytes (with
        mode="r+", a write into one would change the other, or the zip's own records)."""
        spans.sort()
        for (_, end, name), (start, _, after) in zip(spans, spans[1:]):
            if start < end:
                raise self.error(name, f"refused: its payload overlaps member {after!r} (bytes "
                                 f"{start} to {end} of the file): a damaged or hostile archive")
        if spans and spans[-1][1] > self.central_directory:
            raise self.error(spans[-1][2], "refused: its payload overlaps the central directory "
                             f"(from byte {self.central_directory}): a damaged or hostile archive")

    def _locate(self, info: zipfile.ZipInfo, size: int) -> Member:
        """The payload of ``info``, after checking its local header against the central one."""
        name = info.filename
        header = os.pread(self.fd, _LOCAL_HEADER.size, info.header_offset)
        if len(header) != _LOCAL_HEADER.size or header[:4] != _LOCAL_SIGNATURE:
            raise self.error(name, "its local header is missing or damaged (truncated archive?)")
        flags = struct.unpack_from("<H", header, 6)[0]
        name_len, extra_len = struct.unpack_from("<2H", header, 26)
        local_name = os.pread(self.fd, name_len, info.header_offset + _LOCAL_HEADER.size)
        if local_name.decode("utf-8" if flags & 0x800 else "cp437", "replace") != info.orig_filename:
            raise self.error(name, "its local header names another file")
        offset = info.header_offset + _LOCAL_HEADER.size + name_len + extra_len
        if info.compress_type == zipfile.ZIP_STORED and info.compress_size != info.file_size:
            # a stored payload is mapped as file_size bytes: more than it holds would
            # read whatever follows it (the next member, the central directory)
            raise self.error(name, f"it is stored uncompressed, yet its sizes disagree ({info.compress_size} "
                             f"bytes stored, {info.file_size} announced): the archive is damaged")
        if offset + info.compress_size > size:
            raise self.error(name, f"its payload runs past the end of the file ({size} bytes): "
                             "the archive is truncated")
        return Member(offset, info.file_size, info.compress_type, info.compress_size, info.CRC)

    def infos(self) -> list[zipfile.ZipInfo]:
        """The central directory's entries, in its order."""
        return self._zip.infolist()

    @property
    def central_directory(self) -> int:
        """The file offset of the central directory's first record."""
        return self._zip.start_dir

    def error(self, member: str, reason: str) -> FormatError:
        return FormatError(self.path, f"member {member!r}: {reason}")

    def read(self, name: str, *, limit: int) -> bytes:
        """The content of member ``name``, its CRC checked; FileNotFoundError if missing.
        A member announcing more than ``limit`` bytes is refused before it is read
        (``bounded_reads.MAX_META_BYTES``, ``MAX_PICKLE_BYTES``), and so are data that hold
        more (or fewer) bytes than announced."""
        if name not in self.members:
            raise FileNotFoundError(errno.ENOENT, f"No member {name!r} in the archive {self.path}")
        member = self.members[name]
        if member.size > limit:
            raise self.error(name, files.too_big(member.size, limit))
        return read_member(self.fd, member, self._refusal(name))

    def pieces(self, name: str, chunk: int | None = None) -> Iterator[bytes]:
        """The data of member ``name`` in pieces of at most ``chunk`` bytes (1 MiB by
        default), exactly as many bytes as its header announces, their CRC checked after
        the last (persist.bounded_reads); each damage is a FormatError naming the member."""
        member, refuse = self.members[name], self._refusal(name)
        if chunk is None:
            return member_pieces(self.fd, member, refuse)
        return member_pieces(self.fd, member, refuse, chunk=chunk)

    def _refusal(self, name: str) -> Callable[[str], FormatError]:
        return lambda reason: self.error(name, reason)

    def check(self, name: str, advance: Callable[[int], None] | None = None) -> None:
        """Read member ``name`` through in bounded pieces (:meth:`pieces`): FormatError
        if its data do not match its stored CRC or size, or cannot be decompressed (what
        ``shared-td verify`` checks); ``advance(n)`` is called with the bytes of each
        piece read (for a progress line)."""
        for piece in self.pieces(name):
            if advance is not None:
                advance(len(piece))

    def size_problem(self, name: str, nbytes: int) -> str | None:
        """Why member ``name`` cannot hold a leaf of ``nbytes`` bytes, else None: it holds
        fewer, or it is compressed and announces another size (then it is never
        decompressed: what comes out must be exactly the leaf)."""
        member = self.members[name]
        if member.size < nbytes:
            return f"holds {member.size} bytes"
        if member.size != nbytes and member.compress_type != zipfile.ZIP_STORED:
            return f"is compressed and announces {member.size} bytes once decompressed"
        return None

    def not_a_save(self) -> str | None:
        """Why the archive's root is no save (format.not_a_save's words), else None."""
        try:
            meta = json.loads(self.read(fmt.META, limit=MAX_META_BYTES).decode("utf-8"))
        except FileNotFoundError:
            return f"it holds no {fmt.META} at its root"
        except FormatError as error:  # (too big: refused unread)
            return f"its {fmt.META} cannot be read: {error.detail}"
        except (ValueError, UnicodeDecodeError, RecursionError) as error:
            return f"its {fmt.META} is not valid JSON: {error}"
        tensorclass = f"{fmt.TENSORCLASS_CHILD}/{fmt.META}" in self.members
        return fmt.save_problem(meta, tensorclass_child=tensorclass)

    def leaf(self, name: str, leaf: LeafMeta, *, where: str) -> torch.Tensor:
        """The tensor of leaf ``leaf`` stored as member ``name``: a view into the mapping
        of the archive, or (compressed or unaligned) a copy in memory, decompressed
        straight into a buffer of the leaf's size."""
        member, shape = self.members[name], torch.Size(leaf.shape)
        problem = self.size_problem(name, leaf.nbytes)
        if problem is not None:
            unread = "" if member.compress_type == zipfile.ZIP_STORED else \
                ": refused before decompressing it (a damaged or hostile archive)"
            raise self.error(name, f"{problem}, but {where} says a {leaf.dtype} "
                             f"tensor of shape {tuple(shape)} ({leaf.nbytes} bytes){unread}")
        if member.compress_type == zipfile.ZIP_STORED and member.offset % leaf.dtype.itemsize == 0:
            return MemoryMappedTensor._from_backing(self.backing(), member.offset, leaf.dtype, shape)
        why = "compressed" if member.compress_type != zipfile.ZIP_STORED else "not aligned"
        if self.writable:
            raise self.error(name, f"cannot be loaded with mode='r+': its payload is {why}, so it "
                             "can only be copied into memory, and writes would never reach the "
                             "archive. Load it without mode='r+', or save the archive again "
                             "without compression.")
        buffer = self._buffer(name, leaf.nbytes)
        with memoryview(buffer) as view:
            at = 0
            for piece in self.pieces(name):  # (a stored member may hold more: read for its CRC)
                taken = min(len(piece), leaf.nbytes - at)
                view[at:at + taken] = memoryview(piece)[:taken]
                at += taken
        return torch.frombuffer(buffer, dtype=leaf.dtype).view(shape)

    def _buffer(self, name: str, nbytes: int) -> mmap.mmap:
        """Memory for the ``nbytes`` of member ``name`` once decompressed: anonymous
        pages, committed only as the data arriving fill them (a header may declare any
        size: a bytearray would be zero-filled, all of it, before the first byte is
        read). A size beyond the memory available is refused before it is reserved."""
        if nbytes >= _CHECKED_SIZE:
            room, why = memory_check.memory_room()
            if nbytes > room:
                raise StorageFullError(errno.ENOMEM, (
                    f"Cannot load member {name!r} of the archive {self.path}: it is compressed, "
                    f"and its {nbytes} bytes ({nbytes / 2**30:.1f} GiB) once decompressed must be "
                    f"held in memory, where {room} bytes are available ({why}). Load it where "
                    "there is more memory, or save it without compression (leaves are then "
                    "mapped, not copied)."))
        # private: after a fork each process writes its own copy (a shared mapping, the
        # default, let a DataLoader worker's write reach the parent's "copy")
        try:
            return mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        except OSError as err:  # RLIMIT_AS, vm.max_map_count, the commit: say which member
            raise map_error(err.errno, -1, nbytes, False, f"member {name!r} of the archive "
                            f"{self.path} (compressed: decompressed into private memory)") from None

    def backing(self) -> files.FileBacking:
        """The one mapping of the whole archive (made on first use)."""
        with self._mapping:
            if self._backing is None:
                self._backing = files.backing_from_fd(  # (bound: leaves lie at its members' offsets)
                    self.path, self.fd, shared=self.writable,
                    read_only=None if self.writable else self.read_only_reason, bound=True)
            return self._backing

    def close(self) -> None:
        """Close the file (the mapping, if made, lives as long as its tensors)."""
        if getattr(self, "_zip", None) is not None:
            self._zip.close()
        if getattr(self, "_file", None) is not None:
            self._file.close()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _add_parents(directories: set[str], name: str) -> None:
    parent = posixpath.dirname(name)
    while parent not in directories:
        directories.add(parent)
        parent = posixpath.dirname(parent)


class ArchiveNode:
    """One node directory inside an archive, with the methods of ``storage.files.Directory``
    that the loader uses (``read``, ``exists``, ``child``, ``join``, ``path``, ``close``)."""

    def __init__(self, archive: Archive, at: str = ""):
        self.archive, self.at = archive, at
        self.fd = archive.fd  # the loader compares it with the path to see a replaced archive

    @property
    def path(self) -> str:
        return f"{self.archive.path}::{self.at}" if self.at else self.archive.path

    def _member(self, name: str) -> str:
        return f"{self.at}/{name}" if self.at else name

    def join(self, name: str) -> str:
        return f"{self.archive.path}::{self._member(name)}"

    def exists(self, name: str) -> bool:
        member = self._member(name)
        return member in self.archive.members or member in self.archive.directories

    def read(self, name: str, *, limit: int) -> bytes:
        return self.archive.read(self._member(name), limit=limit)

    def child(self, name: str) -> "ArchiveNode":
        member = self._member(name)
        if member not in self.archive.directories:
            raise FileNotFoundError(errno.ENOENT, f"No directory {member!r} in the archive {self.archive.path}")
        return ArchiveNode(self.archive, member)

    def leaf(self, name: str, leaf: LeafMeta) -> torch.Tensor:
        member = self._member(name)
        if member not in self.archive.members:
            raise FileNotFoundError(errno.ENOENT, f"No member {member!r} in the archive {self.archive.path}")
        return self.archive.leaf(member, leaf, where=f"key {leaf.key!r} in {self.join(fmt.META)}")

    def close(self) -> None:
        if not self.at:
            self.archive.close()


def open_regular_file(path: str, flags: int) -> int:
    """Open ``path`` (symlinks followed: the caller's own path) if it is a regular file;
    a FIFO or device is refused without blocking."""
    fd = os.open(path, flags | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    kind = files.file_kind(os.fstat(fd).st_mode)
    if kind is not None:
        os.close(fd)
        raise FormatError(path, f"{kind}, not a regular file: not an archive")
    return fd


def looks_like_zip(path: str) -> bool:
    """Whether the regular file ``path`` starts as a zip does (never blocks)."""
    try:
        fd = open_regular_file(path, os.O_RDONLY)
    except (OSError, FormatError):
        return False
    try:
        return os.pread(fd, 4, 0) in ZIP_STARTS
    finally:
        os.close(fd)


def is_memmap_archive(path: Any) -> bool:
    """True if ``path`` is a zip file holding a save (ours or tensordict's) at its root.

    Its root ``meta.json`` must parse and name a tensordict class with the fields that
    class always has (``format.save_problem``). A directory, a missing path, a FIFO (not
    opened for reading, so this never blocks), another file or a zip of other things
    gives False.

    Examples:
        >>> _ = shared_td.TensorDict(a=torch.zeros(3)).save("data/td.tdz")
        >>> shared_td.is_memmap_archive("data/td.tdz"), shared_td.is_memmap_archive("data")
        (True, False)
    """
    try:
        path = os.fspath(path)
        if not os.path.isfile(path) or not looks_like_zip(path):
            return False
        archive = Archive(path)
    except (OSError, FormatError, TypeError, ValueError):
        return False
    try:
        return archive.not_a_save() is None
    except (OSError, FormatError):
        return False
    finally:
        archive.close()
