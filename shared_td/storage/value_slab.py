"""ValueSlab: the one memfd that holds the shared non-tensor values made together.

``memmap_(share_non_tensor=True)`` shares every non-tensor value of a tree at once; each
value is a cell (:class:`~shared_td.storage.shared_value.SharedValue`) of one slab, so a
tree costs one memfd, one mapping and one descriptor handed to the coordinator, not one
of each per value (a memfd alone cost ~30 us to make on the machine where this was
measured, more than the rest of sharing a small value).

The layout::

    bytes 0 .. 63        slab header: word 0 = end (the first byte not allocated yet),
                         word 1 = the number of cells, word 2 = MAGIC (what tells a
                         slab from another memfd handed to attach_slab)
    64 + 64 * i ...      cell i's header (see shared_value: version, two slots)
    then                 payload regions, each of one slot of one cell

* Regions. Each slot of a cell owns one region (offset, capacity). A value that does not
  fit its slot's region gets a new one at the end (:meth:`ValueSlab.allocate`, under the
  slab's lock, reserved with ``posix_fallocate`` before ``end`` moves: a full memory
  fails there, with nothing published), 1.5 times the old capacity at least (a value
  that grows a little at each write reallocates rarely); the old region's memory is then
  given back (:func:`~shared_td.platform.free_bytes`): a region of a page or more starts
  on a page and is whole pages, so all of it is freed. Memory stays below the live value
  plus the next one, each at most 1.5 times the largest written to its slot, plus a
  page per growth of a value below a page; the file's size (sparse) grows with each
  reallocation.
* Crashes. A writer killed after ``end`` moved leaves its new region unused (memory the
  slab keeps until it is freed: the last process holding it closes it); ``end`` is one
  aligned 8-byte store. A slot's offset is stored before its capacity: a writer killed
  between the two leaves the new offset with the old, smaller capacity, never an old
  region with a new one's capacity.
* What another process of the user may do: a memfd that is not a slab (no MAGIC word), a
  cell naming bytes outside the allocated regions (:meth:`ValueSlab.check_region`) are a
  :class:`~shared_td.errors.SegmentUnavailableError`, never read, written or freed; the
  memfd is sealed against shrinking (:func:`~shared_td.platform.new_memfd`), so a
  truncation through ``/proc`` cannot make the mapped headers raise SIGBUS.
* Locks: byte 0 is the slab's allocation lock; cell ``i`` has bytes ``1 + 3i .. 3 + 3i``
  (every lock a :class:`~shared_td.platform.ByteLock`: threads, then open-file-description
  lock). Lock order: a cell's locks, then the slab's.
* Lifetime: cells hold their slab; the slab holds its live cells weakly (one object per
  cell and process). The memfd, its descriptor, its holders (the coordinators that
  adopted it) and how it is reopened by another process are the slab's; a cell's memory
  lives as long as its slab, i.e. as long as any cell of it is held anywhere.
"""
from __future__ import annotations

import ctypes
import mmap
import multiprocessing.reduction
import os
import struct
import threading
import weakref
from typing import Callable

from shared_td.errors import SegmentUnavailableError
from shared_td.finalizers import Finalizer
from shared_td.platform import ByteLock, free_bytes, map_shared_bytes, reopen_description, unmap_bytes
from shared_td.storage.anonymous import GENERIC_ADVICE, attach_peer_fd, create_memfd
from shared_td.storage.cache import InodeCache
from shared_td.storage.duplicates import held_duplicate, receive_duplicate
from shared_td.storage.fd_mapping import map_error
from shared_td.storage.files import allocate, pwrite_all
from shared_td.storage.holders import open_first

__all__ = ["ValueSlab", "attach_slab", "keep_slab", "region_capacity"]

SLAB_HEADER = 64
#: bytes of each cell's header
CELL_HEADER = 64
_WORDS = struct.Struct("=3Q")  # end, number of cells, MAGIC
#: word 2 of a slab's header: another memfd (a Segment's, a counter's) named by a forged
#: or mistaken pickle is refused, not read and written as cells
MAGIC = int.from_bytes(b"stdslab1", "little")
_WHAT = "a shared non-tensor value"


#: payloads of this many bytes or more are written from themselves by ValueSlab.create,
#: not copied into its image of the memfd first
_WRITTEN_APART = 1 << 20


