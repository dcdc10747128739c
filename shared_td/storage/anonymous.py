"""Anonymous shared memory: ``memfd`` segments that other processes attach by reference.

Ownership and lifetime (the questions CPython's ``shared_memory`` answers with names and
a resource tracker; we need neither):

* ``Segment.create`` makes a ``memfd`` (name ``shared_td-<pid>``) and reserves all its
  bytes with ``posix_fallocate``, so a full tmpfs or memory limit is a
  :class:`~shared_td.storage.files.StorageFullError` at creation, never a SIGBUS later;
  a mapping that this process's limits refuse (``RLIMIT_AS``) is refused first.
* The :class:`Segment` object owns exactly one descriptor and one mapping (its
  ``storage``). The descriptor is closed by a finalizer when that storage dies:
  when the Segment and every tensor viewing it are gone, plain views too (``detach()``,
  ``view()``, ``.data``), as torch keeps the descriptor of its shared storages, so that
  such a view can still be sent (below); not at interpreter exit (the kernel closes it
  then), so that a view put on a queue as ``main`` returns is still sent by the queue's
  feeder thread, which runs after the ``atexit`` hooks. The memory is freed by the kernel when the last
  descriptor *and* the last mapping in any process are gone. Nothing is ever named in
  ``/dev/shm``, so a SIGKILL leaks nothing.
* Plain ``pickle`` sends a segment as ``(pid, fd, (st_dev, st_ino), nbytes)`` of the
  pickling process. The receiver opens ``/proc/<pid>/fd/<fd>`` -- allowed for processes
  of the same user -- checks the inode, and owns the new descriptor. This works with
  every pickler and start method, as long as the sending process still holds the segment
  when the receiver unpickles (:class:`SegmentUnavailableError` otherwise). Fork
  children inherit the descriptor and this module's cache, so they need no ``/proc``.
  A segment attached from a Coordinator also names the ``(pid, fd)`` of the manager
  that holds it, as a *fallback holder* (:mod:`shared_td.storage.holders`): a receiver
  that cannot reach the sender opens the manager's descriptor, with the same checks,
  so a tree a worker attached (or a plain view of it) and sent on is received after
  that worker exited, while the name stays published; the error when no route works
  names each one tried.
* multiprocessing's ``ForkingPickler`` (queues, pipes, process arguments, DataLoader
  workers) sends a *duplicate descriptor* instead, as torch sends its storages:
  ``multiprocessing.reduction.DupFd(fd)`` with the key, size, pid and fd. A spawn or
  forkserver child's arguments pass it at the child's start; otherwise the sender's
  ``resource_sharer`` thread holds the duplicate until the receiver connects and takes it
  (SCM_RIGHTS). So a segment put on a queue and dropped by its sender, or returned by a
  DataLoader worker, still reaches the receiver while the sender *process* lives. The
  receiver checks the descriptor's inode and size (a mismatch is refused, never mapped),
  and keeps it as its Segment or closes it if it has that segment already. Costs, as in
  torch: one descriptor per segment per pickle in the sender until it is received, and a
  pickle never received (or a pickling that fails half-way) holds it, and so the memory,
  until the sender exits. If the duplicate cannot be taken (the sender exited, or the
  receiver is not of the sender's family: another ``authkey``), or the sender does not
  hand it over within a bound (it is stopped or hung), the receiver tries the ``/proc``
  route above, then the holders (:mod:`shared_td.storage.duplicates`). A SharedCounter
  and a shared non-tensor value (SharedValue), also memfds, are sent the same way
  (:func:`~shared_td.storage.duplicates.receive_duplicate`), each with its own
  words when it cannot be received. The Coordinator pickles its segments itself (plain
  pickles of ``Segment.__reduce__``) and ``multiprocess`` (dill) has its own pickler:
  both keep the ``/proc`` route. A receiver out of descriptors (``RLIMIT_NOFILE``) gets
  a :class:`~shared_td.errors.MappingError` naming the segment and that limit.
* A plain ``torch.Tensor`` over a segment or a mapped file (a view that is not a
  MemoryMappedTensor: ``detach()``, ``view()``, ``.data``, the leaves of ``td.detach()``,
  ``td.view()``, ``td.apply(...)``) is sent by ForkingPickler (multiprocessing's and
  multiprocess's) as a view of the same memory: its storage as its Segment (as above)
  or FileBacking (the path), by a reducer for ``torch.UntypedStorage`` registered over
  torch's (:mod:`shared_td.storage.sending`, which gives torch's every other storage). Torch's
  own sent ``DupFd(-1)``: it keeps no descriptor of a mapping made by ``torch.from_file``.
  Ours are told by an attribute of their storage (a copy-on-write mapping's too), never
  by ``filename``. A receiver keeps one mapping (and, for a segment, one descriptor) of
  what it receives while any view of it lives, however many views it receives.
* Many leaves can share one segment (at :data:`ALIGNMENT`-byte offsets): descriptors grow
  with the number of segments, not of tensors (user-issues row 15). Each leaf's torch
  storage is a slice of the segment's, its own bytes only (:mod:`shared_td.storage.slices`).
"""

