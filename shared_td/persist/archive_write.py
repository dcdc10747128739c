"""Writing archives: a tree or a directory save zipped into one file, atomically; an
archive extracted into a directory save. The format, and how archives are read, is in
``persist.archive``.

A tree is zipped straight from memory: the engine's planner names every file and builds
every meta.json (and pickle) first, as for a directory, then each member is streamed
from its tensor into the zip, with no file per leaf on the way. The zip is written to a
temporary file ``.<name>.shared_td-new-<pid>-<random>`` beside the target (the name of
an atomic writer's leftovers, which gc removes once ``<pid>`` is dead) and renamed over
the target under its writer lock.
"""
from __future__ import annotations

import errno
import os
import stat
import struct
import time
import warnings
import zipfile
from typing import Any, Callable, Iterable

from shared_td.errors import FormatError
from shared_td.persist import atomic
from shared_td.persist import format as fmt
from shared_td.persist.archive import (
    ALIGNMENT, ARCHIVE_SUFFIX, ZIP_STARTS, Archive, check_compression, name_problem, open_regular_file,
)
from shared_td.persist.bounded_reads import MAX_META_BYTES
from shared_td.persist.planner import NodePlan, Options, Planner
from shared_td.persist.writer import node_files
from shared_td.storage import files
from shared_td.storage.fd_mapping import mapping_limits
from shared_td.storage.files import Directory, NO_SPACE_ERRNOS, storage_full_error

_PAD_EXTRA_ID = 0x6474  # b"td", tensordict's id for the padding block
_LOCAL_HEADER_SIZE = 30
_ZIP64_LOCAL_EXTRA = 20  # what zipfile adds to a local header under force_zip64=True
_CHUNK = 16 << 20
_ZEROS = memoryview(bytes(1 << 20))


class Members:
    """Adds members to a zip being written: payloads (``*.memmap``) aligned and stored,
    or compressed with ``compress_type``; every other member stored."""

    def __init__(self, zf: zipfile.ZipFile, compress_type: int):
        self.zf, self.compress_type = zf, compress_type
        self.written = 0  # bytes of members added so far
        self.pending = 0  # bytes of the member being added
        self.total: int | None = None  # bytes of all members, when known before the first

    def needed(self) -> int:
        """The bytes the members need (zip headers aside), for a full disk's message:
        all of them when known, else at least what is written and the current member."""
        return max(self.total or 0, self.written + self.pending)

    def add(self, name: str, size: int, chunks: Iterable) -> None:
        check_member_name(name)
        payload = name.endswith(fmt.LEAF_SUFFIX)
        self.pending = size
        _write_member(self.zf, name, size, chunks, self.compress_type if payload else zipfile.ZIP_STORED)
        self.written, self.pending = self.written + size, 0


def check_member_name(name: str, key: Any = None) -> None:
    """A ValueError naming ``name`` (and the key it stores) if it cannot be a member."""
    problem = name_problem(name)
    if problem is None:
        return
    if key is not None:
        raise ValueError(f"The key {key!r} cannot be saved in an archive: its file name {name!r} "
                         f"has {problem}. Rename the key, or save to a directory (archive=False).")
    raise ValueError(f"The file {name!r} cannot be a member of an archive: its name has "
                     f"{problem}. Rename it (or save with robust_key=True).")


def _padding(header_offset: int, name: str) -> bytes:
    """The extra field that puts the payload of a member at ``header_offset`` on an
    ALIGNMENT boundary (zipfile appends its 20-byte zip64 block after it)."""
    start = header_offset + _LOCAL_HEADER_SIZE + len(name.encode("utf-8")) + 4 + _ZIP64_LOCAL_EXTRA
    pad = -start % ALIGNMENT
    return struct.pack("<HH", _PAD_EXTRA_ID, pad) + bytes(pad)


def _write_member(zf: zipfile.ZipFile, name: str, size: int, chunks: Iterable, compress_type: int) -> None:
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
        written = 0
        for chunk in chunks:
            out.write(chunk)
            written += len(chunk)
        if written != size:
            raise RuntimeError(f"{name} changed size while it was put in the archive "
                               f"({written} bytes instead of {size}).")


def _out_of_memory(action: str) -> MemoryError:
    """The MemoryError of a piece that this process could not allocate to ``action``:
    a bare one said nothing of what was read or of the limit (RLIMIT_AS) that refused it."""
    return MemoryError(f"Cannot {action} in pieces of up to {_CHUNK >> 20} MiB: out of memory. This process may "
                       f"have reached a limit: {mapping_limits(False)}. Raise it (`ulimit -v`, "
                       "resource.setrlimit(resource.RLIMIT_AS, ...)) or free memory; nothing changed at the "
                       "destination.")


