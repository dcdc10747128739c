"""File storage for memory-mapped tensors: create and open files, then map them.

Rules this module enforces:

* A file is created with ``O_CREAT | O_EXCL`` and is never written through a symlink:
  it is opened relative to an opened :class:`Directory` with ``O_NOFOLLOW``, so a
  directory renamed or replaced by a symlink meanwhile never redirects it.
* Bytes are written with ``pwrite`` into the page cache *before* the file is mapped:
  that is several times faster than first-touch faults through a fresh mapping.
* A file only ever grows: an existing longer file keeps its tail, and nothing here
  truncates a file that another process may have mapped (a shrink would SIGBUS it).
* Mapping checks sizes first: a missing file is a ``FileNotFoundError`` (never created),
  a short one a :class:`FileTooShortError` -- never a SIGBUS on first access.
* Zero-byte requests never create or map anything (``mmap`` of 0 bytes is invalid).
* A file read whole (:meth:`Directory.read`: a meta.json, a pickle) is read only up to
  the cap its caller gives, checked on its ``fstat`` size before a byte is read: a
  sparse file announces any size at no cost on disk.

The pieces live in four modules; their public names are all importable from here:

* this one: :class:`Directory` (every name resolved relative to an open directory),
  :func:`create_file` and the creation rules;
* :mod:`shared_td.storage.writing`: ``pwrite_all``, ``allocate``, ``reserve_space``,
  :class:`StorageFullError` for "no room";
* :mod:`shared_td.storage.mapping`: :class:`FileBacking`, one mapping of a whole file
  per process, and how it pickles;
* :mod:`shared_td.storage.fd_mapping`: ``map_fd`` and the errors that name the limit
  that refused a mapping or an open.
"""

from __future__ import annotations

import errno
import os
import stat

from shared_td.errors import FileTooShortError, FormatError, StorageFullError
from shared_td.storage.fd_mapping import descriptor_limits, map_fd
from shared_td.storage.mapping import (
    PATH_FLAGS,
    FileBacking,
    backing_from_fd,
    file_kind,
    boot_id,
    find_backing,
    map_path_fd,
    mapped_backing,
    open_file_backing,
    relocated,
)
from shared_td.storage.removal import remove_tree
from shared_td.storage.writing import (
    NO_SPACE_ERRNOS,
    allocate,
    not_regular_error,
    pwrite_all,
    raw_bytes,
    reserve_space,
    storage_full_error,
    tensor_bytes,
)

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
    # the rest of what the package imports from here, defined in the modules above
    "NO_SPACE_ERRNOS",
    "backing_from_fd",
    "boot_id",
    "map_path_fd",
    "mapped_backing",
    "raw_bytes",
    "relocated",
    "reserve_space",
    "storage_full_error",
]

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
            # iteratively, not through parent.path: a chain of directories opened one
            # below the other may be deeper than Python's recursion limit
            chain, top = [], self
            while top._path is None:
                chain.append(top)
                top = top._parent
            for each in reversed(chain):
                each._path, each._parent = _join(top._path, each._name), None
                top = each
        return self._path

    @classmethod
    def open(cls, path: str, *, action: str = "write memory-mapped tensor", create: bool = False) -> "Directory":
        """Open the directory ``path`` (a caller's own path: symlinks in it are followed),
        creating it and its parents first when ``create``."""
        if create:
            os.makedirs(path, mode=0o777, exist_ok=True)
        try:
            return cls(os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC), path, action)
        except OSError as error:
            if error.errno not in (errno.EMFILE, errno.ENFILE):
                raise
            raise _named_error(error, path) from None

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
            fd = os.open(name, PATH_FLAGS, dir_fd=self.fd)
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

    def read(self, name: str, *, limit: int) -> bytes:
        """All the bytes of the regular file ``name``, read to its end (:func:`read_whole`:
        more than ``limit`` bytes is a FormatError naming it, raised before reading)."""
        fd, st = self.open_regular_stat(name)
        try:
            return read_whole(fd, st.st_size, self.join(name), limit)
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

    def rmdir(self, name: str) -> None:
        """Remove the empty sub-directory ``name`` (one that holds anything stays: an
        OSError naming it); a missing one is not an error."""
        try:
            os.rmdir(name, dir_fd=self.fd)
        except FileNotFoundError:
            pass
        except OSError as error:
            raise self._open_error(error, name) from None

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
        return _named_error(error, path)