from __future__ import annotations

import errno
import mmap
import multiprocessing
import multiprocessing.reduction
import os

from shared_td import platform
from shared_td.errors import MappingError, SegmentUnavailableError
from shared_td.finalizers import Finalizer
from shared_td.storage.files import NO_SPACE_ERRNOS, map_fd, pwrite_all, storage_full_error
from shared_td.storage.cache import MappingCache
from shared_td.storage.holders import add_holders, holders_of, open_first
from shared_td.storage.duplicates import held_duplicate, receive_duplicate
from shared_td.storage.fd_mapping import descriptor_limits, map_error

__all__ = [
    "ALIGNMENT", "Segment", "SegmentUnavailableError", "add_segment_holders", "align", "attach_peer_fd",
    "attach_segment", "create_memfd",
    "cached_segment", "find_segment", "receive_segment",
]

#: Offsets of leaves packed into one segment: a multiple of every dtype's size and of
#: the cache line, so vectorised kernels see aligned data.
ALIGNMENT = 64


def align(nbytes: int, alignment: int = ALIGNMENT) -> int:
    """Round ``nbytes`` up to a multiple of ``alignment``.

    Example:
        >>> align(1), align(64), align(65)
        (64, 64, 128)
    """
    return -(-nbytes // alignment) * alignment


def create_memfd(name: str, nbytes: int, what: str) -> int:
    """:func:`shared_td.platform.new_memfd`, a full memory reported as a
    :class:`~shared_td.storage.files.StorageFullError` naming the size and ``what``.

    Example:
        >>> fd = create_memfd("example", 64, "an example"); os.fstat(fd).st_size
        64
        >>> os.close(fd)
    """
    try:
        return platform.new_memfd(name, nbytes)
    except OSError as err:
        if err.errno in NO_SPACE_ERRNOS:
            raise storage_full_error(err, nbytes, what) from err
        if err.errno in (errno.EMFILE, errno.ENFILE):  # this process's own descriptors, said so
            raise OSError(err.errno, f"Could not create {what} of {nbytes} bytes ({err}). "
                                     f"{descriptor_limits(err.errno)}") from err
        raise


# (st_dev, st_ino) -> Segment: one descriptor and one mapping per segment per process,
# however many leaves of it are unpickled. Weak, so a dead segment leaves no entry; a
# live entry keeps its descriptor open, so its inode number cannot be reused meanwhile.
# It holds each segment's storage too, while any tensor views it: a plain view (detach(),
# .data) keeps the mapping and its descriptor after the Segment object is gone, and a
# segment received again reuses them (see MappingCache).
_CACHE = MappingCache()


class Segment:
    """An anonymous shared-memory segment of ``nbytes`` bytes, mapped once in this process.

    Attributes: ``fd`` (the one descriptor this object owns), ``nbytes``, ``key``
    (``(st_dev, st_ino)``, the identity of the memory across processes) and ``storage``
    (one uint8 ``torch.UntypedStorage`` over all the bytes).

    Example:
        >>> import pickle
        >>> seg = Segment.create(128)
        >>> seg.write(64, b"hi")
        >>> bytes(seg.storage[64:66].tolist())
        b'hi'
        >>> pickle.loads(pickle.dumps(seg)) is seg  # same process: the same object
        True
    """

    __slots__ = ("fd", "nbytes", "key", "storage", "_finalizer", "__weakref__")

    def __init__(self, fd: int, nbytes: int, key: tuple[int, int]):
        # Private: use Segment.create, or pickle. Takes ownership of fd.
        self.fd = fd
        self.nbytes = nbytes
        self.key = key
        try:
            # Mapped eagerly: mapping costs nothing until touched, and one fixed storage
            # per segment is what lets a tensor prove which segment it views (a leaf's
            # own storage is a slice of it that names it: shared_td.storage.slices).
            storage = map_fd(fd, nbytes, shared=True,
                             what=f"an anonymous shared-memory segment (inode {key[1]})")
        except BaseException:
            os.close(fd)
            raise
        self.storage = storage
        # The descriptor lives as long as the mapping's storage, which this object holds
        # and so does every tensor viewing it, plain ones too (detach(), view(), .data):
        # such a view sent by ForkingPickler after this object died goes as a duplicate
        # of it (see _reduce_storage). The storage's Python object is one per mapping
        # (torch keeps it while any tensor views it), so it can say what it maps.
        self._finalizer = Finalizer(storage, os.close, fd)
        # Not at interpreter exit: a view put on a queue just before main returns is
        # pickled by the queue's feeder thread after atexit hooks run (os.dup(fd): EBADF,
        # the receiver waits for ever); the kernel closes the descriptor at exit anyway.
        self._finalizer.atexit = False
        setattr(storage, SEGMENT_ATTRIBUTE, (fd, nbytes, key))

    @classmethod
    def create(cls, nbytes: int) -> Segment:
        """Create a new zero-filled segment with all ``nbytes`` reserved.

        Raises ``ValueError`` for ``nbytes <= 0`` (callers keep zero-byte tensors out of
        segments) and :class:`~shared_td.storage.files.StorageFullError` when the memory
        cannot be reserved.

        Example:
            >>> Segment.create(1000).nbytes
            1000
        """
        if nbytes <= 0:
            raise ValueError(f"A segment needs a positive size, got {nbytes} bytes.")
        # map_fd's trial mapping (PROT_NONE: address space and a mapping, no memory),
        # made before the memory is reserved: a mapping that RLIMIT_AS or
        # vm.max_map_count refuses must not first reserve (and zero) all its bytes
        try:
            mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE, prot=0).close()
        except OSError as error:
            raise map_error(error.errno, -1, nbytes, True, "a new anonymous shared-memory segment "
                            "(inode none yet: refused before any byte was reserved)") from None
        fd = create_memfd(f"shared_td-{os.getpid()}", nbytes, "an anonymous shared-memory segment")
        try:
            st = os.fstat(fd)
        except BaseException:  # (a Ctrl-C as it returned: the memfd is nobody else's yet)
            os.close(fd)
            raise
        return _register(fd, nbytes, (st.st_dev, st.st_ino))

    def write(self, offset: int, data) -> None:
        """Write bytes-like ``data`` at byte ``offset`` with ``pwrite`` (no page faults).

        Example:
            >>> seg = Segment.create(8)
            >>> seg.write(0, b"\\x07")
            >>> seg.storage[0]
            7
        """
        size = memoryview(data).nbytes
        if offset < 0 or offset + size > self.nbytes:
            raise ValueError(
                f"Writing {size} bytes at offset {offset} overflows a segment of "
                f"{self.nbytes} bytes."
            )
        pwrite_all(self.fd, data, offset, where="an anonymous shared-memory segment")

    @property
    def holders(self) -> tuple[tuple[int, int], ...]:
        """``(pid, fd)`` of the coordinators known to hold this segment (it was attached
        from them), tried by a receiver when this process is gone; see
        :mod:`shared_td.storage.holders`."""
        return holders_of(self.storage)

    def add_holders(self, holders) -> None:
        """Record processes that hold this segment for as long as they live (coordinators)."""
        add_holders(self.storage, holders)

    def __reduce__(self):
        # plain pickle, and the Coordinator's own pickling (which calls this): by /proc,
        # then by the holders (only named when there are some: a segment no coordinator
        # holds pickles as it always did)
        holders = self.holders
        return _attach, (os.getpid(), self.fd, self.key, self.nbytes, *((holders,) if holders else ()))

    def _reduce_with_duplicate(self):
        # multiprocessing's ForkingPickler (registered below): a duplicate descriptor
        # that outlives this object, so that the receiver needs only the sender process
        # (and, once that is gone, a holder)
        # (/proc route: the duplicate's own number, see held_duplicate)
        holders = self.holders
        duplicate, held = held_duplicate(self.fd)
        return _receive, (duplicate, self.key, self.nbytes, os.getpid(), held, *((holders,) if holders else ()))

    def __repr__(self) -> str:
        return f"Segment(nbytes={self.nbytes}, fd={self.fd}, inode={self.key[1]})"