def _file_chunks(fd: int, size: int, path: str):
    """The bytes of the file ``path`` open as ``fd``, in pieces."""
    done = 0
    while done < size:
        try:
            chunk = os.pread(fd, min(_CHUNK, size - done), done)
        except MemoryError:
            raise _out_of_memory(f"read {path} to put it in the archive") from None
        if not chunk:
            return
        yield chunk
        done += len(chunk)


def _view_chunks(view: memoryview):
    for start in range(0, len(view), _CHUNK):
        yield view[start:start + _CHUNK]


def _zero_chunks(size: int):
    while size:
        chunk = _ZEROS[:min(size, len(_ZEROS))]
        yield chunk
        size -= len(chunk)


# ------------------------------------------------------------------ what goes in
def plan_tree(obj: Any, *, like: bool, robust_key: bool | None, where: str) -> list[tuple]:
    """The members of ``obj`` saved as a directory would be, planned by the engine (keys
    checked, files named, every meta.json and pickle built) and every member name
    checked: nothing is written, so a refusal leaves nothing on disk. ``where`` names
    the archive in the planner's messages. :func:`add_tree` writes them."""
    options = Options(prefix=where, inplace=False, like=like, copy_existing=True,
                      robust_key=True if robust_key is None else bool(robust_key))
    root = Planner(options, fresh_root=True).plan(obj)  # fresh: nothing on disk is looked at
    built = {id(node): node_files(node) for node in root.walk()}
    planned = list(_node_members(root, built, "", (), like=like))
    for name, _, _, key in planned:
        check_member_name(name, key)
    return planned


def planned_pickles(planned: list[tuple]) -> dict[str, bytes]:
    """The side files (pickles) among the members :func:`plan_tree` planned, by member
    name: the bytes this call made from the caller's own objects, which a load of the
    archive just written takes instead of the archive's (never unpickled from a file)."""
    side = (fmt.OTHER_PICKLE, fmt.STACK_PICKLE)
    return {name: b"".join(chunks()) for name, _, chunks, _ in planned
            if name.rpartition("/")[2] in side}


def add_tree(members: Members, planned: list[tuple]) -> None:
    """Add the members :func:`plan_tree` planned, each payload streamed from its tensor
    (zeros for ``like``); their total is known first, for a full disk's message."""
    members.total = members.written + sum(size for _, size, _, _ in planned)
    for name, size, chunks, _ in planned:
        members.add(name, size, chunks())


def _node_members(node: NodePlan, built: dict, at: str, keys: tuple, *, like: bool):
    """``(member name, size, chunks factory, key)`` for the node and its descendants, in
    tensordict's order; the key is the nested key the member stores (its node's for
    meta.json and pickles)."""
    document, side = built[id(node)]
    node_key = keys if len(keys) != 1 else keys[0]
    named: dict[str, Any] = {name: (value, node_key) for name, value in side.items()}
    for key, leaf in node.leaves.items():
        if leaf.source.numel():  # an empty leaf has no file, as in the directory layout
            named[os.path.basename(leaf.path)] = (leaf, keys + (key,) if keys else key)
    yield at + fmt.META, len(document), (lambda: [document]), node_key
    for name in sorted(named):
        value, key = named[name]
        if isinstance(value, bytes):
            yield at + name, len(value), (lambda value=value: [value]), key
        else:
            size = value.source.numel() * value.source.element_size()
            yield at + name, size, (lambda leaf=value, size=size: _leaf_chunks(leaf, size, like)), key
    for key, child in sorted(node.children.items(), key=lambda item: os.path.basename(item[1].directory)):
        yield from _node_members(child, built, f"{at}{os.path.basename(child.directory)}/",
                                 keys + (key,), like=like)


def _leaf_chunks(leaf: Any, size: int, like: bool):
    # the CPU copy (of a leaf on another device) is made when its member is written
    return _zero_chunks(size) if like else _view_chunks(files.tensor_bytes(leaf.source.cpu()))


def add_directory(members: Members, directory: Directory, at: str = "") -> None:
    """The files below the directory save ``directory``: meta.json first at each level,
    then the other files, then each sub-directory (tensordict's order). Never through a
    symlink; a killed writer's temporaries are left out; anything but a file or a
    directory is refused."""
    names = sorted(os.listdir(directory.fd))
    kinds = {name: directory.lstat(name) for name in names}
    regular = [n for n in names if kinds[n] is not None and stat.S_ISREG(kinds[n].st_mode)
               and fmt.temporary_writer_pid(n) is None]
    for name in sorted(regular, key=lambda n: n != fmt.META):
        fd = directory.open_regular(name)
        try:
            size = os.fstat(fd).st_size
            members.add(at + name, size, _file_chunks(fd, size, directory.join(name)))
        finally:
            os.close(fd)
    for name in _subdirectories(directory, names, kinds):
        with directory.child(name) as child:
            add_directory(members, child, f"{at}{name}/")


