"""Communication layer: one narrow interface; mpi4py, Horovod and torch.distributed backends;
node groups by host name; the launcher's environment (launcher) and the collective monitor
(monitor).

Names are imported on first use, so that the launcher's environment
(``lsgd_hpc.comm.launcher``) and the monitor are read without loading torch or mpi4py.
"""

from __future__ import annotations

from lsgd_hpc._exports import lazy_getattr as _lazy_getattr, listed_dir as _listed_dir

#: public name -> module of this package that defines it
_EXPORTS = {
    "CommError": "base", "CommStats": "base", "Communicator": "base", "Election": "base",
    "Pending": "base", "Request": "base", "check_tensor": "base", "sanitize_score": "base",
    "uncounted": "accounting",
    "GradBuckets": "buckets", "FlatParams": "flat",
    "RANKS_PER_NODE_ENV": "groups", "NodeGroups": "groups", "node_layout": "groups",
}

__all__ = ["CommError", "CommStats", "Communicator", "Election", "FlatParams", "GradBuckets",
           "NodeGroups", "Pending", "RANKS_PER_NODE_ENV", "Request", "check_tensor",
           "make_world", "node_layout", "sanitize_score", "uncounted"]

__getattr__ = _lazy_getattr(globals(), _EXPORTS)
__dir__ = _listed_dir(globals())
del _lazy_getattr, _listed_dir


def make_world(backend: str = "mpi", *, device=None):
    """The world communicator of the chosen backend ('mpi', 'horovod' or 'torch').

    'torch' creates torch.distributed's default process group when none exists (gloo for
    CPU tensors, NCCL for CUDA ones; rendezvous from the launcher, see lsgd_hpc.comm.launcher);
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
    from lsgd_hpc.comm.base import CommError
    raise CommError(f"unknown backend {backend!r}; choose 'mpi', 'horovod' or 'torch'")