def _register(fd: int, nbytes: int, key: tuple[int, int]) -> Segment:
    """Wrap ``fd`` as this process's Segment for ``key``, unless this process maps that
    segment already (another thread won, or plain views keep its mapping): then ``fd``
    is closed and that one returned. Owns ``fd`` from the call on (its callers never
    close it after: a Ctrl-C landing as this returned would close it twice)."""
    try:
        existing = cached_segment(key)
    except BaseException:  # (a Ctrl-C, or a failing lookup: fd was left open)
        os.close(fd)
        raise
    if existing is not None:
        os.close(fd)
        return existing
    segment = Segment(fd, nbytes, key)
    stored = _CACHE.put_if_absent(key, segment)
    if stored is not segment:
        # Another thread attached the same memory meanwhile: keep one per process.
        segment._finalizer()
    else:
        _CACHE.keep_storage(key, segment.storage)
    return stored


#: the attribute of a segment's storage that holds ``(fd, nbytes, key)``: what a view
#: of it pickles by when its Segment object is gone (the descriptor lives as long as it)
SEGMENT_ATTRIBUTE = "_shared_td_segment"


def cached_segment(key: tuple[int, int]) -> Segment | None:
    """This process's Segment for ``key``: its object, or one rebuilt over the mapping
    that tensors still view (:func:`find_segment`), kept in the cache while held."""
    segment = _CACHE.get(key)
    if segment is not None:
        return segment
    storage = _CACHE.storage(key)
    if storage is None:
        return None
    return _CACHE.put_if_absent(key, find_segment(storage))


