"""Running the cases and printing the table; the options shared by both entry points.

``shared-td bench`` and ``python benchmarks/run.py`` take the same options
(``add_arguments``) and call ``run``.

Examples:
    >>> import contextlib, io
    >>> with contextlib.redirect_stdout(io.StringIO()) as table:  # the machine, then the rows
    ...     status = run(BenchOptions.quick(only=["tree_load"]))
    >>> status, [row.split()[:2] for row in table.getvalue().splitlines()[2:]]
    (0, [['tree_load', 'floor:'], ['tree_load', 'floor'], ['tree_load', 'shared_td'], ['tree_load', 'tensordict']])
"""
from __future__ import annotations

import argparse
import dataclasses
import shutil
import tempfile
from typing import Callable

from shared_td.bench.cases_cluster import SharedLoopback, case_cluster_counter, case_cluster_sync, sync_peers
from shared_td.bench.cases_cluster_push import case_cluster_push
from shared_td.bench.cases_cluster_values import case_cluster_value
from shared_td.bench.cases_consolidate import case_consolidate, case_consolidated_pickle
from shared_td.bench.cases_dist_batch import case_dist_batch
from shared_td.bench.cases_map import case_map
from shared_td.bench.cases_tree_walk import case_tree_walk
from shared_td.bench.cases_files import (
    case_big_leaf,
    case_tree_anonymous,
    case_tree_append,
    case_tree_archive,
    case_tree_load,
    case_tree_to_files,
)
from shared_td.bench.cases_replay import Rate, case_replay, case_replay_loader, case_replay_worker
from shared_td.bench.cases_sharing import (
    case_atomic_rewrite,
    case_coord_attach,
    case_leaf_pickle,
    case_nontensor_read,
    case_share_nontensor,
)
from shared_td.bench.libraries import comparison_note
from shared_td.bench.timing import describe_machine, frozen_heap
from shared_td.bench.worker import close_shared_worker, fork_shared_worker

CASES: dict[str, Callable[..., dict]] = {
    "big_leaf": case_big_leaf,
    "tree_to_files": case_tree_to_files,
    "tree_load": case_tree_load,
    "tree_anonymous": case_tree_anonymous,
    "tree_archive": case_tree_archive,
    "tree_append": case_tree_append,
    "leaf_pickle": case_leaf_pickle,
    "atomic_rewrite": case_atomic_rewrite,
    "coord_attach": case_coord_attach,
    "nontensor_read": case_nontensor_read,
    "share_nontensor": case_share_nontensor,
    "consolidate": case_consolidate,
    "consol_pickle": case_consolidated_pickle,
    "tree_walk": case_tree_walk,
    "map": case_map,
    "replay": case_replay,
    "replay_worker": case_replay_worker,
    "replay_loader": case_replay_loader,
    "cluster_sync": case_cluster_sync,
    "cluster_push": case_cluster_push,
    "cluster_counter": case_cluster_counter,
    "cluster_value": case_cluster_value,
    "dist_batch": case_dist_batch,
}

#: The cases that run jobs in the run's worker process (shared_td/bench/worker.py).
WORKER_CASES = frozenset({"share_nontensor", "consol_pickle", "replay_worker", "cluster_sync", "cluster_push"})
#: The cases that share the run's loopback cluster (cases_cluster.SharedLoopback).
LOOPBACK_CASES = frozenset({"cluster_counter", "cluster_value"})


