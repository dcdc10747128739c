"""Writing bytes into files and reserving room for them, for every kind of storage.

* Bytes are written with ``pwrite`` in chunks of at most 1 GiB (one call moves at most
  ~2 GiB on Linux), looping over short writes.
* "No room" (``ENOSPC``, ``EDQUOT``, ``ENOMEM``, ``EFBIG``) is a
  :class:`~shared_td.errors.StorageFullError` naming the bytes asked for and where,
  raised at the write or reservation, never a SIGBUS when a mapped page is first touched.
* Room is reserved with ``posix_fallocate``; a file is only ever grown, never shrunk
  (another process may have it mapped: a shrink would SIGBUS it).
* A write that fails names where it went; one into something that is not a regular file
  (a FIFO put where a leaf file was) says what it is, not only "Illegal seek".

Files (:mod:`shared_td.storage.files`), anonymous segments and shared values all write
through here.
"""

from __future__ import annotations

import errno
import os
import resource
import stat

import torch

from shared_td import memory_check
from shared_td.errors import StorageFullError
from shared_td.storage.mapping import file_kind

# One pwrite moves at most ~2 GiB on Linux; smaller calls also keep memory views short.
_WRITE_CHUNK = 1 << 30
#: errnos that mean "no room": reported as StorageFullError with the size asked for
NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.ENOMEM, errno.EFBIG)


def _size_text(nbytes: int) -> str:
    return f"{nbytes} bytes ({nbytes / 2**20:.1f} MiB)"


def storage_full_error(err: OSError, nbytes: int, where: str) -> StorageFullError:
    """Turn an ``ENOSPC``-like ``OSError`` into a :class:`StorageFullError` naming the
    size and the fix: for ``EFBIG`` (a file grown past this process's ``RLIMIT_FSIZE``,
    or the file system's largest file) that limit, not the room left.

    Example:
        >>> print(storage_full_error(OSError(errno.EFBIG, "File too large"), 2**20, "x"))  # doctest: +ELLIPSIS
        [Errno 27] Could not reserve 1048576 bytes (1.0 MiB) for x: File too large. ... RLIMIT_FSIZE ...
    """
    if err.errno == errno.EFBIG:
        soft, hard = (("unlimited" if value == resource.RLIM_INFINITY else str(value))
                      for value in resource.getrlimit(resource.RLIMIT_FSIZE))
        fix = (f"A file may not grow past this process's RLIMIT_FSIZE (soft/hard = {soft}/{hard} "
               "bytes) nor the largest file of its file system: raise the limit (`ulimit -f`, "
               "resource.setrlimit(resource.RLIMIT_FSIZE, ...)) or write less.")
    else:
        fix = "Free space there, or raise the limit (for containers: --shm-size / memory limit)."
    return StorageFullError(err.errno, f"Could not reserve {_size_text(nbytes)} for {where}: {err.strerror}. {fix}")


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
    if flat.numel() == 1 and flat.stride(0) != 1:
        # torch calls one element contiguous whatever its stride (``x[:, k]`` of a batch
        # of one, ``z.conj().imag``): reshape and contiguous keep it, and view refuses it
        flat = flat.as_strided((1,), (1,))
    elif not flat.is_contiguous():
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
            raise _named_write_error(err, fd, where) from err


def _named_write_error(err: OSError, fd: int, where: str) -> OSError:
    """``err`` (a failed write into ``fd``) naming ``where``; if ``fd`` is not a regular
    file (pwrite into a FIFO or socket is "Illegal seek"), saying what it is instead."""
    try:
        mode = os.fstat(fd).st_mode
    except OSError:
        mode = stat.S_IFREG  # nothing more to tell
    if stat.S_ISREG(mode):
        return type(err)(err.errno, f"{err.strerror}: {where}")
    return not_regular_error(err.errno, where, mode)


def not_regular_error(code: int, where: str, mode: int) -> OSError:
    """The ``OSError`` (errno ``code``) for writing ``where``, which is not a regular file
    but what ``mode`` says (a FIFO, a socket...)."""
    return OSError(code, f"Cannot write {where}: it is {file_kind(mode)}, not a regular file. "
                         "Remove it (or write to another path) and write again.")


def allocate(fd: int, offset: int, nbytes: int, where: str, *, anonymous: bool = False) -> None:
    """Reserve bytes ``offset .. offset + nbytes`` of ``fd`` with ``posix_fallocate``
    (growing it if needed): a full disk or memory is a :class:`StorageFullError` naming
    the size and ``where`` now, never a SIGBUS when a page is first touched.

    ``anonymous``: ``fd`` is a memfd, which no size limit of its own stops (growing it
    past the memory fills RAM until the OOM killer ends some process): a big growth is
    checked first against the memory available (:func:`shared_td.memory_check.check_growth`),
    as a new segment is."""
    try:
        if anonymous:
            memory_check.check_growth(offset + nbytes - os.fstat(fd).st_size)
        os.posix_fallocate(fd, offset, nbytes)
    except OSError as err:
        if err.errno in NO_SPACE_ERRNOS:
            raise storage_full_error(err, nbytes, where) from err
        raise


def reserve_space(fd: int, nbytes: int, path: str) -> None:
    """Grow the file ``fd`` to at least ``nbytes`` (never shrink it), its space reserved
    (see :func:`allocate`); ``fd`` must be a regular file (``EINVAL`` naming ``path`` and
    what it is, as ``ftruncate`` of a FIFO)."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise not_regular_error(errno.EINVAL, f"file {path}", st.st_mode)
    if st.st_size >= nbytes:
        return
    try:
        allocate(fd, 0, nbytes, f"file {path}")
    except StorageFullError:
        raise
    except OSError:
        # EOPNOTSUPP/EINVAL: a filesystem without fallocate; grow sparsely
        os.ftruncate(fd, nbytes)