def find_segment(storage) -> Segment | None:
    """The Segment of this process whose mapping is ``storage``, if any: also when the
    object that made it is gone but tensors still view its mapping (a new object over
    the same descriptor and storage, not kept: the tensors hold the memory).

    Example:
        >>> seg = Segment.create(64)
        >>> find_segment(seg.storage) is seg, find_segment(torch.zeros(2).untyped_storage())
        (True, None)
        >>> view = torch.empty(0, dtype=torch.uint8).set_(seg.storage)
        >>> key = seg.key; del seg  # only a plain view holds the mapping now
        >>> find_segment(view.untyped_storage()).key == key
        True
    """
    held = getattr(storage, SEGMENT_ATTRIBUTE, None)
    if held is None:  # (a TypedStorage, or a storage that is no mapping's own object)
        segments = _CACHE.values()
        return next((s for s in segments if s.storage.data_ptr() == storage.data_ptr()), None)
    cached = _CACHE.get(held[2])
    if cached is not None and cached.storage is storage:
        return cached
    segment = Segment.__new__(Segment)
    segment.fd, segment.nbytes, segment.key = held
    segment.storage = storage
    segment._finalizer = None  # (the storage's finalizer closes the descriptor)
    return segment


# ``what`` may be any user of a segment (tensors, a SharedCounter, the coordinator's
# table): this advice covers each, so that none is told what only suits another
GENERIC_ADVICE = (
    "Anonymous shared memory (tensors memory-mapped without a prefix, a SharedCounter, "
    "shared non-tensor values) can only be received while its sender holds it: keep the "
    "sender alive until every receiver has unpickled it, or, for tensors, publish them "
    "through a Coordinator (which holds them for its receivers) or give them a filename "
    "(memmap_(prefix))."
)


