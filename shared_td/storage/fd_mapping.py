"""Mapping an open descriptor, and the errors that say why a mapping or an open failed.

* :func:`map_fd` maps the first bytes of an open file as one ``UntypedStorage``
  (torch maps ``/proc/self/fd/N``, so the inode the caller checked is the inode mapped);
  a mapping that fails leaves nothing open.
* A refused mapping is an ``OSError`` (:class:`~shared_td.errors.MappingError`) naming
  the file or segment, its size and the limits that may be at fault
  (:func:`mapping_limits`); an open refused for want of descriptors names them
  (:func:`descriptor_limits`).

Files (:mod:`shared_td.storage.mapping`) and anonymous segments
(:mod:`shared_td.storage.anonymous`) both map through here.
"""

from __future__ import annotations

import errno
import mmap
import os
import re
import resource

import torch

from shared_td.errors import MappingError

def map_fd(fd: int, nbytes: int, *, shared: bool = True, what: str | None = None):
    """Map the first ``nbytes`` of the open file ``fd`` as one uint8 ``UntypedStorage``.

    ``shared=False`` gives a private copy-on-write mapping. torch opens the file again
    (through ``/proc/self/fd``) and closes that second descriptor once mapped; the caller
    still owns ``fd``. The caller must have checked that the file holds ``nbytes``.

    A mapping that cannot be made is an ``OSError`` with the errno of the failed call,
    naming ``what`` (default: the file that ``fd`` names), the size and, for a mapping
    refused for want of memory (``ENOMEM``), this process's limits (``RLIMIT_AS``,
    ``vm.max_map_count``, for a private mapping ``RLIMIT_DATA`` and the commit limit:
    see :func:`mapping_limits`); an ``EMFILE`` names ``RLIMIT_NOFILE``. Nothing is left
    open (but for the race told below).

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryFile() as f:
        ...     _ = f.write(b"\\x01\\x02"); f.flush()
        ...     map_fd(f.fileno(), 2).tolist()
        [1, 2]
    """
    if nbytes:
        # torch.from_file leaves open the descriptor it opened when its mmap fails, and
        # for a memfd that descriptor holds all its memory until the process exits: a
        # mapping of the same size without a file (anonymous, unmapped at once; one
        # syscall pair) fails first for the same limits. A thread that takes the last of
        # the address space between this trial and torch's mmap can still make torch leak
        # one descriptor (the error below is raised all the same).
        try:
            mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE, prot=_TRIAL_PROT[shared]).close()
        except OSError as error:
            raise map_error(error.errno, fd, nbytes, shared, what) from None
    try:
        mapped = torch.from_file(f"/proc/self/fd/{fd}", shared=shared, size=nbytes, dtype=torch.uint8)
    except RuntimeError as error:
        # torch's message names /proc/self/fd/<n> (no parenthesis), then "(errno)"; with
        # TORCH_SHOW_CPP_STACKTRACES=1 a stack trace follows it: the first one is the errno
        found = re.search(r"\((\d+)\)", str(error))
        if found is None:
            raise
        raise map_error(int(found.group(1)), fd, nbytes, shared, what,
                        opening=str(error).startswith("unable to open")) from None
    return mapped.untyped_storage()


# The trial mapping's protection: none (PROT_NONE, 0) for a shared mapping (it counts
# in the address space and the mapping count, as the file's shared mapping does, and is
# charged to no memory commit, as that is not); read-write for a private one, charged
# to the commit as torch's private writable mapping of the file is.
_TRIAL_PROT = {True: 0, False: mmap.PROT_READ | mmap.PROT_WRITE}


def map_error(code: int, fd: int, nbytes: int, shared: bool, what: str | None,
              opening: bool = False) -> OSError:
    """The ``OSError`` (errno ``code``) of a failed :func:`map_fd`: it names ``what``
    (default: what ``fd`` names), the size and the limits that may be at fault."""
    what = what or _fd_name(fd)
    action = "open" if opening else f"map {nbytes} bytes ({_mib(nbytes)}) of"
    message = f"Cannot {action} {what}: {os.strerror(code)}."
    if code == errno.ENOMEM:
        message += (f" This process may have reached a limit on its mappings: {mapping_limits(shared)}. "
                    "Raise the limit reached (`ulimit -v`, resource.setrlimit(resource.RLIMIT_AS, ...), "
                    "`sysctl vm.max_map_count=...`), or map fewer or smaller tensors.")
    elif code in (errno.EMFILE, errno.ENFILE):
        message += f" {descriptor_limits(code)}"
    return MappingError(code, message)


