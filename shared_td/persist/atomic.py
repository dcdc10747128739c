"""Atomic rewrites of a prefix: a sibling directory, a file lock, a swap.

``memmap_(prefix, atomic=True)`` writes the whole tree into a new directory next to
``prefix`` and then swaps it in, so a failure or a SIGKILL at any moment leaves ``prefix``
as it was or as the new complete version.

* **What may be replaced**: a missing or empty directory, or one whose meta.json is a
  save of tensordict or shared_td (:func:`shared_td.persist.format.not_a_save`: it parses,
  its ``_type`` is known and the fields of that type are there). Anything else is a
  :class:`~shared_td.errors.AtomicWriteError` (a RuntimeError) naming the prefix and what
  it holds, and nothing is touched.
* **Lock**: writers of one prefix serialise on ``.<name>.lock`` beside it
  (writer_lock.py); readers rely on the rename alone.
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
  These trees are shared_td's own: one that is read-only (the retired version of a
  read-only save, whose mode the new version also takes) gets owner ``rwx`` on its
  directories of this user to be emptied (``storage.removal.remove_own_tree``).
* **Leftovers**: temporary directories and files are named
  ``.<name>.shared_td-<kind>-<pid>-<rand>``: ``new`` for a :class:`Staging` directory
  and a :func:`temporary_name` file, ``old`` for the fallback's retired directory
  (:func:`swap_into_place`). Those of dead writers are removed by the next atomic
  write (under the lock) and by ``shared_td.gc(prefix)``; only names exactly of this
  form are ever touched (leftovers.py). Writing needs prefix's parent directory
  writable (lock file, staging directory): a PermissionError says so, naming it.
* **Not durable**: files are not synced, so this guards against a killed process, not
  a power failure.
"""
from __future__ import annotations

import errno
import os
import secrets
import stat
import tempfile
import warnings

from shared_td.errors import AtomicWriteError
from shared_td.persist import format as fmt
from shared_td.persist.format import lock_path, sibling_stem
from shared_td.persist.leftovers import TAG as _TAG
from shared_td.persist.leftovers import find_leftovers, gc, parse_leftover_name, sweep_leftovers
from shared_td.persist.writer_lock import acquired, parent_not_writable, prefix_lock
from shared_td.platform import rename_exchange
from shared_td.storage.fd_mapping import descriptor_limits
# every tree this module removes is its own (staging, retired versions): see remove_own_tree
from shared_td.storage.removal import remove_own_tree as remove_tree

__all__ = [
    "Staging", "check_target", "resolve", "swap_into_place", "temporary_name",
    # the writer lock (writer_lock.py) and the leftovers (leftovers.py), which the
    # writers and ``shared_td.gc`` reach through this module
    "acquired", "lock_path", "parent_not_writable", "prefix_lock",
    "find_leftovers", "gc", "parse_leftover_name", "sweep_leftovers",
]


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
        start = f".{sibling_stem(name)}.{_TAG}-new-{os.getpid()}-"
        try:
            self.path = _new_directory(parent, start)
        except PermissionError as error:  # the lock file was there already: a bare EACCES
            raise parent_not_writable(error, os.path.join(parent, start + "*")) from None
        self.reserved: list[int] = []
        self.replaced: os.stat_result | None = None
        try:
            try:
                self.reserved.append(os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC))
                self.reserved.append(os.dup(self.reserved[0]))
            except OSError as error:  # (os.dup's error names nothing)
                if error.errno not in (errno.EMFILE, errno.ENFILE):
                    raise
                raise OSError(error.errno, (
                    f"atomic=True: cannot reserve the two descriptors that a write into {self.path} "
                    f"(the new version of {prefix}) keeps until it ends: {error.strerror}. "
                    f"{descriptor_limits(error.errno)}")) from None
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
            remove_tree(self.path)  # (finish() may have made it read-only)
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
        retired = tempfile.mkdtemp(prefix=f".{sibling_stem(name)}.{_TAG}-old-{os.getpid()}-", dir=parent)
        os.rename(prefix, os.path.join(retired, "tree"))
        os.rename(staging, prefix)
    try:
        # our own directory now, holding the old version with its modes: a read-only
        # save's directories are made writable to be emptied (else each rewrite of it
        # left a whole copy behind, which gc could not remove either)
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
    return f".{sibling_stem(name)}.{_TAG}-new-{os.getpid()}-{secrets.token_hex(6)}"
