"""`python -m lsgd_hpc.aggregate`: see lsgd_hpc/analysis/aggregate.py."""

import sys

from lsgd_hpc.analysis.aggregate import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
