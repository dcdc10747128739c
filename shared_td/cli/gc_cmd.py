"""``shared-td gc PATH``: remove what killed atomic writers left under PATH.

Two kinds of things, and nothing else:

* temporary directories ``.<name>.shared_td-{new,old}-<pid>-<random>`` whose writer
  process ``<pid>`` no longer runs (a running writer's are never touched);
* lock files ``.<name>.lock`` that no process holds (probed with a non-blocking flock),
  beside a saved tensordict ``<name>`` (a directory or an archive) or beside such
  directories (an archive writer's temporary directory is one of them). A lock file of
  a prefix that no longer exists is left alone: nothing says it is ours;
* inside a saved tensordict, the temporary files (``meta.json.<pid>.<thread>.tmp``, ...)
  of a writer ``<pid>`` killed while it rewrote the metadata in place, and the new bytes
  ``.<NAME>.shared_td.<pid>.<thread>.tmp`` it staged for a leaf ``NAME`` (a view written
  into its parent's own directory): renamed over ``NAME`` only at the commit, so nothing
  of the save names them.

PATH may be a saved tensordict itself, a directory or a ``.tdz`` archive: its leftovers
beside it are cleaned (an archive's lock ``.x.tdz.lock`` and the temporary files
``.x.tdz.shared_td-new-<pid>-<12 hex>`` of its dead writers).

Each prefix is cleaned by ``shared_td.gc(prefix, remove_lock=True)`` under its writer
lock; a prefix whose lock a running writer holds is skipped (that writer removes dead
writers' directories itself before it swaps). Only what was removed is listed as removed:
what could not be is listed as failed (exit code 1), and the other prefixes are cleaned.
"""
from __future__ import annotations

import argparse
import errno
import functools
import math
import os

from shared_td.cli.common import CommandError, UsageError, one_line, plural, print_json, print_lines
from shared_td.persist import format as fmt
from shared_td.persist import leftovers
from shared_td.persist.archive import is_memmap_archive
from shared_td.persist.lock_probe import lock_is_held

EPILOG = """examples:
  shared-td gc --dry-run /data       list what would be removed under /data
  shared-td gc /data                 remove it
  shared-td gc /data/buffer          a saved tensordict: also its own leftovers beside it
  shared-td gc /data/buffer.tdz      an archive: its leftovers beside it (.buffer.tdz.lock, ...)
  shared-td gc --wait 30 /data       wait up to 30 s for each running writer's lock

Leftovers live beside their prefix (/data/.buffer.shared_td-new-4242-3f9a0c1d2e4b for
/data/buffer), so PATH is usually the parent directory; its subdirectories are searched
too (symlinks are not followed); one that cannot be listed is reported as failed
(exit code 1): it may hold leftovers. When PATH itself is refused (missing, a symlink loop,
neither a directory nor an archive, permission denied), --json still prints the
document, with PATH as its one failure (exit code 1).
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", metavar="PATH",
                        help="a directory to search, or a saved tensordict (a directory or an archive)")
    parser.add_argument("--dry-run", action="store_true", help="list what would be removed; remove nothing")
    parser.add_argument("--wait", type=_seconds, default=0.0, metavar="SECONDS",
                        help="how long to wait for a running writer's lock (default 0: skip its prefix)")
    parser.add_argument("--json", action="store_true",
                        help="print JSON (keys: removed, skipped, failed, dry_run)")


def _seconds(text: str) -> float:
    """--wait's value: a finite number of seconds, 0 or more (else a usage error)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds, 0 or more, got {text!r}")
    return value


_seconds.__name__ = "seconds"  # argparse names the type in its error messages


def run(args: argparse.Namespace) -> int:
    if not math.isfinite(args.wait) or args.wait < 0:  # run() called without the parser
        raise UsageError(f"--wait must be a finite number of seconds, 0 or more, got {args.wait}")
    root = os.path.abspath(args.path)
    unlisted: list[OSError] = []
    try:
        prefixes = prefixes_to_clean(root, unlisted)
    except CommandError as error:
        if not args.json:
            raise  # one line on stderr
        # the document all the same (a script reading stdout always gets one), PATH
        # itself its one failure, in the words stderr would have shown; exit code 1
        _print_json(args.dry_run, [], [], [{"prefix": root, "error": one_line(error)}])
        return 1
    removed, skipped = [], []
    # a directory gc could not list may hold leftovers: a failure, not "0 removed"
    failed = [{"prefix": error.filename, "error": f"cannot list {error.filename}: {error.strerror}"}
              for error in unlisted]
    for prefix in prefixes:
        try:
            if not args.dry_run:
                removed += leftovers.gc(prefix, timeout=args.wait, remove_lock=True)
            elif lock_is_held(fmt.lock_path(prefix)):
                skipped.append(prefix)
            else:
                removed += leftovers.gc(prefix, dry_run=True, remove_lock=True)
        except TimeoutError as error:  # (what was removed before it, listed)
            removed += getattr(error, "removed", [])
            skipped.append(prefix)
        except OSError as error:  # a leftover that cannot be removed or looked for: said, not hidden
            removed += getattr(error, "removed", [])
            failed.append({"prefix": prefix, "error": str(error)})
    if args.json:
        _print_json(args.dry_run, removed, skipped, failed)
    else:
        print_lines(report_lines(removed, skipped, dry_run=args.dry_run, root=root, failed=failed))
    return 1 if failed else 0


def _print_json(dry_run: bool, removed: list[str], skipped: list[str], failed: list[dict]) -> None:
    print_json({"dry_run": dry_run, "removed": removed, "skipped": skipped, "failed": failed})


