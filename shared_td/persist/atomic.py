"""Atomic rewrites of a prefix: a sibling directory, a file lock, a swap.

``memmap_(prefix, atomic=True)`` writes the whole tree into a new directory next to
``prefix`` and then swaps it in, so a failure or a SIGKILL at any moment leaves ``prefix``
as it was or as the new complete version.

* **What may be replaced**: a missing or empty directory, or one whose meta.json is a
  save of tensordict or shared_td (:func:`shared_td.persist.format.not_a_save`: it parses,
  its ``_type`` is known and the fields of that type are there). Anything else is a
  :class:`~shared_td.errors.AtomicWriteError` (a RuntimeError) naming the prefix and what
  it holds, and nothing is touched.
* **Lock**: writers of one prefix serialise on ``.<name>.lock`` beside it (never inside
  the directory being swapped), through ``filelock``. The lock only orders writers;
  readers rely on the rename alone (file locks do not work on every filesystem). The
  lock file is created (or opened) with ``O_NOFOLLOW``: a symlink planted there is an
  error, never followed (it could make a writer truncate or lock another file).
* **Swap**: ``renameat2(RENAME_EXCHANGE)`` (Linux), so ``prefix`` never goes missing;
  where the filesystem refuses it, two renames (``prefix`` is missing for a moment).
* **A symlinked prefix**: a prefix that is a symlink is resolved once, before the lock
  is taken, and the directory it points to is replaced: the lock, the staging directory
  and the swap live beside the link's target, the link itself is never replaced or
  removed, and the result's files are named under the target. A dangling symlink is
  refused (FileNotFoundError). ``gc(prefix)`` looks beside both the link and its target.
* **Permissions**: a new prefix gets the mode, group and setgid bit that ``os.makedirs``
  would give it (umask, parent's setgid); a rewrite gives the new version the replaced
  directory's mode bits (setgid and sticky included) and group, and its sub-directories
  and files are created as a plain ``makedirs``/``open`` inside it would be. The owner
  becomes the writer (only root could keep another owner); a group the writer may not
  give is a PermissionError before anything is written.
* **Clean-up**: a failed write removes its staging directory with :func:`remove_tree`,
  which never holds more than two descriptors (``shutil.rmtree`` holds two per level),
  and two descriptors are kept open from the start of the write for it: a write that
  failed because the process ran out of descriptors still cleans up. A clean-up that
  fails anyway is added as a note to the raised error (after a successful swap, a
  RuntimeWarning), naming what is left; gc removes it once the writer has exited.
* **Leftovers**: temporary directories are named ``.<name>.shared_td-<kind>-<pid>-<rand>``
  (``<rand>``: 12 hex digits, mkdtemp's 8 characters for ``old``); only names exactly
  of this form are ever touched (a user's ``.x.shared_td-new-1-mydata`` is not ours),
  and an ``-old-`` one only while it holds nothing but ``tree``. Those of dead writers
  are removed by the next atomic write (under the lock) and by ``shared_td.gc(prefix)``
  (a writer killed between the fallback's two renames leaves ``prefix`` missing until
  then: the sweep moves the old version back). Nothing outside prefix's parent
  directory is touched. ``gc`` returns only what it removed and raises an OSError
  naming a leftover it could not remove; with nothing to remove and no lock file it
  takes no lock (creates none: a read-only directory is no error). Writing needs
  prefix's parent directory writable (lock file, staging directory): a PermissionError
  says so, naming it. Lock files stay (every writer reuses them);
  ``gc(prefix, remove_lock=True)`` (``shared-td gc``) removes one no process holds.
* **Not durable**: files are not synced, so this guards against a killed process, not
  a power failure.
"""
from __future__ import annotations

import errno
import os
import re
import secrets
import stat
import tempfile
import warnings

import filelock

