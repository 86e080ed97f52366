"""`python -m lsgd_hpc.plan`: see lsgd_hpc/planning/plan.py."""

import sys

from lsgd_hpc.planning.plan import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