def _unavailable(pid: int, key: tuple[int, int], what: str, reason: str,
                 advice: str = GENERIC_ADVICE) -> SegmentUnavailableError:
    return SegmentUnavailableError(
        f"The {what} (inode {key[1]}) sent by process {pid} is gone ({reason}): that "
        f"process has exited or no longer holds it. {advice}"
    )


#: errnos of an open of ``/proc/<pid>/fd/<fd>`` that are this process's (or this
#: machine's) shortage, not the sender's absence: no descriptor, no file table entry, no memory
OWN_SHORTAGE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM})


def attach_peer_fd(pid: int, fd: int, key: tuple[int, int], *, what: str, min_size: int = 0,
                   advice: str = GENERIC_ADVICE) -> int:
    """Our own descriptor on the memfd that process ``pid`` holds as ``fd``
    (:func:`shared_td.platform.reopen_peer_fd`: still the file ``key`` =
    ``(st_dev, st_ino)``), holding at least ``min_size`` bytes; a
    :class:`SegmentUnavailableError` naming ``what`` (and giving ``advice``, the fix for
    that user of the memory) otherwise. The caller owns it.

    An open refused for this process's own shortage (:data:`OWN_SHORTAGE_ERRNOS`: out
    of descriptors, ``RLIMIT_NOFILE``) is an ``OSError`` with that errno saying so, not
    a SegmentUnavailableError: the sender is not to blame, and attaching again does not help.
    """
    # (our own pid too: a reference pickled here and unpickled here, e.g. by
    # multiprocess's pickler; the inode check refuses a descriptor number reused since)
    try:
        new_fd = platform.reopen_peer_fd(pid, fd, key)
    except OSError as err:
        if err.errno in OWN_SHORTAGE_ERRNOS:
            # this process (or the system) is short of descriptors or memory: the sender
            # may well hold the segment, and trying again would fail the same way
            limits = descriptor_limits(err.errno) if err.errno != errno.ENOMEM else \
                "The kernel is out of memory for a new open file."
            raise MappingError(err.errno, f"Cannot attach the {what} (inode {key[1]}) that process {pid} "
                                          f"holds: {err.strerror}. {limits}") from err
        if err.errno in (errno.EACCES, errno.EPERM):
            # the sender lives and may hold it: this process may not open its descriptors
            raise SegmentUnavailableError(
                f"The {what} (inode {key[1]}) sent by process {pid} cannot be attached "
                f"({err.strerror}): this process may not open the descriptors of process {pid} "
                f"(/proc/{pid}/fd: another user's process, a process that is not dumpable such as a "
                "setuid program, or a ptrace restriction such as kernel.yama.ptrace_scope or a "
                f"container's policy). Run both as one user without that restriction. {advice}"
            ) from err
        # ENOENT, ESRCH: the process or its descriptor is gone; ESTALE: the number now
        # names another file (see reopen_peer_fd)
        reason = "it was released in this process" if pid == os.getpid() else err.strerror or str(err)
        raise _unavailable(pid, key, what, reason, advice) from err
    try:
        st = os.fstat(new_fd)
        if st.st_size < min_size:
            raise _unavailable(pid, key, what, f"it holds only {st.st_size} bytes", advice)
    except BaseException:
        os.close(new_fd)
        raise
    return new_fd


