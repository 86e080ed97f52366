"""`python -m lsgd_hpc.train` (and `srun --mpi=pmix python -m lsgd_hpc.train`): the trainer,
lsgd_hpc/cli/train.py, a user of the public library API."""

from lsgd_hpc.cli.train import main, run_as_main

__all__ = ["main"]

if __name__ == "__main__":
    run_as_main()