def _place(end: int, nbytes: int) -> tuple[int, int]:
    """(offset, capacity) of a new region of at least ``nbytes`` at or after ``end``: 8-byte
    aligned, or whole pages on a page boundary from a page up (so that freeing it frees
    all of it)."""
    if nbytes >= mmap.PAGESIZE:
        page = mmap.PAGESIZE
        return -(-end // page) * page, -(-nbytes // page) * page
    return -(-end // 8) * 8, max(8, -(-nbytes // 8) * 8)


def region_capacity(nbytes: int, capacity: int) -> int:
    """The capacity to ask for when ``nbytes`` does not fit a region of ``capacity``."""
    return max(nbytes, capacity + capacity // 2)


class ValueSlab:
    """The memfd holding cells of shared values (see the module doc); private: made by
    :meth:`create` or reopened by :func:`attach_slab`.

    Example:
        >>> slab = ValueSlab.create([b"first", b"second"], lambda offset, length, capacity: struct.pack("=Q", offset))
        >>> offsets = [int.from_bytes(os.pread(slab.fd, 8, 64 + 64 * i), "little") for i in range(slab.cells)]
        >>> slab.cells, [os.pread(slab.fd, 6, offset) for offset in offsets]
        (2, [b'first\\x00', b'second'])
    """

    def __init__(self, fd: int, holders: tuple = ()):
        # Takes ownership of fd.
        self.fd = fd
        self._finalizer = Finalizer(self, os.close, fd)
        # not at interpreter exit: a cell put on a queue just before main returns is
        # pickled by the feeder thread after atexit hooks (os.dup(fd) would be EBADF);
        # the kernel closes it at exit
        self._finalizer.atexit = False
        try:
            stat = os.fstat(fd)
            self.key = (stat.st_dev, stat.st_ino)
            _end, self.cells, magic = _WORDS.unpack(os.pread(fd, _WORDS.size, 0).ljust(_WORDS.size, b"\0"))
            self._mapped = SLAB_HEADER + CELL_HEADER * self.cells
            if magic != MAGIC or not self.cells or stat.st_size < self._mapped:
                raise SegmentUnavailableError(
                    f"The memfd (inode {stat.st_ino}, {stat.st_size} bytes) is not a slab of shared "
                    f"non-tensor values ({'its mark, ' if magic == MAGIC else 'no slab mark, '}{self.cells} "
                    "cells): refused.")
            # Mapped once: the headers read by every get(). Their bytes were reserved at
            # creation, so touching them can never raise SIGBUS.
            try:
                self._address = map_shared_bytes(fd, self._mapped)
            except OSError as error:  # ENOMEM: RLIMIT_AS, vm.max_map_count (named, as for a segment)
                raise map_error(error.errno, fd, self._mapped, True,
                                f"the slab of shared non-tensor values (inode {stat.st_ino})") from None
        except BaseException:
            self._finalizer()
            raise
        unmap = Finalizer(self, unmap_bytes, self._address, self._mapped)
        unmap.atexit = False  # exit unmaps anyway; a late get() must not find it gone
        self._end = ctypes.c_uint64.from_address(self._address)
        self._lock = ByteLock(fd, 0)
        # (pid, fd) of other processes that hold the memfd (see the holders property)
        self._holders: tuple[tuple[int, int], ...] = tuple(holders)
        # set while an adopter hands this slab to a coordinator in the background: a
        # call that returns once it is done (raising what went wrong); see holders
        self._handing_over: Callable[[], None] | None = None
        self._live: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # index -> cell
        self._live_lock = threading.Lock()

    @classmethod
    def create(cls, payloads: list[bytes], cell_header: Callable[[int, int, int], bytes]) -> "ValueSlab":
        """A new slab of one cell per payload, cell ``i``'s header being
        ``cell_header(offset, length, capacity)`` of the region its payload was written to.

        The whole memfd is reserved with ``posix_fallocate``: a full memory is a
        :class:`~shared_td.storage.files.StorageFullError` here, never a SIGBUS. The
        headers and the small payloads are written in one ``pwrite``; payloads of
        :data:`_WRITTEN_APART` bytes or more are placed after them and written from
        themselves (copied into that image, a big value was held twice more at once).
        """
        order = sorted(range(len(payloads)), key=lambda i: len(payloads[i]) >= _WRITTEN_APART)  # (stable)
        end = SLAB_HEADER + CELL_HEADER * len(payloads)
        regions: list = [None] * len(payloads)
        image_size = None  # where the first payload written apart starts
        for index in order:
            offset, capacity = _place(end, len(payloads[index]))
            if image_size is None and len(payloads[index]) >= _WRITTEN_APART:
                image_size = offset
            regions[index] = (offset, capacity)
            end = offset + capacity
        image = bytearray(end if image_size is None else image_size)
        _WORDS.pack_into(image, 0, end, len(payloads), MAGIC)
        apart = []
        for index, (payload, (offset, capacity)) in enumerate(zip(payloads, regions)):
            header = SLAB_HEADER + CELL_HEADER * index
            image[header:header + CELL_HEADER] = cell_header(offset, len(payload), capacity).ljust(CELL_HEADER, b"\0")
            if len(payload) >= _WRITTEN_APART:
                apart.append((payload, offset))
            else:
                image[offset:offset + len(payload)] = payload
        fd = create_memfd(f"shared_td-value-{os.getpid()}", end, _WHAT)
        try:
            pwrite_all(fd, image, 0, where=_WHAT)
            for payload, offset in apart:
                pwrite_all(fd, payload, offset, where=_WHAT)
        except BaseException:
            os.close(fd)
            raise
        return cls(fd)

    def header_address(self, index: int) -> int:
        """The address of cell ``index``'s header in this process."""
        return self._address + SLAB_HEADER + CELL_HEADER * index

    def cell(self, index: int, make: Callable[["ValueSlab", int], object]) -> object:
        """This process's one object of cell ``index`` (``make(self, index)`` if none lives)."""
        if type(index) is not int or not 0 <= index < self.cells:
            raise SegmentUnavailableError(f"{_WHAT} names cell {index!r} of a slab of {self.cells}: refused.")
        with self._live_lock:
            found = self._live.get(index)
            if found is None:
                found = self._live[index] = make(self, index)
            return found

    def allocate(self, nbytes: int) -> tuple[int, int]:
        """(offset, capacity) of a new region of at least ``nbytes`` bytes, reserved (see
        the module doc); a full memory raises here, ``end`` unchanged. Called with the
        writing cell's write lock held (the lock order)."""
        lock = self._lock
        # this shape exactly (see ByteLock): a signal handler or finalizer growing another
        # cell of this slab while this thread is inside allocate() would re-enter both
        # locks (an RLock, and an OFD lock this description holds) and get the same region
        if lock.threads._is_owned():
            raise lock.reentered("Allocating room for a shared non-tensor value")
        with lock.threads:
            try:
                lock.take()
                offset, capacity = _place(self._end.value, nbytes)
                allocate(self.fd, offset, capacity, _WHAT, anonymous=True)
                self._end.value = offset + capacity
            finally:
                lock.give_back()
        return offset, capacity

    def check_region(self, offset: int, capacity: int) -> None:
        """Refuse a region that is not among the allocated ones (after the headers, before
        ``end``): the header was written by something else than shared_td, which a
        process of the same user can do; reading, writing or freeing it would hit other
        cells or the headers."""
        if offset < self._mapped or offset + capacity > self._end.value:
            raise SegmentUnavailableError(
                f"{_WHAT} (inode {self.key[1]}) names bytes {offset}..{offset + capacity}, outside "
                f"the regions of its slab ({self._mapped}..{self._end.value}): the memfd was "
                "written by something else than shared_td; refused.")

    def free(self, offset: int, capacity: int) -> None:
        """Give back the memory of a region no reader can be in any more (whole pages)."""
        if capacity >= mmap.PAGESIZE:
            free_bytes(self.fd, offset, capacity)

    # ------------------------------------------------------------ holders
    @property
    def holders(self) -> tuple[tuple[int, int], ...]:
        """(pid, fd) of other processes that hold the memfd for as long as they live
        (coordinators), tried in order when the pickling process is gone.

        A slab that an adopter is still handing to a coordinator in the background (see
        :meth:`handing_over`) is waited for first, so a pickle names its coordinator;
        what went wrong in the background is raised here, once.
        """
        wait = self._handing_over
        if wait is not None:
            try:
                wait()
            finally:
                self._handing_over = None
        return self._holders

    def add_holders(self, holders) -> None:
        """Record more processes that hold this slab (e.g. a coordinator that adopted it)."""
        self._holders = tuple(dict.fromkeys((*self._holders, *map(tuple, holders))))

    def handing_over(self, wait: Callable[[], None]) -> None:
        """Mark this slab as being handed to a coordinator in the background:
        ``wait()`` returns once that is done (or raises why it failed); :attr:`holders`
        (and so a pickle of any of its cells) calls it first."""
        self._handing_over = wait

    def _after_fork(self) -> None:
        # A fork child shares our open file description, hence our locks: give it its own
        # (see shared_td.platform), and fresh thread locks.
        try:
            reopen_description(self.fd)
            error = None
        except OSError as err:
            error = err
        self._lock.renew_after_fork(error)
        self._live_lock = threading.Lock()
        for cell in list(self._live.values()):
            cell._renew_locks(error)

    def __reduce__(self):
        return attach_slab, (os.getpid(), self.fd, self.key, self.holders)

    def _reduce_with_duplicate(self):
        # multiprocessing's ForkingPickler (registered below): a duplicate descriptor that
        # outlives this object, so that the receiver needs only the sender process. The
        # holders first: reading them can raise (a failed hand-over), and a DupFd made
        # before would stay registered with the resource sharer (an fd and the memfd's
        # memory) until this process exits
        # (/proc route: the duplicate's own number, see held_duplicate)
        holders = self.holders
        duplicate, held = held_duplicate(self.fd)
        return _receive, (duplicate, self.key, os.getpid(), held, holders)

    def __repr__(self) -> str:
        return f"ValueSlab(fd={self.fd}, inode={self.key[1]}, cells={self.cells}, holders={list(self._holders)})"


# (st_dev, st_ino) -> this process's ValueSlab of that memfd; a fork child reopens its
# own description of each and gets fresh thread locks (a fork taken while another thread
# was reading or writing a cell)
_CACHE = InodeCache(after_fork="_after_fork")


def keep_slab(slab: ValueSlab) -> ValueSlab:
    """Record ``slab`` as this process's one of its memfd, unless another thread recorded
    one first (then ``slab`` is closed and that one returned)."""
    stored = _CACHE.put_if_absent(slab.key, slab)
    if stored is not slab:
        slab._finalizer()
    return stored


def attach_slab(pid: int, fd: int, key: tuple[int, int], holders: tuple = ()) -> ValueSlab:
    """This process's slab ``key``: its own, else opened through process ``pid``'s
    descriptor ``fd``, else through a holder's. ``holders`` are recorded on it either way
    (a pickle made after a coordinator adopted the slab names it: this process, sending
    the slab on, names it too).

    Example:
        >>> slab = ValueSlab.create([b"x"], lambda offset, length, capacity: b"")
        >>> _ = keep_slab(slab)
        >>> attach_slab(os.getpid(), slab.fd, slab.key, ((4242, 7),)) is slab, slab.holders
        (True, ((4242, 7),))
    """
    key = tuple(key)
    slab = _CACHE.get_or_create(key, lambda: ValueSlab(_reopen(key, pid, fd, holders), holders))
    if holders:
        slab.add_holders(holders)
    return slab


def _receive(duplicate, key: tuple[int, int], pid: int, fd: int, holders: tuple = ()) -> ValueSlab:
    """Unpickle a slab sent by ForkingPickler: this process's, else the duplicate
    descriptor received, else (it cannot be taken) :func:`attach_slab`'s routes."""
    key = tuple(key)
    slab = receive_duplicate(duplicate, key, SLAB_HEADER + CELL_HEADER, pid, what=_WHAT, cached=_CACHE.get,
                             adopt=lambda new_fd: keep_slab(ValueSlab(new_fd, holders)),
                             fallback=lambda: attach_slab(pid, fd, key, holders))
    if holders:
        slab.add_holders(holders)  # (as attach_slab records them)
    return slab


multiprocessing.reduction.ForkingPickler.register(ValueSlab, ValueSlab._reduce_with_duplicate)


def _reopen(key: tuple[int, int], pid: int, fd: int, holders: tuple) -> int:
    """Our own descriptor on slab ``key``: through process ``pid``'s descriptor ``fd``,
    else through each holder's in turn (:func:`~shared_td.storage.holders.open_first`)."""
    def open_route(route_pid: int, route_fd: int, advice: str) -> int:
        return attach_peer_fd(route_pid, route_fd, key, what="shared non-tensor value", advice=advice)

    return open_first((pid, fd), holders, open_route, what="shared non-tensor value", key=key, advice=GENERIC_ADVICE)