def mapping_limits(shared: bool = True) -> str:
    """What may refuse a new mapping of this process, as text: ``RLIMIT_AS`` (soft and
    hard, and the address space in use), ``vm.max_map_count`` (and the mappings in use)
    and, for a private mapping, ``RLIMIT_DATA`` and the memory commit
    (``vm.overcommit_memory``).

    Example:
        >>> mapping_limits().startswith("RLIMIT_AS soft/hard = ")
        True
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    status = _proc_fields("/proc/self/status", "VmSize")
    in_use = f" (in use: {_mib(status['VmSize'] * 1024)})" if "VmSize" in status else ""
    text = f"RLIMIT_AS soft/hard = {_limit(soft, _mib)}/{_limit(hard, _mib)}{in_use}"
    try:
        with open("/proc/self/maps", "rb") as maps:
            count = f" (in use: {sum(1 for _ in maps)})"
    except OSError:
        count = ""
    text += f"; vm.max_map_count {_read_sysctl('vm/max_map_count')}{count}"
    if not shared:
        # a private writable mapping also counts in the data segment and the commit
        soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
        meminfo = _proc_fields("/proc/meminfo", "Committed_AS", "CommitLimit")
        text += (f"; a private mapping also counts in RLIMIT_DATA soft/hard = {_limit(soft, _mib)}/"
                 f"{_limit(hard, _mib)} and in the memory commit: vm.overcommit_memory "
                 f"{_read_sysctl('vm/overcommit_memory')}")
        if len(meminfo) == 2:
            text += (f" (committed {_mib(meminfo['Committed_AS'] * 1024)} of a CommitLimit of "
                     f"{_mib(meminfo['CommitLimit'] * 1024)}, the limit when it is 2)")
    return text


def descriptor_limits(code: int = errno.EMFILE) -> str:
    """Why an ``open`` failed with ``EMFILE`` (this process is out of descriptors: its
    ``RLIMIT_NOFILE``) or ``ENFILE`` (the system-wide table is full: ``fs.file-max``),
    as sentences saying what to do.

    Example:
        >>> descriptor_limits().startswith("This process is out of file descriptors (RLIMIT_NOFILE soft/hard = ")
        True
    """
    if code == errno.ENFILE:
        return (f"The system-wide table of open files is full (fs.file-max {_read_sysctl('fs/file-max')}): "
                "close files in some process, or raise fs.file-max.")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        in_use = f", {len(os.listdir('/proc/self/fd'))} open"
    except OSError:  # (listing needs a descriptor too)
        in_use = ""
    return (f"This process is out of file descriptors (RLIMIT_NOFILE soft/hard = {_limit(soft, str)}/"
            f"{_limit(hard, str)}{in_use}). Close descriptors you no longer need, or raise the limit "
            "(`ulimit -n`, resource.setrlimit(resource.RLIMIT_NOFILE, ...)).")


def _fd_name(fd: int) -> str:
    try:
        return f"the file {os.readlink(f'/proc/self/fd/{fd}')}"
    except OSError:
        return f"the file of descriptor {fd}"


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


def _limit(value: int, show) -> str:
    return "unlimited" if value == resource.RLIM_INFINITY else show(value)


def _read_sysctl(name: str) -> str:
    try:
        with open(f"/proc/sys/{name}") as source:
            return source.read().strip()
    except OSError:
        return "unknown"


def _proc_fields(path: str, *names: str) -> dict[str, int]:
    """The numeric fields ``names`` of a ``/proc`` file of ``Name: value kB`` lines."""
    found = {}
    try:
        with open(path) as source:
            for line in source:
                name, _, value = line.partition(":")
                if name in names:
                    found[name] = int(value.split()[0])
    except (OSError, ValueError, IndexError):
        pass
    return found
