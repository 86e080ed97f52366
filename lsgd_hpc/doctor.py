"""`python -m lsgd_hpc.doctor`: see lsgd_hpc/cli/doctor.py."""

import sys

from lsgd_hpc.cli.doctor import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
