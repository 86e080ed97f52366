"""DiLoCo: local SGD whose averaged displacement is the gradient of an outer optimizer."""

from __future__ import annotations

import copy
import math
from typing import Optional

import torch

from lsgd_hpc.comm import FlatParams, NodeGroups
from lsgd_hpc.methods.rules.base import Rule, MetricsSink

__all__ = ["DiLoCoRule"]


class DiLoCoRule(Rule):
    """DiLoCo (Douillard et al. 2023; as in torchft's DiLoCo and OpenDiLoCo).

    Inner loop: every worker takes ``local_steps`` (H) steps of its own optimizer, whose state
    stays local. Outer step at every step s with s mod H = 0, with x_prev the parameters after
    the last outer step (x_0 at the start):

        delta  = (1/p) sum_i (x_prev - x_i)       one allreduce of the pseudo-gradient
        x      <- x_prev;  outer SGD step on x with gradient delta;  x_prev <- x

    The outer optimizer is torch's SGD with ``outer_lr``, ``outer_momentum`` and
    ``outer_nesterov`` (DiLoCo's 0.7, 0.9, Nesterov; Nesterov with momentum 0 is plain SGD,
    so ``outer_nesterov`` is ignored then). With outer lr 1 and momentum 0 this is
    local SGD with T = H, up to rounding (x_prev - mean(x_prev - x_i) against mean(x_i)).
    The floating-point buffers after the parameters (BatchNorm running statistics) are not
    trained: they are averaged at the outer step, in the same allreduce as delta.
    x_prev and the outer momentum buffer are in ``state_dict``. ``optimizer`` (the inner one)
    is accepted for a uniform constructor and not used.
    """

    name = "diloco"
    extra_columns = {"train": {"outer_grad_norm": "f8"}}

    def __init__(self, groups: NodeGroups, flat: FlatParams, local_steps: int = 500,
                 outer_lr: float = 0.7, outer_momentum: float = 0.9, outer_nesterov: bool = True,
                 optimizer: Optional[torch.optim.Optimizer] = None,
                 log: Optional[MetricsSink] = None):
        super().__init__(groups, flat, log)
        self.H = local_steps
        self.outer_lr, self.outer_momentum = float(outer_lr), float(outer_momentum)
        self.outer_nesterov = bool(outer_nesterov)
        n = flat.n_params
        # x_prev as a parameter of the outer optimizer; its .grad receives delta
        self.prev = torch.nn.Parameter(flat.params.detach().clone(), requires_grad=False)
        self.prev.grad = torch.zeros_like(self.prev)
        self.outer_opt = torch.optim.SGD([self.prev], lr=self.outer_lr,
                                         momentum=self.outer_momentum,
                                         nesterov=self.outer_nesterov and self.outer_momentum > 0)
        # [delta | buffers]: one allreduce per outer step
        self.scratch = torch.empty_like(flat.flat)
        self.world.agree_buffers(self.scratch)
        self.n_params = n
        #: x_prev is taken again before the first step: the trainer broadcasts x_0 after
        #: building the method (a resumed run loads it from the checkpoint instead)
        self._anchor_pending = True
        self.outer_steps = 0
        self.last_grad_norm = math.nan

    def before_step(self, step: int) -> None:
        if self._anchor_pending:
            self.prev.data.copy_(self.flat.params)
            self._anchor_pending = False

    def after_step(self, step: int, loss: float) -> None:
        if step % self.H:
            return
        self._anchor_pending = False
        n, x, buf = self.n_params, self.flat.flat, self.scratch
        torch.sub(self.prev.data, x[:n], out=buf[:n])          # x_prev - x_i
        buf[n:].copy_(x[n:])                                   # BatchNorm statistics
        self.world.allreduce_(buf, "mean")
        self.prev.grad.copy_(buf[:n])                          # delta
        self.outer_opt.step()                                  # x_prev <- outer step
        x[:n].copy_(self.prev.data)
        x[n:].copy_(buf[n:])
        self.outer_steps += 1
        self.last_grad_norm = float(buf[:n].double().norm())

    def train_columns(self):
        return {"outer_grad_norm": self.last_grad_norm}

    def state_dict(self) -> dict:
        # a copy: the optimizer's own state_dict holds its live momentum buffer
        return {"prev": self.prev.data.clone(), "outer": copy.deepcopy(self.outer_opt.state_dict()),
                "outer_steps": self.outer_steps, "outer_grad_norm": self.last_grad_norm}

    def load_state_dict(self, state: dict) -> None:
        self.prev.data.copy_(state["prev"])
        self.outer_opt.load_state_dict(copy.deepcopy(state["outer"]))
        self.outer_steps = int(state.get("outer_steps", 0))
        self.last_grad_norm = float(state.get("outer_grad_norm", math.nan))
        self._anchor_pending = False
