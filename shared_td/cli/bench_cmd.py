"""``shared-td bench``: the benchmark table (shared_td vs tensordict 0.15.3 vs the raw OS)."""
from __future__ import annotations

import argparse

from shared_td.bench import add_arguments as add_bench_arguments
from shared_td.bench import options_from_args, run as run_bench
from shared_td.cli.common import UsageError

EPILOG = """examples:
  shared-td bench --quick                     every case, small sizes, one run each
  shared-td bench --only big_leaf --only tree_load
  shared-td bench --size-mib 1024 --repeat 3 --dir /mnt/nvme   the full run, elsewhere
  shared-td bench --only replay --only replay_worker --only replay_loader   the RL hot paths

Each number is the best of --repeat runs; "vs first row" is the first row of the case
divided by this one (above 1: faster than the reference). The replay cases show one row
per operation with a column per library and shared_td's value divided by each other
column's: for a time below 1 means shared_td is faster, for a rate (N/s, the DataLoader
row) above 1 does (higher is better). tensordict is optional: when it is not
installed its rows are left out. Exit code 1 if a case failed.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_bench_arguments(parser)


def run(args: argparse.Namespace) -> int:
    try:
        options = options_from_args(args)
    except ValueError as error:
        raise UsageError(str(error)) from None
    return run_bench(options)
