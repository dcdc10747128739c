"""File storage for memory-mapped tensors: create, write, map and size-check files.

Rules this module enforces:

* A file is created with ``O_CREAT | O_EXCL`` and is never written through a symlink:
  it is opened relative to an opened :class:`Directory` with ``O_NOFOLLOW``, so a
  directory renamed or replaced by a symlink meanwhile never redirects it.
* Bytes are written with ``pwrite`` into the page cache *before* the file is mapped:
  that is several times faster than first-touch faults through a fresh mapping.
* A file only ever grows: an existing longer file keeps its tail, and nothing here
  truncates a file that another process may have mapped (a shrink would SIGBUS it).
* A mapping covers the whole file and is made through our own descriptor
  (``/proc/self/fd/N``), so the inode we checked is the inode we map; the descriptor is
  closed right after mapping, so mapped files cost no file descriptors.
* Mapping checks sizes first: a missing file is a ``FileNotFoundError`` (never created),
  a short one a :class:`FileTooShortError` -- never a SIGBUS on first access.
* Zero-byte requests never create or map anything (``mmap`` of 0 bytes is invalid).
"""

from __future__ import annotations

import errno
import os
import stat

import torch

from shared_td.errors import FileReplacedError, FileTooShortError, FormatError, StorageFullError
from shared_td.storage.cache import InodeCache
from shared_td.storage.removal import remove_tree

__all__ = [
    "FileBacking",
    "Directory",
    "FileTooShortError",
    "StorageFullError",
    "allocate",
    "create_file",
    "find_backing",
    "map_fd",
    "open_file_backing",
    "pwrite_all",
    "tensor_bytes",
]

# One pwrite moves at most ~2 GiB on Linux; smaller calls also keep memory views short.
_WRITE_CHUNK = 1 << 30
#: errnos that mean "no room": reported as StorageFullError with the size asked for
NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.ENOMEM, errno.EFBIG)


def _size_text(nbytes: int) -> str:
    return f"{nbytes} bytes ({nbytes / 2**20:.1f} MiB)"


def storage_full_error(err: OSError, nbytes: int, where: str) -> StorageFullError:
    """Turn an ``ENOSPC``-like ``OSError`` into a :class:`StorageFullError` naming the size."""
    return StorageFullError(
        err.errno,
        f"Could not reserve {_size_text(nbytes)} for {where}: {err.strerror}. "
        "Free space there, or raise the limit (for containers: --shm-size / memory limit).",
    )


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """Return the raw C-order bytes of a CPU tensor as a ``memoryview`` (copying only if needed).

    Example:
        >>> len(tensor_bytes(torch.arange(3, dtype=torch.int16)))
        6
    """
    return memoryview(raw_bytes(tensor).numpy())