from shared_td.errors import AtomicWriteError
from shared_td.persist import format as fmt
from shared_td.persist.format import lock_path
from shared_td.persist.lock_probe import lock_is_held, remove_unheld_lock
from shared_td.platform import pid_alive, rename_exchange
from shared_td.storage.removal import remove_tree

#: Seconds a writer waits for another writer of the same prefix before TimeoutError.
#: Override per process with the environment variable SHARED_TD_LOCK_TIMEOUT.
DEFAULT_LOCK_TIMEOUT = 600.0

_TAG = "shared_td"


def prefix_lock(prefix: str, timeout: float | None = None) -> filelock.BaseFileLock:
    """The inter-process lock that orders atomic writers of ``prefix``; its file is
    created now if missing (:func:`create_lock_file`)."""
    if timeout is None:
        timeout = float(os.environ.get("SHARED_TD_LOCK_TIMEOUT", DEFAULT_LOCK_TIMEOUT))
    path = lock_path(prefix)
    # filelock 3.x (3.22 still) sets the file's mode to its ``mode`` argument (0o644 by
    # default) at every acquire, taking away the group write of a 0o002 umask: given
    # the file's own mode, it changes nothing
    return filelock.FileLock(path, timeout=timeout, mode=create_lock_file(path))


class acquired:
    """``with acquired(prefix):`` holds the writer lock; a clear TimeoutError on expiry."""

    def __init__(self, prefix: str, timeout: float | None = None):
        self.lock = prefix_lock(prefix, timeout)

    def __enter__(self) -> "acquired":
        while True:
            try:
                self.lock.acquire()
            except PermissionError as error:  # an existing lock file we may not open to write
                raise PermissionError(error.errno, (
                    f"Cannot lock {self.lock.lock_file}: this process may not open it for writing "
                    f"({error.strerror}). Every writer of a prefix opens its lock file so: make it "
                    "writable by them (chmod), or remove it (the next writer makes a new one).")) from None
            except filelock.Timeout:
                raise TimeoutError(
                    f"Another writer has held the lock {self.lock.lock_file} for more than "
                    f"{self.lock.timeout:.0f} s: an atomic write of the same prefix is still "
                    "running. Wait for it, or raise SHARED_TD_LOCK_TIMEOUT."
                ) from None
            if self._holds_the_file_at_its_path():
                return self
            # gc removed the file between our open and our flock: what we hold locks
            # nothing that the next writer would see, so lock the file now there
            self.lock.release()
            create_lock_file(self.lock.lock_file)

    def _holds_the_file_at_its_path(self) -> bool:
        """False if the locked file was unlinked or replaced (filelock 3.12 does not check that)."""
        fd = getattr(self.lock._context, "lock_file_fd", None)
        if fd is None:  # a filelock without this attribute: trust it
            return True
        try:
            return os.path.samestat(os.fstat(fd), os.lstat(self.lock.lock_file))
        except FileNotFoundError:
            return False

    def __exit__(self, *exc: object) -> None:
        self.lock.release()


