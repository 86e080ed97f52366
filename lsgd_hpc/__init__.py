"""lsgd_hpc: Leader SGD and baselines for distributed training on MPI clusters."""

__version__ = "0.1.0"
