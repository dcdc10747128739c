"""Running the cases and printing the table; the options shared by both entry points.

``shared-td bench`` and ``python benchmarks/run.py`` take the same options
(``add_arguments``) and call ``run``.

Examples:
    >>> run(BenchOptions.quick(only=["tree_load"]))  # prints the machine, then the rows
    0
"""
from __future__ import annotations

import argparse
import dataclasses
import shutil
import tempfile
from typing import Callable

from shared_td.bench.cases_files import case_big_leaf, case_tree_anonymous, case_tree_load, case_tree_to_files
from shared_td.bench.cases_sharing import (
    case_atomic_rewrite,
    case_coord_attach,
    case_leaf_pickle,
    case_nontensor_read,
)
from shared_td.bench.libraries import comparison_note
from shared_td.bench.timing import describe_machine

CASES: dict[str, Callable[..., dict]] = {
    "big_leaf": case_big_leaf,
    "tree_to_files": case_tree_to_files,
    "tree_load": case_tree_load,
    "tree_anonymous": case_tree_anonymous,
    "leaf_pickle": case_leaf_pickle,
    "atomic_rewrite": case_atomic_rewrite,
    "coord_attach": case_coord_attach,
    "nontensor_read": case_nontensor_read,
}


@dataclasses.dataclass
class BenchOptions:
    """Sizes of the cases. The defaults are the full run; ``quick()`` a short one."""

    size_mib: int = 256  # the big leaf (and a quarter of it for atomic_rewrite)
    repeat: int = 5  # each number is the best of this many runs
    nodes: int = 1000  # nested tensordicts in the tree cases
    rounds: int = 200  # coordinator calls per timing (and 5x as many lock rounds)
    only: list[str] | None = None  # case names; None runs them all
    directory: str | None = None  # where the scratch directory goes (None: the temp dir)

    @classmethod
    def quick(cls, **overrides) -> "BenchOptions":
        """Small sizes, one run each: every case in well under a minute on 2 cores."""
        return cls(**{"size_mib": 16, "repeat": 1, "nodes": 100, "rounds": 20, **overrides})


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark options (defaults None: ``options_from_args`` fills them in)."""
    full = BenchOptions()
    parser.add_argument("--quick", action="store_true",
                        help="small sizes and one run of each case (under a minute on 2 cores)")
    parser.add_argument("--size-mib", type=int, help=f"size of the big leaf (default {full.size_mib})")
    parser.add_argument("--repeat", type=int, help=f"best of this many runs (default {full.repeat})")
    parser.add_argument("--nodes", type=int, help=f"nodes of the tree cases (default {full.nodes})")
    parser.add_argument("--rounds", type=int, help=f"calls per coordinator timing (default {full.rounds})")
    parser.add_argument("--only", choices=sorted(CASES), action="append", metavar="CASE",
                        help="run this case only (may be repeated): " + ", ".join(CASES))
    parser.add_argument("--dir", dest="directory", default=None,
                        help="where to write files (default: a temporary directory)")


def options_from_args(args: argparse.Namespace) -> BenchOptions:
    """The options given on the command line over the full (or --quick) defaults."""
    given = {field.name: getattr(args, field.name) for field in dataclasses.fields(BenchOptions)
             if getattr(args, field.name, None) is not None}
    for name in ("size_mib", "repeat", "nodes", "rounds"):
        if name in given and given[name] < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {given[name]}")
    return BenchOptions.quick(**given) if args.quick else BenchOptions(**given)


def run(options: BenchOptions, write: Callable[[str], None] = print) -> int:
    """Run the cases and write the table; 1 if a case failed (the others still run)."""
    root = tempfile.mkdtemp(prefix="shared_td_bench_", dir=options.directory)
    failed = 0
    try:
        write(describe_machine(root))
        note = comparison_note()
        if note:
            write(note)
        write(f"{'case':<16}{'column':<26}{'time':>10}{'vs first row':>14}")
        for name in options.only or CASES:
            try:
                results = CASES[name](options, root)
            except Exception as error:  # report it and go on: one broken case hides no other
                write(f"{name:<16}failed: {type(error).__name__}: {error}")
                failed += 1
                continue
            for line in table_rows(name, results):
                write(line)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 1 if failed else 0


def table_rows(name: str, results: dict) -> list[str]:
    """One line per column; times also as a ratio to the first (reference) column."""
    reference = next(iter(results.values()))
    rows = []
    for column, value in results.items():
        if isinstance(value, int):  # a count, not a time
            rows.append(f"{name:<16}{column:<26}{value:>10d}")
        else:
            rows.append(f"{name:<16}{column:<26}{readable_time(value):>10}{reference / value:>13.2f}x")
    return rows


def readable_time(seconds: float) -> str:
    """``seconds`` in the unit that shows it best.

    Examples:
        >>> readable_time(0.25), readable_time(0.00123), readable_time(2.5e-6)
        ('250.0 ms', '1.23 ms', '2.50 us')
    """
    unit, scale = next(((u, k) for u, k in (("s", 1.0), ("ms", 1e-3)) if seconds >= k), ("us", 1e-6))
    shown = seconds / scale
    return f"{shown:.1f} {unit}" if shown >= 100 else f"{shown:.2f} {unit}"