def raw_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The C-order bytes of a CPU tensor as a 1-d uint8 tensor (a view when possible).

    Example:
        >>> raw_bytes(torch.tensor([1, 2], dtype=torch.int16)).tolist()
        [1, 0, 2, 0]
    """
    # reshape(-1) first: a 0-dim tensor cannot be viewed as another dtype
    flat = tensor.detach().resolve_conj().resolve_neg().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    return flat.view(torch.uint8)


def pwrite_all(fd: int, data, offset: int, *, where: str = "a file") -> None:
    """Write all of ``data`` at ``offset`` of ``fd``, looping over short writes.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryFile() as f:
        ...     pwrite_all(f.fileno(), b"abc", 0)
        ...     os.pread(f.fileno(), 3, 0)
        b'abc'
    """
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        try:
            done += os.pwrite(fd, view[done : done + _WRITE_CHUNK], offset + done)
        except OSError as err:
            if err.errno in NO_SPACE_ERRNOS:
                raise storage_full_error(err, len(view), where) from err
            raise


def map_fd(fd: int, nbytes: int, *, shared: bool = True):
    """Map the first ``nbytes`` of the open file ``fd`` as one uint8 ``UntypedStorage``.

    ``shared=False`` gives a private copy-on-write mapping. torch opens the file again
    (through ``/proc/self/fd``) and closes that second descriptor once mapped; the caller
    still owns ``fd``. The caller must have checked that the file holds ``nbytes``.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryFile() as f:
        ...     _ = f.write(b"\\x01\\x02"); f.flush()
        ...     map_fd(f.fileno(), 2).tolist()
        [1, 2]
    """
    mapped = torch.from_file(f"/proc/self/fd/{fd}", shared=shared, size=nbytes, dtype=torch.uint8)
    return mapped.untyped_storage()


class FileBacking:
    """One mapping of a whole file, shared by every tensor that views that file.

    Attributes: ``path`` (absolute), ``storage`` (uint8 ``UntypedStorage`` or ``None``
    for an empty file), ``nbytes`` (bytes mapped), ``shared`` (``False`` for a private
    copy-on-write mapping), ``read_only`` (``None``, or why this process may not write
    the file, e.g. "it is on a read-only file system": tensors over such a backing
    refuse writes), ``inode`` (``(st_dev, st_ino)`` of the file mapped when its
    tensors are bound to that very file, else None). Pickles as ``(path, shared,
    read_only, inode, this machine's boot)``: the receiver maps the file again, so
    writes on either side reach the same page cache, and a read-only backing stays
    read-only.

    Which file a receiver maps: what the path names then, for a file that holds one
    leaf (a directory save's: an atomic rewrite of the prefix gives later receivers
    the new values, as a published prefix promises). A file whose leaves lie at offsets
    of its own layout (an archive, a consolidated file) is bound to its inode: a
    receiver on this machine that finds another file there (a new save renamed over
    it) raises FileReplacedError; it read the new file's bytes at the old offsets.
    """

    __slots__ = ("path", "storage", "nbytes", "shared", "read_only", "inode", "__weakref__")

    def __init__(self, path: str, storage, nbytes: int, shared: bool, read_only: str | None = None,
                 inode: tuple[int, int] | None = None):
        self.path = path
        self.storage = storage
        self.nbytes = nbytes
        self.shared = shared
        self.read_only = read_only
        self.inode = inode

    def __reduce__(self):
        return open_file_backing, (self.path, self.shared, self.read_only, self.inode, boot_id())

    def __repr__(self) -> str:
        mode = "shared" if self.shared else "copy-on-write"
        if self.read_only:
            mode += ", read-only"
        return f"FileBacking({self.path!r}, nbytes={self.nbytes}, {mode})"


# (st_dev, st_ino) -> FileBacking, so that unpickling many leaves of one file maps it once.
# Keyed by inode, not path: a file replaced by rename is a new file and gets a new mapping.
_CACHE = InodeCache()


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
        cached = _CACHE.get(key)
        # a file that changed size since is mapped again, so sizes are always current
        if cached is not None and cached.nbytes == st.st_size:
            if bound:
                cached.inode = key
            return cached
    storage = map_fd(fd, st.st_size, shared=shared) if st.st_size else None
    backing = FileBacking(path, storage, st.st_size, shared, read_only, key if bound else None)
    if shared:
        # private mappings are never shared: two copy-on-write opens must not see each
        # other's private writes
        _CACHE.put(key, backing)
    return backing


_PATH_FLAGS = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC


def map_path_fd(path: str, fd: int, st: os.stat_result, *, read_only: str | None = None) -> FileBacking:
    """Map the regular file that the ``O_PATH`` descriptor ``fd`` names
    (:meth:`Directory.open_path_regular`, ``st`` its ``fstat``): shared and writable, or
    with ``read_only`` (why it may not be written) privately, as :func:`backing_from_fd`.

    The file is opened for real only by the mapping itself (torch opens
    ``/proc/self/fd/<fd>``: the inode that was checked), read-write when shared. A file
    this process may not open so is an ``OSError`` with the errno of that open
    (EACCES, EROFS, EPERM...) naming ``path``, so the caller can map it read-only. A
    mapping this process holds already is reused only if the file may still be written.
    """
    shared = read_only is None
    if shared:
        cached = _CACHE.get((st.st_dev, st.st_ino))
        if cached is not None and cached.nbytes == st.st_size and \
                os.access(f"/proc/self/fd/{fd}", os.W_OK, effective_ids=True):
            return cached
    try:
        storage = map_fd(fd, st.st_size, shared=shared) if st.st_size else None
    except RuntimeError:
        # torch's error has no errno: open the file as it did to get one (an error path)
        probe = _reopen(fd, path, os.O_RDWR if shared else os.O_RDONLY)
        os.close(probe)
        raise
    if not st.st_size:  # nothing mapped: the file must still be openable as asked
        os.close(_reopen(fd, path, os.O_RDWR if shared else os.O_RDONLY))
    backing = FileBacking(path, storage, st.st_size, shared, read_only)
    if shared:
        _CACHE.put((st.st_dev, st.st_ino), backing)
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
    return _CACHE.get((st.st_dev, st.st_ino))


def find_backing(storage) -> FileBacking | None:
    """The shared FileBacking of this process whose storage is ``storage``, if any."""
    backings = _CACHE.values()
    return next((b for b in backings if b.storage is not None
                 and b.storage.data_ptr() == storage.data_ptr()), None)


def relocated(backing: FileBacking, path: str) -> FileBacking:
    """The same mapping under the file's new name, after its directory was renamed.

    The mapped inode is unchanged, so no byte moves; this process's cache then hands
    out the new name.
    """
    moved = FileBacking(path, backing.storage, backing.nbytes, backing.shared, backing.read_only, backing.inode)
    if backing.shared:
        st = os.stat(path)
        _CACHE.put((st.st_dev, st.st_ino), moved)
    return moved


def open_file_backing(path: str, shared: bool = True, read_only: str | None = None,
                      inode: tuple[int, int] | None = None, boot: str | None = None) -> FileBacking:
    """Map an existing file by path; a missing file raises ``FileNotFoundError``.
    ``read_only`` as in :func:`backing_from_fd`. ``inode``: the ``(st_dev, st_ino)``
    the file had on the machine booted as ``boot`` (a pickled FileBacking's); this
    process's mapping of that inode is reused, and on that machine another file at
    ``path`` is a FileReplacedError.

    Example:
        >>> import tempfile
        >>> with tempfile.NamedTemporaryFile() as f:
        ...     _ = f.write(b"abcd"); f.flush()
        ...     open_file_backing(f.name).nbytes
        4
    """
    checked = inode is not None and boot is not None and boot == boot_id()
    if shared:
        # Unpickling many leaves of files this process maps already (attach, workers)
        # needs no descriptor: a stat names the inode, and the cache has its mapping
        # (of the pickled inode: this process's own tensors keep their file when a new
        # one was renamed over its path)
        st = os.stat(path)
        here = (st.st_dev, st.st_ino)
        cached = _CACHE.get(tuple(inode) if checked else here)
        # (the size is the path's file's: of no meaning for a mapping of the old inode)
        if cached is not None and (cached.nbytes == st.st_size or (checked and tuple(inode) != here)):
            return cached
    flags = (os.O_RDWR if shared else os.O_RDONLY) | os.O_CLOEXEC
    fd = os.open(path, flags)
    try:
        st = os.fstat(fd)
        if checked and (st.st_dev, st.st_ino) != tuple(inode):
            raise FileReplacedError(errno.ENOENT, (
                f"The file a pickled tensor maps was replaced since it was pickled (a save, "
                f"consolidate or atomic rewrite put a new file there): {path}. Its old bytes are "
                "no longer reachable by this path; pickle the tensor again (or load the new file)."))
        return backing_from_fd(path, fd, shared=shared, read_only=read_only, st=st, bound=inode is not None)
    finally:
        os.close(fd)


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


def file_kind(mode: int) -> str | None:
    """None for a regular file, else what it is ("a FIFO", "a directory", ...)."""
    if stat.S_ISREG(mode):
        return None
    kinds = {stat.S_ISLNK: "a symlink", stat.S_ISDIR: "a directory", stat.S_ISFIFO: "a FIFO",
             stat.S_ISSOCK: "a socket", stat.S_ISCHR: "a character device", stat.S_ISBLK: "a block device"}
    return next((name for test, name in kinds.items() if test(mode)), "not a regular file")


def _join(directory: str, name: str) -> str:
    """``os.path.join`` of a directory path and one file name (no separator in it), at
    the cost of one concatenation: a load joins one per node and leaf."""
    return directory + name if not directory or directory.endswith("/") else directory + "/" + name


class Directory:
    """An open directory: every name below it is resolved relative to its descriptor.

    A path string is looked up again at each use, so another process that renames a
    directory, or puts a symlink in its place, between a check and the use sends the
    bytes elsewhere. A Directory is opened once; its files and sub-directories are
    opened through ``dir_fd`` with ``O_NOFOLLOW``, so nothing below it follows a symlink
    or is looked up twice. ``path`` only names things (errors, the file names that
    mapped tensors record; a child's is joined only when asked for); ``action``
    ("write memory-mapped tensor", "load") words the symlink refusals. The caller
    closes it (``with`` or :meth:`close`).
    """

    __slots__ = ("fd", "action", "_parent", "_name", "_path")

    def __init__(self, fd: int, path: str | None, action: str = "write memory-mapped tensor",
                 *, parent: "Directory | None" = None, name: str = ""):
        self.fd = fd
        self.action = action
        self._path = path  # None: joined from parent's path and name when first needed
        self._parent = parent
        self._name = name

    @property
    def path(self) -> str:
        if self._path is None:
            self._path = _join(self._parent.path, self._name)
            self._parent = None
        return self._path

    @classmethod
    def open(cls, path: str, *, action: str = "write memory-mapped tensor", create: bool = False) -> "Directory":
        """Open the directory ``path`` (a caller's own path: symlinks in it are followed),
        creating it and its parents first when ``create``."""
        if create:
            os.makedirs(path, mode=0o777, exist_ok=True)
        return cls(os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC), path, action)

    def join(self, name: str) -> str:
        """The path of ``name`` (one file name) in this directory."""
        return _join(self.path, name)

    def child(self, name: str) -> "Directory":
        """The sub-directory ``name`` (a symlink there is refused)."""
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(name, flags, dir_fd=self.fd)
        except OSError as error:
            raise self._open_error(error, name) from None
        return Directory(fd, None, self.action, parent=self, name=name)

    def mkdir(self, name: str) -> None:
        """Create the sub-directory ``name`` (modes as ``os.makedirs`` gives them)."""
        try:
            os.mkdir(name, 0o777, dir_fd=self.fd)
        except OSError as error:
            raise self._open_error(error, name) from None

    def open_file(self, name: str, flags: int, mode: int = 0o666) -> int:
        """``openat`` of ``name`` with ``O_NOFOLLOW``; the caller closes the descriptor."""
        try:
            return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=self.fd)
        except OSError as error:
            raise self._open_error(error, name) from None

    def lstat(self, name: str) -> os.stat_result | None:
        """The entry ``name`` itself (a symlink is not followed); None if missing."""
        try:
            return os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return None

    def exists(self, name: str) -> bool:
        return self.lstat(name) is not None

    def is_symlink(self, name: str) -> bool:
        st = self.lstat(name)
        return st is not None and stat.S_ISLNK(st.st_mode)

    def open_path_regular(self, name: str) -> tuple[int, os.stat_result]:
        """An ``O_PATH`` descriptor of the regular file ``name`` and its ``fstat``, for
        :func:`map_path_fd`; the caller closes it. An ``O_PATH`` open opens nothing for
        reading or writing, so a FIFO, socket or device here (put there at any moment,
        also after a check) is refused by the ``fstat`` without its open ever running:
        no driver's open, no writer of a FIFO let through. A symlink is refused too
        (``O_PATH | O_NOFOLLOW`` gives the link itself)."""
        try:
            fd = os.open(name, _PATH_FLAGS, dir_fd=self.fd)
        except OSError as error:
            raise self._open_error(error, name) from None
        try:
            st = os.fstat(fd)
        except BaseException:
            os.close(fd)
            raise
        kind = file_kind(st.st_mode)
        if kind is None:
            return fd, st
        os.close(fd)
        raise self._refusal(name, kind)

    def open_regular(self, name: str, flags: int = os.O_RDONLY) -> int:
        """Open the regular file ``name``; anything else (a symlink, FIFO, socket, device,
        directory) is refused without being opened for reading, so nothing blocks."""
        return self.open_regular_stat(name, flags)[0]

    def open_regular_stat(self, name: str, flags: int = os.O_RDONLY) -> tuple[int, os.stat_result]:
        """:meth:`open_regular`, with the ``fstat`` of the opened file (its size)."""
        try:
            kind = file_kind(os.stat(name, dir_fd=self.fd, follow_symlinks=False).st_mode)
        except OSError as error:
            raise self._open_error(error, name) from None
        if kind is None:
            # O_NONBLOCK: should a FIFO replace the file after that stat, open and read
            # return at once (and fstat refuses it) instead of waiting forever
            fd = self.open_file(name, flags | os.O_NONBLOCK | os.O_NOCTTY)
            st = os.fstat(fd)
            kind = file_kind(st.st_mode)
            if kind is None:
                return fd, st
            os.close(fd)
        raise self._refusal(name, kind)

    def _refusal(self, name: str, kind: str) -> Exception:
        """The error for ``name`` that is ``kind`` (:func:`file_kind`), not a regular file."""
        if kind == "a symlink":
            return RuntimeError(f"Refusing to {self.action} through symlink {self.join(name)}.")
        return FormatError(self.join(name), f"{kind}, not a regular file: refused (reading it could block or never end)")

    def read(self, name: str) -> bytes:
        """All the bytes of the regular file ``name``, read to its end."""
        fd, st = self.open_regular_stat(name)
        try:
            # one read for a file that kept its fstat size: a read that stops at that
            # size when asked for one byte more stopped at the end
            first = os.read(fd, st.st_size + 1)
            if len(first) == st.st_size:
                return first
            chunks = [first]
            while chunk := os.read(fd, 1 << 20):
                chunks.append(chunk)
            return b"".join(chunks)
        finally:
            os.close(fd)

    def write_new_file(self, name: str, data, *, final: str | None = None) -> None:
        """Write ``data`` to a file ``name`` that must not exist yet (``O_EXCL``).

        If a write fails the file is removed at once (a partial file on a full disk
        would keep it full); no room is a :class:`StorageFullError` naming the file
        (``final``: the file that ``name`` is a temporary of) and the bytes needed.
        """
        fd = self.open_file(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        try:
            view = memoryview(data).cast("B")
            while view:
                view = view[os.write(fd, view):]
        except BaseException as error:
            os.close(fd)
            self.unlink(name)
            if isinstance(error, OSError) and error.errno in NO_SPACE_ERRNOS:
                where = f"file {self.join(name)}" if final is None else \
                    f"file {self.join(final)} (written as {name})"
                raise storage_full_error(error, len(data), where) from error
            raise
        os.close(fd)

    def unlink(self, name: str) -> None:
        """Remove the file ``name``; a missing one is not an error."""
        try:
            os.unlink(name, dir_fd=self.fd)
        except FileNotFoundError:
            pass

    def replace(self, source: str, target: str) -> None:
        """Rename ``source`` over ``target``, both in this directory (atomic)."""
        os.replace(source, target, src_dir_fd=self.fd, dst_dir_fd=self.fd)

    def remove_tree(self, name: str) -> None:
        """Remove the sub-directory ``name`` and all it holds (never through a symlink,
        with two descriptors whatever its depth); OSError naming what stays."""
        remove_tree(name, dir_fd=self.fd, shown=self.join(name))

    def close(self) -> None:
        os.close(self.fd)

    def __enter__(self) -> "Directory":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _open_error(self, error: OSError, name: str) -> Exception:
        """The error to raise for ``error`` on ``name``: a refused symlink, else the
        same error naming the full path."""
        path = self.join(name)
        if error.errno == errno.ELOOP or (error.errno == errno.ENOTDIR and self.is_symlink(name)):
            return RuntimeError(f"Refusing to {self.action} through symlink {path}.")
        return type(error)(error.errno, f"{error.strerror}: {path}")


def reserve_file(directory: Directory, name: str, *, existsok: bool) -> tuple[int, bool]:
    """Create the file ``name`` of ``directory`` exclusively, or open the existing file
    when ``existsok``.

    Returns ``(fd, created)``; the caller closes ``fd``. Symlinks are refused, an
    existing file with ``existsok=False`` is a ``RuntimeError`` (tensordict's message).
    """
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        # os.open itself, not open_file: an existing file is common (an overwrite),
        # and its error needs no message
        return os.open(name, flags, 0o666, dir_fd=directory.fd), True
    except FileExistsError:
        pass  # O_EXCL also fails on a symlink, dangling or not: this sees them all
    except OSError as error:
        raise directory._open_error(error, name) from None
    if not existsok:
        if directory.is_symlink(name):
            raise RuntimeError(f"Refusing to {directory.action} through symlink {directory.join(name)}.")
        raise RuntimeError(f"The file {directory.join(name)} already exists.")
    # O_NOFOLLOW: a symlink put there since is refused, never followed
    return directory.open_file(name, os.O_RDWR), False


def check_new_empty_file(directory: Directory, name: str, *, existsok: bool) -> None:
    """Apply the creation rules to a zero-byte leaf, which gets no file at all."""
    st = directory.lstat(name)
    if st is not None and stat.S_ISLNK(st.st_mode):
        raise RuntimeError(f"Refusing to {directory.action} through symlink {directory.join(name)}.")
    if not existsok and st is not None:
        raise RuntimeError(f"The file {directory.join(name)} already exists.")


def allocate(fd: int, offset: int, nbytes: int, where: str) -> None:
    """Reserve bytes ``offset .. offset + nbytes`` of ``fd`` with ``posix_fallocate``
    (growing it if needed): a full disk or memory is a :class:`StorageFullError` naming
    the size and ``where`` now, never a SIGBUS when a page is first touched."""
    try:
        os.posix_fallocate(fd, offset, nbytes)
    except OSError as err:
        if err.errno in NO_SPACE_ERRNOS:
            raise storage_full_error(err, nbytes, where) from err
        raise


def reserve_space(fd: int, nbytes: int, path: str) -> None:
    """Grow the file ``fd`` to at least ``nbytes`` (never shrink it), its space reserved
    (see :func:`allocate`)."""
    if os.fstat(fd).st_size >= nbytes:
        return
    try:
        allocate(fd, 0, nbytes, f"file {path}")
    except StorageFullError:
        raise
    except OSError:
        # EOPNOTSUPP/EINVAL: a filesystem without fallocate; grow sparsely
        os.ftruncate(fd, nbytes)


def create_file(path: str, nbytes: int, *, existsok: bool = False, data=None):
    """Create (or reuse) ``path`` with at least ``nbytes``, write ``data``, map it.

    ``data`` (bytes-like, ``nbytes`` long) is written with ``pwrite`` before mapping.
    Without data the file is grown, never shrunk, and its space reserved with
    ``posix_fallocate`` so a full disk is an exception now rather than a SIGBUS later.
    Returns ``(backing, created)``; for ``nbytes == 0`` only the checks run and
    ``(None, False)`` is returned.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as d:
        ...     backing, created = create_file(os.path.join(d, "x"), 4, data=b"abcd")
        ...     backing.storage.tolist(), created
        ([97, 98, 99, 100], True)
    """
    parent, name = os.path.split(os.path.abspath(path))
    try:
        directory = Directory.open(parent)
    except FileNotFoundError as err:
        raise RuntimeError(f"{err.strerror}: {path}") from err
    with directory:
        if nbytes == 0:
            check_new_empty_file(directory, name, existsok=existsok)
            return None, False
        fd, created = reserve_file(directory, name, existsok=existsok)
    try:
        if data is not None:
            pwrite_all(fd, data, 0, where=f"file {path}")
        else:
            reserve_space(fd, nbytes, path)
        return backing_from_fd(path, fd, shared=True), created
    finally:
        os.close(fd)