def save_size(directory: Directory) -> int:
    """The bytes of the files :func:`add_directory` puts in an archive (before the first:
    what a full disk's message names)."""
    names = sorted(os.listdir(directory.fd))
    kinds = {name: directory.lstat(name) for name in names}
    total = sum(st.st_size for name, st in kinds.items() if st is not None and stat.S_ISREG(st.st_mode)
                and fmt.temporary_writer_pid(name) is None)
    for name in _subdirectories(directory, names, kinds):
        with directory.child(name) as child:
            total += save_size(child)
    return total


def _subdirectories(directory: Directory, names: list, kinds: dict) -> list[str]:
    """The sub-directories among ``names``; a symlink or a special file is refused."""
    found = []
    for name in names:
        st = kinds[name]
        if st is None or stat.S_ISREG(st.st_mode):
            continue
        if stat.S_ISLNK(st.st_mode):
            raise RuntimeError(f"Refusing to put a symlink in an archive: {directory.join(name)}.")
        if not stat.S_ISDIR(st.st_mode):
            raise FormatError(directory.join(name), f"{files.file_kind(st.st_mode)} in a save: "
                              "only files and directories can be put in an archive")
        found.append(name)
    return found


# ------------------------------------------------------------------ atomic write
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
    if not existsok:  # (first: any file there is tensordict's RuntimeError)
        _refuse_existing(target)
    try:
        _refuse_special(target, os.lstat(target))
    except FileNotFoundError:
        pass
    return target


def _refuse_special(target: str, found: os.stat_result | None) -> None:
    """An OSError (EEXIST) when what is at ``target`` (``found``: its lstat) is no
    regular file: a FIFO, socket or device is never replaced (the archive renamed over
    it removed it: ``/dev/null`` for a root writer), as ``consolidate(filename=)``."""
    if found is not None and not stat.S_ISREG(found.st_mode):
        raise OSError(errno.EEXIST, f"Cannot write an archive at {target}: it is "
                      f"{files.file_kind(found.st_mode)}, which an archive write would replace. Remove it, "
                      "or write the archive elsewhere.")


def _refuse_existing(target: str) -> None:
    if os.path.lexists(target):
        raise RuntimeError(f"A file already exists at {target}, cannot save the tensordict there. "
                           "Set existsok=True to overwrite.")


def write_archive(target: str, fill: Callable[[Members], None], compression: Any = None, *,
                  existsok: bool = True, then: Callable[[int], Any] | None = None) -> Any:
    """Write the archive ``target`` atomically: ``fill(members)`` adds its members to a
    new temporary file beside it, which is then renamed over it, under its writer lock.
    On any failure ``target`` is left as it was and the temporary file removed (after a
    SIGKILL: by the next writer or gc). The new file keeps an old one's mode.

    ``existsok=False``: an existing ``target`` is a RuntimeError, checked under the lock
    (another writer may have saved there since the caller's check). ``then()`` runs after
    the rename, still under the lock, and its value is returned: ``then(fd)`` gets the
    written file still open (read-write), and must read it through ``fd``, never by
    ``target``'s name: the lock only orders shared_td's writers, and any other process
    (tensordict, ``mv``, ``cp``) may have renamed its own file over ``target`` since."""
    compress_type = check_compression(compression)
    parent, name = os.path.split(target)
    os.makedirs(parent, exist_ok=True)
    with atomic.acquired(target), Directory.open(parent) as directory:
        if not existsok:
            _refuse_existing(target)
        _refuse_special(target, directory.lstat(name))  # (again: it may have come since the check)
        _sweep(target)
        temporary, fd = _new_temporary(directory, name)
        members = None
        try:
            try:
                with open(fd, "wb", closefd=False) as stream, \
                        zipfile.ZipFile(stream, "w", allowZip64=True) as zf:
                    members = Members(zf, compress_type)
                    fill(members)
                old = directory.lstat(name)
                if old is not None and stat.S_ISREG(old.st_mode):
                    os.fchmod(fd, stat.S_IMODE(old.st_mode))
                directory.replace(temporary, name)
            except BaseException as error:
                directory.unlink(temporary)
                if isinstance(error, OSError) and error.errno in NO_SPACE_ERRNOS:
                    needed = members.needed() if members is not None else 0
                    compressed = "; before compression" if compress_type != zipfile.ZIP_STORED else ""
                    raise storage_full_error(error, needed, (
                        f"the archive {target} (the size of its members, zip headers aside{compressed}; "
                        f"written as {temporary})")) from error
                raise
            return then(fd) if then is not None else None
        finally:
            os.close(fd)


