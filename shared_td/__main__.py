"""``python -m shared_td <command>``: see shared_td.cli."""
import sys

from shared_td.cli import main

if __name__ == "__main__":
    sys.exit(main())
