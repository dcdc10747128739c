"""Writing archives: zip a directory save (aligned or compressed payloads), atomically;
extract one into a directory save. The format, and how archives are read, is in
``persist.archive``.
"""
from __future__ import annotations

import errno
import os
import stat
import struct
import time
import warnings
import zipfile
import zlib
from typing import Any, Callable

from shared_td.errors import FormatError
from shared_td.persist import atomic
from shared_td.persist import format as fmt
from shared_td.persist.archive import (
    ALIGNMENT, ARCHIVE_SUFFIX, Archive, check_compression, is_memmap_archive, name_problem,
)
from shared_td.storage import files
from shared_td.storage.files import Directory, NO_SPACE_ERRNOS, storage_full_error
from shared_td.storage.removal import remove_tree

_PAD_EXTRA_ID = 0x6474  # b"td", tensordict's id for the padding block
_LOCAL_HEADER_SIZE = 30
_ZIP64_LOCAL_EXTRA = 20  # what zipfile adds to a local header under force_zip64=True
_CHUNK = 16 << 20


def _files_of(directory: Directory, at: str = ""):
    """``(member name, directory, file name)`` of every file below ``directory``:
    meta.json first at each level, then the other files, then each sub-directory
    (tensordict's order). Never through a symlink; a killed writer's temporaries are
    left out; anything but a file or a directory is refused."""
    names = sorted(os.listdir(directory.fd))
    kinds = {name: directory.lstat(name) for name in names}
    regular = [n for n in names if kinds[n] is not None and stat.S_ISREG(kinds[n].st_mode)
               and fmt.temporary_writer_pid(n) is None]
    for name in sorted(regular, key=lambda n: n != fmt.META):
        yield (f"{at}/{name}" if at else name), directory, name
    for name in names:
        st = kinds[name]
        if st is None or stat.S_ISREG(st.st_mode):
            continue
        if not stat.S_ISDIR(st.st_mode):
            raise FormatError(directory.join(name), f"{files.file_kind(st.st_mode)} in a save: "
                              "only files and directories can be put in an archive")
        with directory.child(name) as child:
            yield from _files_of(child, f"{at}/{name}" if at else name)


def _padding(header_offset: int, name: str) -> bytes:
    """The extra field that puts the payload of a member at ``header_offset`` on an
    ALIGNMENT boundary (zipfile appends its 20-byte zip64 block after it)."""
    start = header_offset + _LOCAL_HEADER_SIZE + len(name.encode("utf-8")) + 4 + _ZIP64_LOCAL_EXTRA
    pad = -start % ALIGNMENT
    return struct.pack("<HH", _PAD_EXTRA_ID, pad) + bytes(pad)


def _write_member(zf: zipfile.ZipFile, name: str, fd: int, size: int, compress_type: int) -> None:
    info = zipfile.ZipInfo(name, date_time=time.localtime()[:6])
    info.compress_type = compress_type
    info.file_size = size
    info.external_attr = (stat.S_IFREG | 0o644) << 16
    aligned = compress_type == zipfile.ZIP_STORED and name.endswith(fmt.LEAF_SUFFIX)
    if aligned:
        info.extra = _padding(zf.start_dir, name)
    with zf.open(info, "w", force_zip64=True) as out:
        if aligned and zf.fp.tell() % ALIGNMENT:
            raise RuntimeError(f"The payload of {name} is not aligned: zipfile's local header "
                               "layout changed (this is a bug of shared_td).")
        done = 0
        while done < size:
            chunk = os.pread(fd, min(_CHUNK, size - done), done)
            if not chunk:
                raise RuntimeError(f"{name} shrank while it was put in the archive.")
            out.write(chunk)
            done += len(chunk)