def _named_error(error: OSError, path: str) -> OSError:
    """``error`` (of an open or mkdir) naming ``path``; out of descriptors, also this
    process's limit and the fix."""
    limits = f". {descriptor_limits(error.errno)}" if error.errno in (errno.EMFILE, errno.ENFILE) else ""
    return type(error)(error.errno, f"{error.strerror}: {path}{limits}")


def too_big(size: int, limit: int) -> str:
    """Why a file (or archive member) of ``size`` bytes is not read whole: the words of
    :func:`read_whole`'s error, for a caller that names the file its own way."""
    mib = f" ({limit >> 20} MiB)" if limit >= 1 << 20 and not limit % (1 << 20) else ""
    return (f"{size} bytes, more than the {limit} bytes{mib} such a file is read to at most: "
            "refused unread (a damaged or hostile save)")


def read_whole(fd: int, size: int, path: str, limit: int) -> bytes:
    """All the bytes of the open regular file ``fd`` of ``fstat`` size ``size``, read to
    its end; ``path`` names it in errors.

    A file of more than ``limit`` bytes is a FormatError naming it, its size and the
    limit, before a byte is read: its size may lie about its content (a sparse file of
    1 GiB takes no disk, yet reading it costs 1 GiB of memory), and a reader that needs
    the whole file in memory caps what it accepts (persist.bounded_reads.MAX_META_BYTES).
    A file that grows past ``limit`` while read is refused too.

    Examples (:meth:`Directory.read` reads through it):
        >>> with Directory.open(".") as here:
        ...     here.write_new_file("small", b"abc")
        ...     here.read("small", limit=1 << 10)
        b'abc'
        >>> with Directory.open(".") as here:
        ...     here.read("small", limit=2)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        shared_td.errors.FormatError: ./small: 3 bytes, more than the 2 bytes such a file is read to at most: ...
    """
    if size > limit:
        raise FormatError(path, too_big(size, limit))
    # one read for a file that kept its fstat size: a read that stops at that size when
    # asked for one byte more stopped at the end (and the result is the buffer: no copy)
    first = os.read(fd, size + 1)
    if len(first) == size:
        return first
    chunks, total = [first], len(first)
    while total <= limit and (chunk := os.read(fd, min(1 << 20, limit + 1 - total))):
        chunks.append(chunk)
        total += len(chunk)
    if total > limit:
        raise FormatError(path, f"grew past {limit} bytes while it was read: refused (a damaged or "
                          "hostile save, or a file still being written)")
    return b"".join(chunks)


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
    # O_NOFOLLOW: a symlink put there since is refused, never followed; O_NONBLOCK and
    # O_NOCTTY: a FIFO or device put there is opened without waiting for a peer or
    # taking a terminal, then refused (a device's bytes must never be written over)
    fd = directory.open_file(name, os.O_RDWR | os.O_NONBLOCK | os.O_NOCTTY)
    mode = os.fstat(fd).st_mode
    if stat.S_ISREG(mode):
        return fd, False
    os.close(fd)
    raise not_regular_error(errno.EINVAL, f"file {directory.join(name)}", mode)  # before a byte is written


def check_new_empty_file(directory: Directory, name: str, *, existsok: bool) -> None:
    """Apply the creation rules to a zero-byte leaf, which gets no file at all."""
    st = directory.lstat(name)
    if st is not None and stat.S_ISLNK(st.st_mode):
        raise RuntimeError(f"Refusing to {directory.action} through symlink {directory.join(name)}.")
    if not existsok and st is not None:
        raise RuntimeError(f"The file {directory.join(name)} already exists.")


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
        except BaseException:
            # a failed create leaves no file (a retry would find it "already exists"):
            # only the inode this call made, not a file put at the name since
            if created:
                try:
                    mine, there = os.fstat(fd), directory.lstat(name)
                    if there is not None and os.path.samestat(mine, there):
                        os.unlink(name, dir_fd=directory.fd)
                except OSError:
                    pass  # (the error to raise is the one that failed the create)
            raise
        finally:
            os.close(fd)
