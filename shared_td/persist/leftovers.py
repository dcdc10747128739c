"""The temporaries of atomic writers: their names, and removing those of dead writers.

* **Names**: temporary directories and files are named
  ``.<name>.shared_td-<kind>-<pid>-<rand>`` beside the prefix ``<name>`` (``<rand>``:
  12 hex digits, mkdtemp's 8 characters for ``old``; see persist/atomic.py for who makes
  each kind). Only names exactly of this form are ever touched (a user's
  ``.x.shared_td-new-1-mydata`` is not ours), and an ``-old-`` one only while it holds
  nothing but ``tree``.
* **Leftovers**: those of dead writers (their pid no longer runs) are removed by the
  next atomic write (under the lock) and by ``shared_td.gc(prefix)`` (a writer killed
  between the fallback's two renames leaves ``prefix`` missing until then: the sweep
  moves the old version back). Nothing outside prefix's parent directory is touched.
  ``gc`` returns only what it removed and raises an OSError naming a leftover it could
  not remove; with nothing to remove and no lock file it takes no lock (creates none: a
  read-only directory is no error). ``gc(prefix, remove_lock=True)`` (``shared-td gc``)
  also removes the lock file when no process holds it.
"""
from __future__ import annotations

import os
import re
import stat

from shared_td.persist import format as fmt
from shared_td.persist.format import lock_path, sibling_stem
from shared_td.persist.lock_probe import lock_is_held, remove_unheld_lock
from shared_td.persist.writer_lock import acquired
from shared_td.platform import pid_alive
# every tree this module removes is an atomic writer's own: see remove_own_tree
from shared_td.storage.removal import remove_own_tree as remove_tree

#: The word in the name of every temporary of ours (see the module docstring).
TAG = "shared_td"


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
    ``prefix``: ``meta.json.<pid>.<thread>.tmp`` and the like, and the new bytes of a
    leaf it staged (``.<NAME>.shared_td.<pid>.<thread>.tmp``, persist/writer.py), whose
    pid is gone (nothing of the save names them: its files are renamed over the old
    ones only at the commit). Only regular files; symlinks are not followed; nothing is
    removed."""
    found = []
    for directory, subdirectories, names in os.walk(prefix):
        subdirectories.sort()
        for name in sorted(names):
            pid = fmt.temporary_writer_pid(name)
            if pid is not None and not pid_alive(pid) and _is_regular(os.path.join(directory, name)):
                found.append(os.path.join(directory, name))
    return found


def _is_regular(path: str) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False


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
            if os.path.basename(path).startswith(f".{sibling_stem(name)}.{TAG}-old-") \
                    and not os.path.lexists(prefix) and os.path.isdir(moved_away):
                # killed between the two renames of the fallback: the old version goes back
                if _SHORTENED_STEM.fullmatch(name) and len(os.fsencode(name)) > 200:
                    # found by a scan from its siblings' names, whose start only is the
                    # prefix's (see sibling_stem): its name is unknown, so it stays
                    raise OSError("holds the old version of a prefix whose name is too long to "
                                  "read from it: run shared_td.gc() with that prefix")
                os.rename(moved_away, prefix)
            remove_tree(path)  # ours: a retired read-only save too
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
    and returns what would go. A leftover that cannot be removed is an OSError naming it
    (with ``removed``: what was removed before it).
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
                    try:
                        os.unlink(path)
                    except FileNotFoundError:  # (gone meanwhile: another gc's)
                        continue
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
    rf"\.(?P<name>.+)\.{TAG}-(?:new-(?P<new>[1-9][0-9]*)-[0-9a-f]{{12}}"
    rf"|old-(?P<old>[1-9][0-9]*)-[a-z0-9_]{{8}})",
    re.DOTALL,
)


# What sibling_stem makes of a name too long to be kept whole: its start, "~", 16 hex.
_SHORTENED_STEM = re.compile(r".+~[0-9a-f]{16}", re.DOTALL)


def parse_leftover_name(entry: str) -> tuple[str, int] | None:
    """``(prefix name, writer pid)`` of a temporary's name exactly as our writers make
    it (atomic.py's ``temporary_name``, ``Staging`` and ``swap_into_place``),
    else None.

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
    return parsed[1] if parsed is not None and parsed[0] == sibling_stem(name) else None


def _is_ours(path: str) -> bool:
    """A retired directory (``-old-``) holds nothing or the moved-away ``tree`` only:
    anything else in it is not what swap_into_place made, and stays."""
    if f".{TAG}-old-" not in os.path.basename(path):
        return True
    try:
        return not os.path.islink(path) and set(os.listdir(path)) <= {"tree"}
    except OSError:
        return False
