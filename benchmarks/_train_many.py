"""Run several `python -m lsgd_hpc.train` command lines one after another in one MPI job (saves start-ups)."""

from __future__ import annotations

import json
import sys


def main() -> int:
    with open(sys.argv[1]) as fh:
        argvs = json.load(fh)
    from lsgd_hpc.cli import train
    for argv in argvs:
        code = train.main(argv)
        if code != 0:
            print(f"_train_many: {' '.join(argv)} exited {code}", file=sys.stderr, flush=True)
            return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