def _new_temporary(directory: Directory, name: str) -> tuple[str, int]:
    """A new file ``.<name>.shared_td-new-<pid>-<random>`` in ``directory``, opened."""
    for _ in range(100):
        temporary = atomic.temporary_name(name)
        try:
            # read-write: the caller's then(fd) loads the archive through this descriptor
            return temporary, directory.open_file(temporary, os.O_RDWR | os.O_CREAT | os.O_EXCL)
        except FileExistsError:
            continue
        except PermissionError as error:  # the lock file was there already: a bare EACCES
            raise atomic.parent_not_writable(error, directory.join(temporary)) from None
    raise FileExistsError(errno.EEXIST, f"No unused temporary name .{name}.shared_td-new-* in {directory.path}")


def _sweep(target: str) -> None:
    """Remove the temporaries of dead writers of ``target`` (under its lock)."""
    try:
        atomic.sweep_leftovers(target)
    except OSError as error:  # what dead writers left does not stop this one
        warnings.warn(str(error), RuntimeWarning, stacklevel=4)


def pack_memmap(prefix: Any, archive: Any = None, compression: Any = None) -> str:
    """Zip the directory save ``prefix`` into the archive ``archive`` (default
    ``<prefix>.tdz``), atomically; returns the archive's path. Payloads are stored
    aligned, or compressed with ``compression`` (see ``archive.check_compression``).

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

    def fill(members: Members) -> None:
        with Directory.open(prefix, action="put in an archive") as directory:
            members.total = save_size(directory)  # what a full disk's message names
            add_directory(members, directory)

    write_archive(target, fill, compression)
    return target


def unpack_memmap(archive: Any, prefix: Any) -> str:
    """Extract the archive ``archive`` into the directory save ``prefix``; returns it.

    Atomic as ``memmap_(prefix, atomic=True)``: the members are written (through
    ``openat``/``O_NOFOLLOW``, every CRC checked) into a new directory beside
    ``prefix``, which is then swapped in; only a missing or empty directory or an
    existing save is replaced (anything else is an AtomicWriteError and nothing is
    touched), and never the directory holding the archive itself (a ValueError). The
    archive is opened once: a damaged one is a FormatError naming the member (as
    load_memmap's), and nothing is written outside that new directory.

    Examples:
        >>> _ = shared_td.TensorDict(a=torch.zeros(3)).save("data/td.tdz")
        >>> sorted(os.listdir(shared_td.unpack_memmap("data/td.tdz", "data/td")))
        ['a.memmap', 'meta.json']
    """
    source = os.path.abspath(os.fspath(archive))
    opened = _open_save_archive(source)  # opened once: what is checked is what is extracted
    try:
        target = atomic.check_target(prefix, existsok=True)
        real, into = os.path.realpath(source), os.path.realpath(target)
        if real == into or real.startswith(into + os.sep):
            # the swap would replace (delete) the directory holding the archive it extracts
            raise ValueError(f"Cannot unpack {source} into {target}: the archive lies inside "
                             "that directory, which the extraction replaces. Unpack it elsewhere, "
                             "or move the archive out first.")
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


def _open_save_archive(source: str) -> Archive:
    """The archive ``source``, opened once and checked: a ValueError if it is no zip
    file holding a save at its root; a damaged archive's FormatError (naming the member)
    as it is."""
    def not_one(why: str) -> ValueError:
        return ValueError(f"{source} is not a memory-mapped tensordict archive (a zip file "
                          f"with a saved tensordict's {fmt.META} at its root): {why}.")

    try:
        fd = open_regular_file(source, os.O_RDONLY)
    except FormatError as error:  # a directory, FIFO, device...
        raise not_one(error.detail) from None
    except FileNotFoundError:
        raise not_one("there is no such file") from None
    try:
        if os.pread(fd, 4, 0) not in ZIP_STARTS:
            raise not_one("it is not a zip file")
    except BaseException:
        os.close(fd)
        raise
    opened = Archive(source, fd=fd)  # a damaged index: FormatError naming the member
    try:
        if fmt.META in opened.members:  # damaged (its CRC) or too big: FormatError, not "no save"
            opened.read(fmt.META, limit=MAX_META_BYTES)
        why = opened.not_a_save()
        if why is not None:
            raise not_one(why)
    except BaseException:
        opened.close()
        raise
    return opened


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
            # in bounded pieces, never past the size its header announces (a member that
            # holds more is a FormatError at the first byte too many), its CRC checked
            offset = 0
            try:
                for chunk in archive.pieces(member, _CHUNK):
                    files.pwrite_all(fd, chunk, offset, where=f"file {directory.join(name)}")
                    offset += len(chunk)
            except MemoryError:
                raise _out_of_memory(f"read the member {member!r} of the archive {archive.path} to "
                                     "unpack it") from None
        finally:
            os.close(fd)
    finally:
        for each in reversed(opened):
            each.close()
