"""Mapping whole files: one mapping per file and process, shared by all its tensors.

* A mapping covers the whole file and is made through our own descriptor
  (``/proc/self/fd/N``), so the inode we checked is the inode we map; the descriptor is
  closed right after mapping, so mapped files cost no file descriptors.
* A mapping that fails (the address space, the number of mappings or the memory
  commit is exhausted) leaves nothing open and is an ``OSError`` naming the file or
  segment, its size and the limits that may be at fault: see
  :func:`shared_td.storage.fd_mapping.map_fd`.
* This process keeps one shared mapping per inode (``(st_dev, st_ino)``, never per path:
  a file replaced by rename is a new file and gets a new mapping), so unpickling many
  leaves of one file maps it once; a file whose size changed is mapped again. A file
  opened under another name than the one it was first mapped by (moved, hard-linked)
  gets a backing of the name asked for that shares the mapping (:func:`named`).
* A :class:`FileBacking` pickles by reference (the path, and for a file with its own
  layout its inode and this machine's boot), never by value.
* Mapping by path (unpickling, ``MemoryMappedTensor.from_filename``) maps a regular file
  only: a symlink put at the path is refused, never followed, and a FIFO, socket,
  device or directory there is refused without being opened (nothing blocks): see
  :func:`open_file_backing`.

Creating and opening the files themselves is :mod:`shared_td.storage.files`.
"""

from __future__ import annotations

import errno
import os
import stat
import weakref

from shared_td.errors import FileReplacedError
from shared_td.storage.cache import MappingCache
from shared_td.storage.fd_mapping import map_fd
from shared_td.storage.replaced import replaced_since_pickled

# O_PATH opens nothing for reading or writing: no FIFO waits for a writer, no device's
# driver runs its open; a mapping opens /proc/self/fd/<fd> (the inode checked through it).
PATH_FLAGS = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC


def file_kind(mode: int) -> str | None:
    """None for a regular file, else what it is ("a FIFO", "a directory", ...)."""
    if stat.S_ISREG(mode):
        return None
    kinds = {stat.S_ISLNK: "a symlink", stat.S_ISDIR: "a directory", stat.S_ISFIFO: "a FIFO",
             stat.S_ISSOCK: "a socket", stat.S_ISCHR: "a character device", stat.S_ISBLK: "a block device"}
    return next((name for test, name in kinds.items() if test(mode)), "not a regular file")


class FileBacking:
    """One mapping of a whole file, shared by every tensor that views that file.

    Attributes: ``path`` (absolute), ``storage`` (uint8 ``UntypedStorage`` or ``None``
    for an empty file), ``nbytes`` (bytes mapped), ``shared`` (``False`` for a private
    copy-on-write mapping), ``read_only`` (``None``, or why this process may not write
    the file, e.g. "it is on a read-only file system": tensors over such a backing
    refuse writes), ``inode`` (``(st_dev, st_ino)`` of the file mapped when its
    tensors are bound to that very file, else None). ``mapped``: the ``(st_dev,
    st_ino)`` of the file mapped, always (kept on the storage for
    :func:`shared_td.storage.sending.mapped_memory`; default: the storage's, else what
    ``path`` names now). Pickles as ``(path, shared,
    read_only, inode, this machine's boot)``: the receiver maps the file again, so
    writes on either side reach the same page cache, and a read-only backing stays
    read-only.

    Which file a receiver maps: what the path names then, for a file that holds one
    leaf (a directory save's: an atomic rewrite of the prefix gives later receivers
    the new values, as a published prefix promises). A file whose leaves lie at offsets
    of its own layout (an archive, a consolidated file), or any private mapping's, is
    bound to its inode: a receiver on this machine that finds another file there (a new
    save renamed over it) raises FileReplacedError (:mod:`shared_td.storage.replaced`).
    """

    __slots__ = ("path", "storage", "nbytes", "shared", "read_only", "inode", "origin", "aliases",
                 "__weakref__")

    def __init__(self, path: str, storage, nbytes: int, shared: bool, read_only: str | None = None,
                 inode: tuple[int, int] | None = None, *, mapped: tuple[int, int] | None = None):
        self.path = path
        self.storage = storage
        self.nbytes = nbytes
        self.shared = shared
        self.read_only = read_only
        self.inode = inode
        if storage is not None:  # what a plain view pickles by (see sending.mapped_memory)
            if mapped is None:  # (a backing of a mapping made before: it has its inode)
                mapped = getattr(storage, FILE_ATTRIBUTE, (None,) * 6)[5] or inode_at(path)
            setattr(storage, FILE_ATTRIBUTE, (path, nbytes, shared, read_only, inode, mapped))
        #: the cached backing whose mapping this one shares under another name (see
        #: :func:`named`): held, so this process's cache keeps that mapping; else None
        self.origin = None
        #: the live backings made by :func:`named` that share this one's mapping under
        #: other names (a weakref.WeakSet, made with the first), for :func:`find_backing`
        self.aliases = None

    def __reduce__(self):
        inode = self.inode
        if not self.shared and self.storage is not None:  # a copy of that file: bound to it (see replaced)
            inode = inode or getattr(self.storage, FILE_ATTRIBUTE)[5]
        return _unpickle_backing, (self.path, self.shared, self.read_only, inode, boot_id())

    def __repr__(self) -> str:
        mode = "shared" if self.shared else "copy-on-write"
        if self.read_only:
            mode += ", read-only"
        return f"FileBacking({self.path!r}, nbytes={self.nbytes}, {mode})"


