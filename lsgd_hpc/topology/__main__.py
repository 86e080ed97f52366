"""python -m lsgd_hpc.topology: see lsgd_hpc/topology/cli.py."""

import sys

from lsgd_hpc.topology.cli import main

if __name__ == "__main__":
    sys.exit(main())
