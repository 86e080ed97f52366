"""Allreduce SGD: gradients averaged over all workers every step, replicas stay identical."""

from __future__ import annotations

from lsgd_hpc.comm import FlatParams, GradBuckets, NodeGroups
from lsgd_hpc.methods.rules.base import Rule
from lsgd_hpc.methods.rules.state import REPLICA

__all__ = ["AllreduceRule"]


class AllreduceRule(Rule):
    """Synchronous data parallel SGD, as Horovod's DistributedOptimizer and PyTorch DDP:
        g <- (1/p) sum_i g_i   (allreduce of the fused gradient buffer)
    then every worker takes the same step. With ``bucket_bytes > 0`` the buffer is averaged
    in buckets of about that size whose non-blocking allreduces start from gradient hooks
    during backward (see :class:`~lsgd_hpc.comm.GradBuckets`) and complete in
    ``before_step``; with 0, one blocking allreduce of the whole buffer after backward.
    Either way the same bytes move and every rank gets the same mean.
    Floating-point buffers (BatchNorm statistics) are broadcast from rank 0 each step, as
    DDP does, so that replicas stay bit-identical (their consensus distance, measured by the
    trainer as for every method, is zero).
    """

    name = "allreduce"
    #: the replicas (parameters, buffers, optimizer state) are bit-identical
    shared_state = (REPLICA,)

    def __init__(self, groups: NodeGroups, flat: FlatParams, log=None, bucket_bytes: int = 0):
        super().__init__(groups, flat, log)
        self.buffers = flat.flat[flat.n_params:]
        self.buckets = GradBuckets(self.world, flat, bucket_bytes) if bucket_bytes > 0 else None

    def before_step(self, step: int) -> None:
        if self.buckets is not None:
            self.buckets.finish()
        else:
            self.world.allreduce_(self.flat.grad, "mean")

    def after_step(self, step: int, loss: float) -> None:
        if self.buffers.numel():
            self.world.broadcast_(self.buffers, 0)

    def suspend(self, complete: bool, recovery) -> None:
        """The gradient averaging cut off is not redone (a survivor's own gradient is gone:
        the in-place allreduce overwrote it); the source's replica is taken instead."""
        if self.buckets is not None:
            self.buckets.abandon()
        return None

    def rejoin(self, world, joined: bool, source: int) -> str:
        return f"the replica of rank {source} (parameters and optimizer state)"