#: the attribute of a mapped file's storage: ``(path, nbytes, shared, read_only, inode,
#: mapped)`` of its last FileBacking (see :func:`shared_td.storage.sending.mapped_memory`)
FILE_ATTRIBUTE = "_shared_td_file"


# (st_dev, st_ino) -> FileBacking, so that unpickling many leaves of one file maps it once.
# Keyed by inode, not path: a file replaced by rename is a new file and gets a new mapping.
_CACHE = MappingCache()


def cached_backing(key: tuple[int, int]) -> FileBacking | None:
    """This process's shared mapping of the file ``key`` = ``(st_dev, st_ino)``: its
    FileBacking, or one rebuilt over the storage that only plain views hold now (kept in
    the cache while held); None if it has none."""
    backing = _CACHE.get(key)
    if backing is not None:
        return backing
    storage = _CACHE.storage(key)
    held = getattr(storage, FILE_ATTRIBUTE, None)
    if held is None:
        return None
    path, nbytes, shared, read_only, inode, mapped = held
    return _CACHE.put_if_absent(key, FileBacking(path, storage, nbytes, shared, read_only, inode, mapped=mapped))


def _keep(key: tuple[int, int], backing: FileBacking) -> None:
    """Make ``backing`` this process's shared mapping of the file ``key``."""
    _CACHE.put(key, backing)
    _CACHE.keep_storage(key, backing.storage)