def pack_directory(source: str, target: str, compression: Any = None, *, final: str | None = None) -> None:
    """Zip the directory save ``source`` into the NEW file ``target`` (O_EXCL), payloads
    aligned or compressed as ``persist.archive`` says. ``final``: the archive that
    ``target`` is a temporary of (named in errors)."""
    compress_type = check_compression(compression)
    with Directory.open(source, action="put in an archive") as root:
        parent, name = os.path.split(target)
        with Directory.open(parent) as out_dir:
            out = out_dir.open_file(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        try:
            with open(out, "wb") as stream, zipfile.ZipFile(stream, "w", allowZip64=True) as zf:
                for member, directory, file_name in _files_of(root):
                    problem = name_problem(member)
                    if problem is not None:
                        raise FormatError(directory.join(file_name), f"its name has {problem}: it "
                                          "cannot be a member of an archive (save with robust_key=True)")
                    fd = directory.open_regular(file_name)
                    try:
                        size = os.fstat(fd).st_size
                        packed = compress_type if member.endswith(fmt.LEAF_SUFFIX) else zipfile.ZIP_STORED
                        _write_member(zf, member, fd, size, packed)
                    finally:
                        os.close(fd)
        except OSError as error:
            if error.errno in NO_SPACE_ERRNOS:
                where = f"archive {final or target}" + (f" (written as {target})" if final else "")
                raise storage_full_error(error, _tree_size(source), where) from error
            raise


def _tree_size(path: str) -> int:
    return sum(os.lstat(os.path.join(d, n)).st_size for d, _, names in os.walk(path) for n in names)


def check_archive_target(target: Any, *, existsok: bool) -> str:
    """The file an archive write replaces (absolute, a symlink followed), checked first:
    a directory there is a IsADirectoryError, an existing file with existsok=False a
    RuntimeError (as tensordict)."""
    if target is None:
        raise ValueError("An archive needs a file to write to: pass prefix= (e.g. 'data/buffer.tdz').")
    target = os.path.realpath(os.path.abspath(os.fspath(target)))
    if os.path.isdir(target):
        raise IsADirectoryError(errno.EISDIR, f"Cannot write an archive at {target}: it is a "
                                "directory (pass archive=False to write a directory save there).")
    if os.path.lexists(target) and not existsok:
        raise RuntimeError(f"A file already exists at {target}, cannot save the tensordict there. "
                           "Set existsok=True to overwrite.")
    return target


def write_archive(target: str, stage: Callable[[str], str], compression: Any = None) -> None:
    """Write the archive ``target`` atomically. ``stage(path)`` returns the directory
    save to zip: one it writes at ``path`` (inside a temporary directory beside
    ``target``), or an existing one. The zip is made in that temporary directory and
    renamed over ``target`` under its writer lock. On any failure ``target`` is left as
    it was and the temporary directory removed (after a SIGKILL: by the next writer or
    ``shared-td gc``)."""
    check_compression(compression)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    with atomic.acquired(target):
        _sweep(target)
        staging = atomic.Staging(target)
        try:
            source = stage(os.path.join(staging.path, "tree"))
            packed = os.path.join(staging.path, os.path.basename(target))
            pack_directory(source, packed, compression, final=target)
            if os.path.isfile(target):  # the new version keeps the old one's mode
                os.chmod(packed, stat.S_IMODE(os.stat(target).st_mode))
            staging.finish()
            os.rename(packed, target)
        except BaseException as error:
            staging.discard(error)
            raise
        try:
            remove_tree(staging.path)
        except OSError as error:
            warnings.warn(f"{target} was written, but its temporary directory could not be "
                          f"removed: {error}. shared_td.gc({target!r}) removes it once this "
                          "process has exited.", RuntimeWarning, stacklevel=3)


def _sweep(target: str) -> None:
    """Remove the temporary directories of dead writers of ``target`` (under its lock)."""
    try:
        atomic.sweep_leftovers(target)
    except OSError as error:  # what dead writers left does not stop this one
        warnings.warn(str(error), RuntimeWarning, stacklevel=4)


def pack_memmap(prefix: Any, archive: Any = None, compression: Any = None) -> str:
    """Zip the directory save ``prefix`` into the archive ``archive`` (default
    ``<prefix>.tdz``), atomically; returns the archive's path. Payloads are stored
    aligned, or compressed with ``compression`` (see :func:`check_compression`).

    Examples:
        >>> _ = shared_td.TensorDict(a=torch.zeros(3)).save("data/saved")
        >>> os.path.basename(shared_td.pack_memmap("data/saved"))
        'saved.tdz'
    """
    prefix = os.path.abspath(os.fspath(prefix))
    check_compression(compression)
    why = fmt.not_a_save(prefix)
    if why is not None:
        raise ValueError(f"Cannot pack {prefix}: it is not a saved tensordict ({why}).")
    target = check_archive_target(prefix + ARCHIVE_SUFFIX if archive is None else archive, existsok=True)
    real = os.path.realpath(prefix)
    if target == real or target.startswith(real + os.sep):
        raise ValueError(f"The archive {target} must be outside the save {prefix} it packs.")
    write_archive(target, lambda _: prefix, compression)
    return target


def unpack_memmap(archive: Any, prefix: Any) -> str:
    """Extract the archive ``archive`` into the directory save ``prefix``; returns it.

    Atomic as ``memmap_(prefix, atomic=True)``: the members are written (through
    ``openat``/``O_NOFOLLOW``, every CRC checked) into a new directory beside
    ``prefix``, which is then swapped in; only a missing or empty directory or an
    existing save is replaced (anything else is an AtomicWriteError and nothing is
    touched). A damaged archive is a FormatError naming the member, and nothing is
    written outside that new directory.

    Examples:
        >>> _ = shared_td.TensorDict(a=torch.zeros(3)).save("data/td.tdz")
        >>> sorted(os.listdir(shared_td.unpack_memmap("data/td.tdz", "data/td")))
        ['a.memmap', 'meta.json']
    """
    source = os.path.abspath(os.fspath(archive))
    if not is_memmap_archive(source):
        raise ValueError(f"{source} is not a memory-mapped tensordict archive (a zip file "
                         f"with a saved tensordict's {fmt.META} at its root).")
    target = atomic.check_target(prefix, existsok=True)
    opened = Archive(source)
    try:
        with atomic.acquired(target):
            _sweep(target)
            staging = atomic.Staging(target)
            try:
                with Directory.open(staging.path, action="unpack an archive") as root:
                    for member in sorted(opened.members):
                        _extract(opened, member, root)
                staging.finish()
                atomic.swap_into_place(staging.path, target)
            except BaseException as error:
                staging.discard(error)
                raise
    finally:
        opened.close()
    return target


def _extract(archive: Archive, member: str, root: Directory) -> None:
    """Write ``member`` below ``root``, making its directories; never through a symlink."""
    *parents, name = member.split("/")
    opened = []
    try:
        directory = root
        for part in parents:
            if not directory.exists(part):
                directory.mkdir(part)
            directory = directory.child(part)
            opened.append(directory)
        fd = directory.open_file(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        try:
            offset = 0
            with archive._zip.open(member) as stream:
                while chunk := stream.read(_CHUNK):
                    files.pwrite_all(fd, chunk, offset, where=f"file {directory.join(name)}")
                    offset += len(chunk)
        except (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError) as error:
            raise archive.error(member, f"cannot be read: {error}") from None
        finally:
            os.close(fd)
    finally:
        for each in reversed(opened):
            each.close()
