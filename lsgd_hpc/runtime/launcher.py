"""Moved to :mod:`lsgd_hpc.comm.launcher` (the launcher's environment belongs to the
communication layer); these names stay importable from here for older callers."""

from lsgd_hpc.comm.launcher import (SLURM_PORT_BASE, SLURM_PORT_SPAN, LaunchInfo, detect,
                                    env_rank, expand_hostlist, launch_method, launched_alone,
                                    launcher_size, launcher_world_size, local_rank,
                                    slurm_master, torch_store, world_on_one_host)

__all__ = ["LaunchInfo", "detect", "env_rank", "launched_alone", "local_rank",
           "launcher_world_size", "world_on_one_host", "launch_method", "launcher_size",
           "expand_hostlist", "slurm_master", "SLURM_PORT_BASE", "SLURM_PORT_SPAN",
           "torch_store"]