def inode_at(path: str) -> tuple[int, int] | None:
    """``(st_dev, st_ino)`` of what ``path`` names (a link itself, not followed), or None."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def named(cached: FileBacking, path: str) -> FileBacking:
    """``cached`` (this process's mapping of a file) for a file opened as ``path``:
    itself when it was mapped under that name, else a backing named ``path`` that
    shares its mapping. A file moved or hard-linked since it was mapped must get the
    name asked for: a tensor records it and pickles it, and a receiver maps what that
    name holds (the old name may hold another file by then).

    Example:
        >>> first = FileBacking("/data/a.memmap", None, 0, True)
        >>> moved = named(first, "/data/c.memmap")
        >>> moved.path, moved.origin is first, named(first, "/data/a.memmap") is first
        ('/data/c.memmap', True, True)
    """
    if cached.path == path:
        return cached
    alias = FileBacking(path, cached.storage, cached.nbytes, cached.shared, cached.read_only, cached.inode)
    origin = alias.origin = cached.origin or cached
    if origin.aliases is None:
        origin.aliases = weakref.WeakSet()
    origin.aliases.add(alias)
    return alias


def same_mapping(first: FileBacking | None, second: FileBacking) -> bool:
    """Whether two backings share one mapping (one is the other, or an alias of it
    made by :func:`named` or :func:`relocated`)."""
    return first is not None and (first is second or first.storage is second.storage is not None)


def backing_from_fd(path: str, fd: int, *, shared: bool = True, read_only: str | None = None,
                    st: os.stat_result | None = None, created: bool = False, bound: bool = False) -> FileBacking:
    """Map the whole file open as ``fd`` (or reuse this process's mapping of it).

    ``read_only`` (why the file may not be written) needs ``shared=False``: the mapping
    is private, and the tensors over it refuse writes. ``st``: the ``fstat`` of ``fd``
    when the caller has just made it (:meth:`Directory.open_regular_stat`). ``created``:
    the caller made the file with ``O_EXCL``, so no mapping of it can be cached (a live
    mapping keeps its inode, whose number a new file cannot get): none is looked for.
    ``bound``: its tensors lie at offsets of this file's own layout (an archive, a
    consolidated file): pickled, they name its inode (see FileBacking).
    """
    if read_only and shared:
        raise ValueError(f"A read-only backing of {path} must be mapped copy-on-write (shared=False).")
    if st is None:
        st = os.fstat(fd)
    key = (st.st_dev, st.st_ino)
    if shared and not created:
        cached = cached_backing(key)
        # a file that changed size since is mapped again, so sizes are always current
        if cached is not None and cached.nbytes == st.st_size:
            if bound:
                cached.inode = key
            return named(cached, path)
    storage = map_fd(fd, st.st_size, shared=shared, what=path) if st.st_size else None
    backing = FileBacking(path, storage, st.st_size, shared, read_only, key if bound else None, mapped=key)
    if shared:
        # private mappings are never shared: two copy-on-write opens must not see each
        # other's private writes
        _keep(key, backing)
    return backing


def map_path_fd(path: str, fd: int, st: os.stat_result, *, read_only: str | None = None,
                shared: bool | None = None, bound: bool = False) -> FileBacking:
    """Map the regular file that the ``O_PATH`` descriptor ``fd`` names
    (:meth:`Directory.open_path_regular`, ``st`` its ``fstat``): shared and writable, or
    with ``read_only`` (why it may not be written) privately, as :func:`backing_from_fd`.
    ``shared=False`` without ``read_only`` is a private mapping this process may write
    (``from_filename(mode="r")``); ``bound`` as in :func:`backing_from_fd`.

    The file is opened for real only by the mapping itself (torch opens
    ``/proc/self/fd/<fd>``: the inode that was checked), read-write when shared. A file
    this process may not open so is an ``OSError`` with the errno of that open
    (EACCES, EROFS, EPERM...) naming ``path``, so the caller can map it read-only; a
    mapping that fails is :func:`map_fd`'s ``OSError``, naming ``path``. A
    mapping this process holds already is reused only if the file may still be written.
    """
    if shared is None:
        shared = read_only is None
    if read_only and shared:
        raise ValueError(f"A read-only backing of {path} must be mapped copy-on-write (shared=False).")
    key = (st.st_dev, st.st_ino)
    if shared:
        cached = cached_backing(key)
        if cached is not None and cached.nbytes == st.st_size and \
                os.access(f"/proc/self/fd/{fd}", os.W_OK, effective_ids=True):
            if bound:
                cached.inode = key
            return named(cached, path)
    if st.st_size:
        storage = map_fd(fd, st.st_size, shared=shared, what=path)
    else:  # nothing mapped: the file must still be openable as asked
        storage = None
        os.close(_reopen(fd, path, os.O_RDWR if shared else os.O_RDONLY))
    backing = FileBacking(path, storage, st.st_size, shared, read_only, key if bound else None, mapped=key)
    if shared:
        _keep(key, backing)
    return backing


def _reopen(fd: int, path: str, flags: int) -> int:
    """Open again the file of descriptor ``fd`` (through ``/proc/self/fd``) with
    ``flags``; an error names ``path``."""
    try:
        return os.open(f"/proc/self/fd/{fd}", flags | os.O_CLOEXEC)
    except OSError as error:
        raise type(error)(error.errno, f"{error.strerror}: {path}") from None


def mapped_backing(st: os.stat_result) -> FileBacking | None:
    """This process's shared mapping of the file that ``st`` describes, if it has one."""
    return cached_backing((st.st_dev, st.st_ino))


def find_backing(storage, filename: str | None = None) -> FileBacking | None:
    """A backing of this process's shared mapping whose storage is ``storage``, named by
    a path that names the mapped file now; None when ``storage`` is no such mapping.

    The file may have been moved since it was mapped, and its first name may hold
    another file by now: a backing is returned only if its path names the mapped inode
    (the mapping's own, or a live one that :func:`named` made), else, with no
    ``filename``, a :class:`FileReplacedError` asks for it. ``filename``: the name to
    record; it must name the mapped file (else the ``RuntimeError`` "differs").
    """
    origin = next((b for b in _CACHE.values() if b.storage is not None
                   and b.storage.data_ptr() == storage.data_ptr()), None)
    if origin is None:
        return None
    if filename is not None:
        path = os.path.abspath(filename)
        if _names_mapping(path, origin):
            return named(origin, path)
        raise RuntimeError(
            "Providing a storage with an associated filename that differs from the filename "
            f"argument is not permitted unless filename=None. Got filename={filename}, "
            f"storage.filename={origin.path} ({path} is not the file this storage maps).")
    for candidate in (origin, *(origin.aliases or ())):
        if _names_mapping(candidate.path, origin):
            return candidate
    raise FileReplacedError(errno.ENOENT, (
        f"The file this storage maps is no longer at {origin.path} (it was moved, deleted or "
        "replaced since it was mapped), and no name of it is known: pass filename= with "
        "its path now (MemoryMappedTensor.from_storage(storage, filename=...))."))


def _names_mapping(path: str, backing: FileBacking) -> bool:
    """Whether ``path`` names the file that ``backing`` maps: this process's mapping of
    the inode there is ``backing``'s (a live mapping keeps its inode, so its number is
    never another file's meanwhile). A symlink at ``path`` is not that file."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return same_mapping(cached_backing((st.st_dev, st.st_ino)), backing)


def relocated(backing: FileBacking, path: str) -> FileBacking:
    """The same mapping under the file's new name, after its directory was renamed.

    The mapped inode is unchanged, so no byte moves; this process's cache then hands
    out the new name, under the inode recorded when it was mapped (``path`` is not
    looked at: a save nested past PATH_MAX has leaf paths no system call takes).
    """
    moved = FileBacking(path, backing.storage, backing.nbytes, backing.shared, backing.read_only, backing.inode)
    if backing.shared:
        _keep(getattr(backing.storage, FILE_ATTRIBUTE)[5], moved)
    return moved


def open_file_backing(path: str, shared: bool = True, read_only: str | None = None,
                      inode: tuple[int, int] | None = None, boot: str | None = None) -> FileBacking:
    """Map the regular file at ``path``; a missing file raises ``FileNotFoundError``.
    ``read_only`` as in :func:`backing_from_fd`. ``inode``: the ``(st_dev, st_ino)``
    the file had on the machine booted as ``boot`` (a pickled FileBacking's); this
    process's mapping of that inode is reused, and on that machine another file at
    ``path`` is a FileReplacedError.

    Anything but a regular file at ``path`` is an ``OSError`` naming it and what it is
    (a symlink: ``ELOOP``, a directory: ``IsADirectoryError``, a FIFO, socket or device:
    ``ENODEV``, as mmap says), found without opening it: see :func:`_open_regular_path`.

    Example:
        >>> import tempfile
        >>> with tempfile.NamedTemporaryFile() as f:
        ...     _ = f.write(b"abcd"); f.flush()
        ...     open_file_backing(f.name).nbytes
        4
    """
    return _open_backing(path, shared, read_only, inode, boot, pickled=False)


def _unpickle_backing(path: str, shared: bool, read_only: str | None,
                      inode: tuple[int, int] | None, boot: str | None) -> FileBacking:
    """A pickled :class:`FileBacking` in the receiving process: :func:`open_file_backing`,
    where anything but a regular file at ``path`` is a :class:`FileReplacedError` (the
    sender mapped a regular file there, so someone put this in its place)."""
    return _open_backing(path, shared, read_only, inode, boot, pickled=True)


#: open(O_RDWR) fails so on a file that can be read but not written (its mode or ACL,
#: a read-only file system, an immutable file): such a file is mapped copy-on-write,
#: read-only, where a load (or a receiver) may, and its tensors' errors say why, in
#: these words.
READ_ONLY_ERRNOS = {
    errno.EROFS: "it is on a read-only file system",
    errno.EACCES: "this process has no permission to write it (its mode or ACL)",
    errno.EPERM: "this process may not write it (an immutable or append-only file)",
}


def _open_backing(path, shared, read_only, inode, boot, *, pickled: bool) -> FileBacking:
    checked = inode is not None and boot is not None and boot == boot_id()
    if shared:
        # Unpickling many leaves of files this process maps already (attach, workers)
        # needs no descriptor: a stat names the inode, and the cache has its mapping
        # (of the pickled inode: this process's own tensors keep their file when a new
        # one was renamed over its path). lstat, not stat: a symlink put at ``path``
        # must not lead to this process's mapping of the file it points to.
        st = os.lstat(path)
        here = (st.st_dev, st.st_ino)
        cached = cached_backing(tuple(inode) if checked else here)
        # (the size is the path's file's: of no meaning for a mapping of the old inode)
        if cached is not None and (cached.nbytes == st.st_size or (checked and tuple(inode) != here)):
            return named(cached, path)
    fd, st = _open_regular_path(path, pickled)
    try:
        if checked and (st.st_dev, st.st_ino) != tuple(inode):
            raise replaced_since_pickled(path, shared)
        try:
            return map_path_fd(path, fd, st, read_only=read_only, shared=shared, bound=inode is not None)
        except OSError as error:
            if not (pickled and shared and error.errno in READ_ONLY_ERRNOS):
                raise
            # a file this process may read but not write (made read-only since the sender
            # mapped it, or not this user's): mapped read-only, as load_memmap maps it, so
            # that a reader works and a write raises a ReadOnlyError saying why (a bare
            # MappingError "Cannot open ...: Permission denied" failed the unpickle)
            return map_path_fd(path, fd, st, read_only=READ_ONLY_ERRNOS[error.errno], bound=inode is not None)
    finally:
        os.close(fd)


def _open_regular_path(path: str, pickled: bool) -> tuple[int, os.stat_result]:
    """An ``O_PATH`` descriptor of the regular file ``path`` and its ``fstat``; the
    caller closes it. Anything else is refused without being opened: a FIFO, socket or
    device (mapping it could block for ever, or run a driver), a directory, and a
    symlink as the last component of ``path``.

    Only the last component must not be a link (``O_NOFOLLOW``): the directories above
    are the user's own path, which may legitimately run through a symlink (a prefix
    that is a link to a data disk, ``/tmp`` on some systems; a loaded leaf records the
    prefix as the user gave it), so a link there cannot be told from a legitimate one.
    ``MemoryMappedTensor.from_filename`` records the resolved path (``realpath``), so
    that its path never ends in a link.
    """
    fd = os.open(path, PATH_FLAGS)  # (its errors name the path)
    try:
        st = os.fstat(fd)
    except BaseException:
        os.close(fd)
        raise
    if stat.S_ISREG(st.st_mode):
        return fd, st
    os.close(fd)
    raise _not_regular_error(path, st.st_mode, pickled)


def _not_regular_error(path: str, mode: int, pickled: bool) -> OSError:
    """The error for ``path``, which holds ``mode``'s kind of file and not a regular file."""
    kind = file_kind(mode)
    if pickled:
        return FileReplacedError(errno.ENOENT, (
            f"The file a pickled tensor maps is now {kind}, not a regular file: {path}. "
            "Refused without being opened (a symlink would send this process's writes into "
            "the file it names, a FIFO or device could block): whoever can write that "
            "directory put it there. Remove it and save the tensor again."))
    code = {"a symlink": errno.ELOOP, "a directory": errno.EISDIR}.get(kind, errno.ENODEV)
    # OSError(code, ...) is the errno's subclass (IsADirectoryError for EISDIR)
    return OSError(code, f"Cannot map {path}: it is {kind}, not a regular file (only a "
                         "regular file can be memory-mapped; refused without opening it).")


def boot_id() -> str | None:
    """This machine's boot id (device and inode numbers mean the same files only within
    one boot of one machine); None where the kernel does not tell."""
    global _BOOT_ID
    if _BOOT_ID is _UNREAD:
        try:
            with open("/proc/sys/kernel/random/boot_id") as source:
                _BOOT_ID = source.read().strip()
        except OSError:
            _BOOT_ID = None
    return _BOOT_ID


_UNREAD = object()
_BOOT_ID: object = _UNREAD
