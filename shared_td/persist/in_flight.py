"""The writes running in the background (``memmap_(..., return_early=True)``).

Two things need to know them:

* **Another write of the same tree or prefix** waits for them (:func:`wait_for`, at
  most ``SHARED_TD_LOCK_TIMEOUT`` seconds, then a TimeoutError naming both). Two writes
  of one prefix running at once would undo each other: the later one plans against a
  directory the earlier one is still filling, and a failure of the earlier one would
  remove what the later one wrote. In sequence, the last write wins, as in tensordict.
* **The end of the program**: a background write still running when the main thread
  ends must complete. Its thread is not a daemon (the interpreter joins it), but
  ``concurrent.futures`` refuses every ``submit`` once its own exit hook has run, which
  happens before the interpreter joins the threads: the write's pool would then fail
  and the save be removed, silently. :func:`_wait_at_exit`, registered after that hook
  (``threading``'s exit hooks run last registered first), waits for every running
  write before it; one that failed says so on stderr, as nobody can read its future.

A failed write whose future is dropped without its error being read (``result()``,
``exception()``) warns (a RuntimeWarning naming the write and its error) when the future
is freed, as asyncio's "Future exception was never retrieved": else the caller that
never looks at the future would not learn that the save is missing.

Example:
    >>> import tempfile, torch, shared_td
    >>> td = shared_td.TensorDict(a=torch.ones(3), batch_size=[3])
    >>> with tempfile.TemporaryDirectory() as path:
    ...     future = td.memmap_(path, num_threads=2, return_early=True)
    ...     _ = td.memmap_(path)  # waits for the first write, then writes again
    ...     print(future.done(), td.is_memmap())
    True True
"""
from __future__ import annotations

import concurrent.futures.thread  # noqa: F401  (its exit hook first: ours, registered after, runs before it)
import os
import sys
import threading
import traceback
import warnings
import weakref
from concurrent.futures import Future
from typing import Any, Callable, Iterable

from shared_td.persist.writer_lock import lock_timeout
from shared_td.thread_pool import thread_refused


class _Write:
    __slots__ = ("future", "prefix", "nodes", "description")

    def __init__(self, future: Future, prefix: str | None, nodes: set[int], description: str):
        self.future, self.prefix, self.nodes, self.description = future, prefix, nodes, description


_guard = threading.Lock()
_running: dict[int, _Write] = {}  # id(future) -> the write
# futures of failed writes whose error no one read yet: reported at exit when still held
# then (a module-level future is never freed before the last collection that warns)
_unread: "weakref.WeakSet[_WriteFuture]" = weakref.WeakSet()


class _WriteFuture(Future):
    """The future of one background write: one whose error was set and never read
    warns once when it is freed (see the module doc)."""

    def __init__(self, description: str):
        super().__init__()
        self.description = description
        self.unread_error = False  # set before the error is, cleared by a read of it

    def set_exception(self, exception: BaseException | None) -> None:
        self.unread_error = True
        _unread.add(self)
        super().set_exception(exception)

    def result(self, timeout: float | None = None) -> Any:
        try:
            return super().result(timeout)
        finally:
            self._read()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        try:
            return super().exception(timeout)
        finally:
            self._read()

    def _read(self) -> None:
        if self.done():  # (not a read when the wait timed out)
            self.unread_error = False
            _unread.discard(self)

    def __del__(self) -> None:
        if not self.unread_error:
            return
        self.unread_error = False
        # (a warning turned into an error is reported as any error of a __del__)
        warnings.warn(
            f"shared_td: the background write ({self.description}) failed and its future "
            f"was never read, so nothing reported it: {super().exception(0)!r}. Nothing of "
            "that write was kept; call future.result() to get such an error.",
            RuntimeWarning, stacklevel=2)


def started(future: Future, prefix: str | None, nodes: Iterable[Any], description: str) -> None:
    """Record a background write of ``nodes`` (the objects of its tree) to ``prefix``
    (None: anonymous memory), until :func:`ended`."""
    write = _Write(future, prefix, {id(node) for node in nodes}, description)
    with _guard:
        _running[id(future)] = write


def ended(future: Future) -> None:
    """The write of ``future`` is over (called by its thread, before it sets the future)."""
    with _guard:
        _running.pop(id(future), None)


class Handover:
    """Who cleans up after a job handed to another thread (a background write, a leaf of
    the writer's pool): its caller, until the job's thread takes it over (the first thing
    it does), or the caller takes it back (a failure or a Ctrl-C, landing anywhere from
    the hand-over on: inside ``Thread.start``, which waits for the thread, inside a
    pool's ``submit``, or as either returns). Whichever comes first keeps it: the caller
    never undoes what a running job still owns, nor the job what its caller undid (it
    is then not run)."""

    __slots__ = ("_lock", "_owner")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: str | None = None

    def _take(self, who: str) -> bool:
        with self._lock:
            if self._owner is None:
                self._owner = who
            return self._owner == who

    def taken_by_write(self) -> bool:
        return self._take("write")

    def kept_by_caller(self) -> bool:
        """Whether the caller (failing) still owns the clean-up: the write never ran."""
        return self._take("caller")


