"""SlowMo: local SGD with a slow momentum step on the averaged model."""

from __future__ import annotations

import math
from typing import Optional

import torch

from lsgd_hpc.comm import FlatParams, NodeGroups
from lsgd_hpc.methods.rules.base import Rule, MetricsSink
from lsgd_hpc.methods.rules.local_sgd import FlatAverage

__all__ = ["SlowMoRule"]


class SlowMoRule(Rule):
    """Slow momentum (Wang, Tantia, Ballas, Rabbat 2019; fairscale's
    SlowMoDistributedDataParallel), over local SGD.

    Base: local SGD with period ``local_steps`` (T): every T steps x_i <- (1/p) sum_j x_j
    (one allreduce of the whole flat buffer, BatchNorm statistics included; T = 1 averages
    every step). Every ``slowmo_every`` steps (a multiple of T, so the base has just averaged),
    with gamma the learning rate of the optimizer's (first) param group and x_old the
    parameters after the last slow step (x_0 at the start):

        u     <- beta u + (x_old - x) / gamma
        x_old <- x_old - alpha gamma u
        x     <- x_old

    on the parameters (the averaged BatchNorm statistics stay as they are). u is computed in
    fairscale's order, u.mul_(beta).sub_(x, alpha=1/gamma).add_(x_old, alpha=1/gamma).
    With beta = 0 and alpha = 1 this is the base, up to rounding. The slow step needs no
    communication of its own. u and x_old are in ``state_dict``.

    With ``topk`` < 1 on the world the base's average goes through a reference r
    (:class:`~lsgd_hpc.methods.rules.local_sgd.FlatAverage`): r is the common x after the
    last round, after the slow step when one was taken (its parameters are then x_old), so
    x_old alone cannot stand for it between slow steps; r is shared state (``reference``).
    """

    name = "slowmo"
    shared_state = ("old", "u", "u_norm")
    extra_columns = {"train": {"slowmo_u_norm": "f8"}}

    def __init__(self, groups: NodeGroups, flat: FlatParams, local_steps: int = 1,
                 slowmo_every: int = 48, slowmo_beta: float = 0.5, slowmo_alpha: float = 1.0,
                 optimizer: Optional[torch.optim.Optimizer] = None,
                 log: Optional[MetricsSink] = None):
        super().__init__(groups, flat, log)
        self.T, self.every = local_steps, slowmo_every
        self.beta, self.alpha = float(slowmo_beta), float(slowmo_alpha)
        self.optimizer = optimizer
        self.averaging = FlatAverage(self.world, flat)
        self.shared_state = self.averaging.shared(type(self).shared_state)
        self.old = flat.params.detach().clone()          # x_old
        self.u = torch.zeros_like(self.old)               # slow momentum buffer
        #: x_old is taken again before the first step (the trainer broadcasts x_0 after
        #: building the method; a resumed run loads it from the checkpoint instead)
        self._anchor_pending = True
        self.last_u_norm = math.nan

    def gamma(self) -> float:
        """The learning rate of the step just taken (the trainer sets it before each step)."""
        return float(self.optimizer.param_groups[0]["lr"])

    def before_step(self, step: int) -> None:
        self.averaging.anchor()
        if self._anchor_pending:
            self.old.copy_(self.flat.params)
            self._anchor_pending = False

    def after_step(self, step: int, loss: float) -> None:
        if step % self.T:
            return
        self._anchor_pending = False
        self.averaging.average()                          # the base: local SGD
        if step % self.every:
            return
        gamma = self.gamma()
        if not gamma > 0:
            raise ValueError(f"SlowMo needs a learning rate > 0 at its slow step, got {gamma}")
        xp = self.flat.params
        self.u.mul_(self.beta).sub_(xp, alpha=1 / gamma).add_(self.old, alpha=1 / gamma)
        self.old.sub_(self.u, alpha=self.alpha * gamma)
        xp.copy_(self.old)
        self.averaging.settle()
        self.last_u_norm = float(self.u.double().norm())

    def train_columns(self):
        return {"slowmo_u_norm": self.last_u_norm}

    def state_dict(self) -> dict:
        return self.averaging.save({"old": self.old.clone(), "u": self.u.clone(),
                                    "u_norm": self.last_u_norm})

    def load_state_dict(self, state: dict) -> None:
        self.old.copy_(state["old"])
        self.u.copy_(state["u"])
        self.last_u_norm = float(state.get("u_norm", math.nan))
        self._anchor_pending = False
        self.averaging.load(state, "slowmo")

    def rejoin(self, world, joined: bool, source: int) -> str:
        if joined:
            self.flat.params.copy_(self.old)
        return "x_old (the last slow step's parameters) and a fresh optimizer state"
