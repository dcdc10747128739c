"""``shared-td verify PREFIX``: would this saved tensordict load, completely and safely?

Checked, from the meta.json files only (nothing is mapped or unpickled): every
meta.json passes the loader's own check (``node_meta.NodeMeta.from_json``: it parses, each
field has the right type, dtypes and devices are known, shapes fit the batch size and
no file could hold more), so a load refuses exactly what is reported here; every leaf
file it lists is a regular file (a FIFO, socket or device is never opened) holding at
least the bytes its shape and dtype need; no symlink anywhere (a symlink could lead out
of the directory, and the loader refuses them); files and directories no meta.json names
are warnings; in an archive, every member's data match its stored CRC-32. Paths and keys
are printed with control characters escaped and backslashes doubled (JSON holds them raw).
"""
from __future__ import annotations

import argparse
import dataclasses
import os

from shared_td.cli.common import human_bytes, plural, print_json, print_lines
from shared_td.cli.survey_report import survey_for_report
from shared_td.persist.survey import Survey

EPILOG = """examples:
  shared-td verify /data/buffer          a report; exit code 0 (ok, maybe warnings) or 1 (errors)
  shared-td verify --json /data/buffer   the same as JSON (keys: prefix, ok, totals, problems);
                                         also when PREFIX is no save: the reason is its problem
  shared-td verify -q /data/buffer && echo loads   only the exit code and the problems

Errors (exit code 1): what load_memmap refuses: a meta.json that is missing, not JSON
or has a bad field (named in the message), a batch size that does not fit its entries,
a leaf file that is missing, not a regular file or shorter than its shape and dtype
need, a nested tensor, any symlink; in an archive, a member whose data do not match
its checksum (a damaged index or an escaping member name is refused, as a load does).
Warnings (exit code 0): files or directories that no meta.json names (a leftover
temporary file, a stack member after a gap, a stale pickle).
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prefix", metavar="PREFIX", help="the directory or .tdz archive of a saved tensordict")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a report")
    parser.add_argument("-q", "--quiet", action="store_true",
                        help="print the problems only (nothing when there is none)")


def run(args: argparse.Namespace) -> int:
    # a PATH refused whole: one line on stderr, or with --json its one problem
    found, _ = survey_for_report(args.prefix, as_json=args.json)
    if args.json:
        print_json(as_json(found))
    else:
        lines = report_lines(found)
        if args.quiet:
            lines = lines[1:]
        if lines:
            print_lines(lines)
    return 1 if found.errors else 0


def as_json(found: Survey) -> dict:
    return {
        "prefix": found.prefix,
        "ok": not found.errors,
        "totals": found.totals(),
        "problems": [
            dict(dataclasses.asdict(p), absolute_path=os.path.normpath(os.path.join(found.prefix, p.path)))
            for p in found.problems
        ],
    }


def report_lines(found: Survey) -> list[str]:
    """A summary line, then one line per problem (errors first) with its full path."""
    totals = found.totals()
    checked = (
        f"{plural(totals['nodes'], 'node')}, {plural(totals['leaves'], 'leaf')} "
        f"({human_bytes(totals['bytes'])}), {plural(totals['non_tensor_values'], 'non-tensor value')}"
    )
    if not found.problems:
        summary = f"ok: {found.prefix}: {checked}"
    else:
        verdict = "FAILED" if found.errors else "ok"
        summary = (f"{verdict}: {found.prefix}: {plural(len(found.errors), 'error')}, "
                   f"{plural(len(found.warnings), 'warning')} ({checked})")
    width = max((len(p.severity) for p in found.problems), default=0)
    problems = [
        f"{p.severity:<{width}}  {os.path.join(found.prefix, p.path)}: {p.message}"
        for p in found.errors + found.warnings
    ]
    return [summary] + problems
