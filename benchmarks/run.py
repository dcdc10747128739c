"""Side-by-side benchmarks: shared_td vs tensordict 0.15.3 vs the raw OS reference.

The cases live in the package (shared_td/bench/); this runner and ``shared-td bench``
take the same options.

Run:  python benchmarks/run.py [--quick] [--size-mib 256] [--repeat 5] [--only NAME]
"""
from __future__ import annotations

import argparse
import sys

from shared_td.bench import add_arguments, options_from_args, run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args()
    try:
        options = options_from_args(args)
    except ValueError as error:
        parser.error(str(error))
    return run(options)


if __name__ == "__main__":
    sys.exit(main())
