"""Synchronous EASGD without a parameter server: every worker holds the same centre."""

from __future__ import annotations

import torch

from lsgd_hpc.comm import FlatParams, NodeGroups
from lsgd_hpc.methods.rules.base import Rule

__all__ = ["EASGDRule"]


class EASGDRule(Rule):
    """Elastic averaging SGD (Zhang, Choromanska, LeCun 2015), synchronous.

    Every ``tau`` steps, with the centre c identical on every worker:
        d_i = alpha (x_i - c);   x_i <- x_i - d_i;   c <- c + sum_i d_i   (one allreduce)
    c starts at the common x_0. The centre is EASGD's model: it is evaluated beside each
    worker's own (with BatchNorm statistics recomputed on training batches first, since no
    worker trained the centre; see the trainer's --bn-recompute).
    """

    name = "easgd"
    extra_columns = {"eval": {"center_test_loss": "f8", "center_test_accuracy": "f8"}}
    shared_state = ("center",)

    def __init__(self, groups: NodeGroups, flat: FlatParams, alpha: float, tau: int, log=None):
        super().__init__(groups, flat, log)
        self.alpha, self.tau = alpha, tau
        self.center = flat.flat.detach().clone()
        self.d = torch.empty_like(self.center)
        self.world.agree_buffers(self.d)

    def after_step(self, step: int, loss: float) -> None:
        if step % self.tau:
            return
        x, c, d = self.flat.flat, self.center, self.d
        torch.sub(x, c, out=d).mul_(self.alpha)          # d_i = alpha (x_i - c)
        x.sub_(d)
        self.world.allreduce_(d, "sum")                   # d <- sum_i d_i
        c.add_(d)

    def eval_models(self):
        return {"center": self.center}

    def rejoin(self, world, joined: bool, source: int) -> str:
        if joined:
            self.flat.flat.copy_(self.center)
        return "the centre and a fresh optimizer state"