def _attach(pid: int, fd: int, key: tuple[int, int], nbytes: int, holders: tuple = ()) -> Segment:
    """Unpickle a segment: reuse this process's copy, or open the sender's descriptor,
    else a holder's."""
    what = f"anonymous shared-memory segment of {nbytes} bytes (the memory of tensors)"
    return attach_segment(pid, fd, key, nbytes, what=what, holders=holders)


def attach_segment(pid: int, fd: int, key: tuple[int, int], nbytes: int, *, what: str,
                   advice: str = GENERIC_ADVICE, holders: tuple = ()) -> Segment:
    """This process's Segment for the segment ``key`` that process ``pid`` holds as
    ``fd`` (its own, if it has one), else that one of the ``holders`` (``(pid, fd)`` of
    coordinators holding it) holds, tried in turn: for a user of segments that pickles
    its own reference (a SharedCounter), so that the error of a sender gone names that
    user (``what``) and its fix (``advice``); see :func:`attach_peer_fd` and
    :func:`~shared_td.storage.holders.open_first`. The holders are recorded on the
    segment, so that it is sent on with them."""
    key = tuple(key)
    segment = cached_segment(key)
    if segment is None:
        def open_route(route_pid: int, route_fd: int, advice: str) -> int:
            return attach_peer_fd(route_pid, route_fd, key, what=what, min_size=nbytes, advice=advice)

        new_fd = open_first((pid, fd), holders, open_route, what=what, key=key, advice=advice)
        segment = _register(new_fd, nbytes, key)
    if holders:
        segment.add_holders(holders)
    return segment


def add_segment_holders(key: tuple[int, int], holders) -> None:
    """Record ``holders`` (``(pid, fd)`` of coordinators) of the segment ``key``, if this
    process maps it: what an attach from a coordinator learns (the manager's descriptor),
    so that the segment, sent on by this process, is received after it exited.

    Example:
        >>> seg = Segment.create(64)
        >>> add_segment_holders(seg.key, [(1, 3)]); seg.holders
        ((1, 3),)
    """
    segment = cached_segment(tuple(key))
    if segment is not None:
        segment.add_holders(holders)


multiprocessing.reduction.ForkingPickler.register(Segment, Segment._reduce_with_duplicate)


def _receive(duplicate, key: tuple[int, int], nbytes: int, pid: int, fd: int, holders: tuple = ()) -> Segment:
    """Unpickle a segment sent by ForkingPickler (see :func:`receive_duplicate`): this
    process's Segment, or the received descriptor kept as it.

    Example:
        >>> from multiprocessing.reduction import ForkingPickler
        >>> seg = Segment.create(64)
        >>> ForkingPickler.loads(ForkingPickler.dumps(seg)) is seg
        True
    """
    what = f"anonymous shared-memory segment of {nbytes} bytes (the memory of tensors)"
    return receive_segment(duplicate, key, nbytes, pid, fd, what=what, holders=holders)


def receive_segment(duplicate, key: tuple[int, int], nbytes: int, pid: int, fd: int, *, what: str,
                    advice: str = GENERIC_ADVICE, holders: tuple = ()) -> Segment:
    """This process's Segment for a segment sent by ForkingPickler
    (:func:`receive_duplicate`; ``pid`` holds it as ``fd``): for a user of segments that
    pickles its own reference (a SharedCounter), so that the error of a sender gone names
    that user (``what``) and its fix (``advice``), as :func:`attach_segment`, whose
    routes (the sender's ``/proc``, then the ``holders``) are tried when the duplicate
    cannot be taken."""
    key = tuple(key)

    def adopt(new_fd: int) -> Segment:
        segment = _register(new_fd, nbytes, key)
        if holders:
            segment.add_holders(holders)
        return segment

    def cached(found_key: tuple) -> Segment | None:
        segment = cached_segment(found_key)
        if segment is not None and holders:
            segment.add_holders(holders)
        return segment

    return receive_duplicate(
        duplicate, key, nbytes, pid, what=what, cached=cached, adopt=adopt,
        fallback=lambda: attach_segment(pid, fd, key, nbytes, what=what, advice=advice, holders=holders))
