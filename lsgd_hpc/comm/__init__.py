"""Communication layer: one narrow interface, an mpi4py backend and a Horovod backend."""

from .base import (CommError, CommStats, Communicator, Election, Pending, Request, check_tensor,
                   sanitize_score)
from .buckets import GradBuckets
from .flat import FlatParams
from .groups import RANKS_PER_NODE_ENV, NodeGroups, node_layout

__all__ = ["CommError", "CommStats", "Communicator", "Election", "FlatParams", "GradBuckets",
           "NodeGroups", "Pending", "RANKS_PER_NODE_ENV", "Request", "check_tensor",
           "make_world", "node_layout", "sanitize_score"]


def make_world(backend: str = "mpi") -> Communicator:
    """The world communicator of the chosen backend ('mpi' or 'horovod')."""
    if backend == "mpi":
        from .mpi import MPICommunicator
        return MPICommunicator()
    if backend == "horovod":
        from .horovod import HorovodCommunicator
        return HorovodCommunicator()
    raise CommError(f"unknown backend {backend!r}; choose 'mpi' or 'horovod'")
