"""The coordinator's manager process: its private directory, its serving loop, the sweep.

Its private directory is locked (``flock``) by the manager for its whole life, and the
sweep of dead managers' directories removes only those it can lock
(:func:`sweep_dead_dirs`): the kernel drops a dead process's lock, whatever killed it.

:class:`~shared_td.coordinator.process.ServerProcess` runs this file as a script in a
fresh interpreter: the server listens on a Unix socket in a new private directory, serves
one :class:`~shared_td.coordinator.registry.Registry` to every client over the wire
protocol of ``multiprocess.managers`` (under the fixed id :data:`REGISTRY_ID`; its accept
loop and handshake are ours, see :mod:`shared_td.coordinator.accepting`), and stops
on a shutdown request or once the process that started it is gone (even by SIGKILL),
removing its directory.

Why a fresh interpreter and not a fork of the process that wants a coordinator: forking
took ~15 ms here, but the child would keep, for the life of the process, copy-on-write
copies of every private page its creator later writes or frees (a trainer's weights,
buffers: up to its whole memory) and every descriptor the creator had open (pipes whose
readers then never see EOF, segments never freed). ``spawn`` would re-import the user's
``__main__`` (a script without the ``if __name__ == "__main__"`` guard would fail) and
torch (~2.5 s). This module and the registry import only the standard library and
``multiprocess`` (never torch, never the ``shared_td`` package, never a container: what
is published reaches the manager as plain data), so the interpreter starts in ~0.1 s.

The platform module is loaded from its file (:func:`_load_torch_free`), and the
registry and the accept loop from theirs beside this one by the platform module's own
loader (``platform._load_sibling``): importing them through the package would import
``shared_td``, hence torch.
"""
from __future__ import annotations

import importlib.util
import os
import re
import resource
import shutil
import signal
import stat
import sys
import tempfile
import threading
import time


def _load_torch_free(full_name: str, *path_parts: str):
    """The torch-free module ``full_name`` of the package, at ``path_parts`` below it:
    through the package when this module was imported through it, else (this file runs
    as a script) loaded alone from its path. Only for the platform module, which then
    loads the others (its ``_load_sibling``): it cannot load itself."""
    if __package__:
        return importlib.import_module(full_name)
    package_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location(full_name, os.path.join(package_dir, *path_parts))
    module = importlib.util.module_from_spec(spec)
    sys.modules[full_name] = module  # the registry finds platform there (see registry.py)
    spec.loader.exec_module(module)
    return module


# The operating-system primitives (the package's one platform module), then the
# registry's names that the manager process uses (VersionTable: also what tests of the
# table under a killed writer build).
platform = _load_torch_free("shared_td.platform", "platform.py")
_registry = platform._load_sibling("coordinator.registry")
Registry, VersionTable = _registry.Registry, _registry.VersionTable
# multiprocess's server with our accept loop and handshake (see accepting.py)
_accepting = platform._load_sibling("coordinator.accepting")

__all__ = ["DIR_PATTERN", "REGISTRY_ID", "make_private_dir", "serve", "sweep_dead_dirs"]

#: Name of a coordinator's private directory under ``tempfile.gettempdir()``:
#: ``shared_td-coord-<manager pid>-<mkdtemp suffix>``. The sweep touches nothing else
#: but the directories that :func:`make_private_dir` makes before it renames them.
DIR_PREFIX = "shared_td-coord-"
DIR_PATTERN = re.compile(r"^shared_td-coord-(\d+)-[a-z0-9_]{8}$")
#: A directory :func:`make_private_dir` has made (``tempfile.mkdtemp``: 8 characters of
#: [a-z0-9_] after the prefix) and not renamed yet; its maker may have been killed.
NEW_DIR_PATTERN = re.compile(r"^shared_td-coord-new-[a-z0-9_]{8}$")
#: Seconds since its last change (mtime: its making, nothing changes it after) before an
#: unlocked ``new-`` directory counts as abandoned. Its live maker holds no lock only
#: between its mkdtemp and its flock, two system calls apart: a maker stalled longer
#: than this there (stopped, swapped out) finds its directory taken and makes another.
NEW_DIR_GRACE_S = 60.0

