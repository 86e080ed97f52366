"""`mpirun -np N python -m lsgd_hpc.netprobe`: see lsgd_hpc/planning/netprobe.py."""

import sys

from lsgd_hpc.planning.netprobe import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