def run_in_background(work: Callable[[], Any], description: str, thread_name: str, *,
                      prefix: str | None = None, nodes: Iterable[Any] = (),
                      on_failure: Callable[[], None] | None = None, handover: Handover) -> Future:
    """The future of ``work()`` run on a thread of its own, recorded here (see the module
    doc) from now until just before the future is set. ``on_failure()`` runs when
    ``work`` raised, before the future is set (``result()`` must not return while it
    runs); an error of its own is added to work's as a note. ``handover``: the thread
    takes it first thing; a caller that failed first (a Ctrl-C as the thread started)
    keeps the clean-up, and ``work`` never runs.

    The thread is not a daemon: the interpreter waits for it at exit (and this module
    makes sure it can still use a thread pool then). A daemon thread still freeing a
    write's replaced leaves during finalization aborts the process ("terminate called
    without an active exception").
    """
    future = _WriteFuture(description)
    thread = None

    def run() -> None:
        if not handover.taken_by_write():  # (its caller failed as it started: not run)
            future.cancel()
        if not future.set_running_or_notify_cancel():
            ended(future)
            return
        try:
            result = work()
        except BaseException as error:  # delivered by future.result()
            if on_failure is not None:
                try:
                    on_failure()
                except BaseException as failure:
                    error.add_note(f"The clean-up after this failed write failed too: {failure!r}")
            ended(future)
            future.set_exception(error)
        else:
            ended(future)
            future.set_result(result)

    try:
        # (inside the try: a Ctrl-C landing as started() returned left the write recorded
        # with a future never set: the program's exit waited for it forever)
        started(future, prefix, nodes, description)
        thread = threading.Thread(target=run, daemon=False, name=thread_name)
        thread.start()
    except BaseException as error:
        if handover.kept_by_caller():  # (else the write runs: it owns the record)
            ended(future)  # (nothing when started() never recorded it)
            if type(error) is RuntimeError and thread is not None and thread.ident is None:
                # refused by the system (RLIMIT_NPROC, memory): say so, and which limit
                raise thread_refused(error, description, "write without return_early=True (the calling "
                                     "thread then writes, and the call returns the result itself)") from error
        raise
    return future


def _overlaps(first: str, second: str) -> bool:
    """One of the two directories is the other or inside it."""
    return first == second or first.startswith(second.rstrip("/") + "/") or second.startswith(first.rstrip("/") + "/")


def wait_for(obj: Any, prefix: str | None) -> None:
    """Wait for the background writes of ``obj`` (a node of their tree) or of a
    directory that is ``prefix``, inside it or holds it (an absolute path; None: none).
    A failed one is not this call's error (its own future raises it).

    Raises:
        TimeoutError: one still runs after ``SHARED_TD_LOCK_TIMEOUT`` seconds (600).
    """
    if not _running:  # the common case: nothing runs in the background
        return
    with _guard:
        writes = [write for write in _running.values()
                  if id(obj) in write.nodes or (prefix is not None and write.prefix is not None
                                                and _overlaps(prefix, write.prefix))]
    if not writes:
        return
    timeout = lock_timeout()
    done, pending = concurrent.futures.wait([write.future for write in writes], timeout)
    if pending:
        names = ", ".join(write.description for write in writes if write.future in pending)
        raise TimeoutError(
            f"A write to {prefix or 'shared memory'} waited {timeout:g} s for an earlier "
            f"memmap_(..., return_early=True) of the same tensordict or directory ({names}), "
            "which still runs. Nothing was written. Wait for that write (future.result()) "
            "before writing again, or raise SHARED_TD_LOCK_TIMEOUT."
        )


def _wait_at_exit() -> None:
    """Let every background write complete before ``concurrent.futures`` stops its
    pools; report those that failed (their futures will never be read)."""
    with _guard:
        writes = list(_running.values())
    for write in writes:
        error = write.future.exception()  # waits
        if error is not None:
            print(f"shared_td: the background write ({write.description}) running when the "
                  "program ended failed; nothing of it was kept:", file=sys.stderr)
            traceback.print_exception(error, file=sys.stderr)
    for future in list(_unread):  # failed before the end, its future held and never read
        if future.unread_error:
            error = future.exception()  # (a read: it will not warn again when freed)
            print(f"shared_td: the background write ({future.description}) failed and its "
                  "future was never read; nothing of it was kept:", file=sys.stderr)
            traceback.print_exception(error, file=sys.stderr)


threading._register_atexit(_wait_at_exit)


def _after_fork_in_child() -> None:
    """A fork child runs none of its parent's background writes (their threads are the
    parent's; the parent completes them): it forgets them. Else the child's exit
    (``_wait_at_exit``: a normal exit, a multiprocessing or DataLoader worker's end) and
    its next write of the same tree or prefix waited for a future nobody sets."""
    global _guard
    _guard = threading.Lock()  # (a thread of the parent may have held it at the fork)
    _running.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