#: The server-side id of the registry object; fixed, so clients need no ``create`` call.
REGISTRY_ID = "shared_td-registry"

# How often the manager checks that the process that started it is still alive.
_PARENT_POLL_S = 0.2

#: The registry methods clients may call.
EXPOSED = ("publish", "attach", "layout", "names", "unpublish", "info", "version", "adopt_cells")


# ----------------------------------------------------------------------------- sweep

def sweep_dead_dirs(root: str | None = None) -> list[str]:
    """Remove private directories of coordinators whose manager process is dead, and
    the directories of makers killed before they renamed theirs.

    Only entries of ``root`` (default ``tempfile.gettempdir()``) named exactly like ours
    (:data:`DIR_PATTERN`, :data:`NEW_DIR_PATTERN`), that are real directories owned by
    this user, are considered. A live manager holds the ``flock`` of its directory for
    its whole life (see :func:`make_private_dir`) and the kernel drops it when that
    process dies, however it dies: a directory is removed only by a sweeper that takes
    that lock. The pid in the name alone cannot say: a manager in another pid namespace
    sharing this temp dir (two containers with one /tmp volume) has a pid that means
    nothing here. A pid alive here skips the directory at once (never a wrong removal: at
    worst a reused pid keeps a dead directory until a later sweep).

    A ``new-`` directory has no pid: it is removed when nobody holds its lock and it was
    made over :data:`NEW_DIR_GRACE_S` ago (a younger one may be between the mkdtemp and
    the flock of a live maker; it is never even locked by the sweep), and only while it is
    empty, as its maker leaves it. Returns the removed paths.

    Example:
        >>> sweep_dead_dirs()  # doctest: +SKIP
        ['/tmp/shared_td-coord-41234-k2j4h5g6']
    """
    root = root or tempfile.gettempdir()
    removed = []
    try:
        entries = os.listdir(root)
    except OSError:
        return removed
    for entry in entries:
        path = os.path.join(root, entry)
        match = DIR_PATTERN.match(entry)
        if match is not None:
            if not platform.pid_alive(int(match.group(1))) and _remove_unheld(path, abandoned_before=None):
                removed.append(path)
        elif NEW_DIR_PATTERN.match(entry) and _remove_unheld(path, abandoned_before=time.time() - NEW_DIR_GRACE_S):
            removed.append(path)
    return removed