def prefixes_to_clean(root: str, unlisted: list[OSError]) -> list[str]:
    """The prefixes whose leftovers gc of PATH ``root`` (absolute) cleans: those under a
    directory (the errors of directories that cannot be listed appended to
    ``unlisted``), or an archive's own; a CommandError saying why for any other ``root``."""
    if os.path.isdir(root):
        return prefixes_under(root, unlisted)
    if os.path.isfile(root):
        # an archive: its leftovers (.x.tdz.lock, .x.tdz.shared_td-new-...) are beside
        # it; a damaged one's temporaries too (their names say whose they are)
        prefixes = [p for p in prefixes_in(os.path.dirname(root), unlisted) if p == root]
        if prefixes or is_memmap_archive(root):
            return prefixes
    raise CommandError(_not_searchable(root))


def _not_searchable(root: str) -> str:
    """Why ``root`` is no PATH for gc, and what to give instead."""
    fix = "give a directory to search or a saved tensordict (a directory or a .tdz archive)"
    try:
        info = os.stat(root)
    except OSError as error:
        if error.errno == errno.ELOOP:
            return f"{root} is a symlink loop (ELOOP: too many levels of symbolic links): fix or remove the link"
        if os.path.islink(root):
            return f"{root} is a symlink to {os.readlink(root)}, which does not exist: fix the link, or {fix}"
        if error.errno in (errno.ENOENT, errno.ENOTDIR):
            return f"No such directory: {root}"
        return f"cannot look at {root}: {error.strerror}"
    kind = fmt.file_kind(info.st_mode) or "a file but no saved tensordict archive"
    return f"{root} is {kind}, not a directory: {fix}"


def prefixes_under(root: str, unlisted: list[OSError] | None = None) -> list[str]:
    """Every prefix with leftovers or a lock file beside it, in ``root`` or below it.

    ``root`` itself counts when it is a saved tensordict (its leftovers are beside it).
    Temporary directories are not searched (they are copies of a tree) and symlinks
    are not followed. The error of each directory that cannot be listed is appended to
    ``unlisted`` (os.walk passes over them in silence otherwise), root's parent too
    when root is a save (its leftovers are there); one that vanished meanwhile holds
    nothing (a concurrent atomic rewrite replaces directories): no error.
    """
    found = []
    if os.path.isfile(os.path.join(root, fmt.META)):
        found += [p for p in prefixes_in(os.path.dirname(root), unlisted) if p == root]
    onerror = None if unlisted is None else functools.partial(_note_unlisted, unlisted)
    for directory, dirnames, names in os.walk(root, onerror=onerror):
        found += prefixes_in(directory, unlisted)
        if fmt.META in names and any(fmt.temporary_writer_pid(name) is not None for name in names):
            # gc of the save that holds it (under that save's lock) finds and checks them;
            # only in a node directory (a meta.json there): look-alike names elsewhere are
            # no writer's of ours (our writers stage only in existing nodes)
            found.append(_outermost_save(directory, root))
        dirnames[:] = sorted(d for d in dirnames if leftovers.parse_leftover_name(d) is None)
    return sorted(set(found))


def _outermost_save(directory: str, root: str) -> str:
    """The saved tensordict holding ``directory`` (a node directory of it, or itself):
    its outermost ancestor with a meta.json, not above ``root``."""
    top = directory
    while top != root:
        parent = os.path.dirname(top)
        if not os.path.isfile(os.path.join(parent, fmt.META)):
            break
        top = parent
    return top


def _note_unlisted(unlisted: list[OSError], error: OSError) -> None:
    """Keep the error of a directory that could not be listed, unless it is gone."""
    if not isinstance(error, (FileNotFoundError, NotADirectoryError)):
        unlisted.append(error)


def prefixes_in(directory: str, unlisted: list[OSError] | None = None) -> list[str]:
    """Prefixes in ``directory`` with atomic writers' directories or a lock file beside them.

    Names are parsed only (nothing is checked for being dead or stale). A lock file
    counts only beside a saved tensordict or an archive (a ``.x.lock`` of another program
    is not ours). A ``directory`` that cannot be listed (permission denied) has its error
    appended to ``unlisted`` (raised without it); one that is gone holds none.
    """
    try:
        entries = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []
    except OSError as error:
        if unlisted is None:
            raise
        unlisted.append(error)
        return []
    found = set()
    for entry in entries:
        parsed = leftovers.parse_leftover_name(entry)
        if parsed is not None:
            found.add(os.path.join(directory, parsed[0]))
        elif (name := fmt.prefix_of_lock(entry)) is not None:
            prefix = os.path.join(directory, name)
            if os.path.isfile(os.path.join(prefix, fmt.META)) or is_memmap_archive(prefix):
                found.add(prefix)
    return sorted(found)


def report_lines(removed: list[str], skipped: list[str], *, dry_run: bool, root: str,
                 failed: list[dict] = ()) -> list[str]:
    verb = "would remove" if dry_run else "removed"
    lines = [f"{verb}  {path}  ({_what(path)})" for path in removed]
    lines += [f"skipped {prefix}: a running writer holds its lock {fmt.lock_path(prefix)}"
              for prefix in skipped]
    lines += [f"failed  {failure['prefix']}: {failure['error']}" for failure in failed]
    count = plural(len(removed), "leftover")
    lines.append(f"{count} {'to remove' if dry_run else 'removed'} under {root}"
                 + (f", {plural(len(skipped), 'prefix')} in use" if skipped else "")
                 + (f", {plural(len(failed), 'prefix')} failed" if failed else ""))
    return lines


def _what(path: str) -> str:
    parsed = leftovers.parse_leftover_name(os.path.basename(path))
    if parsed is not None:
        return f"temporary directory of dead writer pid {parsed[1]}"
    writer = fmt.temporary_writer_pid(os.path.basename(path))
    if writer is not None:
        return f"temporary file of dead writer pid {writer}"
    return "lock file no process holds"
