"""Side-by-side benchmarks: shared_td vs tensordict 0.15.3 vs the raw OS reference.

Every case is measured in the same run and the table shows ratios, so the noise of a
shared machine affects all columns alike. Each number is the best of ``repeat`` runs.
Run them with ``shared-td bench`` or ``python benchmarks/run.py`` (same options);
tensordict is optional (its columns are left out, with a note, when it is missing).

Examples:
    >>> import contextlib, io
    >>> from shared_td.bench import BenchOptions, run
    >>> with contextlib.redirect_stdout(io.StringIO()) as table:  # the machine, then the rows
    ...     status = run(BenchOptions.quick(only=["big_leaf"]))
    >>> status, table.getvalue().splitlines()[1].split()
    (0, ['case', 'column', 'time', 'vs', 'first', 'row'])
"""
from shared_td.bench.runner import CASES, BenchOptions, add_arguments, options_from_args, run

__all__ = ["CASES", "BenchOptions", "add_arguments", "options_from_args", "run"]
