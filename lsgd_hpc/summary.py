"""`python -m lsgd_hpc.summary`: see lsgd_hpc/analysis/summary.py."""

import sys

from lsgd_hpc.analysis.summary import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
