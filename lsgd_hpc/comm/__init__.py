"""Communication layer: one narrow interface; mpi4py, Horovod and torch.distributed backends."""

from lsgd_hpc.comm.base import (CommError, CommStats, Communicator, Election, Pending, Request,
                                check_tensor, sanitize_score)
from lsgd_hpc.comm.buckets import GradBuckets
from lsgd_hpc.comm.flat import FlatParams
from lsgd_hpc.comm.groups import RANKS_PER_NODE_ENV, NodeGroups, node_layout

__all__ = ["CommError", "CommStats", "Communicator", "Election", "FlatParams", "GradBuckets",
           "NodeGroups", "Pending", "RANKS_PER_NODE_ENV", "Request", "check_tensor",
           "make_world", "node_layout", "sanitize_score"]


def make_world(backend: str = "mpi", *, device=None) -> Communicator:
    """The world communicator of the chosen backend ('mpi', 'horovod' or 'torch').

    'torch' creates torch.distributed's default process group when none exists (gloo for
    CPU tensors, NCCL for CUDA ones; rendezvous from the launcher, see lsgd_hpc.runtime.launcher);
    ``device`` (torch only): this rank's GPU, bound to the process group for NCCL."""
    if backend == "mpi":
        from lsgd_hpc.comm.mpi import MPICommunicator
        return MPICommunicator()
    if backend == "horovod":
        from lsgd_hpc.comm.horovod import HorovodCommunicator
        return HorovodCommunicator()
    if backend == "torch":
        from lsgd_hpc.comm.torchdist import TorchCommunicator
        return TorchCommunicator(device=device)
    raise CommError(f"unknown backend {backend!r}; choose 'mpi', 'horovod' or 'torch'")
