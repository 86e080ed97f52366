"""python -m lsgd_hpc.data: stage and check data sets (see lsgd_hpc/data/cli.py)."""

import sys

from lsgd_hpc.data.cli import main

if __name__ == "__main__":
    sys.exit(main())
