"""The survey that ``inspect`` and ``verify`` print, a PATH refused whole included.

The survey refuses a PATH whole when it is missing, a symlink loop or a dangling
symlink, neither a directory nor an archive, cannot be looked at (permission denied),
or holds no saved tensordict (its root meta.json missing, not JSON, not a regular file,
failing its checksum, not a save). Without ``--json`` that is one line on stderr (exit
code 1). With ``--json`` the command's document is printed all the same, so that a
script reading stdout always gets one: no tree (inspect's is null, all totals are 0)
and one error, at the path it concerns (``"meta.json"``, or ``"."`` for PATH itself),
in the words stderr would have shown (:func:`~shared_td.cli.common.one_line`). The
exit code stays 1. (``gc --json`` follows the same rule with its own keys.)
"""
from __future__ import annotations

import os

from shared_td.cli.common import one_line
from shared_td.cli.progress_line import ProgressLine
from shared_td.errors import FormatError
from shared_td.persist.saved_tree import Entry, Problem
from shared_td.persist.survey import Survey, survey


def survey_for_report(prefix: str, *, as_json: bool) -> tuple[Survey, bool]:
    """``(survey(prefix), False)``; for a --json report, a PATH the survey refuses whole
    gives ``(refused(prefix, error), True)`` (without --json its error is raised, for
    ``main`` to print on stderr)."""
    progress = ProgressLine("checking the archive's data")  # (on a terminal only)
    try:
        return survey(prefix, progress), False
    except (OSError, FormatError) as error:
        if not as_json:
            raise
        return refused(prefix, error), True
    finally:
        progress.close()


def refused(prefix: str, error: Exception) -> Survey:
    """The survey of a prefix that ``survey`` refused whole: no tree, one error (the
    path it concerns, as the survey named it, and the reason).

    Examples:
        >>> found = refused("data/missing", FileNotFoundError("No such directory: data/missing"))
        >>> found.errors[0].path, found.errors[0].message, found.totals()["nodes"]
        ('.', 'No such directory: data/missing', 0)
    """
    path = getattr(error, "survey_path", os.curdir)
    root = Entry("", "none", "", class_name="?")  # no node read: all totals 0
    return Survey(os.path.abspath(os.fspath(prefix)), root, [Problem("error", path, one_line(error))])