def create_lock_file(path: str) -> int:
    """Create the lock file ``path`` (mode 0o666 less the umask, as a plain ``open``)
    unless it exists, never following a symlink: one planted there is an OSError, so
    that no writer truncates or locks the file it points to (filelock >= 3.20.1 opens
    it with O_NOFOLLOW too, which closes the window between this check and its open).
    Returns the file's mode bits."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o666)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise OSError(error.errno, f"The lock file {path} is a symlink (to {os.readlink(path)}): "
                          "refusing to follow it. Remove it; the next writer creates a new one.") from None
        if isinstance(error, PermissionError):
            raise parent_not_writable(error, path) from None
        raise
    try:
        mode = os.fstat(fd).st_mode
    finally:
        os.close(fd)
    if not stat.S_ISREG(mode):
        raise OSError(errno.EINVAL, f"The lock file {path} is not a regular file: remove it.")
    return stat.S_IMODE(mode)


def parent_not_writable(error: PermissionError, path: str) -> PermissionError:
    """``error`` (creating ``path``) reworded: the fix is a writable directory, not ``path``."""
    parent = os.path.dirname(path)
    return PermissionError(
        error.errno, f"Cannot create {path}: its directory {parent} is not writable by this "
        "process. An atomic write (atomic=True, an archive save, unpack_memmap) creates its "
        f"lock file and its new version beside the prefix, so {parent} must be writable: make "
        "it writable, or write elsewhere (a directory save in place: atomic=False)."
    )


def resolve(prefix) -> str:
    """``prefix`` made absolute, a symlink resolved to the directory it points to (what
    atomic=True replaces, see the module docstring).

    Raises:
        FileNotFoundError: ``prefix`` is a symlink to nothing.
    """
    prefix = os.path.abspath(os.fspath(prefix))
    if not os.path.islink(prefix):
        return prefix
    if not os.path.exists(prefix):
        raise FileNotFoundError(
            f"atomic=True: prefix {prefix} is a symlink to {os.readlink(prefix)}, which does "
            "not exist. Create that directory, or remove the symlink."
        )
    return os.path.realpath(prefix)


def check_target(prefix: str | None, *, existsok: bool) -> str:
    """Validate an atomic write's prefix before anything is written; returns what will
    be replaced (absolute, a symlink resolved: :func:`resolve`).

    Raises:
        ValueError: no prefix (and the tensordict has no directory of its own).
        FileNotFoundError: prefix is a symlink to nothing.
        NotADirectoryError: prefix is a file (or anything else but a directory).
        AtomicWriteError (a RuntimeError): prefix is a non-empty directory and
            existsok=False, or a non-empty directory that is not a saved tensordict
            (format.not_a_save says why).
    """
    if prefix is None:
        raise ValueError(
            "atomic=True needs a directory to write to: pass prefix= (this tensordict is "
            "not memory-mapped to a directory of its own)."
        )
    prefix = resolve(prefix)
    if os.path.lexists(prefix) and not os.path.isdir(prefix):
        what = "a file" if os.path.isfile(prefix) else "no directory"
        raise NotADirectoryError(f"atomic=True: prefix {prefix} is {what}, not a directory.")
    entries = sorted(os.listdir(prefix)) if os.path.isdir(prefix) else []
    if entries:
        if not existsok:
            raise AtomicWriteError(
                f"atomic=True with existsok=False: {prefix} is a non-empty directory. Pass "
                "existsok=True to replace it, or choose a new prefix."
            )
        why = fmt.not_a_save(prefix)
        if why is not None:
            raise AtomicWriteError(
                f"atomic=True would replace {prefix} as a whole, but it is not a saved "
                f"tensordict: {why}. It holds {_listing(prefix, entries)}. Nothing was "
                "touched: choose another prefix, or empty this one yourself."
            )
    return prefix


def _listing(directory: str, entries: list[str], shown: int = 8) -> str:
    """``a.txt, photos/, ... and 3 more``: the first entries, directories marked."""
    def named(entry: str) -> str:
        path = os.path.join(directory, entry)
        return entry + "/" if os.path.isdir(path) and not os.path.islink(path) else entry

    more = f" and {len(entries) - shown} more" if len(entries) > shown else ""
    return ", ".join(map(named, entries[:shown])) + more


class Staging:
    """The new directory of one atomic write, beside the prefix it will replace.

    Made as a plain ``os.mkdir`` of the prefix would be (mode 0o777 less the umask, the
    parent's setgid and group). When a directory is replaced, it takes that directory's
    group and setgid bit at once (so that what the write creates inside inherits them)
    and its exact mode in :meth:`finish`. Two descriptors stay reserved until the write
    ends, so that :meth:`discard` can remove the tree after a write that failed for lack
    of descriptors (:func:`remove_tree` needs two).
    """

    def __init__(self, prefix: str):
        self.prefix = prefix
        parent, name = os.path.split(prefix)
        os.makedirs(parent, exist_ok=True)
        start = f".{name}.{_TAG}-new-{os.getpid()}-"
        try:
            self.path = _new_directory(parent, start)
        except PermissionError as error:  # the lock file was there already: a bare EACCES
            raise parent_not_writable(error, os.path.join(parent, start + "*")) from None
        self.reserved: list[int] = []
        self.replaced: os.stat_result | None = None
        try:
            self.reserved.append(os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC))
            self.reserved.append(os.dup(self.reserved[0]))
            if os.path.isdir(prefix):
                self.replaced = os.lstat(prefix)
                self._take_group_and_setgid()
        except BaseException as error:
            self.discard(error)
            raise

    def _take_group_and_setgid(self) -> None:
        fd, old = self.reserved[0], self.replaced
        if os.fstat(fd).st_gid != old.st_gid:
            try:
                os.fchown(fd, -1, old.st_gid)
            except PermissionError:
                raise PermissionError(
                    errno.EPERM, f"atomic=True: {self.prefix} belongs to group {old.st_gid}, which "
                    "this process may not give to its new version (not a member), so other users "
                    "would lose their access. Write as a member of that group, or with atomic=False."
                ) from None
        # the owner may write until finish(): the final mode may not let it
        os.fchmod(fd, stat.S_IMODE(old.st_mode) | stat.S_IRWXU)

    def finish(self) -> None:
        """The tree is written: the replaced directory's exact mode, and the reserved
        descriptors freed for the swap and the removal of the old version."""
        if self.replaced is not None:
            os.fchmod(self.reserved[0], stat.S_IMODE(self.replaced.st_mode))
        self._release()

    def discard(self, error: BaseException) -> None:
        """Remove the staging tree after ``error``; a failure to do so becomes a note on it."""
        self._release()
        try:
            remove_tree(self.path)
        except OSError as failure:
            error.add_note(
                f"The staging directory {self.path} could not be removed: {failure}. Remove it, "
                f"or run shared_td.gc({self.prefix!r}) once this process has exited."
            )

    def _release(self) -> None:
        while self.reserved:
            os.close(self.reserved.pop())


def _new_directory(parent: str, start: str) -> str:
    """A new directory ``<parent>/<start><random>``, made by ``os.mkdir(path, 0o777)``
    as a plain makedirs would (tempfile.mkdtemp makes 0o700). The random part is hex:
    no dot, so parse_leftover_name finds the prefix's name."""
    for _ in range(100):
        path = os.path.join(parent, start + secrets.token_hex(6))
        try:
            os.mkdir(path, 0o777)
        except FileExistsError:
            continue
        return path
    raise FileExistsError(errno.EEXIST, f"No unused temporary directory name {start}* in {parent}")


def swap_into_place(staging: str, prefix: str) -> None:
    """Make ``staging`` the directory at ``prefix``; the old one (if any) is deleted.

    Uses RENAME_EXCHANGE so ``prefix`` always exists; falls back to two renames on
    filesystems that refuse it. The write has succeeded once the swap is made: an old
    version that cannot be deleted is a RuntimeWarning naming it, not an error.
    """
    if not os.path.lexists(prefix):
        os.rename(staging, prefix)
        return
    if rename_exchange(staging, prefix):
        retired = staging  # the old version now lives at the staging name
    else:
        parent, name = os.path.split(prefix)
        retired = tempfile.mkdtemp(prefix=f".{name}.{_TAG}-old-{os.getpid()}-", dir=parent)
        os.rename(prefix, os.path.join(retired, "tree"))
        os.rename(staging, prefix)
    try:
        remove_tree(retired)
    except OSError as error:
        warnings.warn(
            f"{prefix} was replaced, but its old version at {retired} could not be removed: "
            f"{error}. shared_td.gc({prefix!r}) removes it once this process has exited.",
            RuntimeWarning, stacklevel=2,
        )


def temporary_name(name: str) -> str:
    """A fresh name ``.<name>.shared_td-new-<pid>-<random>`` for a file written beside
    ``name`` and then renamed over it: if its writer is killed first, :func:`gc` of
    ``name`` (and the next archive write there) finds it by this name and removes it.

    Examples:
        >>> parse_leftover_name(temporary_name("td.bin")) == ("td.bin", os.getpid())
        True
    """
    return f".{name}.{_TAG}-new-{os.getpid()}-{secrets.token_hex(6)}"


def find_leftovers(prefix: str) -> list[str]:
    """Temporary directories of ``prefix`` whose writer process is gone (nothing removed).

    Only names of our own pattern in prefix's parent are considered, and a directory of
    a live writer (its pid still runs) is never one of them.
    """
    parent, name = os.path.split(os.path.abspath(prefix))
    try:
        entries = sorted(os.listdir(parent))
    except FileNotFoundError:
        return []
    found = []
    for entry in entries:
        pid = _writer_pid(entry, name)
        if pid is not None and not pid_alive(pid) and _is_ours(os.path.join(parent, entry)):
            found.append(os.path.join(parent, entry))
    return found


def find_stale_temporaries(prefix: str) -> list[str]:
    """Temporary files a killed (non-atomic) writer left inside the saved tree at
    ``prefix``: ``meta.json.<pid>.<thread>.tmp`` and the like, whose pid is gone.
    Symlinks are not followed; nothing is removed."""
    found = []
    for directory, subdirectories, names in os.walk(prefix):
        subdirectories.sort()
        for name in sorted(names):
            pid = fmt.temporary_writer_pid(name)
            if pid is not None and not pid_alive(pid):
                found.append(os.path.join(directory, name))
    return found


def sweep_leftovers(prefix: str) -> list[str]:
    """Remove temporary directories of ``prefix`` left by writers that died.

    If the writer died between the two renames of the fallback (``prefix`` missing),
    the old version it moved away is renamed back to ``prefix``. Call it while holding
    the prefix lock (``gc`` does). Returns what it removed; an OSError naming every
    leftover it could not remove (its ``removed`` attribute: what it did remove).
    """
    prefix = os.path.abspath(prefix)
    parent, name = os.path.split(prefix)
    removed, failed = [], []
    for path in find_leftovers(prefix):
        moved_away = os.path.join(path, "tree")
        try:
            if os.path.basename(path).startswith(f".{name}.{_TAG}-old-") \
                    and not os.path.lexists(prefix) and os.path.isdir(moved_away):
                # killed between the two renames of the fallback: the old version goes back
                os.rename(moved_away, prefix)
            remove_tree(path)
        except OSError as error:
            failed.append(f"{path} ({error})")
            continue
        removed.append(path)
    if failed:
        error = OSError(f"Could not remove the leftovers of dead writers of {prefix}: {'; '.join(failed)}")
        error.removed = removed
        raise error
    return removed


def gc(prefix: str, timeout: float | None = None, *, dry_run: bool = False,
       remove_lock: bool = False) -> list[str]:
    """Remove what killed writers of ``prefix`` left; returns the paths removed.

    The temporary directories of dead atomic writers (beside ``prefix``) and the
    temporary files of dead writers inside it (:func:`find_stale_temporaries`) are
    removed under the prefix lock (waiting at most ``timeout`` seconds for a running
    writer, then TimeoutError). With ``remove_lock=True`` the lock file ``.<name>.lock``
    goes too when no process holds it. ``dry_run=True`` removes nothing, takes no lock
    and returns what would go. A leftover that cannot be removed is an OSError naming it.
    For a symlinked prefix, both the link's and its target's neighbours are cleaned (an
    atomic write works beside the target; older versions worked beside the link).

    Examples:
        >>> _ = shared_td.TensorDict(a=torch.ones(2)).memmap_("data/buffer", atomic=True)
        >>> shared_td.gc("data/buffer")  # no writer was killed: nothing to remove
        []
        >>> [os.path.basename(p) for p in shared_td.gc("data/buffer", remove_lock=True, dry_run=True)]
        ['.buffer.lock']
    """
    prefix = os.path.abspath(os.fspath(prefix))
    found = []
    if os.path.islink(prefix):
        # beside the link: only what an older writer left (none writes there now)
        if find_leftovers(prefix):
            found += _gc_one(prefix, timeout, dry_run, remove_lock, inside=False)
        if not os.path.isdir(prefix):
            return found
        prefix = os.path.realpath(prefix)
    try:
        return found + _gc_one(prefix, timeout, dry_run, remove_lock, inside=True)
    except OSError as error:
        error.removed = found + getattr(error, "removed", [])
        raise


def _gc_one(prefix: str, timeout: float | None, dry_run: bool, remove_lock: bool,
            *, inside: bool) -> list[str]:
    """gc of one real path (``inside``: the temporary files within it too)."""
    lock_file = lock_path(prefix)
    stale = find_stale_temporaries if inside else (lambda _: [])
    if dry_run:
        found = find_leftovers(prefix) + stale(prefix)
        if remove_lock and os.path.lexists(lock_file) and not lock_is_held(lock_file):
            found.append(lock_file)
        return found
    existed = os.path.lexists(lock_file)  # else taking the lock creates it: not a leftover
    removed: list[str] = []
    # Nothing to remove and no lock file: none is created (a read-only parent is then no
    # error). An existing lock is taken (a running writer's is waited for, or TimeoutError:
    # the CLI's "skipped"); what is found is looked up again under it.
    if existed or find_leftovers(prefix) or stale(prefix):
        try:
            with acquired(prefix, timeout):
                removed += sweep_leftovers(prefix)
                for path in stale(prefix):
                    os.unlink(path)
                    removed.append(path)
        except OSError as error:  # what was removed before it, for the caller to report
            error.removed = removed + getattr(error, "removed", [])
            raise
    if remove_lock and remove_unheld_lock(lock_file) and existed:
        removed.append(lock_file)
    return removed


# Exactly the names our writers make, whole: gc deletes what matches, so a user's
# ".x.shared_td-new-4194000-mydata" must not. Staging and temporary_name end with 12 hex
# digits (secrets.token_hex(6)), the fallback's retired directory with tempfile.mkdtemp's
# 8 characters of [a-z0-9_] (and holds nothing but "tree": _is_ours).
_LEFTOVER_NAME = re.compile(
    rf"\.(?P<name>.+)\.{_TAG}-(?:new-(?P<new>[1-9][0-9]*)-[0-9a-f]{{12}}"
    rf"|old-(?P<old>[1-9][0-9]*)-[a-z0-9_]{{8}})",
    re.DOTALL,
)


def parse_leftover_name(entry: str) -> tuple[str, int] | None:
    """``(prefix name, writer pid)`` of a temporary's name exactly as our writers make
    it (:func:`temporary_name`, :class:`Staging`, :func:`swap_into_place`), else None.

    Examples:
        >>> parse_leftover_name(".buffer.shared_td-new-4242-0123456789ab")
        ('buffer', 4242)
        >>> parse_leftover_name(".buffer.shared_td-new-4242-mydata") is None
        True
    """
    match = _LEFTOVER_NAME.fullmatch(entry)
    return (match["name"], int(match["new"] or match["old"])) if match else None


def _writer_pid(entry: str, name: str) -> int | None:
    parsed = parse_leftover_name(entry)
    return parsed[1] if parsed is not None and parsed[0] == name else None


def _is_ours(path: str) -> bool:
    """A retired directory (``-old-``) holds nothing or the moved-away ``tree`` only:
    anything else in it is not what swap_into_place made, and stays."""
    if f".{_TAG}-old-" not in os.path.basename(path):
        return True
    try:
        return not os.path.islink(path) and set(os.listdir(path)) <= {"tree"}
    except OSError:
        return False