@dataclasses.dataclass
class BenchOptions:
    """Sizes of the cases. The defaults are the full run; ``quick()`` a short one."""

    size_mib: int = 256  # the big leaf (and a quarter of it for atomic_rewrite)
    repeat: int = 5  # each number is the best of this many runs
    nodes: int = 1000  # nested tensordicts in the tree cases
    rounds: int = 200  # coordinator calls per timing (and 5x as many lock rounds, 10x replay calls)
    rows: int = 65536  # rows of the replay buffer
    only: list[str] | None = None  # case names; None runs them all
    directory: str | None = None  # where the scratch directory goes (None: the temp dir)
    # cluster_sync's reference ranks and the loopback cluster of cluster_counter and
    # cluster_value start with the run, so that their start overlaps the cases before
    # them, whose timings they may disturb: quick runs only
    early_peers: bool = False
    # the run's worker and those early ranks are forked at the start of the run, copies
    # of this process with its imports done (ms, not ~4 s of CPU each for a fresh
    # interpreter's imports). Only for a process that did nothing before the run: a fork
    # copies every lock as it is, e.g. one that a gloo thread of earlier work holds (the
    # command line sets it with --quick; a caller of run() in its own process spawns)
    fork: bool = False

    @classmethod
    def quick(cls, **overrides) -> "BenchOptions":
        """Small sizes, one run each: every case in about 10 s on 2 idle cores from the
        command line (which also sets ``fork``)."""
        return cls(**{"size_mib": 16, "repeat": 1, "nodes": 100, "rounds": 20, "early_peers": True, **overrides})


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark options (defaults None: ``options_from_args`` fills them in)."""
    full = BenchOptions()
    parser.add_argument("--quick", action="store_true",
                        help="small sizes and one run of each case (about 10 s on 2 idle cores)")
    parser.add_argument("--size-mib", type=int, help=f"size of the big leaf (default {full.size_mib})")
    parser.add_argument("--repeat", type=int, help=f"best of this many runs (default {full.repeat})")
    parser.add_argument("--nodes", type=int, help=f"nodes of the tree cases (default {full.nodes})")
    parser.add_argument("--rounds", type=int, help=f"calls per coordinator timing (default {full.rounds})")
    parser.add_argument("--rows", type=int, help=f"rows of the replay buffer (default {full.rows})")
    parser.add_argument("--only", choices=sorted(CASES), action="append", metavar="CASE",
                        help="run this case only (may be repeated): " + ", ".join(CASES))
    parser.add_argument("--dir", dest="directory", default=None,
                        help="where to write files (default: a temporary directory)")


def options_from_args(args: argparse.Namespace) -> BenchOptions:
    """The options given on the command line over the full (or --quick) defaults."""
    given = {field.name: getattr(args, field.name) for field in dataclasses.fields(BenchOptions)
             if getattr(args, field.name, None) is not None}
    for name in ("size_mib", "repeat", "nodes", "rounds", "rows"):
        if name in given and given[name] < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {given[name]}")
    # the command line's process has run nothing else: a quick run may fork (see fork)
    return BenchOptions.quick(**{"fork": True, **given}) if args.quick else BenchOptions(**given)


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
        with frozen_heap():  # the imports' objects: not rescanned before each timed run
            failed = _run_cases(options, root, write)
    finally:
        close_shared_worker()
        shutil.rmtree(root, ignore_errors=True)
    return 1 if failed else 0


def _run_cases(options: BenchOptions, root: str, write: Callable[[str], None]) -> int:
    """Run and write each case; the number that failed."""
    names = options.only or list(CASES)
    if options.fork and WORKER_CASES.intersection(names):  # before any case made a thread
        fork_shared_worker()
    peers = sync_peers(options) if options.early_peers and "cluster_sync" in names else None
    # after the forks: its nodes run threads and hold store connections
    loop = SharedLoopback(early=options.early_peers) if LOOPBACK_CASES.intersection(names) else None
    failed = 0
    try:
        for position, name in enumerate(names):
            try:
                extra = {"peers": peers} if name == "cluster_sync" and peers is not None else {}
                if name in LOOPBACK_CASES:
                    extra["loop"] = loop.get()  # its start's error is these cases' failure
                results = CASES[name](options, root, **extra)
            except Exception as error:  # report it and go on: one broken case hides no other
                write(f"{name:<16}failed: {type(error).__name__}: {error}")
                failed += 1
                continue
            finally:
                if loop is not None and not LOOPBACK_CASES.intersection(names[position + 1:]):
                    loop.close()  # its threads (a values poller at 1 kHz) run beside no later case
            for line in table_rows(name, results):
                write(line)
    finally:
        try:
            if loop is not None:
                loop.close()
        finally:
            if peers is not None:  # never reached cluster_sync (an interrupt): stopped, bounded
                peers.close()
    return failed


def table_rows(name: str, results: dict) -> list[str]:
    """One line per column; times also as a ratio to the first (reference) column
    (a rate as the inverse ratio: above 1 is always faster than the reference).

    A case whose results are ``{row: {column: value}}`` gets a grid instead (see
    ``grid_rows``).
    """
    reference = next(iter(results.values()))
    if isinstance(reference, dict):
        return grid_rows(name, results)
    rows = []
    for column, value in results.items():
        if isinstance(value, int):  # a count, not a time
            rows.append(f"{name:<16}{column:<26}{value:>10d}")
        else:
            speedup = value / reference if isinstance(value, Rate) else reference / value
            rows.append(f"{name:<16}{column:<26}{readable_value(value):>10}{speedup:>13.2f}x")
    return rows


def grid_rows(name: str, results: dict) -> list[str]:
    """A header naming the columns, then one line per row: each column's value, then
    shared_td's value divided by each other column's, as shown: for a time below 1 is
    faster, for a rate (N/s) above 1 is faster (higher is better).

    Example:
        >>> for line in grid_rows("replay", {"buf[i]": {"raw": 2e-6, "shared_td": 3e-6}}):
        ...     print(line)
        replay          operation                          raw   shared_td  shared_td/raw
        replay          buf[i]                         2.00 us     3.00 us          1.50x
    """
    columns = list(next(iter(results.values())))
    others = [column for column in columns if column != "shared_td"]
    ratio_names = [f"shared_td/{column}" for column in others] if "shared_td" in columns else []
    rows = [f"{name:<16}{'operation':<26}" + "".join(f"{c:>12}" for c in columns)
            + "".join(f"{r:>{max(15, len(r) + 2)}}" for r in ratio_names)]
    for row, values in results.items():
        line = f"{name:<16}{row:<26}" + "".join(f"{readable_value(values[c]):>12}" for c in columns)
        if ratio_names:
            ours = values["shared_td"]
            line += "".join(f"{ours / values[c]:>{max(15, len(r) + 2) - 1}.2f}x"
                            for c, r in zip(others, ratio_names))
        rows.append(line)
    return rows


def readable_value(value: float) -> str:
    """A time as ``readable_time`` shows it; a Rate as ``N/s``."""
    return f"{value:,.0f}/s" if isinstance(value, Rate) else readable_time(value)


def readable_time(seconds: float) -> str:
    """``seconds`` in the unit that shows it best.

    Examples:
        >>> readable_time(0.25), readable_time(0.00123), readable_time(2.5e-6)
        ('250.0 ms', '1.23 ms', '2.50 us')
    """
    unit, scale = next(((u, k) for u, k in (("s", 1.0), ("ms", 1e-3)) if seconds >= k), ("us", 1e-6))
    shown = seconds / scale
    return f"{shown:.1f} {unit}" if shown >= 100 else f"{shown:.2f} {unit}"
