"""Leader SGD: each worker is pulled toward the best worker, its node's and the global one."""

from __future__ import annotations

import math
from collections import deque
from typing import Optional

import torch

from ..comm import Election, FlatParams, NodeGroups
from .base import Algorithm, MetricsSink

__all__ = ["LeaderSGD", "window_score"]

GLOBAL, LOCAL = 0, 1


def window_score(losses) -> float:
    """A worker's score: the mean of its last K minibatch losses (+inf before any)."""
    return sum(losses) / len(losses) if losses else math.inf


class LeaderSGD(Algorithm):
    """Multi-leader LSGD (Teng et al.), synchronous.

    Every ``tau_local`` steps, inside each node:   x_i <- x_i - c_L (x_i - x_l(node))
    Every ``tau_global`` steps, over all workers:   x_i <- x_i - c_G (x_i - x_L)
    where a leader is the member with the lowest score (mean of its last K minibatch
    losses), elected with one MINLOC reduction; the leader's own pull is zero. When both
    fall on one step the local pull comes first. With one node, or one rank per node, the
    local level is the global one and only the global pull runs (single-leader LSGD).
    The global leader's parameters cross node boundaries once per node
    (NodeGroups.broadcast_from_). Momentum buffers are the worker's own and are not pulled.
    After each global pull the consensus distance is probed (one uncounted allreduce).
    """

    name = "lsgd"

    def __init__(self, groups: NodeGroups, flat: FlatParams, tau_local: int, tau_global: int,
                 pull_local: float, pull_global: float, window: int,
                 log: Optional[MetricsSink] = None):
        super().__init__(groups, flat, log)
        if tau_local < 1 or tau_global < 1 or tau_global % tau_local:
            raise ValueError("tau_global must be a positive multiple of tau_local")
        self.tau_local, self.tau_global = tau_local, tau_global
        self.pull_local, self.pull_global = pull_local, pull_global
        self.losses: deque = deque(maxlen=window)
        self.leader_buf = torch.empty_like(flat.flat)
        self.multi_level = 1 < groups.n_nodes < groups.world.size
        self.last_global: Optional[Election] = None

    def score(self) -> float:
        return window_score(self.losses)

    def after_step(self, step: int, loss: float) -> None:
        self.losses.append(float(loss))
        score = self.score()
        if self.multi_level and step % self.tau_local == 0:
            el = self.groups.node.elect(score)
            self._log(step, LOCAL, el, score)
            self._pull(el.world_rank, self.pull_local,
                       lambda t: self.groups.node.broadcast_(t, el.rank))
        if step % self.tau_global == 0:
            el = self.groups.world.elect(score)
            self.last_global = el
            self._log(step, GLOBAL, el, score)
            self._pull(el.world_rank, self.pull_global,
                       lambda t: self.groups.broadcast_from_(t, el.world_rank))
            self.probe_consensus(step)

    def _pull(self, leader: int, c: float, broadcast) -> None:
        x, xl = self.flat.flat, self.leader_buf
        is_leader = self.world.world_rank == leader
        if is_leader:
            xl.copy_(x)
        broadcast(xl)
        if not is_leader and c > 0:
            x.sub_(x - xl, alpha=c)      # x <- x - c (x - x_L)

    def _log(self, step: int, scope: int, el: Election, score: float) -> None:
        self.log("leader", step=step, scope=scope, leader_rank=el.world_rank, score=score)

    def state_dict(self) -> dict:
        return {"losses": list(self.losses)}

    def load_state_dict(self, state: dict) -> None:
        self.losses.clear()
        self.losses.extend(float(v) for v in state["losses"])
