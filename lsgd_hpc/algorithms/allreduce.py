"""Allreduce SGD: gradients averaged over all workers every step, replicas stay identical."""

from __future__ import annotations

from ..comm import FlatParams, NodeGroups
from .base import Algorithm

__all__ = ["AllreduceSGD"]


class AllreduceSGD(Algorithm):
    """Synchronous data parallel SGD, as Horovod's DistributedOptimizer and PyTorch DDP:
        g <- (1/p) sum_i g_i   (one allreduce over the fused gradient buffer)
    then every worker takes the same step. Floating-point buffers (BatchNorm statistics) are
    broadcast from rank 0 each step, as DDP does, so that replicas stay bit-identical.
    The consensus distance, zero by construction, is probed at every ``consensus_every``
    step as a check.
    """

    name = "allreduce"

    def __init__(self, groups: NodeGroups, flat: FlatParams, consensus_every: int = 0, log=None):
        super().__init__(groups, flat, log)
        self.consensus_every = consensus_every
        self.buffers = flat.flat[flat.n_params:]

    def before_step(self, step: int) -> None:
        self.world.allreduce_(self.flat.grad, "mean")

    def after_step(self, step: int, loss: float) -> None:
        if self.buffers.numel():
            self.world.broadcast_(self.buffers, 0)
        if self.consensus_every and step % self.consensus_every == 0:
            self.probe_consensus(step)