def _remove_unheld(path: str, *, abandoned_before: float | None) -> bool:
    """Remove the directory ``path`` if it is ours to sweep and we can take its lock;
    whether it was removed. ``abandoned_before``: for a ``new-`` directory, the time
    (``time.time()``) it must have been made before; it is then removed only if empty."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    # never follow a link, never touch another user's directory, never lock a new-
    # directory that a live maker may be about to lock
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or \
            (abandoned_before is not None and st.st_mtime >= abandoned_before):
        return False
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        # the directory judged above, still at path once locked (held while removing:
        # no manager or maker can hold a directory that we hold)
        if not os.path.samestat(os.fstat(fd), st) or not platform.try_flock(fd) or not _still_at(fd, path):
            return False  # replaced, or its manager lives in a pid namespace we do not see
        if abandoned_before is None:
            shutil.rmtree(path, ignore_errors=True)
            return True
        try:
            os.rmdir(path)  # a maker leaves it empty: anything in it is not ours
        except OSError:
            return False
        return True
    finally:
        os.close(fd)


def _still_at(fd: int, path: str) -> bool:
    """Whether the directory open as ``fd`` is the one at ``path`` now."""
    try:
        return os.path.samestat(os.fstat(fd), os.lstat(path))
    except OSError:
        return False


def make_private_dir(root: str | None = None) -> tuple[str, int]:
    """A new 0700 directory ``shared_td-coord-<pid>-<8 characters>`` under ``root``
    (default ``tempfile.gettempdir()``), and a descriptor on it that holds its ``flock``:
    the caller keeps it open for its whole life, so that :func:`sweep_dead_dirs` of any
    process (of any pid namespace) leaves the directory alone while the caller lives.

    The directory is made and locked under a ``new-`` name, then renamed to its final
    name: a sweeper never sees it unlocked under that name. Killed before the rename,
    this process leaves the ``new-`` directory, which a sweep removes once it is older
    than :data:`NEW_DIR_GRACE_S` (and unlocked). Stalled longer than that before its
    flock, this process finds the directory locked or removed by a sweeper: it leaves
    it to the sweeper and makes another.
    """
    root = root or tempfile.gettempdir()
    while True:
        starting = tempfile.mkdtemp(prefix=f"{DIR_PREFIX}new-", dir=root)
        try:
            fd = os.open(starting, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            continue  # swept already (see above): the sweeper's, not ours
        try:  # (fd is closed once, after it: never in it and again in its handler)
            ours = platform.try_flock(fd) and _still_at(fd, starting)
            if ours:
                final = os.path.join(root, f"{DIR_PREFIX}{os.getpid()}-{starting[-8:]}")
                if not os.path.lexists(final):  # (a rename onto an empty directory replaces it)
                    os.rename(starting, final)  # the lock belongs to the inode: it follows
                    return final, fd
        except BaseException:
            os.close(fd)
            shutil.rmtree(starting, ignore_errors=True)
            raise
        os.close(fd)
        if ours:
            os.rmdir(starting)  # that name is taken: draw another
        # (else a sweeper holds it or removed it, see above: draw another)


# ----------------------------------------------------------------------------- server

def serve(authkey: bytes, report, parent: int) -> None:
    """Run the coordinator server in this process until it is shut down or its parent
    (the process of pid ``parent``, which started it) dies; ``report(address)`` is
    called once it listens."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the parent
    _raise_descriptor_limit()
    sweep_dead_dirs()
    directory, lock_fd = make_private_dir()  # lock_fd: held until this process ends
    server = None
    try:
        server = _accepting.Server({}, os.path.join(directory, "sock"), authkey, "pickle")
        # Pin the registry under a fixed id with a refcount no client ever drops:
        # clients then need no create/incref/decref, and a forked client that
        # inherited a connection can never unbalance a refcount.
        server.id_to_obj[REGISTRY_ID] = (Registry(), EXPOSED, None)
        server.id_to_refcount[REGISTRY_ID] = 1
        # its threads first: a manager that cannot start them (a low RLIMIT_AS it
        # inherited) exits before it reports, so that start() says so, not the first call
        server.start_accepting()
        threading.Thread(target=_watch_parent, args=(server, parent), daemon=True).start()
        report(server.address)
        server.serve_forever()  # returns after a shutdown request
    finally:
        if server is not None:
            # the listener's own finalizer unlinks the socket: run it before rmtree
            try:
                server.listener.close()
            except OSError:
                pass
        shutil.rmtree(directory, ignore_errors=True)
        os.close(lock_fd)


def main() -> None:
    """Entry point of this file run as a script: the authkey comes on stdin, the pid of
    the process that started it is the last argument, the address goes to stdout as one
    line. That pid is not ``os.getppid()`` read here: a parent killed before this line
    ran has handed this process to the reaper already, whose pid a watch would then
    compare with for ever (the server outlived its killed parent)."""
    parent = int(sys.argv[-1])
    authkey = sys.stdin.buffer.read(32)
    sys.stdin.close()

    def report(address: str) -> None:
        try:
            sys.stdout.write(address + "\n")
            sys.stdout.flush()
        except BrokenPipeError:
            # the owner was killed before it read the address: stop quietly (no
            # traceback, nor one at exit when Python flushes stdout again)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            raise SystemExit(0) from None

    try:
        serve(authkey, report, parent)
    except SystemExit:
        pass


def _raise_descriptor_limit() -> None:
    # The manager holds one descriptor per adopted cell and segment: use the hard limit.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            pass


def _watch_parent(server, parent: int) -> None:
    """Stop the server once the process that started it is gone (even by SIGKILL).

    The manager holds anonymous memory for its creator's job; outliving it would keep
    that memory until reboot. ``serve_forever`` then exits cleanly, removing the
    private directory.
    """
    while os.getppid() == parent:
        time.sleep(_PARENT_POLL_S)
    server.stop_event.set()  # (made by start_accepting, before this thread started)


if __name__ == "__main__":
    main()
